//! A model of the direct send/recv protocol (docs/design-gpu.md, send/recv rules), run under
//! random interleavings of the ranks; the GPU code follows it.
//!
//! One channel per ordered pair (s -> d), in memory of the receiver d: two data slots, two
//! flags (word 0: sequence | signature, word 1: count), and in the *sender's* inbox from d the
//! ack word d writes after it has read a sequence. Sequences are counted per direction on the
//! host, from 1. A send of sequence q (parity q & 1) waits until the ack is at least q - 2 (the
//! slot is free), writes word 1, pushes, then writes word 0; a receive of q waits until word 0
//! of its parity reaches q, reads word 1, checks both against its own op, reads the slot, and
//! acknowledges q. A group's sends come before its receives; a rank runs its ops one after
//! another (a kernel each, one stream), or a whole group at once (the group kernel) where the
//! group holds at most one op per direction of a pair.
//!
//! Checked: no receive ever reads data of another sequence, a flag found in a parity slot is
//! only ever q - 2 or q, the ranks finish every program whose groups match, and a send/recv
//! pair that disagrees (count or dtype) is reported by the receiver, never read silently.
//! Mutations the model must catch (so the test can fail): one slot instead of two, a send that
//! does not wait for the ack, and a group kernel holding two ops of one direction of a pair.

use std::collections::HashMap;

use super::model::Xorshift;
use commd_proto::num::usize_of;

/// An op of a rank's program: send to / receive from `peer`, with its signature (dtype) and
/// count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Send { peer: usize, sig: u32, count: u32 },
    Recv { peer: usize, sig: u32, count: u32 },
}

#[derive(Default, Clone)]
struct Channel {
    /// Word 0 per parity: (sequence, signature).
    w0: [Option<(u64, u32)>; 2],
    /// Word 1 per parity: count, with the sequence that wrote it (the model's check only).
    w1: [Option<(u64, u32)>; 2],
    /// Data per parity: (sequence, value).
    data: [Option<(u64, u64)>; 2],
    /// The receiver's ack of the sender's sequences (lives in the sender's memory).
    ack: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    WaitAck,
    Word1,
    Push,
    Word0,
    WaitFlag,
    Read,
    Ack,
}

#[derive(Debug, PartialEq, Eq)]
enum End {
    Done,
    Mismatch { rank: usize, peer: usize, seq: u64 },
    Stuck,
}

struct Knobs {
    /// Data slots (and flags) per channel: a sequence uses slot q % slots.
    slots: u64,
    /// How far a send may run ahead of the receiver's ack (`None`: no wait at all).
    ahead: Option<u64>,
    /// How a group's ops run.
    grouping: Grouping,
}

/// How a rank runs a group's ops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Grouping {
    /// One op after another (a kernel each, in issue order on one stream).
    Serial,
    /// All at once in one kernel (`commd_p2p_group`) where the group has at most one op per
    /// direction of a pair, else one after another (as `post_cuda_p2p_group` does).
    Kernel,
    /// All at once in one kernel whatever the group holds (the mutation the rule rules out).
    KernelAlways,
}

impl Knobs {
    /// The protocol as designed (checks its claims strictly; mutations only need to fail).
    fn built(&self) -> bool {
        self.slots == 2 && self.ahead == Some(2) && self.grouping != Grouping::KernelAlways
    }
}

/// The units a rank runs one after another: each a set of ops that run at once.
fn units(groups: &[Vec<Op>], g: Grouping) -> Vec<Vec<Op>> {
    let key = |o: &Op| match *o {
        Op::Send { peer, .. } => (peer, true),
        Op::Recv { peer, .. } => (peer, false),
    };
    let mut out = Vec::new();
    for group in groups {
        let once = group
            .iter()
            .enumerate()
            .all(|(i, o)| group[..i].iter().all(|x| key(x) != key(o)));
        if g == Grouping::KernelAlways || (g == Grouping::Kernel && once) {
            out.push(group.clone());
        } else {
            out.extend(group.iter().map(|o| vec![*o]));
        }
    }
    out
}

fn value(src: usize, dst: usize, q: u64) -> u64 {
    (src as u64) << 48 | (dst as u64) << 40 | q
}

