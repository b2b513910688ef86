//! Across nodes: the daemon-wide network context (node id, data listener and connection pool),
//! and one thread per multi-node communicator that owns its [`wire::Wire`] and runs everything of
//! that communicator in posting order: collectives through the hierarchical algorithms of
//! [`algo`], cross-node sends and receives, and intra-node steps that must stay ordered with them.
//!
//! Failure model: any error on the wire (peer closed, silent for `peer_timeout`, mismatched
//! collective, op timeout) fails the op with a message naming the node and its ranks, tells every
//! peer (ABORT with the message), and breaks the communicator on this node; the peers do the same
//! when they receive the ABORT, so every rank learns within the peer timeout. Other communicators
//! have their own threads and streams and keep running.

pub mod algo;
pub mod conn;
pub mod link;
pub mod peer_client;
pub mod rdma;
pub mod staging;
pub mod switchpath;
pub mod wire;

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use commd_proto::desc::{OpKind, status};

use crate::posted::Posted;
use algo::{Coll, Scratch, Topo, Tuning};
use conn::DataPlane;
use link::Link;
use rdma::{Offer, RdmaCtx, Transport};
use wire::{CLASS_P2P, NetError, PeerLinks, RecvId, SendId, Sig, Tag, Wire};

/// Daemon-wide network state (absent when the peer service is off).
#[derive(Debug)]
pub struct NetCtx {
    /// This node's id: its advertised peer-service address.
    pub node: String,
    pub data: Arc<DataPlane>,
    pub streams: usize,
    pub peer_timeout: Duration,
    pub tuning: Tuning,
    /// Mutual TLS for the peer service (PEM contents), when configured.
    pub tls: Option<PeerTls>,
    /// Switch sessions (config `switch*`), and the advertised IPv4 workers send from by default.
    pub switch: crate::switch::Settings,
    pub switch_ip: Option<std::net::Ipv4Addr>,
    /// `transport`: auto, tcp or rdma.
    pub transport: String,
    /// This daemon's RDMA transport, or why it has none.
    pub rdma: Result<Arc<RdmaCtx>, String>,
}

impl NetCtx {
    /// What this node tells the others about RDMA at rendezvous.
    pub fn offer(&self) -> Offer {
        match (&self.rdma, self.transport.as_str()) {
            (_, "tcp") => Offer {
                desc: String::new(),
                off: "transport=tcp on that node".into(),
            },
            (Ok(r), _) => Offer {
                desc: r.desc.clone(),
                off: String::new(),
            },
            (Err(why), _) => Offer {
                desc: String::new(),
                off: why.clone(),
            },
        }
    }
}

/// PEM contents of this daemon's certificate, key and the CA all daemons trust.
#[derive(Clone)]
pub struct PeerTls {
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
    pub ca: Vec<u8>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerTls(..)")
    }
}

/// Work for a communicator's net thread, run in the order submitted.
pub enum Cmd {
    /// A matched collective: this node's ops (ascending rank) and the plan input.
    Coll { coll: Coll, ops: Vec<Posted> },
    /// A send to, or receive from, a rank on another node.
    P2p(Box<Posted>),
    /// An intra-node step that must stay ordered with the network work.
    Run(Box<dyn FnOnce() + Send>),
    /// This node gives up on the communicator (a local rank died, shutdown): tell the peers.
    Abort(String),
    /// Every local rank left: end cleanly (peers see END, connections go back to the pool).
    End,
}

/// The communicator's handle on its net thread.
pub struct NetHandle {
    tx: Mutex<mpsc::Sender<Cmd>>,
    wake: Arc<OwnedFd>,
    pub topo: Topo,
    ended: AtomicBool,
    /// The communicator's switch session, for `commd status`.
    pub switch: Arc<Mutex<switchpath::SwitchInfo>>,
}

impl std::fmt::Debug for NetHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NetHandle(node {} of {})",
            self.topo.me,
            self.topo.nodes.len()
        )
    }
}

impl NetHandle {
    /// Queues `c`; gives it back if the thread is gone (the caller fails its ops).
    #[allow(clippy::result_large_err)] // the command itself is the error: its ops must complete
    pub fn submit(&self, c: Cmd) -> Result<(), Cmd> {
        let r = self
            .tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(c)
            .map_err(|e| e.0);
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        r
    }

    pub fn end(&self) {
        if !self.ended.swap(true, Ordering::AcqRel) {
            let _ = self.submit(Cmd::End);
        }
    }
}

/// Per-communicator parameters for [`start`].
pub struct Setup {
    pub token: [u8; 16],
    pub topo: Topo,
    /// Peer data addresses by node.
    pub data_addrs: Vec<String>,
    /// What each node said about its RDMA transport.
    pub offers: Vec<Offer>,
    pub label: String,
    pub comm_id: u64,
    pub op_timeout: Duration,
    /// The communicator's `switch` option (None: the daemon's `switch` setting).
    pub switch: Option<String>,
    /// Breaks the communicator on this node (fails queued and later ops).
    pub on_fail: Box<dyn Fn(u32, String) + Send>,
}

