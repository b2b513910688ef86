//! The C-visible types: status codes, dtype and reduction codes, the unique id and the opaque
//! handles. Names are the C names (this module is the header's vocabulary).
#![allow(non_camel_case_types)]

use commd_client::{Buffer, Client, Communicator, Request};
use commd_proto::desc::OpKind;

/// The result of every commd call. On anything but COMMD_OK (and COMMD_IN_PROGRESS from
/// commd_request_test / commd_request_wait_timeout), commd_last_error() says what happened.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum commd_status_t {
    /// Success.
    COMMD_OK = 0,
    /// The request has not completed yet (commd_request_test, commd_request_wait_timeout).
    COMMD_IN_PROGRESS = 1,
    /// An argument was invalid: a NULL handle, an unknown dtype or reduction, a buffer range
    /// outside its allocation, a rank out of range, an unknown or reused unique id...
    COMMD_INVALID_ARGUMENT = 2,
    /// No daemon answers at the socket (the message names the path).
    COMMD_DAEMON_UNAVAILABLE = 3,
    /// The daemon exited or closed this session; open a new session once it is back.
    COMMD_DAEMON_LOST = 4,
    /// Ranks posted different ops (kind, dtype, count, root or reduction) at the same position.
    /// The communicator stays usable.
    COMMD_MISMATCH = 5,
    /// Another rank of the communicator died or destroyed it; the communicator is aborted.
    COMMD_PEER_LOST = 6,
    /// An op (or the communicator's creation) did not complete in time: the message names the
    /// ranks that never posted it / never joined.
    COMMD_TIMEOUT = 7,
    /// The daemon is shutting down.
    COMMD_SHUTDOWN = 8,
    /// The op was aborted because an earlier error aborted its communicator.
    COMMD_ABORTED = 9,
    /// An internal error (a bug in commd: please report the message).
    COMMD_INTERNAL = 10,
    /// A rank revoked the communicator (the message names it and why): its ops fail; it can
    /// still be shrunk.
    COMMD_REVOKED = 11,
}

impl commd_status_t {
    pub(crate) const ALL: [commd_status_t; 12] = [
        Self::COMMD_OK,
        Self::COMMD_IN_PROGRESS,
        Self::COMMD_INVALID_ARGUMENT,
        Self::COMMD_DAEMON_UNAVAILABLE,
        Self::COMMD_DAEMON_LOST,
        Self::COMMD_MISMATCH,
        Self::COMMD_PEER_LOST,
        Self::COMMD_TIMEOUT,
        Self::COMMD_SHUTDOWN,
        Self::COMMD_ABORTED,
        Self::COMMD_INTERNAL,
        Self::COMMD_REVOKED,
    ];

    /// The variant's name, NUL-terminated for C.
    pub(crate) fn name_nul(self) -> &'static str {
        match self {
            Self::COMMD_OK => "COMMD_OK\0",
            Self::COMMD_IN_PROGRESS => "COMMD_IN_PROGRESS\0",
            Self::COMMD_INVALID_ARGUMENT => "COMMD_INVALID_ARGUMENT\0",
            Self::COMMD_DAEMON_UNAVAILABLE => "COMMD_DAEMON_UNAVAILABLE\0",
            Self::COMMD_DAEMON_LOST => "COMMD_DAEMON_LOST\0",
            Self::COMMD_MISMATCH => "COMMD_MISMATCH\0",
            Self::COMMD_PEER_LOST => "COMMD_PEER_LOST\0",
            Self::COMMD_TIMEOUT => "COMMD_TIMEOUT\0",
            Self::COMMD_SHUTDOWN => "COMMD_SHUTDOWN\0",
            Self::COMMD_ABORTED => "COMMD_ABORTED\0",
            Self::COMMD_INTERNAL => "COMMD_INTERNAL\0",
            Self::COMMD_REVOKED => "COMMD_REVOKED\0",
        }
    }
}

/// An element type code (COMMD_FLOAT32, ...). A plain integer so that any value a caller
/// passes is well-defined: unknown codes are reported as COMMD_INVALID_ARGUMENT.
pub type commd_dtype_t = u32;
/// 32-bit IEEE float.
pub const COMMD_FLOAT32: commd_dtype_t = 1;
/// 64-bit IEEE float.
pub const COMMD_FLOAT64: commd_dtype_t = 2;
/// 16-bit IEEE float (reductions accumulate in float32).
pub const COMMD_FLOAT16: commd_dtype_t = 3;
/// bfloat16 (reductions accumulate in float32).
pub const COMMD_BFLOAT16: commd_dtype_t = 4;
/// Signed 8-bit integer (integer reductions wrap).
pub const COMMD_INT8: commd_dtype_t = 5;
/// Unsigned 8-bit integer.
pub const COMMD_UINT8: commd_dtype_t = 6;
/// Signed 32-bit integer.
pub const COMMD_INT32: commd_dtype_t = 7;
/// Signed 64-bit integer.
pub const COMMD_INT64: commd_dtype_t = 8;
/// Unsigned 32-bit integer (min, max and avg compare and divide unsigned).
pub const COMMD_UINT32: commd_dtype_t = 9;
/// Unsigned 64-bit integer.
pub const COMMD_UINT64: commd_dtype_t = 10;
/// fp8 E4M3 (OCP "fn", NCCL's ncclFloat8e4m3): reductions accumulate in float32 and store the
/// result rounded to nearest even, saturated to the largest finite value (448).
pub const COMMD_FLOAT8E4M3: commd_dtype_t = 11;
/// fp8 E5M2 (NCCL's ncclFloat8e5m2): as COMMD_FLOAT8E4M3, saturating at 57344.
pub const COMMD_FLOAT8E5M2: commd_dtype_t = 12;