fn run(programs: &[Vec<Vec<Op>>], k: &Knobs, seed: u64) -> End {
    let n = programs.len();
    let units: Vec<Vec<Vec<Op>>> = programs.iter().map(|p| units(p, k.grouping)).collect();
    let mut ch: HashMap<(usize, usize), Channel> = HashMap::new();
    // Per rank: the unit it runs, and each of its ops' step and sequence (0: not started).
    let mut at = vec![0usize; n];
    let mut live: Vec<Vec<(Step, u64, bool)>> = vec![Vec::new(); n];
    let mut sent: HashMap<(usize, usize), u64> = HashMap::new();
    let mut recvd: HashMap<(usize, usize), u64> = HashMap::new();
    let mut rng = Xorshift(seed | 1);
    let mut stalls = 0u32;
    loop {
        if (0..n).all(|r| at[r] == units[r].len()) {
            return End::Done;
        }
        let me = usize_of(rng.next() % n as u64);
        if at[me] == units[me].len() {
            stalls += 1;
            if stalls > 200_000 {
                return End::Stuck;
            }
            continue;
        }
        let unit = &units[me][at[me]];
        if live[me].is_empty() {
            // The unit starts: its sequences are counted on the host, in issue order.
            for op in unit {
                let q = match *op {
                    Op::Send { peer, .. } => {
                        let c = sent.entry((me, peer)).or_default();
                        *c += 1;
                        *c
                    }
                    Op::Recv { peer, .. } => {
                        let c = recvd.entry((peer, me)).or_default();
                        *c += 1;
                        *c
                    }
                };
                let first = match op {
                    Op::Send { .. } if k.ahead.is_some() => Step::WaitAck,
                    Op::Send { .. } => Step::Word1,
                    Op::Recv { .. } => Step::WaitFlag,
                };
                live[me].push((first, q, false));
            }
        }
        // One step of one of the unit's unfinished ops, picked at random.
        let open: Vec<usize> = (0..unit.len()).filter(|&i| !live[me][i].2).collect();
        let j = open[usize_of(rng.next() % open.len() as u64)];
        let op = unit[j];
        let (st, q, _) = live[me][j];
        let p = usize_of(q % k.slots);
        let mut progressed = true;
        let mut next = st;
        let mut finished = false;
        match (op, st) {
            (Op::Send { peer, .. }, Step::WaitAck) => {
                let c = ch.entry((me, peer)).or_default();
                if c.ack + k.ahead.unwrap_or(u64::MAX / 2) >= q {
                    next = Step::Word1;
                } else {
                    progressed = false;
                }
            }
            (Op::Send { peer, count, .. }, Step::Word1) => {
                ch.entry((me, peer)).or_default().w1[p] = Some((q, count));
                next = Step::Push;
            }
            (Op::Send { peer, .. }, Step::Push) => {
                ch.entry((me, peer)).or_default().data[p] = Some((q, value(me, peer, q)));
                next = Step::Word0;
            }
            (Op::Send { peer, sig, .. }, Step::Word0) => {
                ch.entry((me, peer)).or_default().w0[p] = Some((q, sig));
                finished = true;
            }
            (Op::Recv { peer, sig, count }, Step::WaitFlag) => {
                let c = ch.entry((peer, me)).or_default();
                match c.w0[p] {
                    Some((e, s)) if e >= q => {
                        assert!(
                            e == q || !k.built(),
                            "rank {me} waiting for sequence {q} from {peer} found {e}"
                        );
                        let (we, wc) = c.w1[p].unwrap_or((0, u32::MAX));
                        assert!(
                            we == e || !k.built(),
                            "rank {me}, sequence {q} from {peer}: word 1 of sequence {we}"
                        );
                        if e != q || s != sig || wc != count {
                            return End::Mismatch {
                                rank: me,
                                peer,
                                seq: q,
                            };
                        }
                        next = Step::Read;
                    }
                    Some((e, _)) => {
                        assert!(
                            e + k.slots == q || !k.built(),
                            "rank {me} waiting for sequence {q} from {peer} found {e} in its slot"
                        );
                        progressed = false;
                    }
                    None => progressed = false,
                }
            }
            (Op::Recv { peer, .. }, Step::Read) => {
                let got = ch.entry((peer, me)).or_default().data[p];
                assert_eq!(
                    got,
                    Some((q, value(peer, me, q))),
                    "rank {me}, sequence {q} from {peer}: slot holds {got:?} (stale or overwritten)"
                );
                next = Step::Ack;
            }
            (Op::Recv { peer, .. }, Step::Ack) => {
                // The last writer wins, as the kernels' plain store does.
                ch.entry((peer, me)).or_default().ack = q;
                finished = true;
            }
            (op, s) => unreachable!("{op:?} at {s:?}"),
        }
        live[me][j] = (next, q, finished);
        if live[me].iter().all(|x| x.2) {
            live[me].clear();
            at[me] += 1;
        }
        if progressed {
            stalls = 0;
        } else {
            stalls += 1;
            if stalls > 200_000 {
                return End::Stuck;
            }
        }
    }
}