/// Starts the communicator's net thread; it connects to the peers first (queued work waits).
pub fn start(ctx: &Arc<NetCtx>, s: Setup) -> std::io::Result<NetHandle> {
    let (tx, rx) = mpsc::channel();
    let wake = Arc::new(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )?);
    let h = NetHandle {
        tx: Mutex::new(tx),
        wake: wake.clone(),
        topo: s.topo.clone(),
        ended: AtomicBool::new(false),
        switch: Arc::new(Mutex::new(switchpath::SwitchInfo::default())),
    };
    let ctx = ctx.clone();
    let info = h.switch.clone();
    std::thread::Builder::new()
        .name(format!("commd-net-{}", s.comm_id))
        .spawn(move || Thread::run(ctx, s, rx, wake, info))?;
    Ok(h)
}

struct Inflight {
    p: Posted,
    send: Option<SendId>,
    recv: Option<RecvId>,
    since: Instant,
    /// GPU p2p: the host staging buffer the wire reads or writes.
    stage: Option<staging::Pinned>,
}

/// A host-staged GPU send or recv outside the wire: a send waits for its stream and its copy
/// to host memory before it is posted; a received message waits for the receiver's stream (its
/// buffer free) and its copy to the GPU before the op completes.
struct StagedP2p {
    p: Posted,
    buf: staging::Pinned,
    copy: Option<(usize, commd_client::gpu::cu::sys::CUevent)>,
    since: Instant,
}

struct Thread {
    ctx: Arc<NetCtx>,
    s: Setup,
    broken: Option<(u32, String)>,
    inflight: Vec<Inflight>,
    /// Host-staged GPU p2p ops waiting for a stream or a copy (see `StagedP2p`).
    staged: Vec<StagedP2p>,
    pool: staging::Pool,
    scratch: Scratch,
    sw: Option<crate::switch::worker::Worker>,
    sw_info: Arc<Mutex<switchpath::SwitchInfo>>,
    /// Reasons already logged for ops the switch cannot take.
    sw_skipped: std::collections::HashSet<String>,
}

fn p2p_sig(p: &Posted) -> Sig {
    Sig {
        op: OpKind::Send.code() as u8,
        dtype: p.op.dtype.code(),
        redop: 0xff,
        root: 0,
        count: p.op.count,
    }
}

fn wake_dup(fd: &Arc<OwnedFd>) -> std::io::Result<OwnedFd> {
    Ok(rustix::io::fcntl_dupfd_cloexec(&**fd, 0)?)
}

