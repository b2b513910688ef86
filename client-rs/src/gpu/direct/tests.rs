//! Unit tests of the direct path's host side: settings, plans, signatures, records.

use super::config::*;
use super::plan::*;
use super::signature::*;
use super::*;
use commd_proto::desc::{DType, OpKind, RedOp};

#[test]
fn config_parses_and_refuses_bad_values() {
    let c = Config::parse(None, None, None).unwrap();
    assert_eq!(
        c,
        Config {
            enabled: true,
            shared_gpus: false,
            max_bytes: None,
            blocks: DEFAULT_BLOCKS
        }
    );
    let mib = 1u64 << 20;
    // (ranks, whole ops, copies, split shares, slots)
    let want = [
        (2, 16 * mib, 8 * mib, 8 * mib, 16 * mib),
        (3, 4 * mib, 8 * mib, 8 * mib, 8 * mib),
        (4, 2 * mib, 8 * mib, 8 * mib, 8 * mib),
        (5, 2 * mib, 4 * mib, 4 * mib, 4 * mib),
        (6, mib, 4 * mib, 4 * mib, 4 * mib),
        (7, mib, 4 * mib, 4 * mib, 4 * mib),
        (8, mib, 2 * mib, 4 * mib, 4 * mib),
    ];
    for (n, whole, push, share, slot) in want {
        let lim = c.limits(n);
        assert_eq!(lim, Limits { whole, push, share }, "{n} ranks");
        assert_eq!(lim.slot(), slot, "{n} ranks");
        assert_eq!(lim.of(k::MODE_AR), whole);
        assert_eq!(lim.of(k::MODE_A2A), push);
        assert_eq!(lim.of(k::MODE_RS), whole.max(push), "{n} ranks");
        assert!(lim.of(k::MODE_RS) <= slot);
        // Every rank's GPU sends (n - 1) x a copy at most 24 MiB; on 3+ ranks a push is
        // within the split's share (it never widens the slot); a window is at most 64 MiB
        // of data slots and 16 x 8 KiB of LL lines.
        assert!((u64::from(n) - 1) * push <= 24 * mib);
        assert!(n == 2 || push <= share, "{n} ranks");
        assert!(window_bytes(n, slot) <= 64 * mib + k::DATA_OFF + 16 * k::LL_SLOT_BYTES);
    }
    // A set limit is every limit, and the slot (rounded up to 4 KiB).
    let set = Config::parse(None, Some("65536"), None).unwrap();
    for n in [2, 4, 8] {
        assert_eq!(set.limits(n), Limits::all(65536));
        assert_eq!(set.limits(n).slot(), 65536);
    }
    assert_eq!(Limits::all(5000).slot(), 8192);
    assert!(!Config::parse(Some("0"), None, None).unwrap().enabled);
    assert!(!Config::parse(Some("off"), None, None).unwrap().enabled);
    let sh = Config::parse(Some("shared"), None, None).unwrap();
    assert!(sh.enabled && sh.shared_gpus);
    assert_eq!(
        Config::parse(None, Some("65536"), Some("8")).unwrap(),
        Config {
            enabled: true,
            shared_gpus: false,
            max_bytes: Some(65536),
            blocks: 8
        }
    );
    for (m, x, b) in [
        (Some("yes"), None, None),
        (None, Some("-1"), None),
        (None, Some("lots"), None),
        (None, None, Some("0")),
        (None, None, Some("5000")),
    ] {
        let e = Config::parse(m, x, b).unwrap_err();
        assert!(e.contains("COMMD_GRAPH_DIRECT"), "{e}");
    }
}

#[test]
fn an_all_reduce_splits_only_past_the_limit_with_a_share_within_it() {
    let mib = 1u64 << 20;
    let max = default_max_bytes(4); // 2 MiB
    let split = |count, n, most| split_share(count, 4, n, max, max, most);
    // Within the limit: one direct all-reduce.
    assert_eq!(split(max / 4, 4, u64::MAX), None);
    // 4 and 8 MiB of f32 on 4 ranks: shares of 1 and 2 MiB.
    assert_eq!(split(mib, 4, u64::MAX), Some(mib / 4));
    assert_eq!(split(2 * mib, 4, u64::MAX), Some(mib / 2));
    // A remainder modulo the ranks is left to a small all-reduce of its own.
    assert_eq!(split(mib + 3, 4, u64::MAX), Some(mib / 4));
    // Past 4 x the limit the share does not fit a window slot.
    assert_eq!(split(2 * mib + 4, 4, u64::MAX), None);
    // COMMD_DIRECT_SPLIT_MAX_BYTES: 0 splits nothing; a lower value stops it there.
    assert_eq!(split(mib, 4, 0), None);
    assert_eq!(split(mib, 4, 4 * mib), Some(mib / 4));
    assert_eq!(split(mib + 1, 4, 4 * mib), None);
    // One rank: nothing to split, and its limits are defined (a group of one asks for
    // them before it finds that it runs no direct op, so they must not divide by zero).
    assert_eq!(split(mib, 1, u64::MAX), None);
    let lim1 = Config::parse(None, None, None).unwrap().limits(1);
    assert!(
        lim1.whole > 0 && lim1.push > 0 && lim1.share > 0,
        "{lim1:?}"
    );
    assert!(window_bytes(1, lim1.slot()) > 0);
    // 2 ranks by default: one direct op up to 16 MiB, and a share of a larger one (8 MiB
    // or more) past the split's 8 MiB: nothing splits.
    let lim = Config::parse(None, None, None).unwrap().limits(2);
    let split2 = |count| split_share(count, 4, 2, lim.whole, lim.share, u64::MAX);
    assert_eq!(split2(4 * mib), None);
    assert_eq!(split2(4 * mib + 2), None);
    assert_eq!(split2(16 * mib), None);
    // 4 ranks by default: one direct op up to 2 MiB, then shares of up to 8 MiB (32 MiB).
    let lim4 = Config::parse(None, None, None).unwrap().limits(4);
    let split4 = |count| split_share(count, 4, 4, lim4.whole, lim4.share, u64::MAX);
    assert_eq!(split4(mib / 2), None);
    assert_eq!(split4(mib / 2 + 1), Some(mib / 8));
    assert_eq!(split4(4 * mib), Some(mib));
    assert_eq!(split4(8 * mib + 3), Some(2 * mib));
    assert_eq!(split4(8 * mib + 4), None);
    // 2 ranks with the limit set to 4 MiB: split up to 8 MiB.
    let m2 = 4 * mib;
    assert_eq!(split_share(2 * mib, 4, 2, m2, m2, u64::MAX), Some(mib));
    assert_eq!(split_share(2 * mib + 2, 4, 2, m2, m2, u64::MAX), None);
    assert_eq!(SPLIT_MAX.parse(None).unwrap(), u64::MAX);
    assert_eq!(SPLIT_MAX.parse(Some("0")).unwrap(), 0);
    assert_eq!(SPLIT_MAX.parse(Some("8388608")).unwrap(), 8 * mib);
    for bad in ["-1", "x", "99999999999999"] {
        let e = SPLIT_MAX.parse(Some(bad)).unwrap_err();
        assert!(
            e.contains("COMMD_DIRECT_SPLIT_MAX_BYTES") && e.contains(bad),
            "{e}"
        );
    }
}

