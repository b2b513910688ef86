//! `commd bench`: an nccl-tests style benchmark. It starts N client *processes* (this binary's
//! hidden `bench-worker` subcommand), so every byte takes the real inter-process path, against a
//! running daemon (`--socket`) or one embedded in this process. Each worker times its ops,
//! verifies results on deterministic data, and reports JSON lines that this process aggregates.
//!
//! Columns follow nccl-tests: `time` is the mean per op (the slowest rank's; `-a` picks rank 0's,
//! the ranks' mean or the fastest instead, as nccl-tests' `-a`), `algbw = size/time`,
//! `busbw = algbw * factor` (all_reduce 2(n-1)/n; all_gather, reduce_scatter, all_to_all (n-1)/n;
//! others 1). `med` is the median per-op time, `#wrong` the elements that failed verification.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Instant;

use commd_client::Client;
use commd_proto::desc::{DType, OpKind, RedOp};
use serde::{Deserialize, Serialize};

mod worker;

pub use worker::worker;

#[derive(Clone, Debug, clap::Args, Serialize, Deserialize)]
pub struct BenchArgs {
    /// all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, sendrecv (nccl-tests
    /// spellings such as allreduce and alltoall work too)
    #[arg(long, default_value = "all_reduce", value_parser = parse_op)]
    pub op: String,
    /// Client processes (ranks), over all nodes.
    #[arg(long, default_value_t = 4)]
    pub ranks: u32,
    /// Embedded daemons acting as separate nodes (own sockets and peer ports on loopback); the
    /// ranks are spread over them in contiguous blocks and the inter-node steps go over the
    /// configured transport (`--set transport=tcp|rdma|auto`; auto: RDMA when a device exists),
    /// or through a switch session for all-reduce (see --switch).
    #[arg(long, default_value_t = 1)]
    pub nodes: u32,
    /// With --nodes > 1: the switch for the inter-node step of int32/float32 all-reduce:
    /// `embedded` (a `commd switch` in this process), a SwitchML controller HOST:PORT, or `off`
    /// (the daemons' `switch` setting). Each node's workers send from 127.0.0.(10 + node).
    #[arg(long, default_value = "off")]
    #[serde(default)]
    pub switch: String,
    /// Smallest size in bytes (K, M, G suffixes), as nccl-tests' -b.
    #[arg(short = 'b', long, visible_alias = "minbytes", default_value = "8", value_parser = parse_size)]
    pub min_bytes: u64,
    /// Largest size in bytes (K, M, G suffixes), as nccl-tests' -e.
    #[arg(short = 'e', long, visible_alias = "maxbytes", default_value = "256M", value_parser = parse_size)]
    pub max_bytes: u64,
    /// Multiply the size by this factor each step (at least 2), as nccl-tests' -f.
    #[arg(short = 'f', long, visible_alias = "stepfactor", default_value_t = 2)]
    pub step_factor: u64,
    /// Add this many bytes each step instead (K, M, G suffixes), as nccl-tests' -i.
    #[arg(short = 'i', long, visible_alias = "stepbytes", value_parser = parse_size, conflicts_with = "step_factor")]
    #[serde(default)]
    pub step_bytes: Option<u64>,
    /// How the ranks' times make a row's time: 0 rank 0's, 1 their mean (nccl-tests' default),
    /// 2 the fastest rank's, 3 the slowest rank's (commd's default), as nccl-tests' -a.
    #[arg(short = 'a', long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(0..=3))]
    #[serde(default)]
    pub average: u8,
    /// Threads per process, as nccl-tests' -t: 1 (commd bench runs one client process per
    /// rank; more ranks are --ranks).
    #[arg(short = 't', long = "nthreads", default_value_t = 1)]
    #[serde(default)]
    pub nthreads: u32,
    /// GPUs per thread, as nccl-tests' -g: 1 (commd bench's ranks are CPU client processes).
    #[arg(short = 'g', long = "ngpus", default_value_t = 1)]
    #[serde(default)]
    pub ngpus: u32,
    /// Element type: f32, f64, f16, bf16, i8, u8, i32, i64, u32, u64, f8e4m3, f8e5m2 (or
    /// nccl-tests' float, double, half, bfloat16, int8, uint8, int32, int64, uint32, uint64), or
    /// `all` (each in turn), as nccl-tests' -d.
    #[arg(short = 'd', long, default_value = "f32", value_parser = parse_dtype)]
    pub dtype: String,
    /// Reduction: sum, prod, min, max, avg, band, bor, bxor, or `all` (sum, prod, min, max and
    /// avg in turn), as nccl-tests' -o.
    #[arg(short = 'o', long, default_value = "sum", value_parser = parse_redop)]
    pub redop: String,
    /// Root rank of broadcast and reduce, as nccl-tests' -r.
    #[arg(short = 'r', long, default_value_t = 0)]
    pub root: u32,
    /// Timed iterations per size (0: chosen by size, 5..=1000), as nccl-tests' -n.
    #[arg(short = 'n', long, default_value_t = 0)]
    pub iters: u32,
    /// Warm-up iterations per size (0: chosen by size), as nccl-tests' -w.
    #[arg(short = 'w', long, default_value_t = 0)]
    pub warmup: u32,
    /// Check results: 1 (default) or 0, as nccl-tests' -c.
    #[arg(short = 'c', long, value_parser = clap::value_parser!(u8).range(0..=1))]
    #[serde(default)]
    pub check: Option<u8>,
    /// Skip result verification (same as -c 0).
    #[arg(long)]
    pub no_check: bool,
    /// Emit one JSON object per row instead of the table.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Emit CSV (a header line, then one line per size and placement) instead of the table.
    #[arg(long)]
    #[serde(default)]
    pub csv: bool,
    /// Where each rank's data lives: `registered` (memory from the daemon's shared allocation,
    /// used in place, as `commd.torch.empty` tensors), `allocator` (blocks of commd's CPU
    /// allocator, as ordinary torch tensors and numpy arrays of 1 MiB and up get: the first op
    /// moves them into shared memory and registers them, later ops run in place) or `plain`
    /// (ordinary process memory, copied into shared staging memory and back around every op,
    /// as memory no commd allocator served is). The copies are part of the timed op. Except
    /// with `registered`, each row says where an op's time went (`phases`).
    #[arg(long, default_value = "registered", value_parser = ["registered", "allocator", "plain"])]
    #[serde(default = "registered")]
    pub memory: String,
}

