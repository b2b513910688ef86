//! commd's NCCL-compatible library: `libcommd_nccl.so`, SONAME `libnccl.so.2`, exporting
//! NCCL's C API with NCCL's types, enums, struct layouts and result codes, so that programs
//! written for NCCL (torch's "nccl" backend, vLLM's pynccl, nccl-tests, MPI+NCCL codes) run their
//! collectives on the node's commd daemon with no code change: preload it
//! (`LD_PRELOAD=.../libnccl.so.2`, or `commd exec -- ...`) or point `VLLM_NCCL_SO_PATH` at it.
//!
//! Every function of NCCL's host API that libtorch_cuda imports is defined (a preloaded
//! library that lacked one would let the real NCCL be called with a commd communicator).
//! What commd does not do returns `ncclInvalidUsage`, and `ncclGetLastError` says what and why;
//! nothing here panics into C or hangs on bad input.
//!
//! Layers: the C entry points, grouped by theme (`lifecycle`, `query`, `collective`, `p2p`,
//! `memory`, `window`, `unsupported`: argument checks and conversions only) -> `comm` (communicators, op
//! dispatch) and `group` -> `host` (the host-memory extension) -> `ffi`, `log`. The crate root
//! holds the C types they share. Device memory goes through `commd_client`'s stream-ordered GPU
//! ops (docs/contracts.md #4, docs/design-gpu.md persistent ops: ops issued while a stream is
//! captured become persistent graph ops).

#![deny(unsafe_code)] // allowed only in the modules that say why
#![allow(non_camel_case_types, non_snake_case, clippy::missing_safety_doc)]

mod collconfig;
mod collective;
mod comm;
mod elastic;
mod env;
mod ffi;
mod lifecycle;
mod log;
mod memory;
mod p2p;
mod params;
mod premul;
mod profiling;
mod query;
mod staging;
mod unsupported;
mod window;

use std::ffi::{c_char, c_int, c_void};

use comm::{Comm, UNIQUE_ID_BYTES};
use ffi::{Outcome, ncclResult_t};

// The entry points keep their paths at the crate root (`commd_nccl::ncclAllReduce`).
pub use collective::*;
pub use elastic::*;
pub use lifecycle::*;
pub use memory::*;
pub use p2p::*;
pub use params::*;
pub use query::*;
pub use unsupported::*;
pub use window::*;

/// `ncclComm_t`.
pub type ncclComm_t = *mut Comm;
/// `cudaStream_t` (a driver stream handle; 0 is the legacy default stream).
pub type cudaStream_t = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// The head of `ncclConfig_t` (NCCL 2.14+): size, magic, version, then `blocking`. The rest
/// tunes NCCL's own kernels and transports, which commd does not have.
#[repr(C)]
pub struct ConfigHead {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
}

/// The NCCL API version this library reports (`NCCL_COMMD_VERSION_CODE` overrides it): 2.28,
/// the release whose host API it implements.
pub fn version_code() -> c_int {
    commd_settings::get(&commd_settings::keys::NCCL_COMMD_VERSION_CODE)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(22800)
}

fn ok() -> Outcome<ncclResult_t> {
    Ok(ffi::SUCCESS)
}

#[cfg(test)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
mod tests {
    use super::lifecycle::{API_MAGIC, blocking};
    use super::*;

    #[test]
    fn stale_handles_and_bad_arguments_are_errors_not_crashes() {
        let bogus = 0x1000 as ncclComm_t;
        let mut n = 0;
        // SAFETY: the library must refuse the handle before using it.
        let r = unsafe { ncclCommCount(bogus, &mut n) };
        assert_eq!(r, ffi::INVALID_ARGUMENT);
        // SAFETY: as above.
        let r = unsafe { ncclCommCount(std::ptr::null_mut(), &mut n) };
        assert_eq!(r, ffi::INVALID_ARGUMENT);
        // SAFETY: null is checked.
        let r = unsafe { ncclGetVersion(std::ptr::null_mut()) };
        assert_eq!(r, ffi::INVALID_ARGUMENT);
        let mut v = 0;
        // SAFETY: valid out pointer.
        assert_eq!(unsafe { ncclGetVersion(&mut v) }, ffi::SUCCESS);
        assert!(v >= 22800);
        assert_eq!(ncclGroupEnd(), ffi::INVALID_USAGE);
        assert_eq!(ncclGroupStart(), ffi::SUCCESS);
        assert_eq!(ncclGroupEnd(), ffi::SUCCESS);
        assert_eq!(ncclCommGrow(), ffi::INVALID_USAGE);
        // SAFETY: the message pointer is this thread's live last-error string.
        let m = unsafe { std::ffi::CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) };
        assert!(
            m.to_string_lossy()
                .contains("ncclCommGrow is not supported"),
            "{m:?}"
        );
        let bad = ConfigHead {
            size: 4,
            magic: 0,
            version: 0,
            blocking: 1,
        };
        // SAFETY: a valid (if uninitialised-by-NCCL) config.
        assert!(unsafe { blocking(&bad) }.is_err());
        let good = ConfigHead {
            size: std::mem::size_of::<ConfigHead>(),
            magic: API_MAGIC,
            version: 22800,
            blocking: 0,
        };
        // SAFETY: as above.
        assert!(!unsafe { blocking(&good) }.unwrap());
    }
}
