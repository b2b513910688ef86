//! How an op past the direct limit runs as direct ops: the split into shares or chunks, and
//! the plan of parts that every rank computes alike.

use commd_proto::desc::OpKind;

use super::config::Limits;
use super::signature::Part;

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
pub(super) const MAX_CHUNKS: u64 = 4;

/// The elements of each chunk of a reduce of `count` elements of `es` bytes on `n` ranks past
/// what runs as one direct op or one split (limits `lim`), up to [`MAX_CHUNKS`] chunks and
/// `most` bytes (`COMMD_DIRECT_SPLIT_MAX_BYTES`); each chunk runs in order, the last one marked.
/// On 2 ranks a chunk is one direct reduce of the limit: there a reduce's share (half the op)
/// is past the split's ([`default_share_bytes`]), and the daemon's path is slower than NCCL.
/// On 2 GPUs (nccl-tests):
/// - in chunks of 16 MiB, a reduce of 32 or 64 MiB is faster than on the daemon's path
///   (docs/benchmarks.md row `nccl2-reduce-32M-64M`); from 128 MiB the daemon's copy engines
///   are faster (docs/benchmarks.md row `nccl2-reduce-128M`), hence the cap;
/// - one direct reduce of 32 MiB (a 32 MiB limit) is faster still, but a larger slot costs
///   every communicator GPU memory (4 slots per window), and all-reduce and broadcast are
///   slower as one larger direct op than on the daemon's path, so only a reduce is chunked and
///   the slot stays.
///
/// On 3+ ranks a chunk is a split of n shares of the largest share (32 MiB on 4 ranks), whose
/// parts are those of [`split_share`]'s split: the daemon's reduce brings every rank's input
/// to the root ((n - 1) x the bytes into one GPU), the split moves 2 (n - 1) / n x the bytes
/// through each GPU. On 4 GPUs a split reduce of 32 MiB, and in chunks one of 64 or 128 MiB,
/// is faster than on the daemon's path (docs/benchmarks.md rows `nccl4-reduce-32M`,
/// `nccl4-reduce-128M`).
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
/// (`COMMD_DIRECT_SPLIT_MAX_BYTES`), or a share past `share_max`. On 4 GPUs, at 4 and 8 MiB,
/// the two direct ops together take less time than the daemon's path (all-reduce, broadcast,
/// reduce; docs/benchmarks.md rows `nccl4-allreduce-4M-16M`, `nccl4-broadcast-8M`,
/// `nccl4-reduce-8M`).
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
            let mut parts = Vec::with_capacity(commd_proto::num::usize_of(count.div_ceil(chunk)));
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