#[test]
fn a_reduce_past_the_limit_on_two_ranks_runs_in_chunks_of_the_limit() {
    let mib = 1u64 << 20;
    let lim = Config::parse(None, None, None).unwrap().limits(2);
    let how = |kind, count, n, most| split_how(kind, count, 4, n, lim, most);
    // Within the 16 MiB limit: one direct op.
    assert_eq!(how(OpKind::Reduce, 4 * mib, 2, u64::MAX), None);
    // Past it: chunks of 16 MiB (4 Mi f32), the last one shorter (4 Mi + 1 elements still
    // make a remainder of 1 and shares of 8 MiB).
    assert_eq!(
        how(OpKind::Reduce, 4 * mib + 1, 2, u64::MAX),
        Some(Split::Shares(2 * mib))
    );
    assert_eq!(
        how(OpKind::Reduce, 4 * mib + 2, 2, u64::MAX),
        Some(Split::Chunks(4 * mib))
    );
    // Up to 4 chunks (64 MiB); past that the daemon's path.
    assert_eq!(
        how(OpKind::Reduce, 16 * mib, 2, u64::MAX),
        Some(Split::Chunks(4 * mib))
    );
    assert_eq!(how(OpKind::Reduce, 16 * mib + 1, 2, u64::MAX), None);
    // Rank `me` of `n`'s plan of a reduce to root 0 of `count` f32 in chunks of `chunk`,
    // its input at 0x1000 and no output (a non-root).
    let reduce_plan = |count, n, me, chunk| {
        split_plan(
            OpKind::Reduce,
            count,
            4,
            n,
            me,
            0,
            Some(0x1000),
            None,
            Split::Chunks(chunk),
        )
        .unwrap()
    };
    let plan = reduce_plan(9 * mib, 2, 1, 4 * mib);
    let counts: Vec<u64> = plan.iter().map(|p| p.count).collect();
    assert_eq!(counts, [4 * mib, 4 * mib, mib]);
    assert_eq!(plan[1].send, Some(0x1000 + 16 * mib));
    assert_eq!(plan[2].recv, None);
    // COMMD_DIRECT_SPLIT_MAX_BYTES bounds chunks too.
    assert_eq!(how(OpKind::Reduce, 8 * mib, 2, 0), None);
    assert_eq!(
        how(OpKind::Reduce, 8 * mib, 2, 32 * mib),
        Some(Split::Chunks(4 * mib))
    );
    assert_eq!(how(OpKind::Reduce, 8 * mib + 1, 2, 32 * mib), None);
    // Only a reduce, only on 2 ranks (the others measured slower as larger direct ops).
    for kind in [OpKind::AllReduce, OpKind::Broadcast, OpKind::ReduceScatter] {
        assert_eq!(how(kind, 8 * mib, 2, u64::MAX), None, "{}", kind.name());
    }
    let lim4 = Config::parse(None, None, None).unwrap().limits(4);
    let how4 = |kind, count| split_how(kind, count, 4, 4, lim4, u64::MAX);
    // On 4 ranks the shares come first: 8 MiB of f32 in 2 MiB shares, 32 MiB (and a
    // remainder) in 8 MiB ones.
    assert_eq!(how4(OpKind::Reduce, 2 * mib), Some(Split::Shares(mib / 2)));
    assert_eq!(
        how4(OpKind::Reduce, 8 * mib + 3),
        Some(Split::Shares(2 * mib))
    );
    // Past them a reduce runs in chunks of 32 MiB (8 Mi f32), each split in shares, up to
    // 4 chunks (128 MiB); the other kinds take the daemon's path.
    assert_eq!(
        how4(OpKind::Reduce, 8 * mib + 4),
        Some(Split::Chunks(8 * mib))
    );
    assert_eq!(how4(OpKind::Reduce, 32 * mib), Some(Split::Chunks(8 * mib)));
    assert_eq!(how4(OpKind::Reduce, 32 * mib + 1), None);
    for kind in [OpKind::AllReduce, OpKind::Broadcast] {
        assert_eq!(how4(kind, 16 * mib), None, "{}", kind.name());
    }
    // 64 MiB on 4 ranks: two chunks of two parts each, the second's first part marked.
    let plan = reduce_plan(16 * mib, 4, 2, 8 * mib);
    let parts: Vec<(OpKind, Part, u64)> = plan.iter().map(|p| (p.kind, p.part, p.count)).collect();
    let rs = |last| {
        (
            OpKind::ReduceScatter,
            Part::ReduceToScratch { last },
            2 * mib,
        )
    };
    let ga = (OpKind::Reduce, Part::Gather, 2 * mib);
    assert_eq!(parts, [rs(false), ga, rs(true), ga]);
    assert_eq!(plan[2].send, Some(0x1000 + 32 * mib));
    // An element larger than the limit (a set limit below it) is never a chunk of 0.
    let tiny = Limits::all(2);
    assert_eq!(split_how(OpKind::Reduce, 8, 4, 2, tiny, u64::MAX), None);
    // A limit that is no multiple of the element size: never a fifth chunk.
    let odd = Limits::all(1_000_001);
    let five = 4 * 250_000 + 1;
    assert_eq!(split_how(OpKind::Reduce, five, 4, 2, odd, u64::MAX), None);
    assert_eq!(
        split_how(OpKind::Reduce, five - 1, 4, 2, odd, u64::MAX),
        Some(Split::Chunks(250_000))
    );
    // The last chunk's mark shows in a mismatch's words.
    let last = part_signature(
        Part::Of {
            rooted: true,
            last: true,
        },
        OpKind::Reduce,
        DType::F32,
        RedOp::Sum,
        1,
    );
    assert_eq!(
        describe_sig(last),
        "reduce f32 sum root 1 (last part of a broadcast or reduce root 1 split into direct ops)"
    );
}

