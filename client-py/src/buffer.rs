//! `Buffer`: shared memory registered with the daemon, exported to Python through the buffer
//! protocol (numpy and torch view it without a copy).

#![allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use pyo3::exceptions::PyBufferError;
use pyo3::ffi;
use pyo3::prelude::*;

/// Shared memory registered with the daemon. Supports the buffer protocol (writable, 1-D bytes).
#[pyclass(module = "commd._native", frozen, weakref)]
pub(crate) struct Buffer {
    pub(crate) inner: Arc<commd_client::Buffer>,
    pub(crate) exports: std::sync::atomic::AtomicUsize,
}

#[pymethods]
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

    // The length of a mapping of this process, which fits its address space.
    #[allow(clippy::cast_possible_truncation)] // 64-bit targets only
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
        let len = ffi::Py_ssize_t::try_from(me.inner.len())
            .map_err(|_| PyBufferError::new_err("buffer too large for the buffer protocol"))?;
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
