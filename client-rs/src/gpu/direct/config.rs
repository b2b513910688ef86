//! What the environment and the GPU allow a direct op: its grid, the size limits of each kind
//! of op, and the direct path's settings (graph, split, LL lines, forwarded broadcasts).

use super::signature::Part;
use crate::gpu::kernels::direct as k;
use crate::{Error, Result};

/// Default blocks of the direct kernel (fewer on a GPU with fewer SMs): 16 and 64 blocks take
/// the same time up to 64 KiB, and from 512 KiB 64 blocks are faster (docs/benchmarks.md row
/// `graph2-allreduce-1M-4M`).
pub const DEFAULT_BLOCKS: u32 = 64;

/// A direct op whose pushes reach this many bytes ((n - 1) x its bytes per rank) runs on twice
/// the blocks ([`launch_grid`]): on 4 GPUs 128 blocks take less time than 64 from 6 MiB of
/// pushes, and more up to 3 MiB.
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
/// Against the half grid at 8 B-4 KiB, one block on its own is faster for broadcast and
/// reduce-scatter and slightly slower for all-reduce and all-to-all; with LL lines (which need
/// it) all-reduce, all-to-all and reduce-scatter are faster (docs/benchmarks.md row
/// `nccl2-allreduce-8B`).
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
/// - on 2 GPUs an all-gather or all-to-all with 16 MiB per rank is slower direct than on the
///   daemon's path, with 8 MiB per rank faster (docs/benchmarks.md row `nccl2-allgather-16M`);
/// - on 4 GPUs, with a push loading every peer's chunk at once, 8 MiB per peer (24 MiB of
///   pushes) is faster direct than on the daemon's path for an all-gather, all-to-all and
///   reduce-scatter (docs/benchmarks.md rows `nccl4-allgather-32M`, `nccl4-alltoall-32M`,
///   `nccl4-reduce-scatter-32M`).
pub fn default_push_bytes(nranks: u32) -> u64 {
    let per = (24u64 << 20) / u64::from(nranks.saturating_sub(1).max(1));
    pow2_floor(per.min(8 << 20))
}

/// The largest power of two at most `x` (at least 1).
pub(super) fn pow2_floor(x: u64) -> u64 {
    1u64 << (63 - x.max(1).leading_zeros())
}

/// The default largest direct all-reduce, reduce-scatter, broadcast and reduce (bytes per rank),
/// on 2 ranks 16 MiB, elsewhere the power of two at most 8 MiB / (n - 1) and 4 MiB (4 MiB for 3
/// ranks, 2 MiB for 4 to 5, 1 MiB for 6 to 8; on 4 GPUs one direct op of 4 or 8 MiB is slower
/// than the split). A window slot is the largest of the limits ([`Limits::slot`]). On 2 GPUs
/// an all-reduce, reduce or broadcast of 16 MiB and a reduce-scatter of 32 MiB are faster as
/// one direct op than under a 4 MiB limit (docs/benchmarks.md rows `nccl2-allreduce-8M-16M`,
/// `nccl2-reduce-8M-16M`, `nccl2-broadcast-8M-16M`, `nccl2-reduce-scatter-32M`); at 32 MiB per
/// rank the daemon's path is as fast or faster. On more ranks an op past the limit whose share
/// fits is split into direct ops; larger ones take the daemon's path, whose reduce-scatter +
/// all-gather moves 2 (n - 1) / n x the bytes.
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
/// rounds. On 4 GPUs a broadcast, reduce or all-reduce of 16 MiB (4 MiB shares) and of 32 MiB
/// (8 MiB shares) is faster than with 2 MiB shares, whose split stops at 8 MiB
/// (docs/benchmarks.md rows `nccl4-broadcast-32M`, `nccl4-reduce-16M`, `nccl4-reduce-32M`,
/// `nccl4-allreduce-32M`). The limit of a whole direct op stays: one direct op of 4 or 8 MiB
/// is slower than the split. 3 and 5 to 8 ranks follow the same rule, not measured (no such
/// machine).
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
    /// larger of `push` and `whole` (on 4 GPUs a reduce-scatter of 16 MiB, 4 MiB per peer, is
    /// faster direct than on the daemon's path: docs/benchmarks.md row
    /// `nccl4-reduce-scatter-16M`); the rest `whole`.
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
pub(super) struct Setting {
    pub(super) key: &'static commd_settings::Key,
    pub(super) lo: u64,
    pub(super) hi: u64,
    pub(super) default: u64,
}

