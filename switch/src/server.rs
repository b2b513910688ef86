//! `commd switch`: a software SwitchML switch for hosts without a programmable switch, and for
//! tests. It serves the SwitchML controller gRPC API (`switchml_proto` Session + Sync) and the
//! UDP data plane with the switch's exact aggregation semantics ([`super::agg`]), and goes beyond
//! the original:
//! - several concurrent sessions, each with its own slot pool (a real switch holds one);
//! - per-session, per-worker and per-slot counters at `/metrics`;
//! - optional drop / duplicate / reorder injection for tests;
//! - late copies of earlier rounds are dropped instead of added (see [`super::agg::Verdict`]).
//!
//! Workers are told apart by source address. A commd worker also sends its first UDP port and
//! thread count as gRPC metadata (`commd-worker-port`, `commd-worker-threads`), which lets
//! sessions share worker IPs; a reference client that does not is matched by IP alone. Barrier
//! and Broadcast are scoped by the `commd-scope` metadata when present (a real controller has a
//! single scope). The data port is returned as `commd-data-port` response metadata.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use commd_proto::switchml_pb as pb;
use pb::session_server::{Session, SessionServer};
use pb::sync_server::{Sync as SyncSvc, SyncServer};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry as PromRegistry;
use rand::{Rng, SeedableRng};
use tonic::{Request, Response, Status};

use super::agg::{Pool, SlotCounters, Verdict};
use super::packet::{Header, MAX_WORKERS, PacketSize, SLOTS};
use super::udpio::Stats;
use commd_host::cores;

/// `commd switch` options.
#[derive(Clone, Debug, clap::Args)]
pub struct SwitchArgs {
    /// Controller gRPC address (SwitchML's default port is 50099). Loopback unless told
    /// otherwise, like every commd listener: pass an address the nodes reach to serve them.
    #[arg(long, default_value = "127.0.0.1:50099")]
    pub listen: SocketAddr,
    /// UDP data-plane address (a real switch uses port 0xBEE0 = 48864; 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:48864")]
    pub data: SocketAddr,
    /// Prometheus metrics address (`off` to disable).
    #[arg(long, default_value = "127.0.0.1:9466")]
    pub metrics: String,
    /// Slots per session (a real switch has 8192).
    #[arg(long, default_value_t = SLOTS)]
    pub slots: usize,
    /// Drop this fraction of packets (both directions), for tests.
    #[arg(long, default_value_t = 0.0)]
    pub drop: f64,
    /// Duplicate this fraction of packets (both directions), for tests.
    #[arg(long, default_value_t = 0.0)]
    pub dup: f64,
    /// Hold back this fraction of incoming packets until after the next one, for tests.
    #[arg(long, default_value_t = 0.0)]
    pub reorder: f64,
    /// Seed of the fault injection.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Pin the data-plane thread to a free core (see `commd status`: never a core another
    /// polling thread on this host holds).
    #[arg(long, default_value = "on")]
    pub pin: String,
    /// Also export per-slot series (`commd_switch_slot_*`: up to --slots per session, so off
    /// by default to keep the metrics' series bounded).
    #[arg(long)]
    pub slot_metrics: bool,
}

#[derive(Default)]
struct WorkerCounters {
    packets: u64,
    bytes: u64,
    duplicates: u64,
    stale: u64,
    results: u64,
}

struct SessionState {
    id: u64,
    size: PacketSize,
    /// Each rank's IPv4, once registered.
    members: Vec<Option<Ipv4Addr>>,
    pool: Pool,
    workers: Vec<WorkerCounters>,
    completions: u64,
}

#[derive(Default)]
struct Registry {
    sessions: HashMap<u64, SessionState>,
    /// (worker IP, source port or 0 = any) -> (session, rank).
    by_addr: HashMap<(Ipv4Addr, u16), (u64, u32)>,
    unknown: u64,
    malformed: u64,
    injected_drops: u64,
    injected_dups: u64,
    injected_reorders: u64,
}

/// State shared by the controller, the data plane and `/metrics`.
pub struct Switch {
    reg: Mutex<Registry>,
    data_addr: SocketAddr,
    slots: usize,
    core: Mutex<String>,
    /// `--slot-metrics`: export the per-slot series.
    slot_metrics: bool,
    stats: Stats,
    stop: AtomicBool,
    sync: Mutex<HashMap<String, SyncScope>>,
    notify: tokio::sync::watch::Sender<u64>,
    generation: AtomicU64,
}

