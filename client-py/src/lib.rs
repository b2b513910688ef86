//! `commd._native`: the Python bindings over `commd-client`.
//!
//! This layer is deliberately thin: sessions, communicators, shared-memory buffers (exposed
//! through the buffer protocol, so numpy and torch view them without a copy), op posting and
//! requests. Staging of arbitrary arrays, the numpy-level API and the torch backend live in the
//! Python package (`python/commd`). Every blocking call releases the GIL and wakes up every
//! 100 ms to deliver signals (Ctrl-C interrupts a wait; the op itself keeps running).

#![deny(unsafe_code)] // allowed only in the modules that say why
// cast/unwrap lints: fixed in the next change
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::unwrap_used
)]

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use commd_client::desc::{DType, OpKind, RedOp};
use commd_client::{Error, OpErrorKind};
use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyException, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

create_exception!(
    _native,
    CommError,
    PyException,
    "Base class of every commd error."
);
create_exception!(
    _native,
    DaemonUnavailableError,
    CommError,
    "The commd daemon could not be reached (the message names the socket and how to start it)."
);
create_exception!(
    _native,
    DaemonLostError,
    CommError,
    "The daemon went away (exited or closed this session) while the client used it."
);
create_exception!(
    _native,
    MismatchError,
    CommError,
    "Ranks posted different collectives (op, dtype, count, root or reduction) at the same step."
);
create_exception!(
    _native,
    PeerLostError,
    CommError,
    "A rank of the communicator died or left."
);
create_exception!(
    _native,
    CommTimeoutError,
    CommError,
    "Some ranks never posted the op (or never joined) within the timeout."
);
create_exception!(
    _native,
    ShutdownError,
    CommError,
    "The daemon is shutting down."
);
create_exception!(
    _native,
    AbortedError,
    CommError,
    "The communicator was aborted by an earlier error or destroyed."
);
create_exception!(
    _native,
    InvalidOpError,
    CommError,
    "The daemon refused the op's arguments (bounds, dtype, reduction)."
);
create_exception!(
    _native,
    UnsupportedError,
    CommError,
    "commd cannot do this correctly yet (e.g. a GPU op during CUDA graph capture): refused."
);

/// Converts a client error to the matching Python exception.
fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match &e {
        Error::DaemonUnavailable { .. } => DaemonUnavailableError::new_err(msg),
        Error::DaemonLost { .. } => DaemonLostError::new_err(msg),
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::Unsupported(_) => UnsupportedError::new_err(msg),
        _ => match e.op_kind() {
            Some(OpErrorKind::Mismatch) => MismatchError::new_err(msg),
            Some(OpErrorKind::PeerLost) => PeerLostError::new_err(msg),
            Some(OpErrorKind::Timeout) => CommTimeoutError::new_err(msg),
            Some(OpErrorKind::Shutdown) => ShutdownError::new_err(msg),
            Some(OpErrorKind::Aborted) => AbortedError::new_err(msg),
            Some(OpErrorKind::Invalid) => InvalidOpError::new_err(msg),
            Some(OpErrorKind::Internal) | None => CommError::new_err(msg),
        },
    }
}

/// Seconds (None: no limit) to a Duration, refusing negative and non-finite values.
fn duration(secs: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match secs {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, got {s}"
        ))),
    }
}

/// A GPU pacing cap in GB/s (1e9 bytes/s) as bytes/s: `None` stays `None`, 0 means uncapped;
/// negative, non-finite and nonzero values below the daemon's minimum (1 MB/s) are refused here
/// (the daemon checks the minimum too, for every client).
fn pacing(gbps: Option<f64>, what: &str) -> PyResult<Option<u64>> {
    let min = commd_client::MIN_PACING_BYTES_PER_SEC;
    match gbps {
        None => Ok(None),
        Some(g) if !g.is_finite() || g < 0.0 => Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of GB/s (0 or None: uncapped), got {g}"
        ))),
        // `as` saturates: absurdly large caps become u64::MAX bytes/s, i.e. no limit in effect.
        Some(g) => match (g * 1e9).round() as u64 {
            b if b > 0 && b < min => Err(PyValueError::new_err(format!(
                "{what}={g} GB/s is below the minimum of {} GB/s (1 MB/s); the cap is in GB/s, and 0 or None means uncapped",
                min as f64 / 1e9
            ))),
            b => Ok(Some(b)),
        },
    }
}

