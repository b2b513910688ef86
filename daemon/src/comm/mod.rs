//! Communicators on one node: per-rank op queues, sequencing, cross-rank argument matching, p2p
//! matching, and failure reporting (mismatch, peer lost, timeout, shutdown).
//!
//! Ordering model (like one NCCL stream per rank and communicator): a rank's ops on a
//! communicator run in the order it posted them. The k-th collective of every rank forms
//! sequence number k; it runs once every rank has posted it and every earlier op of each rank is
//! done. Consecutive send/recv ops of a rank form a group (like `ncclGroupStart/End`): any of them
//! may match its peer's counterpart, in per-pair order, so exchanges cannot deadlock.
//!
//! Execution is serialized per communicator: whichever thread makes an op runnable runs it (and
//! whatever becomes runnable next) outside the lock, while other posters only enqueue.
//! Every posted op is completed exactly once: by execution, by an error, or by a drain.

mod report;
mod step;

pub use crate::posted::{CudaTicket, Origin, Posted};
pub use report::{
    comm_device, comm_formed, comm_nodes, comm_paths, op_executed, op_span, ranks_share_a_process,
};

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use commd_proto::desc::{Op, OpKind, status};

use crate::cuda::{self, GpuBufs, GpuSpan};
use crate::engine::{self, RankBufs};
use crate::net;
use crate::pacing::Pacer;

/// A GPU op on a multi-node communicator without `flags::HOST_STAGED`: its client library
/// would run the single-node phases and kernels, which the daemons do not serve across nodes.
const STAGED_MISSING: &str = "GPU op on a communicator that spans nodes without the host-staged flag (a client library older than this daemon?); update the client library, or use host tensors";

/// Fails every op of a step as invalid with one message.
fn invalid_all(ops: Vec<Posted>, msg: String) -> Step {
    Step::Fail {
        ops: ops
            .into_iter()
            .map(|p| (p, status::INVALID, msg.clone()))
            .collect(),
        abort: None,
    }
}

/// Where a communicator came from, for shrinking it (`Daemon::shrink`): its token (the
/// credential a child's token is derived from), each rank's node, and its parent.
#[derive(Clone, Debug, Default)]
pub struct Lineage {
    pub token: [u8; 16],
    /// Per rank: its node's id (the daemon's peer address), as the root's membership names it.
    pub rank_node: Vec<String>,
    /// A shrink's child: the parent's daemon-wide id and the parent ranks it left out.
    pub parent: Option<(u64, Vec<u32>)>,
}

#[derive(Clone, Debug)]
pub struct Member {
    pub session_id: u64,
    pub pid: i32,
    /// On this node (else a rank of another node's daemon; its queue here stays empty).
    pub local: bool,
}

enum Step {
    Run {
        plan: engine::Plan,
        ops: Vec<Posted>,
    },
    /// Multi-node communicators: work for the communicator's net thread.
    Net(net::Cmd),
    Gpu(cuda::GpuJob),
    Fail {
        ops: Vec<(Posted, u32, String)>,
        abort: Option<(u32, String)>,
    },
}

struct Inner {
    queues: Vec<VecDeque<Posted>>,
    coll_next: Vec<u64>,
    send_next: HashMap<(u32, u32), u64>,
    recv_next: HashMap<(u32, u32), u64>,
    progressing: bool,
    broken: Option<(u32, String)>,
    left: Vec<bool>,
    /// Why each rank that destroyed the communicator is gone (`Comm::leave`), for the ops that
    /// needed it.
    left_msg: HashMap<u32, String>,
}

impl Inner {
    /// Why `p` can never complete because a rank destroyed the communicator: a collective once
    /// any rank left (it will never post its part), a send or recv whose peer left, a receive
    /// from any source once every other rank left.
    fn departed(&self, p: &Posted) -> Option<String> {
        if p.op.any_source {
            // Any other rank may still send: only when all of them left can it never match.
            let others = || (0..self.left.len()).filter(|&r| r != p.rank as usize);
            if !others().all(|r| self.left[r]) {
                return None;
            }
            return others().find_map(|r| self.left_msg.get(&crate::ranks::of(r)).cloned());
        }
        let who = if p.op.kind.is_p2p() {
            Some(p.op.peer)
        } else {
            (0..crate::ranks::of(self.left.len())).find(|&r| self.left[r as usize])
        };
        who.filter(|&r| self.left.get(r as usize) == Some(&true))
            .and_then(|r| self.left_msg.get(&r).cloned())
    }
}

