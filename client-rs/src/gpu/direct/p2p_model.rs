//! A model of the direct send/recv protocol (docs/design.md, "What is left": send/recv as direct
//! ops), run under random interleavings of the ranks before any GPU code exists for it.
//!
//! One channel per ordered pair (s -> d), in memory of the receiver d: two data slots, two
//! flags (word 0: sequence | signature, word 1: count), and in the *sender's* inbox from d the
//! ack word d writes after it has read a sequence. Sequences are counted per direction on the
//! host, from 1. A send of sequence q (parity q & 1) waits until the ack is at least q - 2 (the
//! slot is free), writes word 1, pushes, then writes word 0; a receive of q waits until word 0
//! of its parity reaches q, reads word 1, checks both against its own op, reads the slot, and
//! acknowledges q. Each rank runs its ops in issue order (one stream); a group's sends are
//! launched before its receives.
//!
//! Checked: no receive ever reads data of another sequence, a flag found in a parity slot is
//! only ever q - 2 or q, the ranks finish every program whose groups match, and a send/recv
//! pair that disagrees (count or dtype) is reported by the receiver, never read silently.
//! Mutations the model must catch (so the test can fail): one slot instead of two, and a send
//! that does not wait for the ack.

use std::collections::HashMap;

use super::model::Xorshift;

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
    Start,
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
}

impl Knobs {
    /// The protocol as designed (checks its claims strictly; mutations only need to fail).
    fn built(&self) -> bool {
        self.slots == 2 && self.ahead == Some(2)
    }
}

fn value(src: usize, dst: usize, q: u64) -> u64 {
    (src as u64) << 48 | (dst as u64) << 40 | q
}

fn run(programs: &[Vec<Op>], k: &Knobs, seed: u64) -> End {
    let n = programs.len();
    let mut ch: HashMap<(usize, usize), Channel> = HashMap::new();
    let mut at = vec![0usize; n];
    let mut step = vec![Step::Start; n];
    let mut seq = vec![0u64; n];
    let mut sent: HashMap<(usize, usize), u64> = HashMap::new();
    let mut recvd: HashMap<(usize, usize), u64> = HashMap::new();
    let mut rng = Xorshift(seed | 1);
    let mut stalls = 0u32;
    loop {
        if (0..n).all(|r| at[r] == programs[r].len()) {
            return End::Done;
        }
        let me = (rng.next() % n as u64) as usize;
        if at[me] == programs[me].len() {
            stalls += 1;
            if stalls > 200_000 {
                return End::Stuck;
            }
            continue;
        }
        let op = programs[me][at[me]];
        let q = seq[me];
        let p = (q % k.slots) as usize;
        let mut progressed = true;
        match (op, step[me]) {
            (Op::Send { peer, .. }, Step::Start) => {
                let c = sent.entry((me, peer)).or_default();
                *c += 1;
                seq[me] = *c;
                step[me] = if k.ahead.is_some() {
                    Step::WaitAck
                } else {
                    Step::Word1
                };
            }
            (Op::Recv { peer, .. }, Step::Start) => {
                let c = recvd.entry((peer, me)).or_default();
                *c += 1;
                seq[me] = *c;
                step[me] = Step::WaitFlag;
            }
            (Op::Send { peer, .. }, Step::WaitAck) => {
                let c = ch.entry((me, peer)).or_default();
                if c.ack + k.ahead.unwrap_or(u64::MAX / 2) >= q {
                    step[me] = Step::Word1;
                } else {
                    progressed = false;
                }
            }
            (Op::Send { peer, count, .. }, Step::Word1) => {
                ch.entry((me, peer)).or_default().w1[p] = Some((q, count));
                step[me] = Step::Push;
            }
            (Op::Send { peer, .. }, Step::Push) => {
                ch.entry((me, peer)).or_default().data[p] = Some((q, value(me, peer, q)));
                step[me] = Step::Word0;
            }
            (Op::Send { peer, sig, .. }, Step::Word0) => {
                ch.entry((me, peer)).or_default().w0[p] = Some((q, sig));
                at[me] += 1;
                step[me] = Step::Start;
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
                        step[me] = Step::Read;
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
                step[me] = Step::Ack;
            }
            (Op::Recv { peer, .. }, Step::Ack) => {
                ch.entry((peer, me)).or_default().ack = q;
                at[me] += 1;
                step[me] = Step::Start;
            }
            (op, s) => unreachable!("{op:?} at {s:?}"),
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
/// its receive), sends launched before receives within a group.
fn programs(n: usize, groups: usize, seed: u64) -> Vec<Vec<Op>> {
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
            for &(s, d, sig, count) in &edges {
                if s == r {
                    prog.push(Op::Send {
                        peer: d,
                        sig,
                        count,
                    });
                }
            }
            for &(s, d, sig, count) in &edges {
                if d == r {
                    prog.push(Op::Recv {
                        peer: s,
                        sig,
                        count,
                    });
                }
            }
        }
    }
    ps
}

const BUILT: Knobs = Knobs {
    slots: 2,
    ahead: Some(2),
};

#[test]
fn sends_and_receives_pair_in_order_and_always_finish() {
    for n in [2, 3, 4] {
        for seed in 0..120u64 {
            let ps = programs(n, 12, seed);
            assert_eq!(
                run(&ps, &BUILT, seed * 7919 + 5),
                End::Done,
                "{n} ranks, seed {seed}"
            );
        }
    }
}

#[test]
fn a_pair_that_disagrees_is_reported_by_the_receiver() {
    for seed in 0..100u64 {
        let mut ps = programs(3, 8, seed);
        // Rank 1's third receive from anyone expects another count than was sent.
        let Some(i) = ps[1]
            .iter()
            .enumerate()
            .filter(|(_, o)| matches!(o, Op::Recv { .. }))
            .nth(2)
            .map(|(i, _)| i)
        else {
            continue;
        };
        if let Op::Recv { count, .. } = &mut ps[1][i] {
            *count += 10;
        }
        match run(&ps, &BUILT, seed + 3) {
            End::Mismatch { rank: 1, .. } => {}
            other => panic!("seed {seed}: {other:?}, want a mismatch at rank 1"),
        }
    }
}

#[test]
fn one_slot_or_no_ack_wait_is_caught() {
    // The mutations the design rules out: the model must be able to fail. (One slot with
    // `ahead` 1 is a correct stop-and-wait protocol; one slot with two sequences in flight is not.)
    for knobs in [
        Knobs {
            slots: 1,
            ahead: Some(2),
        },
        Knobs {
            slots: 2,
            ahead: None,
        },
    ] {
        let mut caught = 0;
        for seed in 0..300u64 {
            let ps = programs(2, 20, seed);
            let r = std::panic::catch_unwind(|| run(&ps, &knobs, seed * 104_729 + 3));
            if !matches!(r, Ok(End::Done)) {
                caught += 1;
            }
        }
        assert!(
            caught > 0,
            "slots {} ahead {:?}: never went wrong in 300 schedules",
            knobs.slots,
            knobs.ahead
        );
    }
}
