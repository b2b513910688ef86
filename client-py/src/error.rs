//! The Python exception hierarchy (`commd.CommError` and its subclasses) and the mapping of
//! `commd_client` errors onto it. Every binding that calls the client converts its error here.

use commd_client::{Error, OpErrorKind};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

create_exception!(
    commd,
    CommError,
    PyException,
    "Base class of every commd error."
);
create_exception!(
    commd,
    DaemonUnavailableError,
    CommError,
    "The commd daemon could not be reached (the message names the socket and how to start it)."
);
create_exception!(
    commd,
    DaemonLostError,
    CommError,
    "The daemon went away (exited or closed this session) while the client used it."
);
create_exception!(
    commd,
    MismatchError,
    CommError,
    "Ranks posted different collectives (op, dtype, count, root or reduction) at the same step."
);
create_exception!(
    commd,
    PeerLostError,
    CommError,
    "A rank of the communicator died or left."
);
create_exception!(
    commd,
    CommTimeoutError,
    CommError,
    "Some ranks never posted the op (or never joined) within the timeout."
);
create_exception!(
    commd,
    ShutdownError,
    CommError,
    "The daemon is shutting down."
);
create_exception!(
    commd,
    AbortedError,
    CommError,
    "The communicator was aborted by an earlier error or destroyed."
);
create_exception!(
    commd,
    RevokedError,
    AbortedError,
    "A rank revoked the communicator (the message names it and why); it can still be shrunk."
);
create_exception!(
    commd,
    InvalidOpError,
    CommError,
    "The daemon refused the op's arguments (bounds, dtype, reduction)."
);
create_exception!(
    commd,
    UnsupportedError,
    CommError,
    "commd cannot do this correctly yet (e.g. a GPU op during CUDA graph capture): refused."
);

/// Converts a client error to the matching Python exception.
pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match &e {
        Error::DaemonUnavailable { .. } => DaemonUnavailableError::new_err(msg),
        Error::DaemonLost { .. } => DaemonLostError::new_err(msg),
        Error::InvalidArgument(_) => PyValueError::new_err(msg),
        Error::Unsupported(_) => UnsupportedError::new_err(msg),
        _ => match e.op_kind() {
            Some(OpErrorKind::Mismatch) => MismatchError::new_err(msg),
            Some(OpErrorKind::PeerLost) => PeerLostError::new_err(msg),
            Some(OpErrorKind::Timeout) => CommTimeoutError::new_err(msg),
            Some(OpErrorKind::Shutdown) => ShutdownError::new_err(msg),
            Some(OpErrorKind::Aborted) => AbortedError::new_err(msg),
            Some(OpErrorKind::Revoked) => RevokedError::new_err(msg),
            Some(OpErrorKind::Invalid) => InvalidOpError::new_err(msg),
            Some(OpErrorKind::Internal) | None => CommError::new_err(msg),
        },
    }
}