/// A reduction code (COMMD_SUM, ...), a plain integer like commd_dtype_t.
pub type commd_redop_t = u32;
/// Sum.
pub const COMMD_SUM: commd_redop_t = 1;
/// Product.
pub const COMMD_PROD: commd_redop_t = 2;
/// Minimum.
pub const COMMD_MIN: commd_redop_t = 3;
/// Maximum.
pub const COMMD_MAX: commd_redop_t = 4;
/// Average (sum divided by the number of ranks).
pub const COMMD_AVG: commd_redop_t = 5;
/// Bitwise and (integer dtypes only).
pub const COMMD_BAND: commd_redop_t = 6;
/// Bitwise or (integer dtypes only).
pub const COMMD_BOR: commd_redop_t = 7;
/// Bitwise xor (integer dtypes only).
pub const COMMD_BXOR: commd_redop_t = 8;

/// Size in bytes of a commd_unique_id_t.
pub const COMMD_UNIQUE_ID_BYTES: usize = 128;

/// Names a communicator being created: rank 0 gets one with commd_get_unique_id and passes the
/// bytes to every rank (through a file, a pipe, MPI, a launcher...). Plain bytes: copy freely.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct commd_unique_id_t {
    pub bytes: [u8; COMMD_UNIQUE_ID_BYTES],
}

/// A session with the local daemon (one per process is typical). Communicators and buffers keep
/// their session alive: closing the session handle first is allowed.
pub struct commd_session_t {
    pub(crate) client: Client,
}

/// This process's rank in a communicator.
pub struct commd_comm_t {
    pub(crate) comm: Communicator,
}

/// Host memory shared with the daemon; ops name (buffer, byte offset) pairs.
pub struct commd_buffer_t {
    pub(crate) buf: Buffer,
}

/// A posted op. Free it with commd_request_free (waited or not).
pub struct commd_request_t {
    pub(crate) req: Request,
    pub(crate) kind: OpKind,
}

// The C API lets callers use every handle from any thread.
const _: () = {
    const fn thread_safe<T: Send + Sync>() {}
    thread_safe::<commd_session_t>();
    thread_safe::<commd_comm_t>();
    thread_safe::<commd_buffer_t>();
    thread_safe::<commd_request_t>();
};

#[cfg(test)]
mod tests {
    use super::*;
    use commd_proto::desc::{DType, RedOp, dtype, redop};

    /// The C codes are literals (cbindgen cannot evaluate paths); they must equal the wire codes.
    #[test]
    fn c_codes_are_the_wire_codes() {
        let dtypes = [
            (COMMD_FLOAT32, dtype::F32),
            (COMMD_FLOAT64, dtype::F64),
            (COMMD_FLOAT16, dtype::F16),
            (COMMD_BFLOAT16, dtype::BF16),
            (COMMD_INT8, dtype::I8),
            (COMMD_UINT8, dtype::U8),
            (COMMD_INT32, dtype::I32),
            (COMMD_INT64, dtype::I64),
            (COMMD_UINT32, dtype::U32),
            (COMMD_UINT64, dtype::U64),
            (COMMD_FLOAT8E4M3, dtype::F8E4M3),
            (COMMD_FLOAT8E5M2, dtype::F8E5M2),
        ];
        for (c, wire) in dtypes {
            assert_eq!(c, u32::from(wire));
            assert!(DType::from_code(wire).is_some());
        }
        let redops = [
            (COMMD_SUM, redop::SUM),
            (COMMD_PROD, redop::PROD),
            (COMMD_MIN, redop::MIN),
            (COMMD_MAX, redop::MAX),
            (COMMD_AVG, redop::AVG),
        ];
        for (c, wire) in redops {
            assert_eq!(c, u32::from(wire));
            assert!(RedOp::from_code(wire).is_some());
        }
        // Bitwise ops: whenever the wire codes know them, they must be these.
        for (c, name) in [
            (COMMD_BAND, "band"),
            (COMMD_BOR, "bor"),
            (COMMD_BXOR, "bxor"),
        ] {
            if let Some(r) = RedOp::from_code(u8::try_from(c).unwrap()) {
                assert!(
                    format!("{r:?}").to_lowercase().contains(&name[1..]),
                    "{c} is {r:?}"
                );
            }
        }
    }
}