fn registered() -> String {
    "registered".into()
}

const OPS: &str = "all_reduce, all_gather, reduce_scatter, broadcast, reduce, all_to_all, sendrecv";

/// An op name as commd spells it (nccl-tests' spellings accepted), or the valid ones.
pub fn parse_op(s: &str) -> Result<String, String> {
    let n = match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
        "all_reduce" | "allreduce" => "all_reduce",
        "all_gather" | "allgather" => "all_gather",
        "reduce_scatter" | "reducescatter" => "reduce_scatter",
        "broadcast" | "bcast" => "broadcast",
        "reduce" => "reduce",
        "all_to_all" | "alltoall" => "all_to_all",
        "sendrecv" | "send_recv" => "sendrecv",
        _ => return Err(format!("unknown op '{s}' (valid: {OPS})")),
    };
    Ok(n.to_string())
}

/// A dtype as commd spells it (nccl-tests' names accepted), or the valid ones.
pub fn parse_dtype(s: &str) -> Result<String, String> {
    let n = match s.trim().to_ascii_lowercase().as_str() {
        "all" => "all",
        "f32" | "float" | "float32" => "f32",
        "f64" | "double" | "float64" => "f64",
        "f16" | "half" | "float16" => "f16",
        "bf16" | "bfloat16" => "bf16",
        "i8" | "int8" | "char" => "i8",
        "u8" | "uint8" => "u8",
        "i32" | "int32" | "int" => "i32",
        "i64" | "int64" => "i64",
        "u32" | "uint32" => "u32",
        "u64" | "uint64" => "u64",
        "f8e4m3" | "fp8e4m3" | "float8_e4m3fn" => "f8e4m3",
        "f8e5m2" | "fp8e5m2" | "float8_e5m2" => "f8e5m2",
        _ => {
            return Err(format!(
                "unknown dtype '{s}' (valid: f32, f64, f16, bf16, i8, u8, i32, i64, u32, u64, f8e4m3, f8e5m2)"
            ));
        }
    };
    Ok(n.to_string())
}

