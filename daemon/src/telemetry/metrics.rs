//! The Prometheus registry (`prometheus-client`) and what feeds it.
//!
//! Two kinds of metrics:
//! - counters and histograms updated by hooks on the completion path (ops, bytes, latency, errors,
//!   IPC opens): label values are `&'static str`, so an update is a read-locked map lookup and an
//!   atomic add, never an allocation;
//! - values read when `/metrics` is scraped (sessions, communicators, pending ops, ring occupancy,
//!   link counters, the IPC cache): nothing on the data path pays for them.
//!
//! Metric names and labels are listed in `docs/observability.md`; keep the two in step.

use std::fmt::Write as _;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use commd_proto::desc::{Op, status};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::daemon::Daemon;

type Labels3 = [(&'static str, &'static str); 3];
type Labels2 = [(&'static str, &'static str); 2];

fn latency_histogram() -> Histogram {
    // 1 us .. ~16.8 s in factors of two.
    Histogram::new(exponential_buckets(1e-6, 2.0, 25))
}

/// Hook-fed metrics plus the scrape-time collector.
pub struct Metrics {
    registry: Registry,
    ops: Family<Labels3, Counter>,
    op_bytes: Family<Labels3, Counter>,
    latency: Family<Labels2, Histogram, fn() -> Histogram>,
    errors: Family<Labels2, Counter>,
    ipc_open: Histogram,
    sessions_opened: Counter,
    comms_formed: Counter,
    state: Arc<StateCollector>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let ops = Family::<Labels3, Counter>::default();
        registry.register(
            "commd_ops",
            "Ops completed successfully, per rank, by op, dtype and transport",
            ops.clone(),
        );
        let op_bytes = Family::<Labels3, Counter>::default();
        registry.register(
            "commd_op_bytes",
            "Payload bytes of successful ops, per rank: count x element size (NCCL's count argument in bytes)",
            op_bytes.clone(),
        );
        let latency = Family::<Labels2, Histogram, fn() -> Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        registry.register(
            "commd_op_duration_seconds",
            "Per-rank op latency from post to completion (includes waiting for the other ranks)",
            latency.clone(),
        );
        let errors = Family::<Labels2, Counter>::default();
        registry.register(
            "commd_op_errors",
            "Ops that failed, per rank, by op and error kind (invalid, mismatch, peer_lost, timeout, shutdown, aborted, internal)",
            errors.clone(),
        );
        let ipc_open = latency_histogram();
        registry.register(
            "commd_ipc_handle_open_duration_seconds",
            "Time spent in each cuIpcOpenMemHandle (cache misses only)",
            ipc_open.clone(),
        );
        let sessions_opened = Counter::default();
        registry.register(
            "commd_sessions_opened",
            "Client sessions opened since the daemon started",
            sessions_opened.clone(),
        );
        let comms_formed = Counter::default();
        registry.register(
            "commd_communicators_formed",
            "Communicators formed since the daemon started",
            comms_formed.clone(),
        );
        let state = Arc::new(StateCollector::default());
        registry.register_collector(Box::new(state.clone()));
        Self {
            registry,
            ops,
            op_bytes,
            latency,
            errors,
            ipc_open,
            sessions_opened,
            comms_formed,
            state,
        }
    }

    /// One rank's op completed with status `st` after `latency` (from its post).
    pub fn op_done(&self, op: &Op, transport: &'static str, st: u32, latency: Duration) {
        let name = op.kind.name();
        if st == status::OK {
            let l = [
                ("op", name),
                ("dtype", op.dtype.name()),
                ("transport", transport),
            ];
            self.ops.get_or_create(&l).inc();
            self.op_bytes
                .get_or_create(&l)
                .inc_by(op.count.saturating_mul(op.dtype.size()));
            self.latency
                .get_or_create(&[("op", name), ("transport", transport)])
                .observe(latency.as_secs_f64());
        } else {
            self.errors
                .get_or_create(&[("op", name), ("kind", status::name(st))])
                .inc();
        }
    }

    pub fn ipc_open(&self, took: Duration) {
        self.ipc_open.observe(took.as_secs_f64());
    }

    pub fn session_opened(&self) {
        self.sessions_opened.inc();
    }

    pub fn comm_formed(&self) {
        self.comms_formed.inc();
    }

    /// The daemon whose state the scrape-time gauges describe (the latest one started).
    pub fn attach(&self, d: &Arc<Daemon>) {
        *self.state.daemon.lock().unwrap_or_else(|e| e.into_inner()) = Arc::downgrade(d);
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            // Only a formatting bug can get here; say so in the body rather than fail the scrape.
            let _ = writeln!(out, "# encoding failed: {e}");
        }
        out
    }
}

/// The daemon's metrics.
pub fn metrics() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::new)
}

