//! Direct captured collectives (DESIGN.md contract 7): the host side.
//!
//! A persistent op (contract 6) takes every replay through the daemon's executor: ready seen,
//! copies issued, events seen, done written, each a CPU round trip, 26-50 us per op against
//! NCCL's 10-16 us under graphs (docs/benchmarks.md, 2026-11-25/26). An all-reduce,
//! all-gather, reduce-scatter, broadcast or reduce captured on a communicator whose ranks each
//! have their own GPU, all visible to each other with peer access, runs instead as one kernel
//! of the graph (`kernels::direct`): it pushes the input into the peers' windows and reduces
//! (or copies) its own window into the output, with flags that advance on the GPU. The daemon
//! sees nothing per replay; it only marks a communicator broken (`HINT_BROKEN`) when a rank's
//! process is lost, which stops a kernel that waits for that rank.
//!
//! The windows are set up with the first such capture on a communicator: every rank allocates
//! its window on its GPU and the ranks exchange IPC handles through a host all-gather on the
//! communicator itself (so a rank that does not take this path fails that all-gather as a
//! mismatch instead of hanging); then each opens its peers' windows and a second all-gather
//! agrees on the outcome: every rank takes the path, or none does (and says why, once).
//! Windows stay mapped for the life of the process: a graph may outlive its communicator.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use commd_proto::desc::{DType, OpKind, RedOp, doorbell};

use super::cu::{self, ck, sys};
use super::kernels::{self, DirectArgs, direct as k};
use super::{CudaOpArgs, CudaPosted, ensure_context, map_host, pointer_span};
use crate::{Client, Communicator, Error, Request, Result, lock};

/// Bytes each rank sends in the first all-gather.
const OFFER_BYTES: u64 = 128;
/// Default blocks of the direct kernel (fewer on a GPU with fewer SMs). 2x H200, 2026-11-26
/// (docs/benchmarks.md): 16 and 64 blocks both take 8.1-8.4 us per op up to 64 KiB; at 512
/// KiB / 2 MiB / 4 MiB 64 blocks take 10.1 / 16.4 / 26.3 us against 16 blocks' 12.4 / 26.2 /
/// 56.1 (NCCL's graph: 12.5 / 29.1 / 36.3).
pub const DEFAULT_BLOCKS: u32 = 64;
/// A direct op whose pushes reach this many bytes ((n - 1) x its bytes per rank) runs on twice
/// the blocks ([`launch_grid`]). 4x H200, 2026-11-28 (docs/benchmarks.md): 128 blocks took
/// 4-11% less than 64 from 6 MiB of pushes (alltoall 8 MiB 33.8 against 38.0 us, broadcast 8
/// MiB 56.2 against 59.3), and 1-6% more up to 3 MiB (all_reduce 512 KiB 14.1 against 13.3).
pub const LARGE_PUSH_BYTES: u64 = 4 << 20;

/// The (blocks, tickets per block) of a direct op of `bytes` per rank on `n` ranks, on windows
/// whose ops take `grid` tickets each (an even number): one block taking them all when the op
/// is at most `one_block` bytes ([`one_block_max`]: such a block is its own last one, with no
/// arrival count and one fence less before its flags), the whole grid when its pushes reach
/// [`LARGE_PUSH_BYTES`], else half of it with 2 tickets per block.
pub fn launch_grid(grid: u32, bytes: u64, n: u32, one_block: u64) -> (u32, u32) {
    if bytes <= one_block {
        (1, grid.max(1))
    } else if bytes.saturating_mul(u64::from(n.saturating_sub(1))) >= LARGE_PUSH_BYTES || grid < 2 {
        (grid, 1)
    } else {
        (grid / 2, 2)
    }
}

/// `COMMD_DIRECT_ONE_BLOCK_MAX_BYTES`: the largest direct op (bytes per rank) that runs on one
/// block ([`launch_grid`]); default 4096 (one pass of the block's 256 threads x 16 bytes);
/// `0`: none. Local to a rank (the peers do not see a rank's grid). Read once per process.
/// 2x H200 (docs/benchmarks.md, 2026-11-28, "Shortening a small direct op's GPU path"), 8 B-4
/// KiB against the half grid: on its own 0.1-0.7 us less for broadcast and 0.8-1.9 for
/// reduce-scatter, up to 0.4 more for all-reduce and 0.9 for all-to-all; with LL lines (which
/// need it) all-reduce 0.7-2.1 us less, all-to-all 1.3-1.5, reduce-scatter 0.1-1.0.
pub(crate) fn one_block_max() -> Result<u64> {
    static V: SettingCell = SettingCell::new();
    ONE_BLOCK_MAX.once(&V)
}
/// The default largest push to one peer of a direct all-gather, all-to-all or reduce-scatter
/// (on 2 ranks also the largest share of a split op, [`default_share_bytes`]): the power of two
/// at most 24 MiB / (n - 1) and 8 MiB, so every rank's GPU sends at most 24 MiB per such op
/// ((n - 1) x this): 8 MiB for 2 to 4 ranks, 4 for 5 to 7, 2 for 8. On 3+ ranks it is at most
/// the split's share, so it never widens a window's slot ([`Limits::slot`]). Past it the
/// daemon's copy engines copy straight into the receivers' buffers, where a direct copy goes
/// through the windows:
/// - 2x H200 (docs/benchmarks.md, 2026-11-28, "The direct limit on two GPUs"): an all-gather
///   with 16 MiB per rank took 84.7 us direct against the daemon's 71.1, an all-to-all 94.7
///   against 69.4, while 8 MiB per rank took 40.6 against 48.4;
/// - 4x H200, once a push loads every peer's chunk at once (2026-11-28, "Pushes of 8 MiB per
///   peer on four GPUs"): 8 MiB per peer (24 MiB of pushes) took 98.6 us for an all-gather of
///   32 MiB, 100.7 for an all-to-all and 95.9 for a reduce-scatter, against the daemon's
///   112.2, 111.0 and 119.4 (NCCL 105.9, 107.2, 103.6). The earlier kernel, one peer after
///   the other, had taken 121.2 for that all-to-all, hence the 12 MiB of the time before.
pub fn default_push_bytes(nranks: u32) -> u64 {
    let per = (24u64 << 20) / u64::from(nranks.saturating_sub(1).max(1));
    pow2_floor(per.min(8 << 20))
}

/// The largest power of two at most `x` (at least 1).
fn pow2_floor(x: u64) -> u64 {
    1u64 << (63 - x.max(1).leading_zeros())
}

/// The default largest direct all-reduce, reduce-scatter, broadcast and reduce (bytes per rank),
/// on 2 ranks 16 MiB, elsewhere the power of two at most 8 MiB / (n - 1) and 4 MiB (4 MiB for 3
/// ranks, 2 MiB for 4 to 5, 1 MiB for 6 to 8; one direct op of 4 or 8 MiB was slower than the
/// split on 4x H200, "Larger shares on four GPUs"). A window slot is the largest of the limits
/// ([`Limits::slot`]). Measured on 2x H200 (docs/benchmarks.md, 2026-11-28,
/// "The direct limit on two GPUs"; nccl-tests, us, against the earlier 4 MiB limit and NCCL):
/// all-reduce 16 MiB 74.9 (87.6, 78.3), reduce 16 MiB 55.4 (82.0, 58.4), broadcast 16 MiB
/// 63.2 (65.6, 63.2), reduce-scatter 32 MiB 80.5 (87.3, 90.2); at 32 MiB per rank the daemon's
/// path is as fast or faster. On more ranks an op past the limit whose share fits is split
/// into direct ops; larger ones take the daemon's path, whose reduce-scatter + all-gather moves
/// 2 (n - 1) / n x the bytes.
pub fn default_max_bytes(nranks: u32) -> u64 {
    // One rank (a group of one) runs no direct op, but its limits are still asked for.
    if nranks <= 2 {
        16 << 20
    } else {
        pow2_floor((8u64 << 20) / u64::from(nranks - 1)).min(4 << 20)
    }
}

/// The default largest share (bytes per rank) of an op split into direct ops
/// ([`split_share`]): on 2 ranks [`default_push_bytes`] (8 MiB; their limit is 16 MiB, so
/// nothing splits in shares there), on 3 or more the power of two at most 32 MiB / n (8 MiB
/// for 3 and 4 ranks, 4 MiB for 5 to 8), so that a window's data slots (2 x n of the largest
/// of the limits, [`Limits::slot`]) stay within 64 MiB, as on 2 ranks. Past the split the
/// daemon's path runs a broadcast or reduce as a reduce-scatter and all-gather of copy-engine
/// rounds. Measured on 4x H200 (docs/benchmarks.md, 2026-11-28, "Larger shares on four
/// GPUs"; nccl-tests, us, against the earlier 2 MiB shares, whose split stopped at 8 MiB, and
/// NCCL): at 16 MiB (4 MiB shares) broadcast 99.9 (158.9, 65.3), reduce 99.9 (174.3, 62.3),
/// all-reduce 107.0 (135.5, 99.6); at 32 MiB (8 MiB shares) broadcast 190.3 (226.7, 113.2),
/// reduce 192.3 (328.7, 109.0), all-reduce 199.4 (206.8, 172.0). The limit of a whole direct
/// op stays: one direct op of 4 or 8 MiB was slower than the split (broadcast 4 MiB 44.4
/// against 38.5). 3 and 5 to 8 ranks follow the same rule, not measured (no such machine).
pub fn default_share_bytes(nranks: u32) -> u64 {
    if nranks <= 2 {
        default_push_bytes(nranks)
    } else {
        pow2_floor((32u64 << 20) / u64::from(nranks))
    }
}

