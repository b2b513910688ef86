//! What a caller asks of the library and of a communicator: the version, result names, the
//! last error, a communicator's asynchronous error, its size, device and rank. Nothing here
//! changes a communicator.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::ffi::{c_char, c_int};

use crate::comm;
use crate::ffi::{self, guard, ncclResult_t, put};
use crate::{ncclComm_t, ok, version_code};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    guard("ncclGetVersion", || {
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(version, version_code(), "version") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    ffi::result_name(result).as_ptr()
}

/// The communicator's own failure when it has one (so a watchdog thread reading it sees why
/// the communicator failed), else the calling thread's last failure.
#[unsafe(no_mangle)]
pub extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    if !comm.is_null()
        && let Ok(c) = comm::get(comm)
        && let Some(p) = c.last_error_ptr()
    {
        return p;
    }
    ffi::last_error_ptr()
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclResetDebugInit() {}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommGetAsyncError(
    c: ncclComm_t,
    async_error: *mut ncclResult_t,
) -> ncclResult_t {
    guard("ncclCommGetAsyncError", || {
        let comm = comm::get(c)?;
        let (r, message) = comm.async_error();
        if let Some(m) = message {
            // Where torch's watchdog reads the reason (ncclGetLastError after this call).
            ffi::set_last_error(&m);
        }
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(async_error, r, "asyncError") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCount(c: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    guard("ncclCommCount", || {
        let n = comm::get(c)?.c_nranks()?;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(count, n, "count") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommCuDevice(c: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    guard("ncclCommCuDevice", || {
        let d = comm::get(c)?.device.max(0);
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(device, d, "device") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommUserRank(c: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    guard("ncclCommUserRank", || {
        let r = comm::get(c)?.c_rank()?;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(rank, r, "rank") }?;
        ok()
    })
}
