//! How a direct op is named in the flags it writes (its signature, and the parts of split
//! ops), and how a failure record is told in words.

use commd_proto::desc::{DType, OpKind, RedOp};

use crate::gpu::kernels::{direct as k, p2p as kp};

/// The op signature a flag carries: kind, dtype and reduction (sum for the copies), one byte
/// each, and the root of broadcast and reduce (0 otherwise) plus 0x10 (never
/// `kernels::direct::ERR_SIG`).
pub fn signature(kind: OpKind, dtype: DType, op: RedOp, root: u32) -> u32 {
    let root = if kind.has_root() { root & 0x0f } else { 0 };
    (u32::from(kind.code()) & 0xff)
        | (u32::from(dtype.code()) << 8)
        | (u32::from(op.code()) << 16)
        | ((0x10 | root) << 24)
}

/// The mark in a signature of a direct op that is one part of an op split into several
/// ([`Communicator::split_op`]): such a part never pairs with an op that a peer posted by
/// itself (a reduce-scatter then an all-gather), which would leave the mismatch unseen.
pub const PART: u32 = 0x20 << 24;

/// The mark of a part of a split broadcast or reduce, whose root is in the signature too (a
/// part of a split broadcast never pairs with one of a split all-reduce, nor of another root).
pub const ROOTED: u32 = 0x40 << 24;

/// The mark of the last chunk of an op split into chunks ([`Split::Chunks`]): a rank that runs
/// fewer chunks than a peer (another count) fails on it, where the peer runs a chunk more.
pub const LAST: u32 = 0x80 << 24;

/// The kind byte of a signature for the scatter of a split broadcast and the gather of a split
/// reduce (no op of their own: never an `OpKind` code).
pub(super) const SCATTER_CODE: u32 = 0xf6;

pub(super) const GATHER_CODE: u32 = 0xf7;

/// What a direct op is: an op by itself, or one part of an op split into direct ops
/// ([`Communicator::split_op`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Part {
    Whole,
    /// Runs as its kind says; `rooted`: of a split broadcast or reduce (root `peer`); `last`:
    /// the last chunk of an op split into chunks ([`Split::Chunks`]).
    Of {
        rooted: bool,
        last: bool,
    },
    /// Of a split broadcast: chunk `r` of the root's input (`count` elements each) into rank
    /// `r`'s output (`kernels::direct::MODE_SC`).
    Scatter,
    /// Of a split reduce: a reduce-scatter whose share goes to `recv` on the root and to the
    /// rank's scratch slot on the others (whose buffers are the user's input only); `last`: the
    /// first part of the last chunk of a reduce in chunks of splits ([`Split::Chunks`]).
    ReduceToScratch {
        last: bool,
    },
    /// Of a split reduce: every rank's share (the root's in `send`, the others' in their
    /// scratch slot) into the root's `recv`, in rank order (`kernels::direct::MODE_GA`).
    Gather,
}

impl Part {
    /// The kernel mode (`kernels::direct::MODE_*`) of a direct op of `kind` that is this part;
    /// `None`: no direct op of that kind.
    pub(crate) fn mode(self, kind: OpKind) -> Option<u32> {
        Some(match (self, kind) {
            (Part::Scatter, _) => k::MODE_SC,
            (Part::Gather, _) => k::MODE_GA,
            (_, OpKind::AllReduce) => k::MODE_AR,
            (_, OpKind::AllGather) => k::MODE_AG,
            (_, OpKind::ReduceScatter) => k::MODE_RS,
            (_, OpKind::Broadcast) => k::MODE_BC,
            (_, OpKind::Reduce) => k::MODE_RED,
            (_, OpKind::AllToAll) => k::MODE_A2A,
            _ => return None,
        })
    }

