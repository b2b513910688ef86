//! `commd status` (details through the admin service) and `commd stat -l` (live per-link
//! traffic): the client side. Prints and returns exit codes; `main.rs` only dispatches.

use std::path::Path;
use std::time::Duration;

use commd_proto::pb::{self, admin_client::AdminClient};
use serde_json::json;
use tonic::transport::Channel;

use crate::config::Config;
use crate::exit;

/// A tokio runtime and a channel to the daemon's socket (no session is opened).
fn connect(socket: &Path) -> Result<(tokio::runtime::Runtime, AdminClient<Channel>), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let ch = commd_client::uds_channel(&rt, socket).map_err(|m| {
        format!(
            "cannot reach the commd daemon at {}: {m} (is `commd serve` running? --socket/COMMD_SOCKET pick another)",
            socket.display()
        )
    })?;
    Ok((rt, AdminClient::new(ch).max_decoding_message_size(64 << 20)))
}

fn rpc_error(what: &str, s: &tonic::Status) -> String {
    if s.code() == tonic::Code::PermissionDenied {
        s.message().to_string()
    } else {
        format!("{what}: {} ({:?})", s.message(), s.code())
    }
}

/// `commd status` through the admin service. `None`: the caller may not use it (the message
/// was printed); fall back to the job API's `Status`.
pub fn status(cfg: &Config, as_json: bool) -> Option<i32> {
    let (rt, mut c) = match connect(&cfg.socket) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("commd status: {e}");
            return Some(exit::RUNTIME);
        }
    };
    let r = match rt.block_on(c.get_status(pb::AdminStatusRequest {})) {
        Ok(r) => r.into_inner(),
        Err(s) if s.code() == tonic::Code::PermissionDenied => {
            eprintln!(
                "commd status: communicator details unavailable: {}",
                s.message()
            );
            return None;
        }
        Err(s) => {
            eprintln!("commd status: {}", rpc_error("status", &s));
            return Some(exit::RUNTIME);
        }
    };
    if as_json {
        println!("{}", status_json(&r));
    } else {
        print!("{}", status_text(&r));
    }
    Some(exit::OK)
}

use crate::ranks::text as ranks;

pub fn status_json(r: &pb::AdminStatusReply) -> serde_json::Value {
    let d = r.daemon.clone().unwrap_or_default();
    let sessions: Vec<_> = d
        .session_list
        .iter()
        .map(|x| json!({"session_id": x.session_id, "uid": x.uid, "pid": x.pid, "name": x.name,
            "communicators": x.communicators, "registrations": x.registrations, "mapped_bytes": x.mapped_bytes,
            "ops_completed": x.ops_completed, "ops_failed": x.ops_failed}))
        .collect();
    let comms: Vec<_> = r
        .communicators
        .iter()
        .map(|c| {
            let ranks: Vec<_> = c.ranks.iter().map(|k| json!({"rank": k.rank, "pid": k.pid,
                "session_id": k.session_id, "collectives_posted": k.collectives_posted, "queued": k.queued,
                "gpu": (k.gpu >= 0).then_some(k.gpu), "oldest_pending": k.oldest_pending})).collect();
            let oldest = c.oldest.as_ref().map(|s| json!({"op": s.op, "seq": s.seq, "p2p": s.p2p,
                "what": s.what, "age_ms": s.age_ms, "rank": s.rank, "posted": s.posted, "missing": s.missing}));
            json!({"comm_id": c.comm_id, "unique_id": c.unique_id, "label": c.label, "name": c.name, "nranks": c.nranks,
                "local_ranks": c.local_ranks, "nodes": c.nodes, "op_timeout_ms": c.op_timeout_ms,
                "pending_ops": c.pending_ops, "broken": c.broken, "switch": c.switch,
                "pacing_bytes_per_sec": (c.pacing_bytes_per_sec > 0).then_some(c.pacing_bytes_per_sec),
                "pacing_delayed_us": c.pacing_delayed_us, "ranks": ranks, "oldest": oldest,
                "parent_comm_id": (c.parent_comm_id > 0).then_some(c.parent_comm_id),
                "excluded": c.excluded})
        })
        .collect();
    json!({"daemon_version": d.daemon_version, "pid": d.pid, "daemon_uid": r.daemon_uid, "uptime_ms": d.uptime_ms,
        "sessions": d.session_list.len(), "communicators": d.communicators, "registrations": d.registrations,
        "mapped_bytes": d.mapped_bytes, "ops_completed": d.ops_completed, "ops_failed": d.ops_failed,
        "pending_joins": d.pending_joins, "workers": d.workers, "session_list": sessions,
        "metrics_listen": r.metrics_listen, "otlp_endpoint": r.otlp_endpoint, "communicator_list": comms,
        "cpu_claims": r.cpu_claims, "cuda_available": d.cuda_available, "gpus": d.gpus,
        "ipc_opens": d.ipc_opens, "ipc_cache_hits": d.ipc_cache_hits, "ipc_open_us": d.ipc_open_us,
        "ipc_open_now": d.ipc_open_now, "gpu_ops": d.gpu_ops})
}