/// A session with the local daemon.
#[pyclass(module = "commd._native", frozen)]
struct Client {
    inner: commd_client::Client,
}

#[pymethods]
impl Client {
    /// Connects to the daemon at `socket` (default: `$COMMD_SOCKET`, else the per-user path).
    #[new]
    #[pyo3(signature = (socket=None, name=None))]
    fn new(py: Python<'_>, socket: Option<PathBuf>, name: Option<String>) -> PyResult<Self> {
        let mut o = commd_client::Options::default();
        if let Some(n) = name {
            o.name = n;
        }
        let c = py
            .detach(|| commd_client::Client::connect_with(socket.as_deref(), o))
            .map_err(to_py)?;
        Ok(Self { inner: c })
    }

    /// The daemon socket this session uses.
    #[getter]
    fn socket(&self) -> String {
        self.inner.socket().display().to_string()
    }

    #[getter]
    fn session_id(&self) -> u64 {
        self.inner.session_id()
    }

    /// A fresh 128-byte communicator id, to hand to every rank.
    fn unique_id<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let id = py.detach(|| self.inner.unique_id()).map_err(to_py)?;
        Ok(PyBytes::new(py, &id))
    }

    /// Joins communicator `unique_id` as `rank` of `nranks`; returns once every rank joined.
    /// `pacing_gbps`: cap on the daemon's GPU copies for it, GB/s (None: the daemon's default,
    /// 0: uncapped).
    #[pyo3(signature = (unique_id, rank, nranks, op_timeout=None, join_timeout=None, switch=None, pacing_gbps=None))]
    #[allow(clippy::too_many_arguments)] // the Python keyword arguments, one to one
    fn communicator(
        &self,
        py: Python<'_>,
        unique_id: &[u8],
        rank: u32,
        nranks: u32,
        op_timeout: Option<f64>,
        join_timeout: Option<f64>,
        switch: Option<String>,
        pacing_gbps: Option<f64>,
    ) -> PyResult<Communicator> {
        if rank >= nranks {
            return Err(PyValueError::new_err(format!(
                "rank {rank} is out of range for {nranks} ranks"
            )));
        }
        let o = commd_client::CommOptions {
            op_timeout: duration(op_timeout, "op_timeout")?,
            join_timeout: duration(join_timeout, "join_timeout")?,
            switch,
            pacing_bytes_per_sec: pacing(pacing_gbps, "pacing_gbps")?,
        };
        let uid = unique_id.to_vec();
        let c = py
            .detach(|| self.inner.communicator_with(&uid, rank, nranks, o))
            .map_err(to_py)?;
        Ok(Communicator {
            inner: std::sync::Mutex::new(Some(Arc::new(c))),
            rank,
            nranks,
            stash: Arc::default(),
        })
    }

    /// Allocates `nbytes` of shared memory registered with the daemon (zero-filled).
    fn alloc(&self, py: Python<'_>, nbytes: u64) -> PyResult<Buffer> {
        let b = py.detach(|| self.inner.alloc(nbytes)).map_err(to_py)?;
        Ok(Buffer {
            inner: Arc::new(b),
            exports: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// `(Buffer, byte offset)` when `[address, address + nbytes)` lies in one block of commd's
    /// CPU allocator (`host_allocator`), which the first call moves into shared memory and
    /// registers with this session (see commd_client::hostmem); None otherwise. The Buffer is
    /// a registration only: its bytes cannot be exported.
    fn adopt(&self, py: Python<'_>, address: usize, nbytes: usize) -> Option<(Buffer, u64)> {
        py.detach(|| commd_client::hostmem::adopt(&self.inner, address, nbytes))
            .map(|(b, off)| {
                (
                    Buffer {
                        inner: b,
                        exports: std::sync::atomic::AtomicUsize::new(0),
                    },
                    off,
                )
            })
    }

    /// (allocations this process registered with the daemon, registration cache hits).
    fn cuda_registration_stats(&self) -> (u64, u64) {
        self.inner.cuda_registration_stats()
    }

    /// The daemon's status (as JSON text).
    fn status_json(&self, py: Python<'_>) -> PyResult<String> {
        let s = py.detach(|| self.inner.status()).map_err(to_py)?;
        let ipc = format!(
            ",\"cuda_available\":{},\"cuda_reason\":{:?},\"gpus\":{},\"ipc_opens\":{},\"ipc_cache_hits\":{},\"ipc_open_us\":{},\"ipc_open_now\":{},\"gpu_ops\":{}}}",
            s.cuda_available,
            s.cuda_reason,
            s.gpus,
            s.ipc_opens,
            s.ipc_cache_hits,
            s.ipc_open_us,
            s.ipc_open_now,
            s.gpu_ops
        );
        let base = format!(
            "{{\"daemon_version\":{:?},\"pid\":{},\"uptime_ms\":{},\"sessions\":{},\"communicators\":{},\"registrations\":{},\"mapped_bytes\":{},\"ops_completed\":{},\"ops_failed\":{},\"workers\":{}}}",
            s.daemon_version,
            s.pid,
            s.uptime_ms,
            s.sessions,
            s.communicators,
            s.registrations,
            s.mapped_bytes,
            s.ops_completed,
            s.ops_failed,
            s.workers
        );
        Ok(format!("{}{ipc}", &base[..base.len() - 1]))
    }
}

/// Shared memory registered with the daemon. Supports the buffer protocol (writable, 1-D bytes).
#[pyclass(module = "commd._native", frozen, weakref)]
struct Buffer {
    inner: Arc<commd_client::Buffer>,
    exports: std::sync::atomic::AtomicUsize,
}

#[pymethods]
#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
impl Buffer {
    #[getter]
    fn nbytes(&self) -> u64 {
        self.inner.len()
    }

    #[getter]
    fn mem_id(&self) -> u32 {
        self.inner.mem_id()
    }

    /// The address of the first byte in this process (to recognise arrays that live here).
    #[getter]
    fn address(&self) -> usize {
        self.inner.as_ptr() as usize
    }

    fn __len__(&self) -> usize {
        self.inner.len() as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "<commd.Buffer mem {} ({} bytes)>",
            self.inner.mem_id(),
            self.inner.len()
        )
    }

    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null view"));
        }
        let me = slf.get();
        if me.inner.is_block() {
            return Err(PyBufferError::new_err(
                "this Buffer is the registration of a commd CPU allocator block (its bytes \
                 belong to the tensor that owns the block)",
            ));
        }
        let len = me.inner.len() as ffi::Py_ssize_t;
        // SAFETY: `view` is non-null and owned by the caller for the duration of this call; we
        // fill every field. The exporter object is kept alive by the new reference in `obj`.
        unsafe {
            (*view).buf = me.inner.as_ptr() as *mut c_void;
            (*view).len = len;
            (*view).readonly = 0;
            (*view).itemsize = 1;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                c"B".as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape = if flags & ffi::PyBUF_ND == ffi::PyBUF_ND {
                &mut (*view).len
            } else {
                std::ptr::null_mut()
            };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
            (*view).obj = slf.clone().into_any().into_ptr();
        }
        me.exports
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// # Safety
    /// Called by CPython with a view this object filled.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {
        self.exports
            .fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn parse_kind(s: &str) -> PyResult<OpKind> {
    OpKind::parse(s).ok_or_else(|| PyValueError::new_err(format!("unknown op {s:?}")))
}

fn parse_dtype(s: &str) -> PyResult<DType> {
    DType::parse(s).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unsupported dtype {s:?} (commd reduces f32, f64, f16, bf16, i8, u8, i32, i64)"
        ))
    })
}