/// A communicator's direct limits, in bytes per rank ([`Config::limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The largest all-reduce, broadcast or reduce (a reduce-scatter's too where it is the
    /// larger, [`Limits::of`]).
    pub whole: u64,
    /// The largest all-gather, all-to-all or reduce-scatter (bytes per peer).
    pub push: u64,
    /// The largest share of an op split into direct ops ([`split_share`]).
    pub share: u64,
}

impl Limits {
    /// Every limit `bytes` (a set `COMMD_*_DIRECT_MAX_BYTES`).
    pub fn all(bytes: u64) -> Self {
        Self {
            whole: bytes,
            push: bytes,
            share: bytes,
        }
    }

    /// The largest whole direct op of `mode`: an all-gather or all-to-all pushes each peer's
    /// chunk as a copy (`push`); a reduce-scatter pushes each peer's chunk too, so it takes the
    /// larger of `push` and `whole` (4x H200, docs/benchmarks.md, 2026-11-28, "Pushes of 8 MiB
    /// per peer on four GPUs": a reduce-scatter of 16 MiB, 4 MiB per peer, took 51.5 us direct
    /// against the daemon's 76.3, NCCL 61.9); the rest `whole`.
    pub fn of(&self, mode: u32) -> u64 {
        match mode {
            k::MODE_AG | k::MODE_A2A => self.push,
            k::MODE_RS => self.push.max(self.whole),
            _ => self.whole,
        }
    }

    /// Bytes of a window's data slot: the largest direct op or part of one, rounded up to
    /// 4 KiB.
    pub fn slot(&self) -> u64 {
        self.whole
            .max(self.push)
            .max(self.share)
            .div_ceil(4096)
            .max(1)
            * 4096
    }
}

/// A direct path's integer setting `name` with value `v`: `None` when unset or empty, else an
/// integer from `lo` to `hi`, or the error naming the setting and its value.
pub(crate) fn env_int(
    name: &str,
    v: Option<&str>,
    lo: u64,
    hi: u64,
) -> std::result::Result<Option<u64>, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(None),
        Some(s) => s
            .parse::<u64>()
            .ok()
            .filter(|x| (lo..=hi).contains(x))
            .map(Some)
            .ok_or_else(|| format!("{name}={s:?}: expected an integer from {lo} to {hi}")),
    }
}

/// `COMMD_DIRECT_SPLIT_MAX_BYTES`: the largest all-reduce, broadcast or reduce (bytes per rank)
/// past the direct limit that runs as direct ops, e.g. a reduce-scatter then an all-gather
/// ([`Communicator::split_op`]); default: every one whose share (1/n of it) fits the
/// limit, i.e. up to n x the limit; `0`: none (each takes the daemon's path, as before). The
/// same on every rank (checked when the windows are set up). Read once per process.
pub(crate) fn split_max() -> Result<u64> {
    static V: SettingCell = SettingCell::new();
    SPLIT_MAX.once(&V)
}

/// A direct path's byte setting: `default` when unset or empty, else an integer from `lo` to
/// `hi`, or the error naming the setting and its value ([`env_int`]).
struct Setting {
    name: &'static str,
    lo: u64,
    hi: u64,
    default: u64,
}

/// Where a setting's value (or its error) is kept once read.
type SettingCell = std::sync::OnceLock<std::result::Result<u64, String>>;

impl Setting {
    fn parse(&self, v: Option<&str>) -> std::result::Result<u64, String> {
        Ok(env_int(self.name, v, self.lo, self.hi)?.unwrap_or(self.default))
    }

    /// The process's value, read from the environment once into `cell`.
    fn once(&self, cell: &'static SettingCell) -> Result<u64> {
        cell.get_or_init(|| self.parse(std::env::var(self.name).ok().as_deref()))
            .clone()
            .map_err(Error::InvalidArgument)
    }
}

const SPLIT_MAX: Setting = Setting {
    name: "COMMD_DIRECT_SPLIT_MAX_BYTES",
    lo: 0,
    hi: 1 << 40,
    default: u64::MAX,
};
const ONE_BLOCK_MAX: Setting = Setting {
    name: "COMMD_DIRECT_ONE_BLOCK_MAX_BYTES",
    lo: 0,
    hi: 1 << 20,
    default: 4096,
};
const BCAST_FORWARD_MIN: Setting = Setting {
    name: "COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES",
    lo: 0,
    hi: u64::MAX,
    default: 2 << 20,
};
const DEFER_WAIT: Setting = Setting {
    name: "COMMD_DIRECT_DEFER_WAIT",
    lo: 0,
    hi: 1,
    default: 0,
};
const LL_MAX: Setting = Setting {
    name: "COMMD_DIRECT_LL_MAX_BYTES",
    lo: 0,
    hi: k::LL_MAX_BYTES,
    default: k::LL_MAX_BYTES,
};

/// How an op past the direct limit runs as direct ops ([`split_how`], [`split_plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Split {
    /// In shares of this many elements per rank ([`split_share`]): e.g. a reduce-scatter then
    /// an all-gather.
    Shares(u64),
    /// As the same op on consecutive ranges of at most this many elements ([`reduce_chunk`]).
    Chunks(u64),
}

/// How an op of `kind` (`count` elements of `es` bytes, `n` ranks, the direct limits `lim`,
/// `COMMD_DIRECT_SPLIT_MAX_BYTES` = `most`) past the direct limit runs as direct ops: in shares
/// where they fit, else (a reduce) in chunks; `None`: one direct op, or the
/// daemon's path. The same on every rank: its inputs are.
pub(crate) fn split_how(
    kind: OpKind,
    count: u64,
    es: u64,
    n: u64,
    lim: Limits,
    most: u64,
) -> Option<Split> {
    split_share(count, es, n, lim.whole, lim.share, most)
        .map(Split::Shares)
        .or_else(|| reduce_chunk(kind, count, es, n, lim, most).map(Split::Chunks))
}

/// The most chunks of a reduce in chunks ([`reduce_chunk`]).
const MAX_CHUNKS: u64 = 4;

/// The elements of each chunk of a reduce of `count` elements of `es` bytes on `n` ranks past
/// what runs as one direct op or one split (limits `lim`), up to [`MAX_CHUNKS`] chunks and
/// `most` bytes (`COMMD_DIRECT_SPLIT_MAX_BYTES`); each chunk runs in order, the last one marked.
/// On 2 ranks a chunk is one direct reduce of the limit: there a reduce's share (half the op)
/// is past the split's ([`default_share_bytes`]), and the daemon's path took 1.3-1.4x NCCL's
/// time. Measured on 2x H200 (docs/benchmarks.md, 2026-11-28, "A reduce past the limit on two
/// GPUs"; nccl-tests, us):
/// - in chunks of 16 MiB, 32 MiB took 110.5 and 64 MiB 221.7, against the daemon's 141.9
///   and 258.3 (NCCL 104.2 and 197.2); from 128 MiB the daemon's copy engines are faster
///   (430 against 442, 1463 against 1766 at 512 MiB), hence the cap;
/// - one direct reduce of 32 MiB (a 32 MiB limit) took 103.4, but a larger slot costs every
///   communicator GPU memory (4 slots per window), and all-reduce and broadcast are slower
///   as one larger direct op than on the daemon's path (32 MiB: 153.2 against 136.4, 132.4
///   against 109.1), so only a reduce is chunked and the slot stays.
///
/// On 3+ ranks a chunk is a split of n shares of the largest share (32 MiB on 4 ranks), whose
/// parts are those of [`split_share`]'s split: the daemon's reduce brings every rank's input
/// to the root ((n - 1) x the bytes into one GPU), the split moves 2 (n - 1) / n x the bytes
/// through each GPU. On 4x H200 (docs/benchmarks.md, 2026-11-28, "Larger shares on four
/// GPUs") a split reduce of 32 MiB took 192.3 us against the daemon's 328.7, and in chunks
/// 64 MiB took 383.0 and 128 MiB 768.5 against the daemon's 628.6 and 1124.7 (NCCL 201.9 and
/// 384.0).
pub(crate) fn reduce_chunk(
    kind: OpKind,
    count: u64,
    es: u64,
    n: u64,
    lim: Limits,
    most: u64,
) -> Option<u64> {
    let es = es.max(1);
    let bytes = count.saturating_mul(es);
    let chunk = if n == 2 {
        lim.whole / es
    } else {
        n.saturating_mul(lim.share / es)
    };
    // At most MAX_CHUNKS chunks of whole elements (a limit need not be a multiple of `es`).
    let top = most.min(chunk.saturating_mul(es).saturating_mul(MAX_CHUNKS));
    (kind == OpKind::Reduce && n >= 2 && count > chunk && bytes <= top && chunk > 0)
        .then_some(chunk)
}

/// The share (elements per rank) of an all-reduce, broadcast or reduce of `count` elements of
/// `es` bytes split into direct ops ([`Communicator::split_op`]), or `None` when it is not
/// split: within the direct limit `max` (one direct op), past `most` bytes
/// (`COMMD_DIRECT_SPLIT_MAX_BYTES`), or a share past `share_max`. Measured on 4x H200
/// (docs/benchmarks.md, 2026-11-28): at 4 and 8 MiB the two direct ops together take 0.5-0.65x
/// the daemon's path (all-reduce, broadcast, reduce).
pub(crate) fn split_share(
    count: u64,
    es: u64,
    n: u64,
    max: u64,
    share_max: u64,
    most: u64,
) -> Option<u64> {
    let bytes = count.saturating_mul(es);
    let share = count / n.max(1);
    (n >= 2 && bytes > max && bytes <= most && share > 0 && share * es <= share_max)
        .then_some(share)
}

