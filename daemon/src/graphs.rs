//! Persistent GPU ops: ops captured into CUDA graphs (DESIGN.md contract 6), as the executor
//! (`commd-gpu`, `cuda.rs`) holds them between replays.
//!
//! A captured op is matched across ranks once, when the clients post it during capture, and
//! registered here with its planned phases (which hold its buffers and scratch). The executor
//! then polls each op's graph doorbells: when every rank's stream fired a replay (wrote
//! `ready = 1`), [`Registry::poll`] hands the job out to run like an eager job, and
//! [`Registry::finished`] takes it back. Replay values follow `commd_proto::graph`.
//!
//! An op that fails once (a rank lost, ranks that fire one replay but not the other within the
//! communicator's op timeout, a failed copy, a mismatch at capture, a peer's graph destroyed)
//! is *poisoned*: its job is dropped and every later replay on every rank is released at once
//! with the error words set. A failed op never runs again, so a late rank can never be paired
//! with another replay of its peers.
//!
//! Uses: `cuda` (bells, jobs), `session` (errors), `commd_proto`. Owned by the executor thread
//! alone: no locks.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use commd_proto::desc::{doorbell, status};

use crate::cuda::{Bell, GpuJob, late_streams};

/// Registry key for ops poisoned at capture, which belong to no matched job.
const ORPHANS: u64 = u64::MAX;

struct Persist {
    label: String,
    bells: Vec<Bell>,
    phases: u32,
    /// The planned job; `None` while a replay runs (the executor holds it) or once poisoned.
    job: Option<GpuJob>,
    poisoned: Option<(u32, String)>,
    /// Per bell: the rank's graph was destroyed (its slot may be reused).
    released: Vec<bool>,
    /// When the first rank of a replay that not every rank has fired yet fired.
    partial_since: Option<Instant>,
    timeout: Duration,
}

impl Persist {
    fn gone(&self, i: usize) -> bool {
        self.released[i] || self.bells[i].session.is_closed()
    }

    /// Fails the op for good and releases the ranks that fired (`loud`: log a warning; a graph
    /// destroyed on one rank before the others is the normal end of a job, logged at debug).
    fn poison(&mut self, st: u32, msg: String, loud: bool) {
        if loud {
            tracing::warn!(target: "commd::cuda", "{msg}");
        } else {
            tracing::debug!(target: "commd::cuda", "{msg}");
        }
        self.job = None;
        for (i, b) in self.bells.iter().enumerate() {
            if !self.released[i] && b.graph_words().is_some_and(|w| w.fired()) {
                fail_bell(b, self.phases, st, &msg);
            }
        }
        self.poisoned = Some((st, msg));
    }
}

/// Releases one rank's replay of a persistent op that failed: error words set (the graph
/// doorbell's, and the communicator's hint bit so the client's next call on it looks), the
/// message kept for `GetGraphOpError`, every phase released.
pub fn fail_bell(b: &Bell, phases: u32, st: u32, msg: &str) {
    if let Some(w) = b.graph_words() {
        w.fail(phases, st);
    }
    if let Some(h) = b.session.ring.doorbell_hint(b.comm_slot) {
        h.fetch_or(doorbell::HINT_GRAPH_FAILED, Ordering::AcqRel);
    }
    b.session.set_graph_error(b.slot, st, msg);
}

/// The executor's persistent ops, by communicator id and registration order.
#[derive(Default)]
pub struct Registry {
    by_comm: HashMap<u64, BTreeMap<u64, Persist>>,
    /// (session id, graph doorbell slot) -> (communicator id, op id).
    slots: HashMap<(u64, u32), (u64, u64)>,
    next: u64,
}

impl Registry {
    pub fn is_empty(&self) -> bool {
        self.by_comm.is_empty()
    }

    /// Communicators with persistent ops.
    pub fn comms(&self) -> Vec<u64> {
        self.by_comm.keys().copied().collect()
    }

    fn insert(&mut self, comm: u64, p: Persist) {
        self.next += 1;
        for b in &p.bells {
            self.slots.insert((b.session.id, b.slot), (comm, self.next));
        }
        self.by_comm.entry(comm).or_default().insert(self.next, p);
    }

    /// Registers a matched persistent op and completes its posts (the clients' captures).
    pub fn register(&mut self, mut job: GpuJob) {
        if let Some(b) = job
            .bells
            .iter()
            .find(|b| self.slots.contains_key(&(b.session.id, b.slot)))
        {
            let msg = format!(
                "{}: rank {} names graph doorbell slot {}, which a live captured op already holds (client error)",
                job.label, b.rank, b.slot
            );
            tracing::warn!(target: "commd::cuda", "{msg}");
            // Completing with an error would poison the held slot's op: report without that.
            for p in job.ops.drain(..) {
                p.session
                    .complete(p.op.user_data, p.op.comm, p.seq, status::INVALID, Some(msg.clone()));
            }
            return;
        }
        for p in job.ops.drain(..) {
            let c = p.op.comm;
            p.complete(c, status::OK, None);
        }
        let n = job.bells.len();
        self.insert(
            job.comm_id,
            Persist {
                label: job.label.clone(),
                bells: job.bells.clone(),
                phases: job.phases.len() as u32,
                timeout: job.timeout,
                job: Some(job),
                poisoned: None,
                released: vec![false; n],
                partial_since: None,
            },
        );
    }

