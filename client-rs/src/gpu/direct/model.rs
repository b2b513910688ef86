//! A model of the direct-op protocol (docs/contracts.md #7), run under random interleavings
//! of the ranks: the window rules of `kernels/direct.rs` (epoch from a per-window counter, parity
//! `e & 1`, a flag's second word (capture index, count) written to every window when the op
//! starts, data slot (p, source), the flag's first word (epoch, signature) per (p, source)
//! after every push, the own one last, a wait for every rank's first word of the epoch, then
//! its second word and the reads) as steps of one actor per rank. It checks what the design
//! claims: with two parities no read ever sees another epoch's data, a peer's flag in a parity
//! slot is only ever epoch e - 2 or e when rank waits for e, the second word read after the
//! first is of the same epoch (it carries no epoch of its own), ranks that run the same ops
//! always finish, and ranks that do not are told (a mismatch), never paired silently. With one
//! parity the same model finds overwritten reads: the test can fail.
//!
//! Ops by LL lines (`struct commd_direct`'s `ll`) mix with them: such an op writes its data
//! lines and its header line (epoch, signature, capture index) into the peers' LL areas and
//! `LL_SIG` into its flag, waits for each peer's header of the epoch (or a flag of the epoch
//! that is not `LL_SIG`: a mismatch), then polls each data line and copies it into the
//! source's data slot of its own window, which the reads take as usual. The model checks that
//! a line is never of a later epoch than the one awaited and that the copied slot is never
//! overwritten before it is read.
//!
//! Forwarded broadcasts (`kernels::direct::MODE_BCF`) mix with both: such an op writes its
//! early signature into every window with its second flag words, then the root pushes part q of
//! its slot (n - 1 parts) into non-root q's window only and flags; a non-root waits for the
//! root's flag (or a peer's early signature of the epoch that names another op: a mismatch),
//! forwards its part from its own window into the other non-roots' windows, then flags; every
//! rank waits for every flag, and a non-root reads every part of the root's slot. The model
//! checks that each part read is the root's data of the epoch, whoever wrote it, and that ranks
//! whose roots differ, each waiting on another, are told instead of stuck (without the early
//! signatures they are stuck: the test can fail).
//!
//! Broadcasts whose root defers its wait (`DirectArgs::defer`) mix with all of them: the root
//! pushes its slot to every peer and flags, but waits for no flag and reads nothing; it keeps
//! the op's words, and its next op, before it writes anything, waits for every rank's flag of
//! that epoch and checks it names the kept op. The non-roots push nothing and run the op as
//! usual, reading the root's slot. The model checks that the wait one op late keeps every read
//! of the parity argument right and every mismatch told (without it, reads are overwritten:
//! the test can fail).
//!
//! Eager collectives on the daemon's path (`kernels::direct::MARK_OFF`) mix with all of them:
//! such an op takes no epoch; the rank's stream writes its daemon mark (the epoch its next
//! direct op will take, the count of its daemon-path ops so far) into its own window, then
//! waits in the daemon until every rank posted its op of the same count, which must have the
//! same signature (the daemon's own mismatch check). A rank whose wait for a peer's flag (or
//! LL line, or deferred flag) finds nothing looks at that peer's mark: one of the awaited epoch
//! with a count past its own means the peer ran this op, or an earlier one, on the daemon's
//! path. The model checks that ranks running the same ops never see such a mark, and that a
//! count across the limit (one rank on the daemon's path) and ops issued in different orders
//! are told at once (without the marks both wait forever: the test can fail).

use commd_proto::num::usize_of;

/// A model index or count (a few thousand at most) as the u32 of an op's fields.
fn small(x: usize) -> u32 {
    u32::try_from(x).unwrap()
}

/// A flag's first word: epoch, signature.
type Flag = (u64, u32);

/// The signature an op by LL lines writes into its flag (`kernels::direct::LL_SIG`).
const LL: u32 = u32::MAX - 1;

/// Signatures from here on are ops on the daemon's path (not direct ops).
const DAEMON: u32 = 1000;

/// What a slot holds: epoch, source, value.
type Datum = (u64, usize, u64);

/// An op of a program: signature, capture index, by LL lines, forwarded from this root, a
/// broadcast from this root that defers its wait.
type Op = (u32, u32, bool, Option<usize>, Option<usize>);