#[derive(Default)]
struct SyncScope {
    barrier_count: u32,
    barrier_gen: u64,
    bcast_count: u32,
    bcast_gen: u64,
    bcast_value: Option<u64>,
    bcast_done: HashMap<u64, u64>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn meta(r: &tonic::metadata::MetadataMap, k: &str) -> Option<String> {
    r.get(k).and_then(|v| v.to_str().ok()).map(str::to_string)
}

/// A locally administered MAC from the switch's IP (the software switch has no MAC of its own).
fn mac_of(ip: Ipv4Addr) -> u64 {
    0x0200_0000_0000 | u64::from(u32::from(ip))
}

impl Switch {
    fn bump(&self) {
        let g = self.generation.fetch_add(1, Ordering::AcqRel) + 1;
        let _ = self.notify.send(g);
    }

    fn register(&self, r: &pb::UdpSessionRequest, port: u16, threads: u16) -> Result<(), Status> {
        let n = r.num_workers as usize;
        if n == 0 || n > MAX_WORKERS {
            return Err(Status::invalid_argument(format!(
                "num_workers {n} must be 1..={MAX_WORKERS}"
            )));
        }
        if r.rank as usize >= n {
            return Err(Status::invalid_argument(format!(
                "rank {} out of range for {n} workers",
                r.rank
            )));
        }
        let size = u8::try_from(r.packet_size)
            .ok()
            .and_then(PacketSize::from_code)
            .filter(|s| s.processed())
            .ok_or_else(|| {
                Status::invalid_argument(format!(
                    "packet size code {} is not aggregated (MTU_256 or MTU_1024)",
                    r.packet_size
                ))
            })?;
        if r.ipv4 == 0 {
            return Err(Status::invalid_argument("worker ipv4 is 0"));
        }
        let ip = Ipv4Addr::from(r.ipv4);
        let mut reg = lock(&self.reg);
        if r.rank == 0 {
            // Rank 0 registers first and (re)creates the session; this wipes a session with the
            // same id (a real switch wipes everything).
            reg.sessions.insert(
                r.session_id,
                SessionState {
                    id: r.session_id,
                    size,
                    members: vec![None; n],
                    pool: Pool::new(r.num_workers, size.values(), self.slots),
                    workers: (0..n).map(|_| WorkerCounters::default()).collect(),
                    completions: 0,
                },
            );
            let id = r.session_id;
            reg.by_addr.retain(|_, v| v.0 != id);
        }
        let Some(s) = reg.sessions.get_mut(&r.session_id) else {
            return Err(Status::failed_precondition(format!(
                "session {:#x} is not registered: rank 0 registers first",
                r.session_id
            )));
        };
        if s.members.len() != n || s.size != size {
            return Err(Status::invalid_argument(format!(
                "session {:#x} has {} workers and {}-byte packets; rank {} asked for {n} and {}",
                r.session_id,
                s.members.len(),
                s.size.bytes(),
                r.rank,
                size.bytes()
            )));
        }
        s.members[r.rank as usize] = Some(ip);
        let keys: Vec<(Ipv4Addr, u16)> = if port == 0 {
            vec![(ip, 0)]
        } else {
            (0..threads.max(1))
                .map(|t| (ip, port.wrapping_add(t)))
                .collect()
        };
        for k in keys {
            reg.by_addr.insert(k, (r.session_id, r.rank));
        }
        tracing::info!(target: "commd::switch", "session {:#x}: rank {} of {n} registered from {ip} (ports {port}+{threads}), {}-byte packets", r.session_id, r.rank, size.bytes());
        Ok(())
    }
}

struct Ctl(Arc<Switch>);

#[tonic::async_trait]
impl Session for Ctl {
    async fn rdma_session(
        &self,
        _r: Request<pb::RdmaSessionRequest>,
    ) -> Result<Response<pb::RdmaSessionResponse>, Status> {
        Err(Status::unimplemented(
            "commd switch serves UDP sessions only (RDMA sessions need a Tofino switch)",
        ))
    }

