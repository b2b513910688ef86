//! Memory: buffer registration (`ncclCommRegister`/`ncclCommDeregister`, tokens only: commd
//! registers buffers with the daemon on first use), `ncclMemAlloc`/`ncclMemFree` over the CUDA
//! driver, and a communicator's memory statistics.

#![allow(unsafe_code)] // the C ABI and the CUDA driver: raw pointers from C callers

use std::ffi::{c_int, c_void};

use commd_cuda::{self as cu, sys};

use crate::comm;
use crate::ffi::{self, Failure, Outcome, guard, invalid, ncclResult_t, put, usage};
use crate::{ncclComm_t, ok};

/// The live registration handles, each with its communicator's handle: commd registers
/// buffers with the daemon on first use and caches them per allocation, so registering ahead
/// only checks the range and hands out a token (an address no other live handle has).
fn registrations() -> &'static std::sync::Mutex<std::collections::HashMap<usize, usize>> {
    static R: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<usize, usize>>> =
        std::sync::OnceLock::new();
    R.get_or_init(Default::default)
}

/// Drops the registrations of a released communicator (NCCL frees them with it).
pub(crate) fn forget_registrations(c: ncclComm_t) {
    comm::lock(registrations()).retain(|&token, owner| {
        if *owner != c as usize {
            return true;
        }
        // SAFETY: made by Box::into_raw in ncclCommRegister and still live (in the set).
        drop(unsafe { Box::from_raw(token as *mut u8) });
        false
    });
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommRegister(
    c: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    guard("ncclCommRegister", || {
        comm::get(c)?;
        if buff.is_null() {
            return Err(invalid("buff is NULL"));
        }
        if handle.is_null() {
            return Err(invalid("handle is a null pointer"));
        }
        let _ = size;
        // A heap address is the token: unique among live handles, and never NULL.
        let token = Box::into_raw(Box::new(0u8)) as usize;
        comm::lock(registrations()).insert(token, c as usize);
        // SAFETY: checked non-null; NCCL's contract on the out pointer.
        unsafe { handle.write(token as *mut c_void) };
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDeregister(c: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    guard("ncclCommDeregister", || {
        comm::get(c)?;
        if handle.is_null() {
            return ok();
        }
        let mut live = comm::lock(registrations());
        match live.get(&(handle as usize)) {
            Some(&owner) if owner == c as usize => {
                live.remove(&(handle as usize));
                // SAFETY: made by Box::into_raw in ncclCommRegister, removed from the live
                // set just now, so freed once.
                drop(unsafe { Box::from_raw(handle.cast::<u8>()) });
                ok()
            }
            Some(_) => Err(usage(format!(
                "handle {handle:p} was registered with another communicator"
            ))),
            None => Err(usage(format!(
                "handle {handle:p} is not a live registration (not returned by ncclCommRegister, or deregistered already)"
            ))),
        }
    })
}

pub(crate) fn cuda_failure(e: cu::CuError) -> Failure {
    Failure {
        code: ffi::UNHANDLED_CUDA_ERROR,
        message: e.to_string(),
    }
}

/// Makes the current device's primary context current when the thread has none.
fn cuda_context() -> Outcome {
    if let Err(why) = cu::driver() {
        return Err(Failure {
            code: ffi::UNHANDLED_CUDA_ERROR,
            message: format!("CUDA is not available in this process: {why}"),
        });
    }
    cu::context::ensure_context(0).map_err(cuda_failure)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    guard("ncclMemAlloc", || {
        if ptr.is_null() {
            return Err(invalid("ptr is a null pointer"));
        }
        cuda_context()?;
        let mut d: sys::CUdeviceptr = 0;
        // Plain device memory: commd shares it with its daemon through a CUDA IPC handle.
        // SAFETY: valid out pointer; a context is current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut d, size.max(1)) };
        cu::ck(r, "cuMemAlloc").map_err(cuda_failure)?;
        // A device address of this process is pointer-sized.
        #[allow(clippy::cast_possible_truncation)] // 64-bit targets only
        let p = d as usize as *mut c_void;
        // SAFETY: checked non-null above.
        unsafe { ptr.write(p) };
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    guard("ncclMemFree", || {
        if ptr.is_null() {
            return ok();
        }
        cuda_context()?;
        // SAFETY: NCCL's contract: memory ncclMemAlloc returned, freed once.
        let r = unsafe { sys::cuMemFree_v2(ptr as usize as sys::CUdeviceptr) };
        cu::ck(r, "cuMemFree").map_err(cuda_failure)?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommMemStats(
    c: ncclComm_t,
    stat: c_int,
    value: *mut u64,
) -> ncclResult_t {
    guard("ncclCommMemStats", || {
        let comm = comm::get(c)?;
        // ncclStatGpuMemSuspend 0, ...Suspended 1, ...Persist 2, ...Total 3 (nccl.h). The GPU
        // memory this process holds for the communicator (direct-op windows, send/recv
        // inboxes, staging; the daemon's scratch is the daemon's, in `commd status`) cannot be
        // suspended: all of it is persistent, and nothing is suspended.
        let v = match stat {
            0 | 1 => 0,
            2 | 3 => comm.gpu_memory_bytes(),
            _ => return Err(invalid(format!("unknown memory statistic {stat}"))),
        };
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(value, v, "value") }?;
        ok()
    })
}
