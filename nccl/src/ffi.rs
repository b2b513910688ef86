//! NCCL's C types as this library sees them (result codes, data types, reduction ops, the
//! communicator config's head), the failures entry points return, the last-error text, and the
//! guard every entry point runs in (no panic unwinds into C).
//!
//! May use: `commd_client` errors and `commd_proto` codes. Owns no state but the thread's
//! last-error text.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers
#![allow(non_camel_case_types)]

use std::ffi::c_int;

use commd_client::desc::{DType, RedOp, status};
use commd_client::{Error, OpErrorKind};

/// `ncclResult_t`.
pub type ncclResult_t = c_int;
pub const SUCCESS: ncclResult_t = 0;
pub const UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub const SYSTEM_ERROR: ncclResult_t = 2;
pub const INTERNAL_ERROR: ncclResult_t = 3;
pub const INVALID_ARGUMENT: ncclResult_t = 4;
pub const INVALID_USAGE: ncclResult_t = 5;
pub const REMOTE_ERROR: ncclResult_t = 6;
pub const IN_PROGRESS: ncclResult_t = 7;
pub const TIMEOUT: ncclResult_t = 8;

/// The text `ncclGetErrorString` gives for a result code.
pub fn result_name(r: ncclResult_t) -> &'static std::ffi::CStr {
    match r {
        SUCCESS => c"no error",
        UNHANDLED_CUDA_ERROR => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        SYSTEM_ERROR => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        INTERNAL_ERROR => c"internal error - please report this issue to the commd developers",
        INVALID_ARGUMENT => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        INVALID_USAGE => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        REMOTE_ERROR => c"remote process exited or there was a network error",
        IN_PROGRESS => c"NCCL operation in progress",
        TIMEOUT => c"operation timed out",
        _ => c"unknown result code",
    }
}

/// `ncclDataType_t` values.
pub mod dt {
    pub const INT8: i32 = 0;
    pub const UINT8: i32 = 1;
    pub const INT32: i32 = 2;
    pub const UINT32: i32 = 3;
    pub const INT64: i32 = 4;
    pub const UINT64: i32 = 5;
    pub const FLOAT16: i32 = 6;
    pub const FLOAT32: i32 = 7;
    pub const FLOAT64: i32 = 8;
    pub const BFLOAT16: i32 = 9;
    pub const FP8_E4M3: i32 = 10;
    pub const FP8_E5M2: i32 = 11;
}

/// `ncclRedOp_t` built-in values.
pub mod op {
    pub const SUM: i32 = 0;
    pub const PROD: i32 = 1;
    pub const MAX: i32 = 2;
    pub const MIN: i32 = 3;
    pub const AVG: i32 = 4;
}

/// NCCL's name of a data type, for messages.
pub fn dtype_name(d: i32) -> String {
    let n = match d {
        dt::INT8 => "ncclInt8",
        dt::UINT8 => "ncclUint8",
        dt::INT32 => "ncclInt32",
        dt::UINT32 => "ncclUint32",
        dt::INT64 => "ncclInt64",
        dt::UINT64 => "ncclUint64",
        dt::FLOAT16 => "ncclFloat16",
        dt::FLOAT32 => "ncclFloat32",
        dt::FLOAT64 => "ncclFloat64",
        dt::BFLOAT16 => "ncclBfloat16",
        dt::FP8_E4M3 => "ncclFloat8e4m3",
        dt::FP8_E5M2 => "ncclFloat8e5m2",
        _ => return format!("data type {d}"),
    };
    n.to_string()
}

fn op_name(o: i32) -> String {
    match o {
        op::SUM => "ncclSum".into(),
        op::PROD => "ncclProd".into(),
        op::MAX => "ncclMax".into(),
        op::MIN => "ncclMin".into(),
        op::AVG => "ncclAvg".into(),
        _ => format!("reduction op {o}"),
    }
}