impl Thread {
    fn run(
        ctx: Arc<NetCtx>,
        s: Setup,
        rx: mpsc::Receiver<Cmd>,
        wake: Arc<OwnedFd>,
        sw_info: Arc<Mutex<switchpath::SwitchInfo>>,
    ) {
        let mut t = Thread {
            ctx,
            s,
            broken: None,
            inflight: Vec::new(),
            staged: Vec::new(),
            pool: staging::Pool::default(),
            scratch: Scratch::default(),
            sw: None,
            sw_info,
            sw_skipped: Default::default(),
        };
        let mut wire = match t.connect(&wake) {
            Ok(w) => Some(w),
            Err(why) => {
                let msg = format!("{}: connecting to the other nodes failed: {why}", t.s.label);
                tracing::warn!(target: "commd::net", "{msg}");
                t.break_comm(status::PEER_LOST, msg);
                None
            }
        };
        if let Some(w) = wire.as_mut() {
            let wanted =
                t.s.switch
                    .clone()
                    .unwrap_or_else(|| t.ctx.switch.controller.clone());
            match switchpath::setup(
                &t.ctx, &t.s.topo, w, &wanted, &t.s.token, &t.s.label, &wake, &t.sw_info,
            ) {
                Ok(sw) => t.sw = sw,
                Err(e) => t.fail(w, "switch session setup", e),
            }
        }
        let mut queue: VecDeque<Cmd> = VecDeque::new();
        let mut disconnected = false;
        loop {
            loop {
                match rx.try_recv() {
                    Ok(c) => queue.push_back(c),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            if disconnected && queue.is_empty() {
                queue.push_back(Cmd::End);
            }
            // Commands that arrive while one runs find the wake fd already drained (the op's
            // own `pump` calls read it): after running any, look at the channel again before
            // sleeping. (Without this a stream of GPU ops, which clients post ahead of their
            // streams, stalled up to 1 s between ops.)
            let mut ran = false;
            while let Some(c) = queue.front() {
                let blocked = matches!(c, Cmd::Coll { .. })
                    && !(t.inflight.is_empty() && t.staged.is_empty())
                    && t.broken.is_none();
                if blocked {
                    break;
                }
                let Some(c) = queue.pop_front() else { break };
                ran = true;
                match c {
                    Cmd::End => {
                        t.fail_queue(&mut queue);
                        t.settle_staged();
                        if let Some(w) = wire.take() {
                            t.end(w);
                        }
                        return;
                    }
                    Cmd::Abort(msg) => {
                        if t.broken.is_none() {
                            if let Some(w) = wire.as_mut() {
                                w.abort(&msg, Duration::from_millis(500));
                            }
                            t.broken = Some((status::ABORTED, msg.clone()));
                            t.fail_inflight();
                        }
                    }
                    Cmd::Run(f) => f(),
                    Cmd::P2p(p) => t.post_p2p(wire.as_mut(), *p),
                    Cmd::Coll { coll, ops } => t.coll(wire.as_mut(), coll, ops),
                }
            }
            match wire.as_mut() {
                Some(w) if t.broken.is_none() => {
                    // Staged GPU ops wait on streams and copies, not sockets: poll those often.
                    let wait = if ran {
                        None
                    } else if t.staged.is_empty() {
                        Some(Instant::now() + Duration::from_secs(1))
                    } else {
                        Some(Instant::now() + Duration::from_micros(100))
                    };
                    let r = w.pump(wait, algo::sig_text);
                    let r = r
                        .and_then(|()| t.check_inflight(w))
                        .and_then(|()| t.progress_staged(w));
                    if let Err(e) = r {
                        t.fail(w, "", e);
                    }
                }
                _ => {
                    // Broken or never connected: only wait for commands to fail or End.
                    let mut fds = [rustix::event::PollFd::new(
                        &*wake,
                        rustix::event::PollFlags::IN,
                    )];
                    let ts = rustix::event::Timespec {
                        tv_sec: 1,
                        tv_nsec: 0,
                    };
                    let _ = rustix::event::poll(&mut fds, Some(&ts));
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(&*wake, &mut b);
                }
            }
        }
    }

    fn connect(&mut self, wake: &Arc<OwnedFd>) -> Result<Wire, String> {
        let topo = &self.s.topo;
        let n = topo.nodes.len();
        let mine = self.ctx.offer();
        let mut kinds = vec![Transport::Tcp; n];
        let mut whys = vec![String::new(); n];
        for i in (0..n).filter(|&i| i != topo.me) {
            let theirs = self.s.offers.get(i).cloned().unwrap_or_default();
            let (t, why) = rdma::choose(&self.ctx.transport, &mine, &theirs, &topo.label(i))?;
            kinds[i] = t;
            whys[i] = why;
        }
        let rd = || {
            self.ctx
                .rdma
                .as_ref()
                .map_err(|e| format!("no RDMA transport: {e}"))
        };
        let mut links: Vec<Option<PeerLinks>> = (0..n).map(|_| None).collect();
        // Dial everyone first (the peers accept on their listener threads or peer service),
        // then collect what they opened to us.
        let mut txs: Vec<Option<Vec<Link>>> = (0..n).map(|_| None).collect();
        let mut nics: Vec<String> = vec!["-".into(); n];
        for (i, slot) in txs.iter_mut().enumerate() {
            if i == topo.me {
                continue;
            }
            let label = topo.label(i);
            let s = match kinds[i] {
                Transport::Tcp => {
                    let s = self
                        .ctx
                        .data
                        .dial(
                            &self.s.data_addrs[i],
                            &self.s.token,
                            &self.ctx.node,
                            self.ctx.streams,
                        )
                        .map_err(|e| format!("{label}: {e}"))?;
                    if let Some(a) = s.first().and_then(|s| s.local_addr().ok()) {
                        nics[i] = a.ip().to_string();
                    }
                    s.into_iter().map(Link::Tcp).collect()
                }
                Transport::Rdma => {
                    let r = rd()?;
                    let pend = (0..r.qps_per_peer as u32)
                        .map(|q| r.prepare(q, &topo.nodes[i]))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| format!("{label}: {e}"))?;
                    let locals: Vec<_> = pend.iter().map(|p| p.local.clone()).collect();
                    let remotes = peer_client::rdma_connect_blocking(
                        &topo.nodes[i],
                        &self.s.token,
                        &self.ctx.node,
                        &locals,
                        self.ctx.tls.as_ref(),
                    )
                    .map_err(|e| format!("{label}: RDMA connection setup: {e}"))?;
                    let mut devs: Vec<String> = locals.iter().map(|l| l.device.clone()).collect();
                    devs.dedup();
                    nics[i] = devs.join("+");
                    pend.into_iter()
                        .zip(remotes.iter())
                        .map(|(p, r)| p.connect(r).map(Link::Rdma))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| format!("{label}: {e}"))?
                }
            };
            *slot = Some(s);
        }
        let deadline = Instant::now() + self.ctx.peer_timeout.max(Duration::from_secs(10));
        for (i, tx) in txs.into_iter().enumerate() {
            let Some(tx) = tx else { continue };
            let rx = match kinds[i] {
                Transport::Tcp => self
                    .ctx
                    .data
                    .take_incoming(&self.s.token, &topo.nodes[i], self.ctx.streams, deadline)
                    .map(|v| v.into_iter().map(Link::Tcp).collect()),
                Transport::Rdma => rd()?
                    .take_incoming(&self.s.token, &topo.nodes[i], tx.len(), deadline)
                    .map(|v| v.into_iter().map(Link::Rdma).collect()),
            }
            .map_err(|e| format!("{}: {e}", topo.label(i)))?;
            links[i] = Some(PeerLinks { tx, rx });
        }
        let wake = wake_dup(wake).map_err(|e| e.to_string())?;
        let mut w = Wire::new(
            topo.me,
            links,
            self.ctx.tuning.chunk,
            self.ctx.peer_timeout,
            wake,
        )
        .map_err(|e| e.to_string())?;
        // One link per peer daemon and transport, shared by every communicator to it.
        for i in (0..n).filter(|&i| i != topo.me) {
            let kind = match kinds[i] {
                Transport::Tcp => "tcp",
                Transport::Rdma => "rdma",
            };
            w.links[i] = Some(crate::telemetry::register_link(
                crate::telemetry::LinkDesc {
                    name: &format!("{kind}:{}", topo.nodes[i]),
                    kind,
                    peer: &topo.nodes[i],
                    nic: &nics[i],
                },
            ));
        }
        let paths: Vec<String> = (0..n)
            .filter(|&i| i != topo.me)
            .map(|i| match kinds[i] {
                Transport::Tcp => format!(
                    "{}: TCP, {} stream(s) per direction ({})",
                    topo.label(i),
                    self.ctx.streams,
                    whys[i]
                ),
                Transport::Rdma => format!(
                    "{}: RDMA, {} RC QP(s) per direction on {} ({}); {}",
                    topo.label(i),
                    rd().map_or(0, |r| r.qps_per_peer),
                    nics[i],
                    whys[i],
                    rd().map_or_else(|e| e.to_string(), |r| r.gpu_path_text())
                ),
            })
            .collect();
        tracing::info!(
            target: "commd::net",
            "{}: node {} of {}, local {}; path to {}",
            self.s.label,
            topo.me,
            n,
            algo::ranks_text(topo.local()),
            paths.join("; path to ")
        );
        Ok(w)
    }