/// Programs of `groups` groups in which every rank sends to some peers and receives from the
/// ranks that send to it (the pattern drawn per group, the same on every rank: every send has
/// its receive), sends before receives within a group; an edge may carry two messages (one
/// direction of a pair twice in a group).
fn programs(n: usize, groups: usize, seed: u64) -> Vec<Vec<Vec<Op>>> {
    let mut rng = Xorshift(seed | 1);
    let mut ps = vec![Vec::new(); n];
    for _ in 0..groups {
        // Edges s -> d of this group, with a dtype and count each.
        let mut edges = Vec::new();
        for s in 0..n {
            for d in 0..n {
                if s != d && rng.next().is_multiple_of(3) {
                    let sig = (rng.next() % 3) as u32;
                    let count = 1 + (rng.next() % 4) as u32;
                    let times = 1 + (rng.next() % 2) as usize;
                    for _ in 0..times {
                        edges.push((s, d, sig, count));
                    }
                }
            }
        }
        for (r, prog) in ps.iter_mut().enumerate() {
            let mut group = Vec::new();
            for &(s, d, sig, count) in &edges {
                if s == r {
                    group.push(Op::Send {
                        peer: d,
                        sig,
                        count,
                    });
                }
            }
            for &(s, d, sig, count) in &edges {
                if d == r {
                    group.push(Op::Recv {
                        peer: s,
                        sig,
                        count,
                    });
                }
            }
            if !group.is_empty() {
                prog.push(group);
            }
        }
    }
    ps
}

const BUILT: Knobs = Knobs {
    slots: 2,
    ahead: Some(2),
    grouping: Grouping::Kernel,
};

#[test]
fn sends_and_receives_pair_in_order_and_always_finish() {
    for grouping in [Grouping::Serial, Grouping::Kernel] {
        let k = Knobs { grouping, ..BUILT };
        for n in [2, 3, 4] {
            for seed in 0..120u64 {
                let ps = programs(n, 12, seed);
                assert_eq!(
                    run(&ps, &k, seed * 7919 + 5),
                    End::Done,
                    "{n} ranks, seed {seed}, {grouping:?}"
                );
            }
        }
    }
}

#[test]
fn a_pair_that_disagrees_is_reported_by_the_receiver() {
    for seed in 0..100u64 {
        let mut ps = programs(3, 8, seed);
        // Rank 1's third receive from anyone expects another count than was sent.
        let Some(op) = ps[1]
            .iter_mut()
            .flatten()
            .filter(|o| matches!(o, Op::Recv { .. }))
            .nth(2)
        else {
            continue;
        };
        if let Op::Recv { count, .. } = op {
            *count += 10;
        }
        match run(&ps, &BUILT, seed + 3) {
            End::Mismatch { rank: 1, .. } => {}
            other => panic!("seed {seed}: {other:?}, want a mismatch at rank 1"),
        }
    }
}

/// How many of 300 schedules of `knobs` do not end as designed (a panic of the model's checks,
/// a mismatch or a stuck run).
fn failures(knobs: &Knobs, n: usize) -> usize {
    (0..300u64)
        .filter(|&seed| {
            let ps = programs(n, 20, seed);
            let r = std::panic::catch_unwind(|| run(&ps, knobs, seed * 104_729 + 3));
            !matches!(r, Ok(End::Done))
        })
        .count()
}

#[test]
fn one_slot_or_no_ack_wait_is_caught() {
    // The mutations the design rules out: the model must be able to fail. (One slot with
    // `ahead` 1 is a correct stop-and-wait protocol; one slot with two sequences in flight is not.)
    for knobs in [
        Knobs {
            slots: 1,
            ahead: Some(2),
            grouping: Grouping::Serial,
        },
        Knobs {
            slots: 2,
            ahead: None,
            grouping: Grouping::Serial,
        },
    ] {
        assert!(
            failures(&knobs, 2) > 0,
            "slots {} ahead {:?}: never went wrong in 300 schedules",
            knobs.slots,
            knobs.ahead
        );
    }
}

#[test]
fn two_ops_of_one_direction_in_one_group_kernel_is_caught() {
    // The group kernel's rule (at most one op per direction of a pair, `post_cuda_p2p_group`):
    // without it a later receive's ack can free an earlier one's slot while it is being read.
    let always = Knobs {
        grouping: Grouping::KernelAlways,
        ..BUILT
    };
    assert!(
        failures(&always, 2) + failures(&always, 3) > 0,
        "one kernel for every group never went wrong in 600 schedules"
    );
    assert_eq!(failures(&BUILT, 3), 0, "the rule as built went wrong");
}

mod ll_flags {
    //! The LL protocol's stale-flag rule (`kernels::p2p` module doc) modelled with flags of `BITS` bits instead of 32, so
    //! that the sequences wrap within a test: one direction of a pair, both parities, every
    //! flag location the kernels write (LL header and lines, the simple flag), messages of
    //! either protocol and any size. Before each send writes, nothing its receive would take
    //! (or take for a mismatch) may already be there.
    use super::super::super::kernels::p2p::{REFRESH_PERIOD, refreshes};
    use super::super::model::Xorshift;
    use commd_proto::num::usize_of;

