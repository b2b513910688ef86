//! commd's CPU allocator as seen from Python: its functions for torch's C++ allocator
//! (`host_allocator`), a numpy memory handler over it (`numpy_mem_handler`, NEP 49), and its
//! counters (`host_blocks`). The allocator itself is `commd_client::hostmem`.

#![allow(unsafe_code)] // PyO3 and raw buffers from Python (numpy, torch)

use std::ffi::c_void;

use pyo3::ffi;
use pyo3::prelude::*;

/// The addresses of commd's CPU allocator functions `(alloc, free)`: `void *alloc(size_t)`
/// (null when out of memory) and `bool free(void *)` (false, doing nothing, for a pointer that is not
/// one of its blocks), for an allocator written in C++
/// (`commd._c10d` installs them as torch's CPU allocator for large tensors).
#[pyfunction]
pub(crate) fn host_allocator() -> (usize, usize) {
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

// SAFETY: immutable; `ctx` is null and never used.
unsafe impl Sync for NpHandler {}

unsafe extern "C" fn np_malloc(_: *mut c_void, n: usize) -> *mut c_void {
    commd_client::hostmem::malloc(n)
}
unsafe extern "C" fn np_calloc(_: *mut c_void, n: usize, size: usize) -> *mut c_void {
    commd_client::hostmem::calloc(n, size)
}
unsafe extern "C" fn np_realloc(_: *mut c_void, p: *mut c_void, n: usize) -> *mut c_void {
    // SAFETY: numpy passes a pointer this handler allocated (it frees arrays with the handler
    // that made them).
    unsafe { commd_client::hostmem::realloc(p, n) }
}
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
pub(crate) fn numpy_mem_handler(py: Python<'_>, min_bytes: usize) -> PyResult<Py<PyAny>> {
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
pub(crate) fn host_blocks(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
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
        ("released_bytes", s.released_bytes),
    ] {
        d.set_item(k, v)?;
    }
    Ok(d)
}

/// Gives the allocator's cached freed blocks back to the system (what memory pressure does);
/// returns the bytes given back.
#[pyfunction]
pub(crate) fn host_blocks_release(py: Python<'_>) -> usize {
    py.detach(commd_client::hostmem::release_cache)
}