    fn end(&mut self, mut w: Wire) {
        w.end(Duration::from_secs(1));
        // Give the peers a moment to end too, so their streams come back clean for reuse.
        let until = Instant::now() + Duration::from_millis(300);
        let n = self.s.topo.nodes.len();
        while Instant::now() < until && (0..n).any(|i| i != w.me() && !w.peer_ended(i)) {
            if w.pump(Some(until), algo::sig_text).is_err() {
                break;
            }
        }
        for (peer, tx, rx) in w.into_streams() {
            // TCP connections go back to the pool; RDMA queue pairs are closed here (their
            // registered rings go back to the device's pool).
            let tcp: Vec<_> = tx
                .into_iter()
                .filter_map(|l| match l {
                    Link::Tcp(s) => Some(s),
                    Link::Rdma(_) => None,
                })
                .collect();
            if !tcp.is_empty() {
                self.ctx.data.give_back(&self.s.data_addrs[peer], tcp);
            }
            for (s, clean) in rx {
                if let (Link::Tcp(s), true) = (s, clean) {
                    self.ctx.data.clone().await_bind(s);
                }
            }
        }
        tracing::debug!(target: "commd::net", "{}: ended", self.s.label);
    }

    /// Waits for the staging copies still running (every local rank has left): their host
    /// buffers are unpinned and freed with the thread.
    fn settle_staged(&mut self) {
        let Ok(cuda) = crate::cuda::get() else { return };
        for s in &mut self.staged {
            if let Some(e) = s.copy.take() {
                let _ = cuda.wait_event(e);
            }
        }
    }

    fn break_comm(&mut self, st: u32, msg: String) {
        if self.broken.is_none() {
            self.broken = Some((st, msg.clone()));
            self.fail_inflight();
            (self.s.on_fail)(
                status::ABORTED,
                format!("aborted after an earlier error: {msg}"),
            );
        }
    }

    fn fail_inflight(&mut self) {
        let (st, msg) = self
            .broken
            .clone()
            .unwrap_or((status::ABORTED, String::new()));
        // Staging buffers go back to the pool, not away: the wire may still point into them
        // until it is dropped (before the pool), and a copy may still be running.
        for f in std::mem::take(&mut self.inflight) {
            let c = f.p.op.comm;
            f.p.complete(c, st, Some(msg.clone()));
            if let Some(b) = f.stage {
                self.pool.give(b);
            }
        }
        for s in std::mem::take(&mut self.staged) {
            if let (Some(e), Ok(cuda)) = (s.copy, crate::cuda::get()) {
                let _ = cuda.wait_event(e);
            }
            let c = s.p.op.comm;
            s.p.complete(c, st, Some(msg.clone()));
            self.pool.give(s.buf);
        }
    }

    fn fail_queue(&mut self, q: &mut VecDeque<Cmd>) {
        let msg = self
            .broken
            .clone()
            .map(|b| b.1)
            .unwrap_or_else(|| format!("{}: communicator destroyed", self.s.label));
        for c in q.drain(..) {
            match c {
                Cmd::Coll { ops, .. } => {
                    for p in ops {
                        let c = p.op.comm;
                        p.complete(c, status::ABORTED, Some(msg.clone()));
                    }
                }
                Cmd::P2p(p) => {
                    let c = p.op.comm;
                    p.complete(c, status::ABORTED, Some(msg.clone()));
                }
                Cmd::Run(f) => f(),
                Cmd::Abort(_) | Cmd::End => {}
            }
        }
        self.fail_inflight();
    }

