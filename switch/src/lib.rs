//! SwitchML-compatible in-network aggregation, the switch's side (see
//! `../shared/specs/switchml.md` and docs/switch.md), apart from the daemon:
//! - [`packet`]: the UDP packet format and block floating point (the protocol both sides speak);
//! - [`agg`]: the switch's per-slot aggregation semantics;
//! - [`udpio`]: batched UDP I/O (GSO/GRO) and its [`udpio::Stats`] counters, for the switch and
//!   the daemon's workers;
//! - [`server`]: `commd switch`, the software switch (controller gRPC API and data plane).
//!
//! The daemon's side of a session (bring-up through the controller, the data-plane workers)
//! lives in the daemon (`commd_daemon::switch`) and uses [`packet`] and [`udpio`] from here.
//!
//! Depends on `commd-proto` (the controller's protobuf types) and `commd-host` (CPU claims).

#![deny(unsafe_code)] // allowed only in the modules that say why

pub mod agg;
pub mod packet;
pub mod server;
pub mod udpio;