fn parse_redop(s: &str) -> PyResult<RedOp> {
    RedOp::parse(s).ok_or_else(|| PyValueError::new_err(format!("unknown reduction {s:?}")))
}

/// A communicator handle; destroyed by `close()` or when garbage-collected.
#[pyclass(module = "commd._native", frozen)]
struct Communicator {
    inner: std::sync::Mutex<Option<Arc<commd_client::Communicator>>>,
    rank: u32,
    nranks: u32,
    stash: Arc<Stash>,
}

/// Python objects (tensors) that GPU ops posted by `cuda_op` use, kept referenced until the
/// daemon reports the op done, so torch's caching allocator cannot hand their memory out while
/// the copies may still run, even when the caller drops the op's Work unwaited (no
/// `record_stream` per tensor). Released in posting order, from the front, by later ops and
/// waits; an op that failed keeps its objects until the communicator is closed (its stream may
/// still run the op's kernels).
#[derive(Default)]
struct Stash {
    live: std::sync::Mutex<std::collections::VecDeque<(Arc<commd_client::Request>, Py<PyAny>)>>,
    failed: std::sync::Mutex<Vec<Py<PyAny>>>,
}

impl Stash {
    /// Drops the references of the leading ops that completed. Needs the GIL (held by every
    /// caller: the drops decrement reference counts).
    fn reap(&self, _py: Python<'_>) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((r, _)) = live.front() {
            match r.test() {
                Ok(false) => break,
                Ok(true) => drop(live.pop_front()),
                Err(_) => {
                    if let Some((_, keep)) = live.pop_front() {
                        self.failed
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(keep);
                    }
                }
            }
        }
    }

    fn push(&self, r: Arc<commd_client::Request>, keep: Py<PyAny>) {
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((r, keep));
    }
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
#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
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
        let dtype = DType::from_code((code >> 16) as u8).ok_or_else(bad)?;
        let redop = match (code >> 24) as u8 {
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
    /// "daemon: <why not direct>" or "undecided" (DESIGN.md contracts 6 and 7).
    fn cuda_graph_path(&self) -> PyResult<String> {
        Ok(self.get()?.cuda_graph_path())
    }

    /// How small eager GPU collectives run on this communicator: "direct", "daemon: <why
    /// not>" or "undecided" (DESIGN.md contract 7 rule 8, COMMD_EAGER_DIRECT).
    fn cuda_eager_path(&self) -> PyResult<String> {
        Ok(self.get()?.cuda_eager_path())
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

type CuStream = commd_cuda::sys::CUstream;

/// A GPU op posted by `Communicator.cuda_op`: a `Request` (wait/test on the CPU) that can also
/// order another stream after the op on the GPU (`cuda_wait`).
#[pyclass(module = "commd._native", frozen)]
struct CudaRequest {
    inner: Arc<commd_client::Request>,
    comm: Arc<commd_client::Communicator>,
    stream: usize,
    device: i32,
    deferred: bool,
    /// Captured into a CUDA graph: a deferred wait is the communicator's flush.
    captured: bool,
    last_ticket: u32,
    bytes: u64,
    done: std::sync::Mutex<Option<Arc<commd_client::gpu::CudaEvent>>>,
    stash: Arc<Stash>,
}

#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
impl CudaRequest {
    /// The event after the op on its stream: recorded by `cuda_op`, or now (an op posted
    /// without one: recorded now, it also covers what was queued on that stream since).
    fn event(&self) -> PyResult<Arc<commd_client::gpu::CudaEvent>> {
        let mut d = self.done.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = d.as_ref() {
            return Ok(e.clone());
        }
        let s = self.stream as CuStream;
        // SAFETY: `s` is the live stream the op was posted on (the caller keeps it alive, as
        // for `cuda_op`), of the op's device.
        let e = Arc::new(unsafe { self.comm.cuda_record(s, self.device) }.map_err(to_py)?);
        *d = Some(e.clone());
        Ok(e)
    }
}

#[pymethods]
#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
impl CudaRequest {
    /// Waits for the op on the CPU (as `Request.wait`).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        wait_request(py, &self.inner, timeout)
    }

    /// True if the op completed (raises its error if it failed); never blocks.
    fn test(&self, py: Python<'_>) -> PyResult<bool> {
        let r = self.inner.clone();
        py.detach(move || r.test()).map_err(to_py)
    }

    /// Prints the op's error on stderr if it fails (see `Request.report_failure`).
    fn report_failure(&self, what: String) {
        report_failure(self.inner.clone(), what)
    }

    /// Makes `stream` wait on the GPU for the op (the CPU does not wait), then raises the op's
    /// error if it already failed. A deferred send/recv: `stream` waits for the op's done
    /// ticket (one stream operation, no event); an op posted on `stream` itself without
    /// deferral: nothing to enqueue; otherwise `stream` waits for the op's event.
    fn cuda_wait(&self, py: Python<'_>, stream: usize) -> PyResult<()> {
        let flushed = self.done.lock().unwrap_or_else(|e| e.into_inner()).clone();
        // SAFETY: `stream` is a live stream handle from the caller (torch's current stream).
        unsafe {
            match flushed {
                Some(e) => e.wait_on(stream as CuStream).map_err(to_py)?,
                None if self.deferred && self.captured => {
                    self.comm.cuda_flush(stream as CuStream).map_err(to_py)?
                }
                None if self.deferred => self
                    .comm
                    .cuda_wait_ticket(stream as CuStream, self.last_ticket, self.bytes)
                    .map_err(to_py)?,
                None if stream == self.stream => {}
                None => self.event()?.wait_on(stream as CuStream).map_err(to_py)?,
            }
        }
        self.stash.reap(py);
        self.inner.test().map(|_| ()).map_err(to_py)
    }

    #[getter]
    fn op_id(&self) -> u64 {
        self.inner.user_data()
    }
}

/// A posted op.
#[pyclass(module = "commd._native", frozen)]
struct Request {
    inner: Arc<commd_client::Request>,
    _keep: Vec<Arc<commd_client::Buffer>>,
    _comm: Arc<commd_client::Communicator>,
}

#[pymethods]
impl Request {
    /// Waits for the op. `timeout` in seconds (None: until done). Returns True when done, False
    /// on timeout; raises the op's error if it failed (every time it is asked).
    #[pyo3(signature = (timeout=None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        wait_request(py, &self.inner, timeout)
    }

    /// True if the op completed (raises its error if it failed); never blocks.
    fn test(&self, py: Python<'_>) -> PyResult<bool> {
        let r = self.inner.clone();
        py.detach(move || r.test()).map_err(to_py)
    }

    #[getter]
    fn op_id(&self) -> u64 {
        self.inner.user_data()
    }

    /// The rank a receive from any source received from, once it completed (None before, and
    /// for every other op).
    #[getter]
    fn source(&self) -> Option<u32> {
        self.inner.source()
    }

    /// Prints the op's error on stderr if it fails ("commd: ERROR: {what}: {error}"); nothing
    /// if it succeeds. For ops whose outcome nothing else waits for (GPU ops behind futures
    /// completed on their stream). One thread of the library looks at such ops every 50 ms,
    /// without the GIL and without waiting on the completion queue: a thread that waited for
    /// each op (woken by the daemon per completion) made a DDP step 3-7% slower.
    fn report_failure(&self, what: String) {
        report_failure(self.inner.clone(), what)
    }
}

