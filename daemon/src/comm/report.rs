//! How a communicator describes itself through telemetry: the span of each matched op, the
//! init lines of a formed communicator and of each rank's GPU, and the paths its data takes
//! (logged, and returned to its ranks).
//!
//! May use: `comm` itself, `cuda` (GPUs and links), `engine` (traffic), `net` (transport
//! summary), `telemetry`.

use commd_proto::desc::status;

use super::{Comm, Posted};
use crate::telemetry::{self, links, log_path};

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
                u64::try_from(last.posted_at.saturating_duration_since(t0).as_micros())
                    .unwrap_or(u64::MAX),
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
    telemetry::op_status(span, if ok { status::OK } else { status::INTERNAL });
}

/// Hook: every rank joined and the communicator formed: ends the init span and logs the
/// communicator and the transport of its paths (as `NCCL_DEBUG=INFO` does at init).
pub fn comm_formed(comm: &Comm, token: &[u8; 16]) {
    let n = comm.nranks;
    let nodes = comm_nodes(comm);
    let local = &comm.local;
    let started = telemetry::comm_init_ended(token, comm.id, &comm.uid_short, local.len(), nodes);
    let took = started
        .map(|t| format!(" in {:.1} ms", t.elapsed().as_secs_f64() * 1e3))
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

/// Whether two of the communicator's ranks on this node are one process (threads of one
/// process, or one thread driving several GPUs as `ncclCommInitAll` does): a client then keeps
/// its ops off paths whose setup blocks a rank until every rank takes part
/// (`CreateCommunicatorReply.ranks_share_a_process`).
pub fn ranks_share_a_process(comm: &Comm) -> bool {
    let mut pids: Vec<i32> = comm
        .members
        .iter()
        .filter(|m| m.local)
        .map(|m| m.pid)
        .collect();
    let n = pids.len();
    pids.sort_unstable();
    pids.dedup();
    pids.len() < n
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