    /// Whether the op reads its send buffer and writes its recv buffer on this rank, and their
    /// elements (`None`: an overflow): ((uses, elements) of send, of recv), for `count` and `n`
    /// ranks. A non-root's scratch slot ([`Part::scratch`]) replaces a buffer it does not use.
    pub(crate) fn buffers(
        self,
        kind: OpKind,
        count: u64,
        n: u64,
        me_root: bool,
    ) -> ((bool, Option<u64>), (bool, Option<u64>)) {
        let all = count.checked_mul(n);
        match self {
            Part::Scatter => ((me_root, all), (true, Some(count))),
            Part::ReduceToScratch { .. } => ((true, all), (me_root, Some(count))),
            Part::Gather => ((me_root, Some(count)), (me_root, all)),
            Part::Whole | Part::Of { .. } => (
                (kind.uses_send(me_root), kind.send_elems(count, n)),
                (kind.uses_recv(me_root), kind.recv_elems(count, n)),
            ),
        }
    }

    /// Which of the op's buffers is this rank's scratch slot (`Windows::scratch`) instead of
    /// the user's: (send, recv). A non-root's share of a split reduce lives there, since its
    /// user buffers are the input only.
    pub(crate) fn scratch(self, me_root: bool) -> (bool, bool) {
        match self {
            Part::ReduceToScratch { .. } if !me_root => (false, true),
            Part::Gather if !me_root => (true, false),
            _ => (false, false),
        }
    }

    /// Marked as the last chunk's (its signature carries [`LAST`]).
    pub(crate) fn last(self) -> bool {
        matches!(
            self,
            Part::Of { last: true, .. } | Part::ReduceToScratch { last: true }
        )
    }

    /// This part marked as the last chunk's first one; a scatter, a gather and a whole op
    /// carry no mark (they never start a chunk).
    pub(super) fn marked_last(self) -> Part {
        match self {
            Part::Of { rooted, .. } => Part::Of { rooted, last: true },
            Part::ReduceToScratch { .. } => Part::ReduceToScratch { last: true },
            p => p,
        }
    }

    /// A part of a split broadcast or reduce (whose root is `peer`).
    pub(super) fn rooted(self) -> bool {
        match self {
            Part::Whole => false,
            Part::Of { rooted, .. } => rooted,
            Part::Scatter | Part::ReduceToScratch { .. } | Part::Gather => true,
        }
    }
}

/// The signature of a direct op of `kind` (`signature`), marked when it is a part of a split op;
/// a scatter or gather part has a kind byte of its own.
pub fn part_signature(part: Part, kind: OpKind, dtype: DType, op: RedOp, root: u32) -> u32 {
    let base = signature(kind, dtype, op, root);
    let code = match part {
        Part::Whole => return base,
        Part::Scatter => SCATTER_CODE,
        Part::Gather => GATHER_CODE,
        Part::Of { .. } | Part::ReduceToScratch { .. } => base & 0xff,
    };
    let root = if part.rooted() {
        ROOTED | ((root & 0x0f) << 24)
    } else {
        0
    };
    let last = if part.last() { LAST } else { 0 };
    (base & !0xff) | code | PART | root | last
}

/// The low 32 bits of a 64-bit word that packs two u32s (a record's flag words: the signature
/// or count below the capture index or epoch) or of a count kept modulo 2^20.
// Truncation is the point: the high half is another field, read with `>> 32`.
#[allow(clippy::cast_possible_truncation)]
pub(crate) const fn lo(w: u64) -> u32 {
    w as u32
}

/// A failure record's words as the kernel wrote them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    pub code: u32,
    pub rank: u32,
    pub epoch: u64,
    pub mine: (u64, u64),
    pub theirs: (u64, u64),
}