/// A reduction name, or the valid ones.
pub fn parse_redop(s: &str) -> Result<String, String> {
    let n = s.trim().to_ascii_lowercase();
    if n == "all" {
        return Ok(n);
    }
    RedOp::parse(&n).map(|_| n.clone()).ok_or_else(|| {
        format!("unknown reduction '{s}' (valid: sum, prod, min, max, avg, band, bor, bxor, all)")
    })
}

impl BenchArgs {
    fn verify(&self) -> bool {
        !self.no_check && self.check != Some(0)
    }
}

/// A size as nccl-tests takes it (`8`, `64K`, `256M`, `1G`: powers of 1024), through the
/// parse-size crate (which also takes `1GiB`, `1.5M`, `64 KB`: all binary here).
pub fn parse_size(s: &str) -> Result<u64, String> {
    const SIZES: parse_size::Config = parse_size::Config::new().with_binary();
    SIZES
        .parse_size(s.trim())
        .map_err(|e| format!("invalid size '{s}': {e} (use e.g. 8, 64K, 256M, 1G)"))
}

/// Parsed op selection.
#[derive(Clone, Copy, Debug)]
struct Sel {
    kind: OpKind,
    dtype: DType,
    redop: Option<RedOp>,
}

fn select(a: &BenchArgs) -> Result<Sel, String> {
    let kind = if a.op == "sendrecv" {
        OpKind::Send
    } else {
        OpKind::parse(&a.op).ok_or_else(|| format!("unknown op '{}'", a.op))?
    };
    if kind == OpKind::Recv || kind == OpKind::Barrier {
        return Err(format!("op '{}' cannot be benchmarked; use sendrecv", a.op));
    }
    let dtype = DType::parse(&a.dtype).ok_or_else(|| {
        format!(
            "unknown dtype '{}' ({})",
            a.dtype,
            commd_proto::desc::ALL_DTYPES.map(DType::name).join(", ")
        )
    })?;
    let redop = if kind.reduces() {
        let r = RedOp::parse(&a.redop).ok_or_else(|| {
            format!(
                "unknown reduction '{}' (sum, prod, min, max, avg, band, bor, bxor)",
                a.redop
            )
        })?;
        r.check_dtype(dtype).map_err(|e| e.to_string())?;
        Some(r)
    } else {
        None
    };
    if a.ranks == 0 || a.ranks > 256 {
        return Err("--ranks must be in 1..=256".into());
    }
    if kind == OpKind::Send && a.ranks < 2 {
        return Err("sendrecv needs at least 2 ranks".into());
    }
    if a.root >= a.ranks {
        return Err(format!(
            "--root {} is out of range for {} ranks",
            a.root, a.ranks
        ));
    }
    if a.nodes == 0 || a.nodes > a.ranks {
        return Err("--nodes must be in 1..=--ranks".into());
    }
    if a.step_factor < 2 {
        return Err("--step-factor must be at least 2".into());
    }
    if a.step_bytes == Some(0) {
        return Err("--step-bytes must be at least 1".into());
    }
    if a.nthreads != 1 || a.ngpus != 1 {
        return Err(format!(
            "-t {} -g {}: commd bench runs one single-threaded client process per rank; give the number of ranks with --ranks (-t and -g take 1)",
            a.nthreads, a.ngpus
        ));
    }
    if a.min_bytes == 0 || a.min_bytes > a.max_bytes {
        return Err("need 0 < --min-bytes <= --max-bytes".into());
    }
    Ok(Sel { kind, dtype, redop })
}

/// (size reported, count per descriptor) for a requested size, as nccl-tests defines them.
fn geometry(kind: OpKind, dtype: DType, n: u64, bytes: u64) -> (u64, u64) {
    let es = dtype.size();
    match kind {
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => {
            let c = (bytes / es / n).max(1);
            (c * n * es, c)
        }
        _ => {
            let c = (bytes / es).max(1);
            (c * es, c)
        }
    }
}

fn bus_factor(kind: OpKind, n: u64) -> f64 {
    let n = n as f64;
    match kind {
        OpKind::AllReduce => 2.0 * (n - 1.0) / n,
        OpKind::AllGather | OpKind::ReduceScatter | OpKind::AllToAll => (n - 1.0) / n,
        _ => 1.0,
    }
}