    /// The error text of `e`, naming nodes by their ranks.
    fn describe(&self, what: &str, e: &NetError) -> (u32, String) {
        let t = &self.s.topo;
        let pre = if what.is_empty() {
            self.s.label.clone()
        } else {
            format!("{}: {what}", self.s.label)
        };
        match e {
            NetError::PeerLost { node, why } => (
                status::PEER_LOST,
                format!("{pre}: lost {}: {why}", t.label(*node)),
            ),
            NetError::Aborted { node, msg } => (
                status::ABORTED,
                format!("{msg} (reported by {})", t.label(*node)),
            ),
            NetError::Mismatch(m) => (
                status::MISMATCH,
                format!(
                    "{pre}: mismatched collective across nodes: {}",
                    name_nodes(t, m)
                ),
            ),
            NetError::Timeout(m) => (status::TIMEOUT, format!("{pre}: {m}")),
            NetError::Local(m) => (status::INTERNAL, format!("{pre}: {m}")),
            NetError::LocalRank(st, m) => (*st, format!("{pre}: {m}")),
        }
    }

    fn fail(&mut self, w: &mut Wire, what: &str, e: NetError) {
        let (st, msg) = self.describe(what, &e);
        tracing::warn!(target: "commd::net", "{msg}");
        if !matches!(e, NetError::Aborted { .. }) {
            w.abort(&msg, Duration::from_millis(500));
        }
        self.break_comm(st, msg);
    }

    fn post_p2p(&mut self, w: Option<&mut Wire>, p: Posted) {
        let (Some(w), None) = (w, &self.broken) else {
            let msg = self
                .broken
                .clone()
                .map(|b| b.1)
                .unwrap_or_else(|| format!("{}: not connected", self.s.label));
            let c = p.op.comm;
            p.complete(c, status::ABORTED, Some(msg));
            return;
        };
        if p.cuda.is_some() {
            // Host staging: a send goes to the wire once its stream is there and its data is
            // in host memory (`progress_staged`); a recv lands in host memory first.
            let bytes = p.op.count * p.op.dtype.size();
            let buf = crate::cuda::get().and_then(|c| self.pool.take(c, bytes));
            match buf {
                Ok(buf) if p.op.kind == OpKind::Send => self.staged.push(StagedP2p {
                    p,
                    buf,
                    copy: None,
                    since: Instant::now(),
                }),
                Ok(buf) => self.post_wire(w, p, Some(buf)),
                Err(why) => {
                    let msg = format!("{}: {}: host staging: {why}", self.s.label, p2p_what(&p));
                    let c = p.op.comm;
                    p.complete(c, status::INTERNAL, Some(msg));
                }
            }
            return;
        }
        self.post_wire(w, p, None);
    }

    /// Posts a p2p op's message to the wire, from or into its host buffer (`stage` for a
    /// host-staged GPU op).
    fn post_wire(&mut self, w: &mut Wire, p: Posted, stage: Option<staging::Pinned>) {
        let t = &self.s.topo;
        let peer_rank = p.op.peer;
        let node = t.rank_node[peer_rank as usize];
        let sig = p2p_sig(&p);
        let (src, dst) = if p.op.kind == OpKind::Send {
            (p.rank, peer_rank)
        } else {
            (peer_rank, p.rank)
        };
        let a = (u64::from(src) << 32) | u64::from(dst);
        let bytes = p.op.count * p.op.dtype.size();
        let host = |s: &Option<crate::engine::Span>| match (&stage, s) {
            (Some(b), _) => b.ptr(),
            (None, Some(s)) => s.ptr(),
            (None, None) => std::ptr::NonNull::<u8>::dangling().as_ptr(),
        };
        let r = if p.op.kind == OpKind::Send {
            let ptr = host(&p.bufs.send);
            // SAFETY: the span stays alive with the Posted op until it completes.
            unsafe {
                w.send(
                    node,
                    Tag {
                        class: CLASS_P2P,
                        a,
                        b: p.seq,
                    },
                    &sig,
                    ptr,
                    bytes as usize,
                )
            }
            .map(|id| (Some(id), None))
        } else {
            let ptr = host(&p.bufs.recv);
            // SAFETY: as above; nothing else writes the recv span while the op is pending.
            unsafe {
                w.recv(
                    node,
                    Tag {
                        class: CLASS_P2P,
                        a,
                        b: p.seq,
                    },
                    Some(sig),
                    ptr,
                    bytes,
                    algo::sig_text,
                )
            }
            .map(|id| (None, Some(id)))
        };
        match r {
            Ok((send, recv)) => self.inflight.push(Inflight {
                p,
                send,
                recv,
                since: Instant::now(),
                stage,
            }),
            Err(e) => {
                let what = p2p_what(&p);
                let c = p.op.comm;
                let (st, msg) = self.describe(&what, &e);
                p.complete(c, st, Some(msg));
                if let Some(b) = stage {
                    self.pool.give(b);
                }
            }
        }
    }

