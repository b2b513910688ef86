//! `Communicator`: a joined communicator, posting ops on shared-memory buffers (`post`) and
//! stream-ordered GPU ops (`post_cuda`, and `cuda_op`, the torch backend's fast path), with its
//! GPU-path queries and `close`.

#![allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)

use std::sync::Arc;

use commd_client::desc::{DType, OpKind, RedOp};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::buffer::Buffer;
use crate::convert::{pacing, parse_dtype, parse_kind, parse_redop};
use crate::error::{AbortedError, to_py};
use crate::request::{CuStream, CudaRequest, Request, Stash};

/// A communicator handle; destroyed by `close()` or when garbage-collected.
#[pyclass(module = "commd._native", frozen)]
pub(crate) struct Communicator {
    pub(crate) inner: std::sync::Mutex<Option<Arc<commd_client::Communicator>>>,
    pub(crate) rank: u32,
    pub(crate) nranks: u32,
    pub(crate) stash: Arc<Stash>,
}

/// Bits of `cuda_op`'s flags (see `cuda_code`).
const CUDA_DEFER_WAIT: u64 = 1;
const CUDA_ORDER_AFTER: u64 = 2;
const CUDA_RECORD: u64 = 4;

impl Communicator {
    fn get(&self) -> PyResult<Arc<commd_client::Communicator>> {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| AbortedError::new_err("this communicator was closed"))
    }
}

type Loc<'py> = Option<(Bound<'py, Buffer>, u64)>;

#[pymethods]
impl Communicator {
    #[getter]
    fn rank(&self) -> u32 {
        self.rank
    }

    #[getter]
    fn nranks(&self) -> u32 {
        self.nranks
    }

    /// Nodes (daemons) the communicator spans; above 1, its GPU ops are staged through host
    /// memory by the daemons (docs/multinode.md).
    #[getter]
    fn nodes(&self) -> PyResult<u32> {
        Ok(self.get()?.nodes())
    }

    /// The daemon's id for this communicator (as shown in error messages and `commd status`).
    #[getter]
    fn id(&self) -> PyResult<u64> {
        Ok(self.get()?.id())
    }

    /// How the communicator's data moves on this node, one line per path, as the daemon
    /// described it at init.
    #[getter]
    fn paths(&self) -> PyResult<Vec<String>> {
        Ok(self.get()?.paths().to_vec())
    }

    /// Whether two of the communicator's ranks on this node are one process, as the daemon
    /// said at init.
    #[getter]
    fn ranks_share_a_process(&self) -> PyResult<bool> {
        Ok(self.get()?.ranks_share_a_process())
    }

    /// Caps the daemon's GPU copies for this communicator at `gbps` GB/s (None or 0:
    /// uncapped), for every rank on this node, from the next copy phase on.
    #[pyo3(signature = (gbps))]
    fn set_pacing(&self, py: Python<'_>, gbps: Option<f64>) -> PyResult<()> {
        let rate = pacing(gbps, "gbps")?;
        let comm = self.get()?;
        py.detach(|| comm.set_pacing(rate)).map_err(to_py)
    }

