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
use std::sync::{Arc, Mutex, OnceLock};
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

    /// What the scrape-time series of daemon state come from (the latest daemon started).
    pub fn attach(&self, s: Arc<dyn Scrape>) {
        *self.state.scrape.lock().unwrap_or_else(|e| e.into_inner()) = Some(s);
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
    scrape: Mutex<Option<Arc<dyn Scrape>>>,
}

/// Series read at scrape time from state this module does not know (`report`: sessions,
/// communicators, rings, the IPC cache), written after the process and link series.
pub trait Scrape: Send + Sync + std::fmt::Debug {
    fn encode(&self, enc: &mut DescriptorEncoder<'_>) -> std::fmt::Result;
}

pub fn counter(
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

pub fn gauge(enc: &mut DescriptorEncoder, name: &str, help: &str, v: f64) -> std::fmt::Result {
    let m = enc.encode_descriptor(name, help, None, MetricType::Gauge)?;
    ConstGauge::new(v).encode(m)
}

pub fn gauge_rows(
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
        let scrape = self
            .scrape
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(s) = scrape {
            s.encode(&mut enc)?;
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
            any_source: false,
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