type FailureWatch = (Arc<commd_client::Request>, String);

/// Queues `r` for the failure reporter thread (started on first use, and again in a forked
/// child, which has no copy of the parent's threads).
fn report_failure(r: Arc<commd_client::Request>, what: String) {
    static TX: std::sync::Mutex<Option<(u32, std::sync::mpsc::Sender<FailureWatch>)>> =
        std::sync::Mutex::new(None);
    let mut g = TX.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    if g.as_ref().is_none_or(|(p, _)| *p != pid) {
        let (tx, rx) = std::sync::mpsc::channel::<FailureWatch>();
        let started = std::thread::Builder::new()
            .name("commd-failures".into())
            .spawn(move || {
                let mut pending: Vec<FailureWatch> = Vec::new();
                loop {
                    if pending.is_empty() {
                        match rx.recv() {
                            Ok(w) => pending.push(w),
                            Err(_) => return,
                        }
                    }
                    pending.extend(rx.try_iter());
                    pending.retain(|(r, what)| match r.test() {
                        Ok(done) => !done,
                        Err(e) => {
                            eprintln!("commd: ERROR: {what}: {e}");
                            false
                        }
                    });
                    if !pending.is_empty() {
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
            });
        if started.is_err() {
            return;
        }
        *g = Some((pid, tx));
    }
    if let Some((_, tx)) = g.as_ref() {
        let _ = tx.send((r, what));
    }
}

/// Waits for `r` up to `timeout` seconds (None: until done), waking every 100 ms for signals.
fn wait_request(
    py: Python<'_>,
    r: &Arc<commd_client::Request>,
    timeout: Option<f64>,
) -> PyResult<bool> {
    let limit = duration(timeout, "timeout")?;
    let t0 = Instant::now();
    let slice = Duration::from_millis(100);
    loop {
        let left = limit.map(|l| l.saturating_sub(t0.elapsed()));
        let step = left.map_or(slice, |l| l.min(slice));
        let r = r.clone();
        let done = py.detach(move || r.wait_for(Some(step))).map_err(to_py)?;
        if done {
            return Ok(true);
        }
        if left.is_some_and(|l| l <= step) {
            return Ok(false);
        }
        py.check_signals()?;
    }
}

/// The names of every environment setting in commd's registry (`commd-settings`): the only
/// `COMMD_*` names the Python package reads (`commd._settings`).
#[pyfunction]
fn setting_names() -> Vec<&'static str> {
    commd_settings::KEYS.iter().map(|k| k.name).collect()
}

/// Version of the bindings (same as the daemon's protocol version string).
#[pyfunction]
fn version() -> &'static str {
    commd_proto::VERSION
}