pub(super) fn describe_sig(sig: u32) -> String {
    if sig == k::ERR_SIG {
        return "no op (it had failed)".into();
    }
    if sig == k::LL_SIG {
        return format!(
            "an op of at most {} bytes per rank (moved by LL lines: another count)",
            k::LL_MAX_BYTES
        );
    }
    if sig & PART != 0 {
        let root = (sig >> 24) & 0x0f;
        let (what, of) = match (sig & 0xff, sig & ROOTED != 0) {
            (SCATTER_CODE, _) => (format!("scatter {}", dtype_name(sig)), "a broadcast"),
            (GATHER_CODE, _) => (format!("gather {}", dtype_name(sig)), "a reduce"),
            (_, rooted) => (
                describe_sig(sig & !(PART | ROOTED | LAST)),
                if rooted {
                    "a broadcast or reduce"
                } else {
                    "an all_reduce"
                },
            ),
        };
        let root = if sig & ROOTED != 0 {
            format!(" root {root}")
        } else {
            String::new()
        };
        let part = if sig & LAST != 0 { "last part" } else { "part" };
        return format!("{what} ({part} of {of}{root} split into direct ops)");
    }
    let kind = OpKind::from_code((sig & 0xff) as u16)
        .map(|x| x.name().to_string())
        .unwrap_or_else(|| format!("op {}", sig & 0xff));
    let dt = dtype_name(sig);
    let op = RedOp::from_code(((sig >> 16) & 0xff) as u8)
        .map(|x| x.name().to_string())
        .unwrap_or_else(|| format!("reduction {}", (sig >> 16) & 0xff));
    let root = (sig >> 24) & 0x0f;
    match OpKind::from_code((sig & 0xff) as u16) {
        Some(OpKind::Broadcast) => format!("{kind} {dt} root {root}"),
        Some(OpKind::Reduce) => format!("{kind} {dt} {op} root {root}"),
        Some(OpKind::AllGather | OpKind::AllToAll) => format!("{kind} {dt}"),
        _ => format!("{kind} {dt} {op}"),
    }
}

pub(super) fn dtype_name(sig: u32) -> String {
    DType::from_code(((sig >> 8) & 0xff) as u8)
        .map(|x| x.name().to_string())
        .unwrap_or_else(|| format!("dtype {}", (sig >> 8) & 0xff))
}

/// What a failure record means, for the error the client raises: of a replay of a captured op,
/// or (`eager`) of an eager direct op (docs/design-gpu.md, direct collectives rule 8).
pub fn explain(r: &Record, me: u32, eager: bool) -> String {
    let e = r.epoch;
    let (m_sig, m_k, m_count) = (lo(r.mine.0), (r.mine.1 >> 32) as u32, lo(r.mine.1));
    let (t_sig, t_k, t_count) = (lo(r.theirs.0), (r.theirs.1 >> 32) as u32, lo(r.theirs.1));
    let (coll, runs) = if eager {
        ("a collective", "ran")
    } else {
        ("a replayed collective", "replayed")
    };
    match r.code {
        k::MISMATCH => {
            let mut fields = Vec::new();
            if m_sig != t_sig {
                fields.push(format!(
                    "op: rank {me} {} vs rank {} {}",
                    describe_sig(m_sig),
                    r.rank,
                    describe_sig(t_sig)
                ));
            }
            // A peer that moved the op by LL lines wrote no word 1 for it: its count and index
            // are not known here (the op differs all the same).
            let lines = t_sig == k::LL_SIG;
            if m_count != t_count && !lines {
                fields.push(format!(
                    "count: rank {me} {m_count} vs rank {} {t_count}",
                    r.rank
                ));
            }
            if m_k != t_k && !lines {
                fields.push(if eager {
                    format!(
                        "direct op: rank {me} ran its eager direct op #{m_k}, rank {} its #{t_k} (the ranks issued different sequences of collectives)",
                        r.rank
                    )
                } else {
                    format!(
                        "captured op: rank {me} replayed its captured direct op #{m_k}, rank {} its #{t_k} (the ranks replay different graphs, or captured different sequences)",
                        r.rank
                    )
                });
            }
            let within = if eager {
                "an eager direct op"
            } else {
                "a CUDA-graph replay"
            };
            format!(
                "mismatched collective in {within} (direct op #{e} of the communicator): {}",
                fields.join("; ")
            )
        }
        k::TIMEOUT => format!(
            "{coll} (direct op #{e}) timed out waiting for rank {}: its stream never reached the same op (it is stuck, or {runs} other ops{})",
            r.rank,
            if eager {
                ", or its op has another count that sent it to the daemon's path, past the direct limit"
            } else {
                ""
            }
        ),
        k::BROKEN => format!(
            "{coll} (direct op #{e}) stopped waiting for rank {}: the communicator is broken",
            r.rank
        ),
        k::POISONED => format!(
            "{coll} (direct op #{e}) did not run: an earlier direct op on this communicator failed, and none runs after that"
        ),
        k::PEER_FAILED => format!(
            "{coll} (direct op #{e}) did not run: rank {} reported that its own op failed earlier (its error says why)",
            r.rank
        ),
        k::ELSEWHERE => format!(
            "mismatched collective (direct op #{e} of the communicator): rank {} sent this op, or one issued before it, to the daemon's path (its collective #{} on that path since the direct windows' setup; rank {me} had issued {} there), while rank {me} ran it as a direct op ({}, count {m_count}). The ranks' counts differ across the direct limit (COMMD_EAGER_DIRECT_MAX_BYTES), or they issued their collectives in different orders. Rank {}'s op, which waits in the daemon for this rank's, is failed there at once with this error (this rank fails the communicator)",
            r.rank,
            lo(r.theirs.0),
            lo(r.theirs.1),
            describe_sig(m_sig),
            r.rank
        ),
        c => format!("{coll} (direct op #{e}) failed with code {c}"),
    }
}