/// "uid 1000: 3 sessions, 2 communicators, 4 registrations (1048576 bytes), 10 ops": what each
/// user holds, for the per-uid limits (`max_sessions_per_uid`, `max_unique_ids_per_uid`).
pub fn uid_usage(sessions: &[pb::SessionInfo]) -> Vec<String> {
    let mut by: std::collections::BTreeMap<u32, (u32, u32, u32, u64, u64)> = Default::default();
    for x in sessions {
        let e = by.entry(x.uid).or_default();
        e.0 += 1;
        e.1 += x.communicators;
        e.2 += x.registrations;
        e.3 += x.mapped_bytes;
        e.4 += x.ops_completed + x.ops_failed;
    }
    by.into_iter()
        .map(|(uid, (s, c, r, b, ops))| {
            format!(
                "uid {uid}: {s} session(s), {c} communicator(s), {r} registration(s) ({b} bytes), {ops} ops"
            )
        })
        .collect()
}

pub fn status_text(r: &pb::AdminStatusReply) -> String {
    use std::fmt::Write;
    let d = r.daemon.clone().unwrap_or_default();
    let mut o = String::new();
    let _ = writeln!(
        o,
        "commd {} pid {} up {:.1}s: {} sessions, {} communicators ({} forming), {} registrations ({} bytes), ops {} ok / {} failed",
        d.daemon_version,
        d.pid,
        d.uptime_ms as f64 / 1e3,
        d.session_list.len(),
        d.communicators,
        d.pending_joins,
        d.registrations,
        d.mapped_bytes,
        d.ops_completed,
        d.ops_failed
    );
    let metrics = if r.metrics_listen.is_empty() {
        "off".to_string()
    } else {
        format!("http://{}/metrics", r.metrics_listen)
    };
    let traces = if r.otlp_endpoint.is_empty() {
        "off"
    } else {
        r.otlp_endpoint.as_str()
    };
    let _ = writeln!(o, "metrics: {metrics}; traces: {traces}");
    for line in uid_usage(&d.session_list) {
        let _ = writeln!(o, "{line}");
    }
    for x in &d.session_list {
        let _ = writeln!(o, "{}", session_line(x));
    }
    if !r.cpu_claims.is_empty() {
        let _ = writeln!(o, "polling threads pinned on this host:");
        for c in &r.cpu_claims {
            let _ = writeln!(o, "  {c}");
        }
    }
    for c in &r.communicators {
        let pacing = match c.pacing_bytes_per_sec {
            0 => "uncapped".to_string(),
            r => format!(
                "{} GB/s, held back {:.3} s",
                crate::pacing::gbps_text(r),
                c.pacing_delayed_us as f64 / 1e6
            ),
        };
        let _ = writeln!(
            o,
            "{}: {} local ranks on {} node(s), {} ops pending, op timeout {:.1} s, GPU pacing {pacing}",
            c.label,
            c.local_ranks,
            c.nodes,
            c.pending_ops,
            c.op_timeout_ms as f64 / 1e3
        );
        for k in &c.ranks {
            let gpu = if k.gpu >= 0 {
                format!(" GPU {}", k.gpu)
            } else {
                String::new()
            };
            let pending = if k.oldest_pending.is_empty() {
                String::new()
            } else {
                format!(", oldest pending: {}", k.oldest_pending)
            };
            let _ = writeln!(
                o,
                "  rank {:>3} pid {:>7} session {:>4}{gpu}: {} collectives posted, {} queued{pending}",
                k.rank, k.pid, k.session_id, k.collectives_posted, k.queued
            );
        }
        if c.parent_comm_id > 0 {
            let _ = writeln!(
                o,
                "  shrunk from comm {} without ranks [{}]",
                c.parent_comm_id,
                crate::ranks::list(&c.excluded)
            );
        }
        if !c.switch.is_empty() {
            let _ = writeln!(o, "  switch: {}", c.switch);
        }
        if !c.broken.is_empty() {
            let _ = writeln!(o, "  BROKEN: {}", c.broken);
        }
        if let Some(s) = &c.oldest {
            let pid = |r: u32| {
                c.ranks
                    .iter()
                    .find(|k| k.rank == r)
                    .map(|k| k.pid)
                    .unwrap_or(0)
            };
            let missing: Vec<String> = s
                .missing
                .iter()
                .map(|&r| {
                    let blocked = c
                        .ranks
                        .iter()
                        .find(|k| k.rank == r && !k.oldest_pending.is_empty())
                        .map(|k| format!(", blocked in {}", k.oldest_pending))
                        .unwrap_or_default();
                    format!("rank {r} (pid {}{blocked})", pid(r))
                })
                .collect();
            let waiting = if s.missing.is_empty() {
                "every rank posted it; it waits for earlier work".to_string()
            } else {
                format!("waiting for {}", missing.join(", "))
            };
            let _ = writeln!(
                o,
                "  {} {} for {:.1} s: posted by {}; {waiting}",
                if s.age_ms >= 1000 { "STUCK" } else { "pending" },
                s.what,
                s.age_ms as f64 / 1e3,
                ranks(&s.posted)
            );
        }
    }
    o
}