/// One direct op of an op split into several ([`split_plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PlannedPart {
    pub kind: OpKind,
    pub part: Part,
    pub count: u64,
    pub send: Option<u64>,
    pub recv: Option<u64>,
}

/// The direct ops, in order, that rank `me` of `n` runs for an all-reduce, broadcast or reduce
/// (root `root`) of `count` elements of `es` bytes on buffers `send` and `recv`, split as
/// `split` says:
/// - in shares of `share` elements ([`split_share`]): the remainder of the count modulo `n`
///   first, as the same op, then the two parts of [`Communicator::split_op`];
/// - in chunks of `chunk` elements ([`reduce_chunk`]): each range in order, on 2 ranks as the
///   same op, on 3+ (a reduce only) split in shares as above; the last chunk's first part
///   marked (a rank whose count has fewer chunks than a peer's fails on its last one, instead
///   of pairing a peer's next chunk with its next op).
///
/// `Err`: a buffer this rank's parts need is missing, or a kind that does not split.
#[allow(clippy::too_many_arguments)]
pub(crate) fn split_plan(
    kind: OpKind,
    count: u64,
    es: u64,
    n: u32,
    me: u32,
    root: u32,
    send: Option<u64>,
    recv: Option<u64>,
    split: Split,
) -> std::result::Result<Vec<PlannedPart>, String> {
    let need = |p: Option<u64>, what: &str| {
        p.ok_or_else(|| format!("{} needs a {what} buffer", kind.name()))
    };
    let at = |p: Option<u64>, elems: u64| p.map(|p| p + elems * es);
    let rooted = kind.has_root();
    let share = match split {
        Split::Shares(share) => share,
        Split::Chunks(chunk) => {
            if !matches!(kind, OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce) {
                return Err(format!("{} is never split into direct ops", kind.name()));
            }
            if n > 2 && kind != OpKind::Reduce {
                return Err(format!(
                    "{} never runs in chunks on {n} ranks (only a reduce does)",
                    kind.name()
                ));
            }
            let me_root = me == root;
            if kind.uses_send(me_root) {
                need(send, "send")?;
            }
            if kind.uses_recv(me_root) {
                need(recv, "recv")?;
            }
            let chunk = chunk.max(1);
            let mut parts = Vec::with_capacity(count.div_ceil(chunk) as usize);
            let mut off = 0;
            while off < count {
                let c = chunk.min(count - off);
                let last = off + c == count;
                let (s, r) = (at(send, off), at(recv, off));
                if n <= 2 || c < u64::from(n) {
                    parts.push(PlannedPart {
                        kind,
                        part: Part::Of { rooted, last },
                        count: c,
                        send: s,
                        recv: r,
                    });
                } else {
                    // 3+ ranks: each chunk split in shares, its first part marked on the last.
                    let mut sub = split_plan(
                        kind,
                        c,
                        es,
                        n,
                        me,
                        root,
                        s,
                        r,
                        Split::Shares(c / u64::from(n)),
                    )?;
                    if last {
                        sub[0].part = sub[0].part.marked_last();
                    }
                    parts.extend(sub);
                }
                off += c;
            }
            return Ok(parts);
        }
    };
    let body = share * u64::from(n);
    let of = Part::Of {
        rooted,
        last: false,
    };
    let mut parts = Vec::with_capacity(3);
    if count > body {
        parts.push(PlannedPart {
            kind,
            part: of,
            count: count - body,
            send: at(send, body),
            recv: at(recv, body),
        });
    }
    let one = |kind, part, send, recv| PlannedPart {
        kind,
        part,
        count: share,
        send,
        recv,
    };
    match kind {
        OpKind::AllReduce | OpKind::Broadcast => {
            // This rank's share of the output: the first part fills it, the all-gather
            // spreads it.
            let recv = need(recv, "recv")?;
            let mine = Some(recv + u64::from(me) * share * es);
            if kind == OpKind::AllReduce {
                parts.push(one(
                    OpKind::ReduceScatter,
                    of,
                    Some(need(send, "send")?),
                    mine,
                ));
            } else {
                // Only the root reads a send buffer.
                let send = if me == root {
                    Some(need(send, "send")?)
                } else {
                    send
                };
                parts.push(one(OpKind::Broadcast, Part::Scatter, send, mine));
            }
            parts.push(one(OpKind::AllGather, of, mine, Some(recv)));
        }
        OpKind::Reduce => {
            let send = Some(need(send, "send")?);
            let root_share = if me == root {
                Some(need(recv, "recv")? + u64::from(root) * share * es)
            } else {
                None
            };
            parts.push(one(
                OpKind::ReduceScatter,
                Part::ReduceToScratch { last: false },
                send,
                root_share,
            ));
            parts.push(one(OpKind::Reduce, Part::Gather, root_share, recv));
        }
        _ => return Err(format!("{} is never split into direct ops", kind.name())),
    }
    Ok(parts)
}

/// How long a direct op waits for a peer's flag when the communicator has no op timeout.
const DEFAULT_TIMEOUT_S: u64 = 300;

/// A communicator's direct path: not tried yet, refused (why), or its windows.
#[derive(Default)]
pub(crate) enum State {
    #[default]
    Unknown,
    Off(String),
    On(Box<Windows>),
}

pub(crate) struct Windows {
    win: [sys::CUdeviceptr; 8],
    slot: u64,
    /// Tickets per op (`launch_grid`): twice the blocks of a small op.
    grid: u32,
    device: i32,
    /// The failure record: host address (read by the client) and device address.
    rec_host: usize,
    rec_dev: sys::CUdeviceptr,
    hint_dev: sys::CUdeviceptr,
    /// Direct ops so far (captured ones, or eager ones for eager windows): the next op's index
    /// (part of its flag, so ranks that replay different captured ops never pair).
    next_k: u32,
    /// The largest op moved by LL lines ([`ll_max`], the same on every rank).
    ll_max: u64,
    /// The smallest forwarded broadcast ([`bcast_forward_min`], the same on every rank).
    fwd_min: u64,
    /// Eager windows: the epoch of the last op launched (the host numbers eager ops, which run
    /// in issue order: `DirectArgs::epoch`); captured ops count tickets on the GPU instead.
    epoch: u64,
    /// Eager windows: their ops' status words (in the record page).
    status: Option<Arc<eager::StatusPool>>,
    /// Eager windows: the communicator's collectives sent to the daemon's path since they
    /// were set up (`kernels::direct::MARK_OFF`; [`Communicator::mark_daemon_op`]).
    daemon_ops: u32,
}

/// The configuration from the environment: `COMMD_GRAPH_DIRECT` (`auto`, the default, or
/// `0`/`off`), `COMMD_GRAPH_DIRECT_MAX_BYTES`, `COMMD_GRAPH_DIRECT_BLOCKS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    pub enabled: bool,
    /// `COMMD_GRAPH_DIRECT=shared`: ranks that share a GPU take the path too. For tests of
    /// the protocol with more ranks than GPUs: correct, but each wait is time-sliced against
    /// the peer's kernel (milliseconds per op).
    pub shared_gpus: bool,
    /// `None`: [`default_max_bytes`] for the communicator's size.
    pub max_bytes: Option<u64>,
    /// Blocks of a small direct op (`COMMD_GRAPH_DIRECT_BLOCKS`, at most half the SMs); a large
    /// one runs on twice as many ([`launch_grid`]).
    pub blocks: u32,
}

impl Config {
    pub fn from_env() -> std::result::Result<Self, String> {
        Self::parse(
            std::env::var("COMMD_GRAPH_DIRECT").ok().as_deref(),
            std::env::var("COMMD_GRAPH_DIRECT_MAX_BYTES")
                .ok()
                .as_deref(),
            std::env::var("COMMD_GRAPH_DIRECT_BLOCKS").ok().as_deref(),
        )
    }

    pub fn parse(
        mode: Option<&str>,
        max: Option<&str>,
        blocks: Option<&str>,
    ) -> std::result::Result<Self, String> {
        let (enabled, shared_gpus) = match mode.map(str::trim) {
            None | Some("") | Some("auto") | Some("1") | Some("on") => (true, false),
            Some("0") | Some("off") => (false, false),
            Some("shared") => (true, true),
            Some(v) => {
                return Err(format!(
                    "COMMD_GRAPH_DIRECT={v:?}: expected auto (the default), 0/off, or shared (tests only: also ranks sharing a GPU)"
                ));
            }
        };
        Ok(Self {
            enabled,
            shared_gpus,
            max_bytes: env_int("COMMD_GRAPH_DIRECT_MAX_BYTES", max, 0, 1 << 30)?,
            blocks: env_int("COMMD_GRAPH_DIRECT_BLOCKS", blocks, 1, 1024)?
                .map_or(DEFAULT_BLOCKS, |b| b as u32),
        })
    }

    /// The limits of each kind of direct op on `nranks` ranks: a set `max_bytes` is every one
    /// of them; by default copies stop at [`default_push_bytes`] and split shares at
    /// [`default_share_bytes`].
    pub fn limits(&self, nranks: u32) -> Limits {
        match self.max_bytes {
            Some(b) => Limits::all(b),
            None => {
                let whole = default_max_bytes(nranks);
                Limits {
                    whole,
                    push: default_push_bytes(nranks),
                    share: default_share_bytes(nranks),
                }
            }
        }
    }
}

