//! Daemon-wide state: sessions, communicators, pending joins, issued unique ids, and the
//! operations the control plane and the fd socket call. Transport-agnostic: no tonic types here
//! (errors are [`DaemonError`], mapped to gRPC statuses in `control`).

use std::collections::{BTreeMap, HashMap};
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

mod join;
mod memory;
mod shrink;

pub use join::JoinOpts;
use join::*;
use shrink::*;
pub use shrink::{ShrinkArgs, Shrinking};

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
    /// Memberships, those of communicators still forming included.
    pub communicators: usize,
    pub registered_bytes: u64,
    /// Host and GPU registrations.
    pub registrations: usize,
    /// Fds staged on the fd socket and not registered.
    pub staged_fds: usize,
}

impl UidUsage {
    fn add(&mut self, o: &UidUsage) {
        self.sessions += o.sessions;
        self.communicators += o.communicators;
        self.registered_bytes = self.registered_bytes.saturating_add(o.registered_bytes);
        self.registrations += o.registrations;
        self.staged_fds += o.staged_fds;
    }
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
    /// Shrinks' children that cannot form (survivors passed different exclude lists): the
    /// reason, for every later join of them (`shrink`).
    spoiled: Mutex<HashMap<[u8; 16], (String, Instant)>>,
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
            spoiled: Mutex::new(HashMap::new()),
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
            // A direct captured op (docs/contracts.md #7) of a surviving rank may be waiting on
            // the GPU for this rank's flag: the hint bit stops it.
            for r in comm.local.iter().copied().filter(|&r| r != rank) {
                self.hint(&comm, r, commd_proto::desc::doorbell::HINT_BROKEN);
            }
        }
        // Pending joins of this session fail for everyone: the communicator can no longer form.
        let mut joins = lock(&self.joins);
        let tokens: Vec<[u8; 16]> = joins
            .iter()
            .filter(|(_, j)| j.members.values().any(|m| m.session_id() == Some(id)))
            .map(|(t, _)| *t)
            .collect();
        for t in tokens {
            if let Some(j) = joins.remove(&t) {
                let rank = j
                    .members
                    .iter()
                    .find(|(_, m)| m.session_id() == Some(id))
                    .map_or(0, |(r, _)| *r);
                for m in j.members.into_values() {
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

    pub fn counts(&self) -> Counts {
        let sessions = self.sessions();
        let mut c = Counts {
            sessions: u32::try_from(sessions.len()).unwrap_or(u32::MAX),
            ..Default::default()
        };
        for s in &sessions {
            let t = s.tables();
            c.registrations = c.registrations.saturating_add(
                u32::try_from(t.mems.len() + t.cuda_mems.len()).unwrap_or(u32::MAX),
            );
            c.mapped_bytes += t.registered_bytes;
        }
        c.communicators = u32::try_from(lock(&self.comms).len()).unwrap_or(u32::MAX);
        c.pending_joins = u32::try_from(lock(&self.joins).len()).unwrap_or(u32::MAX);
        c
    }

    /// Periodic housekeeping: op timeouts, attach deadlines, dead processes.
    pub fn tick(&self, check_liveness: bool) {
        let now = Instant::now();
        if check_liveness {
            let closed = self.expire_staged();
            if closed > 0 {
                tracing::debug!(target: "commd::session", "closed {closed} staged fd(s) not registered within staged_fd_timeout_ms");
            }
        }
        let comms: Vec<Arc<Comm>> = lock(&self.comms).values().cloned().collect();
        for c in comms {
            // Every later op of the communicator fails at once; a direct op
            // (docs/contracts.md #7) of a local rank waiting on the GPU for a peer's flag stops
            // too, instead of at its own timeout, and the clients send later ops to the daemon,
            // which fails them with the reason. Marked before the timed-out ops complete.
            c.check_timeout(now, || {
                for &r in &c.local {
                    self.hint(&c, r, commd_proto::desc::doorbell::HINT_BROKEN);
                }
            });
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
            for m in j.members.into_values() {
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

/// Per rank: whether it is known to have a GPU of its own in the communicator: every rank has
/// bound one and no other rank's is the same (`HINT_OWN_GPU`).
pub fn own_gpu_ranks(gpus: &[Option<usize>]) -> Vec<bool> {
    let all = gpus.iter().all(Option::is_some);
    shared_gpu_ranks(gpus)
        .into_iter()
        .map(|shared| all && !shared)
        .collect()
}

#[cfg(test)]
mod tests;