fn sizes(a: &BenchArgs) -> Vec<u64> {
    let mut v = Vec::new();
    let mut s = a.min_bytes;
    while s <= a.max_bytes {
        v.push(s);
        let next = match a.step_bytes {
            Some(b) => s.checked_add(b),
            None => s.checked_mul(a.step_factor),
        };
        match next {
            Some(n) => s = n,
            None => break,
        }
    }
    v
}

fn iters_for(a: &BenchArgs, size: u64) -> (u32, u32) {
    let iters = if a.iters > 0 {
        a.iters
    } else {
        (2u64 << 30).div_ceil(size.max(1)).clamp(5, 1000) as u32
    };
    let warmup = if a.warmup > 0 {
        a.warmup
    } else {
        (iters / 5).clamp(2, 100)
    };
    (iters, warmup)
}

/// One worker's result for one size and placement.
#[derive(Debug, Serialize, Deserialize)]
pub struct WorkerRow {
    pub rank: u32,
    pub size: u64,
    pub inplace: bool,
    pub mean_us: f64,
    pub median_us: f64,
    pub wrong: u64,
    pub error: Option<String>,
    #[serde(default)]
    pub phases: Phases,
}

/// Where an op's time goes, medians over the timed ops (us), and the first op on the buffers
/// (warm-up included): the staging copies of `--memory plain`, the registration lookup of
/// `allocator` (whose first op of the run moves and registers the blocks), the op itself.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    pub first_us: f64,
    pub copy_in_us: f64,
    pub lookup_us: f64,
    pub op_us: f64,
    pub copy_out_us: f64,
}

impl Phases {
    /// Each phase's worst over ranks.
    fn max(self, o: Self) -> Self {
        Self {
            first_us: self.first_us.max(o.first_us),
            copy_in_us: self.copy_in_us.max(o.copy_in_us),
            lookup_us: self.lookup_us.max(o.lookup_us),
            op_us: self.op_us.max(o.op_us),
            copy_out_us: self.copy_out_us.max(o.copy_out_us),
        }
    }
}

/// Single-thread memcpy bandwidth of this machine (GB/s), best of 5, 64 MiB.
pub fn memcpy_gbps() -> f64 {
    let n = 64usize << 20;
    let src = vec![1u8; n];
    let mut dst = vec![0u8; n];
    dst.copy_from_slice(&src);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        best = best.min(t.elapsed().as_secs_f64());
    }
    n as f64 / best / 1e9
}

/// The reductions `-o all` runs, as nccl-tests' (its `mulsum` is commd's PreMulSum, which
/// the bench does not run).
const ALL_REDOPS: [&str; 5] = ["sum", "prod", "min", "max", "avg"];

/// The parent side: [`run_one`] for each dtype and reduction the arguments name (`-d all`,
/// `-o all`: each in turn, one table each; a pair commd does not reduce, e.g. a bitwise
/// reduction of floats, is said and left out). True when every result was right.
pub fn run(
    a: &BenchArgs,
    socket: Option<PathBuf>,
    embedded_cfg: Option<crate::config::Config>,
) -> Result<bool, String> {
    if a.dtype != "all" && a.redop != "all" {
        return run_one(a, socket, embedded_cfg);
    }
    let dtypes: Vec<String> = if a.dtype == "all" {
        commd_proto::desc::ALL_DTYPES
            .iter()
            .map(|d| d.name().to_string())
            .collect()
    } else {
        vec![a.dtype.clone()]
    };
    let reduces = OpKind::parse(&a.op).is_some_and(|k| k.reduces());
    let redops: Vec<String> = match (a.redop.as_str(), reduces) {
        ("all", true) => ALL_REDOPS.iter().map(|r| r.to_string()).collect(),
        ("all", false) => vec!["sum".into()], // not used by this op
        (r, _) => vec![r.to_string()],
    };
    let mut ok = true;
    for d in &dtypes {
        for r in &redops {
            let mut one = a.clone();
            one.dtype.clone_from(d);
            one.redop.clone_from(r);
            if let (Some(op), Some(dt)) = (RedOp::parse(r), DType::parse(d))
                && reduces
                && let Err(e) = op.check_dtype(dt)
            {
                if !a.json && !a.csv {
                    println!("# dtype {d} redop {r}: not run ({e})");
                }
                continue;
            }
            ok &= run_one(&one, socket.clone(), embedded_cfg.clone())?;
        }
    }
    Ok(ok)
}