/// Bytes of a rank's window for `n` ranks and `slot`-byte data slots: the header, the data
/// slots, then the LL lines (`kernels::direct::LL_SLOT_BYTES` per parity and source).
pub fn window_bytes(n: u32, slot: u64) -> u64 {
    ll_area_off(n, slot) + 2 * u64::from(n) * k::LL_SLOT_BYTES
}

/// Whether an op moves by LL lines: an eager op (`eager`, its epoch `epoch` numbered by the
/// host) of at most `ll_max` bytes on one block, without a root ([`rooted_mode`]), below epoch
/// 2^32. A line carries the low 32 bits of its epoch and a reader takes a line whose epoch
/// equals the one it awaits, so a line left unwritten since 2^32 epochs earlier would pass
/// for a fresh one: below 2^32 no line is that old (the LL area starts zeroed, epoch 0).
/// Captured ops keep the flags: their epochs count on the GPU, and a graph replayed for days
/// passes 2^32 ops. The same on every rank: its inputs are (the op, the exchanged setting,
/// the windows' shared sequence of ops).
pub(crate) fn ll_op(
    eager: bool,
    epoch: u64,
    blocks: u32,
    bytes: u64,
    ll_max: u64,
    mode: u32,
) -> bool {
    eager && epoch < 1 << 32 && blocks == 1 && bytes <= ll_max && !rooted_mode(mode)
}

/// Whether a kernel mode has a root (broadcast, reduce, and the scatter and gather of split
/// ones). Those keep the flags even under the LL limit: on 2x H200 (docs/benchmarks.md,
/// 2026-11-28) a broadcast of 8 B-4 KiB by lines took 8.2-8.4 us at best against 6.2-7.8 by
/// flags on one block, where all-reduce, all-to-all and reduce-scatter by lines took 0.1-2.1 us
/// less.
pub(crate) fn rooted_mode(mode: u32) -> bool {
    matches!(
        mode,
        k::MODE_BC | k::MODE_BCF | k::MODE_RED | k::MODE_SC | k::MODE_GA
    )
}

/// Offset of a window's LL area (zeroed at the setup: a line's epoch must never match stale
/// bytes).
fn ll_area_off(n: u32, slot: u64) -> u64 {
    k::DATA_OFF + 2 * u64::from(n) * slot
}

/// `COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES`: the smallest direct broadcast (bytes per rank) on 3+
/// ranks that runs forwarded (`kernels::direct::MODE_BCF`: the root pushes one part of n - 1 to
/// each non-root, which forwards it to the others, so the root's GPU sends the bytes once
/// instead of n - 1 times, one flag hop later); default 2 MiB; `0`: every one. Measured on 4x
/// H200 (docs/benchmarks.md, 2026-11-28, "A forwarded broadcast"; nccl-tests, us, against the
/// root pushing to every rank, and NCCL): 2 MiB 21.8 (24.8, 20.1), 1 MiB 16.6 (15.9, 12.4),
/// 256 KiB 12.0 (9.4, 10.4); as one op past the limit (a set limit of 8 MiB) 4 MiB 32.2 against
/// the split's 36.8 (NCCL 26.0), 8 MiB 54.4 against 56.6. The same on every rank (checked when
/// the windows are set up). Read once per process.
pub(crate) fn bcast_forward_min() -> Result<u64> {
    static V: SettingCell = SettingCell::new();
    BCAST_FORWARD_MIN.once(&V)
}

/// The kernel mode of a direct op of mode `mode` and `bytes` per rank on `n` ranks whose
/// forwarded broadcasts start at `fwd_min` bytes ([`bcast_forward_min`]): a whole broadcast
/// that size on 3+ ranks runs forwarded, the rest as they are. The same on every rank: its
/// inputs are.
pub(crate) fn forwarded(mode: u32, part: Part, n: u32, bytes: u64, fwd_min: u64) -> u32 {
    if mode == k::MODE_BC && part == Part::Whole && n >= 3 && bytes >= fwd_min {
        k::MODE_BCF
    } else {
        mode
    }
}

/// `COMMD_DIRECT_LL_MAX_BYTES`: the largest direct op (bytes per rank) that moves by LL lines
/// (at most `kernels::direct::LL_MAX_BYTES`, 4096, the default; only ops that run on one
/// block, `COMMD_DIRECT_ONE_BLOCK_MAX_BYTES`, and not broadcast or reduce: [`rooted_mode`]);
/// `0`: none. The same on every rank (checked when the windows are set up: a rank that moves
/// an op by lines and one that moves it by flags would fail it as a mismatch). Read once per
/// process.
pub(crate) fn ll_max() -> Result<u64> {
    static V: SettingCell = SettingCell::new();
    LL_MAX.once(&V)
}

/// `COMMD_DIRECT_DEFER_WAIT=1`, for measurements only (default 0): a rank that reads nothing
/// of its peers in a direct op (a broadcast's root, a reduce's non-root, ...) ends the op
/// without waiting for their flags, and its next direct op waits for them first
/// (`kernels::direct::DEFER_OFF`). Results and mismatch checks are as without it (a mismatch
/// at such an op fails that rank's next op); what is missing before it can be a default: a
/// peer may still write its flag into this rank's window after this rank's last op, so a
/// process that exits right then leaves that write to freed memory (the windows live until
/// the process exits; docs/design.md contract 7 rule 3 says what would close that). A rank's
/// own choice (its peers need not share it). Read once per process.
pub(crate) fn defer_wait() -> Result<bool> {
    static V: SettingCell = SettingCell::new();
    Ok(DEFER_WAIT.once(&V)? != 0)
}

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
const SCATTER_CODE: u32 = 0xf6;
const GATHER_CODE: u32 = 0xf7;

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
    fn marked_last(self) -> Part {
        match self {
            Part::Of { rooted, .. } => Part::Of { rooted, last: true },
            Part::ReduceToScratch { .. } => Part::ReduceToScratch { last: true },
            p => p,
        }
    }

    /// A part of a split broadcast or reduce (whose root is `peer`).
    fn rooted(self) -> bool {
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

/// A failure record's words as the kernel wrote them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    pub code: u32,
    pub rank: u32,
    pub epoch: u64,
    pub mine: (u64, u64),
    pub theirs: (u64, u64),
}

fn describe_sig(sig: u32) -> String {
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

fn dtype_name(sig: u32) -> String {
    DType::from_code(((sig >> 8) & 0xff) as u8)
        .map(|x| x.name().to_string())
        .unwrap_or_else(|| format!("dtype {}", (sig >> 8) & 0xff))
}

/// What a failure record means, for the error the client raises: of a replay of a captured op,
/// or (`eager`) of an eager direct op (contract 7 rule 8).
pub fn explain(r: &Record, me: u32, eager: bool) -> String {
    let e = r.epoch;
    let (m_sig, m_k, m_count) = (r.mine.0 as u32, (r.mine.1 >> 32) as u32, r.mine.1 as u32);
    let (t_sig, t_k, t_count) = (
        r.theirs.0 as u32,
        (r.theirs.1 >> 32) as u32,
        r.theirs.1 as u32,
    );
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
            r.theirs.0 as u32,
            r.theirs.1 as u32,
            describe_sig(m_sig),
            r.rank
        ),
        c => format!("{coll} (direct op #{e}) failed with code {c}"),
    }
}

impl Windows {
    /// Rank `me`'s scratch slot: parity 0's slot of `me` in its own window, which no rank
    /// pushes into (a rank pushes only into its peers' windows), `slot` bytes.
    fn scratch(&self, me: u32) -> sys::CUdeviceptr {
        self.win[me as usize] + k::DATA_OFF + u64::from(me) * self.slot
    }

    /// Takes the failure record, if the kernel wrote one since the last look.
    fn take(&self) -> Option<Record> {
        read_record(self.rec_host, true)
    }
}

/// An eager window set's failure record that the watchdog looks at (every 100 ms:
/// [`crate::Inner::report_direct_failures`]). A direct op that failed because a peer sent the
/// same op to the daemon's path ([`k::ELSEWHERE`]) leaves that peer waiting in the daemon,
/// which never sees the direct op: this rank then fails the communicator in the daemon
/// (`FailCommunicator`) with its own error, once, so every rank is told at once.
pub(crate) struct RecordWatch {
    pub(crate) page: usize,
    pub(crate) handle: u32,
    pub(crate) rank: u32,
    pub(crate) told: bool,
    /// The record of the communicator's direct send/recv (`p2p::P2pShared`), whose
    /// [`k::ELSEWHERE`] is a peer's send or receive on the daemon's path.
    pub(crate) p2p: bool,
}

impl crate::Inner {
    /// Tells the daemon, once per window set, of a record `r` (read from `page`) saying that a
    /// peer ran this rank's direct op on the daemon's path; `None`: looks at every window set's
    /// record (the watchdog). Errors of the call are dropped: the peers then fail at the op
    /// timeout, as before.
    pub(crate) fn report_direct_failures(&self, seen: Option<(usize, &Record)>) {
        let todo: Vec<(u32, String)> = {
            let mut g = lock(&self.gpu);
            g.records
                .iter_mut()
                .filter(|w| !w.told && seen.is_none_or(|(p, _)| p == w.page))
                .filter_map(|w| {
                    let r = match seen {
                        Some((_, r)) => *r,
                        None => read_record(w.page, false)?,
                    };
                    (r.code == k::ELSEWHERE).then(|| {
                        w.told = true;
                        let why = if w.p2p {
                            eager::explain_p2p(&r)
                        } else {
                            explain(&r, w.rank, true)
                        };
                        (w.handle, why)
                    })
                })
                .collect()
        };
        for (handle, why) in todo {
            let _ = self.fail_comm(handle, commd_proto::desc::status::MISMATCH, &why);
        }
    }
}

