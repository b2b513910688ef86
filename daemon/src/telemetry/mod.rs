//! Observability: what the daemon chose and what it is doing, for operators.
//!
//! - [`links`]: per-link rx/tx byte and packet counters — **the API transports call** (below).
//! - [`metrics`]: the Prometheus registry (ops, bytes, latency, errors, IPC opens, and gauges read
//!   at scrape time) and [`http`]: the `/metrics` endpoint (`metrics_listen`).
//! - [`trace`]: `tracing` spans for sessions, communicator init and ops, exported over OTLP when
//!   `otlp_endpoint` is set (nothing is exported, and nothing fails, when it is not).
//! - [`logging`]: the subscriber (`COMMD_DEBUG`, `COMMD_DEBUG_SUBSYS`, text or JSON lines) and the
//!   `NCCL_DEBUG=INFO`-style init lines: [`log_path`] names each path's transport and why.
//! - [`admin`]: the `Admin` gRPC service (caller must have the daemon's uid, or be root);
//!   [`cli`]: `commd status` and `commd stat -l` over it.
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
//! The rest is hooked already: `Posted::complete` → [`op_done`]; `Comm::run_step` →
//! [`op_span`] / [`op_executed`]; the GPU executor → [`op_status`] and [`links::gpu_copy`];
//! `Daemon::hello`/`close_session` → [`session_opened`]/[`session_closed`]; `Daemon::join`/`form`
//! → [`comm_joining`]/[`comm_formed`]; `Daemon::comm_scratch` → [`comm_device`]; `serve` →
//! [`start`]/[`shutdown`].

pub mod http;
pub mod links;
pub mod logging;
pub mod metrics;
pub mod trace;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

use commd_proto::desc::{Op, status};

use crate::comm::{Comm, Posted};
use crate::daemon::Daemon;

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