    /// Posts one op. `send`/`recv` are `(Buffer, byte_offset)` or None; `peer` is the root
    /// (broadcast, reduce) or the peer (send, recv). Returns a `Request`, which keeps the
    /// buffers alive until it completes. Do not touch the bytes the op uses until then.
    #[pyo3(signature = (op, dtype, count, send=None, recv=None, redop=None, peer=0))]
    #[allow(clippy::too_many_arguments)]
    fn post<'py>(
        &self,
        py: Python<'py>,
        op: &str,
        dtype: &str,
        count: u64,
        send: Loc<'py>,
        recv: Loc<'py>,
        redop: Option<&str>,
        peer: u32,
    ) -> PyResult<Request> {
        let kind = parse_kind(op)?;
        let dtype = parse_dtype(dtype)?;
        let redop = redop.map(parse_redop).transpose()?;
        let comm = self.get()?;
        let sb = send.as_ref().map(|(b, o)| (b.get().inner.clone(), *o));
        let rb = recv.as_ref().map(|(b, o)| (b.get().inner.clone(), *o));
        let args = commd_client::OpArgs {
            kind,
            dtype,
            redop,
            count,
            peer,
            send: sb.as_ref().map(|(b, o)| (&**b, *o)),
            recv: rb.as_ref().map(|(b, o)| (&**b, *o)),
        };
        // SAFETY: the Request keeps both buffers' registrations alive until it is dropped, and
        // the ownership rule (documented here and in the Python API) forbids touching the bytes
        // the op uses until it completes.
        let req = py
            .detach(|| unsafe { comm.post_detached(args) })
            .map_err(to_py)?;
        let mut keep = Vec::new();
        keep.extend(sb.map(|(b, _)| b));
        keep.extend(rb.map(|(b, _)| b));
        Ok(Request {
            inner: Arc::new(req),
            _keep: keep,
            _comm: comm,
        })
    }

    /// Posts a stream-ordered GPU op: `send`/`recv` are device addresses (e.g.
    /// `tensor.data_ptr()`) or None, `stream` a CUDA stream handle (e.g.
    /// `torch.cuda.Stream().cuda_stream`) of the tensors' device. The op runs when `stream`
    /// reaches it; work enqueued on `stream` afterwards sees its results. The CPU does not wait.
    /// The caller keeps the tensors alive until the returned Request completes. `defer_wait`
    /// (send/recv only): the stream waits at the next `cuda_flush` instead (send/recv groups).
    #[pyo3(signature = (op, dtype, count, stream, send=None, recv=None, redop=None, peer=0, defer_wait=false))]
    #[allow(clippy::too_many_arguments)]
    fn post_cuda(
        &self,
        py: Python<'_>,
        op: &str,
        dtype: &str,
        count: u64,
        stream: usize,
        send: Option<u64>,
        recv: Option<u64>,
        redop: Option<&str>,
        peer: u32,
        defer_wait: bool,
    ) -> PyResult<Request> {
        let args = commd_client::gpu::CudaOpArgs {
            kind: parse_kind(op)?,
            dtype: parse_dtype(dtype)?,
            redop: redop.map(parse_redop).transpose()?,
            count,
            peer,
            send,
            recv,
            stream: stream as commd_cuda::sys::CUstream,
            defer_wait,
            after: None,
            record: false,
            // The torch backend's send/recv keep the daemon's path (CudaOpArgs::p2p_direct).
            p2p_direct: false,
            span: None,
        };
        let comm = self.get()?;
        let c = comm.clone();
        // SAFETY: the Python caller (commd.torch) keeps the tensors alive until the request
        // completes and passes a live stream of the tensors' device; `stream` is an integer
        // handle from torch, validated by the driver before anything is posted.
        let req = py
            .detach(move || unsafe { c.post_cuda(args) })
            .map_err(to_py)?;
        Ok(Request {
            inner: Arc::new(req),
            _keep: Vec::new(),
            _comm: comm,
        })
    }

    /// The op code for `cuda_op` (compute once, reuse): the op, dtype and reduction, and
    /// flags: `defer_wait` (send/recv groups, as in `post_cuda`), `order_after` (the op's stream
    /// first waits, on the GPU, for the work queued on the `after` stream), `record` (record an
    /// event after the op, which `CudaRequest.cuda_wait` makes another stream wait on).
    #[staticmethod]
    #[pyo3(signature = (op, dtype, redop=None, defer_wait=false, order_after=true, record=true))]
    fn cuda_code(
        op: &str,
        dtype: &str,
        redop: Option<&str>,
        defer_wait: bool,
        order_after: bool,
        record: bool,
    ) -> PyResult<u64> {
        let kind = parse_kind(op)?;
        let dt = parse_dtype(dtype)?;
        let red = redop.map(parse_redop).transpose()?;
        let flags = (if defer_wait { CUDA_DEFER_WAIT } else { 0 })
            | (if order_after { CUDA_ORDER_AFTER } else { 0 })
            | (if record { CUDA_RECORD } else { 0 });
        Ok(u64::from(kind.code())
            | u64::from(dt.code()) << 16
            | red.map_or(0, |r| u64::from(r.code()) + 1) << 24
            | flags << 32)
    }

    /// The per-op GPU path in one call (the torch backend's fast path): posts op `code` (from
    /// `cuda_code`) of `count` elements with `peer` (root or peer rank); `ptrs` is `(send,
    /// recv, stream, after)`: device addresses (0: none), the stream the op runs on, and the
    /// stream it is ordered after (with `order_after`). `keep` (e.g. the tensors) stays
    /// referenced until the daemon reports the op done. Returns a `CudaRequest`.
    #[pyo3(signature = (code, peer, count, ptrs, keep=None))]
    fn cuda_op(
        &self,
        py: Python<'_>,
        code: u64,
        peer: u32,
        count: u64,
        ptrs: (u64, u64, usize, usize),
        keep: Option<Py<PyAny>>,
    ) -> PyResult<CudaRequest> {
        let bad = || PyValueError::new_err(format!("invalid cuda_op code {code:#x}"));
        let kind = OpKind::from_code((code & 0xffff) as u16).ok_or_else(bad)?;
        let dtype = DType::from_code(((code >> 16) & 0xff) as u8).ok_or_else(bad)?;
        let redop = match ((code >> 24) & 0xff) as u8 {
            0 => None,
            r => Some(RedOp::from_code(r - 1).ok_or_else(bad)?),
        };
        let flags = code >> 32;
        let (send, recv, stream, after) = ptrs;
        let args = commd_client::gpu::CudaOpArgs {
            redop,
            peer,
            send: (send != 0).then_some(send),
            recv: (recv != 0).then_some(recv),
            defer_wait: flags & CUDA_DEFER_WAIT != 0,
            after: (flags & CUDA_ORDER_AFTER != 0).then_some(after as CuStream),
            record: flags & CUDA_RECORD != 0,
            ..commd_client::gpu::CudaOpArgs::new(kind, dtype, count, stream as CuStream)
        };
        let comm = self.get()?;
        self.stash.reap(py);
        let c = comm.clone();
        // SAFETY: the caller (commd.torch) passes live streams of the tensors' device and
        // device addresses of tensors it keeps alive through `keep` (released only once the
        // daemon reports the op done); the driver validates the stream before anything is
        // posted.
        let posted = py
            .detach(move || unsafe { c.post_cuda_ordered(args) })
            .map_err(to_py)?;
        let req = Arc::new(posted.request);
        // A captured op's buffers live as long as the graph's memory (the graph keeps them at
        // fixed addresses; the daemon holds its own mapping): holding the tensors until its
        // registration completes would keep graph-pool memory alive that torch's graph trees
        // expect freed.
        if let Some(k) = keep
            && !posted.captured
        {
            self.stash.push(req.clone(), k);
        }
        Ok(CudaRequest {
            inner: req,
            comm,
            stream,
            device: posted.device,
            deferred: args.defer_wait && kind.is_p2p(),
            captured: posted.captured,
            last_ticket: posted.last_ticket,
            bytes: posted.bytes,
            done: std::sync::Mutex::new(posted.done),
            stash: self.stash.clone(),
        })
    }

    /// Enqueues on `stream` the wait for the deferred send/recv ops of this communicator.
    fn cuda_flush(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let comm = self.get()?;
        // SAFETY: `stream` is a live stream handle from the caller (torch).
        py.detach(move || unsafe { comm.cuda_flush(stream as commd_cuda::sys::CUstream) })
            .map_err(to_py)
    }

    /// Raises the failure of a replay of a GPU op captured into a CUDA graph on this
    /// communicator since the last check (every GPU op posted on it checks first, too).
    fn cuda_graph_check(&self, py: Python<'_>) -> PyResult<()> {
        let comm = self.get()?;
        py.detach(move || comm.cuda_graph_check()).map_err(to_py)
    }

    /// How all-reduces captured into CUDA graphs run on this communicator: "direct",
    /// "daemon: <why not direct>" or "undecided" (docs/design-gpu.md: persistent ops, direct collectives).
    fn cuda_graph_path(&self) -> PyResult<String> {
        Ok(self.get()?.cuda_graph_path())
    }

    /// How small eager GPU collectives run on this communicator: "direct", "daemon: <why
    /// not>" or "undecided" (docs/design-gpu.md, direct collectives rule 8, COMMD_EAGER_DIRECT).
    fn cuda_eager_path(&self) -> PyResult<String> {
        Ok(self.get()?.cuda_eager_path())
    }

    /// Why the daemon holds this communicator broken for good, as (status, reason): status is
    /// "peer_lost", "timeout", "mismatch", "aborted", "revoked", "shutdown", "invalid" or
    /// "internal".
    /// None while it works. One round trip to the daemon.
    fn failure(&self, py: Python<'_>) -> PyResult<Option<(String, String)>> {
        let comm = self.get()?;
        let f = py.detach(|| comm.failure()).map_err(to_py)?;
        Ok(f.map(|(s, m)| (commd_client::desc::status::name(s).to_string(), m)))
    }

    /// Revokes the communicator for every rank: their queued and later ops fail with
    /// `RevokedError` naming this rank and `reason`; it can still be shrunk.
    #[pyo3(signature = (reason=""))]
    fn revoke(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        let comm = self.get()?;
        py.detach(|| comm.revoke(reason)).map_err(to_py)
    }

    /// A child without the parent ranks in `exclude`, ranks renumbered in order (NCCL's
    /// ncclCommShrink): every surviving rank calls it with the same list; no unique id. With
    /// `abort`, this communicator is revoked first; else this rank's ops on it finish first.
    #[pyo3(signature = (exclude, abort=false, op_timeout=None, join_timeout=None, name=None))]
    fn shrink(
        &self,
        py: Python<'_>,
        exclude: Vec<u32>,
        abort: bool,
        op_timeout: Option<f64>,
        join_timeout: Option<f64>,
        name: Option<String>,
    ) -> PyResult<Communicator> {
        let comm = self.get()?;
        let o = commd_client::ShrinkOptions {
            abort,
            comm: commd_client::CommOptions {
                op_timeout: crate::convert::duration(op_timeout, "op_timeout")?,
                join_timeout: crate::convert::duration(join_timeout, "join_timeout")?,
                name,
                ..Default::default()
            },
        };
        let c = py.detach(|| comm.shrink(&exclude, o)).map_err(to_py)?;
        Ok(Communicator {
            rank: c.rank(),
            nranks: c.nranks(),
            inner: std::sync::Mutex::new(Some(Arc::new(c))),
            stash: Arc::default(),
        })
    }

    /// The status code of a failed GPU op on this communicator since the last call, or None.
    fn cuda_take_error(&self) -> PyResult<Option<u32>> {
        Ok(self.get()?.cuda_take_error())
    }

    /// Destroys the communicator now (the other ranks' later ops fail with "peer lost").
    fn close(&self, py: Python<'_>) {
        let c = self.inner.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.detach(move || drop(c));
        let live = std::mem::take(&mut *self.stash.live.lock().unwrap_or_else(|e| e.into_inner()));
        let failed =
            std::mem::take(&mut *self.stash.failed.lock().unwrap_or_else(|e| e.into_inner()));
        drop((live, failed));
    }

    /// (ops whose objects `cuda_op` still keeps, failed ops' kept objects): for tests.
    fn cuda_stash_len(&self, py: Python<'_>) -> (usize, usize) {
        self.stash.reap(py);
        (
            self.stash
                .live
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .len(),
            self.stash
                .failed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .len(),
        )
    }
}