/// The socket path a client would use now (`$COMMD_SOCKET`, else the per-user default).
#[pyfunction]
fn default_socket() -> String {
    commd_client::resolve_socket_path().display().to_string()
}

/// The addresses of commd's CPU allocator functions `(alloc, free)`: `void *alloc(size_t)`
/// (null when out of memory) and `bool free(void *)` (false, doing nothing, for a pointer that is not
/// one of its blocks), for an allocator written in C++
/// (`commd._c10d` installs them as torch's CPU allocator for large tensors).
#[pyfunction]
fn host_allocator() -> (usize, usize) {
    (
        commd_client::hostmem::alloc as *const () as usize,
        commd_client::hostmem::free as *const () as usize,
    )
}

/// numpy's `PyDataMemAllocator` (NEP 49), version 1.
#[repr(C)]
struct NpAllocator {
    ctx: *mut c_void,
    malloc: unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void,
    calloc: unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void,
    realloc: unsafe extern "C" fn(*mut c_void, *mut c_void, usize) -> *mut c_void,
    free: unsafe extern "C" fn(*mut c_void, *mut c_void, usize),
}

/// numpy's `PyDataMem_Handler`.
#[repr(C)]
struct NpHandler {
    name: [u8; 127],
    version: u8,
    allocator: NpAllocator,
}