pub fn metrics_addr() -> Option<SocketAddr> {
    *METRICS_ADDR.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the daemon's telemetry: links of this node, the scrape-time collector, and the
/// /metrics server. Must run inside the control plane's tokio runtime. A port that cannot be
/// bound is logged as an error and leaves the daemon serving without metrics.
pub fn start(d: &Arc<Daemon>) {
    metrics().attach(d);
    links::shm();
    if let Ok(c) = crate::cuda::get() {
        let p2p: Vec<(usize, usize, bool)> =
            c.links.iter().map(|l| (l.from, l.to, l.p2p)).collect();
        links::register_gpus(c.gpus.len(), |a, b| {
            match p2p.iter().find(|(f, t, _)| *f == a && *t == b) {
                Some((_, _, true)) => "cuda_p2p",
                _ => "cuda_staged",
            }
        });
    }
    let Some(addr) = d.cfg.telemetry.metrics_listen else {
        tracing::info!(target: "commd::telemetry", "metrics: off (metrics_listen = off)");
        return;
    };
    let bound = std::net::TcpListener::bind(addr).and_then(|l| {
        l.set_nonblocking(true)?;
        let local = l.local_addr()?;
        Ok((tokio::net::TcpListener::from_std(l)?, local))
    });
    match bound {
        Ok((l, local)) => {
            *METRICS_ADDR.lock().unwrap_or_else(|e| e.into_inner()) = Some(local);
            tracing::info!(target: "commd::telemetry", "serving Prometheus metrics on http://{local}/metrics");
            tokio::spawn(http::serve(l));
        }
        Err(e) => {
            tracing::error!(target: "commd::telemetry", "metrics disabled: cannot listen on {addr} (metrics_listen): {e}; the daemon serves without /metrics");
        }
    }
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

/// Hook: the span of a matched op (collective: one op per rank; p2p: `[send, recv]`). Disabled
/// (and free) unless a subscriber wants `commd::op` spans: trace export, or `COMMD_DEBUG=TRACE`.
/// Records how long the first rank waited for the last (`wait_us`) and who was last.
pub fn op_span(
    comm: &Comm,
    ops: &[Posted],
    algorithm: &'static str,
    transport: &'static str,
) -> tracing::Span {
    let Some(first) = ops.first() else {
        return tracing::Span::none();
    };
    let o = &first.op;
    let name = if o.kind.is_p2p() {
        "send_recv"
    } else {
        o.kind.name()
    };
    let span = tracing::info_span!(target: "commd::op", parent: None, "op",
        otel.name = name, otel.status_code = tracing::field::Empty,
        comm = comm.id, comm_uid = %comm.uid_short, nranks = comm.nranks, seq = first.seq,
        op = name, dtype = o.dtype.name(), count = o.count, bytes = o.count.saturating_mul(o.dtype.size()),
        algorithm, transport, wait_us = tracing::field::Empty, last_rank = tracing::field::Empty,
        status = tracing::field::Empty);
    if !span.is_disabled() {
        let first_post = ops.iter().map(|p| p.posted_at).min();
        if let (Some(t0), Some(last)) = (first_post, ops.iter().max_by_key(|p| p.posted_at)) {
            span.record(
                "wait_us",
                last.posted_at.saturating_duration_since(t0).as_micros() as u64,
            );
            span.record("last_rank", last.rank);
        }
    }
    span
}

/// Hook: a host plan ran; counts its shared-memory traffic and records the op's status.
pub fn op_executed(span: &tracing::Span, t: &crate::engine::Traffic, ok: bool) {
    if ok {
        let l = links::shm();
        l.rx(t.read_bytes, t.read_ranges);
        l.tx(t.written_bytes, t.written_ranges);
    }
    op_status(span, if ok { status::OK } else { status::INTERNAL });
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

/// Hook: every rank joined and the communicator formed: ends the init span and logs the
/// communicator and the transport of its paths (as `NCCL_DEBUG=INFO` does at init).
pub fn comm_formed(comm: &Comm, token: &[u8; 16]) {
    metrics().comm_formed();
    let started = lock(&FORMING).remove(token);
    let n = comm.nranks;
    let nodes = comm_nodes(comm);
    let local = &comm.local;
    if let Some((span, _)) = &started {
        span.record("comm", comm.id);
        span.record("comm_uid", comm.uid_short.as_str());
        span.record("local_ranks", local.len());
        span.record("nodes", nodes);
    }
    let took = started
        .as_ref()
        .map(|(_, t)| format!(" in {:.1} ms", t.elapsed().as_secs_f64() * 1e3))
        .unwrap_or_default();
    let pids: Vec<String> = local
        .iter()
        .filter_map(|&r| comm.members.get(r as usize))
        .map(|m| m.pid.to_string())
        .collect();
    let label = comm.label();
    let local_text = ranks_text(local);
    tracing::info!(target: "commd::init", comm = comm.id, nranks = n, nodes, local_ranks = local.len(),
        "{label}: init done{took}: nranks {n}, nodes {nodes}, local ranks {local_text} (pids {}), op timeout {:.1} s",
        pids.join(","),
        comm.op_timeout.as_secs_f64());
    for (path, transport, reason) in host_paths(comm) {
        log_path(&label, &path, &transport, &reason);
    }
}

/// The host-memory paths of a communicator on this node: (path, transport, why).
fn host_paths(comm: &Comm) -> Vec<(String, String, String)> {
    let local_text = ranks_text(&comm.local);
    let nodes = comm_nodes(comm);
    let mut v = Vec::new();
    if comm.local.len() > 1 {
        v.push((
            format!("{local_text} (every local pair)"),
            "SHM".to_string(),
            "the ranks are on this node: host buffers move through shared memory, copied by the daemon (GPU buffers: see the device lines once each rank binds its GPU)".to_string(),
        ));
    }
    if nodes > 1 {
        let (transport, why) = crate::net::rdma::summary();
        v.push((
            format!("{local_text} <-> ranks on {} other node(s)", nodes - 1),
            transport.to_string(),
            why.to_string(),
        ));
    }
    v
}

/// The lines `comm_formed` logs for a communicator's paths, for its ranks to print
/// (`CreateCommunicatorReply.paths`).
pub fn comm_paths(comm: &Comm) -> Vec<String> {
    host_paths(comm)
        .into_iter()
        .map(|(p, t, r)| format!("{p} via {t}: {r}"))
        .collect()
}

/// Nodes a communicator spans (1 unless it has a network thread).
pub fn comm_nodes(comm: &Comm) -> usize {
    comm.net
        .get()
        .map(|h| h.topo.nodes.len())
        .unwrap_or(1)
        .max(1)
}

/// "0-3", "0-1", "0,2,5", "0" (crate::ranks::list, with a pair of neighbours as a range, as
/// the init log has always printed it).
fn ranks_text(rs: &[u32]) -> String {
    match rs {
        [a, b] if *b == a + 1 => format!("{a}-{b}"),
        _ => crate::ranks::list(rs),
    }
}

/// Hook: `rank` of `comm` bound its GPU scratch (`scratch[r]`: each rank's, once bound). Logs
/// the rank's device and, once every rank has one, each GPU pair's path and why.
pub fn comm_device(comm: &Comm, rank: u32, scratch: &[Option<crate::cuda::GpuSpan>]) {
    let Ok(c) = crate::cuda::get() else { return };
    let label = comm.label();
    let gpu_of = |r: usize| scratch.get(r).and_then(|s| s.as_ref()).map(|s| s.mem.gpu);
    if let Some(g) = gpu_of(rank as usize)
        && let Some(gpu) = c.gpus.get(g)
    {
        tracing::info!(target: "commd::init", comm = comm.id, rank, gpu = g,
            "{label}: rank {rank} uses GPU {g} ({}, bus {})", gpu.name, gpu.pci_bus_id);
    }
    let gpus: Option<Vec<usize>> = (0..comm.nranks as usize).map(gpu_of).collect();
    let Some(gpus) = gpus else { return };
    if comm.nranks < 2 {
        return;
    }
    for (a, &ga) in gpus.iter().enumerate() {
        for (b, &gb) in gpus.iter().enumerate() {
            if a == b {
                continue;
            }
            let path = format!("rank {a} (GPU {ga}) -> rank {b} (GPU {gb})");
            if ga == gb {
                log_path(
                    &label,
                    &path,
                    "CE local",
                    "both ranks use the same GPU: device-local copy-engine copies",
                );
                continue;
            }
            match c.links.iter().find(|l| l.from == ga && l.to == gb) {
                Some(l) if l.p2p => log_path(
                    &label,
                    &path,
                    "P2P/CE",
                    &format!(
                        "{} (peer access on, driver perf rank {})",
                        l.path, l.performance_rank
                    ),
                ),
                Some(l) => log_path(&label, &path, "host staging", &l.path),
                None => log_path(
                    &label,
                    &path,
                    "unknown",
                    "no topology entry for this GPU pair",
                ),
            }
        }
    }
}