impl crate::Inner {
    /// The error of a direct op of communicator `handle` that failed with `code` (`message`:
    /// what failed, and why as the GPU saw it). One that stopped on the broken hint
    /// ([`k::BROKEN`]) knows only that the communicator is broken: the daemon's reason is
    /// added, with its status (`GetCommFailure`), so the error names the lost rank, the timed
    /// out op or the rank that failed the communicator.
    pub(crate) fn direct_error(&self, handle: u32, code: u32, message: String) -> Error {
        if code == k::BROKEN {
            return match self.comm_failure(handle) {
                Ok(Some((st, why))) => Error::Op {
                    kind: crate::OpErrorKind::from_status(st),
                    message: format!("{message}: {why}"),
                },
                Ok(None) | Err(_) => Error::Op {
                    kind: eager::op_error_kind(code),
                    message: format!(
                        "{message} (a rank's process or the daemon was lost, an op of it timed out in the daemon, or a rank failed it; the daemon could not say which: the next op on the communicator names it)"
                    ),
                },
            };
        }
        Error::Op {
            kind: eager::op_error_kind(code),
            message,
        }
    }
}

/// The failure record at `page` (a set of windows' record page), if the kernel wrote one since
/// the last look; `take`: cleared (the kernel writes the next failure's there).
fn read_record(page: usize, take: bool) -> Option<Record> {
    let base = page as *mut u8;
    // SAFETY: the record is a leaked page (see `setup`), 8-byte aligned; the GPU writes
    // it with volatile stores, code last, so code is read first with acquire.
    unsafe {
        let code = &*base.cast::<AtomicU32>();
        let c = code.load(Ordering::Acquire);
        if c == 0 {
            return None;
        }
        let w = |i: usize| std::ptr::read_volatile(base.cast::<u64>().add(i));
        let r = Record {
            code: c,
            rank: std::ptr::read_volatile(base.cast::<u32>().add(1)),
            epoch: w(1),
            mine: (w(2), w(3)),
            theirs: (w(4), w(5)),
        };
        if take {
            code.store(0, Ordering::Release);
        }
        Some(r)
    }
}

impl Communicator {
    /// Whether the daemon marked this communicator broken for good: a rank's process was lost,
    /// an op of it timed out in the daemon (or this process lost the daemon). One memory load; direct captured ops poll the same
    /// word on the GPU (`HINT_BROKEN`).
    pub fn is_broken(&self) -> bool {
        self.client
            .ring
            .doorbell_hint(self.doorbell_slot)
            .is_some_and(|h| h.load(Ordering::Acquire) & doorbell::HINT_BROKEN != 0)
    }

    /// How this communicator's captured collectives run: `"direct"` (contract 7),
    /// `"daemon: <why>"` (contract 6, and why not direct), or `"undecided"` before the first
    /// one was captured.
    pub fn cuda_graph_path(&self) -> String {
        match &lock(&self.gpu).direct {
            State::Unknown => "undecided".into(),
            State::Off(why) => format!("daemon: {why}"),
            State::On(_) => "direct".into(),
        }
    }

    /// How this communicator's small eager collectives run: `"direct"` (rule 8,
    /// `COMMD_EAGER_DIRECT`), `"daemon: <why>"`, or `"undecided"` before the first one that
    /// could.
    pub fn cuda_eager_path(&self) -> String {
        let e = match EagerConfig::cached_text() {
            Ok(e) => e,
            Err(e) => return format!("daemon: {e}"),
        };
        if !e.enabled {
            return "daemon: COMMD_EAGER_DIRECT is off".into();
        }
        if self.ranks_share_a_process {
            return "daemon: two ranks of the communicator are one process".into();
        }
        match &lock(&self.gpu).eager {
            State::Unknown => "undecided".into(),
            State::Off(why) => format!("daemon: {why}"),
            State::On(_) => "direct".into(),
        }
    }

    /// The failure of a direct op (a replay, or an eager op) on this communicator since the last
    /// look, as the error to raise (`cuda_graph_check`).
    pub(crate) fn direct_check(&self) -> Result<()> {
        let (code, message) = match self.direct_failure() {
            Some(f) => f,
            None => return Ok(()),
        };
        Err(self.client.direct_error(self.handle, code, message))
    }

    /// [`Communicator::direct_check`]'s failure, if any: its code and what failed, and why.
    fn direct_failure(&self) -> Option<(u32, String)> {
        let c = lock(&self.gpu);
        // A replay's failure, then an eager direct op's (rule 8: its request fails too, and
        // the communicator's next call raises, as for a failed op of the daemon's path).
        for (state, eager) in [(&c.direct, false), (&c.eager, true)] {
            let State::On(w) = state else {
                continue;
            };
            let Some(r) = w.take() else {
                continue;
            };
            if eager {
                // The peer on the daemon's path waits there for this op: told now, if the
                // watchdog has not yet told it.
                self.client.report_direct_failures(Some((w.rec_host, &r)));
            }
            let what = if eager {
                "an eager GPU collective run as a direct op"
            } else {
                "a replay of a GPU collective captured into a CUDA graph"
            };
            return Some((
                r.code,
                format!(
                    "{what} on communicator {} failed (its results are not valid): {}",
                    self.comm_id,
                    explain(&r, self.rank, eager)
                ),
            ));
        }
        let s = c.p2p_shared.as_ref()?;
        let r = s.take_record()?;
        // As for an eager op: the peer waiting on the daemon's path is told now.
        self.client.report_direct_failures(Some((s.page, &r)));
        Some((
            r.code,
            format!(
                "an eager GPU send/recv run as a direct op on communicator {} failed (its results are not valid): {}",
                self.comm_id,
                eager::explain_p2p(&r)
            ),
        ))
    }

    /// Before an eager collective that takes the daemon's path on `stream` (device `dev`) is
    /// posted: where the communicator has eager windows and the op's kind has a direct mode,
    /// counts it and writes this rank's daemon mark (`kernels::direct::MARK_OFF`) on the
    /// stream, so that a peer that ran the same op as a direct op (another count, across the
    /// limit) or issued its ops in another order fails at once, naming this rank, instead of
    /// waiting for a flag that never comes. One memory op on the stream; nothing elsewhere.
    ///
    /// # Safety
    /// `stream` is live and of device `dev`, whose context is current.
    pub(crate) unsafe fn mark_daemon_op(
        &self,
        eager: &mut State,
        kind: OpKind,
        stream: sys::CUstream,
        dev: i32,
    ) -> Result<()> {
        let State::On(w) = eager else {
            return Ok(());
        };
        if Part::Whole.mode(kind).is_none() || w.device != dev {
            return Ok(());
        }
        let d = w.daemon_ops.wrapping_add(1);
        let mark = ((w.epoch + 1) << 32) | u64::from(d);
        ck(
            // SAFETY: the window is this rank's own (device `dev`, live for the process); the
            // caller vouches for the stream.
            unsafe {
                sys::cuStreamWriteValue64_v2(
                    stream,
                    w.win[self.rank as usize] + k::MARK_OFF,
                    mark,
                    0,
                )
            },
            "cuStreamWriteValue64(daemon mark)",
        )?;
        w.daemon_ops = d;
        Ok(())
    }

    /// Runs `a` as a direct op if this communicator can: a captured collective (contract 7),
    /// or with `eager` an eager one (rule 8). `Ok(None)`: it takes the daemon's path instead.
    ///
    /// # Safety
    /// As `post_cuda_ordered`: live streams, device buffers valid for the op.
    pub(crate) unsafe fn try_direct(
        &self,
        a: &CudaOpArgs,
        eager: bool,
    ) -> Result<Option<CudaPosted>> {
        // SAFETY: the caller's contract.
        unsafe { self.direct_op(a, eager, Part::Whole) }
    }