/// `commd stat`.
#[derive(clap::Args, Debug, Clone)]
pub struct StatArgs {
    /// Per-link traffic: rx/tx bytes and packets per second for every link (shared memory, GPU
    /// copy-engine paths, network peers and NICs); the default and only view today.
    #[arg(short = 'l', long = "links")]
    pub links: bool,
    /// Seconds between samples (fractions allowed).
    #[arg(short = 'i', long, default_value_t = 1.0)]
    pub interval: f64,
    /// Stop after this many samples (default: until Ctrl-C).
    #[arg(short = 'c', long)]
    pub count: Option<u64>,
    /// One JSON object per sample, then one with the totals.
    #[arg(long)]
    pub json: bool,
}

/// Human units: 1.23 GB, 512 B (decimal, as link rates are quoted; bytesize's SI display).
// `as` saturates on purpose: a displayed rate, clamped to 0..=u64::MAX.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
pub fn human(v: f64) -> String {
    format!(
        "{:.2}",
        bytesize::ByteSize(v.max(0.0) as u64).display().si()
    )
}

/// One link's change between two samples.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    pub name: String,
    pub kind: String,
    pub peer: String,
    pub nic: String,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
}

/// Per-link differences `now - before` (links new since `before` count from zero).
pub fn deltas(before: &[pb::LinkStat], now: &[pb::LinkStat]) -> Vec<Delta> {
    now.iter()
        .map(|l| {
            let b = before.iter().find(|x| x.name == l.name);
            let d = |f: fn(&pb::LinkStat) -> u64| f(l).saturating_sub(b.map(f).unwrap_or(0));
            Delta {
                name: l.name.clone(),
                kind: l.kind.clone(),
                peer: l.peer.clone(),
                nic: l.nic.clone(),
                rx_bytes: d(|x| x.rx_bytes),
                tx_bytes: d(|x| x.tx_bytes),
                rx_packets: d(|x| x.rx_packets),
                tx_packets: d(|x| x.tx_packets),
            }
        })
        .collect()
}

fn table(rows: &[Delta], secs: f64, totals: bool) -> String {
    use std::fmt::Write;
    let mut o = String::new();
    let secs = secs.max(1e-9);
    if totals {
        let _ = writeln!(
            o,
            "{:<20} {:<12} {:<12} {:<8} {:>12} {:>12} {:>10} {:>10} {:>12} {:>12}",
            "LINK",
            "KIND",
            "PEER",
            "NIC",
            "RX bytes",
            "TX bytes",
            "RX pkts",
            "TX pkts",
            "RX avg/s",
            "TX avg/s"
        );
    } else {
        let _ = writeln!(
            o,
            "{:<20} {:<12} {:<12} {:<8} {:>12} {:>12} {:>10} {:>10}",
            "LINK", "KIND", "PEER", "NIC", "RX B/s", "TX B/s", "RX pkt/s", "TX pkt/s"
        );
    }
    for d in rows {
        if totals {
            let _ = writeln!(
                o,
                "{:<20} {:<12} {:<12} {:<8} {:>12} {:>12} {:>10} {:>10} {:>12} {:>12}",
                d.name,
                d.kind,
                d.peer,
                d.nic,
                human(d.rx_bytes as f64),
                human(d.tx_bytes as f64),
                d.rx_packets,
                d.tx_packets,
                human(d.rx_bytes as f64 / secs),
                human(d.tx_bytes as f64 / secs)
            );
        } else {
            let _ = writeln!(
                o,
                "{:<20} {:<12} {:<12} {:<8} {:>12} {:>12} {:>10.0} {:>10.0}",
                d.name,
                d.kind,
                d.peer,
                d.nic,
                human(d.rx_bytes as f64 / secs),
                human(d.tx_bytes as f64 / secs),
                d.rx_packets as f64 / secs,
                d.tx_packets as f64 / secs
            );
        }
    }
    o
}