    /// Moves host-staged GPU p2p ops along: a send whose stream has reached it gets its copy
    /// to host memory, then goes to the wire; a received message whose receiver's stream has
    /// reached the recv gets its copy to the GPU, then the op completes. An error (a local
    /// rank lost, a stream that never arrives, a failed copy) breaks the communicator.
    fn progress_staged(&mut self, w: &mut Wire) -> Result<(), NetError> {
        if self.staged.is_empty() {
            return Ok(());
        }
        let cuda = crate::cuda::get().map_err(NetError::Local)?;
        let mut i = 0;
        while i < self.staged.len() {
            let s = &mut self.staged[i];
            let send = s.p.op.kind == OpKind::Send;
            if let Some(e) = &s.copy {
                let done = cuda.event_done(e);
                if matches!(done, Ok(false)) {
                    i += 1;
                    continue;
                }
                let mut s = self.staged.swap_remove(i);
                if let Some(e) = s.copy.take() {
                    cuda.release_event(e);
                }
                if let Err(e) = done {
                    let what = p2p_what(&s.p);
                    self.staged.push(s);
                    return Err(NetError::Local(format!("{what}: host staging copy: {e}")));
                }
                if send {
                    self.post_wire(w, s.p, Some(s.buf));
                } else {
                    self.pool.give(s.buf);
                    staged_done(s.p);
                }
                continue;
            }
            let Some(b) = s.p.bell() else {
                i += 1;
                continue;
            };
            if b.session.is_closed() {
                return Err(NetError::LocalRank(
                    status::PEER_LOST,
                    format!(
                        "rank {} (pid {}) was lost during {}",
                        b.rank,
                        b.session.pid(),
                        p2p_what(&s.p)
                    ),
                ));
            }
            if !b.ready(0) {
                if s.since.elapsed() > self.s.op_timeout {
                    return Err(NetError::LocalRank(
                        status::TIMEOUT,
                        format!(
                            "{} timed out after {:.1} s: rank {}'s stream never reached it (it signalled {}, the op needs {})",
                            p2p_what(&s.p),
                            s.since.elapsed().as_secs_f64(),
                            b.rank,
                            b.ready_value(),
                            b.ticket
                        ),
                    ));
                }
                i += 1;
                continue;
            }
            let g = if send {
                &s.p.gbufs.send
            } else {
                &s.p.gbufs.recv
            };
            match g.as_ref().filter(|g| g.bytes > 0) {
                Some(g) => {
                    // SAFETY: the buffer stays in `self.staged` (or, on failure, in the pool)
                    // until the copy's event completes; the GPU span lives with the op.
                    let e = unsafe { cuda.copy_host(g, s.buf.ptr(), !send) }.map_err(|e| {
                        NetError::Local(format!("{}: host staging copy: {e}", p2p_what(&s.p)))
                    })?;
                    s.copy = Some(e);
                    s.since = Instant::now();
                    i += 1;
                }
                None => {
                    // Nothing to copy: on to the wire, or done.
                    let s = self.staged.swap_remove(i);
                    if send {
                        self.post_wire(w, s.p, Some(s.buf));
                    } else {
                        self.pool.give(s.buf);
                        staged_done(s.p);
                    }
                }
            }
        }
        Ok(())
    }

    fn check_inflight(&mut self, w: &mut Wire) -> Result<(), NetError> {
        let now = Instant::now();
        let mut i = 0;
        while i < self.inflight.len() {
            let f = &self.inflight[i];
            let done = f.send.is_none_or(|s| w.send_done(s))
                && f.recv.as_ref().is_none_or(|r| w.recv_done(r));
            if done {
                let f = self.inflight.swap_remove(i);
                if let Some(s) = f.send {
                    w.release_send(s);
                }
                if let Some(r) = &f.recv {
                    w.release_recv(r);
                }
                match f.stage {
                    None => {
                        let c = f.p.op.comm;
                        f.p.complete(c, status::OK, None);
                    }
                    Some(buf) if f.p.op.kind == OpKind::Send => {
                        self.pool.give(buf);
                        staged_done(f.p);
                    }
                    // The data is in host memory; its copy to the GPU waits for the stream.
                    Some(buf) => self.staged.push(StagedP2p {
                        p: f.p,
                        buf,
                        copy: None,
                        since: Instant::now(),
                    }),
                }
                continue;
            }
            if let Some(r) = &f.recv
                && w.peer_ended(r.peer)
            {
                return Err(NetError::PeerLost {
                    node: r.peer,
                    why: format!(
                        "it left the communicator while {} was pending",
                        p2p_what(&f.p)
                    ),
                });
            }
            if now.duration_since(f.since) > self.s.op_timeout {
                return Err(NetError::Timeout(format!(
                    "{} timed out after {:.1} s: rank {} never posted the matching {}",
                    p2p_what(&f.p),
                    self.s.op_timeout.as_secs_f64(),
                    f.p.op.peer,
                    if f.p.op.kind == OpKind::Send {
                        "recv"
                    } else {
                        "send"
                    }
                )));
            }
            i += 1;
        }
        Ok(())
    }