/// One dtype and reduction: starts the daemon if needed, the workers, and prints the table.
pub fn run_one(
    a: &BenchArgs,
    socket: Option<PathBuf>,
    embedded_cfg: Option<crate::config::Config>,
) -> Result<bool, String> {
    let sel = select(a)?;
    if !a.json && !a.csv {
        // Starting daemons and processes and the first sizes' warm-up take seconds: say so.
        println!(
            "# commd bench: starting {} client process(es) on {} daemon(s)...",
            a.ranks, a.nodes
        );
        let _ = std::io::stdout().flush();
    }
    let daemons = Daemons::start(a, socket, embedded_cfg)?;
    let (_client, mut children) = spawn_workers(a, &daemons.sockets)?;
    let n = u64::from(a.ranks);
    let p = Printer {
        a,
        sel,
        mb: memcpy_gbps(),
        root_col: if sel.kind.has_root() {
            i64::from(a.root)
        } else {
            -1
        },
    };
    let mut out = std::io::stdout().lock();
    p.header(&mut out);
    // Read every worker's rows; rank 0 paces the output.
    let mut readers: Vec<_> = children
        .iter_mut()
        .map(|c| BufReader::new(c.stdout.take().expect("stdout is piped")).lines())
        .collect();
    let mut totals = Totals {
        ok: true,
        ..Totals::default()
    };
    for size in sizes(a) {
        let (sz, count) = geometry(sel.kind, sel.dtype, n, size);
        let mut cols = Vec::new();
        for inplace in [false, true] {
            let c = read_col(&mut readers, sel.kind, n, sz, inplace, a.average)?;
            totals.ok &= c.wrong == 0;
            cols.push(c);
        }
        for c in &cols {
            totals.busbw_sum += c.busbw;
            totals.rows_seen += 1;
            totals.wrong_total += c.wrong;
        }
        p.row(&mut out, sz, count, &cols);
        let _ = out.flush();
    }
    for (r, mut c) in children.into_iter().enumerate() {
        let st = c.wait().map_err(|e| e.to_string())?;
        if !st.success() {
            return Err(format!("worker {r} exited with {st}"));
        }
    }
    p.footer(&mut out, &totals);
    Ok(totals.ok)
}

/// The daemons the workers use (their sockets) and what runs them: embedded daemons and an
/// embedded switch, stopped when this is dropped.
struct Daemons {
    // Dropped in this order: the switch, its runtime, then the daemons.
    switch: Option<commd_switch::server::Running>,
    switch_rt: Option<tokio::runtime::Runtime>,
    embedded: Vec<crate::serve::Running>,
    /// Per node, its daemon's socket.
    sockets: Vec<PathBuf>,
}

impl Daemons {
    /// The daemon at `socket` (one node), or embedded daemons made from `embedded_cfg`, one
    /// per node, with the switch that `--switch` names.
    fn start(
        a: &BenchArgs,
        socket: Option<PathBuf>,
        embedded_cfg: Option<crate::config::Config>,
    ) -> Result<Self, String> {
        let mut d = Daemons {
            switch: None,
            switch_rt: None,
            embedded: Vec::new(),
            sockets: Vec::new(),
        };
        let switch_ctl = d.start_switch(a)?;
        d.sockets = match socket {
            Some(s) if a.nodes == 1 => vec![s],
            Some(_) => {
                return Err(
                    "--nodes > 1 runs its own embedded daemons; do not pass --socket".into(),
                );
            }
            None => {
                let cfg = embedded_cfg.ok_or("no daemon configuration")?;
                d.start_embedded(a, &cfg, switch_ctl.as_deref())?
            }
        };
        Ok(d)
    }