/// Where a setting's value (or its error) is kept once read.
pub(super) type SettingCell = std::sync::OnceLock<std::result::Result<u64, String>>;

impl Setting {
    pub(super) fn parse(&self, v: Option<&str>) -> std::result::Result<u64, String> {
        Ok(env_int(self.key.name, v, self.lo, self.hi)?.unwrap_or(self.default))
    }

    /// The process's value, read from the environment once into `cell`.
    pub(super) fn once(&self, cell: &'static SettingCell) -> Result<u64> {
        cell.get_or_init(|| self.parse(commd_settings::get(self.key).as_deref()))
            .clone()
            .map_err(Error::InvalidArgument)
    }
}

pub(super) const SPLIT_MAX: Setting = Setting {
    key: &commd_settings::keys::DIRECT_SPLIT_MAX_BYTES,
    lo: 0,
    hi: 1 << 40,
    default: u64::MAX,
};

pub(super) const ONE_BLOCK_MAX: Setting = Setting {
    key: &commd_settings::keys::DIRECT_ONE_BLOCK_MAX_BYTES,
    lo: 0,
    hi: 1 << 20,
    default: 4096,
};

pub(super) const BCAST_FORWARD_MIN: Setting = Setting {
    key: &commd_settings::keys::DIRECT_BCAST_FORWARD_MIN_BYTES,
    lo: 0,
    hi: u64::MAX,
    default: 2 << 20,
};

pub(super) const DEFER_WAIT: Setting = Setting {
    key: &commd_settings::keys::DIRECT_DEFER_WAIT,
    lo: 0,
    hi: 1,
    default: 0,
};

pub(super) const LL_MAX: Setting = Setting {
    key: &commd_settings::keys::DIRECT_LL_MAX_BYTES,
    lo: 0,
    hi: k::LL_MAX_BYTES,
    default: k::LL_MAX_BYTES,
};

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
            commd_settings::get(&commd_settings::keys::GRAPH_DIRECT).as_deref(),
            commd_settings::get(&commd_settings::keys::GRAPH_DIRECT_MAX_BYTES).as_deref(),
            commd_settings::get(&commd_settings::keys::GRAPH_DIRECT_BLOCKS).as_deref(),
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
                .map_or(DEFAULT_BLOCKS, |b| {
                    u32::try_from(b).expect("COMMD_GRAPH_DIRECT_BLOCKS is checked in 1..=1024")
                }),
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
/// ones). Those keep the flags even under the LL limit: a broadcast of 8 B-4 KiB is slower by
/// lines than by flags on one block, where an all-reduce, all-to-all or reduce-scatter is
/// faster by lines (docs/benchmarks.md row `nccl2-broadcast-8B-512K`).
pub(crate) fn rooted_mode(mode: u32) -> bool {
    matches!(
        mode,
        k::MODE_BC | k::MODE_BCF | k::MODE_RED | k::MODE_SC | k::MODE_GA
    )
}

/// Offset of a window's LL area (zeroed at the setup: a line's epoch must never match stale
/// bytes).
pub(super) fn ll_area_off(n: u32, slot: u64) -> u64 {
    k::DATA_OFF + 2 * u64::from(n) * slot
}

/// `COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES`: the smallest direct broadcast (bytes per rank) on 3+
/// ranks that runs forwarded (`kernels::direct::MODE_BCF`: the root pushes one part of n - 1 to
/// each non-root, which forwards it to the others, so the root's GPU sends the bytes once
/// instead of n - 1 times, one flag hop later); default 2 MiB; `0`: every one. On 4 GPUs it is
/// faster than the root pushing to every rank at 2 MiB and slower at 1 MiB and below
/// (docs/benchmarks.md row `nccl4-broadcast-2M`); as one op past the limit (a set limit of
/// 8 MiB) it is faster than the split at 4 and 8 MiB. The same on every rank (checked when
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
/// the process exits; docs/design-gpu.md, direct collectives rule 3, says what would close
/// that). A rank's own choice (its peers need not share it). Read once per process.
pub(crate) fn defer_wait() -> Result<bool> {
    static V: SettingCell = SettingCell::new();
    Ok(DEFER_WAIT.once(&V)? != 0)
}