    /// [`Self::try_direct`]; `part`: what the op is, by itself or one part of a split op (its
    /// signature marked [`PART`], never split again).
    ///
    /// # Safety
    /// As `try_direct`.
    unsafe fn direct_op(
        &self,
        a: &CudaOpArgs,
        eager: bool,
        part: Part,
    ) -> Result<Option<CudaPosted>> {
        let Some(mode) = part.mode(a.kind) else {
            return Ok(None);
        };
        // Copies (all-gather, broadcast) load the (dtype, sum) module: any dtype has one.
        let op = match (mode, a.redop) {
            (k::MODE_AG | k::MODE_BC | k::MODE_A2A | k::MODE_SC | k::MODE_GA, _) => RedOp::Sum,
            (_, Some(op)) => op,
            (_, None) => {
                return Err(Error::InvalidArgument(format!(
                    "{} needs a reduction op",
                    a.kind.name()
                )));
            }
        };
        // Bytes per rank: what each rank pushes to a peer, the size of a window slot.
        let bytes = a.count.saturating_mul(a.dtype.size());
        // Eager ops (rule 8): their own windows, sized and shared as COMMD_EAGER_DIRECT says,
        // never where two ranks are one process (the windows' setup blocks each rank until
        // every rank takes part, and one thread may drive several ranks).
        let cfg = if eager {
            let e = EagerConfig::cached()?;
            if !e.enabled || self.ranks_share_a_process {
                return Ok(None);
            }
            // The environment read once for eager ops (each one asks: a few microseconds
            // per op otherwise); captures read it each time, as before.
            static BLOCKS: std::sync::OnceLock<std::result::Result<u32, String>> =
                std::sync::OnceLock::new();
            let blocks = BLOCKS
                .get_or_init(|| Config::from_env().map(|c| c.blocks))
                .clone()
                .map_err(Error::InvalidArgument)?;
            Config {
                enabled: true,
                shared_gpus: e.shared_gpus,
                max_bytes: e.max_bytes,
                blocks,
            }
        } else {
            Config::from_env().map_err(Error::InvalidArgument)?
        };
        if !cfg.enabled {
            let mut c = lock(&self.gpu);
            if matches!(c.direct, State::Unknown) {
                c.direct = State::Off("COMMD_GRAPH_DIRECT=0".into());
            }
            return Ok(None);
        }
        let lim = cfg.limits(self.nranks);
        // Read for every op (a bad value fails each one, before any exchange with the peers).
        let most = split_max()?;
        let defer = defer_wait()?;
        if matches!(mode, k::MODE_AR | k::MODE_BC | k::MODE_RED)
            && part == Part::Whole
            && self.nodes <= 1
            && self.nranks <= k::MAX_RANKS
            && (mode == k::MODE_AR || a.peer < self.nranks)
            && let Some(split) = split_how(
                a.kind,
                a.count,
                a.dtype.size(),
                u64::from(self.nranks),
                lim,
                most,
            )
        {
            // SAFETY: the caller's contract.
            return unsafe { self.split_op(a, eager, split) };
        }
        // A part of a split op: its plan sized it to the split's share or chunk, within a slot.
        let max = if part != Part::Whole {
            lim.slot()
        } else {
            lim.of(mode)
        };
        if self.nodes > 1
            || self.nranks < 2
            || self.nranks > k::MAX_RANKS
            || bytes == 0
            || bytes > max
            || (a.kind.has_root() || part.rooted()) && a.peer >= self.nranks
        {
            return Ok(None);
        }
        let n = u64::from(self.nranks);
        let me_root = a.peer == self.rank;
        // (uses, elements) of the send and the recv buffer; a non-root's share of a split
        // reduce is in its scratch slot instead (below).
        let (send_use, recv_use) = part.buffers(a.kind, a.count, n, me_root);
        let mut device = None;
        let mut bufs = [0u64; 2];
        let mut span = None;
        for (i, (what, (uses, elems), p)) in
            [("send", send_use, a.send), ("recv", recv_use, a.recv)]
                .into_iter()
                .enumerate()
        {
            if !uses {
                continue;
            }
            let p = p.ok_or_else(|| {
                Error::InvalidArgument(format!("{} needs a {what} buffer", a.kind.name()))
            })?;
            let len = elems
                .and_then(|e| e.checked_mul(a.dtype.size()))
                .ok_or_else(|| Error::InvalidArgument(format!("count {} overflows", a.count)))?;
            // In place: one query for both buffers.
            let (base, size, ordinal) = match span {
                Some((q, s)) if q == p => s,
                _ => pointer_span(p)?,
            };
            span = Some((p, (base, size, ordinal)));
            if p.checked_add(len).is_none_or(|end| end > base + size) {
                return Err(Error::InvalidArgument(format!(
                    "{} {what} buffer {p:#x}: {len} bytes run past its allocation ({base:#x}, {size} bytes)",
                    a.kind.name(),
                )));
            }
            if *device.get_or_insert(ordinal) != ordinal {
                return Err(Error::InvalidArgument(format!(
                    "{} buffers on two devices ({} and {ordinal})",
                    a.kind.name(),
                    device.unwrap_or(-1),
                )));
            }
            bufs[i] = p;
        }
        let [mut send, mut recv] = bufs;
        let dev = match device {
            Some(d) => d,
            // No buffer of its own (a non-root's gather of a split reduce reads its scratch
            // slot only): the device of the windows that the op's first parts used.
            None => {
                let c = lock(&self.gpu);
                match if eager { &c.eager } else { &c.direct } {
                    State::On(w) => w.device,
                    _ => 0,
                }
            }
        };
        ensure_context(dev)?;
        super::prof::mark(super::prof::BUFFERS);
        let mut c = lock(&self.gpu);
        let super::CommGpu {
            direct,
            eager: eager_state,
            last,
            ..
        } = &mut *c;
        let state = if eager { eager_state } else { direct };
        if matches!(state, State::Unknown) {
            match self.setup(&cfg, dev, eager) {
                Ok(s) => *state = s,
                Err(e) => {
                    // The exchange itself failed (a rank that posted another op instead, whose
                    // op failed as a mismatch with it): this op fails too, so that every rank
                    // has spent one op of the communicator's sequence and the next ops pair as
                    // posted. Taking the daemon's path now would pair this op with the peer's
                    // next one.
                    *state = State::Off(format!("setting up the direct path failed: {e}"));
                    return Err(e);
                }
            }
        }
        let w = match state {
            State::On(w) if w.device == dev => w,
            State::On(w) => {
                return Err(Error::InvalidArgument(format!(
                    "{} on device {dev}, but this rank's earlier direct ops on the communicator used device {}",
                    a.kind.name(),
                    w.device
                )));
            }
            _ => return Ok(None),
        };
        if bytes > w.slot {
            return Ok(None);
        }
        let (send_scratch, recv_scratch) = part.scratch(me_root);
        if send_scratch {
            send = w.scratch(self.rank);
        }
        if recv_scratch {
            recv = w.scratch(self.rank);
        }
        let i = &self.client;
        let mut g = lock(&i.gpu);
        let pool = g.events.clone();
        let kern = g.kernels.get_or_insert_with(kernels::Kernels::new);
        kern.prepare(a.dtype, op)?;
        if let Some(after) = a.after
            && after != a.stream
        {
            let ev = pool.get(dev)?;
            // SAFETY: `after` is live (caller) and of the op's device.
            unsafe { ev.record(after)? };
            // SAFETY: `a.stream` is live (caller).
            unsafe { ev.wait_on(a.stream)? };
        }
        // An eager op on another stream than the communicator's last eager op (of either path)
        // waits for it on the GPU: the windows' epochs and the daemon's ready counter both
        // need the communicator's ops in issue order (as `post_cuda_ordered`).
        if eager
            && let Some((ls, ev)) = last.as_ref()
            && *ls != a.stream as usize
        {
            // SAFETY: `a.stream` is live (caller); the event is owned by the communicator.
            unsafe { ev.wait_on(a.stream)? };
        }
        // An eager op's status word, zeroed (the kernel writes its failure code there).
        let status = match (&w.status, eager) {
            (Some(sp), true) => Some((sp.clone(), sp.take()?)),
            (None, true) => {
                return Err(Error::InvalidArgument(
                    "eager direct windows without status words (internal error)".into(),
                ));
            }
            _ => None,
        };
        let (blocks, unit) = launch_grid(w.grid, bytes, self.nranks, one_block_max()?);
        let mode = forwarded(mode, part, self.nranks, bytes, w.fwd_min);
        let args = DirectArgs {
            win: w.win,
            input: send,
            out: recv,
            count: a.count,
            slot: w.slot,
            rec: w.rec_dev,
            hint: w.hint_dev,
            timeout_ns: self
                .op_timeout
                .unwrap_or(std::time::Duration::from_secs(DEFAULT_TIMEOUT_S))
                .as_nanos()
                .min(u128::from(u64::MAX)) as u64,
            me: self.rank,
            n: self.nranks,
            sig: part_signature(part, a.kind, a.dtype, op, a.peer),
            k: w.next_k,
            divisor: self.nranks,
            mode,
            root: a.peer,
            status: status.as_ref().map_or(0, |(_, w)| *w),
            unit,
            ll: u32::from(ll_op(eager, w.epoch + 1, blocks, bytes, w.ll_max, mode)),
            defer: u32::from(defer),
            dseq: if eager { w.daemon_ops } else { 0 },
            epoch: if eager { w.epoch + 1 } else { 0 },
        };
        super::prof::mark(super::prof::PREPARE);
        // SAFETY: the windows, record and hint word live for the process (`setup`); the
        // buffers were checked above; the caller vouches for the stream.
        if let Err(e) = unsafe { kern.launch_direct(a.stream, a.dtype, op, blocks, &args) } {
            if let Some((sp, word)) = &status {
                sp.give_back(*word);
            }
            return Err(e.into());
        }
        super::prof::mark(super::prof::LAUNCH);
        w.next_k = w.next_k.wrapping_add(1);
        if eager {
            w.epoch += 1;
        }
        let Some((sp, word)) = status else {
            let done = if a.record {
                let ev = pool.get(dev)?;
                // SAFETY: `a.stream` is live and of the event's device.
                unsafe { ev.record(a.stream)? };
                Some(Arc::new(ev))
            } else {
                None
            };
            return Ok(Some(CudaPosted {
                request: Request::new(i.clone(), 0, Some(Ok(0)), None),
                done,
                device: dev,
                last_ticket: 0,
                bytes,
                captured: true,
            }));
        };
        // Eager: one event after the kernel is the op's completion, the order point for the
        // communicator's next op on another stream, and (`a.record`) the caller's done event.
        // (A word whose kernel was launched is never given back: if this record failed, the
        // kernel could still write it after another op took it.)
        let ev = pool.get(dev).map(Arc::new).and_then(|ev| {
            // SAFETY: `a.stream` is live and of the event's device.
            unsafe { ev.record(a.stream) }.map(|()| ev)
        });
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                // The op is launched but no event orders the communicator's next op after it.
                // Eager epochs are numbered in issue order (`DirectArgs::epoch`), so the GPU
                // must run them in that order: wait for this one before failing.
                // SAFETY: `a.stream` is live (caller); an eager op's stream is not capturing.
                let _ = unsafe { sys::cuStreamSynchronize(a.stream) };
                return Err(e);
            }
        };
        *last = Some((a.stream as usize, ev.clone()));
        let op = sp.launched(word, ev.clone(), false);
        let posted = self.eager_posted(a, sp, op, ev, dev, bytes);
        super::prof::mark(super::prof::EVENT);
        Ok(Some(posted))
    }

    /// An op past the direct limit as direct ops (`COMMD_DIRECT_SPLIT_MAX_BYTES`,
    /// [`split_share`]), each a kernel on the caller's stream, marked [`PART`]: the count's
    /// remainder modulo the ranks first (the same op on the last elements; first, so that ranks
    /// whose counts differ only there fail at once), then the body in shares of `share`
    /// elements, one per rank:
    /// - all-reduce: a reduce-scatter into this rank's share of the output (NCCL's in-place
    ///   layout when the buffers are one), then an all-gather of the shares in place;
    /// - broadcast: a scatter of the root's input into each rank's share of the output, then the
    ///   same all-gather;
    /// - reduce: a reduce-scatter into the root's share of its output and the other ranks'
    ///   scratch slots (their buffers are the input only), then a gather of the shares to the
    ///   root.
    ///
    /// Each GPU sends at most 2 (n - 1) / n x the bytes in two launches, against the daemon's
    /// copy-engine rounds with a host turnaround each. A reduce whose share is past the split
    /// runs in chunks instead ([`Split::Chunks`]): on 2 ranks the same reduce on each range of
    /// at most the direct limit, one launch each; on 3+ each chunk split in shares as above. An eager call's request fails if any part
    /// failed (`LocalDone::earlier`); `Ok(None)` when the direct path is off (no part ran: the
    /// same on every rank).
    ///
    /// # Safety
    /// As `try_direct`.
    unsafe fn split_op(
        &self,
        a: &CudaOpArgs,
        eager: bool,
        split: Split,
    ) -> Result<Option<CudaPosted>> {
        let es = a.dtype.size();
        let plan = split_plan(
            a.kind,
            a.count,
            es,
            self.nranks,
            self.rank,
            a.peer,
            a.send,
            a.recv,
            split,
        )
        .map_err(Error::InvalidArgument)?;
        let parts: Vec<(CudaOpArgs, Part)> = plan
            .into_iter()
            .map(|p| {
                let args = CudaOpArgs {
                    kind: p.kind,
                    count: p.count,
                    send: p.send,
                    recv: p.recv,
                    ..*a
                };
                (args, p.part)
            })
            .collect();
        let last = parts.len() - 1;
        let mut earlier = Vec::with_capacity(last);
        for (i, (mut p, part)) in parts.into_iter().enumerate() {
            if i > 0 {
                p.after = None;
            }
            p.record = a.record && i == last;
            // SAFETY: the caller's contract; every part lies within the op's buffers (or a
            // scratch slot of the windows).
            let Some(mut posted) = (unsafe { self.direct_op(&p, eager, part)? }) else {
                if i == 0 {
                    return Ok(None);
                }
                return Err(Error::InvalidArgument(format!(
                    "{} split into direct ops: part {i} could not run after part 0 did (internal error)",
                    a.kind.name()
                )));
            };
            if i < last {
                earlier.extend(posted.request.local.take().map(|l| l.op));
                continue;
            }
            if let Some(l) = posted.request.local.as_mut() {
                l.earlier = std::mem::take(&mut earlier);
                l.what = a.kind.name();
            }
            posted.bytes = a.count.saturating_mul(es);
            return Ok(Some(posted));
        }
        Ok(None)
    }

    /// The posted op of an eager direct op (collective or send/recv): its status `op` (launched
    /// on a word of `pool`), completed by `ev` (recorded after its kernel).
    pub(crate) fn eager_posted(
        &self,
        a: &CudaOpArgs,
        pool: Arc<eager::StatusPool>,
        op: Arc<eager::OpStatus>,
        ev: Arc<super::CudaEvent>,
        dev: i32,
        bytes: u64,
    ) -> CudaPosted {
        CudaPosted {
            request: Request::new(
                self.client.clone(),
                0,
                None,
                Some(LocalDone {
                    pool,
                    op,
                    earlier: Vec::new(),
                    comm_id: self.comm_id,
                    handle: self.handle,
                    rank: self.rank,
                    what: a.kind.name(),
                }),
            ),
            done: a.record.then_some(ev),
            device: dev,
            last_ticket: 0,
            bytes,
            captured: false,
        }
    }

    /// Sets up the windows (module doc): the same outcome on every rank. `eager`: the windows
    /// of eager direct ops (rule 8), apart from the captured ops' ones. An error is of the
    /// exchange itself (a peer that did not take part), the same on every rank that saw it; the
    /// others fail their all-gather the same way.
    fn setup(&self, cfg: &Config, dev: i32, eager: bool) -> Result<State> {
        let n = self.nranks;
        let i = &self.client;
        let lim = cfg.limits(n);
        let slot = lim.slot();
        let sms = lock(&i.gpu)
            .kernels
            .get_or_insert_with(kernels::Kernels::new)
            .sm_count()?;
        // Tickets per op: a small op's blocks (at most half the SMs) twice (`launch_grid`).
        let grid = 2 * cfg.blocks.min(sms / 2).max(1);
        let wbytes = window_bytes(n, slot);
        let mut offer = vec![0u8; OFFER_BYTES as usize];
        // My window: allocated, its header zeroed, exported.
        let mut local_err = None;
        let mut win: sys::CUdeviceptr = 0;
        let ll_off = ll_area_off(n, slot);
        let zero = [(0, k::DATA_OFF), (ll_off, wbytes - ll_off)];
        let alloc = alloc_window(wbytes, &zero).map(|(p, h)| {
            win = p;
            offer[..64].copy_from_slice(&h);
        });
        if let Err(e) = alloc {
            local_err = Some(format!("rank {}: {e}", self.rank));
        }
        let uuid = super::device_uuid(dev)?;
        offer[64..80].copy_from_slice(&uuid);
        offer[80..88].copy_from_slice(&slot.to_le_bytes());
        offer[88..92].copy_from_slice(&grid.to_le_bytes());
        offer[92] = u8::from(local_err.is_none());
        // (Read by every op before it gets here: `direct_op`.)
        offer[96..104].copy_from_slice(&split_max()?.to_le_bytes());
        let ll = ll_max()?;
        offer[104..112].copy_from_slice(&ll.to_le_bytes());
        // The limit of a whole op too: two ranks with one slot size may still differ there.
        offer[112..120].copy_from_slice(&lim.whole.to_le_bytes());
        let fwd = bcast_forward_min()?;
        offer[120..128].copy_from_slice(&fwd.to_le_bytes());
        let all = self.host_all_gather(&offer)?;
        let part = |r: usize| &all[r * OFFER_BYTES as usize..(r + 1) * OFFER_BYTES as usize];
        // Decisions every rank makes alike from the same offers.
        let mut why = None;
        for r in 0..n as usize {
            let o = part(r);
            if o[92] != 1 {
                why = Some(format!("rank {r} could not allocate its window"));
            } else if o[80..88] != offer[80..88]
                || o[88..92] != offer[88..92]
                || o[112..120] != offer[112..120]
            {
                why = Some(format!(
                    "rank {r} has another {} or COMMD_GRAPH_DIRECT_BLOCKS (or GPU size) than rank {}",
                    if eager {
                        "COMMD_EAGER_DIRECT_MAX_BYTES"
                    } else {
                        "COMMD_GRAPH_DIRECT_MAX_BYTES"
                    },
                    self.rank
                ));
            } else if o[104..112] != offer[104..112] {
                why = Some(format!(
                    "rank {r} has another COMMD_DIRECT_LL_MAX_BYTES than rank {}",
                    self.rank
                ));
            } else if o[120..128] != offer[120..128] {
                why = Some(format!(
                    "rank {r} has another COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES than rank {}",
                    self.rank
                ));
            } else if o[96..104] != offer[96..104] {
                why = Some(format!(
                    "rank {r} has another COMMD_DIRECT_SPLIT_MAX_BYTES than rank {}",
                    self.rank
                ));
            } else if let Some(q) = (0..r)
                .find(|&q| part(q)[64..80] == o[64..80])
                .filter(|_| !cfg.shared_gpus)
            {
                why = Some(format!(
                    "ranks {q} and {r} share a GPU (a kernel that waits for a peer on the same GPU would be time-sliced against it)"
                ));
            }
            if why.is_some() {
                break;
            }
        }
        // Open the peers' windows (only when every offer was acceptable).
        let mut wins = [0u64; 8];
        wins[self.rank as usize] = win;
        let mut opened = Vec::new();
        let mut mine_ok = why.is_none() && local_err.is_none();
        let mut my_why = String::new();
        if mine_ok {
            for r in (0..n as usize).filter(|&r| r != self.rank as usize) {
                match open_peer(dev, part(r)) {
                    Ok(p) => {
                        wins[r] = p;
                        opened.push(p);
                    }
                    Err(e) => {
                        my_why = format!("rank {} cannot map rank {r}'s window: {e}", self.rank);
                        mine_ok = false;
                        break;
                    }
                }
            }
        }
        // The failure record (one leaked page, mapped for the device) and the hint word: made
        // before the verdict, so that a rank that cannot make them says so there instead of
        // leaving the others waiting for its flags.
        let mut rec = None;
        if mine_ok {
            match self.record_page() {
                Ok(r) => rec = Some(r),
                Err(e) => {
                    my_why = format!("rank {}: {e}", self.rank);
                    mine_ok = false;
                }
            }
        }
        // Every rank says whether it could; all or none take the path.
        let mut verdict = vec![0u8; 8];
        verdict[0] = u8::from(mine_ok);
        let verdicts = self.host_all_gather(&verdict)?;
        let failed: Vec<u32> = (0..n).filter(|&r| verdicts[r as usize * 8] != 1).collect();
        if why.is_none() && !failed.is_empty() {
            why = Some(if my_why.is_empty() {
                format!(
                    "rank(s) {failed:?} could not map their peers' windows (peer access between the GPUs, or GPUs not visible to those processes) or their failure record"
                )
            } else {
                my_why
            });
        }
        if let Some(why) = why {
            for p in opened {
                // SAFETY: opened above with cuIpcOpenMemHandle; no work uses it.
                unsafe { sys::cuIpcCloseMemHandle(p) };
            }
            if win != 0 {
                // SAFETY: allocated above; no work uses it.
                unsafe { sys::cuMemFree_v2(win) };
            }
            if self.rank == 0 {
                let which = if eager {
                    "eager GPU collectives (COMMD_EAGER_DIRECT)"
                } else {
                    "collectives captured into CUDA graphs"
                };
                eprintln!(
                    "commd: communicator {}: {which} take the daemon's path (contract 6), not the direct one: {why}",
                    self.comm_id
                );
            }
            return Ok(State::Off(why));
        }
        let Some((page, rec_dev, hint_dev)) = rec else {
            return Err(Error::InvalidArgument(
                "direct path: the verdict was taken without a record (internal error)".into(),
            ));
        };
        if eager {
            lock(&i.gpu).records.push(RecordWatch {
                page: page as usize,
                handle: self.handle,
                rank: self.rank,
                told: false,
                p2p: false,
            });
        }
        Ok(State::On(Box::new(Windows {
            win: wins,
            slot,
            grid,
            device: dev,
            rec_host: page as usize,
            rec_dev,
            hint_dev,
            next_k: 0,
            epoch: 0,
            daemon_ops: 0,
            ll_max: ll,
            fwd_min: fwd,
            // SAFETY: `record_page` leaks the page: it lives for the process.
            status: eager.then(|| Arc::new(unsafe { eager::StatusPool::new(page as usize) })),
        })))
    }

    /// GPU memory this process allocated for the communicator's direct ops, in bytes: the
    /// windows of captured and eager collectives, the rounds kernel's barrier and the
    /// send/recv inboxes. All of it is kept until the process exits (peers and graphs may
    /// still use it), so it only grows; the NCCL library reports it as `ncclCommMemStats`.
    pub fn cuda_memory_bytes(&self) -> u64 {
        let c = lock(&self.gpu);
        let win = |s: &State| match s {
            State::On(w) => window_bytes(self.nranks, w.slot),
            _ => 0,
        };
        win(&c.direct) + win(&c.eager) + c.rounds_bar.map_or(0, |_| 16) + p2p::inbox_bytes(&c.p2p)
    }

    /// A zeroed page for the failure record (and eager status words), leaked (a graph may
    /// outlive the communicator) and mapped for the device; and the device address of this
    /// communicator's doorbell hint word.
    fn record_page(&self) -> Result<(*mut u8, sys::CUdeviceptr, sys::CUdeviceptr)> {
        let i = &self.client;
        if self.doorbell_slot == doorbell::NO_SLOT {
            return Err(Error::InvalidArgument(
                "the communicator has no doorbell slot".into(),
            ));
        }
        let layout = std::alloc::Layout::from_size_align(4096, 4096)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        // SAFETY: non-zero size; zeroed; never freed.
        let page = unsafe { std::alloc::alloc_zeroed(layout) };
        if page.is_null() {
            return Err(Error::InvalidArgument(
                "out of memory for the direct-op record".into(),
            ));
        }
        // SAFETY: `page` is page-aligned, one page, mapped for the process's life.
        let rec_dev = unsafe { map_host(page, 4096, "direct-op record")? };
        let hint_dev = {
            let mut g = lock(&i.gpu);
            i.doorbell_dev(&mut g)?
        } + doorbell::HINT_OFF
            + 4 * u64::from(self.doorbell_slot);
        Ok((page, rec_dev, hint_dev))
    }

    /// All-gathers `mine` (the same length on every rank) through the daemon (host memory).
    fn host_all_gather(&self, mine: &[u8]) -> Result<Vec<u8>> {
        let client = Client {
            inner: self.client.clone(),
        };
        let len = mine.len() as u64;
        let mut send = client.alloc(len)?;
        send.as_mut_slice().copy_from_slice(mine);
        let recv = client.alloc(len * u64::from(self.nranks))?;
        self.all_gather((&send, 0), (&recv, 0), len, DType::U8)?
            .wait()?;
        Ok(recv.as_slice().to_vec())
    }
}

