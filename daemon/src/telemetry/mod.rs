//! Observability: what the daemon chose and what it is doing, for operators.
//!
//! - [`links`]: per-link rx/tx byte and packet counters — **the API transports call** (below).
//! - [`metrics`](mod@metrics): the Prometheus registry (ops, bytes, latency, errors, IPC opens, and gauges read
//!   at scrape time) and [`http`]: the `/metrics` endpoint (`metrics_listen`).
//! - [`trace`]: `tracing` spans for sessions, communicator init and ops, exported over OTLP when
//!   `otlp_endpoint` is set (nothing is exported, and nothing fails, when it is not).
//! - [`ratelimit`]: repeated WARN lines of one kind limited per call site, with a summary.
//! - [`logging`]: the subscriber (`COMMD_DEBUG`, `COMMD_DEBUG_SUBSYS`, text or JSON lines) and the
//!   `NCCL_DEBUG=INFO`-style init lines: [`log_path`] names each path's transport and why.
//!
//! A foundation (daemon/src/lib.rs): it names no module above it. What reads daemon state for
//! metrics is `crate::report` (through [`metrics::Scrape`]); what a communicator logs of itself
//! is `crate::comm::report`; the `Admin` service is `crate::admin`, `commd stat` `crate::cli`.
//!
//! Must not: block, lock contended state or allocate on the data path (the hooks below are
//! atomics, or a read-locked lookup keyed by `&'static str`), or let an unreachable exporter or a
//! busy metrics port stop the daemon.
//!
//! # Hooks
//! Transports (network, RDMA, switch) call:
//! ```text
//! // once per path, when set up (peer connected, NIC port opened); same name = same counters:
//! let link = telemetry::register_link(LinkDesc { name: "tcp:10.0.0.2:7400", kind: "tcp", peer: "node-b", nic: "eth0" });
//! link.tx(bytes, packets);   // per send, two relaxed atomic adds
//! link.rx(bytes, packets);   // per receive
//! // at communicator init, for each path (or group of paths with the same choice):
//! telemetry::log_path(&comm.label(), "rank 0 -> rank 4", "TCP", "no RDMA device on this node");
//! ```
//! The rest is hooked already: `Posted::complete` → [`op_done`]; `comm::op_span` /
//! `comm::op_executed` → [`op_status`]; the GPU executor → [`op_status`] and
//! [`links::gpu_copy`]; `Daemon::hello`/`close_session` → [`session_opened`]/[`session_closed`];
//! `Daemon::join` → [`comm_joining`]; `comm::comm_formed` → [`comm_init_ended`]; `serve` →
//! `report::start` / [`shutdown`].

pub mod http;
pub mod links;
pub mod logging;
pub mod metrics;
pub mod ratelimit;
pub mod trace;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{LazyLock, Mutex};
use std::time::{Duration, Instant};

use commd_proto::desc::{Op, status};

pub use links::{Direction, Link, LinkDesc, LinkSnapshot, link_bytes, register_link};
pub use logging::log_path;
pub use metrics::metrics;

/// Transport names used as the `transport` label of op metrics and spans.
pub mod transport {
    /// Host shared memory: the daemon copies between the ranks' registered buffers.
    pub const SHM: &str = "shm";
    /// CUDA copy-engine pushes between GPUs (or within one).
    pub const CUDA: &str = "cuda_ce";
    /// Between daemons over TCP (multi-node communicators).
    pub const TCP: &str = "tcp";
}

pub use crate::config::{OtlpProtocol, TelemetrySettings as Settings};

/// Where /metrics is served, once [`start`] bound it.
static METRICS_ADDR: Mutex<Option<SocketAddr>> = Mutex::new(None);

/// Records where /metrics is served (by `report::start`, once bound).
pub fn set_metrics_addr(a: SocketAddr) {
    *METRICS_ADDR.lock().unwrap_or_else(|e| e.into_inner()) = Some(a);
}

pub fn metrics_addr() -> Option<SocketAddr> {
    *METRICS_ADDR.lock().unwrap_or_else(|e| e.into_inner())
}

/// Flushes and stops trace export (at daemon exit).
pub fn shutdown() {
    trace::shutdown();
}

/// Hook: one rank's op completed (any status), `latency` after it was posted.
#[inline]
pub fn op_done(op: &Op, transport: &'static str, st: u32, latency: Duration) {
    metrics().op_done(op, transport, st, latency);
}

/// Hook: records an op's final status on its span.
pub fn op_status(span: &tracing::Span, st: u32) {
    if span.is_disabled() {
        return;
    }
    span.record("status", status::name(st));
    if st != status::OK {
        span.record("otel.status_code", "ERROR");
    }
}

type SpanMap<K> = LazyLock<Mutex<HashMap<K, (tracing::Span, Instant)>>>;
/// Open session spans, by session id.
static SESSIONS: SpanMap<u64> = LazyLock::new(Default::default);
/// Communicators forming (first rank joined), by unique-id token.
static FORMING: SpanMap<[u8; 16]> = LazyLock::new(Default::default);
/// Joins that never form (every rank gave up) are forgotten beyond this many.
const MAX_FORMING: usize = 4096;

fn lock<K>(
    m: &'static SpanMap<K>,
) -> std::sync::MutexGuard<'static, HashMap<K, (tracing::Span, Instant)>> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Hook: a session opened (`Hello`).
pub fn session_opened(id: u64, uid: u32, pid: i32, name: &str) {
    metrics().session_opened();
    let span = tracing::info_span!(target: "commd::session", parent: None, "session",
        session = id, uid, pid, name, reason = tracing::field::Empty);
    if !span.is_disabled() {
        lock(&SESSIONS).insert(id, (span, Instant::now()));
    }
}

/// Hook: a session closed; ends its span.
pub fn session_closed(id: u64, reason: &str) {
    if let Some((span, _)) = lock(&SESSIONS).remove(&id) {
        span.record("reason", reason);
    }
}

/// Hook: the first rank joined a communicator (starts its init span).
pub fn comm_joining(token: &[u8; 16], nranks: u32) {
    let span = tracing::info_span!(target: "commd::init", parent: None, "comm_init",
        nranks, comm = tracing::field::Empty, comm_uid = tracing::field::Empty,
        local_ranks = tracing::field::Empty, nodes = tracing::field::Empty);
    let mut m = lock(&FORMING);
    if m.len() >= MAX_FORMING {
        m.clear();
    }
    m.insert(*token, (span, Instant::now()));
}

/// Hook: every rank joined: ends the communicator's init span (recording its id, uid, local
/// ranks and nodes) and returns when its first rank joined.
pub fn comm_init_ended(
    token: &[u8; 16],
    comm: u64,
    uid_short: &str,
    local_ranks: usize,
    nodes: usize,
) -> Option<Instant> {
    metrics().comm_formed();
    let (span, t0) = lock(&FORMING).remove(token)?;
    span.record("comm", comm);
    span.record("comm_uid", uid_short);
    span.record("local_ranks", local_ranks);
    span.record("nodes", nodes);
    Some(t0)
}
