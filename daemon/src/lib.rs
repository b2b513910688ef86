//! The commd daemon library; `main.rs` is wiring over it.
//!
//! - [`config`]: the typed settings registry and its precedence rules.
//! - [`serve`]: start/stop of the daemon (sockets, threads, signals, exit codes).
//! - [`control`]: the local gRPC service; [`fdsock`]: the fd socket.
//! - [`daemon`]: daemon-wide state; [`session`]: per-client sessions and ring pollers;
//!   [`comm`]: communicators, matching and failure reports; [`pacing`]: the per-communicator
//!   cap on GPU copy bandwidth.
//! - [`engine`]: plans and their host-memory execution; [`shm`]: registered memory.
//! - [`bench`]: `commd bench`.
//! - [`issued`]: the unique ids issued and not yet used (bounded per uid).
//! - [`ranks`]: rank lists in messages (ranges, bounded).
//! - [`private`]: opening files in directories other users may write to (no symlinks).
//! - [`notify`]: readiness notification to systemd; [`health`]: `commd health`.
//! - [`telemetry`]: metrics, traces, logs, link counters, the admin service, `commd stat`.

pub mod bench;
pub mod comm;
pub mod config;
pub mod control;
pub mod cuda;
pub mod daemon;
pub mod engine;
pub mod exec;
pub mod fanout;
pub mod fdsock;
pub mod graphs;
pub mod health;
pub mod issued;
pub mod net;
pub mod notify;
pub mod pacing;
pub mod peer;
pub mod private;
pub mod ranks;
pub mod serve;
pub mod session;
pub mod shm;
pub mod switch;
pub mod telemetry;