/// The flag's signature of a direct send/recv (a receive compares it whole with its sender's,
/// and the bytes apart): the marker `SIG_MARK` (bits 28-31; no byte count of an LL header
/// reaches them, so a record says which of the two differed), the sends (for a receive: the
/// receives) of the pair's direction that took the daemon's path before the op, modulo 2^20
/// (bits 8-27), and the dtype (bits 0-7). The k-th message from a rank to another pairs
/// with the k-th receive, as in NCCL, only if both sides put the same messages on each path in
/// the same order: equal counts before every direct op say so (`tests::
/// equal_daemon_counts_pair_every_message_in_order`).
pub(crate) fn p2p_signature(dtype: DType, daemon_ops: u64) -> u32 {
    SIG_MARK | ((lo(daemon_ops) & SIG_COUNT_MASK) << 8) | u32::from(dtype.code())
}

/// The marker of a direct send/recv's signature (`p2p_signature`).
pub(crate) const SIG_MARK: u32 = 0x5000_0000;

const SIG_COUNT_MASK: u32 = (1 << 20) - 1;

/// A signature's fields: its dtype code and count of daemon-path ops; `None` if `w` is not a
/// signature (an LL header's byte count).
pub(crate) fn sig_fields(w: u32) -> Option<(u8, u32)> {
    (w & 0xF000_0000 == SIG_MARK).then_some(((w & 0xff) as u8, (w >> 8) & SIG_COUNT_MASK))
}

/// A direct send/recv's failure code (`kernels::p2p`).
pub(crate) fn explain_p2p_code(code: u32) -> String {
    match code {
        k::MISMATCH => "the peer's send and this receive disagree on the bytes or the dtype (mismatch)".into(),
        k::TIMEOUT => "the peer's matching op did not come within the op timeout".into(),
        k::POISONED => "an earlier direct send/recv between these two ranks failed, and none runs after that (its error says why)".into(),
        c => explain_code(c),
    }
}