#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
// SAFETY: immutable; `ctx` is null and never used.
unsafe impl Sync for NpHandler {}

#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
unsafe extern "C" fn np_malloc(_: *mut c_void, n: usize) -> *mut c_void {
    commd_client::hostmem::malloc(n)
}
#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
unsafe extern "C" fn np_calloc(_: *mut c_void, n: usize, size: usize) -> *mut c_void {
    commd_client::hostmem::calloc(n, size)
}
#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
unsafe extern "C" fn np_realloc(_: *mut c_void, p: *mut c_void, n: usize) -> *mut c_void {
    // SAFETY: numpy passes a pointer this handler allocated (it frees arrays with the handler
    // that made them).
    unsafe { commd_client::hostmem::realloc(p, n) }
}
#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
unsafe extern "C" fn np_free(_: *mut c_void, p: *mut c_void, _size: usize) {
    // SAFETY: as in np_realloc.
    unsafe { commd_client::hostmem::free_any(p) }
}

static NP_HANDLER: NpHandler = NpHandler {
    name: {
        let mut n = [0u8; 127];
        let s = b"commd";
        let mut i = 0;
        while i < s.len() {
            n[i] = s[i];
            i += 1;
        }
        n
    },
    version: 1,
    allocator: NpAllocator {
        ctx: std::ptr::null_mut(),
        malloc: np_malloc,
        calloc: np_calloc,
        realloc: np_realloc,
        free: np_free,
    },
};