/// Values read at scrape time: daemon state and link counters.
#[derive(Debug, Default)]
struct StateCollector {
    daemon: Mutex<Weak<Daemon>>,
}

fn counter(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Vec<(&str, String)>, u64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
    for (labels, v) in rows {
        ConstCounter::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> std::fmt::Result {
    let m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(v).encode(m)
}

fn gauge_rows(
    enc: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    rows: &[(Vec<(&str, String)>, i64)],
) -> std::fmt::Result {
    let mut m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    for (labels, v) in rows {
        ConstGauge::new(*v).encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// The standard `process_*` series (Prometheus client conventions) of this process, from /proc:
/// (start time since the epoch, CPU seconds, resident bytes, open fds, threads).
fn process_stats() -> Option<(f64, f64, f64, f64, f64)> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which may hold spaces: state is field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let num = |i: usize| f.get(i - 3).and_then(|v| v.parse::<f64>().ok());
    let ticks = rustix::param::clock_ticks_per_second() as f64;
    let cpu = (num(14)? + num(15)?) / ticks;
    let threads = num(20)?;
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<f64>().ok())?;
    let start = boot + num(22)? / ticks;
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let rss_pages: f64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    let rss = rss_pages * rustix::param::page_size() as f64;
    let fds = std::fs::read_dir("/proc/self/fd").ok()?.count() as f64;
    Some((start, cpu, rss, fds, threads))
}

impl Collector for StateCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        if let Some((start, cpu, rss, fds, threads)) = process_stats() {
            gauge(
                &mut enc,
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch in seconds",
                start,
            )?;
            let m = enc.encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                MetricType::Counter,
            )?;
            ConstCounter::new(cpu).encode(m)?;
            gauge(
                &mut enc,
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                rss,
            )?;
            gauge(
                &mut enc,
                "process_open_fds",
                "Number of open file descriptors",
                fds,
            )?;
            gauge(
                &mut enc,
                "process_threads",
                "Number of OS threads in the process",
                threads,
            )?;
        }
        let links = super::links::registry().snapshot();
        let mut bytes = Vec::new();
        let mut packets = Vec::new();
        for l in &links {
            for (dir, b, p) in [
                ("rx", l.rx_bytes, l.rx_packets),
                ("tx", l.tx_bytes, l.tx_packets),
            ] {
                let labels = vec![
                    ("link", l.name.clone()),
                    ("kind", l.kind.clone()),
                    ("peer", l.peer.clone()),
                    ("nic", l.nic.clone()),
                    ("direction", dir.to_string()),
                ];
                bytes.push((labels.clone(), b));
                packets.push((labels, p));
            }
        }
        counter(
            &mut enc,
            "commd_link_bytes",
            "Bytes moved per link (shared memory, GPU copy-engine paths, network peers) and direction",
            &bytes,
        )?;
        counter(
            &mut enc,
            "commd_link_packets",
            "Transfers per link and direction (shm: buffer ranges; GPU: copies; network: the transport's packets)",
            &packets,
        )?;
        let build = vec![(vec![("version", commd_proto::VERSION.to_string())], 1)];
        gauge_rows(&mut enc, "commd_build_info", "The daemon's version", &build)?;
        let Some(d) = self
            .daemon
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .upgrade()
        else {
            return Ok(());
        };
        let c = d.counts();
        gauge(
            &mut enc,
            "commd_uptime_seconds",
            "Seconds since the daemon started",
            d.started.elapsed().as_secs_f64(),
        )?;
        gauge(
            &mut enc,
            "commd_sessions",
            "Client sessions (processes) connected now",
            f64::from(c.sessions),
        )?;
        gauge(
            &mut enc,
            "commd_communicators",
            "Communicators formed and not destroyed",
            f64::from(c.communicators),
        )?;
        gauge(
            &mut enc,
            "commd_communicators_forming",
            "Communicators waiting for ranks to join",
            f64::from(c.pending_joins),
        )?;
        gauge(
            &mut enc,
            "commd_registrations",
            "Memory registrations (host and GPU) of all sessions",
            f64::from(c.registrations),
        )?;
        gauge(
            &mut enc,
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
                &mut enc,
                "commd_gpu_pacing_bytes_per_second",
                "Cap on each communicator's GPU copy bandwidth on this node (0: uncapped)",
                &pacing_cap,
            )?;
        } else {
            // Bounded labels by default: a scrape's series do not grow with every job.
            gauge_rows(
                &mut enc,
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
            &mut enc,
            "commd_pending_ops",
            "Ops posted and not yet matched or completed, over all communicators and ranks",
            pending as f64,
        )?;
        gauge(
            &mut enc,
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
            &mut enc,
            "commd_ring_entries_used",
            "Descriptors in the sessions' submission (sq) and completion (cq) rings: summed, or per session with metrics_per_job = on",
            &used,
        )?;
        gauge_rows(
            &mut enc,
            "commd_ring_entries",
            "Capacity of the sessions' rings: summed, or per session with metrics_per_job = on",
            &cap,
        )?;
        if let Ok(cuda) = crate::cuda::get() {
            use std::sync::atomic::Ordering::Relaxed;
            let s = &cuda.stats;
            let one = |v: u64| vec![(Vec::new(), v)];
            counter(
                &mut enc,
                "commd_ipc_handle_opens",
                "cuIpcOpenMemHandle calls (registrations not served from the cache)",
                &one(s.opens.load(Relaxed)),
            )?;
            counter(
                &mut enc,
                "commd_ipc_handle_cache_hits",
                "GPU registrations served from an open mapping",
                &one(s.hits.load(Relaxed)),
            )?;
            gauge(
                &mut enc,
                "commd_ipc_handles_open",
                "IPC mappings open now",
                f64::from(s.open_now.load(Relaxed)),
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use commd_proto::desc::{DType, OpKind};

    fn op(kind: OpKind, dtype: DType, count: u64) -> Op {
        Op {
            user_data: 1,
            kind,
            dtype,
            redop: None,
            count,
            peer: 0,
            comm: 1,
            send_mem: 0,
            send_off: 0,
            recv_mem: 0,
            recv_off: 0,
            cuda_ticket: None,
            one_shot: false,
            staged: false,
            persistent: false,
            graph_tag: 0,
        }
    }

    /// The value of the sample `line_prefix` (name and labels) in an exposition.
    fn sample(text: &str, line_prefix: &str) -> Option<f64> {
        text.lines()
            .find(|l| l.starts_with(line_prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    #[test]
    fn op_counters_bytes_and_latency_add_up() {
        let m = Metrics::new();
        for _ in 0..3 {
            m.op_done(
                &op(OpKind::AllReduce, DType::F32, 1000),
                "shm",
                status::OK,
                Duration::from_micros(30),
            );
        }
        m.op_done(
            &op(OpKind::AllGather, DType::BF16, 10),
            "cuda_ce",
            status::OK,
            Duration::from_millis(2),
        );
        m.op_done(
            &op(OpKind::AllReduce, DType::F32, 1000),
            "shm",
            status::MISMATCH,
            Duration::ZERO,
        );
        let t = m.encode();
        let ar = r#"{op="all_reduce",dtype="f32",transport="shm"}"#;
        assert_eq!(
            sample(&t, &format!("commd_ops_total{ar}")),
            Some(3.0),
            "{t}"
        );
        assert_eq!(
            sample(&t, &format!("commd_op_bytes_total{ar}")),
            Some(12000.0)
        );
        assert_eq!(
            sample(
                &t,
                r#"commd_op_bytes_total{op="all_gather",dtype="bf16",transport="cuda_ce"}"#
            ),
            Some(20.0)
        );
        assert_eq!(
            sample(
                &t,
                r#"commd_op_duration_seconds_count{op="all_reduce",transport="shm"}"#
            ),
            Some(3.0)
        );
        assert_eq!(
            sample(
                &t,
                r#"commd_op_errors_total{op="all_reduce",kind="mismatch"}"#
            ),
            Some(1.0)
        );
        // 30 us lands in the 32 us bucket and every bucket above, not in the 16 us one.
        let bucket = |le: &str| {
            sample(
                &t,
                &format!(
                    r#"commd_op_duration_seconds_bucket{{le="{le}",op="all_reduce",transport="shm"}}"#
                ),
            )
        };
        assert_eq!(bucket("0.000016"), Some(0.0), "{t}");
        assert_eq!(bucket("0.000032"), Some(3.0), "{t}");
        assert!(t.trim_end().ends_with("# EOF"));
    }

    #[test]
    fn link_counters_are_exported_by_direction() {
        let l = super::super::links::register_link(super::super::links::LinkDesc {
            name: "test-metrics-link",
            kind: "tcp",
            peer: "node-x",
            nic: "eth9",
        });
        l.tx(1234, 2);
        l.rx(99, 1);
        let t = Metrics::new().encode();
        let lbl = |dir: &str| {
            format!(
                r#"{{link="test-metrics-link",kind="tcp",peer="node-x",nic="eth9",direction="{dir}"}}"#
            )
        };
        assert_eq!(
            sample(&t, &format!("commd_link_bytes_total{}", lbl("tx"))),
            Some(1234.0),
            "{t}"
        );
        assert_eq!(
            sample(&t, &format!("commd_link_packets_total{}", lbl("tx"))),
            Some(2.0)
        );
        assert_eq!(
            sample(&t, &format!("commd_link_bytes_total{}", lbl("rx"))),
            Some(99.0)
        );
        assert!(t.contains("# TYPE commd_link_bytes counter"), "{t}");
    }
}
