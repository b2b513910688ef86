//! Error reporting across the C boundary: status codes from `commd_client::Error`, the
//! thread-local last-error message, and the guard every entry point runs in (no panic unwinds
//! into C).

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use commd_client::{Error, OpErrorKind};

use crate::types::commd_status_t;
use crate::types::commd_status_t::*;

/// A failed call: its status and the message for `commd_last_error`.
#[derive(Debug)]
pub(crate) struct Failure {
    pub status: commd_status_t,
    pub message: String,
}

pub(crate) type Outcome<T = ()> = Result<T, Failure>;

pub(crate) fn invalid(message: impl Into<String>) -> Failure {
    Failure {
        status: COMMD_INVALID_ARGUMENT,
        message: message.into(),
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Self {
        Failure {
            status: classify(&e),
            message: e.to_string(),
        }
    }
}

/// The C status for a client error.
pub(crate) fn classify(e: &Error) -> commd_status_t {
    match e {
        Error::DaemonUnavailable { .. } => COMMD_DAEMON_UNAVAILABLE,
        Error::DaemonLost { .. } => COMMD_DAEMON_LOST,
        Error::Op { kind, .. } => match kind {
            OpErrorKind::Invalid => COMMD_INVALID_ARGUMENT,
            OpErrorKind::Mismatch => COMMD_MISMATCH,
            OpErrorKind::PeerLost => COMMD_PEER_LOST,
            OpErrorKind::Timeout => COMMD_TIMEOUT,
            OpErrorKind::Shutdown => COMMD_SHUTDOWN,
            OpErrorKind::Aborted => COMMD_ABORTED,
            OpErrorKind::Revoked => COMMD_REVOKED,
            OpErrorKind::Internal => COMMD_INTERNAL,
        },
        Error::Rpc { code, message, .. } => {
            use tonic::Code;
            match code {
                Code::DeadlineExceeded => COMMD_TIMEOUT,
                Code::InvalidArgument
                | Code::NotFound
                | Code::AlreadyExists
                | Code::FailedPrecondition
                | Code::OutOfRange
                | Code::PermissionDenied
                | Code::ResourceExhausted => COMMD_INVALID_ARGUMENT,
                // The daemon answers Unavailable while shutting down and when a rank dies during
                // a communicator's rendezvous; the transport answers Unavailable/Unknown/
                // Cancelled when the daemon itself went away. The daemon's wording is the only
                // thing that tells these apart on the wire.
                Code::Unavailable if message.contains("shutting down") => COMMD_SHUTDOWN,
                Code::Unavailable if message.contains("exited while the communicator") => {
                    COMMD_PEER_LOST
                }
                Code::Unavailable | Code::Unknown | Code::Cancelled => COMMD_DAEMON_LOST,
                _ => COMMD_INTERNAL,
            }
        }
        Error::InvalidArgument(_) | Error::Unsupported(_) => COMMD_INVALID_ARGUMENT,
        Error::Io(_) | Error::Ring(_) => COMMD_INTERNAL,
    }
}

pub(crate) use commd_abi::last_error_ptr;
#[cfg(test)]
use commd_abi::set_last_error;

#[cfg(test)]
pub(crate) fn last_error_string() -> String {
    commd_abi::last_error()
}

/// Runs the body of the entry point `func` under the ABIs' shared guard (`commd_abi::guard`):
/// a failure becomes its status and message, a panic COMMD_INTERNAL, so nothing unwinds into C.
pub(crate) fn ffi(func: &str, body: impl FnOnce() -> Outcome<commd_status_t>) -> commd_status_t {
    commd_abi::guard(
        func,
        COMMD_INTERNAL,
        |_| {},
        || body().map_err(|f| (f.status, f.message)),
    )
}

/// For entry points that return no status (free/close): failures only set the message.
pub(crate) fn ffi_void(func: &str, body: impl FnOnce()) {
    ffi(func, || {
        body();
        Ok(COMMD_OK)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_become_internal_errors() {
        let s = ffi("commd_test", || panic!("boom"));
        assert_eq!(s, COMMD_INTERNAL);
        let m = last_error_string();
        assert!(m.contains("commd_test") && m.contains("boom"), "{m}");
    }

    #[test]
    fn failures_keep_their_status_and_name_the_function() {
        let s = ffi("commd_x", || Err(invalid("count is wrong")));
        assert_eq!(s, COMMD_INVALID_ARGUMENT);
        assert_eq!(last_error_string(), "commd_x: count is wrong");
        set_last_error("a\0b");
        assert_eq!(last_error_string(), "a\\0b");
    }

    #[test]
    fn rpc_codes_map_to_statuses() {
        let rpc = |code, message: &str| Error::Rpc {
            op: "create_communicator",
            code,
            message: message.into(),
        };
        use tonic::Code;
        assert_eq!(
            classify(&rpc(Code::DeadlineExceeded, "ranks 1 never joined")),
            COMMD_TIMEOUT
        );
        assert_eq!(
            classify(&rpc(Code::NotFound, "unknown id")),
            COMMD_INVALID_ARGUMENT
        );
        assert_eq!(
            classify(&rpc(Code::Unavailable, "daemon is shutting down")),
            COMMD_SHUTDOWN
        );
        assert_eq!(
            classify(&rpc(
                Code::Unavailable,
                "rank 1 (pid 7) exited while the communicator was forming: x"
            )),
            COMMD_PEER_LOST
        );
        assert_eq!(
            classify(&rpc(Code::Unavailable, "transport error")),
            COMMD_DAEMON_LOST
        );
        assert_eq!(
            classify(&Error::Op {
                kind: OpErrorKind::Mismatch,
                message: String::new()
            }),
            COMMD_MISMATCH
        );
    }
}