/// A `mem_handler` capsule for numpy's `PyDataMem_SetHandler` (NEP 49): arrays of at least
/// `min_bytes` come from commd's CPU allocator (so ops on them run in place), smaller ones
/// from the C library. The handler is named "commd".
#[pyfunction]
#[allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)
fn numpy_mem_handler(py: Python<'_>, min_bytes: usize) -> PyResult<Py<PyAny>> {
    commd_client::hostmem::set_min_bytes(min_bytes);
    // SAFETY: a capsule over a static that lives as long as the process, with a static name
    // and no destructor.
    let cap = unsafe {
        ffi::PyCapsule_New(
            &NP_HANDLER as *const NpHandler as *mut c_void,
            c"mem_handler".as_ptr(),
            None,
        )
    };
    if cap.is_null() {
        return Err(PyErr::fetch(py));
    }
    // SAFETY: a new reference, owned from here on.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) }.unbind())
}

/// The CPU allocator's counters (commd_client::hostmem::Stats) as a dict.
#[pyfunction]
fn host_blocks(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let s = commd_client::hostmem::stats();
    let d = pyo3::types::PyDict::new(py);
    for (k, v) in [
        ("allocs", s.allocs),
        ("reused", s.reused),
        ("moved", s.moved),
        ("registered", s.registered),
        ("fork_copies", s.fork_copies),
        ("live", s.live),
        ("live_bytes", s.live_bytes),
        ("live_shared", s.live_shared),
        ("cached_bytes", s.cached_bytes),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Client>()?;
    m.add_class::<Buffer>()?;
    m.add_class::<Communicator>()?;
    m.add_class::<Request>()?;
    m.add_class::<CudaRequest>()?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(setting_names, m)?)?;
    m.add_function(wrap_pyfunction!(host_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(host_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(numpy_mem_handler, m)?)?;
    m.add_function(wrap_pyfunction!(default_socket, m)?)?;
    m.add("CommError", py.get_type::<CommError>())?;
    m.add(
        "DaemonUnavailableError",
        py.get_type::<DaemonUnavailableError>(),
    )?;
    m.add("DaemonLostError", py.get_type::<DaemonLostError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add("PeerLostError", py.get_type::<PeerLostError>())?;
    m.add("CommTimeoutError", py.get_type::<CommTimeoutError>())?;
    m.add("ShutdownError", py.get_type::<ShutdownError>())?;
    m.add("AbortedError", py.get_type::<AbortedError>())?;
    m.add("InvalidOpError", py.get_type::<InvalidOpError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    Ok(())
}