fn delta_json(rows: &[Delta], secs: f64) -> Vec<serde_json::Value> {
    let secs = secs.max(1e-9);
    rows.iter()
        .map(|d| {
            json!({"name": d.name, "kind": d.kind, "peer": d.peer, "nic": d.nic,
            "rx_bytes": d.rx_bytes, "tx_bytes": d.tx_bytes, "rx_packets": d.rx_packets, "tx_packets": d.tx_packets,
            "rx_bytes_per_s": d.rx_bytes as f64 / secs, "tx_bytes_per_s": d.tx_bytes as f64 / secs,
            "rx_packets_per_s": d.rx_packets as f64 / secs, "tx_packets_per_s": d.tx_packets as f64 / secs})
        })
        .collect()
}

/// `commd stat -l`: samples the daemon's link counters every interval and prints rates, then
/// the totals since the start (on Ctrl-C or after `--count` samples), like `eadm stat -l`.
pub fn stat(cfg: &Config, a: &StatArgs) -> i32 {
    if !(a.interval.is_finite() && a.interval > 0.0) {
        eprintln!("commd stat: --interval must be a positive number of seconds");
        return exit::USAGE;
    }
    let (rt, mut c) = match connect(&cfg.socket) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("commd stat: {e}");
            return exit::RUNTIME;
        }
    };
    let mut sample = move || -> Result<pb::LinkStatsReply, String> {
        rt.block_on(c.get_link_stats(pb::LinkStatsRequest {}))
            .map(|r| r.into_inner())
            .map_err(|s| rpc_error("link stats", &s))
    };
    let first = match sample() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("commd stat: {e}");
            return exit::RUNTIME;
        }
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Ctrl-C ends the loop and prints the totals (second Ctrl-C: default action).
    let _ = signal_flag(&stop);
    if !a.json {
        println!(
            "commd stat -l: per-link traffic of the daemon at {} every {:.1} s ({})",
            cfg.socket.display(),
            a.interval,
            match a.count {
                Some(n) => format!("{n} samples"),
                None => "Ctrl-C to stop".into(),
            }
        );
    }
    let mut prev = first.clone();
    let mut n = 0u64;
    let step = Duration::from_secs_f64(a.interval);
    while a.count.is_none_or(|c| n < c) && !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let until = std::time::Instant::now() + step;
        while std::time::Instant::now() < until && !stop.load(std::sync::atomic::Ordering::Relaxed)
        {
            std::thread::sleep(
                until
                    .saturating_duration_since(std::time::Instant::now())
                    .min(Duration::from_millis(50)),
            );
        }
        let now = match sample() {
            Ok(s) => s,
            Err(e) => {
                eprintln!("commd stat: {e}");
                return exit::RUNTIME;
            }
        };
        n += 1;
        let secs = now.uptime_ns.saturating_sub(prev.uptime_ns) as f64 / 1e9;
        let rows = deltas(&prev.links, &now.links);
        let t = now.uptime_ns.saturating_sub(first.uptime_ns) as f64 / 1e9;
        if a.json {
            println!(
                "{}",
                json!({"sample": n, "t": t, "interval_s": secs, "links": delta_json(&rows, secs)})
            );
        } else {
            println!("-- t={t:.1}s");
            print!("{}", table(&rows, secs, false));
        }
        prev = now;
    }
    let secs = prev.uptime_ns.saturating_sub(first.uptime_ns) as f64 / 1e9;
    let rows = deltas(&first.links, &prev.links);
    if a.json {
        println!(
            "{}",
            json!({"totals": {"samples": n, "seconds": secs, "links": delta_json(&rows, secs)}})
        );
    } else {
        println!("-- totals over {secs:.1} s ({n} samples)");
        print!("{}", table(&rows, secs, true));
    }
    exit::OK
}

/// Sets `flag` on SIGINT/SIGTERM (once; a second signal acts as usual).
fn signal_flag(flag: &std::sync::Arc<std::sync::atomic::AtomicBool>) -> std::io::Result<()> {
    let f = flag.clone();
    std::thread::Builder::new()
        .name("commd-stat-sig".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            if let Ok(rt) = rt {
                rt.block_on(async {
                    use tokio::signal::unix::{SignalKind, signal};
                    let (Ok(mut i), Ok(mut t)) = (
                        signal(SignalKind::interrupt()),
                        signal(SignalKind::terminate()),
                    ) else {
                        return;
                    };
                    tokio::select! {
                        _ = i.recv() => {}
                        _ = t.recv() => {}
                    }
                });
                f.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        })?;
    Ok(())
}