    async fn udp_session(
        &self,
        r: Request<pb::UdpSessionRequest>,
    ) -> Result<Response<pb::UdpSessionResponse>, Status> {
        let local = r
            .extensions()
            .get::<tonic::transport::server::TcpConnectInfo>()
            .and_then(|i| i.local_addr());
        let port = meta(r.metadata(), "commd-worker-port")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0u16);
        let threads = meta(r.metadata(), "commd-worker-threads")
            .and_then(|v| v.parse().ok())
            .unwrap_or(1u16);
        let req = r.into_inner();
        self.0.register(&req, port, threads)?;
        let ip = match self.0.data_addr.ip() {
            IpAddr::V4(a) if !a.is_unspecified() => a,
            _ => match local.map(|a| a.ip()) {
                Some(IpAddr::V4(a)) => a,
                _ => Ipv4Addr::LOCALHOST,
            },
        };
        let mut resp = Response::new(pb::UdpSessionResponse {
            session_id: req.session_id,
            mac: mac_of(ip),
            ipv4: u32::from(ip),
        });
        if let Ok(v) = self.0.data_addr.port().to_string().parse() {
            resp.metadata_mut().insert("commd-data-port", v);
        }
        Ok(resp)
    }
}

#[tonic::async_trait]
impl SyncSvc for Ctl {
    async fn barrier(
        &self,
        r: Request<pb::BarrierRequest>,
    ) -> Result<Response<pb::BarrierResponse>, Status> {
        let scope = meta(r.metadata(), "commd-scope").unwrap_or_default();
        let n = r.into_inner().num_workers;
        if n == 0 || n as usize > MAX_WORKERS {
            return Err(Status::invalid_argument("num_workers must be 1..=32"));
        }
        let sw = &self.0;
        let mut rx = sw.notify.subscribe();
        let mine = {
            let mut g = lock(&sw.sync);
            let s = g.entry(scope.clone()).or_default();
            let mine = s.barrier_gen;
            s.barrier_count += 1;
            if s.barrier_count >= n {
                s.barrier_count = 0;
                s.barrier_gen += 1;
                drop(g);
                sw.bump();
                return Ok(Response::new(pb::BarrierResponse {}));
            }
            mine
        };
        loop {
            if rx.changed().await.is_err() {
                return Err(Status::unavailable("switch shutting down"));
            }
            let g = lock(&sw.sync);
            if g.get(&scope).is_some_and(|s| s.barrier_gen != mine) {
                return Ok(Response::new(pb::BarrierResponse {}));
            }
        }
    }

    async fn broadcast(
        &self,
        r: Request<pb::BroadcastRequest>,
    ) -> Result<Response<pb::BroadcastResponse>, Status> {
        let scope = meta(r.metadata(), "commd-scope").unwrap_or_default();
        let q = r.into_inner();
        if q.num_workers == 0 || q.num_workers as usize > MAX_WORKERS || q.root >= q.num_workers {
            return Err(Status::invalid_argument(
                "num_workers must be 1..=32 and root < num_workers",
            ));
        }
        let sw = &self.0;
        let mut rx = sw.notify.subscribe();
        let mine = {
            let mut g = lock(&sw.sync);
            let s = g.entry(scope.clone()).or_default();
            let mine = s.bcast_gen;
            if q.rank == q.root {
                s.bcast_value = Some(q.value);
            }
            s.bcast_count += 1;
            if s.bcast_count >= q.num_workers {
                let v = s.bcast_value.take().unwrap_or(0);
                s.bcast_done.insert(mine, v);
                s.bcast_done.retain(|k, _| *k + 8 > mine);
                s.bcast_count = 0;
                s.bcast_gen += 1;
                drop(g);
                sw.bump();
                return Ok(Response::new(pb::BroadcastResponse { value: v }));
            }
            mine
        };
        loop {
            if rx.changed().await.is_err() {
                return Err(Status::unavailable("switch shutting down"));
            }
            let g = lock(&sw.sync);
            if let Some(v) = g.get(&scope).and_then(|s| s.bcast_done.get(&mine)) {
                return Ok(Response::new(pb::BroadcastResponse { value: *v }));
            }
        }
    }
}

/// Faults injected into the data plane.
struct Faults {
    drop: f64,
    dup: f64,
    reorder: f64,
    rng: rand::rngs::StdRng,
    held: Option<(Vec<u8>, SocketAddr)>,
}