/// The commd element type of an NCCL type (ops that only copy move its bytes unchanged).
pub fn copy_dtype(d: i32) -> Outcome<DType> {
    Ok(match d {
        dt::INT8 => DType::I8,
        dt::UINT8 => DType::U8,
        dt::INT32 => DType::I32,
        dt::UINT32 => DType::U32,
        dt::INT64 => DType::I64,
        dt::UINT64 => DType::U64,
        dt::FLOAT16 => DType::F16,
        dt::FLOAT32 => DType::F32,
        dt::FLOAT64 => DType::F64,
        dt::BFLOAT16 => DType::BF16,
        dt::FP8_E4M3 => DType::F8E4M3,
        dt::FP8_E5M2 => DType::F8E5M2,
        _ => {
            return Err(invalid(format!(
                "invalid data type {d} (ncclDataType_t is 0-11)"
            )));
        }
    })
}

/// The commd element type and op that reduce an NCCL (type, op) pair, or why not. Every NCCL
/// type reduces with every built-in op: unsigned min/max/avg compare and divide unsigned, fp8
/// accumulates in f32 and stores rounded to nearest even, saturated (as NCCL's `__NV_SATFINITE`).
pub fn reduce_types(d: i32, o: i32) -> Outcome<(DType, RedOp)> {
    let red = match o {
        op::SUM => RedOp::Sum,
        op::PROD => RedOp::Prod,
        op::MAX => RedOp::Max,
        op::MIN => RedOp::Min,
        op::AVG => RedOp::Avg,
        o if o > op::AVG => {
            return Err(usage(format!(
                "reduction op {o} is not one commd created (ncclRedOpCreatePreMulSum is not supported by commd)"
            )));
        }
        o => return Err(invalid(format!("invalid reduction op {o}"))),
    };
    let dtype = copy_dtype(d)?;
    red.check_dtype(dtype)
        .map_err(|e| usage(format!("{} on {}: {e}", op_name(o), dtype_name(d))))?;
    Ok((dtype, red))
}

/// A failed call: the result code and the text `ncclGetLastError` gives.
#[derive(Clone, Debug)]
pub struct Failure {
    pub code: ncclResult_t,
    pub message: String,
}

pub type Outcome<T = ()> = Result<T, Failure>;

pub fn invalid(message: impl Into<String>) -> Failure {
    Failure {
        code: INVALID_ARGUMENT,
        message: message.into(),
    }
}

pub fn usage(message: impl Into<String>) -> Failure {
    Failure {
        code: INVALID_USAGE,
        message: message.into(),
    }
}

/// What commd does not implement: `ncclInvalidUsage`, naming the function and why.
pub fn unsupported(func: &str, why: &str) -> Failure {
    usage(format!(
        "{func} is not supported by commd's NCCL library: {why}"
    ))
}

/// The NCCL result for a failed op's completion status (the doorbell error word).
pub fn status_result(s: u32) -> ncclResult_t {
    match s {
        status::INVALID => INVALID_ARGUMENT,
        status::MISMATCH => INVALID_USAGE,
        status::PEER_LOST | status::ABORTED | status::REVOKED => REMOTE_ERROR,
        status::TIMEOUT => TIMEOUT,
        status::SHUTDOWN => SYSTEM_ERROR,
        _ => INTERNAL_ERROR,
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        let code = match &e {
            Error::DaemonUnavailable { .. } | Error::DaemonLost { .. } => SYSTEM_ERROR,
            Error::Op { kind, .. } => match kind {
                OpErrorKind::Invalid => INVALID_ARGUMENT,
                OpErrorKind::Mismatch => INVALID_USAGE,
                OpErrorKind::PeerLost | OpErrorKind::Aborted | OpErrorKind::Revoked => REMOTE_ERROR,
                OpErrorKind::Timeout => TIMEOUT,
                OpErrorKind::Shutdown => SYSTEM_ERROR,
                OpErrorKind::Internal => INTERNAL_ERROR,
            },
            Error::Rpc { code, message, .. } => {
                use tonic::Code;
                match code {
                    Code::DeadlineExceeded => TIMEOUT,
                    Code::InvalidArgument
                    | Code::NotFound
                    | Code::AlreadyExists
                    | Code::OutOfRange
                    | Code::PermissionDenied
                    | Code::ResourceExhausted => INVALID_ARGUMENT,
                    Code::FailedPrecondition => INVALID_USAGE,
                    // A rank that died during the rendezvous: its peers see a remote failure.
                    Code::Unavailable if message.contains("exited while the communicator") => {
                        REMOTE_ERROR
                    }
                    Code::Unavailable | Code::Unknown | Code::Cancelled => SYSTEM_ERROR,
                    _ => INTERNAL_ERROR,
                }
            }
            Error::InvalidArgument(_) => INVALID_ARGUMENT,
            Error::Unsupported(_) => INVALID_USAGE,
            Error::Io(_) | Error::Ring(_) => SYSTEM_ERROR,
        };
        Failure {
            code,
            message: e.to_string(),
        }
    }
}

