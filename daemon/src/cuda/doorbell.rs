//! The daemon's side of the doorbell words (docs/contracts.md #4 and #5): a rank's `Bell`
//! (ready seen?), done counters published contiguously per slot (a p2p group completes out of
//! ticket order), and failures that release every phase.
//!
//! The session a doorbell lives in is seen through [`Client`] (implemented by
//! `session::Session`), so this layer never names the daemon-state types above it.
//!
//! May use: `commd_proto` (the ring and its words).

use super::*;

use commd_proto::ring::Ring;

/// A job's phase index (or phase count) in the doorbell's `u32` ticket arithmetic, which
/// counts modulo 2^32 (`wrapping_add` of tickets): `p` modulo 2^32 is that exact value.
#[allow(clippy::cast_possible_truncation)]
pub(crate) fn phase_word(p: usize) -> u32 {
    p as u32
}

/// What the GPU executor needs of a client's session: its id and pid (for messages), the ring
/// holding its doorbell words, whether it is gone, and where a captured op's failure is kept
/// for the client to read.
pub trait Client: Send + Sync {
    fn id(&self) -> u64;
    fn pid(&self) -> i32;
    fn ring(&self) -> &Ring;
    fn is_closed(&self) -> bool;
    fn set_graph_error(&self, slot: u32, st: u32, msg: &str);
}

/// An op the executor completes (`comm::Posted`): with a status and message, or, for a
/// captured op that must not poison the slot it names, reported to its client only.
pub trait Done: Send {
    fn complete(self: Box<Self>, st: u32, msg: Option<String>);
    fn report(self: Box<Self>, st: u32, msg: Option<String>);
}

/// A rank's doorbell: its session, slot, and the op's first ticket. For a persistent op
/// (`graph`), the slot is a graph doorbell and the ticket 1 (`commd_proto::graph`).
#[derive(Clone)]
pub struct Bell {
    pub session: Arc<dyn Client>,
    pub rank: u32,
    pub slot: u32,
    pub ticket: u32,
    pub graph: bool,
    /// The communicator's doorbell slot in the session (hints, for a persistent op's failure).
    pub comm_slot: u32,
}

impl Bell {
    fn words(&self) -> Option<(&AtomicU32, &AtomicU32, &AtomicU32)> {
        if self.graph {
            self.session.ring().graph_doorbell(self.slot)
        } else {
            self.session.ring().doorbell(self.slot)
        }
    }

    /// A persistent op's words for the replay protocol (`None` for eager ops).
    pub fn graph_words(&self) -> Option<commd_proto::graph::Words<'_>> {
        if !self.graph {
            return None;
        }
        let (ready, done, error) = self.session.ring().graph_doorbell(self.slot)?;
        Some(commd_proto::graph::Words { ready, done, error })
    }

    /// Whether the rank's stream has reached phase `phase` of the op (its ready counter).
    pub fn ready(&self, phase: u32) -> bool {
        match self.words() {
            Some((ready, _, _)) => {
                let want = self.ticket.wrapping_add(phase);
                ready
                    .load(Ordering::Acquire)
                    .wrapping_sub(want)
                    .cast_signed()
                    >= 0
            }
            None => false,
        }
    }

    pub fn ready_value(&self) -> u32 {
        self.words()
            .map(|(r, _, _)| r.load(Ordering::Acquire))
            .unwrap_or(0)
    }
}

/// The ranks of `bells` whose streams have not reached phase `phase`, with their counters, for
/// a timeout message.
pub fn late_streams(bells: &[Bell], phase: u32) -> Vec<String> {
    bells
        .iter()
        .filter(|b| !b.ready(phase))
        .map(|b| {
            format!(
                "rank {} (pid {}: its stream signalled {}, the op needs {})",
                b.rank,
                b.session.pid(),
                b.ready_value(),
                b.ticket.wrapping_add(phase)
            )
        })
        .collect()
}

/// Done counters advance contiguously: a p2p group's ops may match in another order than the
/// client posted them (their tickets), and the client's stream waits once for the group's last
/// ticket, so ticket `t` is published only once every ticket before it is done. One tracker for
/// the daemon: a group's ops can finish on the GPU executor (within the node) and on a net
/// thread (host-staged, across nodes).
#[derive(Default)]
struct Slots {
    pending: HashMap<(u64, u32), Vec<u32>>,
}

static SLOTS: OnceLock<Mutex<Slots>> = OnceLock::new();

/// Publishes ticket `t` of `b`'s doorbell as done once every earlier ticket is (see `Slots`).
pub fn signal_done(b: &Bell, t: u32) {
    SLOTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .signal(b, t);
}

impl Slots {
    fn signal(&mut self, b: &Bell, t: u32) {
        let Some((_, done, _)) = b.session.ring().doorbell(b.slot) else {
            return;
        };
        let key = (b.session.id(), b.slot);
        let mut cur = done.load(Ordering::Acquire);
        if t.wrapping_sub(cur).cast_signed() <= 0 {
            return; // already released (a failure advanced past it)
        }
        let pending = self.pending.entry(key).or_default();
        pending.push(t);
        while let Some(i) = pending.iter().position(|&x| x == cur.wrapping_add(1)) {
            pending.swap_remove(i);
            cur = cur.wrapping_add(1);
        }
        pending.retain(|&x| x.wrapping_sub(cur).cast_signed() > 0);
        if pending.is_empty() {
            self.pending.remove(&key);
        }
        advance_done(&*b.session, b.slot, cur);
    }
}

/// Raises a doorbell slot's done counter to `value` (never lowers it, wrap-aware).
pub fn advance_done(s: &dyn Client, slot: u32, value: u32) {
    if let Some((_, done, _)) = s.ring().doorbell(slot) {
        let _ = done.fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
            (value.wrapping_sub(d).cast_signed() > 0).then_some(value)
        });
    }
}

/// Fails a CUDA op's doorbell: sets the error word (first error wins) and releases every phase
/// so the client's stream never hangs (docs/contracts.md #5).
pub fn fail_doorbell(s: &dyn Client, slot: u32, last_ticket: u32, st: u32) {
    if let Some((_, _, err)) = s.ring().doorbell(slot) {
        let _ = err.compare_exchange(0, st.max(1), Ordering::AcqRel, Ordering::Acquire);
    }
    advance_done(s, slot, last_ticket);
}
