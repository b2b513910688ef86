//! The daemon's state through telemetry: the scrape-time series of sessions, communicators,
//! rings and the IPC cache, and telemetry's start with the daemon (links of this node, the
//! /metrics server). What a communicator logs of itself is `comm::report`.
//!
//! May use: `daemon`, `cuda`, `telemetry`.

use std::sync::{Arc, Weak};
use std::time::Duration;

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::ConstCounter;

use crate::daemon::Daemon;
use crate::telemetry::metrics::{Scrape, counter, gauge, gauge_rows};
use crate::telemetry::{self, links, metrics};

/// Starts the daemon's telemetry: links of this node, the scrape-time collector, and the
/// /metrics server. Must run inside the control plane's tokio runtime. A port that cannot be
/// bound is logged as an error and leaves the daemon serving without metrics.
pub fn start(d: &Arc<Daemon>) {
    metrics().attach(Arc::new(State(Arc::downgrade(d))));
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
            telemetry::set_metrics_addr(local);
            tracing::info!(target: "commd::telemetry", "serving Prometheus metrics on http://{local}/metrics");
            tokio::spawn(telemetry::http::serve(l));
        }
        Err(e) => {
            tracing::error!(target: "commd::telemetry", "metrics disabled: cannot listen on {addr} (metrics_listen): {e}; the daemon serves without /metrics");
        }
    }
}

/// The daemon's state as scrape-time series (attached by [`start`]); holds the daemon weakly.
#[derive(Debug)]
struct State(Weak<Daemon>);

impl Scrape for State {
    /// Writes, in this order: the daemon's counts, pacing, pending ops, rings, the IPC cache.
    fn encode(&self, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let Some(d) = self.0.upgrade() else {
            return Ok(());
        };
        encode_counts(enc, &d)?;
        let per_job = d.cfg.telemetry.metrics_per_job;
        let comms = CommSeries::read(&d, per_job);
        comms.encode(enc, per_job)?;
        encode_rings(enc, &d, per_job)?;
        encode_ipc(enc)
    }
}

/// Uptime and the daemon's counts of sessions, communicators and registrations.
fn encode_counts(enc: &mut DescriptorEncoder<'_>, d: &Daemon) -> std::fmt::Result {
    let c = d.counts();
    gauge(
        enc,
        "commd_uptime_seconds",
        "Seconds since the daemon started",
        d.started.elapsed().as_secs_f64(),
    )?;
    gauge(
        enc,
        "commd_sessions",
        "Client sessions (processes) connected now",
        f64::from(c.sessions),
    )?;
    gauge(
        enc,
        "commd_communicators",
        "Communicators formed and not destroyed",
        f64::from(c.communicators),
    )?;
    gauge(
        enc,
        "commd_communicators_forming",
        "Communicators waiting for ranks to join",
        f64::from(c.pending_joins),
    )?;
    gauge(
        enc,
        "commd_registrations",
        "Memory registrations (host and GPU) of all sessions",
        f64::from(c.registrations),
    )?;
    gauge(
        enc,
        "commd_registered_bytes",
        "Host memory registered by all sessions",
        c.mapped_bytes as f64,
    )
}