/// A window of `bytes` on the current context's device, its first `zero` bytes zeroed, and its
/// IPC handle: (address, handle).
fn alloc_window(
    bytes: u64,
    zero: &[(u64, u64)],
) -> std::result::Result<(sys::CUdeviceptr, [u8; 64]), cu::CuError> {
    let mut win: sys::CUdeviceptr = 0;
    ck(
        // SAFETY: valid out pointer; the caller made the device's context current.
        unsafe { sys::cuMemAlloc_v2(&mut win, bytes as usize) },
        "cuMemAlloc",
    )?;
    let fail = |e| {
        // SAFETY: allocated above; nothing uses it.
        unsafe { sys::cuMemFree_v2(win) };
        e
    };
    // A stream of its own: a memset on the legacy stream would invalidate the caller's capture.
    let s = cu::context::stream_nonblocking().map_err(fail)?;
    let r = zero
        .iter()
        .try_for_each(|&(at, len)| {
            let len = len.min(bytes.saturating_sub(at));
            // SAFETY: `[at, at + len)` lies within the `bytes` of `win`; `s` is live.
            ck(
                unsafe { sys::cuMemsetD8Async(win + at, 0, len as usize, s) },
                "cuMemsetD8Async",
            )
        })
        .and_then(|()| {
            ck(
                // SAFETY: as above.
                unsafe { sys::cuStreamSynchronize(s) },
                "cuStreamSynchronize",
            )
        });
    // SAFETY: `s` was created above.
    unsafe { sys::cuStreamDestroy_v2(s) };
    r.map_err(fail)?;
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    ck(
        // SAFETY: `win` is a cuMemAlloc allocation; valid out pointer.
        unsafe { sys::cuIpcGetMemHandle(&mut h, win) },
        "cuIpcGetMemHandle",
    )
    .map_err(fail)?;
    let mut out = [0u8; 64];
    for (d, s) in out.iter_mut().zip(h.reserved.iter()) {
        *d = *s as u8;
    }
    Ok((win, out))
}