    /// The switch controller's address for `--switch` (`None`: off), starting an embedded
    /// switch for `embedded`.
    fn start_switch(&mut self, a: &BenchArgs) -> Result<Option<String>, String> {
        match a.switch.as_str() {
            "off" => Ok(None),
            _ if a.nodes < 2 => Err("--switch needs --nodes 2 or more".into()),
            "embedded" => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                let args = commd_switch::server::SwitchArgs {
                    listen: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                    data: std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
                    metrics: "off".into(),
                    slots: commd_switch::packet::SLOTS,
                    drop: 0.0,
                    dup: 0.0,
                    reorder: 0.0,
                    seed: 1,
                    pin: "on".into(),
                    slot_metrics: false,
                };
                let r = commd_switch::server::start(&args, &rt)?;
                let ctl = r.listen.to_string();
                self.switch = Some(r);
                self.switch_rt = Some(rt);
                Ok(Some(ctl))
            }
            x => {
                crate::switch::check_controller(x).map_err(|e| format!("--switch {x}: {e}"))?;
                Ok(Some(x.to_string()))
            }
        }
    }

    /// Starts one embedded daemon per node (several: each on its own socket and loopback
    /// ports, through `switch_ctl` when set); returns their sockets.
    fn start_embedded(
        &mut self,
        a: &BenchArgs,
        cfg: &crate::config::Config,
        switch_ctl: Option<&str>,
    ) -> Result<Vec<PathBuf>, String> {
        let mut v = Vec::new();
        for i in 0..a.nodes {
            let mut c = cfg.clone();
            // Embedded daemons serve /metrics on an ephemeral port of the configured
            // address: several of them (--nodes), or one beside the host's own daemon,
            // would otherwise fight over the same port (an ERROR each).
            if let Some(m) = &mut c.telemetry.metrics_listen {
                m.set_port(0);
            }
            if a.nodes > 1 {
                c.socket = cfg.socket.with_file_name(format!("node{i}.sock"));
                c.peer_listen = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
                c.peer_listen_explicit = true;
                c.advertise = String::new();
                if let Some(ctl) = switch_ctl {
                    c.switch.controller = ctl.to_string();
                }
                if c.switch.bind.is_empty() {
                    c.switch.bind = format!("127.0.0.{}", 10 + i);
                }
            }
            v.push(c.socket.clone());
            self.embedded.push(
                crate::serve::start(c).map_err(|e| format!("starting embedded daemon {i}: {e}"))?,
            );
        }
        Ok(v)
    }
}

/// Starts one worker process per rank, each on its node's daemon (`sockets`), in a
/// communicator whose unique id comes from a client of node 0's daemon; that client is kept
/// open for the run.
fn spawn_workers(a: &BenchArgs, sockets: &[PathBuf]) -> Result<(Client, Vec<Child>), String> {
    let node_of =
        |r: u32| commd_proto::num::usize_of(u64::from(r) * u64::from(a.nodes) / u64::from(a.ranks));
    let socket = sockets[0].clone();
    let client = Client::connect(Some(&socket)).map_err(|e| e.to_string())?;
    let uid = client.unique_id().map_err(|e| e.to_string())?;
    let uid_hex: String = uid.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let args_json = serde_json::to_string(a).map_err(|e| e.to_string())?;
    let mut children = Vec::new();
    for r in 0..a.ranks {
        let c = Command::new(&exe)
            .arg("bench-worker")
            .arg("--socket")
            .arg(&sockets[node_of(r)])
            .arg("--uid")
            .arg(&uid_hex)
            .arg("--rank")
            .arg(r.to_string())
            .arg("--args")
            .arg(&args_json)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting worker {r}: {e}"))?;
        children.push(c);
    }
    Ok((client, children))
}

/// One placement (out of place or in place) of one size over every rank: the ranks' mean and
/// median times (us) as `-a` combines them (default: the slowest rank's), the bandwidths (GB/s) and the wrong elements of all ranks.
#[derive(Clone, Copy, Debug)]
struct Col {
    mean: f64,
    med: f64,
    algbw: f64,
    busbw: f64,
    wrong: u64,
    inplace: bool,
    phases: Phases,
}

/// The run's sums for the closing lines.
#[derive(Debug, Default)]
struct Totals {
    /// Every result verified correct (or not checked).
    ok: bool,
    busbw_sum: f64,
    rows_seen: u32,
    wrong_total: u64,
}