    /// A captured op that failed at registration: every replay fails with `st` and `msg`.
    pub fn poison_new(&mut self, bells: Vec<Bell>, phases: u32, st: u32, msg: String) {
        for b in bells {
            if self.slots.contains_key(&(b.session.id, b.slot)) {
                tracing::warn!(target: "commd::cuda", "graph doorbell slot {} of session {} is held by a live captured op; not poisoned again ({msg})", b.slot, b.session.id);
                continue;
            }
            self.insert(
                ORPHANS,
                Persist {
                    label: msg.clone(),
                    bells: vec![b],
                    phases,
                    job: None,
                    poisoned: Some((st, msg.clone())),
                    released: vec![false],
                    partial_since: None,
                    timeout: Duration::MAX,
                },
            );
        }
    }

    /// Session `session` destroyed the graphs holding the ops in `slots`: drops their jobs (the
    /// buffers and scratch they hold); a peer that still replays such an op gets an error.
    /// Returns the slots it holds no op for (yet): a capture is registered once every rank
    /// posted it, which may come after one rank already destroyed its graph; the client keeps
    /// such a slot out of use and asks again, so a slot is never reused while an op for it may
    /// still be registered.
    pub fn release(&mut self, session: u64, slots: &[u32]) -> Vec<u32> {
        let mut unknown = Vec::new();
        for &slot in slots {
            let Some((comm, id)) = self.slots.remove(&(session, slot)) else {
                unknown.push(slot);
                continue;
            };
            let Some(p) = self.by_comm.get_mut(&comm).and_then(|m| m.get_mut(&id)) else {
                continue;
            };
            let Some(i) = p
                .bells
                .iter()
                .position(|b| b.session.id == session && b.slot == slot)
            else {
                continue;
            };
            p.released[i] = true;
            if p.poisoned.is_none() && (0..p.bells.len()).any(|j| !p.gone(j)) {
                let msg = format!(
                    "{}: rank {} destroyed the CUDA graph holding this captured op; replays of it on other ranks cannot run",
                    p.label, p.bells[i].rank
                );
                p.poison(status::PEER_LOST, msg, false);
            }
            p.job = None;
        }
        self.sweep();
        unknown
    }

    /// Drops ops no rank can replay any more (every rank released it or its session closed).
    fn sweep(&mut self) {
        let slots = &mut self.slots;
        for m in self.by_comm.values_mut() {
            m.retain(|_, p| {
                let keep = (0..p.bells.len()).any(|i| !p.gone(i));
                if !keep {
                    for (i, b) in p.bells.iter().enumerate() {
                        if !p.released[i] {
                            slots.remove(&(b.session.id, b.slot));
                        }
                    }
                }
                keep
            });
        }
        self.by_comm.retain(|_, m| !m.is_empty());
    }

    /// Looks at communicator `comm`'s persistent ops: releases firings of poisoned ones, fails
    /// replays that a rank cannot join, and returns (if `may_start`) one op whose every rank
    /// fired a replay, with its job to run. Returns whether anything moved.
    pub fn poll(&mut self, comm: u64, may_start: bool) -> (bool, Option<(u64, GpuJob)>) {
        let Some(ops) = self.by_comm.get_mut(&comm) else {
            return (false, None);
        };
        let mut moved = false;
        let mut start = None;
        let mut lost_any = false;
        for (id, p) in ops.iter_mut() {
            if let Some((st, msg)) = &p.poisoned {
                for (i, b) in p.bells.iter().enumerate() {
                    if !p.released[i] && b.graph_words().is_some_and(|w| w.fired()) {
                        fail_bell(b, p.phases, *st, msg);
                        moved = true;
                    }
                }
                lost_any |= (0..p.bells.len()).any(|i| p.bells[i].session.is_closed());
                continue;
            }
            if p.job.is_none() {
                continue; // its replay is running
            }
            if !p.bells.iter().any(|b| b.ready(0)) {
                p.partial_since = None;
                continue;
            }
            if let Some(b) = p.bells.iter().find(|b| b.session.is_closed()) {
                let msg = format!(
                    "{}: rank {} (pid {}) was lost; this captured op cannot run again",
                    p.label, b.rank, b.session.pid
                );
                p.poison(status::PEER_LOST, msg, true);
                moved = true;
                lost_any = true;
                continue;
            }
            if p.bells.iter().all(|b| b.ready(0)) {
                if may_start && start.is_none() {
                    p.partial_since = None;
                    start = p.job.take().map(|j| (*id, j));
                    moved = true;
                }
                continue;
            }
            let since = *p.partial_since.get_or_insert_with(Instant::now);
            if since.elapsed() > p.timeout {
                let msg = format!(
                    "{}: a replay of this captured op timed out after {:.1} s waiting for {}; the op is failed for good (a rank that captured a different sequence of ops, or stopped replaying its graph?)",
                    p.label,
                    since.elapsed().as_secs_f64(),
                    late_streams(&p.bells, 0).join(", ")
                );
                p.poison(status::TIMEOUT, msg, true);
                moved = true;
            }
        }
        if lost_any {
            self.sweep();
        }
        (moved, start)
    }

    /// A replay handed out by [`Registry::poll`] ended; `failure` poisons the op.
    pub fn finished(&mut self, comm: u64, id: u64, job: GpuJob, failure: Option<(u32, String)>) {
        let Some(p) = self.by_comm.get_mut(&comm).and_then(|m| m.get_mut(&id)) else {
            return;
        };
        match failure {
            Some((st, msg)) => {
                // The bells were released by the executor's `finish`.
                p.job = None;
                if p.poisoned.is_none() {
                    p.poisoned = Some((st, msg));
                }
            }
            None if p.poisoned.is_none() => p.job = Some(job),
            None => {}
        }
    }
}
