//! Persistent GPU ops: ops captured into CUDA graphs (docs/contracts.md #6), as the executor
//! (`commd-gpu`, `cuda/executor.rs`) holds them between replays.
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
//! Uses: the executor's bells and jobs, their clients (`Client`: errors), `commd_proto`. Owned by the executor thread
//! alone: no locks.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use commd_proto::desc::{doorbell, status};

use super::{Bell, GpuJob, late_streams};

/// Registry key for ops poisoned at capture, which belong to no matched job.
const ORPHANS: u64 = u64::MAX;

struct Persist {
    label: String,
    /// The next op of the same graph (capture order, the first again after the last): the op
    /// most likely to fire once this one ran.
    next: Option<u64>,
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
    if let Some(h) = b.session.ring().doorbell_hint(b.comm_slot) {
        h.fetch_or(doorbell::HINT_GRAPH_FAILED, Ordering::AcqRel);
    }
    b.session.set_graph_error(b.slot, st, msg);
}

/// Above this many ops on a communicator, [`Registry::poll`] looks at the likely next ops on
/// every call and at all of them every [`FULL_SCAN`] (a vLLM server captures thousands: one
/// graph per batch size, a few ops per layer).
const SCAN_ALL_BELOW: usize = 64;
const FULL_SCAN: Duration = Duration::from_micros(200);

/// One op's turn in [`Registry::poll`]: (moved, a session was lost, the job to start).
fn check(p: &mut Persist, may_start: bool) -> (bool, bool, Option<GpuJob>) {
    if let Some((st, msg)) = &p.poisoned {
        let mut moved = false;
        for (i, b) in p.bells.iter().enumerate() {
            if !p.released[i] && b.graph_words().is_some_and(|w| w.fired()) {
                fail_bell(b, p.phases, *st, msg);
                moved = true;
            }
        }
        return (moved, p.bells.iter().any(|b| b.session.is_closed()), None);
    }
    if p.job.is_none() {
        return (false, false, None); // its replay is running
    }
    if !p.bells.iter().any(|b| b.ready(0)) {
        p.partial_since = None;
        return (false, false, None);
    }
    if let Some(b) = p.bells.iter().find(|b| b.session.is_closed()) {
        let msg = format!(
            "{}: rank {} (pid {}) was lost; this captured op cannot run again",
            p.label,
            b.rank,
            b.session.pid()
        );
        p.poison(status::PEER_LOST, msg, true);
        return (true, true, None);
    }
    if p.bells.iter().all(|b| b.ready(0)) {
        if may_start {
            p.partial_since = None;
            let j = p.job.take();
            return (j.is_some(), false, j);
        }
        return (false, false, None);
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
        return (true, false, None);
    }
    (false, false, None)
}

/// The executor's persistent ops, by communicator id and registration order.
pub struct Registry {
    by_comm: HashMap<u64, BTreeMap<u64, Persist>>,
    /// (session id, graph doorbell slot) -> (communicator id, op id).
    slots: HashMap<(u64, u32), (u64, u64)>,
    next: u64,
    /// (communicator id, capture tag) -> (first op, last op) of that graph.
    chains: HashMap<(u64, u32), (u64, u64)>,
    /// Per communicator: ops expected to fire next (successors of the ops that ran), and when
    /// every op was last looked at.
    expect: HashMap<u64, (Vec<u64>, Option<Instant>)>,
    full_every: Duration,
}

impl Default for Registry {
    fn default() -> Self {
        Self {
            by_comm: HashMap::new(),
            slots: HashMap::new(),
            next: 0,
            chains: HashMap::new(),
            expect: HashMap::new(),
            full_every: FULL_SCAN,
        }
    }
}

impl Registry {
    pub fn is_empty(&self) -> bool {
        self.by_comm.is_empty()
    }

    /// Communicators with persistent ops.
    pub fn comms(&self) -> Vec<u64> {
        self.by_comm.keys().copied().collect()
    }

    fn insert(&mut self, comm: u64, tag: u32, mut p: Persist) {
        self.next += 1;
        let id = self.next;
        for b in &p.bells {
            self.slots.insert((b.session.id(), b.slot), (comm, id));
        }
        let ops = self.by_comm.entry(comm).or_default();
        // Chain the graph's ops in capture order, the last one back to the first.
        match self.chains.get_mut(&(comm, tag)) {
            Some((head, tail)) if tag != 0 => {
                if let Some(t) = ops.get_mut(tail) {
                    t.next = Some(id);
                }
                p.next = Some(*head);
                *tail = id;
            }
            _ => {
                p.next = Some(id);
                if tag != 0 {
                    self.chains.insert((comm, tag), (id, id));
                }
            }
        }
        ops.insert(id, p);
    }

