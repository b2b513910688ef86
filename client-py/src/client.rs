//! `Client`: a session with the local daemon, which makes communicators and shared-memory
//! buffers and reports the daemon's status. Every call that talks to the daemon releases the GIL.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::buffer::Buffer;
use crate::communicator::Communicator;
use crate::convert::{duration, pacing};
use crate::error::to_py;

/// A session with the local daemon.
#[pyclass(module = "commd._native", frozen)]
pub(crate) struct Client {
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
    /// 0: uncapped). `name`: shown in `commd status`, logs and errors.
    #[pyo3(signature = (unique_id, rank, nranks, op_timeout=None, join_timeout=None, switch=None, pacing_gbps=None, name=None))]
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
        name: Option<String>,
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
            name,
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