pub struct Comm {
    pub id: u64,
    pub uid_short: String,
    pub nranks: u32,
    pub op_timeout: Duration,
    pub members: Vec<Member>,
    workers: usize,
    inner: Mutex<Inner>,
    /// Per rank: the daemon-owned device scratch for GPU reductions (`GetCommScratch`).
    pub scratch: Mutex<Vec<Option<GpuSpan>>>,
    /// Ranks on this node, ascending.
    pub local: Vec<u32>,
    /// Multi-node communicators: the net thread that runs every step in order.
    pub net: std::sync::OnceLock<net::NetHandle>,
    /// The cap on this communicator's GPU copies on this node, shared with the executor through
    /// every [`cuda::GpuJob`]; set at creation and by `SetCommPacing`.
    pub pacer: Arc<Pacer>,
    /// The caller's name for it (NCCL's `commName`, torch's group), set by the first local rank
    /// that gives one ([`Comm::name_once`]).
    name: std::sync::OnceLock<String>,
    /// Set once it formed.
    pub lineage: std::sync::OnceLock<Lineage>,
    /// Per local rank: how many shrinks of this communicator it started (the next one's epoch).
    shrinks: Mutex<HashMap<u32, u32>>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Comm({})", self.label())
    }
}

impl Comm {
    pub fn new(
        id: u64,
        uid_short: String,
        members: Vec<Member>,
        op_timeout: Duration,
        workers: usize,
        pacing: Option<u64>,
    ) -> Self {
        let n = members.len();
        let local = (0..crate::ranks::of(n))
            .filter(|&r| members[r as usize].local)
            .collect();
        Self {
            id,
            uid_short,
            nranks: crate::ranks::of(n),
            op_timeout,
            members,
            workers,
            inner: Mutex::new(Inner {
                queues: (0..n).map(|_| VecDeque::new()).collect(),
                coll_next: vec![0; n],
                send_next: HashMap::new(),
                recv_next: HashMap::new(),
                progressing: false,
                broken: None,
                left: vec![false; n],
                left_msg: HashMap::new(),
            }),
            scratch: Mutex::new(vec![None; n]),
            local,
            net: std::sync::OnceLock::new(),
            pacer: Arc::new(Pacer::new(pacing)),
            name: std::sync::OnceLock::new(),
            lineage: std::sync::OnceLock::new(),
            shrinks: Mutex::new(HashMap::new()),
        }
    }

    /// The epoch of `rank`'s next shrink of this communicator (0, 1, ...): every survivor
    /// shrinks a parent the same number of times, so their epochs agree.
    pub fn next_shrink(&self, rank: u32) -> u32 {
        let mut g = self.shrinks.lock().unwrap_or_else(|e| e.into_inner());
        let e = g.entry(rank).or_insert(0);
        let epoch = *e;
        *e += 1;
        epoch
    }

    /// Ops `rank` posted that have not completed.
    pub fn queued_of(&self, rank: u32) -> usize {
        self.lock()
            .queues
            .get(rank as usize)
            .map_or(0, VecDeque::len)
    }

    /// "comm 7 (id 3fa2b1c0, 4 ranks)", or with a name "comm 7 "train dp" (id 3fa2b1c0, 4
    /// ranks)": how errors and logs name a communicator.
    pub fn label(&self) -> String {
        match self.name.get() {
            Some(n) => format!(
                "comm {} {n:?} (id {}, {} ranks)",
                self.id, self.uid_short, self.nranks
            ),
            None => format!(
                "comm {} (id {}, {} ranks)",
                self.id, self.uid_short, self.nranks
            ),
        }
    }

    /// The name its ranks gave it ("" = none).
    pub fn name(&self) -> &str {
        self.name.get().map_or("", String::as_str)
    }