impl Faults {
    /// Whether outgoing packets are subject to drop or duplication (then every copy of a
    /// multicast result is decided on its own).
    fn on_output(&self) -> bool {
        self.drop > 0.0 || self.dup > 0.0
    }
}

/// Where a group of result packets goes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dest {
    /// Every member of a session, at one source port (multicast emulated by unicasts of the
    /// same buffer).
    Members(u64, u16),
    One(SocketAddr),
}

/// Result packets of one receive batch, grouped by destination and packet size so that each
/// group leaves in GSO sends of one contiguous buffer. Buffers are kept across batches: the
/// data plane allocates nothing per packet.
#[derive(Default)]
struct OutQueue {
    groups: Vec<OutGroup>,
}

struct OutGroup {
    dest: Dest,
    seg: usize,
    bytes: Vec<u8>,
    dsts: Vec<SocketAddr>,
}

impl OutQueue {
    /// Appends a packet of `seg` bytes to `dest`'s group and returns it to be written.
    fn push(
        &mut self,
        dest: Dest,
        seg: usize,
        dsts: impl FnOnce(&mut Vec<SocketAddr>),
    ) -> &mut [u8] {
        let i = match self
            .groups
            .iter()
            .position(|g| g.dest == dest && g.seg == seg && !g.bytes.is_empty())
        {
            Some(i) => i,
            None => match self.groups.iter().position(|g| g.bytes.is_empty()) {
                Some(i) => {
                    let g = &mut self.groups[i];
                    g.dest = dest;
                    g.seg = seg;
                    i
                }
                None => {
                    self.groups.push(OutGroup {
                        dest,
                        seg,
                        bytes: Vec::new(),
                        dsts: Vec::new(),
                    });
                    self.groups.len() - 1
                }
            },
        };
        let g = &mut self.groups[i];
        if g.bytes.is_empty() {
            g.dsts.clear();
            match dest {
                Dest::One(a) => g.dsts.push(a),
                Dest::Members(..) => dsts(&mut g.dsts),
            }
        }
        let at = g.bytes.len();
        g.bytes.resize(at + seg, 0);
        &mut g.bytes[at..]
    }

    /// Sends every group to each of its destinations; returns the packets sent.
    fn flush(&mut self, sock: &UdpSocket, stats: &Stats) -> u64 {
        let mut sent = 0u64;
        for g in &mut self.groups {
            if g.bytes.is_empty() {
                continue;
            }
            for d in &g.dsts {
                if let Err(e) = super::udpio::send_contig(sock, Some(*d), &g.bytes, g.seg, stats) {
                    tracing::debug!(target: "commd::switch", "sending results to {d}: {e}");
                }
                sent += g.bytes.len().div_ceil(g.seg) as u64;
            }
            g.bytes.clear();
        }
        sent
    }
}