    fn coll(&mut self, w: Option<&mut Wire>, mut coll: Coll, ops: Vec<Posted>) {
        let (Some(w), None) = (w, &self.broken) else {
            let msg = self
                .broken
                .clone()
                .map(|b| b.1)
                .unwrap_or_else(|| format!("{}: not connected", self.s.label));
            for p in ops {
                let c = p.op.comm;
                p.complete(c, status::ABORTED, Some(msg.clone()));
            }
            return;
        };
        let what = format!("{} seq {}", coll.kind.name(), coll.seq);
        w.progress = coll.seq + 1;
        let t0 = Instant::now();
        let deadline = t0 + self.s.op_timeout;
        let gpu = ops.iter().any(|p| p.cuda.is_some());
        let mut stage = Vec::new();
        let r = if gpu {
            self.stage_in(w, &mut coll, &ops, deadline, &mut stage)
        } else {
            Ok(())
        };
        let staged_in = t0.elapsed();
        let mut r = r
            .and_then(|()| self.exec_coll(w, &coll, deadline, &what))
            .map(|(alg, transport)| (alg, transport, t0.elapsed()));
        if gpu && let Ok(x) = r {
            r = self.stage_out(&ops, &stage).map(|()| x);
        }
        for (_, b) in stage {
            self.pool.give(b);
        }
        match r {
            Ok((alg, transport, ran)) => {
                tracing::trace!(target: "commd::net", comm = self.s.comm_id, op = coll.kind.name(), seq = coll.seq, bytes = coll.count * coll.dtype.size(), algorithm = alg, transport = transport, staged_in_us = staged_in.as_micros() as u64, ran_us = ran.as_micros() as u64, us = t0.elapsed().as_micros() as u64, "executed");
                for p in ops {
                    if let Some(b) = p.bell() {
                        crate::cuda::signal_done(&b, b.ticket);
                    }
                    let c = p.op.comm;
                    p.complete(c, status::OK, None);
                }
            }
            Err(e) => {
                let (st, msg) = self.describe(&what, &e);
                for p in ops {
                    let c = p.op.comm;
                    p.complete(c, st, Some(msg.clone()));
                }
                self.fail(w, &what, e);
            }
        }
    }

    /// Runs a matched collective on host buffers: through the switch session when it can
    /// carry it, else the TCP/RDMA algorithms. Returns the algorithm and transport used.
    fn exec_coll(
        &mut self,
        w: &mut Wire,
        coll: &Coll,
        deadline: Instant,
        what: &str,
    ) -> Result<(&'static str, &'static str), NetError> {
        let mut transport = "tcp";
        if self.sw.is_some() {
            match algo::switch_fits(coll) {
                Ok(true) => {
                    if self.switch_op(w, coll, deadline, what)? {
                        return Ok(("switch", "switch"));
                    }
                    transport = "tcp (switch could not carry the values)";
                }
                Ok(false) => {}
                Err(why) => {
                    if self.sw_skipped.insert(why.clone()) {
                        tracing::info!(target: "commd::net", "{}: {why}; such all-reduces go over TCP", self.s.label);
                    }
                }
            }
        }
        let topo = self.s.topo.clone();
        let tuning = self.ctx.tuning;
        let alg = algo::run(
            w,
            &topo,
            coll,
            &mut self.scratch,
            &tuning,
            deadline,
            what.to_string(),
        )?;
        Ok((alg, transport))
    }