    /// Names the communicator, unless a rank named it already: true if this call did.
    pub fn name_once(&self, name: &str) -> bool {
        !name.is_empty() && self.name.set(name.to_string()).is_ok()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock would be a daemon bug; keep serving with the state as is.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Enqueues a validated op and runs whatever becomes runnable.
    pub fn post(&self, mut p: Posted) {
        let mut g = self.lock();
        if let Some((st, msg)) = g.broken.clone() {
            drop(g);
            let c = p.op.comm;
            p.complete(c, st, Some(msg));
            return;
        }
        if let Some(msg) = g.departed(&p) {
            drop(g);
            let c = p.op.comm;
            p.complete(c, status::PEER_LOST, Some(msg));
            return;
        }
        let r = p.rank;
        p.seq = match p.op.kind {
            OpKind::Send => next(&mut g.send_next, (r, p.op.peer)),
            // A receive from any source takes its sender's sequence number when it is matched.
            OpKind::Recv if p.op.any_source => crate::posted::ANY_UNMATCHED,
            OpKind::Recv => next(&mut g.recv_next, (p.op.peer, r)),
            _ => {
                let s = g.coll_next[r as usize];
                g.coll_next[r as usize] += 1;
                s
            }
        };
        g.queues[r as usize].push_back(p);
        if g.progressing {
            return;
        }
        g.progressing = true;
        loop {
            let Some(step) = self.find_ready(&mut g) else {
                g.progressing = false;
                return;
            };
            drop(g);
            self.run_step(step);
            g = self.lock();
            if let Some((st, msg)) = g.broken.clone() {
                let ops = drain(&mut g);
                g.progressing = false;
                drop(g);
                for p in ops {
                    let c = p.op.comm;
                    p.complete(c, st, Some(msg.clone()));
                }
                return;
            }
        }
    }

    fn run_step(&self, step: Step) {
        // A multi-node communicator runs everything on its net thread, in order.
        let step = match (self.net.get(), step) {
            (Some(_), Step::Run { plan, ops }) => {
                let label = self.label();
                let workers = self.workers;
                let span = report::op_span(self, &ops, "direct", "shm");
                Step::Net(net::Cmd::Run(Box::new(move || {
                    run_plan(&label, plan, ops, workers, span)
                })))
            }
            (_, s) => s,
        };
        match step {
            Step::Net(cmd) => {
                let Some(h) = self.net.get() else { return };
                if let Err(cmd) = h.submit(cmd) {
                    let msg = format!(
                        "{}: the communicator's network thread is gone",
                        self.label()
                    );
                    match cmd {
                        net::Cmd::Coll { ops, .. } => {
                            for p in ops {
                                let c = p.op.comm;
                                p.complete(c, status::INTERNAL, Some(msg.clone()));
                            }
                        }
                        net::Cmd::P2p(p) => {
                            let c = p.op.comm;
                            p.complete(c, status::INTERNAL, Some(msg));
                        }
                        net::Cmd::Run(f) => f(),
                        net::Cmd::Abort(..) | net::Cmd::End => {}
                    }
                }
            }
            Step::Run { plan, ops } => {
                let span = report::op_span(self, &ops, "direct", "shm");
                run_plan(&self.label(), plan, ops, self.workers, span)
            }
            Step::Gpu(job) => match cuda::get() {
                Ok(c) => c.submit(job),
                Err(why) => {
                    for p in job.ops {
                        p.complete(status::INTERNAL, Some(format!("{}: {why}", job.label)));
                    }
                }
            },
            Step::Fail { ops, abort } => {
                // Across nodes a failed collective cannot be skipped on this node alone (the
                // others would wait for its data): the communicator aborts everywhere with the
                // same message.
                if let Some(h) = self.net.get()
                    && ops.iter().any(|(p, _, _)| !p.op.kind.is_p2p())
                    && let Some((_, st, msg)) = ops.first()
                {
                    let _ = h.submit(net::Cmd::Abort(*st, msg.clone()));
                }
                // A failed eager GPU op is raised asynchronously (its stream released, the
                // error word set; the client raises at its next call or wait), so its ranks
                // can no longer agree on which of their later ops still run: one may raise
                // while another posts its next op and would wait for it forever. The
                // communicator breaks, and every later op fails at once with this error on
                // every rank. (Host ops, waited for by the caller, leave it usable: both ranks
                // see the failure at the same op. Captured ops fail at a replay, seen alike.)
                let abort = abort.or_else(|| {
                    ops.iter()
                        .find(|(p, _, _)| p.cuda.is_some_and(|c| !c.graph))
                        .map(|(_, _, msg)| {
                            (
                                status::ABORTED,
                                format!("aborted after an earlier error: {msg}"),
                            )
                        })
                });
                if let Some(a) = abort {
                    let mut g = self.lock();
                    if g.broken.is_none() {
                        g.broken = Some(a);
                    }
                }
                for (p, st, msg) in ops {
                    let c = p.op.comm;
                    p.complete(c, st, Some(msg));
                }
            }
        }
    }

    /// Picks the next runnable step and removes its ops from the queues.
    fn find_ready(&self, g: &mut Inner) -> Option<Step> {
        let all_heads_collective = self.local.iter().all(|&r| {
            g.queues[r as usize]
                .front()
                .is_some_and(|p| !p.op.kind.is_p2p())
        });
        if all_heads_collective {
            let ops: Vec<Posted> = self
                .local
                .iter()
                .filter_map(|&r| g.queues[r as usize].pop_front())
                .collect();
            return Some(self.collective_step(ops));
        }
        // p2p with a rank on another node: goes to the network as soon as it is in the rank's
        // leading group (the peer's daemon matches it by pair sequence number).
        if self.net.get().is_some() {
            for &a in &self.local {
                let q = &g.queues[a as usize];
                let remote = q
                    .iter()
                    .take_while(|p| p.op.kind.is_p2p())
                    .position(|p| !self.members[p.op.peer as usize].local);
                if let Some(i) = remote
                    && let Some(p) = g.queues[a as usize].remove(i)
                {
                    let refuse = match (&p.invalid, p.cuda.is_some()) {
                        (Some(why), _) => Some(format!("invalid op: {why}")),
                        (None, true) if !p.op.staged => Some(STAGED_MISSING.to_string()),
                        _ => None,
                    };
                    if let Some(why) = refuse {
                        let msg = format!("{}: {} on rank {a}: {why}", self.label(), p.describe());
                        return Some(Step::Fail {
                            ops: vec![(p, status::INVALID, msg)],
                            abort: None,
                        });
                    }
                    let mut p = p;
                    p.transport = crate::telemetry::transport::TCP;
                    return Some(Step::Net(net::Cmd::P2p(Box::new(p))));
                }
            }
        }
        // p2p: look for a send in some rank's leading group whose recv is in the peer's group.
        for &a in &self.local {
            let a = a as usize;
            for (i, s) in g.queues[a].iter().enumerate() {
                if !s.op.kind.is_p2p() {
                    break;
                }
                if s.op.kind != OpKind::Send {
                    continue;
                }
                let b = s.op.peer as usize;
                // A receive posted after a receive from any source waits until that one is
                // matched: it gets its sender's messages after the ones the earlier receive took.
                let named = g.queues[b]
                    .iter()
                    .take_while(|p| p.op.kind.is_p2p() && !p.op.any_source)
                    .position(|p| {
                        p.op.kind == OpKind::Recv
                            && !p.op.any_source
                            && p.op.peer as usize == a
                            && p.seq == s.seq
                    });
                let found = named.map(|j| (j, false)).or_else(|| {
                    // The first send to b in a's queue is a's next message to b.
                    let first = !g.queues[a]
                        .iter()
                        .take(i)
                        .any(|p| p.op.kind == OpKind::Send && p.op.peer as usize == b);
                    first
                        .then(|| any_source_taker(&g.queues[b], a))
                        .flatten()
                        .map(|j| (j, true))
                });
                if let Some((j, any)) = found {
                    let send = g.queues[a].remove(i)?;
                    // Removing from queue a shifted indices only if a == b (self send/recv).
                    let j = if a == b && j > i { j - 1 } else { j };
                    let mut recv = g.queues[b].remove(j)?;
                    if any {
                        take_any_source(g, &mut recv, crate::ranks::of(a), send.seq);
                    }
                    return Some(self.p2p_step(send, recv));
                }
            }
        }
        // Deadlock: every rank has a collective queued behind unmatched p2p ops (or at its head)
        // and nothing can match, now or after any further post.
        let closed = self
            .local
            .iter()
            .all(|&r| g.queues[r as usize].iter().any(|p| !p.op.kind.is_p2p()));
        if closed {
            let heads: Vec<String> = self
                .local
                .iter()
                .map(|&r| {
                    format!(
                        "rank {r}: {}",
                        g.queues[r as usize]
                            .front()
                            .map(|p| p.describe())
                            .unwrap_or_default()
                    )
                })
                .collect();
            let msg = format!(
                "{}: mismatched op order, no rank can progress: {}. Every rank must post its collectives in the same order, and each send needs the matching recv before the next collective.",
                self.label(),
                heads.join("; ")
            );
            let ops = drain(g)
                .into_iter()
                .map(|p| (p, status::MISMATCH, msg.clone()))
                .collect();
            return Some(Step::Fail {
                ops,
                abort: Some((
                    status::ABORTED,
                    format!("aborted after an earlier error: {msg}"),
                )),
            });
        }
        None
    }

    /// Marks the communicator broken for good with `st` and `msg` (logged), unless it already
    /// is (the first reason stays). Its ops fail later, by [`Comm::abort_rank`].
    pub fn set_broken(&self, st: u32, msg: String) {
        Self::break_with(&mut self.lock(), st, msg);
    }

    fn break_with(g: &mut Inner, st: u32, msg: String) {
        if g.broken.is_none() {
            tracing::info!(target: "commd::comm", "{msg}");
            g.broken = Some((st, msg));
        }
    }

    /// Why the communicator is broken for good (the status its ops fail with, the reason), if
    /// it is.
    pub fn broken(&self) -> Option<(u32, String)> {
        self.lock().broken.clone()
    }

    /// Fails every queued op and later posts with `st`; used for peer loss, destroy, shutdown.
    /// Returns true once every rank has left.
    pub fn abort_rank(&self, rank: Option<u32>, st: u32, msg: String) -> bool {
        if let Some(h) = self.net.get() {
            let _ = h.submit(net::Cmd::Abort(st, msg.clone()));
        }
        let mut g = self.lock();
        if let Some(r) = rank {
            g.left[r as usize] = true;
        }
        Self::break_with(&mut g, st, msg);
        let (st, msg) = g.broken.clone().unwrap_or((st, String::new()));
        let ops = drain(&mut g);
        let all_left = self.local.iter().all(|&r| g.left[r as usize]);
        drop(g);
        for p in ops {
            let c = p.op.comm;
            p.complete(c, st, Some(msg.clone()));
        }
        if (all_left || st == status::SHUTDOWN)
            && let Some(h) = self.net.get()
        {
            h.end();
        }
        all_left
    }

    /// A rank destroyed the communicator. What needed it fails with `msg`: its own queued ops,
    /// every queued and later collective (it will never post its part), and sends and receives
    /// with it. Sends and receives between the other ranks go on (a rank that finished its part
    /// of a pipeline may leave while its neighbours still exchange, as with NCCL). The other
    /// nodes are not told to abort; they see this node end once all its ranks have left.
    /// Returns true once every rank of this node has left.
    pub fn leave(&self, rank: u32, msg: String) -> bool {
        let mut g = self.lock();
        if let Some(l) = g.left.get_mut(rank as usize) {
            *l = true;
        }
        tracing::info!(target: "commd::comm", "{msg}");
        g.left_msg.entry(rank).or_insert(msg);
        let mut failed = Vec::new();
        for q in 0..g.queues.len() {
            let mut keep = VecDeque::new();
            while let Some(p) = g.queues[q].pop_front() {
                let m = if p.rank == rank {
                    g.left_msg.get(&rank).cloned()
                } else {
                    g.departed(&p)
                };
                match m {
                    Some(m) => failed.push((p, m)),
                    None => keep.push_back(p),
                }
            }
            g.queues[q] = keep;
        }
        let all_left = self.local.iter().all(|&r| g.left[r as usize]);
        drop(g);
        for (p, m) in failed {
            let c = p.op.comm;
            p.complete(c, status::PEER_LOST, Some(m));
        }
        if all_left && let Some(h) = self.net.get() {
            h.end();
        }
        all_left
    }

    /// If the oldest queued op is older than the op timeout, fails everything naming the ranks
    /// that never posted, and aborts the communicator, calling `on_abort` first (before any op
    /// completes, so that what it marks is seen by whoever a completion wakes). True when it
    /// aborted it.
    pub fn check_timeout(&self, now: Instant, on_abort: impl FnOnce()) {
        let mut g = self.lock();
        if g.broken.is_some() {
            return;
        }
        let oldest = g
            .queues
            .iter()
            .flat_map(|q| q.iter())
            .min_by_key(|p| p.posted_at);
        let Some(p) = oldest else { return };
        let waited = now.saturating_duration_since(p.posted_at);
        if waited < self.op_timeout {
            return;
        }
        let n = self.nranks as usize;
        let msg = if p.op.any_source {
            format!(
                "{}: {} on rank {} timed out after {:.1} s: no rank sent to it",
                self.label(),
                p.describe(),
                p.rank,
                waited.as_secs_f64()
            )
        } else if p.op.kind.is_p2p() {
            let (peer, what) = if p.op.kind == OpKind::Send {
                (p.op.peer, "recv")
            } else {
                (p.op.peer, "send")
            };
            let blocked = g.queues[peer as usize]
                .front()
                .map(|h| format!(" (its oldest pending op is {})", h.describe()))
                .unwrap_or_default();
            format!(
                "{}: {} on rank {} timed out after {:.1} s: rank {peer} never posted the matching {what}{blocked}",
                self.label(),
                p.describe(),
                p.rank,
                waited.as_secs_f64()
            )
        } else {
            let seq = p.seq;
            let missing: Vec<u32> = (0..n)
                .filter(|&r| self.members[r].local && g.coll_next[r] <= seq)
                .map(crate::ranks::of)
                .collect();
            let posted: Vec<u32> = (0..n)
                .filter(|&r| self.members[r].local && g.coll_next[r] > seq)
                .map(crate::ranks::of)
                .collect();
            let pids: Vec<String> = missing
                .iter()
                .map(|&r| {
                    let pid = self.members[r as usize].pid;
                    match g.queues[r as usize].front() {
                        Some(h) => format!("rank {r} pid {pid} is blocked in {}", h.describe()),
                        None => format!("rank {r} pid {pid}"),
                    }
                })
                .collect();
            format!(
                "{}: {} seq {seq} timed out after {:.1} s: {} never posted it ({}); posted by {}",
                self.label(),
                p.op.kind.name(),
                waited.as_secs_f64(),
                ranks(&missing),
                pids.join(", "),
                ranks(&posted)
            )
        };
        tracing::warn!(target: "commd::comm", "{msg}");
        g.broken = Some((
            status::ABORTED,
            format!("aborted after an op timed out: {msg}"),
        ));
        let ops = drain(&mut g);
        drop(g);
        on_abort();
        for p in ops {
            let c = p.op.comm;
            p.complete(c, status::TIMEOUT, Some(msg.clone()));
        }
    }

    /// What the communicator waits for, read-only (`commd status`, `/metrics`): per rank its
    /// posted collectives and queued ops, and the oldest queued op with the local ranks that have
    /// and have not posted it (the facts `check_timeout` reports once that op times out).
    pub fn waiting(&self, now: Instant) -> Waiting {
        let g = self.lock();
        let n = self.nranks as usize;
        let ranks = (0..n)
            .map(|r| RankWait {
                posted: g.coll_next[r],
                queued: g.queues[r].len(),
                oldest: g.queues[r].front().map(|p| p.describe()),
            })
            .collect();
        let oldest = g
            .queues
            .iter()
            .flat_map(|q| q.iter())
            .min_by_key(|p| p.posted_at)
            .map(|p| {
                let (posted, missing) = if p.op.kind.is_p2p() {
                    (vec![p.rank], vec![p.op.peer])
                } else {
                    let by = |f: &dyn Fn(u64) -> bool| {
                        (0..n)
                            .filter(|&r| self.members[r].local && f(g.coll_next[r]))
                            .map(crate::ranks::of)
                            .collect::<Vec<u32>>()
                    };
                    (by(&|c| c > p.seq), by(&|c| c <= p.seq))
                };
                Stuck {
                    op: p.op.kind.name(),
                    seq: p.seq,
                    p2p: p.op.kind.is_p2p(),
                    what: p.describe(),
                    rank: p.rank,
                    age: now.saturating_duration_since(p.posted_at),
                    posted,
                    missing,
                }
            });
        Waiting {
            queued: g.queues.iter().map(|q| q.len()).sum(),
            ranks,
            oldest,
            broken: g.broken.as_ref().map(|b| b.1.clone()),
        }
    }

    pub fn queued(&self) -> usize {
        self.lock().queues.iter().map(|q| q.len()).sum()
    }
}

/// Runs a host-memory plan and completes its ops.
fn run_plan(
    label: &str,
    plan: engine::Plan,
    ops: Vec<Posted>,
    workers: usize,
    span: tracing::Span,
) {
    let _entered = span.enter();
    let traffic = plan.traffic();
    let t0 = Instant::now();
    let res = engine::execute(plan, workers);
    report::op_executed(&span, &traffic, res.is_ok());
    tracing::trace!(target: "commd::engine", op = ops[0].op.kind.name(), seq = ops[0].seq, us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX), "executed");
    for p in ops {
        let c = p.op.comm;
        match &res {
            Ok(()) => p.complete(c, status::OK, None),
            Err(e) => p.complete(
                c,
                status::INTERNAL,
                Some(format!("{label}: {} failed: {e}", p.describe())),
            ),
        }
    }
}