    const BITS: u32 = 10;
    const MASK: u64 = (1 << BITS) - 1;
    /// As REFRESH_PERIOD is to 32 bits: a flag is at most 2 * period + 2 sequences old, under
    /// half the flag's range.
    const PERIOD: u64 = 1 << (BITS - 3);
    const LINES: usize = 64;

    struct Dir {
        /// Per parity: LL header and lines 1..=LINES, and the simple flag (masked sequences).
        ll: [[u64; LINES + 1]; 2],
        simple: [u64; 2],
    }

    /// Whether `got` reads as `want` or later (32-bit wrap-aware in the kernels).
    fn at_or_after(got: u64, want: u64) -> bool {
        let d = got.wrapping_sub(want) & MASK;
        d < (1 << (BITS - 1))
    }

    /// Runs `msgs` (`Some(lines)`: LL; `None`: simple) with or without the refresh; the first
    /// sequence at which a receive could take an old flag, if any.
    fn run(msgs: &[Option<usize>], refresh: bool) -> Option<u64> {
        let mut d = Dir {
            ll: [[0; LINES + 1]; 2],
            simple: [0; 2],
        };
        for (k, m) in msgs.iter().enumerate() {
            let seq = k as u64 + 1;
            let (p, f) = ((seq & 1) as usize, seq & MASK);
            let marker = seq.wrapping_sub(2) & MASK;
            // What the receive of `seq` sees before the send writes: a header or simple flag
            // at or after its sequence (taken, or a false mismatch), the other protocol's
            // flag at or after it (a false mismatch), an LL line equal to it (taken).
            let stale = at_or_after(d.ll[p][0], f)
                || at_or_after(d.simple[p], f)
                || m.is_some_and(|n| d.ll[p][1..=n].contains(&f));
            if stale {
                return Some(seq);
            }
            let r = refresh && refreshes(seq, PERIOD);
            match *m {
                Some(n) => {
                    d.ll[p][0] = f;
                    for (i, line) in d.ll[p][1..].iter_mut().enumerate() {
                        if i < n {
                            *line = f;
                        } else if r {
                            *line = marker;
                        }
                    }
                    if r {
                        d.simple[p] = marker;
                    }
                }
                None => {
                    d.simple[p] = f;
                    if r {
                        d.ll[p] = [marker; LINES + 1];
                    }
                }
            }
        }
        None
    }

    #[test]
    fn ll_flags_are_never_taken_stale_with_the_refresh() {
        assert!(REFRESH_PERIOD.is_power_of_two() && 2 * REFRESH_PERIOD + 2 < 1 << 31);
        assert!(refreshes(1, REFRESH_PERIOD) && refreshes(2, REFRESH_PERIOD));
        assert!(!refreshes(3, REFRESH_PERIOD) && refreshes(2 * REFRESH_PERIOD + 1, REFRESH_PERIOD));
        let mut rng = Xorshift(0x11_22_33);
        let mut stale_without = 0;
        for _ in 0..20 {
            // Long runs of one kind: large LL messages, then small ones or simple ones for
            // longer than the flags' range.
            let mut msgs = Vec::new();
            while msgs.len() < 12 << BITS {
                let len = 1 + (rng.next() % (3 << BITS)) as usize;
                let kind = rng.next() % 3;
                for _ in 0..len {
                    msgs.push(match kind {
                        0 => Some(1 + usize_of(rng.next() % LINES as u64)),
                        1 => Some(1),
                        _ => None,
                    });
                }
            }
            assert_eq!(run(&msgs, true), None);
            stale_without += usize::from(run(&msgs, false).is_some());
        }
        // The same programs reach a stale flag without the rule (they test something).
        assert!(stale_without >= 10, "{stale_without}");
    }

    #[test]
    fn ll_flags_are_taken_stale_without_the_refresh() {
        // One full LL message per parity, then simple ones past the flags' range, then small
        // LL ones: without the refresh, the header or a line is taken from 2^BITS sequences
        // before (the mutation the rule exists for).
        let mut msgs = vec![Some(LINES), Some(LINES)];
        msgs.extend(std::iter::repeat_n(None, 1 << BITS));
        msgs.extend(std::iter::repeat_n(Some(1), 4));
        assert!(run(&msgs, false).is_some());
        assert_eq!(run(&msgs, true), None);
        // Only small LL messages: the lines past them go stale.
        let mut msgs = vec![Some(LINES), Some(LINES)];
        msgs.extend(std::iter::repeat_n(Some(1), (1 << BITS) - 2));
        msgs.extend([Some(LINES), Some(LINES)]);
        assert!(run(&msgs, false).is_some());
        assert_eq!(run(&msgs, true), None);
    }
}