struct Window {
    flags: Vec<[Option<Flag>; 2]>,
    /// A flag's second word: the capture index, with the epoch that wrote it (known to the
    /// model only, for the check; the kernel's word has none).
    aux: Vec<[Option<(u64, u32)>; 2]>,
    /// (epoch, source, value) per (source, parity), per part of the slot (n - 1 parts: a
    /// forwarded broadcast moves one part per non-root; the other ops fill every part).
    data: Vec<[Vec<Option<Datum>>; 2]>,
    /// Early signatures of forwarded broadcasts (epoch, signature) per (source, parity).
    pre: Vec<[Option<Flag>; 2]>,
    /// LL header lines (epoch, signature, capture index) per (source, parity).
    ll_head: Vec<[Option<(u64, u32, u32)>; 2]>,
    /// LL data lines (epoch, source, value) per (source, parity).
    ll_data: Vec<[Option<(u64, usize, u64)>; 2]>,
    entered: u64,
    /// The owner's daemon mark: the epoch of its next direct op, its daemon-path ops so far.
    mark: Option<(u64, u32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Start,
    Aux(usize),
    Push(usize),
    Flag(usize),
    Wait(usize),
    Read(usize),
    LlData(usize),
    LlHead(usize),
    LlWait(usize),
    LlCopy(usize),
    /// A forwarded broadcast's root pushes part q into non-root q's window.
    FPush(usize),
    /// A forwarded broadcast's non-root waits for the root's flag.
    FWait,
    /// A forwarded broadcast's non-root forwards its part into another non-root's window.
    FFwd(usize),
    /// The wait a rank deferred at its previous op: for rank r's flag of that epoch.
    DWait(usize),
    /// An op on the daemon's path: posted, waiting for every rank's op of the same count.
    Daemon,
}

struct Rank {
    /// The ops to run.
    program: Vec<Op>,
    op: usize,
    step: Step,
    epoch: u64,
    /// The epoch, signature, capture index and daemon-path count of this rank's previous op
    /// when it deferred its wait.
    deferred: Option<(u64, u32, u32, u32)>,
    /// Ops on the daemon's path so far (the kernel's `dseq`).
    dseq: u32,
}

#[derive(Debug, PartialEq, Eq)]
enum End {
    Done,
    Mismatch {
        rank: usize,
        peer: usize,
        epoch: u64,
    },
    /// A rank saw a peer's daemon mark of the epoch it awaited (`kernels::direct::ELSEWHERE`).
    Elsewhere {
        rank: usize,
        peer: usize,
        epoch: u64,
    },
    /// The daemon paired ops of another signature (its own mismatch).
    DaemonMismatch {
        at: u32,
    },
    Stuck,
}

fn mismatch(rank: usize, peer: usize, epoch: u64) -> End {
    End::Mismatch { rank, peer, epoch }
}

/// Whether `from`'s daemon mark names `epoch` with more daemon-path ops than `dseq` (what the
/// kernel looks at every 1024 spins of a wait, `commd_direct_stop`).
fn marked(win: &[Window], from: usize, epoch: u64, dseq: u32) -> bool {
    win[from].mark.is_some_and(|(e, d)| e == epoch && d > dseq)
}

fn elsewhere(rank: usize, peer: usize, epoch: u64) -> End {
    End::Elsewhere { rank, peer, epoch }
}

fn value(src: usize, e: u64) -> u64 {
    (src as u64) << 40 | e
}

pub(super) struct Xorshift(pub(super) u64);

impl Xorshift {
    pub(super) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
}

/// The part of a forwarded broadcast's slot that non-root `r` gets from root `t` of `n`.
fn part_of(r: usize, t: usize, n: usize) -> usize {
    (r + n - t - 1) % n
}

/// Runs `programs` (one per rank) under the schedule from `seed`; `parities` is 2 as built, 1
/// for the mutation. Panics on a stale or overwritten read and on a flag from the future.
fn run(programs: &[Vec<Op>], parities: u64, seed: u64) -> End {
    run_with(programs, parities, AS_BUILT, seed)
}

/// What a forwarded broadcast and a deferred wait do: as built, all; each `false` is a
/// mutation.
#[derive(Clone, Copy)]
struct Fwd {
    /// Early signatures written and checked.
    early: bool,
    /// A non-root waits for the root's flag before it forwards.
    wait_root: bool,
    /// A rank that deferred its wait waits at the start of its next op.
    deferred_wait: bool,
    /// A rank that waits looks at the peer's daemon mark.
    marks: bool,
}

const AS_BUILT: Fwd = Fwd {
    early: true,
    wait_root: true,
    deferred_wait: true,
    marks: true,
};

/// [`run`] with forwarded broadcasts as `how` says.
fn run_with(programs: &[Vec<Op>], parities: u64, how: Fwd, seed: u64) -> End {
    let Fwd {
        early,
        wait_root,
        deferred_wait,
        marks,
    } = how;
    let n = programs.len();
    let parts = n.saturating_sub(1).max(1);
    let mut win: Vec<Window> = (0..n)
        .map(|_| Window {
            flags: vec![[None; 2]; n],
            aux: vec![[None; 2]; n],
            data: vec![[vec![None; parts], vec![None; parts]]; n],
            pre: vec![[None; 2]; n],
            ll_head: vec![[None; 2]; n],
            ll_data: vec![[None; 2]; n],
            entered: 0,
            mark: None,
        })
        .collect();
    // The daemon: each rank's posted ops on its path, in order.
    let mut posted: Vec<Vec<u32>> = vec![Vec::new(); n];
    let mut ranks: Vec<Rank> = programs
        .iter()
        .map(|p| Rank {
            program: p.clone(),
            op: 0,
            step: Step::Start,
            epoch: 0,
            deferred: None,
            dseq: 0,
        })
        .collect();
    let mut rng = Xorshift(seed | 1);
    let mut stalls = 0;
    loop {
        if ranks.iter().all(|r| r.op == r.program.len()) {
            return End::Done;
        }
        let me = usize_of(rng.next() % n as u64);
        let r = &mut ranks[me];
        if r.op == r.program.len() {
            stalls += 1;
            if stalls > 100_000 {
                return End::Stuck;
            }
            continue;
        }
        let (sig, k, ll, fwd, bc) = r.program[r.op];
        // This op's root defers its wait (and reads nothing).
        let defers = bc == Some(me);
        let p = usize_of(r.epoch % parities);
        let next = |s: usize| if s + 1 < n { Some(s + 1) } else { None };
        match r.step {
            Step::Start if sig >= DAEMON => {
                // The stream's mark (its next direct op's epoch, this op's count), then the
                // post.
                stalls = 0;
                r.dseq += 1;
                win[me].mark = Some((win[me].entered + 1, r.dseq));
                posted[me].push(sig);
                r.step = Step::Daemon;
            }
            Step::Daemon => {
                let at = r.dseq as usize;
                if posted.iter().all(|p| p.len() >= at) {
                    if posted.iter().any(|p| p[at - 1] != sig) {
                        return End::DaemonMismatch { at: r.dseq };
                    }
                    r.op += 1;
                    r.step = Step::Start;
                    stalls = 0;
                } else {
                    stalls += 1;
                    if stalls > 100_000 {
                        return End::Stuck;
                    }
                }
            }
            Step::Start => {
                stalls = 0;
                win[me].entered += 1;
                r.epoch = win[me].entered;
                let late = r.deferred.is_some_and(|d| d.0 + 1 == r.epoch);
                r.step = if late && deferred_wait {
                    Step::DWait(0)
                } else {
                    Step::Aux(0)
                };
            }
            Step::DWait(from) => {
                let (de, dsig, dk, dd) = r.deferred.unwrap_or_default();
                let dp = usize_of(de % parities);
                match win[me].flags[from][dp] {
                    Some((e, s)) if e >= de => {
                        assert!(
                            e == de || parities == 1,
                            "rank {me} waiting late for epoch {de} saw rank {from}'s flag of epoch {e}"
                        );
                        let kk = win[me].aux[from][dp].map_or(u32::MAX, |a| a.1);
                        if (s, kk) != (dsig, dk) || e != de {
                            return mismatch(me, from, de);
                        }
                        r.step = next(from).map_or(Step::Aux(0), Step::DWait);
                        stalls = 0;
                    }
                    _ => {
                        if marks && marked(&win, from, de, dd) {
                            return elsewhere(me, from, de);
                        }
                        stalls += 1;
                        if stalls > 100_000 {
                            return End::Stuck;
                        }
                    }
                }
            }
            Step::Aux(to) => {
                // The first block writes every window's second word before any push (and a
                // forwarded broadcast its early signature).
                let p = usize_of(r.epoch % parities);
                win[to].aux[me][p] = Some((r.epoch, k));
                if fwd.is_some() && early {
                    win[to].pre[me][p] = Some((r.epoch, sig));
                }
                let first = match fwd {
                    _ if ll => Step::LlData(0),
                    Some(t) if t == me => Step::FPush(0),
                    Some(_) => Step::FWait,
                    None => Step::Push(0),
                };
                r.step = next(to).map_or(first, Step::Aux);
            }
            Step::Push(to) => {
                let p = usize_of(r.epoch % parities);
                // A broadcast's non-roots push nothing.
                if to != me && bc.is_none_or(|t| t == me) {
                    win[to].data[me][p].fill(Some((r.epoch, me, value(me, r.epoch))));
                }
                r.step = next(to).map_or(Step::Flag(0), Step::Push);
            }
            Step::FPush(to) => {
                if to != me {
                    win[to].data[me][p][part_of(to, me, n)] =
                        Some((r.epoch, me, value(me, r.epoch)));
                }
                r.step = next(to).map_or(Step::Flag(0), Step::FPush);
            }
            Step::FWait => {
                let t = fwd.unwrap_or(0);
                // Every 1024 spins in the kernel; here at every look.
                let other = (0..n).find(|&q| {
                    q != me && win[me].pre[q][p].is_some_and(|(e, s)| e == r.epoch && s != sig)
                });
                if !wait_root {
                    r.step = Step::FFwd(0);
                    continue;
                }
                match win[me].flags[t][p] {
                    Some((e, s)) if e >= r.epoch => {
                        assert!(
                            e == r.epoch || parities == 1,
                            "rank {me} waiting for epoch {} saw root {t}'s flag of epoch {e}",
                            r.epoch
                        );
                        let kk = win[me].aux[t][p].map_or(u32::MAX, |a| a.1);
                        if (s, kk) != (sig, k) || e != r.epoch {
                            return mismatch(me, t, r.epoch);
                        }
                        r.step = Step::FFwd(0);
                        stalls = 0;
                    }
                    _ => {
                        if let Some(q) = other {
                            return mismatch(me, q, r.epoch);
                        }
                        if marks && marked(&win, t, r.epoch, r.dseq) {
                            return elsewhere(me, t, r.epoch);
                        }
                        stalls += 1;
                        if stalls > 100_000 {
                            return End::Stuck;
                        }
                    }
                }
            }
            Step::FFwd(to) => {
                let t = fwd.unwrap_or(0);
                let q = part_of(me, t, n);
                if to != me && to != t {
                    // What this rank's own window holds of its part: the root's, of this epoch.
                    let got = win[me].data[t][p][q];
                    assert_eq!(
                        got,
                        Some((r.epoch, t, value(t, r.epoch))),
                        "rank {me}, epoch {}: its part {q} of root {t} holds {got:?} when forwarded",
                        r.epoch
                    );
                    win[to].data[t][p][q] = got;
                }
                r.step = next(to).map_or(Step::Flag(0), Step::FFwd);
            }
            Step::Flag(i) => {
                // The own flag last (`kernels/direct.rs`: the last block writes every flag
                // after every block pushed; modelled as peers first, then its own).
                let to = (me + 1 + i) % n;
                win[to].flags[me][p] = Some((r.epoch, sig));
                r.step = match next(i) {
                    Some(i) => Step::Flag(i),
                    None if defers => {
                        // No wait, no read: the next op waits first.
                        r.deferred = Some((r.epoch, sig, k, r.dseq));
                        r.op += 1;
                        Step::Start
                    }
                    None => Step::Wait(0),
                };
            }
            Step::LlData(to) => {
                if to != me {
                    win[to].ll_data[me][p] = Some((r.epoch, me, value(me, r.epoch)));
                }
                r.step = next(to).map_or(Step::LlHead(0), Step::LlData);
            }
            Step::LlHead(to) => {
                if to != me {
                    win[to].ll_head[me][p] = Some((r.epoch, sig, k));
                    win[to].flags[me][p] = Some((r.epoch, LL));
                }
                r.step = next(to).map_or(Step::LlWait(0), Step::LlHead);
            }
            Step::LlWait(from) => {
                let head = win[me].ll_head[from][p];
                let flag = win[me].flags[from][p];
                if from == me {
                    r.step = next(from).map_or(Step::LlCopy(0), Step::LlWait);
                } else if let Some((e, s, kk)) = head.filter(|h| h.0 >= r.epoch) {
                    assert!(
                        e == r.epoch || parities == 1,
                        "rank {me} waiting for epoch {} saw rank {from}'s header of epoch {e}",
                        r.epoch
                    );
                    if (s, kk) != (sig, k) || e != r.epoch {
                        return mismatch(me, from, r.epoch);
                    }
                    r.step = next(from).map_or(Step::LlCopy(0), Step::LlWait);
                    stalls = 0;
                } else if flag.is_some_and(|(e, s)| e >= r.epoch && s != LL) {
                    // The peer runs this epoch's op by the flags: another op.
                    return mismatch(me, from, r.epoch);
                } else if marks && marked(&win, from, r.epoch, r.dseq) {
                    return elsewhere(me, from, r.epoch);
                } else {
                    stalls += 1;
                    if stalls > 100_000 {
                        return End::Stuck;
                    }
                }
            }
            Step::LlCopy(from) => {
                let mut done = true;
                if from != me {
                    match win[me].ll_data[from][p] {
                        Some((e, src, v)) if e == r.epoch => {
                            assert_eq!((src, v), (from, value(from, e)));
                            // Into the source's slot of this window, read below as pushed data.
                            win[me].data[from][p].fill(Some((e, src, v)));
                            stalls = 0;
                        }
                        Some((e, _, _)) => {
                            assert!(
                                e < r.epoch || parities == 1,
                                "rank {me} waiting for epoch {} saw rank {from}'s line of epoch {e}",
                                r.epoch
                            );
                            done = false;
                        }
                        None => done = false,
                    }
                }
                if done {
                    r.step = next(from).map_or(Step::Read(0), Step::LlCopy);
                } else if marks && marked(&win, from, r.epoch, r.dseq) {
                    return elsewhere(me, from, r.epoch);
                } else {
                    stalls += 1;
                    if stalls > 100_000 {
                        return End::Stuck;
                    }
                }
            }
            Step::Wait(from) => {
                match win[me].flags[from][p] {
                    Some((e, s)) if e >= r.epoch => {
                        assert!(
                            e == r.epoch || parities == 1,
                            "rank {me} waiting for epoch {} saw rank {from}'s flag of epoch {e}",
                            r.epoch
                        );
                        let (ae, kk) = win[me].aux[from][p].unwrap_or((0, u32::MAX));
                        assert!(
                            ae == e || parities == 1,
                            "rank {me}, epoch {}: rank {from}'s second flag word is of epoch {ae}",
                            r.epoch
                        );
                        if (s, kk) != (sig, k) || e != r.epoch {
                            return mismatch(me, from, r.epoch);
                        }
                        r.step = next(from).map_or(Step::Read(0), Step::Wait);
                        stalls = 0;
                    }
                    Some((e, _)) => {
                        assert!(
                            e + 2 == r.epoch || parities == 1,
                            "rank {me} waiting for epoch {} saw rank {from}'s flag of epoch {e} in its parity slot",
                            r.epoch
                        );
                        stalls += 1;
                    }
                    None => stalls += 1,
                }
                if marks && stalls > 0 && marked(&win, from, r.epoch, r.dseq) {
                    return elsewhere(me, from, r.epoch);
                }
                if stalls > 100_000 {
                    return End::Stuck;
                }
            }
            Step::Read(from) => {
                // A broadcast's non-root reads the root's slot only (the root reads nothing);
                // the other ops every peer's.
                let reads = from != me && fwd.or(bc).is_none_or(|t| from == t);
                if reads {
                    for (q, got) in win[me].data[from][p].iter().enumerate() {
                        assert_eq!(
                            *got,
                            Some((r.epoch, from, value(from, r.epoch))),
                            "rank {me}, epoch {}: part {q} of rank {from}'s slot holds {got:?} (stale or overwritten)",
                            r.epoch
                        );
                    }
                }
                match next(from) {
                    Some(f) => r.step = Step::Read(f),
                    None => {
                        r.op += 1;
                        r.step = Step::Start;
                    }
                }
            }
        }
    }
}

/// The signature of a forwarded broadcast from `root` (the root is in a real signature too).
fn fwd_sig(root: usize) -> u32 {
    100 + small(root)
}

/// The signature of a broadcast from `root` whose root defers its wait.
fn defer_sig(root: usize) -> u32 {
    200 + small(root)
}

/// The same random program for `n` ranks: `ops` ops, about half of them by LL lines, on 3+
/// ranks about a quarter forwarded broadcasts from a random root, and about a quarter (of the
/// rest on 3+ ranks) broadcasts whose root defers its wait.
fn programs(n: usize, ops: usize, seed: u64) -> Vec<Vec<Op>> {
    let mut rng = Xorshift(seed | 1);
    let one: Vec<Op> = (0..ops)
        .map(|k| {
            let x = rng.next();
            let root = ((x >> 24) % n as u64) as usize;
            if n >= 3 && (x >> 16).is_multiple_of(4) {
                (fwd_sig(root), small(k), false, Some(root), None)
            } else if (x >> 32).is_multiple_of(4) {
                (defer_sig(root), small(k), false, None, Some(root))
            } else {
                (
                    u32::try_from(x % 5).unwrap(),
                    small(k),
                    (x >> 8) & 1 == 1,
                    None,
                    None,
                )
            }
        })
        .collect();
    vec![one; n]
}

/// `programs` with ops on the daemon's path inserted at random places (the same on every
/// rank), about one in six, of three signatures.
// Truncation is the point: the signatures are cut from random bits.
#[allow(clippy::cast_possible_truncation)]
fn with_daemon_ops(programs: Vec<Vec<Op>>, seed: u64) -> Vec<Vec<Op>> {
    let mut rng = Xorshift(seed.wrapping_mul(6151) | 1);
    let len = programs[0].len();
    let mut at = Vec::new();
    for i in 0..=len {
        let x = rng.next();
        if x.is_multiple_of(6) {
            at.push((i, DAEMON + (x >> 8) as u32 % 3));
        }
    }
    programs
        .into_iter()
        .map(|p| {
            let mut out = Vec::new();
            // Before op i, and after the last one (i = len).
            for i in 0..=len {
                let here = at.iter().filter(|a| a.0 == i);
                out.extend(here.map(|a| (a.1, 0, false, None, None)));
                out.extend(p.get(i).copied());
            }
            out
        })
        .collect()
}

/// The epoch of op `at` of `program`: the direct ops up to it (ops on the daemon's path take
/// none).
fn epoch_of(program: &[Op], at: usize) -> u64 {
    program[..=at].iter().filter(|o| o.0 < DAEMON).count() as u64
}

/// That a run (`end`) was told of a mismatch at op `at` (0-based: epoch `at + 1`).
fn assert_mismatch_at(end: End, at: usize, what: &str) {
    match end {
        End::Mismatch { epoch, .. } => assert_eq!(epoch, at as u64 + 1, "{what}"),
        other => panic!("{what}: {other:?}, want a mismatch at op {at}"),
    }
}

#[test]
fn two_parities_never_read_another_epoch_and_always_finish() {
    for n in [2, 3, 4, 8] {
        for seed in 0..150u64 {
            let ps = programs(n, 40, seed);
            assert_eq!(
                run(&ps, 2, seed * 7919 + 1),
                End::Done,
                "{n} ranks, seed {seed}"
            );
        }
    }
}

#[test]
fn ops_on_the_daemons_path_between_direct_ones_never_raise_a_mark() {
    // The same ops on every rank, some on the daemon's path: every mark a waiting rank sees is
    // of another epoch or of no more daemon-path ops than its own (the stream writes it before
    // the rank's next direct op is issued).
    for n in [2, 3, 4, 8] {
        for seed in 0..150u64 {
            let ps = with_daemon_ops(programs(n, 40, seed), seed);
            assert!(ps[0].iter().any(|o| o.0 >= DAEMON) || seed % 10 != 0 || n > 2);
            assert_eq!(
                run(&ps, 2, seed * 7919 + 5),
                End::Done,
                "{n} ranks, seed {seed}"
            );
        }
    }
}

#[test]
fn programs_mix_ops_on_the_daemons_path() {
    let ps = with_daemon_ops(programs(3, 60, 4), 4);
    let daemon = ps[0].iter().filter(|o| o.0 >= DAEMON).count();
    assert!(
        daemon > 3 && daemon < 25,
        "{daemon} ops on the daemon's path"
    );
    assert!(ps.iter().all(|p| p == &ps[0]));
}

/// The first direct op at or after `from` in `program` made a plain op on every rank (by LL
/// lines or not, never forwarded nor deferred): its index.
fn plain_direct_op(ps: &mut [Vec<Op>], from: usize, ll: bool) -> usize {
    let at = (from..ps[0].len())
        .chain(0..from)
        .find(|&i| ps[0][i].0 < DAEMON)
        .expect("a direct op");
    for p in ps.iter_mut() {
        p[at] = (7, small(at), ll, None, None);
    }
    at
}

/// The (rank, peer, epoch) of a run of `ps` that ends told of a daemon mark; panics on any
/// other end.
fn elsewhere_of(ps: &[Vec<Op>], seed: u64, what: &str) -> (usize, usize, u64) {
    match run(ps, 2, seed) {
        End::Elsewhere { rank, peer, epoch } => (rank, peer, epoch),
        other => panic!("{what}: {other:?}"),
    }
}

/// That the same run without the marks (the mutation) never ends.
fn assert_stuck_without_marks(ps: &[Vec<Op>], seed: u64, what: &str) {
    let no_marks = Fwd {
        marks: false,
        ..AS_BUILT
    };
    assert_eq!(run_with(ps, 2, no_marks, seed), End::Stuck, "{what}");
}

#[test]
fn an_op_on_the_daemons_path_against_a_direct_one_is_told_at_once() {
    // One rank sends an op to the daemon's path (its count past the direct limit) where the
    // others run it as a direct op: a rank that waits for its flag sees its mark at that op's
    // epoch. Without the marks every rank waits forever (the kernel's timeout would end it).
    for n in [2, 3, 4] {
        for seed in 0..100u64 {
            let mut ps = with_daemon_ops(programs(n, 12, seed), seed);
            let at = plain_direct_op(&mut ps, (seed % 12) as usize, seed % 3 == 0);
            let odd = (usize_of(seed) / 12) % n;
            ps[odd][at] = (DAEMON + 9, 0, false, None, None);
            let want = epoch_of(&ps[(odd + 1) % n], at);
            let what = format!("{n} ranks, seed {seed}");
            let (_, peer, epoch) = elsewhere_of(&ps, seed * 37 + 11, &what);
            assert_eq!((peer, epoch), (odd, want), "{what}");
            assert_stuck_without_marks(&ps, seed * 37 + 11, &what);
        }
    }
}

#[test]
fn ops_issued_in_different_orders_across_the_paths_are_told_at_once() {
    // Rank 0 issues a direct op, then one on the daemon's path; the others the same two the
    // other way round. Each path's ops would pair with the same op of the peers, but the
    // streams wait for each other (rank 0's direct op for the others' flags, their daemon op
    // for rank 0's): without the marks nothing moves; with them rank 0 is told.
    for n in [2, 3, 4] {
        for seed in 0..100u64 {
            let mut ps = with_daemon_ops(programs(n, 10, seed), seed);
            let at = plain_direct_op(&mut ps, (seed % 10) as usize, seed % 2 == 0);
            for (r, p) in ps.iter_mut().enumerate() {
                let y = (DAEMON + 7, 0, false, None, None);
                p.insert(if r == 0 { at + 1 } else { at }, y);
            }
            let want = epoch_of(&ps[0], at);
            let what = format!("{n} ranks, seed {seed}");
            let (rank, _, epoch) = elsewhere_of(&ps, seed * 41 + 3, &what);
            assert_eq!((rank, epoch), (0, want), "{what}");
            assert_stuck_without_marks(&ps, seed * 41 + 3, &what);
        }
    }
}

#[test]
fn a_root_that_deferred_its_wait_is_told_of_the_daemons_path_at_its_next_op() {
    // The op is a broadcast whose root defers its wait; one non-root sends it to the daemon's
    // path instead. The other non-roots wait for its flag and see its mark; on 2 ranks only
    // the root is left, which ends its op at once and is told at its next direct op, by the
    // daemon-path count it kept with the deferred op.
    for n in [2, 3, 4] {
        for seed in 0..60u64 {
            let mut ps = programs(n, 8, seed);
            let at = (seed % 6) as usize;
            let root = (usize_of(seed) / 6) % n;
            let odd = (root + 1 + usize_of(seed) % (n - 1)) % n;
            for p in ps.iter_mut() {
                p[at] = (defer_sig(root), small(at), false, None, Some(root));
                p[at + 1] = (7, small(at) + 1, seed % 2 == 0, None, None);
            }
            ps[odd][at] = (DAEMON + 9, 0, false, None, None);
            let what = format!("{n} ranks, seed {seed}");
            let (_, peer, epoch) = elsewhere_of(&ps, seed * 43 + 9, &what);
            assert_eq!((peer, epoch), (odd, at as u64 + 1), "{what}");
        }
    }
}

#[test]
fn one_parity_is_caught_overwriting_a_slot_being_read() {
    // The mutation the design rules out: the model must be able to fail.
    let mut caught = 0;
    for seed in 0..200u64 {
        let ps = programs(3, 30, seed);
        let r = std::panic::catch_unwind(|| run(&ps, 1, seed * 104_729 + 3));
        if r.is_err() || matches!(r, Ok(End::Mismatch { .. })) {
            caught += 1;
        }
    }
    assert!(caught > 0, "one parity never went wrong in 200 schedules");
}

#[test]
fn ranks_that_run_different_ops_are_told_not_paired() {
    for seed in 0..100u64 {
        let mut ps = programs(4, 20, seed);
        // Rank 2 captured one more op at position 5: every later op's capture index differs.
        ps[2].insert(5, (9, 5, seed % 2 == 0, None, None));
        for (i, op) in ps[2].iter_mut().enumerate().skip(6) {
            op.1 = small(i);
        }
        assert_mismatch_at(run(&ps, 2, seed + 11), 5, &format!("seed {seed}"));
        // Same signatures but another count of ops at the end: the short rank finishes, the
        // others wait (the kernel's timeout or the daemon's broken hint ends that wait), but
        // for a broadcast whose root defers its wait: that root ends its extra op as NCCL's
        // root ends a send that fits the peer's buffer (its own result is right; a later op
        // of it would check the peer's flag of that epoch).
        let mut ps = programs(2, 10, seed);
        let extra = ps[1].pop().and_then(|o| o.4);
        let want = if extra == Some(0) {
            End::Done
        } else {
            End::Stuck
        };
        assert_eq!(run(&ps, 2, seed + 13), want, "seed {seed}");
    }
}

#[test]
fn an_op_by_lines_against_the_same_op_by_flags_is_a_mismatch_on_either_side() {
    // The same signature and index, one rank by LL lines and the other by flags (another count
    // across the LL limit): whichever rank looks first is told, at that op.
    for n in [2, 3, 4] {
        for seed in 0..100u64 {
            let mut ps = programs(n, 12, seed);
            let at = (seed % 12) as usize;
            let odd = (usize_of(seed) / 12) % n;
            // (A broadcast never moves by lines: make that op a plain one first.)
            for p in ps.iter_mut() {
                if p[at].3.is_some() || p[at].4.is_some() {
                    p[at] = (7, small(at), false, None, None);
                }
            }
            ps[odd][at].2 = !ps[odd][at].2;
            assert_mismatch_at(
                run(&ps, 2, seed * 31 + 5),
                at,
                &format!("{n} ranks, seed {seed}"),
            );
        }
    }
}

#[test]
fn programs_mix_both_kinds_of_op() {
    let ps = programs(2, 40, 3);
    let lines = ps[0].iter().filter(|o| o.2).count();
    assert!(lines > 5 && lines < 35, "{lines} of 40 by lines");
}

#[test]
fn programs_mix_forwarded_broadcasts_from_every_root() {
    let ps = programs(4, 200, 5);
    let roots: std::collections::HashSet<usize> = ps[0].iter().filter_map(|o| o.3).collect();
    assert_eq!(roots.len(), 4, "{roots:?}");
    assert!(programs(2, 200, 5)[0].iter().all(|o| o.3.is_none()));
}

#[test]
fn forwarded_broadcasts_whose_roots_differ_are_told_not_stuck() {
    // Each rank's root the next rank: every non-root waits for its root, which waits in turn.
    for n in [3, 4, 8] {
        for seed in 0..60u64 {
            let mut ps = programs(n, 10, seed);
            let at = (seed % 10) as usize;
            for (r, p) in ps.iter_mut().enumerate() {
                let root = (r + 1) % n;
                p[at] = (fwd_sig(root), small(at), false, Some(root), None);
            }
            assert_mismatch_at(
                run(&ps, 2, seed * 13 + 7),
                at,
                &format!("{n} ranks, seed {seed}"),
            );
            // Without the early signatures the cycle never ends (the kernel's timeout would).
            let no_early = Fwd {
                early: false,
                ..AS_BUILT
            };
            assert_eq!(
                run_with(&ps, 2, no_early, seed * 13 + 7),
                End::Stuck,
                "{n} ranks, seed {seed}"
            );
        }
    }
}

#[test]
fn a_forward_before_the_roots_flag_is_caught() {
    // The mutation: a non-root forwards its part without waiting for the root's flag.
    let no_wait = Fwd {
        wait_root: false,
        ..AS_BUILT
    };
    let mut caught = 0;
    for seed in 0..200u64 {
        let ps = programs(4, 30, seed);
        let r = std::panic::catch_unwind(|| run_with(&ps, 2, no_wait, seed * 7 + 1));
        if r.is_err() {
            caught += 1;
        }
    }
    assert!(
        caught > 0,
        "forwarding before the root's flag never went wrong in 200 schedules"
    );
}

#[test]
fn programs_mix_deferred_broadcasts_from_every_root() {
    for n in [2, 4] {
        let ps = programs(n, 200, 9);
        let roots: std::collections::HashSet<usize> = ps[0].iter().filter_map(|o| o.4).collect();
        assert_eq!(roots.len(), n, "{n} ranks: {roots:?}");
    }
}

#[test]
fn a_deferred_wait_left_out_is_caught() {
    // The mutation: a root that deferred its wait starts its next op without it.
    let no_wait = Fwd {
        deferred_wait: false,
        ..AS_BUILT
    };
    let mut caught = 0;
    for seed in 0..300u64 {
        // Mostly deferred broadcasts, so that a root runs several in a row.
        let mut ps = programs(3, 30, seed);
        for (i, op) in ps[0].clone().iter().enumerate() {
            if i % 3 != 2 {
                let root = (usize_of(seed) + i / 6) % 3;
                for p in ps.iter_mut() {
                    p[i] = (defer_sig(root), op.1, false, None, Some(root));
                }
            }
        }
        let r = std::panic::catch_unwind(|| run_with(&ps, 2, no_wait, seed * 17 + 3));
        if r.is_err() || matches!(r, Ok(End::Mismatch { .. })) {
            caught += 1;
        }
        // As built, the same programs finish with every read right.
        assert_eq!(run(&ps, 2, seed * 17 + 3), End::Done, "seed {seed}");
    }
    assert!(
        caught > 0,
        "leaving out the deferred wait never went wrong in 300 schedules"
    );
}

#[test]
fn a_deferred_broadcast_against_another_op_is_told_at_that_op() {
    // One rank runs another op where the others run a broadcast whose root defers its wait:
    // the root, the odd rank or not, is told at that op's epoch (a non-root at its wait, the
    // root by its next op's late wait), never paired.
    for n in [2, 3, 4] {
        for seed in 0..100u64 {
            let mut ps = programs(n, 12, seed);
            let at = (seed % 11) as usize;
            let root = (usize_of(seed) / 11) % n;
            let odd = (usize_of(seed) / 7) % n;
            for p in ps.iter_mut() {
                p[at] = (defer_sig(root), small(at), false, None, Some(root));
            }
            ps[odd][at] = (7, small(at), seed % 2 == 0, None, None);
            assert_mismatch_at(
                run(&ps, 2, seed * 29 + 1),
                at,
                &format!("{n} ranks, seed {seed}, root {root}, odd rank {odd}"),
            );
        }
    }
}