    /// Host staging of a GPU collective, before it runs: waits until every local rank's
    /// stream has reached the op (pumping the wire meanwhile), copies each rank's input into
    /// a pinned host buffer, and points `coll`'s buffers at host memory. `stage` receives the
    /// buffers (rank, input or output) for `stage_out` and the pool.
    fn stage_in(
        &mut self,
        w: &mut Wire,
        coll: &mut Coll,
        ops: &[Posted],
        deadline: Instant,
        stage: &mut Vec<(bool, staging::Pinned)>,
    ) -> Result<(), NetError> {
        let cuda = crate::cuda::get().map_err(NetError::Local)?;
        let bells: Vec<crate::cuda::Bell> = ops.iter().filter_map(|p| p.bell()).collect();
        let t0 = Instant::now();
        loop {
            if let Some(b) = bells.iter().find(|b| b.session.is_closed()) {
                return Err(NetError::LocalRank(
                    status::PEER_LOST,
                    format!(
                        "rank {} (pid {}) was lost during the op",
                        b.rank,
                        b.session.pid()
                    ),
                ));
            }
            if bells.iter().all(|b| b.ready(0)) {
                break;
            }
            if Instant::now() > deadline {
                let late = crate::cuda::late_streams(&bells, 0);
                return Err(NetError::LocalRank(
                    status::TIMEOUT,
                    format!(
                        "timed out after {:.1} s waiting for the GPU streams of {} to reach the op; is that rank's stream blocked behind other work?",
                        t0.elapsed().as_secs_f64(),
                        late.join(", ")
                    ),
                ));
            }
            // Spin briefly (a stream usually arrives within microseconds), then keep the
            // sockets moving at a gentler pace.
            let wait = if t0.elapsed() < Duration::from_millis(1) {
                None
            } else {
                Some(Instant::now() + Duration::from_micros(200))
            };
            w.pump(wait, algo::sig_text)?;
        }
        let local =
            |e: commd_client::gpu::cu::CuError| NetError::Local(format!("host staging: {e}"));
        let mut copies = Vec::new();
        let mut r = Ok(());
        'ops: for (p, (rank, bufs)) in ops.iter().zip(coll.bufs.iter_mut()) {
            debug_assert_eq!(p.rank, *rank);
            // In place (the same GPU range in and out): one host buffer serves both, and the
            // host algorithms run in place too (less memory traffic).
            let in_place = matches!(
                coll.kind,
                OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce
            ) && matches!((&p.gbufs.send, &p.gbufs.recv), (Some(s), Some(r)) if s.same_range(r));
            for (recv, g) in [(false, &p.gbufs.send), (true, &p.gbufs.recv)] {
                let Some(g) = g else { continue };
                if recv && in_place {
                    bufs.recv = bufs.send.clone();
                    if let Some((flag, _)) = stage.last_mut() {
                        *flag = true; // the input's buffer is also the output's
                    }
                    continue;
                }
                let (b, span) = match self.pool.take(cuda, g.bytes) {
                    Ok(b) => match b.span(g.bytes) {
                        Some(span) => (b, span),
                        None => {
                            r = Err(NetError::Local("host staging buffer too small".into()));
                            self.pool.give(b);
                            break 'ops;
                        }
                    },
                    Err(why) => {
                        r = Err(NetError::Local(why));
                        break 'ops;
                    }
                };
                if !recv && g.bytes > 0 {
                    // SAFETY: `b` is kept (in `stage`) until the copy's event is waited for
                    // below; the GPU span is bounds-checked and kept alive by the op.
                    match unsafe { cuda.copy_host(g, b.ptr(), false) } {
                        Ok(e) => copies.push(e),
                        Err(e) => r = Err(local(e)),
                    }
                }
                if recv {
                    bufs.recv = Some(span);
                } else {
                    bufs.send = Some(span);
                }
                stage.push((recv, b));
                if r.is_err() {
                    break 'ops;
                }
            }
        }
        for e in copies {
            if let Err(e) = cuda.wait_event(e) {
                r = r.and(Err(local(e)));
            }
        }
        r
    }

    /// Host staging of a GPU collective, after it ran: copies each rank's output from its
    /// host buffer into its GPU buffer and waits for the copies.
    fn stage_out(&self, ops: &[Posted], stage: &[(bool, staging::Pinned)]) -> Result<(), NetError> {
        let cuda = crate::cuda::get().map_err(NetError::Local)?;
        let mut outs = stage.iter().filter(|(recv, _)| *recv).map(|(_, b)| b);
        let mut copies = Vec::new();
        let mut r = Ok(());
        for p in ops {
            let Some(g) = &p.gbufs.recv else { continue };
            let Some(b) = outs.next() else {
                r = Err(NetError::Local(
                    "host staging: an output buffer is missing".into(),
                ));
                break;
            };
            if g.bytes == 0 {
                continue;
            }
            // SAFETY: the host buffer is held by the caller until this returns, after the
            // copies are waited for; the GPU span is bounds-checked and kept alive by the op.
            match unsafe { cuda.copy_host(g, b.ptr(), true) } {
                Ok(e) => copies.push(e),
                Err(e) => {
                    r = Err(NetError::Local(format!("host staging: {e}")));
                    break;
                }
            }
        }
        for e in copies {
            if let Err(e) = cuda.wait_event(e) {
                r = r.and(Err(NetError::Local(format!("host staging: {e}"))));
            }
        }
        r
    }
}

impl Thread {
    /// Runs `coll` through the switch session: `Ok(false)` when a float32 block could not be
    /// carried (every node redoes the op over TCP).
    fn switch_op(
        &mut self,
        w: &mut Wire,
        coll: &Coll,
        deadline: Instant,
        what: &str,
    ) -> Result<bool, NetError> {
        let Some(sw) = self.sw.as_mut() else {
            return Ok(false);
        };
        let via = self
            .s
            .switch
            .clone()
            .unwrap_or_else(|| self.ctx.switch.controller.clone());
        let r = algo::run_switch(
            w,
            &self.s.topo,
            coll,
            &mut self.scratch,
            sw,
            deadline,
            what.to_string(),
            &via,
        )?;
        if r == algo::SwitchRun::Unrepresentable {
            tracing::warn!(target: "commd::net", "{}: {what}: a float32 value is NaN, infinite or too large (>= 2^126) for the switch's block floating point; redoing it over TCP", self.s.label);
            return Ok(false);
        }
        Ok(true)
    }
}

/// Completes a host-staged GPU op whose results are in place: its done counter, then its
/// completion.
fn staged_done(p: Posted) {
    if let Some(b) = p.bell() {
        crate::cuda::signal_done(&b, b.ticket);
    }
    let c = p.op.comm;
    p.complete(c, status::OK, None);
}

fn p2p_what(p: &Posted) -> String {
    if p.op.kind == OpKind::Send {
        format!("send rank {} -> rank {} #{}", p.rank, p.op.peer, p.seq)
    } else {
        format!("recv rank {} <- rank {} #{}", p.rank, p.op.peer, p.seq)
    }
}

/// Replaces "node N" in wire messages by the node's label (ranks and address).
fn name_nodes(t: &Topo, m: &str) -> String {
    let mut out = m.to_string();
    for i in (0..t.nodes.len()).rev() {
        out = out.replace(&format!("node {i} "), &format!("{} ", t.label(i)));
    }
    out
}