/// What the communicators report at one scrape: their pending ops and their pacing, per
/// communicator (`metrics_per_job = on`) or summed.
struct CommSeries {
    pending: u64,
    oldest: Duration,
    /// Per communicator (`metrics_per_job = on` only).
    pacing_cap: Vec<(Vec<(&'static str, String)>, i64)>,
    /// Per communicator, or one unlabelled sum.
    pacing_delay: Vec<(Vec<(&'static str, String)>, f64)>,
    paced: i64,
}

impl CommSeries {
    fn read(d: &Daemon, per_job: bool) -> Self {
        let now = std::time::Instant::now();
        let (mut pending, mut oldest) = (0u64, Duration::ZERO);
        let (mut pacing_cap, mut pacing_delay) = (Vec::new(), Vec::new());
        let (mut paced, mut delay_sum) = (0i64, 0f64);
        for comm in d.comms() {
            let w = comm.waiting(now);
            pending += w.queued as u64;
            if let Some(s) = &w.oldest {
                oldest = oldest.max(s.age);
            }
            let labels = vec![
                ("comm", comm.id.to_string()),
                ("unique_id", comm.uid_short.clone()),
            ];
            let cap = comm.pacer.rate().unwrap_or(0);
            let delayed = comm.pacer.delayed().as_secs_f64();
            paced += i64::from(cap > 0);
            delay_sum += delayed;
            if per_job {
                pacing_cap.push((labels.clone(), i64::try_from(cap).unwrap_or(i64::MAX)));
                pacing_delay.push((labels, delayed));
            }
        }
        if !per_job {
            pacing_delay.push((Vec::new(), delay_sum));
        }
        Self {
            pending,
            oldest,
            pacing_cap,
            pacing_delay,
            paced,
        }
    }

    /// The pacing series, then the pending-op series.
    fn encode(&self, enc: &mut DescriptorEncoder<'_>, per_job: bool) -> std::fmt::Result {
        if per_job {
            gauge_rows(
                enc,
                "commd_gpu_pacing_bytes_per_second",
                "Cap on each communicator's GPU copy bandwidth on this node (0: uncapped)",
                &self.pacing_cap,
            )?;
        } else {
            // Bounded labels by default: a scrape's series do not grow with every job.
            gauge_rows(
                enc,
                "commd_gpu_paced_communicators",
                "Communicators whose GPU copies on this node are capped (per communicator: metrics_per_job = on)",
                &[(Vec::new(), self.paced)],
            )?;
        }
        let mut m = enc.encode_descriptor(
            "commd_gpu_pacing_delay_seconds",
            "Time GPU copy phases were held back by pacing caps: summed, or per communicator with metrics_per_job = on",
            None,
            MetricType::Counter,
        )?;
        for (labels, v) in &self.pacing_delay {
            ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
        }
        gauge(
            enc,
            "commd_pending_ops",
            "Ops posted and not yet matched or completed, over all communicators and ranks",
            self.pending as f64,
        )?;
        gauge(
            enc,
            "commd_oldest_pending_op_seconds",
            "Age of the oldest op still waiting for ranks (0 when none): alert on this to catch hangs",
            self.oldest.as_secs_f64(),
        )
    }
}

/// The sessions' submission and completion rings: entries used and capacity, per session
/// (`metrics_per_job = on`) or summed per queue.
fn encode_rings(enc: &mut DescriptorEncoder<'_>, d: &Daemon, per_job: bool) -> std::fmt::Result {
    let mut used = Vec::new();
    let mut cap = Vec::new();
    let mut sums = [("sq", 0i64, 0i64), ("cq", 0, 0)];
    for s in d.sessions() {
        let r = &s.ring;
        let l = r.layout();
        use std::sync::atomic::Ordering::Relaxed;
        // The SQ tail is client-written: clamp it to the capacity.
        let sq = r
            .sq_tail()
            .load(Relaxed)
            .wrapping_sub(r.sq_head().load(Relaxed))
            .min(l.sq_entries);
        let cq = r
            .cq_tail()
            .load(Relaxed)
            .wrapping_sub(r.cq_head().load(Relaxed))
            .min(l.cq_entries);
        for (i, (q, n, c)) in [("sq", sq, l.sq_entries), ("cq", cq, l.cq_entries)]
            .into_iter()
            .enumerate()
        {
            sums[i].1 += i64::from(n);
            sums[i].2 += i64::from(c);
            if !per_job {
                continue;
            }
            let labels = vec![
                ("session", s.id.to_string()),
                ("pid", s.pid.to_string()),
                ("queue", q.to_string()),
            ];
            used.push((labels.clone(), i64::from(n)));
            cap.push((labels, i64::from(c)));
        }
    }
    if !per_job {
        for (q, n, c) in sums {
            used.push((vec![("queue", q.to_string())], n));
            cap.push((vec![("queue", q.to_string())], c));
        }
    }
    gauge_rows(
        enc,
        "commd_ring_entries_used",
        "Descriptors in the sessions' submission (sq) and completion (cq) rings: summed, or per session with metrics_per_job = on",
        &used,
    )?;
    gauge_rows(
        enc,
        "commd_ring_entries",
        "Capacity of the sessions' rings: summed, or per session with metrics_per_job = on",
        &cap,
    )
}

/// The CUDA IPC cache's counters (when CUDA is up).
fn encode_ipc(enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
    if let Ok(cuda) = crate::cuda::get() {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &cuda.stats;
        let one = |v: u64| vec![(Vec::new(), v)];
        counter(
            enc,
            "commd_ipc_handle_opens",
            "cuIpcOpenMemHandle calls (registrations not served from the cache)",
            &one(s.opens.load(Relaxed)),
        )?;
        counter(
            enc,
            "commd_ipc_handle_cache_hits",
            "GPU registrations served from an open mapping",
            &one(s.hits.load(Relaxed)),
        )?;
        gauge(
            enc,
            "commd_ipc_handles_open",
            "IPC mappings open now",
            f64::from(s.open_now.load(Relaxed)),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! Pins the scrape-time series of [`State`] (names, help, order, labels, values) on a
    //! daemon without CUDA: one with per-job series, one with the bounded default.

    use std::time::Duration;

    use super::*;
    use crate::comm::Comm;
    use crate::config::{Config, Inputs};
    use crate::daemon::JoinOpts;
    use crate::session::Session;

    fn daemon(per_job: bool) -> Arc<Daemon> {
        let toml = std::env::temp_dir().join(format!(
            "commd-report-test-{}-{per_job}.toml",
            std::process::id()
        ));
        std::fs::write(&toml, "").expect("write empty config");
        let mut flags = vec![("cuda".to_string(), "0".to_string())];
        if per_job {
            flags.push(("metrics_per_job".into(), "on".into()));
        }
        let cfg = Config::load(&Inputs {
            config_file: Some(toml),
            flags,
            env: Default::default(),
        })
        .expect("test config");
        Daemon::new(cfg)
    }

    /// Forms a communicator of `nranks` ranks, one session each, asking for `pacing`; returns
    /// its sessions and the communicator.
    fn comm(d: &Arc<Daemon>, pacing: Option<u64>, nranks: u32) -> (Vec<Arc<Session>>, Arc<Comm>) {
        let uid = d.unique_id(0).encode();
        let mut out = Vec::new();
        for rank in 0..nranks {
            let s = d
                .hello(1000, std::process::id().cast_signed(), "test".into(), 0, 0)
                .expect("hello");
            let rx = d
                .join(
                    s.clone(),
                    &uid,
                    rank,
                    nranks,
                    JoinOpts {
                        op_timeout: None,
                        pacing,
                    },
                    Duration::from_secs(5),
                )
                .expect("join");
            out.push((s, rx));
        }
        let mut comm = None;
        let mut sessions = Vec::new();
        for (s, mut rx) in out {
            let (h, _, _, _) = rx.try_recv().expect("formed").expect("joined");
            comm = s.tables().comms.get(&h).map(|(c, _)| c.clone());
            sessions.push(s);
        }
        (sessions, comm.expect("a communicator"))
    }

    /// The series `State` writes, uptime's value blanked.
    fn scrape(d: &Arc<Daemon>) -> String {
        let m = metrics::Metrics::new();
        m.attach(Arc::new(State(Arc::downgrade(d))));
        let t = m.encode();
        let from = t.find("# HELP commd_uptime_seconds").expect("state series");
        let mut out = String::new();
        for l in t[from..].lines() {
            match l.strip_prefix("commd_uptime_seconds ") {
                Some(_) => out.push_str("commd_uptime_seconds UPTIME\n"),
                None => {
                    out.push_str(l);
                    out.push('\n');
                }
            }
        }
        out
    }

    const COMMON_HEAD: &str = "\
# HELP commd_uptime_seconds Seconds since the daemon started
# TYPE commd_uptime_seconds gauge
commd_uptime_seconds UPTIME
# HELP commd_sessions Client sessions (processes) connected now
# TYPE commd_sessions gauge
commd_sessions {sessions}.0
# HELP commd_communicators Communicators formed and not destroyed
# TYPE commd_communicators gauge
commd_communicators {comms}.0
# HELP commd_communicators_forming Communicators waiting for ranks to join
# TYPE commd_communicators_forming gauge
commd_communicators_forming 0.0
# HELP commd_registrations Memory registrations (host and GPU) of all sessions
# TYPE commd_registrations gauge
commd_registrations 0.0
# HELP commd_registered_bytes Host memory registered by all sessions
# TYPE commd_registered_bytes gauge
commd_registered_bytes 0.0
";

    fn head(sessions: usize, comms: usize) -> String {
        COMMON_HEAD
            .replace("{sessions}", &sessions.to_string())
            .replace("{comms}", &comms.to_string())
    }

    #[test]
    fn bounded_series_sum_over_communicators_and_sessions() {
        let d = daemon(false);
        let (_s1, _c1) = comm(&d, Some(10_000_000_000), 2);
        let (_s2, _c2) = comm(&d, None, 1);
        let entries = d.cfg.ring_entries * 3;
        let want = head(3, 2)
            + "\
# HELP commd_gpu_paced_communicators Communicators whose GPU copies on this node are capped (per communicator: metrics_per_job = on)
# TYPE commd_gpu_paced_communicators gauge
commd_gpu_paced_communicators{} 1
# HELP commd_gpu_pacing_delay_seconds Time GPU copy phases were held back by pacing caps: summed, or per communicator with metrics_per_job = on
# TYPE commd_gpu_pacing_delay_seconds counter
commd_gpu_pacing_delay_seconds_total{} 0.0
# HELP commd_pending_ops Ops posted and not yet matched or completed, over all communicators and ranks
# TYPE commd_pending_ops gauge
commd_pending_ops 0.0
# HELP commd_oldest_pending_op_seconds Age of the oldest op still waiting for ranks (0 when none): alert on this to catch hangs
# TYPE commd_oldest_pending_op_seconds gauge
commd_oldest_pending_op_seconds 0.0
# HELP commd_ring_entries_used Descriptors in the sessions' submission (sq) and completion (cq) rings: summed, or per session with metrics_per_job = on
# TYPE commd_ring_entries_used gauge
commd_ring_entries_used{queue=\"sq\"} 0
commd_ring_entries_used{queue=\"cq\"} 0
# HELP commd_ring_entries Capacity of the sessions' rings: summed, or per session with metrics_per_job = on
# TYPE commd_ring_entries gauge
commd_ring_entries{queue=\"sq\"} ENTRIES
commd_ring_entries{queue=\"cq\"} ENTRIES
# EOF
"
            .replace("ENTRIES", &entries.to_string())
            .as_str();
        assert_eq!(scrape(&d), want);
    }

    #[test]
    fn per_job_series_name_each_communicator_and_session() {
        let d = daemon(true);
        let (s, c) = comm(&d, Some(10_000_000_000), 1);
        let s = &s[0];
        let comm_labels = format!("comm=\"{}\",unique_id=\"{}\"", c.id, c.uid_short);
        let ring = |q: &str| format!("session=\"{}\",pid=\"{}\",queue=\"{q}\"", s.id, s.pid);
        let entries = d.cfg.ring_entries;
        let want = head(1, 1)
            + &format!(
                "\
# HELP commd_gpu_pacing_bytes_per_second Cap on each communicator's GPU copy bandwidth on this node (0: uncapped)
# TYPE commd_gpu_pacing_bytes_per_second gauge
commd_gpu_pacing_bytes_per_second{{{comm_labels}}} 10000000000
# HELP commd_gpu_pacing_delay_seconds Time GPU copy phases were held back by pacing caps: summed, or per communicator with metrics_per_job = on
# TYPE commd_gpu_pacing_delay_seconds counter
commd_gpu_pacing_delay_seconds_total{{{comm_labels}}} 0.0
# HELP commd_pending_ops Ops posted and not yet matched or completed, over all communicators and ranks
# TYPE commd_pending_ops gauge
commd_pending_ops 0.0
# HELP commd_oldest_pending_op_seconds Age of the oldest op still waiting for ranks (0 when none): alert on this to catch hangs
# TYPE commd_oldest_pending_op_seconds gauge
commd_oldest_pending_op_seconds 0.0
# HELP commd_ring_entries_used Descriptors in the sessions' submission (sq) and completion (cq) rings: summed, or per session with metrics_per_job = on
# TYPE commd_ring_entries_used gauge
commd_ring_entries_used{{{sq}}} 0
commd_ring_entries_used{{{cq}}} 0
# HELP commd_ring_entries Capacity of the sessions' rings: summed, or per session with metrics_per_job = on
# TYPE commd_ring_entries gauge
commd_ring_entries{{{sq}}} {entries}
commd_ring_entries{{{cq}}} {entries}
# EOF
",
                sq = ring("sq"),
                cq = ring("cq"),
            );
        assert_eq!(scrape(&d), want);
    }
}