    /// Registers a matched persistent op and completes its posts (the clients' captures).
    pub fn register(&mut self, mut job: GpuJob) {
        if let Some(b) = job
            .bells
            .iter()
            .find(|b| self.slots.contains_key(&(b.session.id(), b.slot)))
        {
            let msg = format!(
                "{}: rank {} names graph doorbell slot {}, which a live captured op already holds (client error)",
                job.label, b.rank, b.slot
            );
            tracing::warn!(target: "commd::cuda", "{msg}");
            // Completing with an error would poison the held slot's op: report without that.
            for p in job.ops.drain(..) {
                p.report(status::INVALID, Some(msg.clone()));
            }
            return;
        }
        for p in job.ops.drain(..) {
            p.complete(status::OK, None);
        }
        let n = job.bells.len();
        self.insert(
            job.comm_id,
            job.graph_tag,
            Persist {
                next: None,
                label: job.label.clone(),
                bells: job.bells.clone(),
                phases: super::doorbell::phase_word(job.phases.len()),
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
            if self.slots.contains_key(&(b.session.id(), b.slot)) {
                tracing::warn!(target: "commd::cuda", "graph doorbell slot {} of session {} is held by a live captured op; not poisoned again ({msg})", b.slot, b.session.id());
                continue;
            }
            self.insert(
                ORPHANS,
                0,
                Persist {
                    next: None,
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
                .position(|b| b.session.id() == session && b.slot == slot)
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
                            slots.remove(&(b.session.id(), b.slot));
                        }
                    }
                }
                keep
            });
        }
        self.by_comm.retain(|_, m| !m.is_empty());
        let by_comm = &self.by_comm;
        self.chains
            .retain(|(c, _), (head, _)| by_comm.get(c).is_some_and(|m| m.contains_key(head)));
        self.expect.retain(|c, _| by_comm.contains_key(c));
    }

    /// Looks at communicator `comm`'s persistent ops: releases firings of poisoned ones, fails
    /// replays that a rank cannot join, and returns (if `may_start`) one op whose every rank
    /// fired a replay, with its job to run. Returns whether anything moved. Small registries are
    /// scanned whole on every call; large ones look at the ops expected next (the successors
    /// in their graphs of the ops that ran) on every call and at all ops every 200 us.
    pub fn poll(&mut self, comm: u64, may_start: bool) -> (bool, Option<(u64, GpuJob)>) {
        let Some(ops) = self.by_comm.get_mut(&comm) else {
            return (false, None);
        };
        let (expect, full_at) = self.expect.entry(comm).or_default();
        let full =
            ops.len() < SCAN_ALL_BELOW || full_at.is_none_or(|t| t.elapsed() >= self.full_every);
        let ids: Vec<u64> = if full {
            *full_at = Some(Instant::now());
            ops.keys().copied().collect()
        } else {
            expect.clone()
        };
        let mut moved = false;
        let mut start = None;
        let mut lost_any = false;
        for id in ids {
            let Some(p) = ops.get_mut(&id) else { continue };
            let (m, lost, s) = check(p, may_start && start.is_none());
            moved |= m;
            lost_any |= lost;
            if let Some(j) = s {
                // Once it ran, its graph's next op is the one to watch.
                *expect = p.next.into_iter().collect();
                start = Some((id, j));
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

#[cfg(test)]
mod tests {
    //! The registry's bookkeeping against real session rings (no GPU: the jobs have no copies,
    //! the clients' streams are simulated by writing the graph doorbells).
    use super::*;
    use crate::cuda::Phase;
    use crate::session::Session;
    use commd_proto::ring::RingLayout;
    use std::sync::Arc;

    const COMM: u64 = 7;
    const COMM_SLOT: u32 = 3;

    fn session(id: u64) -> Arc<Session> {
        let layout = RingLayout::new(8, 8).unwrap();
        Arc::new(
            Session::new(
                id,
                0,
                i32::try_from(100 + id).unwrap(),
                "t".into(),
                [0; 16],
                layout,
            )
            .unwrap(),
        )
    }

    fn job(sessions: &[Arc<Session>], slots: &[u32], phases: usize, timeout: Duration) -> GpuJob {
        GpuJob {
            span: tracing::Span::none(),
            comm_id: COMM,
            label: "comm 7: all_reduce seq 1".into(),
            bells: sessions
                .iter()
                .zip(slots)
                .enumerate()
                .map(|(r, (s, &slot))| Bell {
                    session: s.clone(),
                    rank: u32::try_from(r).unwrap(),
                    slot,
                    ticket: 1,
                    graph: true,
                    comm_slot: COMM_SLOT,
                })
                .collect(),
            phases: (0..phases).map(|_| Phase::default()).collect(),
            ops: Vec::new(),
            timeout,
            pacer: Arc::new(crate::pacing::Pacer::new(None)),
            persistent: true,
            graph_tag: 1,
            scratch: Vec::new(),
        }
    }

    fn words(s: &Session, slot: u32) -> (u32, u32, u32) {
        let (r, d, e) = s.ring.graph_doorbell(slot).unwrap();
        (
            r.load(Ordering::Acquire),
            d.load(Ordering::Acquire),
            e.load(Ordering::Acquire),
        )
    }

    fn fire(s: &Session, slot: u32) {
        s.ring
            .graph_doorbell(slot)
            .unwrap()
            .0
            .store(1, Ordering::Release);
    }

    fn hint(s: &Session) -> u32 {
        s.ring
            .doorbell_hint(COMM_SLOT)
            .unwrap()
            .load(Ordering::Acquire)
    }

    #[test]
    fn a_replay_starts_once_every_rank_fired_and_rearms() {
        let ss = [session(1), session(2)];
        let mut reg = Registry::default();
        reg.register(job(&ss, &[5, 9], 2, Duration::from_secs(60)));
        assert_eq!(reg.comms(), vec![COMM]);
        assert!(reg.poll(COMM, true).1.is_none(), "nothing fired");
        fire(&ss[0], 5);
        assert!(reg.poll(COMM, true).1.is_none(), "one rank of two fired");
        fire(&ss[1], 9);
        assert!(reg.poll(COMM, false).1.is_none(), "an eager job is running");
        let (id, j) = reg.poll(COMM, true).1.expect("every rank fired");
        assert!(
            reg.poll(COMM, true).1.is_none(),
            "a running replay is not handed out twice"
        );
        // The executor runs the phases (as `phase_done` does), then hands the job back.
        for p in 0..2 {
            for b in &j.bells {
                b.graph_words().unwrap().phase_done(p, p == 1);
            }
        }
        assert_eq!(words(&ss[0], 5), (0, 2, 0), "ready cleared, done = phases");
        reg.finished(COMM, id, j, None);
        assert!(
            reg.poll(COMM, true).1.is_none(),
            "re-armed, waiting for the next replay"
        );
        fire(&ss[0], 5);
        fire(&ss[1], 9);
        assert!(reg.poll(COMM, true).1.is_some(), "the next replay runs");
    }

    #[test]
    fn a_rank_that_does_not_fire_in_time_fails_the_op_for_good() {
        let ss = [session(1), session(2)];
        let mut reg = Registry::default();
        reg.register(job(&ss, &[0, 0], 3, Duration::from_millis(20)));
        fire(&ss[0], 0);
        assert!(reg.poll(COMM, true).1.is_none());
        std::thread::sleep(Duration::from_millis(40));
        assert!(reg.poll(COMM, true).1.is_none());
        assert_eq!(
            words(&ss[0], 0),
            (0, 3, status::TIMEOUT),
            "the fired rank is released"
        );
        assert_ne!(hint(&ss[0]) & doorbell::HINT_GRAPH_FAILED, 0);
        let (st, msg) = ss[0].take_graph_error(0).unwrap();
        assert_eq!(st, status::TIMEOUT);
        assert!(msg.contains("rank 1") && msg.contains("timed out"), "{msg}");
        // The late rank fires later: released at once, never paired with a later replay.
        fire(&ss[1], 0);
        assert!(reg.poll(COMM, true).1.is_none());
        assert_eq!(words(&ss[1], 0), (0, 3, status::TIMEOUT));
        fire(&ss[0], 0);
        fire(&ss[1], 0);
        assert!(
            reg.poll(COMM, true).1.is_none(),
            "a poisoned op never runs again"
        );
        assert_eq!(words(&ss[0], 0).0, 0);
    }

    #[test]
    fn a_lost_rank_releases_its_peers() {
        let ss = [session(1), session(2)];
        let mut reg = Registry::default();
        reg.register(job(&ss, &[4, 4], 1, Duration::from_secs(60)));
        ss[1].mark_closed(status::PEER_LOST);
        fire(&ss[0], 4);
        assert!(reg.poll(COMM, true).1.is_none());
        assert_eq!(words(&ss[0], 4), (0, 1, status::PEER_LOST));
        let (_, msg) = ss[0].take_graph_error(4).unwrap();
        assert!(msg.contains("rank 1") && msg.contains("lost"), "{msg}");
        // The survivor destroys its graph: nothing is left.
        assert!(reg.release(1, &[4]).is_empty());
        assert!(reg.is_empty());
    }

    #[test]
    fn release_drops_the_op_and_answers_unknown_slots() {
        let ss = [session(1), session(2)];
        let mut reg = Registry::default();
        // A slot released before its op is registered (the peer has not posted its capture).
        assert_eq!(reg.release(1, &[2, 8]), vec![2, 8]);
        reg.register(job(&ss, &[2, 6], 1, Duration::from_secs(60)));
        assert_eq!(reg.release(1, &[2, 8]), vec![8]);
        // Rank 1 still replays: released with an error naming rank 0.
        fire(&ss[1], 6);
        assert!(reg.poll(COMM, true).1.is_none());
        assert_eq!(words(&ss[1], 6).2, status::PEER_LOST);
        let (_, msg) = ss[1].take_graph_error(6).unwrap();
        assert!(msg.contains("rank 0 destroyed"), "{msg}");
        assert!(!reg.is_empty());
        // The slot rank 0 released is free again: a new op there registers.
        reg.register(job(&ss, &[2, 7], 1, Duration::from_secs(60)));
        assert!(reg.release(2, &[6]).is_empty());
        assert_eq!(
            reg.by_comm[&COMM].len(),
            1,
            "the first op is gone once both released"
        );
    }

    #[test]
    fn a_slot_held_by_a_live_op_is_not_registered_twice() {
        let ss = [session(1), session(2)];
        let mut reg = Registry::default();
        reg.register(job(&ss, &[1, 1], 1, Duration::from_secs(60)));
        reg.register(job(&ss, &[1, 2], 1, Duration::from_secs(60)));
        assert_eq!(reg.by_comm[&COMM].len(), 1);
        // And an op poisoned at registration does not take over a live op's slot.
        reg.poison_new(
            vec![job(&ss, &[1], 1, Duration::ZERO).bells.remove(0)],
            1,
            status::MISMATCH,
            "x".into(),
        );
        fire(&ss[0], 1);
        fire(&ss[1], 1);
        assert!(reg.poll(COMM, true).1.is_some(), "the live op still runs");
    }

    #[test]
    fn a_large_registry_watches_each_graphs_next_op_first() {
        let ss = [session(1)];
        let mut reg = Registry {
            full_every: Duration::from_secs(3600),
            ..Default::default()
        };
        // Graph B (tag 2) first, so a full scan would find B's ops before A's.
        for (tag, base) in [(2, 0), (1, 100)] {
            for k in 0..50 {
                let mut j = job(&ss, &[base + k], 1, Duration::from_secs(60));
                j.graph_tag = tag;
                reg.register(j);
            }
        }
        let run = |reg: &mut Registry, want_slot: u32| {
            let (id, j) = reg.poll(COMM, true).1.expect("an op fired");
            assert_eq!(j.bells[0].slot, want_slot);
            j.bells[0].graph_words().unwrap().phase_done(0, true);
            reg.finished(COMM, id, j, None);
        };
        fire(&ss[0], 100);
        run(&mut reg, 100); // the first poll scans everything
        // A's next op and B's first op fire together: A's comes first (it is expected) ...
        fire(&ss[0], 101);
        fire(&ss[0], 0);
        run(&mut reg, 101);
        // ... and B's, not expected, waits for the next full scan.
        assert!(reg.poll(COMM, true).1.is_none());
        reg.full_every = Duration::ZERO;
        run(&mut reg, 0);
        // After A's last op, A's first is expected again (a graph replayed in a loop).
        reg.full_every = Duration::from_secs(3600);
        fire(&ss[0], 149);
        reg.full_every = Duration::ZERO;
        run(&mut reg, 149);
        reg.full_every = Duration::from_secs(3600);
        fire(&ss[0], 100);
        run(&mut reg, 100);
    }

    #[test]
    fn an_op_poisoned_at_registration_releases_every_replay() {
        let ss = [session(1)];
        let mut reg = Registry::default();
        let b = job(&ss, &[3], 2, Duration::ZERO).bells.remove(0);
        reg.poison_new(
            vec![b],
            2,
            status::MISMATCH,
            "mismatched collective: count".into(),
        );
        for _ in 0..3 {
            fire(&ss[0], 3);
            for c in reg.comms() {
                assert!(reg.poll(c, true).1.is_none());
            }
            assert_eq!(words(&ss[0], 3), (0, 2, status::MISMATCH));
        }
        assert!(ss[0].take_graph_error(3).unwrap().1.contains("count"));
        assert!(reg.release(1, &[3]).is_empty());
        assert!(reg.is_empty());
    }
}