impl Switch {
    /// The data-plane loop: receive a batch, aggregate under one lock, send the replies.
    fn data_plane(self: &Arc<Self>, sock: UdpSocket, mut f: Faults, pin: bool) {
        let claim = cores::claim("commd switch data plane", pin);
        *lock(&self.core) = claim.text();
        tracing::info!(target: "commd::switch", "data plane thread: {}", claim.text());
        super::udpio::enable_gro(&sock);
        let mut rb = super::udpio::RecvBufs::new();
        let mut out = OutQueue::default();
        let mut scratch: Vec<u8> = Vec::new();
        while !self.stop.load(Ordering::Acquire) {
            let n = match super::udpio::recv(&sock, &mut rb, &self.stats) {
                Ok(0) => {
                    super::udpio::wait_readable(&sock, Duration::from_millis(100));
                    continue;
                }
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(target: "commd::switch", "data plane: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            {
                let mut reg = lock(&self.reg);
                let mut held_now: Option<(Vec<u8>, SocketAddr)> = None;
                for i in 0..n {
                    let (b, from) = rb.packet(i);
                    if f.drop > 0.0 && f.rng.random_bool(f.drop) {
                        reg.injected_drops += 1;
                        continue;
                    }
                    if f.reorder > 0.0
                        && held_now.is_none()
                        && f.held.is_none()
                        && f.rng.random_bool(f.reorder)
                    {
                        reg.injected_reorders += 1;
                        held_now = Some((b.to_vec(), from));
                        continue;
                    }
                    let copies = if f.dup > 0.0 && f.rng.random_bool(f.dup) {
                        reg.injected_dups += 1;
                        2
                    } else {
                        1
                    };
                    for _ in 0..copies {
                        self.handle(&mut reg, b, from, &mut out, &mut f, &mut scratch);
                    }
                }
                if let Some((b, from)) = f.held.take() {
                    self.handle(&mut reg, &b, from, &mut out, &mut f, &mut scratch);
                }
                f.held = held_now;
            }
            let sent = out.flush(&sock, &self.stats);
            self.stats.packets_sent.fetch_add(sent, Ordering::Relaxed);
        }
    }

    /// Applies one packet and queues its replies in `out`.
    fn handle(
        &self,
        reg: &mut Registry,
        pkt: &[u8],
        from: SocketAddr,
        out: &mut OutQueue,
        f: &mut Faults,
        scratch: &mut Vec<u8>,
    ) {
        let SocketAddr::V4(from4) = from else {
            reg.unknown += 1;
            return;
        };
        let h = match Header::parse(pkt) {
            Ok(h) => h,
            Err(_) => {
                reg.malformed += 1;
                return;
            }
        };
        let key = (*from4.ip(), from4.port());
        let Some(&(sid, rank)) = reg
            .by_addr
            .get(&key)
            .or_else(|| reg.by_addr.get(&(*from4.ip(), 0)))
        else {
            reg.unknown += 1;
            return;
        };
        let Some(s) = reg.sessions.get_mut(&sid) else {
            reg.unknown += 1;
            return;
        };
        if h.size != s.size || !s.pool.fits(&h) {
            reg.malformed += 1;
            return;
        }
        let wc = &mut s.workers[rank as usize];
        wc.packets += 1;
        wc.bytes += pkt.len() as u64;
        let v = s.pool.on_packet(rank, &h, pkt);
        let len = h.wire_len();
        match v {
            Verdict::Absorbed => {}
            Verdict::Complete => {
                s.completions += 1;
                for (k, m) in s.members.iter().enumerate() {
                    if m.is_some()
                        && let Some(wc) = s.workers.get_mut(k)
                    {
                        wc.results += 1;
                    }
                }
                // Multicast, emulated by unicasts: every worker's IP, the completing packet's
                // source port.
                let port = from4.port();
                if !f.on_output() {
                    let members = &s.members;
                    let b = out.push(Dest::Members(sid, port), len, |d| {
                        d.extend(
                            members
                                .iter()
                                .flatten()
                                .map(|ip| SocketAddr::new(IpAddr::V4(*ip), port)),
                        )
                    });
                    s.pool.write_result(&h, b);
                    return;
                }
                scratch.resize(len, 0);
                s.pool.write_result(&h, scratch);
                for ip in s.members.iter().flatten() {
                    let to = SocketAddr::new(IpAddr::V4(*ip), port);
                    if f.rng.random_bool(f.drop) {
                        reg.injected_drops += 1;
                        continue;
                    }
                    let copies = if f.dup > 0.0 && f.rng.random_bool(f.dup) {
                        reg.injected_dups += 1;
                        2
                    } else {
                        1
                    };
                    for _ in 0..copies {
                        out.push(Dest::One(to), len, |_| {})
                            .copy_from_slice(scratch);
                    }
                }
            }
            Verdict::Resend => {
                s.workers[rank as usize].duplicates += 1;
                s.workers[rank as usize].results += 1;
                if f.on_output() && f.rng.random_bool(f.drop) {
                    reg.injected_drops += 1;
                    return;
                }
                let b = out.push(Dest::One(from), len, |_| {});
                s.pool.write_result(&h, b);
            }
            Verdict::DupDropped => s.workers[rank as usize].duplicates += 1,
            Verdict::Stale => s.workers[rank as usize].stale += 1,
        }
    }

    /// OpenMetrics text (prometheus-client, rendered per scrape from a fresh registry):
    /// sessions, workers, injected faults, the data-plane core; per-slot series (up to
    /// `--slots` per session) only with `--slot-metrics`.
    pub fn metrics_text(&self) -> String {
        use prometheus_client::metrics::gauge::Gauge;
        let reg = lock(&self.reg);
        let mut r = PromRegistry::default();
        let sessions = Gauge::<i64>::default();
        sessions.set(i64::try_from(reg.sessions.len()).unwrap_or(i64::MAX));
        r.register("commd_switch_sessions", "Sessions open", sessions);
        let mut sess = Vec::new();
        let mut wk: Vec<(Labels, &WorkerCounters)> = Vec::new();
        let mut slot = Vec::new();
        for s in reg.sessions.values() {
            let sid = ("session", format!("{:#x}", s.id));
            sess.push((vec![sid.clone()], s.completions));
            for (r, w) in s.workers.iter().enumerate() {
                wk.push((vec![sid.clone(), ("worker", r.to_string())], w));
            }
            if self.slot_metrics {
                for (i, c) in s.pool.slot_counters.iter().enumerate() {
                    if c.packets > 0 {
                        slot.push((vec![sid.clone(), ("slot", i.to_string())], *c));
                    }
                }
            }
        }
        counters(
            &mut r,
            "commd_switch_completions",
            "Slot rounds completed (results multicast)",
            sess,
        );
        type WorkerField = fn(&WorkerCounters) -> u64;
        let per_worker: [(&str, &str, WorkerField); 5] = [
            (
                "commd_switch_worker_packets",
                "Packets received per worker",
                |w| w.packets,
            ),
            (
                "commd_switch_worker_bytes",
                "UDP payload bytes received per worker",
                |w| w.bytes,
            ),
            (
                "commd_switch_worker_duplicates",
                "Retransmitted packets per worker",
                |w| w.duplicates,
            ),
            (
                "commd_switch_worker_stale",
                "Late copies of earlier rounds dropped per worker",
                |w| w.stale,
            ),
            (
                "commd_switch_worker_results",
                "Result packets sent per worker",
                |w| w.results,
            ),
        ];
        for (name, help, f) in per_worker {
            counters(
                &mut r,
                name,
                help,
                wk.iter().map(|(l, w)| (l.clone(), f(w))).collect(),
            );
        }
        type SlotField = fn(&SlotCounters) -> u64;
        let per_slot: [(&str, &str, SlotField); 3] = [
            (
                "commd_switch_slot_packets",
                "Packets per slot (used slots only)",
                |c| c.packets,
            ),
            (
                "commd_switch_slot_completions",
                "Completions per slot",
                |c| c.completions,
            ),
            ("commd_switch_slot_duplicates", "Duplicates per slot", |c| {
                c.duplicates
            }),
        ];
        if self.slot_metrics {
            for (name, help, f) in per_slot {
                counters(
                    &mut r,
                    name,
                    help,
                    slot.iter().map(|(l, c)| (l.clone(), f(c))).collect(),
                );
            }
        }
        let one = |k: &'static str, v: &str| vec![(k, v.to_string())];
        counters(
            &mut r,
            "commd_switch_dropped",
            "Packets dropped: unknown sender, malformed",
            vec![
                (one("reason", "unknown_sender"), reg.unknown),
                (one("reason", "malformed"), reg.malformed),
            ],
        );
        counters(
            &mut r,
            "commd_switch_injected",
            "Faults injected (--drop/--dup/--reorder)",
            vec![
                (one("fault", "drop"), reg.injected_drops),
                (one("fault", "dup"), reg.injected_dups),
                (one("fault", "reorder"), reg.injected_reorders),
            ],
        );
        counters(
            &mut r,
            "commd_switch_syscalls",
            "Data-plane send and receive system calls",
            vec![
                (
                    one("call", "sendmmsg"),
                    self.stats.send_calls.load(Ordering::Relaxed),
                ),
                (
                    one("call", "recvmmsg"),
                    self.stats.recv_calls.load(Ordering::Relaxed),
                ),
            ],
        );
        let sent = Counter::<u64>::default();
        sent.inc_by(self.stats.packets_sent.load(Ordering::Relaxed));
        r.register("commd_switch_packets_sent", "Result packets sent", sent);
        let core = Family::<Labels, Gauge<i64>>::default();
        core.get_or_create(&one("where", &lock(&self.core).to_string()))
            .set(1);
        r.register(
            "commd_switch_data_plane_core",
            "Where the data-plane thread runs (the label; the value is 1)",
            core,
        );
        drop(reg);
        let mut o = String::new();
        if let Err(e) = encode(&mut o, &r) {
            tracing::warn!(target: "commd::switch", "metrics: {e}");
        }
        o
    }
}

type Labels = Vec<(&'static str, String)>;

/// Registers a counter family with one series per row.
fn counters(r: &mut PromRegistry, name: &str, help: &str, rows: Vec<(Labels, u64)>) {
    let f = Family::<Labels, Counter<u64>>::default();
    for (l, v) in rows {
        f.get_or_create(&l).inc_by(v);
    }
    r.register(name, help, f);
}

/// A running switch (for `commd switch` and tests).
pub struct Running {
    pub switch: Arc<Switch>,
    pub listen: SocketAddr,
    pub data: SocketAddr,
    pub metrics: Option<SocketAddr>,
    /// The bound `/metrics` listener, for the caller to serve [`Switch::metrics_text`] on
    /// (`commd switch` does, with the daemon's HTTP endpoint).
    pub metrics_listener: Option<tokio::net::TcpListener>,
}

/// Binds everything, starts the data-plane thread and the gRPC controller on `rt`.
pub fn start(a: &SwitchArgs, rt: &tokio::runtime::Runtime) -> Result<Running, String> {
    if !(0.0..=1.0).contains(&a.drop)
        || !(0.0..=1.0).contains(&a.dup)
        || !(0.0..=1.0).contains(&a.reorder)
    {
        return Err("--drop, --dup and --reorder are fractions in 0..=1".into());
    }
    let pin = match a.pin.as_str() {
        "on" | "auto" => true,
        "off" => false,
        x => return Err(format!("--pin {x}: expected on or off")),
    };
    let sock = UdpSocket::bind(a.data).map_err(|e| format!("cannot bind UDP {}: {e}", a.data))?;
    let data = sock.local_addr().map_err(|e| e.to_string())?;
    sock.set_nonblocking(true).map_err(|e| e.to_string())?;
    super::udpio::size_buffers(&sock, 32 << 20);
    let listener = rt
        .block_on(tokio::net::TcpListener::bind(a.listen))
        .map_err(|e| format!("cannot listen on {}: {e}", a.listen))?;
    let listen = listener.local_addr().map_err(|e| e.to_string())?;
    let metrics_l = if a.metrics == "off" {
        None
    } else {
        let addr: SocketAddr = a
            .metrics
            .parse()
            .map_err(|e| format!("--metrics {}: {e}", a.metrics))?;
        Some(
            rt.block_on(tokio::net::TcpListener::bind(addr))
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?,
        )
    };
    let metrics = metrics_l.as_ref().and_then(|l| l.local_addr().ok());
    let (notify, _) = tokio::sync::watch::channel(0u64);
    let sw = Arc::new(Switch {
        reg: Mutex::new(Registry::default()),
        data_addr: data,
        slots: a.slots.clamp(1, SLOTS),
        core: Mutex::new(String::new()),
        slot_metrics: a.slot_metrics,
        stats: Stats::default(),
        stop: AtomicBool::new(false),
        sync: Mutex::new(HashMap::new()),
        notify,
        generation: AtomicU64::new(0),
    });
    let faults = Faults {
        drop: a.drop,
        dup: a.dup,
        reorder: a.reorder,
        rng: rand::rngs::StdRng::seed_from_u64(a.seed),
        held: None,
    };
    let s2 = sw.clone();
    std::thread::Builder::new()
        .name("commd-switch-dp".into())
        .spawn(move || s2.data_plane(sock, faults, pin))
        .map_err(|e| e.to_string())?;
    let ctl = Ctl(sw.clone());
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    rt.spawn(async move {
        let r = tonic::transport::Server::builder()
            .add_service(SessionServer::new(Ctl(ctl.0.clone())))
            .add_service(SyncServer::new(ctl))
            .serve_with_incoming(incoming)
            .await;
        if let Err(e) = r {
            tracing::error!(target: "commd::switch", "controller stopped: {e}");
        }
    });
    Ok(Running {
        switch: sw,
        listen,
        data,
        metrics,
        metrics_listener: metrics_l,
    })
}

impl Drop for Running {
    fn drop(&mut self) {
        self.switch.stop.store(true, Ordering::Release);
    }
}
