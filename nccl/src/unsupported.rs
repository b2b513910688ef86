//! The entry points of NCCL's API that commd does not implement (resizing, symmetric memory
//! windows, the device API, NCCL's parameters): each is exported so that a preloaded library
//! answers for all of NCCL, and each fails with a message saying what to do instead.

#![allow(unsafe_code)] // exported by name: the C ABI

use crate::ffi::{guard, ncclResult_t, unsupported};

/// Entry points of NCCL's API that commd does not implement: each returns
/// `ncclInvalidUsage` with `ncclGetLastError` naming it and why. Their arguments are not read
/// (all return `ncclResult_t`, so ignoring the arguments is ABI-safe on the caller's side).
macro_rules! unsupported {
    ($($name:ident: $why:expr;)*) => {
        $(
            #[unsafe(no_mangle)]
            pub extern "C" fn $name() -> ncclResult_t {
                guard(stringify!($name), || Err(unsupported(stringify!($name), $why)))
            }
        )*
    };
}

const NO_SHRINK: &str = "commd communicators are not resized; create a new one over the remaining ranks (ncclGetUniqueId + ncclCommInitRank, or ncclCommSplit before a rank is lost)";
const NO_WINDOWS: &str = "commd has no symmetric memory windows or one-sided puts and signals; use collectives or ncclSend/ncclRecv";
const NO_PARAMS: &str = "NCCL's parameters tune NCCL's own transports; commd's settings are in its commd.toml and `commd config`";
const NO_DEVICE_API: &str = "commd has no NCCL device API (its collectives run in the daemon and on copy engines, not in user kernels)";

unsupported! {
    ncclCommShrink: NO_SHRINK;
    ncclCommGrow: NO_SHRINK;
    ncclCommGetUniqueId: NO_SHRINK;
    ncclCommRevoke: "use ncclCommAbort, which ends the communicator's outstanding ops";
    ncclCommSuspend: "the library holds no GPU memory to release (the daemon owns its scratch)";
    ncclCommResume: "the library holds no GPU memory to release (the daemon owns its scratch)";
    ncclCommWindowRegister: NO_WINDOWS;
    ncclCommWindowDeregister: NO_WINDOWS;
    ncclWinGetUserPtr: NO_WINDOWS;
    ncclPutSignal: NO_WINDOWS;
    ncclSignal: NO_WINDOWS;
    ncclWaitSignal: NO_WINDOWS;
    ncclDevCommCreate: NO_DEVICE_API;
    ncclDevCommDestroy: NO_DEVICE_API;
    ncclCommQueryProperties: NO_DEVICE_API;
    ncclGetLsaMultimemDevicePointer: NO_DEVICE_API;
    ncclGetMultimemDevicePointer: NO_DEVICE_API;
    ncclGetLsaDevicePointer: NO_DEVICE_API;
    ncclGetPeerDevicePointer: NO_DEVICE_API;
    ncclGroupSimulateEnd: "commd has no cost model to simulate a group with";
    ncclSetEncryption: "commd's data between nodes is protected by its own transport settings, see docs/multinode.md";
    ncclParamBind: NO_PARAMS;
    ncclParamGetI8: NO_PARAMS;
    ncclParamGetI16: NO_PARAMS;
    ncclParamGetI32: NO_PARAMS;
    ncclParamGetI64: NO_PARAMS;
    ncclParamGetU8: NO_PARAMS;
    ncclParamGetU16: NO_PARAMS;
    ncclParamGetU32: NO_PARAMS;
    ncclParamGetU64: NO_PARAMS;
}