/// A communicator's waits, from [`Comm::waiting`].
#[derive(Clone, Debug, Default)]
pub struct Waiting {
    /// Ops queued (posted, not yet matched or run), over all ranks.
    pub queued: usize,
    pub ranks: Vec<RankWait>,
    pub oldest: Option<Stuck>,
    /// Why the communicator is unusable, once it is.
    pub broken: Option<String>,
}

#[derive(Clone, Debug, Default)]
pub struct RankWait {
    /// Collectives this rank has posted so far.
    pub posted: u64,
    pub queued: usize,
    /// This rank's oldest queued op, described.
    pub oldest: Option<String>,
}

/// The oldest queued op of a communicator.
#[derive(Clone, Debug)]
pub struct Stuck {
    pub op: &'static str,
    pub seq: u64,
    pub p2p: bool,
    pub what: String,
    /// The rank that posted it first.
    pub rank: u32,
    pub age: Duration,
    /// Ranks that have posted it and ranks that have not (a send/recv: its peer).
    pub posted: Vec<u32>,
    pub missing: Vec<u32>,
}

/// Renders one field of an op for mismatch reports.
type FieldFn = dyn Fn(&Op) -> String;

/// Where in `q` (rank b's queue) a receive from any source may take rank `a`'s next message to
/// b: the first such receive of b's leading p2p group, unless a receive naming `a` comes before
/// it (that one is owed a's next message first, in b's program order).
fn any_source_taker(q: &VecDeque<Posted>, a: usize) -> Option<usize> {
    for (j, p) in q.iter().enumerate() {
        if !p.op.kind.is_p2p() {
            return None;
        }
        if p.op.kind != OpKind::Recv {
            continue;
        }
        if p.op.any_source {
            return Some(j);
        }
        if p.op.peer as usize == a {
            return None;
        }
    }
    None
}

/// Rank b's receive from any source `recv` takes rank `a`'s message number `seq` (a's next one
/// to b): it becomes a receive from `a` with that number, and b's later receives naming `a`,
/// which were numbered when posted, move to the message after it.
fn take_any_source(g: &mut Inner, recv: &mut Posted, a: u32, seq: u64) {
    let b = recv.rank;
    recv.op.peer = a;
    recv.seq = seq;
    for p in g.queues[b as usize].iter_mut() {
        if p.op.kind == OpKind::Recv && !p.op.any_source && p.op.peer == a && p.seq >= seq {
            p.seq += 1;
        }
    }
    *g.recv_next.entry((a, b)).or_insert(0) += 1;
}

fn next(m: &mut HashMap<(u32, u32), u64>, k: (u32, u32)) -> u64 {
    let e = m.entry(k).or_insert(0);
    let s = *e;
    *e += 1;
    s
}

fn drain(g: &mut Inner) -> Vec<Posted> {
    g.queues.iter_mut().flat_map(|q| q.drain(..)).collect()
}

use crate::ranks::text as ranks;
