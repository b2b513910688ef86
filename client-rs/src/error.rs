//! Client errors: each says what happened and what to do.

use std::path::PathBuf;

use commd_proto::desc::status;

/// The class of a failed op, from its completion status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpErrorKind {
    Invalid,
    Mismatch,
    PeerLost,
    Timeout,
    Shutdown,
    Aborted,
    /// A rank revoked the communicator (the message names it and why).
    Revoked,
    Internal,
}

impl OpErrorKind {
    pub fn from_status(s: u32) -> Self {
        match s {
            status::INVALID => Self::Invalid,
            status::MISMATCH => Self::Mismatch,
            status::PEER_LOST => Self::PeerLost,
            status::TIMEOUT => Self::Timeout,
            status::SHUTDOWN => Self::Shutdown,
            status::ABORTED => Self::Aborted,
            status::REVOKED => Self::Revoked,
            _ => Self::Internal,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Invalid => "invalid",
            Self::Mismatch => "mismatch",
            Self::PeerLost => "peer_lost",
            Self::Timeout => "timeout",
            Self::Shutdown => "shutdown",
            Self::Aborted => "aborted",
            Self::Revoked => "revoked",
            Self::Internal => "internal",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "cannot reach the commd daemon at {}: {reason}. Start it with `commd serve` (or `systemctl start commd`), or set COMMD_SOCKET to its socket path",
        path.display()
    )]
    DaemonUnavailable { path: PathBuf, reason: String },
    #[error("lost the commd daemon (session {session}): {reason}")]
    DaemonLost { session: u64, reason: String },
    #[error("{message}")]
    Op { kind: OpErrorKind, message: String },
    #[error("{op}: {message}")]
    Rpc {
        op: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The call is valid but commd cannot do it correctly in this state (e.g. a GPU op while
    /// its stream is being captured into a CUDA graph): refused rather than run wrongly
    /// (docs/contracts.md #6).
    #[error("not supported: {0}")]
    Unsupported(String),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("ring: {0}")]
    Ring(#[from] commd_proto::ring::RingError),
}

impl Error {
    /// The op-failure class, if this is a failed op.
    pub fn op_kind(&self) -> Option<OpErrorKind> {
        match self {
            Error::Op { kind, .. } => Some(*kind),
            Error::Rpc {
                code: tonic::Code::DeadlineExceeded,
                ..
            } => Some(OpErrorKind::Timeout),
            _ => None,
        }
    }

    /// A copy of this error (`std::io::Error` is not `Clone`; its kind and text are kept).
    pub fn duplicate(&self) -> Self {
        match self {
            Error::DaemonUnavailable { path, reason } => Error::DaemonUnavailable {
                path: path.clone(),
                reason: reason.clone(),
            },
            Error::DaemonLost { session, reason } => Error::DaemonLost {
                session: *session,
                reason: reason.clone(),
            },
            Error::Op { kind, message } => Error::Op {
                kind: *kind,
                message: message.clone(),
            },
            Error::Rpc { op, code, message } => Error::Rpc {
                op,
                code: *code,
                message: message.clone(),
            },
            Error::InvalidArgument(m) => Error::InvalidArgument(m.clone()),
            Error::Unsupported(m) => Error::Unsupported(m.clone()),
            Error::Io(e) => Error::Io(std::io::Error::new(e.kind(), e.to_string())),
            Error::Ring(e) => Error::InvalidArgument(format!("ring: {e}")),
        }
    }

    pub(crate) fn rpc(op: &'static str, s: tonic::Status) -> Self {
        Error::Rpc {
            op,
            code: s.code(),
            message: s.message().to_string(),
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