/// Maps the window that a peer's offer names, in the current context (of `dev`).
fn open_peer(dev: i32, offer: &[u8]) -> std::result::Result<sys::CUdeviceptr, String> {
    let uuid: [u8; 16] = offer[64..80]
        .try_into()
        .map_err(|_| "short offer".to_string())?;
    let count = cu::device_count().map_err(|e| e.to_string())?;
    let peer = (0..count)
        .find(|&o| super::device_uuid(o).is_ok_and(|u| u == uuid))
        .ok_or("its GPU is not visible in this process (CUDA_VISIBLE_DEVICES)")?;
    if !cu::context::can_access_peer(dev, peer).map_err(|e| e.to_string())? {
        return Err(format!("no peer access from GPU {dev} to GPU {peer}"));
    }
    // The handle names a live allocation of the peer: it is in the all-gather, which the peer
    // completed after exporting it.
    cu::ipc_open(&offer[..64], "cuIpcOpenMemHandle").map_err(|e| e.to_string())
}

mod eager;
pub use eager::EagerConfig;
pub(crate) use eager::LocalDone;

mod p2p;
pub use p2p::P2pConfig;
pub(crate) use p2p::{P2pShared, Pair};

#[cfg(test)]
mod model;
#[cfg(test)]
mod p2p_model;

#[cfg(test)]
mod tests {
    use super::*;

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
        // them before it finds that it runs no direct op: that once divided by zero).
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
        // 2 ranks with the limit set to 4 MiB (as before 2026-11-28): split up to 8 MiB.
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
        let parts: Vec<(OpKind, Part, u64)> =
            plan.iter().map(|p| (p.kind, p.part, p.count)).collect();
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
                        let input = |r: u32, i: u64| i64::from(r + 1) * 1000 + i as i64;
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
                            let first_of_last = full as usize * per(c);
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
        // The same record of an eager direct op (rule 8) speaks of eager ops, not replays.
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
            eager::op_error_kind(k::ELSEWHERE),
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
            assert!(e.contains(set.name) && e.contains(bad), "{e}");
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
}
