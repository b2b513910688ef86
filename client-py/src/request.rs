//! Posted ops: `Request` (wait and test on the CPU), `CudaRequest` (a GPU op that can also order
//! another stream after it), the `Stash` that keeps a GPU op's Python objects alive until the
//! daemon reports it done, and the thread that reports failures nothing waits for.

#![allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)

use std::sync::Arc;
use std::time::{Duration, Instant};

use pyo3::prelude::*;

use crate::convert::duration;
use crate::error::to_py;

/// Python objects (tensors) that GPU ops posted by `cuda_op` use, kept referenced until the
/// daemon reports the op done, so torch's caching allocator cannot hand their memory out while
/// the copies may still run, even when the caller drops the op's Work unwaited (no
/// `record_stream` per tensor). Released in posting order, from the front, by later ops and
/// waits; an op that failed keeps its objects until the communicator is closed (its stream may
/// still run the op's kernels).
#[derive(Default)]
pub(crate) struct Stash {
    pub(crate) live:
        std::sync::Mutex<std::collections::VecDeque<(Arc<commd_client::Request>, Py<PyAny>)>>,
    pub(crate) failed: std::sync::Mutex<Vec<Py<PyAny>>>,
}

impl Stash {
    /// Drops the references of the leading ops that completed. Needs the GIL (held by every
    /// caller: the drops decrement reference counts).
    pub(crate) fn reap(&self, _py: Python<'_>) {
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

    pub(crate) fn push(&self, r: Arc<commd_client::Request>, keep: Py<PyAny>) {
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back((r, keep));
    }
}

pub(crate) type CuStream = commd_cuda::sys::CUstream;

/// A GPU op posted by `Communicator.cuda_op`: a `Request` (wait/test on the CPU) that can also
/// order another stream after the op on the GPU (`cuda_wait`).
#[pyclass(module = "commd._native", frozen)]
pub(crate) struct CudaRequest {
    pub(crate) inner: Arc<commd_client::Request>,
    pub(crate) comm: Arc<commd_client::Communicator>,
    pub(crate) stream: usize,
    pub(crate) device: i32,
    pub(crate) deferred: bool,
    /// Captured into a CUDA graph: a deferred wait is the communicator's flush.
    pub(crate) captured: bool,
    pub(crate) last_ticket: u32,
    pub(crate) bytes: u64,
    pub(crate) done: std::sync::Mutex<Option<Arc<commd_client::gpu::CudaEvent>>>,
    pub(crate) stash: Arc<Stash>,
}

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
pub(crate) struct Request {
    pub(crate) inner: Arc<commd_client::Request>,
    pub(crate) _keep: Vec<Arc<commd_client::Buffer>>,
    pub(crate) _comm: Arc<commd_client::Communicator>,
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