pub use commd_abi::{last_error_ptr, set_last_error};

/// Runs the body of the entry point `func` under the ABIs' shared guard (`commd_abi::guard`):
/// a failure becomes its code and last-error text (and a WARN line under NCCL_DEBUG=WARN), a
/// panic `ncclInternalError`.
pub fn guard(func: &str, body: impl FnOnce() -> Outcome<ncclResult_t>) -> ncclResult_t {
    commd_abi::guard(func, INTERNAL_ERROR, crate::log::warn, || {
        body().map_err(|f| (f.code, f.message))
    })
}

/// Writes `v` through an out pointer the caller passed, refusing a null one.
///
/// # Safety
/// `p` must be null or valid for a write of `T`.
pub unsafe fn put<T>(p: *mut T, v: T, what: &str) -> Outcome {
    if p.is_null() {
        return Err(invalid(format!("{what} is a null pointer")));
    }
    // SAFETY: non-null, and the caller's contract.
    unsafe { p.write(v) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_reduces_with_its_own_dtype() {
        assert_eq!(reduce_types(dt::UINT32, op::SUM).unwrap().0, DType::U32);
        assert_eq!(reduce_types(dt::UINT64, op::PROD).unwrap().0, DType::U64);
        for o in [op::MAX, op::MIN, op::AVG] {
            assert_eq!(reduce_types(dt::UINT32, o).unwrap().0, DType::U32);
            assert_eq!(reduce_types(dt::UINT64, o).unwrap().0, DType::U64);
        }
        for (d, want) in [(dt::FP8_E4M3, DType::F8E4M3), (dt::FP8_E5M2, DType::F8E5M2)] {
            for o in [op::SUM, op::PROD, op::MIN, op::MAX, op::AVG] {
                assert_eq!(reduce_types(d, o).unwrap().0, want);
            }
            assert_eq!(copy_dtype(d).unwrap(), want);
        }
        assert_eq!(copy_dtype(12).unwrap_err().code, INVALID_ARGUMENT);
        assert_eq!(
            reduce_types(dt::FLOAT32, 9).unwrap_err().code,
            INVALID_USAGE
        );
        assert_eq!(
            reduce_types(dt::FLOAT32, -1).unwrap_err().code,
            INVALID_ARGUMENT
        );
        assert_eq!(
            reduce_types(dt::BFLOAT16, op::AVG).unwrap(),
            (DType::BF16, RedOp::Avg)
        );
    }

    #[test]
    fn panics_and_failures_become_codes_and_text() {
        assert_eq!(guard("f", || panic!("boom")), INTERNAL_ERROR);
        // SAFETY: the pointer is this thread's live last-error string.
        let t = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) };
        assert!(t.to_string_lossy().contains("boom"));
        assert_eq!(guard("g", || Err(usage("nope"))), INVALID_USAGE);
        // SAFETY: as above.
        let t = unsafe { std::ffi::CStr::from_ptr(last_error_ptr()) };
        assert_eq!(t.to_string_lossy(), "g: nope");
        assert_eq!(status_result(status::PEER_LOST), REMOTE_ERROR);
        assert_eq!(status_result(status::SHUTDOWN), SYSTEM_ERROR);
    }
}
