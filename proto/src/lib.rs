//! commd wire contracts shared by the daemon and every client.
//!
//! - [`pb`]: the gRPC control plane generated from `proto/commd/v1/*.proto` (tonic + prost).
//! - [`desc`]: the fixed-size `#[repr(C)]` descriptors posted through the rings, their codes, and
//!   the validation the daemon applies to every descriptor read from shared memory.
//! - [`ring`]: the shared-memory ring layout (header page, SQ/CQ control lines, doorbell page,
//!   descriptor arrays), versioned by a magic and [`ring::RING_ABI_VERSION`].
//! - [`fdproto`]: the small SOCK_SEQPACKET protocol that passes memfds between client and daemon
//!   (gRPC cannot carry file descriptors) and doubles as the session's liveness signal.
//! - [`uid`]: the opaque communicator unique id.
//!
//! This crate must not depend on the daemon or the client; it holds no policy beyond validation.
//! Unsafe code is confined to [`ring`] (raw shared memory) and [`futex`].

#![deny(unsafe_code)] // allowed only in the modules that say why

pub mod check;
pub mod desc;
pub mod fdproto;
pub mod fp8;
pub mod futex;
pub mod graph;
pub mod num;
pub mod ring;
pub mod uid;

/// Generated control-plane types and services (`package commd.v1`).
#[allow(clippy::all, missing_docs)]
pub mod pb {
    tonic::include_proto!("commd.v1");
}

/// The SwitchML controller API (`package switchml_proto`), for switch sessions.
#[allow(clippy::all, missing_docs)]
pub mod switchml_pb {
    tonic::include_proto!("switchml_proto");
}

/// The smallest nonzero GPU pacing cap (bytes per second) the daemon accepts, in
/// `CreateCommunicatorRequest.pacing_bytes_per_sec`, `SetCommPacingRequest` and its
/// `gpu_pacing_gbps` setting: anything lower is almost certainly a unit mistake (GB/s passed as
/// bytes/s) and would stall the communicator's GPU ops until they time out.
pub const MIN_PACING_BYTES_PER_SEC: u64 = 1_000_000;

/// Version of this crate; the client sends it in `Hello` and the daemon checks the major.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
