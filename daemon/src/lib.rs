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
//!
//! Layers, from the top down; a module names types of its own layer or lower ones only, and
//! completions and wake-ups go up through channels, traits or plain data the lower layer owns:
//! 1. services and commands: `serve`, `control`, `fdsock`, `peer`, `exec`, `bench`, `health`,
//!    the CLI parts of `telemetry`;
//! 2. daemon state: `daemon`, `session`, `comm`, `issued`;
//! 3. executors: `engine` (host), `cuda` (GPU, with its persistent ops: `cuda::graphs`), `net`
//!    (transports and algorithms), `fanout`, `pacing`;
//! 4. foundations: `config`, the metrics/trace/log core of `telemetry`, `shm`, `ranks`,
//!    `private`, `notify`.
//!
//! The code does not follow this yet (issue 21): `scripts/check-layers` lists the dependencies
//! that lie on import cycles today (`scripts/layers-baseline.txt`) and fails the test command
//! when a new one appears.

pub mod admin;
pub mod cli;
pub mod comm;
pub mod config;
pub mod control;
pub mod cuda;
pub mod daemon;
pub mod engine;
pub mod exec;
pub mod exit;
pub mod fanout;
pub mod fdsock;
pub mod issued;
pub mod net;
pub mod notify;
pub mod pacing;
pub mod peer;
pub mod private;
pub mod ranks;
pub mod report;
pub mod serve;
pub mod session;
pub mod shm;
pub mod switch;
pub mod telemetry;