/// Reads every worker's row of one size and placement (`sz` bytes reported).
/// The ranks' times as one, by nccl-tests' `-a`: 0 rank 0's, 1 the mean, 2 the least, 3 the
/// most.
fn over_ranks(v: &[f64], average: u8) -> f64 {
    match average {
        0 => v.first().copied().unwrap_or(0.0),
        1 => v.iter().sum::<f64>() / v.len().max(1) as f64,
        2 => v.iter().copied().fold(f64::INFINITY, f64::min),
        _ => v.iter().copied().fold(0.0, f64::max),
    }
}

fn read_col(
    readers: &mut [std::io::Lines<BufReader<ChildStdout>>],
    kind: OpKind,
    n: u64,
    sz: u64,
    inplace: bool,
    average: u8,
) -> Result<Col, String> {
    let mut means = Vec::with_capacity(readers.len());
    let mut meds = Vec::with_capacity(readers.len());
    let mut wrong = 0u64;
    let mut phases = Phases::default();
    for (r, rd) in readers.iter_mut().enumerate() {
        let line = rd
            .next()
            .and_then(|l| l.ok())
            .ok_or_else(|| format!("worker {r} exited early"))?;
        let row: WorkerRow = serde_json::from_str(&line)
            .map_err(|e| format!("worker {r}: bad row {line:?}: {e}"))?;
        if let Some(e) = row.error {
            return Err(format!("rank {r}: {e}"));
        }
        means.push(row.mean_us);
        meds.push(row.median_us);
        wrong += row.wrong;
        phases = phases.max(row.phases);
    }
    let (mean, med) = (over_ranks(&means, average), over_ranks(&meds, average));
    let algbw = sz as f64 / (mean * 1e-6) / 1e9;
    let busbw = algbw * bus_factor(kind, n);
    Ok(Col {
        mean,
        med,
        algbw,
        busbw,
        wrong,
        inplace,
        phases,
    })
}

/// Writes the parent's output as a table (nccl-tests' layout), CSV or JSON lines.
struct Printer<'a> {
    a: &'a BenchArgs,
    sel: Sel,
    /// The memcpy reference (GB/s).
    mb: f64,
    /// The root rank, or -1 for ops without one.
    root_col: i64,
}