#[test]
fn a_part_of_a_split_all_reduce_never_pairs_with_an_op_of_its_own() {
    for kind in [OpKind::AllReduce, OpKind::ReduceScatter, OpKind::AllGather] {
        let s = signature(kind, DType::F32, RedOp::Sum, 0);
        assert_ne!(s | PART, s);
        assert_ne!(s | PART, k::ERR_SIG);
        assert_ne!(s | PART, k::LL_SIG);
    }
    let rs = signature(OpKind::ReduceScatter, DType::BF16, RedOp::Sum, 0) | PART;
    assert_eq!(
        describe_sig(rs),
        "reduce_scatter bf16 sum (part of an all_reduce split into direct ops)"
    );
}

/// Runs every rank's split plan on a host model of the direct kernel's modes (each reads
/// every input, then writes its outputs, as the kernel's pushes precede its reads): memory
/// is one map from address to element value, every rank's buffers at addresses of their
/// own, and every access is checked against the buffers the part may touch.
#[test]
fn split_plans_compute_the_whole_op_on_every_rank() {
    use std::collections::HashMap;
    const ES: u64 = 4;
    let base = |r: u32| 0x1000_0000 + u64::from(r) * 0x100_0000;
    let scratch = |r: u32| base(r) + 0xF0_0000;
    for kind in [OpKind::AllReduce, OpKind::Broadcast, OpKind::Reduce] {
        for n in 2..=8u32 {
            let n64 = u64::from(n);
            for count in [n64 * 5, n64 * 5 + 1, n64 * 7 + n64 - 1] {
                let share = count / n64;
                let roots = if kind.has_root() { 0..n } else { 0..1 };
                // Shares, and chunks that divide the count, leave a short last one, or
                // are the whole count.
                // (On 3+ ranks only a reduce runs in chunks, each split in shares.)
                let splits = [
                    Split::Shares(share),
                    Split::Chunks(5),
                    Split::Chunks(count / 3),
                    Split::Chunks(count),
                    Split::Chunks(n64 * 2),
                ];
                let chunks_here = n == 2 || kind == OpKind::Reduce;
                for (root, split, in_place) in roots
                    .flat_map(|r| splits.map(|s| (r, s)))
                    .filter(|(_, s)| chunks_here || matches!(s, Split::Shares(_)))
                    .flat_map(|(r, s)| [(r, s, false), (r, s, true)])
                {
                    let what = format!(
                        "{} n={n} count={count} root={root} in_place={in_place} {split:?}",
                        kind.name()
                    );
                    let send = |r: u32| base(r);
                    let recv = |r: u32| base(r) + if in_place { 0 } else { 0x80_0000 };
                    let input =
                        |r: u32, i: u64| i64::from(r + 1) * 1000 + i64::try_from(i).unwrap();
                    let mut mem: HashMap<u64, i64> = HashMap::new();
                    for r in 0..n {
                        for i in 0..count {
                            mem.insert(recv(r) + i * ES, -7);
                            mem.insert(send(r) + i * ES, input(r, i));
                        }
                    }
                    // What NCCL callers may pass: no send on a broadcast's non-root, no
                    // recv on a reduce's non-root (out of place only: torch passes one
                    // tensor for both).
                    let given: Vec<(Option<u64>, Option<u64>)> = (0..n)
                        .map(|r| {
                            let s = (kind != OpKind::Broadcast || r == root || in_place)
                                .then_some(send(r));
                            let v = (kind != OpKind::Reduce || r == root || in_place)
                                .then_some(recv(r));
                            (s, v)
                        })
                        .collect();
                    let plans: Vec<Vec<PlannedPart>> = (0..n)
                        .map(|r| {
                            let (s, v) = given[r as usize];
                            split_plan(kind, count, ES, n, r, root, s, v, split)
                                .unwrap_or_else(|e| panic!("{what}: {e}"))
                        })
                        .collect();
                    // Chunks: in order, within the chunk, only the last one marked (on
                    // 3+ ranks its first part, the chunks being split in shares).
                    if let Split::Chunks(c) = split {
                        let p = &plans[0];
                        let marked: Vec<usize> =
                            (0..p.len()).filter(|&j| p[j].part.last()).collect();
                        assert_eq!(marked.len(), 1, "{what}: marked parts {marked:?}");
                        // Parts of a chunk: one op on 2 ranks (or of fewer elements than
                        // ranks), else a split's two and one more for a remainder.
                        let per = |e: u64| {
                            if n == 2 || e < n64 {
                                1
                            } else {
                                2 + usize::from(!e.is_multiple_of(n64))
                            }
                        };
                        let full = (count - 1) / c;
                        let first_of_last = usize::try_from(full).unwrap() * per(c);
                        assert_eq!(marked[0], first_of_last, "{what}");
                        assert_eq!(p.len(), first_of_last + per(count - full * c), "{what}");
                        for q in p {
                            assert!(q.count <= c, "{what}");
                        }
                        if n == 2 {
                            assert_eq!(p.len() as u64, count.div_ceil(c), "{what}");
                            for (j, q) in p.iter().enumerate() {
                                let last = j + 1 == p.len();
                                assert_eq!(
                                    q.part,
                                    Part::Of {
                                        rooted: kind.has_root(),
                                        last
                                    },
                                    "{what}: part {j}"
                                );
                            }
                        }
                    }
                    for (j, p0) in plans[0].iter().enumerate() {
                        let ps: Vec<PlannedPart> = plans.iter().map(|p| p[j]).collect();
                        for p in &ps {
                            assert_eq!(
                                (p.kind, p.part, p.count),
                                (p0.kind, p0.part, p0.count),
                                "{what}: part {j} differs across ranks"
                            );
                        }
                        let c = p0.count;
                        let mode = p0.part.mode(p0.kind).unwrap();
                        // Each rank's (input, output) address, its scratch slot where the
                        // part says so, and the ranges it may touch.
                        let io: Vec<(u64, u64, u64, u64)> = (0..n)
                            .map(|r| {
                                let p = ps[r as usize];
                                let me_root = r == root;
                                let (ss, rs) = p.part.scratch(me_root);
                                let ((su, se), (ru, re)) =
                                    p.part.buffers(p.kind, c, n64, me_root);
                                let pick = |scr: bool, uses: bool, b: Option<u64>| {
                                    if scr {
                                        return scratch(r);
                                    }
                                    if !uses {
                                        return 0;
                                    }
                                    b.unwrap_or_else(|| {
                                        panic!("{what}: part {j} rank {r}: no buffer")
                                    })
                                };
                                let i = pick(ss, su, p.send);
                                let o = pick(rs, ru, p.recv);
                                // Within a buffer the caller passed (count elements
                                // each) or the scratch slot (a share).
                                let (gs, gv) = given[r as usize];
                                let ranges = [
                                    gs.map(|b| (b, count)),
                                    gv.map(|b| (b, count)),
                                    Some((scratch(r), share)),
                                ];
                                for (addr, elems) in [(i, se), (o, re)] {
                                    if addr == 0 {
                                        continue;
                                    }
                                    let end = addr + elems.unwrap() * ES;
                                    assert!(
                                        ranges.iter().flatten().any(|&(lo, len)| {
                                            addr >= lo && end <= lo + len * ES
                                        }),
                                        "{what}: part {j} rank {r} touches {addr:#x}..{end:#x}, outside its buffers"
                                    );
                                }
                                let elems = |uses: bool, e: Option<u64>| {
                                    if uses { e.unwrap() } else { 0 }
                                };
                                let (se, re) = (elems(su || ss, se), elems(ru || rs, re));
                                // Input and output overlap only as the kernel's in-place
                                // layouts (its own input is read again after the
                                // peers' data was written into the output).
                                let me64 = u64::from(r);
                                if i != 0 && o != 0 && i < o + re * ES && o < i + se * ES {
                                    let fine = match mode {
                                        k::MODE_AR | k::MODE_BC | k::MODE_RED => i == o,
                                        k::MODE_RS | k::MODE_SC => i + me64 * c * ES == o,
                                        k::MODE_AG | k::MODE_GA => o + me64 * c * ES == i,
                                        _ => false,
                                    };
                                    assert!(fine, "{what}: part {j} rank {r}: input and output overlap");
                                }
                                (i, o, se, re)
                            })
                            .collect();
                        // Rank r's input element x (within what the part
                        // declares), and rank me's output element x.
                        let rd = |m: &HashMap<u64, i64>, r: u32, x: u64| {
                            let (a, _, se, _) = io[r as usize];
                            assert!(
                                x < se,
                                "{what}: part {j} reads rank {r}'s input past its {se} elements"
                            );
                            *m.get(&(a + x * ES)).unwrap_or_else(|| {
                                panic!("{what}: part {j} reads unwritten {:#x}", a + x * ES)
                            })
                        };
                        let sum = |m: &HashMap<u64, i64>, x: u64| {
                            (0..n).map(|r| rd(m, r, x)).sum::<i64>()
                        };
                        let mut writes = Vec::new();
                        for me in 0..n {
                            let (_, out, _, re) = io[me as usize];
                            let mut wr = |x: u64, v: i64| {
                                assert!(
                                    x < re,
                                    "{what}: part {j} writes rank {me}'s output past its {re} elements"
                                );
                                writes.push((out + x * ES, v));
                            };
                            let me64 = u64::from(me);
                            for i in 0..c {
                                match mode {
                                    k::MODE_AR => wr(i, sum(&mem, i)),
                                    k::MODE_RS => wr(i, sum(&mem, me64 * c + i)),
                                    k::MODE_BC => wr(i, rd(&mem, root, i)),
                                    k::MODE_SC => wr(i, rd(&mem, root, me64 * c + i)),
                                    k::MODE_RED if me == root => wr(i, sum(&mem, i)),
                                    k::MODE_AG => {
                                        for r in 0..n {
                                            wr(u64::from(r) * c + i, rd(&mem, r, i));
                                        }
                                    }
                                    k::MODE_GA if me == root => {
                                        for r in 0..n {
                                            wr(u64::from(r) * c + i, rd(&mem, r, i));
                                        }
                                    }
                                    k::MODE_RED | k::MODE_GA => {}
                                    m => panic!("{what}: mode {m} in a split plan"),
                                }
                            }
                        }
                        mem.extend(writes);
                    }
                    let total = |i: u64| (0..n).map(|r| input(r, i)).sum::<i64>();
                    for r in 0..n {
                        for i in 0..count {
                            let got = mem[&(recv(r) + i * ES)];
                            let want = match kind {
                                OpKind::AllReduce => total(i),
                                OpKind::Broadcast => input(root, i),
                                _ if r == root => total(i),
                                // A non-root's buffers are left as they were.
                                _ if in_place => input(r, i),
                                _ => -7,
                            };
                            assert_eq!(got, want, "{what}: rank {r} element {i}");
                            if kind == OpKind::Reduce && !in_place {
                                assert_eq!(mem[&(send(r) + i * ES)], input(r, i), "{what}");
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_split_plan_without_a_buffer_it_needs_is_an_error() {
    for split in [Split::Shares(10), Split::Chunks(10)] {
        for n in [2, 4] {
            let plan = |kind, me, root, send, recv| {
                // On 4 ranks only a reduce runs in chunks.
                let n = if kind == OpKind::Reduce || matches!(split, Split::Shares(_)) {
                    n
                } else {
                    2
                };
                split_plan(kind, 41, 4, n, me, root, send, recv, split)
            };
            a_plan_without_a_buffer_it_needs_is_an_error(plan);
        }
    }
    for kind in [OpKind::AllReduce, OpKind::Broadcast] {
        let b = Some(0x1000u64);
        let e = split_plan(kind, 41, 4, 3, 0, 0, b, b, Split::Chunks(12)).unwrap_err();
        assert!(e.contains("never runs in chunks on 3 ranks"), "{e}");
    }
}

fn a_plan_without_a_buffer_it_needs_is_an_error(
    plan: impl Fn(
        OpKind,
        u32,
        u32,
        Option<u64>,
        Option<u64>,
    ) -> std::result::Result<Vec<PlannedPart>, String>,
) {
    let b = Some(0x1000u64);
    for (kind, me, root, send, recv, want) in [
        (
            OpKind::AllReduce,
            0,
            0,
            None,
            b,
            "all_reduce needs a send buffer",
        ),
        (
            OpKind::AllReduce,
            1,
            0,
            b,
            None,
            "all_reduce needs a recv buffer",
        ),
        (
            OpKind::Broadcast,
            2,
            2,
            None,
            b,
            "broadcast needs a send buffer",
        ),
        (
            OpKind::Broadcast,
            1,
            2,
            b,
            None,
            "broadcast needs a recv buffer",
        ),
        (
            OpKind::Reduce,
            1,
            3,
            None,
            None,
            "reduce needs a send buffer",
        ),
        (OpKind::Reduce, 3, 3, b, None, "reduce needs a recv buffer"),
        (OpKind::AllGather, 0, 0, b, b, "never split"),
    ] {
        let e = plan(kind, me, root, send, recv).unwrap_err();
        assert!(e.contains(want), "{e}");
    }
    // What a non-root may leave out: a broadcast's send, a reduce's recv.
    assert!(plan(OpKind::Broadcast, 1, 2, None, b).is_ok());
    assert!(plan(OpKind::Reduce, 1, 3, b, None).is_ok());
}

#[test]
fn parts_of_split_ops_never_pair_across_kinds_or_roots() {
    use OpKind::*;
    let (f, sum) = (DType::F32, RedOp::Sum);
    let of = Part::Of {
        rooted: false,
        last: false,
    };
    let rooted = Part::Of {
        rooted: true,
        last: false,
    };
    let last = Part::Of {
        rooted: true,
        last: true,
    };
    let mut sigs = vec![
        // all-reduce: tail, reduce-scatter, all-gather
        part_signature(of, AllReduce, f, sum, 0),
        part_signature(of, ReduceScatter, f, sum, 0),
        part_signature(of, AllGather, f, sum, 0),
    ];
    for root in 0..8 {
        sigs.extend([
            // broadcast: tail, scatter, all-gather
            part_signature(rooted, Broadcast, f, sum, root),
            part_signature(Part::Scatter, Broadcast, f, sum, root),
            part_signature(rooted, AllGather, f, sum, root),
            // reduce: tail, reduce-scatter, gather; its chunks and last chunk
            part_signature(rooted, Reduce, f, sum, root),
            part_signature(last, Reduce, f, sum, root),
            part_signature(
                Part::ReduceToScratch { last: false },
                ReduceScatter,
                f,
                sum,
                root,
            ),
            part_signature(Part::Gather, Reduce, f, sum, root),
            // the first part of a last chunk split in shares (3+ ranks)
            part_signature(
                Part::ReduceToScratch { last: true },
                ReduceScatter,
                f,
                sum,
                root,
            ),
        ]);
    }
    let wholes: Vec<u32> = commd_proto::desc::ALL_OPS
        .iter()
        .flat_map(|&kind| (0..8).map(move |root| signature(kind, f, sum, root)))
        .collect();
    for (i, s) in sigs.iter().enumerate() {
        assert_ne!(*s, k::ERR_SIG);
        assert_ne!(*s, k::LL_SIG);
        assert!(
            !wholes.contains(s),
            "{s:#x} ({}) pairs with a whole op",
            describe_sig(*s)
        );
        assert!(
            !sigs[..i].contains(s),
            "{s:#x} ({}) twice",
            describe_sig(*s)
        );
    }
    assert_eq!(
        describe_sig(part_signature(
            Part::Scatter,
            Broadcast,
            DType::BF16,
            sum,
            3
        )),
        "scatter bf16 (part of a broadcast root 3 split into direct ops)"
    );
    assert_eq!(
        describe_sig(part_signature(Part::Gather, Reduce, f, RedOp::Max, 2)),
        "gather f32 (part of a reduce root 2 split into direct ops)"
    );
    assert_eq!(
        describe_sig(part_signature(
            Part::ReduceToScratch { last: false },
            ReduceScatter,
            f,
            sum,
            1
        )),
        "reduce_scatter f32 sum (part of a broadcast or reduce root 1 split into direct ops)"
    );
    assert_eq!(
        describe_sig(part_signature(
            Part::ReduceToScratch { last: true },
            ReduceScatter,
            f,
            sum,
            1
        )),
        "reduce_scatter f32 sum (last part of a broadcast or reduce root 1 split into direct ops)"
    );
    assert_eq!(
        describe_sig(part_signature(of, AllGather, f, sum, 5)),
        "all_gather f32 (part of an all_reduce split into direct ops)"
    );
    assert_eq!(
        part_signature(Part::Whole, Reduce, f, sum, 2),
        signature(Reduce, f, sum, 2)
    );
}

#[test]
fn signatures_differ_per_field_and_never_equal_the_error_mark() {
    let a = signature(OpKind::AllReduce, DType::F32, RedOp::Sum, 0);
    assert_ne!(a, signature(OpKind::AllReduce, DType::BF16, RedOp::Sum, 0));
    assert_ne!(a, signature(OpKind::AllReduce, DType::F32, RedOp::Max, 0));
    assert_ne!(
        a,
        signature(OpKind::ReduceScatter, DType::F32, RedOp::Sum, 0)
    );
    assert_ne!(a, k::ERR_SIG);
    assert_ne!(a, k::LL_SIG);
    assert_eq!(describe_sig(a), "all_reduce f32 sum");
    // The root counts only where there is one.
    assert_eq!(a, signature(OpKind::AllReduce, DType::F32, RedOp::Sum, 3));
    let b = signature(OpKind::Broadcast, DType::BF16, RedOp::Sum, 1);
    assert_ne!(b, signature(OpKind::Broadcast, DType::BF16, RedOp::Sum, 0));
    assert_eq!(describe_sig(b), "broadcast bf16 root 1");
    let r = signature(OpKind::Reduce, DType::F32, RedOp::Max, 7);
    assert_eq!(describe_sig(r), "reduce f32 max root 7");
    for kind in [OpKind::Broadcast, OpKind::Reduce, OpKind::AllGather] {
        for root in 0..8 {
            assert_ne!(signature(kind, DType::I64, RedOp::Sum, root), k::ERR_SIG);
            assert_ne!(signature(kind, DType::I64, RedOp::Sum, root), k::LL_SIG);
        }
    }
}

#[test]
fn a_mismatch_names_the_fields_that_differ() {
    let sig = u64::from(signature(OpKind::AllReduce, DType::F32, RedOp::Sum, 0));
    let r = Record {
        code: k::MISMATCH,
        rank: 1,
        epoch: 7,
        mine: ((7 << 32) | sig, (3 << 32) | 32768),
        theirs: ((7 << 32) | sig, (3 << 32) | 16384),
    };
    let m = explain(&r, 0, false);
    assert!(
        m.contains("mismatch") && m.contains("count: rank 0 32768 vs rank 1 16384"),
        "{m}"
    );
    assert!(!m.contains("op:") && !m.contains("captured op"), "{m}");
    let bf = u64::from(signature(OpKind::AllReduce, DType::BF16, RedOp::Sum, 0));
    let r2 = Record {
        theirs: ((7 << 32) | bf, (4 << 32) | 32768),
        ..r
    };
    let m = explain(&r2, 0, false);
    assert!(
        m.contains("all_reduce f32 sum vs rank 1 all_reduce bf16 sum"),
        "{m}"
    );
    assert!(m.contains("#3, rank 1 its #4"), "{m}");
    // The same record of an eager direct op (docs/design-gpu.md, direct collectives rule 8)
    // speaks of eager ops, not replays.
    let m = explain(&r2, 0, true);
    assert!(
        m.contains("in an eager direct op")
            && m.contains("eager direct op #3, rank 1 its #4")
            && m.contains("different sequences of collectives")
            && !m.contains("replay"),
        "{m}"
    );
    // A copy op against another: named without a reduction (all-to-all is a direct op too).
    let a2a = u64::from(signature(OpKind::AllToAll, DType::F32, RedOp::Sum, 0));
    let ag = u64::from(signature(OpKind::AllGather, DType::F32, RedOp::Sum, 0));
    let r3 = Record {
        mine: ((7 << 32) | a2a, (3 << 32) | 32768),
        theirs: ((7 << 32) | ag, (3 << 32) | 32768),
        ..r
    };
    let m = explain(&r3, 0, true);
    assert!(m.contains("all_to_all f32 vs rank 1 all_gather f32"), "{m}");
    // A peer that moved its op by LL lines (another count, under the LL limit): its flag
    // says so, and its word 1 (stale) is not reported as its count or index.
    let r4 = Record {
        theirs: ((7 << 32) | u64::from(k::LL_SIG), (9 << 32) | 5),
        ..r
    };
    let m = explain(&r4, 0, true);
    assert!(
        m.contains("mismatch")
            && m.contains("all_reduce f32 sum vs rank 1 an op of at most 4096 bytes")
            && m.contains("LL lines")
            && !m.contains("count:")
            && !m.contains("#9"),
        "{m}"
    );
    for (code, word) in [
        (k::TIMEOUT, "timed out waiting for rank 1"),
        (k::BROKEN, "broken"),
        (k::POISONED, "earlier"),
        (k::PEER_FAILED, "rank 1 reported"),
    ] {
        let m = explain(&Record { code, ..r }, 0, false);
        assert!(m.contains(word), "{code}: {m}");
    }
    // An eager op's timeout names the cause no flag can show: the peer's op took the
    // daemon's path (another count, past the direct limit).
    let t = |eager| {
        explain(
            &Record {
                code: k::TIMEOUT,
                ..r
            },
            0,
            eager,
        )
    };
    assert!(
        t(true).contains("daemon's path, past the direct limit"),
        "{}",
        t(true)
    );
    assert!(!t(false).contains("daemon"), "{}", t(false));
    // A peer whose daemon mark named this op's epoch: its path, both counts of daemon-path
    // ops, this rank's op and count, the likely causes.
    let m = explain(
        &Record {
            code: k::ELSEWHERE,
            theirs: ((7 << 32) | 3, 2),
            ..r
        },
        0,
        true,
    );
    assert!(
        m.contains("mismatched collective (direct op #7")
            && m.contains("rank 1 sent this op, or one issued before it, to the daemon's path")
            && m.contains("its collective #3 on that path")
            && m.contains("rank 0 had issued 2 there")
            && m.contains("all_reduce f32 sum, count 32768")
            && m.contains("COMMD_EAGER_DIRECT_MAX_BYTES")
            && m.contains("different orders"),
        "{m}"
    );
    assert_eq!(
        super::signature::op_error_kind(k::ELSEWHERE),
        crate::OpErrorKind::from_status(commd_proto::desc::status::MISMATCH)
    );
}

#[test]
fn large_ops_run_on_the_whole_grid_and_every_op_takes_the_same_tickets() {
    let mib = 1u64 << 20;
    // 4 ranks: a 1 MiB op pushes 3 MiB (half the grid), a 2 MiB one 6 MiB (all of it).
    let one = 4096;
    assert_eq!(launch_grid(128, mib, 4, one), (64, 2));
    assert_eq!(launch_grid(128, 2 * mib, 4, one), (128, 1));
    // 2 ranks: only 4 MiB ops and larger reach the threshold.
    assert_eq!(launch_grid(128, 4 * mib - 1, 2, one), (64, 2));
    assert_eq!(launch_grid(128, 4 * mib, 2, one), (128, 1));
    assert_eq!(launch_grid(128, 4097, 8, one), (64, 2));
    // Up to 4 KiB: one block with every ticket; none with the setting at 0.
    assert_eq!(launch_grid(128, 8, 8, one), (1, 128));
    assert_eq!(launch_grid(128, 4096, 2, one), (1, 128));
    assert_eq!(launch_grid(128, 8, 8, 0), (64, 2));
    for grid in [2, 64, 128, 130] {
        for bytes in [1, 4096, mib, 4 * mib] {
            for n in 2..=8 {
                for one in [0, 4096] {
                    let (blocks, unit) = launch_grid(grid, bytes, n, one);
                    assert_eq!(blocks * unit, grid, "{grid} {bytes} {n} {one}");
                }
            }
        }
    }
}

#[test]
fn small_op_settings_take_their_range_and_refuse_the_rest() {
    assert_eq!(ONE_BLOCK_MAX.parse(None).unwrap(), 4096);
    assert_eq!(ONE_BLOCK_MAX.parse(Some("0")).unwrap(), 0);
    assert_eq!(ONE_BLOCK_MAX.parse(Some(" 8192 ")).unwrap(), 8192);
    assert_eq!(LL_MAX.parse(None).unwrap(), k::LL_MAX_BYTES);
    assert_eq!(LL_MAX.parse(Some("")).unwrap(), k::LL_MAX_BYTES);
    assert_eq!(LL_MAX.parse(Some("1024")).unwrap(), 1024);
    // The deferred wait: off unless set to 1.
    assert_eq!(DEFER_WAIT.parse(None).unwrap(), 0);
    assert_eq!(DEFER_WAIT.parse(Some("1")).unwrap(), 1);
    // Past the LL area's lines, negative, not a number: refused, naming the setting.
    for (set, bad) in [
        (&DEFER_WAIT, "2"),
        (&DEFER_WAIT, "yes"),
        (&LL_MAX, "4097"),
        (&LL_MAX, "-1"),
        (&LL_MAX, "lots"),
        (&ONE_BLOCK_MAX, "2000000"),
        (&ONE_BLOCK_MAX, "4k"),
    ] {
        let e = set.parse(Some(bad)).unwrap_err();
        assert!(e.contains(set.key.name) && e.contains(bad), "{e}");
    }
}

#[test]
fn only_small_eager_ops_without_a_root_move_by_lines_below_epoch_2_pow_32() {
    let ll = k::LL_MAX_BYTES;
    assert!(ll_op(true, 1, 1, ll, ll, k::MODE_AR));
    for mode in [k::MODE_AR, k::MODE_AG, k::MODE_RS, k::MODE_A2A] {
        assert!(ll_op(true, (1 << 32) - 1, 1, 8, ll, mode), "{mode}");
        // Captured, past 2^32 epochs, on more than one block, past the limit, or off.
        assert!(!ll_op(false, 1, 1, 8, ll, mode));
        assert!(!ll_op(true, 1 << 32, 1, 8, ll, mode));
        assert!(!ll_op(true, 1, 2, 8, ll, mode));
        assert!(!ll_op(true, 1, 1, ll + 1, ll, mode));
        assert!(!ll_op(true, 1, 1, 8, 0, mode));
    }
    for mode in [k::MODE_BC, k::MODE_BCF, k::MODE_RED, k::MODE_SC, k::MODE_GA] {
        assert!(!ll_op(true, 1, 1, 8, ll, mode), "{mode}");
    }
}

#[test]
fn only_whole_broadcasts_on_three_ranks_or_more_from_the_setting_on_run_forwarded() {
    let whole = Part::Whole;
    // From 2 MiB by default.
    let dflt = BCAST_FORWARD_MIN.parse(None).unwrap();
    assert_eq!(dflt, 2 << 20);
    assert_eq!(forwarded(k::MODE_BC, whole, 4, 2 << 20, dflt), k::MODE_BCF);
    assert_eq!(
        forwarded(k::MODE_BC, whole, 4, (2 << 20) - 1, dflt),
        k::MODE_BC
    );
    // From the setting on, 3+ ranks.
    assert_eq!(forwarded(k::MODE_BC, whole, 4, 4096, 4096), k::MODE_BCF);
    assert_eq!(forwarded(k::MODE_BC, whole, 3, 1, 0), k::MODE_BCF);
    assert_eq!(forwarded(k::MODE_BC, whole, 4, 4095, 4096), k::MODE_BC);
    assert_eq!(forwarded(k::MODE_BC, whole, 2, 1 << 20, 0), k::MODE_BC);
    // Never a part of a split op, nor another kind.
    let of = Part::Of {
        rooted: true,
        last: false,
    };
    assert_eq!(forwarded(k::MODE_BC, of, 4, 1 << 20, 0), k::MODE_BC);
    for mode in [k::MODE_SC, k::MODE_RED, k::MODE_AR, k::MODE_AG] {
        assert_eq!(forwarded(mode, whole, 4, 1 << 20, 0), mode);
    }
    assert_eq!(BCAST_FORWARD_MIN.parse(Some("0")).unwrap(), 0);
    let e = BCAST_FORWARD_MIN.parse(Some("-1")).unwrap_err();
    assert!(e.contains("COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES"), "{e}");
}

#[test]
fn the_window_holds_two_parities_of_every_rank() {
    assert_eq!(
        window_bytes(4, 1 << 20),
        4096 + 8 * (1 << 20) + 8 * k::LL_SLOT_BYTES
    );
    assert_eq!(ll_area_off(4, 1 << 20), 4096 + 8 * (1 << 20));
    // The LL lines of the largest LL op fit, and a slot holds an LL op unpacked.
    assert_eq!(k::LL_SLOT_BYTES, (2 + k::LL_MAX_BYTES / 8) * 16);
    assert!(k::LL_MAX_BYTES <= default_max_bytes(8));
    // The flag area holds 2 parities x MAX_RANKS sources of 16 bytes before the state.
    const {
        assert!(k::FLAGS_OFF + 2 * k::MAX_RANKS as u64 * 16 <= k::STATE_OFF);
        assert!(k::DEAD_OFF + 4 <= k::DATA_OFF);
        // The deferred waits (2 parities) after the state words, then the daemon mark, in
        // the header that the setup zeroes.
        assert!(k::DEAD_OFF + 4 <= k::DEFER_OFF);
        assert!(k::DEFER_OFF + 2 * k::DEFER_BYTES <= k::MARK_OFF);
        assert!(k::MARK_OFF + 8 <= k::DATA_OFF);
    }
}
