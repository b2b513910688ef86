//! The commd daemon library; `main.rs` is wiring over it (the command line, then one call here).
//!
//! Layers, from the top down. A module names types of its own layer or lower ones only, and no
//! two modules reach each other; completions and wake-ups go up through channels, traits or
//! plain data the lower layer owns (`cuda::Client`/`Done`, `comm::Origin`,
//! `telemetry::metrics::Scrape`). `scripts/check-layers` (run by the test command) fails on an
//! upward dependency, a cycle, or a module without a layer:
//! 1. services and commands: [`serve`] (start/stop: sockets, threads, signals), [`control`]
//!    (the local gRPC service), [`accept`] (its connections: per-uid cap, accept back-off),
//!    [`fdsock`] (the fd socket), [`peer`] (the peer service),
//!    [`admin`] (the admin service), [`report`] (daemon state as metrics, telemetry's start),
//!    [`cli`] (`commd bench`, `health`, `stat`, `switch`), [`exec`];
//! 2. daemon state: [`daemon`] (daemon-wide state), [`session`] (per-client sessions and ring
//!    pollers), [`comm`] (communicators, matching and failure reports), [`issued`] (unique ids
//!    issued and not yet used);
//! 3. executors: [`engine`] (host memory), [`cuda`] (GPU copies, persistent ops), [`net`]
//!    (transports and algorithms across nodes, the peer client), [`switch`] (in-network
//!    aggregation, this daemon's side: session bring-up and data-plane workers), [`fanout`],
//!    [`posted`] (a
//!    posted op, which all of them complete);
//! 4. foundations: [`config`] (the typed settings registry and its precedence rules),
//!    [`telemetry`] (metrics, traces, logs, link counters), [`shm`] (registered memory),
//!    [`ranks`] (rank lists in messages), [`notify`] (readiness notification to systemd),
//!    [`exit`] (exit codes), [`pacing`] (the per-communicator cap on GPU copy bandwidth).
//!
//! Below the daemon, in crates of their own: `commd-switch` (the SwitchML packet format and
//! aggregation semantics, batched UDP I/O, and the software switch `commd switch` runs; the
//! daemon uses its protocol types and I/O), `commd-host` (paths no other user can redirect,
//! host-wide CPU-core claims, the default socket path), `commd-proto` (the wire contracts).

#![deny(unsafe_code)] // allowed only in the modules that say why

pub mod accept;
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
pub mod posted;
pub mod ranks;
pub mod report;
pub mod serve;
pub mod session;
pub mod shm;
pub mod switch;
pub mod telemetry;