/// After `commd topo`: the links the daemon has registered (shown when the caller may use the
/// admin service).
pub fn print_links(cfg: &Config) {
    let links = link_list(cfg);
    if links.is_empty() {
        return;
    }
    println!("Links (traffic: commd stat -l):");
    for (name, kind, what) in links {
        println!("  {name:<20} {kind:<12} {what}");
    }
}

/// The daemon's links as (name, kind, description), for `topo` (text and JSON); empty when no
/// daemon answers or the caller may not see them.
pub fn link_list(cfg: &Config) -> Vec<(String, String, String)> {
    let Ok((rt, mut c)) = connect(&cfg.socket) else {
        return Vec::new();
    };
    let Ok(r) = rt.block_on(c.get_link_stats(pb::LinkStatsRequest {})) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for l in r.into_inner().links {
        let what = match l.kind.as_str() {
            "shm" => "host shared memory: local ranks' buffers, copied by the daemon".to_string(),
            "cuda_p2p" => format!("{} -> {} copy-engine push, peer access", l.nic, l.peer),
            "cuda_staged" => format!(
                "{} -> {} copy-engine push staged through host memory by the driver (no P2P)",
                l.nic, l.peer
            ),
            "cuda_local" => format!("copies within {}", l.nic),
            _ => format!("{} to {} via {}", l.kind, l.peer, l.nic),
        };
        out.push((l.name, l.kind, what));
    }
    out
}

/// One session's line in `commd status` (admin and plain views alike).
pub fn session_line(x: &commd_proto::pb::SessionInfo) -> String {
    format!(
        "  session {:>4} pid {:>7} uid {:>5} comms {:>2} regs {:>3} ({} B) ops {}/{} {}",
        x.session_id,
        x.pid,
        x.uid,
        x.communicators,
        x.registrations,
        x.mapped_bytes,
        x.ops_completed,
        x.ops_failed,
        x.name
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(name: &str, rx: u64, tx: u64) -> pb::LinkStat {
        pb::LinkStat {
            name: name.into(),
            kind: "shm".into(),
            peer: "local".into(),
            nic: "-".into(),
            rx_bytes: rx,
            tx_bytes: tx,
            rx_packets: rx / 100,
            tx_packets: tx / 100,
        }
    }

    #[test]
    fn deltas_and_rates() {
        let a = vec![link("shm", 1000, 2000)];
        let b = vec![link("shm", 3000, 2000), link("tcp:x", 500, 0)];
        let d = deltas(&a, &b);
        assert_eq!(
            (d[0].rx_bytes, d[0].tx_bytes, d[0].rx_packets),
            (2000, 0, 20)
        );
        assert_eq!(d[1].rx_bytes, 500, "a new link counts from zero");
        let t = table(&d, 2.0, false);
        assert!(t.contains("1.00 kB"), "{t}");
        assert_eq!(human(999.0), "999 B");
        assert_eq!(human(1_234_000_000.0), "1.23 GB");
    }

    #[test]
    fn status_text_names_the_missing_ranks() {
        let r = pb::AdminStatusReply {
            daemon: Some(pb::StatusReply::default()),
            communicators: vec![pb::CommStatus {
                label: "comm 3 (id ab, 3 ranks)".into(),
                nranks: 3,
                ranks: (0..3)
                    .map(|k| pb::CommRank {
                        rank: k,
                        pid: i32::try_from(100 + k).unwrap(),
                        gpu: -1,
                        ..Default::default()
                    })
                    .collect(),
                oldest: Some(pb::StuckOp {
                    op: "all_reduce".into(),
                    seq: 4,
                    what: "all_reduce seq 4".into(),
                    age_ms: 2500,
                    posted: vec![0, 1],
                    missing: vec![2],
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        };
        let t = status_text(&r);
        assert!(
            t.contains("STUCK all_reduce seq 4 for 2.5 s: posted by ranks 0,1; waiting for rank 2 (pid 102)"),
            "{t}"
        );
        let j = status_json(&r);
        assert_eq!(j["communicator_list"][0]["oldest"]["missing"][0], 2);
        // The IPC handle cache counters are in the JSON (job_start.py counts opens per job).
        assert_eq!(j["ipc_opens"], 0);
        assert!(j.get("ipc_open_now").is_some());
    }
}
