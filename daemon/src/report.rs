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
    fn encode(&self, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result {
        let Some(d) = self.0.upgrade() else {
            return Ok(());
        };
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
        )?;
        let now = std::time::Instant::now();
        let (mut pending, mut oldest) = (0u64, Duration::ZERO);
        let per_job = d.cfg.telemetry.metrics_per_job;
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
        if per_job {
            gauge_rows(
                enc,
                "commd_gpu_pacing_bytes_per_second",
                "Cap on each communicator's GPU copy bandwidth on this node (0: uncapped)",
                &pacing_cap,
            )?;
        } else {
            // Bounded labels by default: a scrape's series do not grow with every job.
            gauge_rows(
                enc,
                "commd_gpu_paced_communicators",
                "Communicators whose GPU copies on this node are capped (per communicator: metrics_per_job = on)",
                &[(Vec::new(), paced)],
            )?;
            pacing_delay.push((Vec::new(), delay_sum));
        }
        let mut m = enc.encode_descriptor(
            "commd_gpu_pacing_delay_seconds",
            "Time GPU copy phases were held back by pacing caps: summed, or per communicator with metrics_per_job = on",
            None,
            MetricType::Counter,
        )?;
        for (labels, v) in &pacing_delay {
            ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
        }
        gauge(
            enc,
            "commd_pending_ops",
            "Ops posted and not yet matched or completed, over all communicators and ranks",
            pending as f64,
        )?;
        gauge(
            enc,
            "commd_oldest_pending_op_seconds",
            "Age of the oldest op still waiting for ranks (0 when none): alert on this to catch hangs",
            oldest.as_secs_f64(),
        )?;
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
        )?;
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
}