impl Printer<'_> {
    fn redop(&self) -> &'static str {
        self.sel.redop.map(|r| r.name()).unwrap_or("none")
    }

    /// The table's first line: the selection and where the ranks run.
    fn title(&self, out: &mut impl Write) {
        let (a, sel) = (self.a, self.sel);
        let _ = writeln!(
            out,
            "# commd bench: op {} ranks {} dtype {} redop {} memory {} (client processes: {}, nodes: {}{}{})",
            a.op,
            a.ranks,
            sel.dtype.name(),
            self.redop(),
            a.memory,
            a.ranks,
            a.nodes,
            if a.nodes > 1 {
                ", embedded daemons on loopback, inter-node transport "
            } else {
                ""
            },
            if a.nodes > 1 {
                format!(
                    "{}{}",
                    crate::net::rdma::summary().0,
                    if a.switch != "off" {
                        ", all-reduce across nodes through a switch session"
                    } else {
                        ""
                    }
                )
            } else {
                String::new()
            }
        );
    }

    /// The CSV header, or the table's title and column heads (JSON: nothing).
    fn header(&self, out: &mut impl Write) {
        let (a, mb) = (self.a, self.mb);
        if a.csv {
            let _ = writeln!(
                out,
                "op,ranks,nodes,dtype,redop,root,size,count,inplace,time_us,median_us,algbw_gbps,busbw_gbps,wrong"
            );
        }
        if a.json || a.csv {
            return;
        }
        self.title(out);
        let _ = writeln!(
            out,
            "# memcpy reference: {mb:.2} GB/s (single thread, 64 MiB)"
        );
        let _ = writeln!(
            out,
            "#                                               out-of-place                           in-place"
        );
        let _ = writeln!(
            out,
            "# {:>12} {:>12} {:>5} {:>6} {:>5} {:>9} {:>9} {:>7} {:>7} {:>6} {:>9} {:>9} {:>7} {:>7} {:>6}",
            "size",
            "count",
            "type",
            "redop",
            "root",
            "time",
            "med",
            "algbw",
            "busbw",
            "#wrong",
            "time",
            "med",
            "algbw",
            "busbw",
            "#wrong"
        );
        let _ = writeln!(
            out,
            "# {:>12} {:>12} {:>5} {:>6} {:>5} {:>9} {:>9} {:>7} {:>7} {:>6} {:>9} {:>9} {:>7} {:>7} {:>6}",
            "(B)",
            "(elems)",
            "",
            "",
            "",
            "(us)",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            "",
            "(us)",
            "(us)",
            "(GB/s)",
            "(GB/s)",
            ""
        );
    }

    /// One size: a CSV or JSON line per placement, or one table row of both (`cols`: out of
    /// place, then in place).
    fn row(&self, out: &mut impl Write, sz: u64, count: u64, cols: &[Col]) {
        let (a, sel, mb, root_col) = (self.a, self.sel, self.mb, self.root_col);
        if a.csv {
            for c in cols {
                let (t, m, al, bu, w, ip) = (c.mean, c.med, c.algbw, c.busbw, c.wrong, c.inplace);
                let _ = writeln!(
                    out,
                    "{},{},{},{},{},{root_col},{sz},{count},{ip},{t:.3},{m:.3},{al:.4},{bu:.4},{w}",
                    a.op,
                    a.ranks,
                    a.nodes,
                    sel.dtype.name(),
                    self.redop(),
                );
            }
        } else if a.json {
            for c in cols {
                let (t, m, al, bu, w, ip) = (c.mean, c.med, c.algbw, c.busbw, c.wrong, c.inplace);
                let mut j = serde_json::json!({"op": a.op, "ranks": a.ranks, "nodes": a.nodes, "dtype": sel.dtype.name(), "redop": self.redop(), "size": sz, "count": count, "inplace": ip,
                    "time_us": t, "median_us": m, "algbw": al, "busbw": bu, "wrong": w, "memcpy_gbps": mb, "memory": a.memory});
                if a.memory != "registered" {
                    j["phases"] = serde_json::json!(c.phases);
                }
                let _ = writeln!(out, "{j}");
            }
        } else {
            let (a0, b0) = (&cols[0], &cols[1]);
            let _ = writeln!(
                out,
                "  {:>12} {:>12} {:>5} {:>6} {:>5} {:>9.2} {:>9.2} {:>7.2} {:>7.2} {:>6} {:>9.2} {:>9.2} {:>7.2} {:>7.2} {:>6}",
                sz,
                count,
                sel.dtype.name(),
                self.redop(),
                root_col,
                a0.mean,
                a0.med,
                a0.algbw,
                a0.busbw,
                a0.wrong,
                b0.mean,
                b0.med,
                b0.algbw,
                b0.busbw,
                b0.wrong
            );
            if a.memory != "registered" {
                let p = |c: &Col| {
                    let q = c.phases;
                    format!(
                        "first {:.1}, copy in {:.1}, lookup {:.1}, op {:.1}, copy out {:.1}",
                        q.first_us, q.copy_in_us, q.lookup_us, q.op_us, q.copy_out_us
                    )
                };
                let _ = writeln!(
                    out,
                    "  {:>12}   phases, median us: out of place: {}; in place: {}",
                    "",
                    p(a0),
                    p(b0)
                );
            }
        }
    }

    /// The table's closing lines (CSV, JSON: nothing).
    fn footer(&self, out: &mut impl Write, totals: &Totals) {
        let a = self.a;
        if a.json || a.csv {
            return;
        }
        let wrong_total = totals.wrong_total;
        // nccl-tests' closing lines, which scripts grep for.
        let _ = if a.verify() {
            writeln!(
                out,
                "# Out of bounds values : {wrong_total} {}",
                if wrong_total == 0 { "OK" } else { "FAILED" }
            )
        } else {
            writeln!(out, "# Out of bounds values : N/A (not checked)")
        };
        let _ = writeln!(
            out,
            "# Avg bus bandwidth    : {:.4}",
            totals.busbw_sum / f64::from(totals.rows_seen.max(1))
        );
        let _ = writeln!(
            out,
            "# verification: {}",
            if !a.verify() {
                "skipped"
            } else if totals.ok {
                "all results correct"
            } else {
                "WRONG RESULTS"
            }
        );
    }
}

#[cfg(test)]
mod tests;