/// A direct send/recv's failure record (`kernels::p2p`: its sequence, this side's flag word,
/// and for a mismatch the peer's), for the error: what differs, where the record says.
pub(crate) fn explain_p2p(r: &Record) -> String {
    let q = r.epoch;
    if r.code == k::ELSEWHERE {
        // The peer's daemon mark (top bit: this op is a send), and this op's own count.
        let m = r.theirs.0 & !(1 << 63);
        let send = r.theirs.0 >> 63 != 0;
        let bits = kp::MARK_COUNT_BITS;
        let (their_q, theirs) = (m >> bits, m & ((1 << bits) - 1));
        let mine = sig_fields(lo(r.mine.0)).map_or(0, |f| f.1);
        let (me, them) = if send {
            (
                format!("direct send #{q} to the peer"),
                format!(
                    "receives from this rank on the daemon's path before its direct receive #{their_q}"
                ),
            )
        } else {
            (
                format!("direct receive #{q} from the peer"),
                format!(
                    "sends to this rank on the daemon's path before its direct send #{their_q}"
                ),
            )
        };
        return format!(
            "{me}: the peer had put {theirs} of its {them}, and this rank {mine} before this op (counted modulo 2^20; messages past COMMD_P2P_DIRECT_MAX_BYTES take that path), so the peer's counterpart of this op would never come. The two ranks' messages between them differ in size across that limit, or were issued in another order (mismatch); the op did not run, and this rank fails the communicator so that the peer's op waiting on the daemon's path fails too"
        );
    }
    if r.code != k::MISMATCH {
        return format!(
            "{} (message #{q} of the pair's direction)",
            explain_p2p_code(r.code)
        );
    }
    let (mine, theirs) = (lo(r.mine.0), lo(r.theirs.0));
    let dtype = |c: u8| {
        commd_proto::desc::DType::from_code(c)
            .map(|d| d.name().to_string())
            .unwrap_or_else(|| format!("dtype {c}"))
    };
    match (sig_fields(mine), sig_fields(theirs)) {
        _ if r.theirs.0 == 0 => format!(
            "direct receive #{q} from the peer: its message is of the other size class (one of at most COMMD_P2P_LL_MAX_BYTES moves by LL lines, the other not): the peer's send and this receive disagree on the bytes (mismatch)"
        ),
        (Some((_, mc)), Some((_, tc))) if mc != tc => format!(
            "direct receive #{q} from the peer: this rank had put {mc} of its receives from the peer on the daemon's path before it, the peer {tc} of its sends to this rank before its direct send #{q} (counted modulo 2^20; messages past COMMD_P2P_DIRECT_MAX_BYTES take that path). The two ranks' messages between them differ in size across that limit, or were issued in another order (mismatch); the peer's message is not this receive's, and it was not taken"
        ),
        (Some((md, _)), Some((td, _))) if md != td => format!(
            "direct receive #{q} from the peer: the peer sent {}, this receive expects {} (mismatch)",
            dtype(td),
            dtype(md)
        ),
        (Some(_), None) => format!(
            "direct receive #{q} from the peer: the peer sent {theirs} bytes, not this receive's count (mismatch)"
        ),
        _ => format!(
            "direct receive #{q} from the peer: the peer's send and this receive disagree on the bytes (mismatch)"
        ),
    }
}

/// The error kind of a direct op's failure code.
pub(crate) fn op_error_kind(code: u32) -> crate::OpErrorKind {
    use commd_proto::desc::status;
    crate::OpErrorKind::from_status(match code {
        k::MISMATCH | k::ELSEWHERE => status::MISMATCH,
        k::TIMEOUT => status::TIMEOUT,
        _ => status::PEER_LOST,
    })
}

/// A failure code alone (the record described an earlier failure).
pub(super) fn explain_code(code: u32) -> String {
    match code {
        k::MISMATCH => "a peer ran another collective (mismatch)".into(),
        k::TIMEOUT => "a peer's op did not come within the op timeout".into(),
        k::BROKEN => "the communicator is broken".into(),
        k::POISONED => "an earlier direct op on this communicator failed, and none runs after that (its error says why)".into(),
        k::PEER_FAILED => "a peer reported that its own op failed earlier (its error says why)".into(),
        k::ELSEWHERE => "a peer sent the op to the daemon's path while this rank ran it as a direct op (mismatch: counts across the direct limit, or collectives issued in different orders)".into(),
        c => format!("failure code {c}"),
    }
}
