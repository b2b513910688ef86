//! Daemon-wide state: sessions, communicators, pending joins, issued unique ids, and the
//! operations the control plane and the fd socket call. Transport-agnostic: no tonic types here
//! (errors are [`DaemonError`], mapped to gRPC statuses in `control`).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use commd_proto::desc::status;
use commd_proto::ring::RingLayout;
use commd_proto::uid::UniqueId;
use thiserror::Error;
use tokio::sync::oneshot;

use commd_proto::pb;

use crate::comm::{Comm, Member};
use crate::config::Config;
use crate::net::NetCtx;
use crate::session::{MAX_STAGED, Session};
use crate::shm::MemRegion;

#[derive(Debug, Error)]
pub enum DaemonError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

/// (communicator handle, daemon-wide id, doorbell slot).
/// A joined rank's communicator handle, daemon-wide id, doorbell slot, and node count.
type JoinResult = Result<(u32, u64, u32, u32), DaemonError>;

struct Joiner {
    session: Arc<Session>,
    tx: oneshot::Sender<JoinResult>,
}

/// A rank of a communicator rooted here: local, or joined by another node's daemon.
enum Slot {
    Local(Joiner),
    Remote {
        node: String,
        data_addr: String,
        rdma: crate::net::rdma::Offer,
        pid: i32,
        tx: oneshot::Sender<Result<pb::PeerJoinReply, DaemonError>>,
    },
}

impl Slot {
    fn session_id(&self) -> Option<u64> {
        match self {
            Slot::Local(j) => Some(j.session.id),
            Slot::Remote { .. } => None,
        }
    }

    fn pid(&self) -> i32 {
        match self {
            Slot::Local(j) => j.session.pid,
            Slot::Remote { pid, .. } => *pid,
        }
    }

    fn fail(self, e: DaemonError) {
        match self {
            Slot::Local(j) => {
                let _ = j.tx.send(Err(e));
            }
            Slot::Remote { tx, .. } => {
                let _ = tx.send(Err(e));
            }
        }
    }
}

struct PendingJoin {
    nranks: u32,
    op_timeout: Duration,
    members: Vec<Option<Slot>>,
    pacing: Option<PacingVote>,
}

/// This node's ranks of a communicator rooted at another node, waiting for the root's answer.
struct RemoteJoin {
    nranks: u32,
    op_timeout: Duration,
    root: String,
    local: HashMap<u32, Joiner>,
    pacing: Option<PacingVote>,
}

/// A rank's creation-time options from `CreateCommunicatorRequest`.
#[derive(Clone, Copy, Debug, Default)]
pub struct JoinOpts {
    /// `None`: the daemon's `op_timeout_ms`.
    pub op_timeout: Option<Duration>,
    /// GPU copy pacing in bytes/s as resolved by [`Daemon::resolve_pacing`] (`None`: uncapped).
    pub pacing: Option<u64>,
}

/// The GPU pacing the first local rank of a forming communicator asked for. Pacing is per node
/// (one [`crate::pacing::Pacer`] in this daemon for all its ranks), so only this node's ranks
/// must agree; ranks on other nodes are paced by their own daemon.
#[derive(Clone, Copy, Debug)]
struct PacingVote {
    rank: u32,
    rate: Option<u64>,
}

/// Records `rank`'s pacing in `vote`, or refuses it if an earlier local rank asked for another.
fn vote_pacing(
    vote: &mut Option<PacingVote>,
    short: &str,
    rank: u32,
    rate: Option<u64>,
) -> Result<(), DaemonError> {
    match *vote {
        Some(v) if v.rate != rate => Err(DaemonError::InvalidArgument(format!(
            "rank {rank} joins communicator {short} with GPU pacing {}, but rank {} joined with {}; every rank of a communicator on a node must ask for the same pacing (pacing_bytes_per_sec; unset means the daemon's gpu_pacing_gbps)",
            crate::pacing::describe(rate),
            v.rank,
            crate::pacing::describe(v.rate)
        ))),
        Some(_) => Ok(()),
        None => {
            *vote = Some(PacingVote { rank, rate });
            Ok(())
        }
    }
}

/// Counters for `Status`.
#[derive(Debug, Default, Clone)]
pub struct Counts {
    pub sessions: u32,
    pub communicators: u32,
    pub registrations: u32,
    pub mapped_bytes: u64,
    pub pending_joins: u32,
}

/// What one uid's sessions hold (per-uid limits, `commd status`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UidUsage {
    pub sessions: usize,
    pub communicators: usize,
    pub registered_bytes: u64,
}

pub struct Daemon {
    pub cfg: Config,
    pub started: Instant,
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    comms: Mutex<HashMap<u64, Arc<Comm>>>,
    issued: Mutex<crate::issued::Issued>,
    /// Serializes the per-uid registered-bytes check and charge (`register`).
    reg_charge: Mutex<()>,
    joins: Mutex<HashMap<[u8; 16], PendingJoin>>,
    remote_joins: Mutex<HashMap<[u8; 16], RemoteJoin>>,
    /// Per-communicator `switch` options of forming communicators (first local rank's).
    switch_opts: Mutex<HashMap<[u8; 16], String>>,
    /// Set once the peer service and data listener are up (absent: single-node daemon).
    net: std::sync::OnceLock<Arc<NetCtx>>,
    next_id: AtomicU64,
    shutting_down: AtomicBool,
    /// Ops completed/failed by sessions that have since closed.
    pub closed_ops: (AtomicU64, AtomicU64),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Daemon {
    pub fn new(cfg: Config) -> Arc<Self> {
        match crate::cuda::init(cfg.cuda, cfg.gpu_scratch_slot_bytes) {
            Ok(c) => {
                tracing::info!(target: "commd::init", "CUDA: {} GPU(s), driver {}", c.gpus.len(), c.driver_version);
                c.log_topology();
            }
            Err(why) => {
                tracing::info!(target: "commd::init", "CUDA unavailable, serving host memory only: {why}")
            }
        }
        Arc::new(Self {
            cfg,
            started: Instant::now(),
            sessions: Mutex::new(HashMap::new()),
            comms: Mutex::new(HashMap::new()),
            issued: Mutex::new(crate::issued::Issued::default()),
            reg_charge: Mutex::new(()),
            joins: Mutex::new(HashMap::new()),
            remote_joins: Mutex::new(HashMap::new()),
            switch_opts: Mutex::new(HashMap::new()),
            net: std::sync::OnceLock::new(),
            next_id: AtomicU64::new(1),
            shutting_down: AtomicBool::new(false),
            closed_ops: (AtomicU64::new(0), AtomicU64::new(0)),
        })
    }

    /// Enables multi-node communicators (called once by `serve`).
    pub fn set_net(&self, n: Arc<NetCtx>) {
        let _ = self.net.set(n);
    }

    pub fn net(&self) -> Option<&Arc<NetCtx>> {
        self.net.get()
    }

    /// This node's id (its advertised peer address), if it has a peer service.
    pub fn node_id(&self) -> Option<String> {
        self.net.get().map(|n| n.node.clone())
    }

    fn new_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Acquire)
    }

    pub fn hello(
        &self,
        uid: u32,
        pid: i32,
        name: String,
        sq: u32,
        cq: u32,
    ) -> Result<Arc<Session>, DaemonError> {
        if self.is_shutting_down() {
            return Err(DaemonError::Unavailable("daemon is shutting down".into()));
        }
        let mut sessions = lock(&self.sessions);
        if sessions.len() >= self.cfg.max_sessions {
            return Err(DaemonError::ResourceExhausted(format!(
                "daemon serves its maximum of {} sessions (max_sessions)",
                self.cfg.max_sessions
            )));
        }
        // One user cannot take every session and lock the others out.
        let mine = sessions.values().filter(|s| s.uid == uid).count();
        if mine >= self.cfg.max_sessions_per_uid {
            return Err(DaemonError::ResourceExhausted(format!(
                "uid {uid} already has {mine} sessions, its maximum (max_sessions_per_uid={}); \
                 each client process holds one until it exits",
                self.cfg.max_sessions_per_uid
            )));
        }
        let pick = |n: u32| {
            if n == 0 {
                self.cfg.ring_entries
            } else {
                n.next_power_of_two().min(commd_proto::ring::MAX_ENTRIES)
            }
        };
        let layout = RingLayout::new(pick(sq), pick(cq))
            .map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
        let mut secret = [0u8; 16];
        rand::RngCore::fill_bytes(&mut rand::rng(), &mut secret);
        let id = self.new_id();
        let s = Session::new(id, uid, pid, name, secret, layout)
            .map_err(|e| DaemonError::Internal(format!("creating session memory: {e}")))?;
        let s = Arc::new(s);
        sessions.insert(id, s.clone());
        tracing::info!(target: "commd::session", session = id, uid, pid, "session opened");
        crate::telemetry::session_opened(id, uid, pid, &s.name);
        Ok(s)
    }

    /// Looks a session up for a caller; only the process that opened it may use it.
    pub fn session_for(&self, id: u64, uid: u32, pid: i32) -> Result<Arc<Session>, DaemonError> {
        let s = lock(&self.sessions).get(&id).cloned().ok_or_else(|| {
            DaemonError::NotFound(format!("no session {id} (closed, or never opened)"))
        })?;
        if s.uid != uid || s.pid != pid {
            return Err(DaemonError::PermissionDenied(format!(
                "session {id} belongs to another process"
            )));
        }
        Ok(s)
    }

    pub fn session(&self, id: u64) -> Option<Arc<Session>> {
        lock(&self.sessions).get(&id).cloned()
    }

    pub fn sessions(&self) -> Vec<Arc<Session>> {
        lock(&self.sessions).values().cloned().collect()
    }

    pub fn comms(&self) -> Vec<Arc<Comm>> {
        lock(&self.comms).values().cloned().collect()
    }

    pub fn comm_by_id(&self, id: u64) -> Option<Arc<Comm>> {
        lock(&self.comms).get(&id).cloned()
    }

    /// Ends a session: its communicators fail for the other ranks with "peer lost" (or the
    /// given status), and its memory, rings and registrations are freed.
    pub fn close_session(&self, id: u64, st: u32, reason: &str) {
        let Some(s) = lock(&self.sessions).remove(&id) else {
            return;
        };
        if !s.mark_closed(st) {
            return;
        }
        tracing::info!(target: "commd::session", session = id, pid = s.pid, "session closed: {reason}");
        crate::telemetry::session_closed(id, reason);
        let comms: Vec<(Arc<Comm>, u32)> = {
            let mut t = s.tables();
            let c = t.comms.drain().map(|(_, v)| v).collect();
            t.mems.clear();
            t.cuda_mems.clear();
            t.ipc_cache.clear();
            t.doorbell_slots.clear();
            t.staged.clear();
            t.registered_bytes = 0;
            c
        };
        for (comm, rank) in comms {
            let msg = format!(
                "{}: rank {rank} (pid {}) lost: {reason}",
                comm.label(),
                s.pid
            );
            if comm.abort_rank(Some(rank), status::PEER_LOST, msg) {
                lock(&self.comms).remove(&comm.id);
            }
        }
        // Pending joins of this session fail for everyone: the communicator can no longer form.
        let mut joins = lock(&self.joins);
        let tokens: Vec<[u8; 16]> = joins
            .iter()
            .filter(|(_, j)| {
                j.members
                    .iter()
                    .flatten()
                    .any(|m| m.session_id() == Some(id))
            })
            .map(|(t, _)| *t)
            .collect();
        for t in tokens {
            if let Some(j) = joins.remove(&t) {
                let rank = j
                    .members
                    .iter()
                    .position(|m| m.as_ref().is_some_and(|m| m.session_id() == Some(id)))
                    .unwrap_or(0);
                for m in j.members.into_iter().flatten() {
                    m.fail(DaemonError::Unavailable(format!(
                        "rank {rank} (pid {}) exited while the communicator was forming: {reason}",
                        s.pid
                    )));
                }
            }
        }
        drop(joins);
        for rj in lock(&self.remote_joins).values_mut() {
            rj.local.retain(|_, j| j.session.id != id);
        }
        self.closed_ops
            .0
            .fetch_add(s.ops_completed.load(Ordering::Relaxed), Ordering::Relaxed);
        self.closed_ops
            .1
            .fetch_add(s.ops_failed.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// A fresh unique id for a session of `uid` (see [`crate::issued`] for the limits).
    pub fn unique_id(&self, uid: u32) -> UniqueId {
        let u = UniqueId::random_with_root(&self.node_id().unwrap_or_default());
        let cap = self.cfg.max_unique_ids_per_uid;
        let dropped = lock(&self.issued).insert(uid, u.token, Instant::now(), cap);
        if dropped > 0 {
            tracing::debug!(target: "commd::session", "uid {uid} holds {cap} unused unique ids (max_unique_ids_per_uid): dropped its {dropped} oldest");
        }
        u
    }

    /// Registers this rank for the communicator and returns a receiver that resolves once every
    /// rank has joined (or the communicator cannot form).
    /// Records a rank's per-communicator `switch` option ("" = the daemon's setting) before it
    /// joins; the first local rank that sets one decides for this node.
    pub fn note_switch(&self, uid_bytes: &[u8], value: &str) -> Result<(), DaemonError> {
        if value.is_empty() {
            return Ok(());
        }
        crate::switch::check_controller(value)
            .map_err(|e| DaemonError::InvalidArgument(format!("switch option '{value}': {e}")))?;
        let uid =
            UniqueId::decode(uid_bytes).map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
        let mut m = lock(&self.switch_opts);
        if m.len() > 4096 {
            m.clear();
        }
        m.entry(uid.token).or_insert_with(|| value.to_string());
        Ok(())
    }

    pub fn join(
        self: &Arc<Self>,
        session: Arc<Session>,
        uid_bytes: &[u8],
        rank: u32,
        nranks: u32,
        opts: JoinOpts,
        wait: Duration,
    ) -> Result<oneshot::Receiver<JoinResult>, DaemonError> {
        if self.is_shutting_down() {
            return Err(DaemonError::Unavailable("daemon is shutting down".into()));
        }
        let held = self.uid_usage(session.uid).communicators;
        if held >= self.cfg.max_comms_per_uid {
            return Err(DaemonError::ResourceExhausted(format!(
                "uid {} is a member of {held} communicators, its maximum (max_comms_per_uid={}); destroy unused ones first",
                session.uid, self.cfg.max_comms_per_uid
            )));
        }
        let uid =
            UniqueId::decode(uid_bytes).map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
        if nranks == 0 || nranks > commd_proto::desc::MAX_RANKS {
            return Err(DaemonError::InvalidArgument(format!(
                "nranks {nranks} must be in 1..={}",
                commd_proto::desc::MAX_RANKS
            )));
        }
        if rank >= nranks {
            return Err(DaemonError::InvalidArgument(format!(
                "rank {rank} is out of range for nranks {nranks}"
            )));
        }
        if !uid.root.is_empty() && Some(&uid.root) != self.node_id().as_ref() {
            return self.join_via_root(session, uid, rank, nranks, opts, wait);
        }
        let mut joins = lock(&self.joins);
        if let std::collections::hash_map::Entry::Vacant(e) = joins.entry(uid.token) {
            if !lock(&self.issued).take(&uid.token, Instant::now()) {
                return Err(DaemonError::NotFound(format!(
                    "unique id {} was not issued by this daemon, or its communicator already formed (ids are single-use, expire after 24 h unused, and a user's oldest unused ids are dropped beyond max_unique_ids_per_uid); an id made on another node by a daemon without a peer service (peer_listen=off, the default) can only be used on that node",
                    uid.short()
                )));
            }
            let op_timeout = opts.op_timeout.unwrap_or(self.cfg.op_timeout);
            crate::telemetry::comm_joining(&uid.token, nranks);
            e.insert(PendingJoin {
                nranks,
                op_timeout,
                members: (0..nranks).map(|_| None).collect(),
                pacing: None,
            });
        }
        let Some(j) = joins.get_mut(&uid.token) else {
            return Err(DaemonError::Internal("pending join vanished".into()));
        };
        if j.nranks != nranks {
            let first = j.members.iter().position(Option::is_some).unwrap_or(0);
            return Err(DaemonError::InvalidArgument(format!(
                "rank {rank} joins communicator {} with nranks={nranks}, but rank {first} joined with nranks={}",
                uid.short(),
                j.nranks
            )));
        }
        if let Some(m) = &j.members[rank as usize] {
            return Err(DaemonError::AlreadyExists(format!(
                "rank {rank} of communicator {} already joined (pid {})",
                uid.short(),
                m.pid()
            )));
        }
        vote_pacing(&mut j.pacing, &uid.short(), rank, opts.pacing)?;
        let (tx, rx) = oneshot::channel();
        j.members[rank as usize] = Some(Slot::Local(Joiner { session, tx }));
        if j.members.iter().all(Option::is_some)
            && let Some(j) = joins.remove(&uid.token)
        {
            drop(joins);
            self.form(uid, j);
        }
        Ok(rx)
    }

    /// Every rank of a communicator rooted here has joined: answer the other nodes with the
    /// membership and form this node's part.
    fn form(&self, uid: UniqueId, j: PendingJoin) {
        let me = self.node_id().unwrap_or_else(|| "local".into());
        let my_data = self
            .net
            .get()
            .map(|n| n.data.addr.to_string())
            .unwrap_or_default();
        let my_rdma = self.net.get().map(|n| n.offer()).unwrap_or_default();
        let mut reply = pb::PeerJoinReply::default();
        for m in j.members.iter().flatten() {
            let (node, data, rdma) = match m {
                Slot::Local(_) => (me.clone(), my_data.clone(), my_rdma.clone()),
                Slot::Remote {
                    node,
                    data_addr,
                    rdma,
                    ..
                } => (node.clone(), data_addr.clone(), rdma.clone()),
            };
            let idx = match reply.nodes.iter().position(|n| n.node == node) {
                Some(i) => i,
                None => {
                    reply.nodes.push(pb::PeerNode {
                        node,
                        data_addr: data,
                        rdma: rdma.desc,
                        rdma_off: rdma.off,
                    });
                    reply.nodes.len() - 1
                }
            };
            reply.rank_node.push(idx as u32);
            reply.rank_pid.push(m.pid());
        }
        let mut local = HashMap::new();
        for (rank, m) in j.members.into_iter().flatten().enumerate() {
            match m {
                Slot::Local(joiner) => {
                    local.insert(rank as u32, joiner);
                }
                Slot::Remote { tx, .. } => {
                    let _ = tx.send(Ok(reply.clone()));
                }
            }
        }
        if !local.is_empty() {
            let pacing = j.pacing.map_or(self.cfg.gpu_pacing, |v| v.rate);
            self.form_local(&uid, &reply, &me, (j.op_timeout, pacing), local);
        }
    }

    /// The root answered: form this node's part of a communicator rooted elsewhere.
    fn form_remote(&self, uid: &UniqueId, reply: pb::PeerJoinReply) {
        let Some(rj) = lock(&self.remote_joins).remove(&uid.token) else {
            return;
        };
        let me = self.node_id().unwrap_or_default();
        let pacing = rj.pacing.map_or(self.cfg.gpu_pacing, |v| v.rate);
        self.form_local(uid, &reply, &me, (rj.op_timeout, pacing), rj.local);
    }

    /// `limits`: the communicator's op timeout and GPU pacing (bytes/s, `None`: uncapped).
    fn form_local(
        &self,
        uid: &UniqueId,
        reply: &pb::PeerJoinReply,
        me: &str,
        limits: (Duration, Option<u64>),
        mut local: HashMap<u32, Joiner>,
    ) {
        let (op_timeout, pacing) = limits;
        let n = reply.rank_node.len();
        let my_node = reply.nodes.iter().position(|x| x.node == me);
        let bad = |why: String, local: HashMap<u32, Joiner>| {
            tracing::warn!(target: "commd::comm", "communicator {}: {why}", uid.short());
            for (_, j) in local {
                let _ = j.tx.send(Err(DaemonError::Internal(format!(
                    "communicator {}: {why}",
                    uid.short()
                ))));
            }
        };
        let Some(my_node) = my_node else {
            return bad(
                "the root's membership does not include this node".into(),
                local,
            );
        };
        let mine: Vec<u32> = (0..n as u32)
            .filter(|&r| reply.rank_node[r as usize] as usize == my_node)
            .collect();
        if mine.len() != local.len() || mine.iter().any(|r| !local.contains_key(r)) {
            return bad(
                format!(
                    "ranks {:?} are on this node, but {:?} joined here",
                    mine,
                    local.keys().collect::<Vec<_>>()
                ),
                local,
            );
        }
        let id = self.new_id();
        let members: Vec<Member> = (0..n as u32)
            .map(|r| match local.get(&r) {
                Some(j) => Member {
                    session_id: j.session.id,
                    pid: j.session.pid,
                    local: true,
                },
                None => Member {
                    session_id: 0,
                    pid: reply.rank_pid.get(r as usize).copied().unwrap_or(0),
                    local: false,
                },
            })
            .collect();
        let comm = Arc::new(Comm::new(
            id,
            uid.short(),
            members,
            op_timeout,
            self.cfg.workers,
            pacing,
        ));
        if reply.nodes.len() > 1 {
            let Some(ctx) = self.net.get() else {
                return bad(
                    "spans nodes but this daemon has no peer service".into(),
                    local,
                );
            };
            let topo = crate::net::algo::Topo::new(
                my_node,
                reply.nodes.iter().map(|x| x.node.clone()).collect(),
                reply.rank_node.iter().map(|&x| x as usize).collect(),
            );
            let weak = Arc::downgrade(&comm);
            let setup = crate::net::Setup {
                token: uid.token,
                topo,
                data_addrs: reply.nodes.iter().map(|x| x.data_addr.clone()).collect(),
                offers: reply
                    .nodes
                    .iter()
                    .map(|x| crate::net::rdma::Offer {
                        desc: x.rdma.clone(),
                        off: x.rdma_off.clone(),
                    })
                    .collect(),
                label: comm.label(),
                comm_id: id,
                op_timeout,
                switch: lock(&self.switch_opts).remove(&uid.token),
                on_fail: Box::new(move |st, msg| {
                    if let Some(c) = weak.upgrade() {
                        c.abort_rank(None, st, msg);
                    }
                }),
            };
            match crate::net::start(ctx, setup) {
                Ok(h) => {
                    let _ = comm.net.set(h);
                }
                Err(e) => {
                    return bad(format!("cannot start its network thread: {e}"), local);
                }
            }
        }
        lock(&self.comms).insert(id, comm.clone());
        tracing::info!(
            target: "commd::comm",
            "{} formed: {} node(s), local {}, GPU pacing {}",
            comm.label(),
            reply.nodes.len().max(1),
            crate::net::algo::ranks_text(&mine),
            crate::pacing::describe(pacing)
        );
        crate::comm::comm_formed(&comm, &uid.token);
        for rank in mine {
            let Some(m) = local.remove(&rank) else {
                continue;
            };
            let (handle, slot) = {
                let mut t = m.session.tables();
                t.next_comm += 1;
                let h = t.next_comm;
                t.comms.insert(h, (comm.clone(), rank));
                let used: std::collections::HashSet<u32> =
                    t.doorbell_slots.values().copied().collect();
                let slot = (0..commd_proto::desc::doorbell::SLOTS)
                    .find(|i| !used.contains(i))
                    .unwrap_or(commd_proto::desc::doorbell::NO_SLOT);
                if let Some((ready, done, err)) = m.session.ring.doorbell(slot) {
                    ready.store(0, Ordering::Release);
                    done.store(0, Ordering::Release);
                    err.store(0, Ordering::Release);
                    if let Some(hint) = m.session.ring.doorbell_hint(slot) {
                        hint.store(0, Ordering::Release);
                    }
                    t.doorbell_slots.insert(h, slot);
                }
                (h, slot)
            };
            if m.session.is_closed() {
                comm.abort_rank(
                    Some(rank),
                    status::PEER_LOST,
                    format!("{}: rank {rank} exited while joining", comm.label()),
                );
            }
            let _ =
                m.tx.send(Ok((handle, id, slot, reply.nodes.len().max(1) as u32)));
        }
    }

    /// A local rank joins a communicator rooted at another node: ask its daemon.
    fn join_via_root(
        self: &Arc<Self>,
        session: Arc<Session>,
        uid: UniqueId,
        rank: u32,
        nranks: u32,
        opts: JoinOpts,
        wait: Duration,
    ) -> Result<oneshot::Receiver<JoinResult>, DaemonError> {
        let Some(net) = self.net.get().cloned() else {
            return Err(DaemonError::Unavailable(format!(
                "communicator {} is rooted at {} (another node), but this daemon has no peer service (peer_listen=off); enable it to join multi-node communicators",
                uid.short(),
                uid.root
            )));
        };
        let op_timeout = opts.op_timeout.unwrap_or(self.cfg.op_timeout);
        let (tx, rx) = oneshot::channel();
        let pid = session.pid;
        {
            let mut rj = lock(&self.remote_joins);
            let e = rj.entry(uid.token).or_insert_with(|| RemoteJoin {
                nranks,
                op_timeout,
                root: uid.root.clone(),
                local: HashMap::new(),
                pacing: None,
            });
            if e.nranks != nranks {
                return Err(DaemonError::InvalidArgument(format!(
                    "rank {rank} joins communicator {} with nranks={nranks}, but another rank on this node joined with nranks={}",
                    uid.short(),
                    e.nranks
                )));
            }
            if e.local.contains_key(&rank) {
                return Err(DaemonError::AlreadyExists(format!(
                    "rank {rank} of communicator {} already joined on this node",
                    uid.short()
                )));
            }
            vote_pacing(&mut e.pacing, &uid.short(), rank, opts.pacing)?;
            e.local.insert(rank, Joiner { session, tx });
        }
        let req = pb::PeerJoinRequest {
            token: uid.token.to_vec(),
            nranks,
            rank,
            node: net.node.clone(),
            data_addr: net.data.addr.to_string(),
            rdma: net.offer().desc,
            rdma_off: net.offer().off,
            pid,
            // The root answers a little before the caller gives up, so its message (naming the
            // missing ranks) is the one the caller sees.
            timeout_ms: wait
                .saturating_sub(Duration::from_millis(300))
                .as_millis()
                .max(1) as u64,
            op_timeout_ms: op_timeout.as_millis() as u64,
        };
        let d = self.clone();
        tokio::spawn(async move {
            match crate::net::peer_client::join(&uid.root, req, wait, net.tls.as_ref()).await {
                Ok(reply) => d.form_remote(&uid, reply),
                Err(e) => {
                    let e = join_error(&uid.root, e);
                    let j = lock(&d.remote_joins)
                        .get_mut(&uid.token)
                        .and_then(|rj| rj.local.remove(&rank));
                    if let Some(j) = j {
                        let _ = j.tx.send(Err(e));
                    }
                }
            }
        });
        Ok(rx)
    }

    /// The root side of a peer's Join: validates the token and records the rank.
    pub fn peer_join(
        &self,
        r: &pb::PeerJoinRequest,
    ) -> Result<oneshot::Receiver<Result<pb::PeerJoinReply, DaemonError>>, DaemonError> {
        if self.is_shutting_down() {
            return Err(DaemonError::Unavailable("daemon is shutting down".into()));
        }
        let token: [u8; 16] = r.token.as_slice().try_into().map_err(|_| {
            tracing::warn!(target: "commd::net", "rejected a join from node {}: malformed token", r.node);
            DaemonError::PermissionDenied("malformed communicator token".into())
        })?;
        let short: String = token[..4].iter().map(|b| format!("{b:02x}")).collect();
        let (rank, nranks) = (r.rank, r.nranks);
        if nranks == 0 || nranks > commd_proto::desc::MAX_RANKS || rank >= nranks {
            return Err(DaemonError::InvalidArgument(format!(
                "rank {rank} / nranks {nranks} out of range"
            )));
        }
        let mut joins = lock(&self.joins);
        if let std::collections::hash_map::Entry::Vacant(e) = joins.entry(token) {
            if !lock(&self.issued).take(&token, Instant::now()) {
                tracing::warn!(target: "commd::net", "rejected a join of rank {rank} from node {} (pid {}): unknown or stale token {short}..", r.node, r.pid);
                return Err(DaemonError::PermissionDenied(format!(
                    "communicator token {short}.. is not known to the root daemon: a wrong or stale unique id (ids are single-use; was the communicator already formed, or the root daemon restarted?)"
                )));
            }
            e.insert(PendingJoin {
                nranks,
                op_timeout: Duration::from_millis(r.op_timeout_ms.max(1)),
                members: (0..nranks).map(|_| None).collect(),
                pacing: None,
            });
        }
        let Some(j) = joins.get_mut(&token) else {
            return Err(DaemonError::Internal("pending join vanished".into()));
        };
        if j.nranks != nranks {
            let first = j.members.iter().position(Option::is_some).unwrap_or(0);
            return Err(DaemonError::InvalidArgument(format!(
                "rank {rank} (node {}) joins communicator {short} with nranks={nranks}, but rank {first} joined with nranks={}",
                r.node, j.nranks
            )));
        }
        if let Some(m) = &j.members[rank as usize] {
            return Err(DaemonError::AlreadyExists(format!(
                "rank {rank} of communicator {short} already joined (pid {})",
                m.pid()
            )));
        }
        let (tx, rx) = oneshot::channel();
        j.members[rank as usize] = Some(Slot::Remote {
            node: r.node.clone(),
            data_addr: r.data_addr.clone(),
            rdma: crate::net::rdma::Offer {
                desc: r.rdma.clone(),
                off: r.rdma_off.clone(),
            },
            pid: r.pid,
            tx,
        });
        if j.members.iter().all(Option::is_some)
            && let Some(j) = joins.remove(&token)
        {
            drop(joins);
            self.form(
                UniqueId {
                    token,
                    root: String::new(),
                },
                j,
            );
        }
        Ok(rx)
    }

    /// A remote rank's join timed out at the root: withdraw it and name the missing ranks.
    pub fn peer_join_timed_out(&self, token: &[u8], rank: u32, waited: Duration) -> String {
        let Ok(token) = <[u8; 16]>::try_from(token) else {
            return "malformed token".into();
        };
        self.withdraw(&token, rank, waited)
    }

    /// Withdraws a rank that gave up waiting; returns the message naming the missing ranks.
    pub fn join_timed_out(&self, uid_bytes: &[u8], rank: u32, waited: Duration) -> String {
        let Ok(uid) = UniqueId::decode(uid_bytes) else {
            return "invalid unique id".into();
        };
        if let Some(rj) = lock(&self.remote_joins).get_mut(&uid.token) {
            rj.local.remove(&rank);
            if rj.local.is_empty() {
                rj.pacing = None;
            }
            return format!(
                "communicator {} (rooted at {}) did not form within {:.1} s; the root daemon did not answer in time",
                uid.short(),
                rj.root,
                waited.as_secs_f64()
            );
        }
        self.withdraw(&uid.token, rank, waited)
    }

    fn withdraw(&self, token: &[u8; 16], rank: u32, waited: Duration) -> String {
        let short: String = token[..4].iter().map(|b| format!("{b:02x}")).collect();
        let mut joins = lock(&self.joins);
        let Some(j) = joins.get_mut(token) else {
            return format!(
                "communicator {short} did not form within {:.1} s",
                waited.as_secs_f64()
            );
        };
        let of = |joined: bool| -> Vec<u32> {
            (0u32..)
                .zip(&j.members)
                .filter(|(_, m)| m.is_some() == joined)
                .map(|(r, _)| r)
                .collect()
        };
        let (joined, missing) = (of(true), of(false));
        let nranks = j.nranks;
        if let Some(m) = j.members.get_mut(rank as usize) {
            *m = None;
        }
        // The pacing was this node's ranks' choice: with none of them left, the next decides.
        if !j
            .members
            .iter()
            .flatten()
            .any(|m| matches!(m, Slot::Local(_)))
        {
            j.pacing = None;
        }
        if j.members.iter().all(Option::is_none) {
            joins.remove(token);
        }
        format!(
            "timed out after {:.1} s waiting for rank(s) [{}] to join communicator {} ({} ranks, {} missing); joined: [{}]",
            waited.as_secs_f64(),
            crate::ranks::list(&missing),
            short,
            nranks,
            missing.len(),
            crate::ranks::list(&joined)
        )
    }

    pub fn destroy_comm(&self, s: &Session, handle: u32) -> Result<(), DaemonError> {
        s.tables().doorbell_slots.remove(&handle);
        let Some((comm, rank)) = s.tables().comms.remove(&handle) else {
            return Err(DaemonError::NotFound(format!(
                "no communicator handle {handle} in session {}",
                s.id
            )));
        };
        let msg = format!(
            "{}: rank {rank} (pid {}) destroyed the communicator",
            comm.label(),
            s.pid
        );
        if comm.leave(rank, msg) {
            lock(&self.comms).remove(&comm.id);
        }
        Ok(())
    }

    /// A communicator's GPU pacing request (`pacing_bytes_per_sec`: absent = the daemon's
    /// `gpu_pacing_gbps`, 0 = uncapped) as a rate in bytes/s (`None`: uncapped).
    pub fn resolve_pacing(&self, requested: Option<u64>) -> Result<Option<u64>, DaemonError> {
        match requested {
            None => Ok(self.cfg.gpu_pacing),
            Some(r) => crate::pacing::check_rate(r).map_err(DaemonError::InvalidArgument),
        }
    }

    /// `SetCommPacing`: caps the GPU copies of `s`'s communicator `handle` at `bytes_per_sec`
    /// (0: uncapped), for every rank on this node, from its next copy phase on.
    pub fn set_comm_pacing(
        &self,
        s: &Session,
        handle: u32,
        bytes_per_sec: u64,
    ) -> Result<(), DaemonError> {
        let (comm, rank) = s.tables().comms.get(&handle).cloned().ok_or_else(|| {
            DaemonError::NotFound(format!(
                "no communicator handle {handle} in session {} (destroyed, or never created here)",
                s.id
            ))
        })?;
        let rate = crate::pacing::check_rate(bytes_per_sec)
            .map_err(|e| DaemonError::InvalidArgument(format!("{}: {e}", comm.label())))?;
        let was = comm.pacer.rate();
        comm.pacer.set_rate(rate);
        tracing::info!(
            target: "commd::comm",
            "{}: rank {rank} (pid {}) set GPU pacing to {} (was {})",
            comm.label(),
            s.pid,
            crate::pacing::describe(rate),
            crate::pacing::describe(was)
        );
        Ok(())
    }

    pub fn stage_fd(&self, s: &Session, token: u64, fd: OwnedFd) -> Result<(), DaemonError> {
        let mut t = s.tables();
        if t.staged.len() >= MAX_STAGED {
            return Err(DaemonError::ResourceExhausted(format!(
                "more than {MAX_STAGED} fds staged and not registered"
            )));
        }
        t.staged.insert(token, fd);
        Ok(())
    }

    pub fn register(&self, s: &Session, token: u64, bytes: u64) -> Result<u32, DaemonError> {
        let fd = s.tables().staged.remove(&token).ok_or_else(|| {
            DaemonError::NotFound(format!(
                "no fd staged under token {token}: stage it on the fd socket first"
            ))
        })?;
        {
            let t = s.tables();
            if t.registered_bytes.saturating_add(bytes) > self.cfg.max_registered_bytes {
                return Err(DaemonError::ResourceExhausted(format!(
                    "registering {bytes} bytes would exceed the session limit of {} bytes (max_registered_bytes)",
                    self.cfg.max_registered_bytes
                )));
            }
        }
        // Check and charge under one lock, so concurrent registrations of a uid cannot both
        // pass; each session's tables are locked only briefly, one at a time.
        let _charge = lock(&self.reg_charge);
        let held = self.uid_usage(s.uid).registered_bytes;
        let cap = self.cfg.max_registered_bytes_per_uid;
        if held.saturating_add(bytes) > cap {
            return Err(DaemonError::ResourceExhausted(format!(
                "registering {bytes} bytes would bring uid {} to {} bytes of registered host memory, above its limit of {cap} bytes (max_registered_bytes_per_uid)",
                s.uid,
                held.saturating_add(bytes)
            )));
        }
        let region = MemRegion::from_fd(fd, bytes)
            .map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
        let mut t = s.tables();
        t.next_mem += 1;
        let id = t.next_mem;
        t.registered_bytes += bytes;
        t.mems.insert(id, Arc::new(region));
        Ok(id)
    }

    /// What the sessions of `uid` hold now.
    pub fn uid_usage(&self, uid: u32) -> UidUsage {
        let mut u = UidUsage::default();
        for s in self.sessions().iter().filter(|s| s.uid == uid) {
            let t = s.tables();
            u.sessions += 1;
            u.communicators += t.comms.len();
            u.registered_bytes = u.registered_bytes.saturating_add(t.registered_bytes);
        }
        u
    }

    /// Registers a client's device allocation by IPC handle; returns (mem id, cached, open us).
    /// The same handle registered again by the session returns the open mapping. With `vmm`,
    /// `handle` is empty and the registration is a mirror of the client's cuMem address range
    /// of `bytes`, its pieces mapped by [`Daemon::map_cuda_pieces`].
    pub fn register_cuda(
        &self,
        s: &Session,
        handle: &[u8],
        uuid: &[u8],
        bytes: u64,
        vmm: bool,
    ) -> Result<(u32, bool, u64), DaemonError> {
        let c = crate::cuda::get()
            .map_err(|why| DaemonError::Unavailable(format!("this daemon has no CUDA: {why}")))?;
        if bytes == 0 {
            return Err(DaemonError::InvalidArgument(
                "registration of 0 bytes".into(),
            ));
        }
        if vmm {
            if !handle.is_empty() {
                return Err(DaemonError::InvalidArgument(
                    "a cuMem range registration carries no IPC handle".into(),
                ));
            }
            let mem = c
                .reserve_vmm(uuid, bytes)
                .map_err(DaemonError::InvalidArgument)?;
            let mut t = s.tables();
            t.next_mem += 1;
            let id = t.next_mem;
            t.cuda_mems.insert(id, Arc::new(mem));
            return Ok((id, false, 0));
        }
        if let Some(id) = s.tables().ipc_cache.get(handle).copied() {
            c.stats.hits.fetch_add(1, Ordering::Relaxed);
            s.ipc_hits.fetch_add(1, Ordering::Relaxed);
            return Ok((id, true, 0));
        }
        let mem = c
            .open_ipc(uuid, handle, bytes)
            .map_err(DaemonError::InvalidArgument)?;
        s.ipc_opens.fetch_add(1, Ordering::Relaxed);
        let us = mem.open_us;
        let mut t = s.tables();
        // Another thread of the client may have registered the same handle meanwhile.
        if let Some(id) = t.ipc_cache.get(handle).copied() {
            return Ok((id, true, 0));
        }
        t.next_mem += 1;
        let id = t.next_mem;
        t.cuda_mems.insert(id, Arc::new(mem));
        t.ipc_cache.insert(handle.to_vec(), id);
        Ok((id, false, us))
    }

    /// Maps pieces (offset, bytes, staged fd token) into the session's cuMem mirror `mem`;
    /// returns the microseconds spent. Every staged fd named is consumed, even on failure.
    pub fn map_cuda_pieces(
        &self,
        s: &Session,
        mem: u32,
        pieces: &[(u64, u64, u64)],
    ) -> Result<u64, DaemonError> {
        let (m, fds) = {
            let mut t = s.tables();
            let fds: Vec<Option<OwnedFd>> = pieces.iter().map(|p| t.staged.remove(&p.2)).collect();
            (t.cuda_mems.get(&mem).cloned(), fds)
        };
        let c = crate::cuda::get()
            .map_err(|why| DaemonError::Unavailable(format!("this daemon has no CUDA: {why}")))?;
        let m = m.ok_or_else(|| {
            DaemonError::NotFound(format!("no GPU memory handle {mem} in session {}", s.id))
        })?;
        if !m.is_vmm() {
            return Err(DaemonError::InvalidArgument(format!(
                "GPU memory handle {mem} is an IPC registration, not a cuMem range"
            )));
        }
        let mut list = Vec::with_capacity(pieces.len());
        for (p, fd) in pieces.iter().zip(fds) {
            let fd = fd.ok_or_else(|| {
                DaemonError::NotFound(format!(
                    "no fd staged under token {}: stage it on the fd socket first",
                    p.2
                ))
            })?;
            list.push((p.0, p.1, fd));
        }
        let us = c
            .map_pieces(&m, list)
            .map_err(DaemonError::InvalidArgument)?;
        s.ipc_opens
            .fetch_add(pieces.len() as u64, Ordering::Relaxed);
        Ok(us)
    }

    /// The device scratch of `s`'s rank of communicator `handle` on the GPU `uuid` (allocated on
    /// first call): (IPC handle, slot bytes, total bytes).
    pub fn comm_scratch(
        &self,
        s: &Session,
        handle: u32,
        uuid: &[u8],
    ) -> Result<(Vec<u8>, u64, u64), DaemonError> {
        let c = crate::cuda::get()
            .map_err(|why| DaemonError::Unavailable(format!("this daemon has no CUDA: {why}")))?;
        let (comm, rank) = s.tables().comms.get(&handle).cloned().ok_or_else(|| {
            DaemonError::NotFound(format!(
                "no communicator handle {handle} in session {}",
                s.id
            ))
        })?;
        let bytes = commd_proto::desc::cuda_scratch_bytes(comm.nranks, c.slot_bytes);
        if bytes == 0 {
            return Ok((Vec::new(), c.slot_bytes, 0));
        }
        let gpu = c.gpu_by_uuid(uuid);
        let mut sc = comm.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = &sc[rank as usize] {
            if Some(existing.mem.gpu) != gpu {
                return Err(DaemonError::InvalidArgument(format!(
                    "{}: rank {rank} already has its GPU scratch on another GPU; use one GPU per rank and communicator",
                    comm.label()
                )));
            }
            let h = c.export(&existing.mem).map_err(DaemonError::Internal)?;
            return Ok((h, c.slot_bytes, bytes));
        }
        // The session's scratch on that GPU, shared by its communicators (see
        // `Tables::scratch_pool`; the executor runs jobs sharing a scratch one at a time).
        let pooled = gpu.and_then(|g| s.tables().scratch_pool.get(&(g, bytes)).cloned());
        let mem = match pooled {
            Some(m) => m,
            None => {
                let m = Arc::new(
                    c.alloc(uuid, bytes)
                        .map_err(DaemonError::ResourceExhausted)?,
                );
                s.tables().scratch_pool.insert((m.gpu, bytes), m.clone());
                m
            }
        };
        let h = c.export(&mem).map_err(DaemonError::Internal)?;
        let span = crate::cuda::GpuSpan::new(mem, 0, bytes)
            .ok_or_else(|| DaemonError::Internal("scratch span".into()))?;
        sc[rank as usize] = Some(span);
        crate::comm::comm_device(&comm, rank, &sc);
        let gpus: Vec<Option<usize>> = sc.iter().map(|s| s.as_ref().map(|s| s.mem.gpu)).collect();
        drop(sc);
        for (r, shared) in shared_gpu_ranks(&gpus).into_iter().enumerate() {
            if shared {
                self.hint(
                    &comm,
                    r as u32,
                    commd_proto::desc::doorbell::HINT_SHARED_GPU,
                );
            }
        }
        Ok((h, c.slot_bytes, bytes))
    }

    /// Sets `bit` in the doorbell hint word of `rank` of `comm` (a local rank's session).
    fn hint(&self, comm: &Arc<Comm>, rank: u32, bit: u32) {
        let Some(m) = comm.members.get(rank as usize).filter(|m| m.local) else {
            return;
        };
        let Some(s) = self.session(m.session_id) else {
            return;
        };
        let slot = {
            let t = s.tables();
            t.comms
                .iter()
                .find(|(_, (c, r))| c.id == comm.id && *r == rank)
                .and_then(|(h, _)| t.doorbell_slots.get(h).copied())
        };
        if let Some(w) = slot.and_then(|slot| s.ring.doorbell_hint(slot)) {
            w.fetch_or(bit, Ordering::AcqRel);
        }
    }

    pub fn deregister(&self, s: &Session, mem: u32) -> Result<(), DaemonError> {
        let mut t = s.tables();
        if t.cuda_mems.remove(&mem).is_some() {
            t.ipc_cache.retain(|_, id| *id != mem);
            return Ok(());
        }
        let r = t.mems.remove(&mem).ok_or_else(|| {
            DaemonError::NotFound(format!("no memory handle {mem} in session {}", s.id))
        })?;
        t.registered_bytes -= r.len();
        // In-flight ops keep their own reference; the mapping goes when the last one finishes.
        Ok(())
    }

    pub fn counts(&self) -> Counts {
        let sessions = self.sessions();
        let mut c = Counts {
            sessions: sessions.len() as u32,
            ..Default::default()
        };
        for s in &sessions {
            let t = s.tables();
            c.registrations += (t.mems.len() + t.cuda_mems.len()) as u32;
            c.mapped_bytes += t.registered_bytes;
        }
        c.communicators = lock(&self.comms).len() as u32;
        c.pending_joins = lock(&self.joins).len() as u32;
        c
    }

    /// Periodic housekeeping: op timeouts, attach deadlines, dead processes.
    pub fn tick(&self, check_liveness: bool) {
        let now = Instant::now();
        let comms: Vec<Arc<Comm>> = lock(&self.comms).values().cloned().collect();
        for c in comms {
            c.check_timeout(now);
        }
        for s in self.sessions() {
            if !s.attached.load(Ordering::Acquire)
                && now.duration_since(s.created) > self.cfg.attach_timeout
            {
                self.close_session(
                    s.id,
                    status::PEER_LOST,
                    "client never attached to the fd socket",
                );
                continue;
            }
            if check_liveness
                && s.pid > 0
                && let Some(pid) = rustix::process::Pid::from_raw(s.pid)
                && rustix::process::test_kill_process(pid) == Err(rustix::io::Errno::SRCH)
            {
                self.close_session(
                    s.id,
                    status::PEER_LOST,
                    &format!("process {} exited", s.pid),
                );
            }
        }
    }

    /// SIGTERM: refuse new work, fail everything pending with a clear error.
    pub fn shutdown(&self, reason: &str) {
        self.shutting_down.store(true, Ordering::Release);
        let msg = format!(
            "daemon is shutting down ({reason}); restart it and re-create the communicator"
        );
        let comms: Vec<Arc<Comm>> = lock(&self.comms).values().cloned().collect();
        for c in comms {
            c.abort_rank(None, status::SHUTDOWN, format!("{}: {msg}", c.label()));
        }
        for (_, j) in lock(&self.joins).drain() {
            for m in j.members.into_iter().flatten() {
                m.fail(DaemonError::Unavailable(msg.clone()));
            }
        }
        for (_, rj) in lock(&self.remote_joins).drain() {
            for (_, j) in rj.local {
                let _ = j.tx.send(Err(DaemonError::Unavailable(msg.clone())));
            }
        }
        for s in self.sessions() {
            s.ring
                .session_error()
                .store(status::SHUTDOWN, Ordering::Release);
        }
    }
}

/// Per rank: whether another rank with a bound GPU uses the same GPU (`None`: not bound yet).
pub fn shared_gpu_ranks(gpus: &[Option<usize>]) -> Vec<bool> {
    gpus.iter()
        .enumerate()
        .map(|(r, g)| {
            g.is_some_and(|g| {
                gpus.iter()
                    .enumerate()
                    .any(|(o, h)| o != r && *h == Some(g))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests;

/// A failed join at the root daemon `root` as this daemon's error.
fn join_error(root: &str, e: crate::net::peer_client::JoinError) -> DaemonError {
    match e {
        crate::net::peer_client::JoinError::Unreachable(e) => DaemonError::Unavailable(format!(
            "cannot reach the root daemon {root} of this communicator (the address in the unique id): {e}"
        )),
        crate::net::peer_client::JoinError::Refused(s) => from_status(root, s),
    }
}

fn from_status(root: &str, s: tonic::Status) -> DaemonError {
    use tonic::Code;
    let m = s.message().to_string();
    match s.code() {
        Code::InvalidArgument => DaemonError::InvalidArgument(m),
        Code::NotFound => DaemonError::NotFound(m),
        Code::PermissionDenied => {
            DaemonError::PermissionDenied(format!("root daemon {root} refused the join: {m}"))
        }
        Code::AlreadyExists => DaemonError::AlreadyExists(m),
        Code::ResourceExhausted => DaemonError::ResourceExhausted(m),
        Code::DeadlineExceeded => DaemonError::DeadlineExceeded(m),
        Code::Unavailable => DaemonError::Unavailable(format!("root daemon {root}: {m}")),
        _ => DaemonError::Internal(format!("root daemon {root}: {m}")),
    }
}
