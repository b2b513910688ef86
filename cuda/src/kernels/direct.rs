//! The kernel of a *direct* captured collective (docs/design-gpu.md, direct collectives): one launch that pushes
//! this rank's input (or its chunks) into the peers' windows (NVLink/PCIe stores through
//! IPC-mapped pointers), signals each peer with a flag, waits for every rank's flag of the same
//! epoch (every op, whatever it moves, so the ranks stay in lockstep), checks that the peers run
//! the same op, and reduces (or copies) its window into the output; reductions in the eager
//! order (every rank's input in ascending rank order, the same on every rank), so a replay is
//! bit for bit the eager result. No daemon and no host work per replay. `mode` picks the op (`MODE_*`).
//!
//! Window of each rank (device memory of that rank's GPU, allocated by its process, opened by
//! its peers; every offset below is from the window's base):
//! - `FLAGS_OFF`: per parity `p` (epoch & 1) and source rank `r`, 16 bytes: word 0 = epoch
//!   (high 32 bits) | op signature (low 32), word 1 = capture index (high) | count (low). The
//!   source's first block writes word 1 into every window when the op starts (it is known
//!   then, and the slot is free: the reader finished epoch e - 2 before it wrote its flag of
//!   e - 1, which this op's start follows); the last block to finish pushing writes word 0 into
//!   every window after one system fence (a release pattern: one fence, then plain stores, so
//!   the flags to n windows cost one round trip, not n); the reader acquires word 0, then
//!   reads word 1.
//! - `STATE_OFF`: `entered` (u64, tickets of blocks that started an op, `unit` per block; epoch =
//!   entered / (grid x unit) + 1, grid x unit being fixed per communicator: a large op runs on
//!   the whole grid, a small one on half of it with 2 tickets per block, a tiny one on one
//!   block with all of them; eager windows do not count: the host numbers their ops,
//!   `epoch`), `arrive[2]` (u32, blocks that finished pushing, per parity; a one-block op,
//!   its own last block, skips it),
//!   `dead` (u32, non-zero once an op of the communicator failed: every later op stops at once).
//! - `DEFER_OFF`: per parity `p`, the epoch and flag words of this rank's op of that parity
//!   whose wait it deferred (`defer`, [`DEFER_OFF`]).
//! - `MARK_OFF`: eager windows, this rank's *daemon mark* ([`MARK_OFF`]), written by its stream
//!   before each collective it sends to the daemon's path instead, read by the peers.
//! - `DATA_OFF`: per parity `p` and source rank `r`, a slot of `slot` bytes at
//!   `DATA_OFF + (p * n + r) * slot`.
//!
//! Why two parities suffice: rank `i` pushes epoch `e + 2` into rank `j`'s slot only after its
//! wait of epoch `e + 1` saw `j`'s flag `e + 1`, which `j` wrote after it finished reading epoch
//! `e` (stream order on `j`). The same argument bounds a peer's flag to `e - 2 ..= e + 1`, so the
//! epoch comparison is done on 32 bits, wrap-aware.
//!
//! Failure record (host memory mapped for the device, one per set of windows, read by the
//! client's `cuda_graph_check`): `code` (u32, written last), `rank` (u32), `epoch` (u64), this
//! rank's flag words, the other rank's flag words. Codes: [`MISMATCH`], [`TIMEOUT`], [`BROKEN`],
//! [`POISONED`], [`PEER_FAILED`], [`ELSEWHERE`]. The rest of its page holds the status words of eager direct
//! ops (direct collectives rule 8; [`STATUS_OFF`]): each failing op writes its code into its own word
//! too, so every op's outcome is known, not only the first failure's.

/// 16-byte loads in flight per thread before their stores in a direct op's pushes and copies
/// (`commd_vloop`): 4 beat 1 and 8 on 4x H200 (the log "Loads in flight", linked from
/// docs/benchmarks.md).
const VEC_UNROLL: u32 = 4;
/// Offset of the flags in a window.
pub const FLAGS_OFF: u64 = 0;
/// Offset of the early signatures of forwarded broadcasts in a window: per parity `p` and
/// source rank `r`, 8 bytes at `PRE_OFF + (p * 8 + r) * 8`, epoch (high 32 bits) | signature,
/// written when such an op starts, before any wait ([`MODE_BCF`]).
pub const PRE_OFF: u64 = 256;
/// Offset of the state words in a window.
pub const STATE_OFF: u64 = 512;
/// Offset of the `dead` word in a window.
pub const DEAD_OFF: u64 = STATE_OFF + 16;
/// Offset of the deferred waits in a window: per parity `p`, 32 bytes at `DEFER_OFF + p * 32`,
/// the epoch, word 0, word 1 and daemon-op count (`dseq`, [`MARK_OFF`]) of this rank's op of
/// parity `p` whose wait it deferred
/// (`struct commd_direct`'s `defer`, tests only so far: `COMMD_DIRECT_DEFER_WAIT`). A rank
/// that reads nothing of its peers in an op (a broadcast's or scatter's root, a reduce's or
/// gather's non-root) then flags and ends without waiting for their flags; its next op, before
/// it writes anything into a window, waits for every rank's flag of that epoch and checks it
/// names that op. Both parity arguments of the module doc hold one op late: this rank writes
/// into a peer's window for epoch e + 1 only after it saw the peer's flag of e. A mismatch at
/// the deferred op fails the next op (the non-roots fail at the op itself).
pub const DEFER_OFF: u64 = STATE_OFF + 32;
/// Bytes of one parity's deferred wait at [`DEFER_OFF`].
pub const DEFER_BYTES: u64 = 32;
/// Offset of an eager window's *daemon mark*: 8 bytes, epoch (high 32 bits) | count (low 32).
/// Before each eager collective that this rank sends to the daemon's path while the
/// communicator has eager windows (an op past the direct limit, say), its stream writes here
/// the epoch its next direct op will take and the number of such collectives so far (the
/// kernel's `dseq` counts the same on every rank that issued the same ops). A peer that waits
/// for this rank's flag of epoch e looks at the mark every 1024 spins (never on the fast
/// path): a mark of epoch e with a count past its own `dseq` means this rank ran that op, or
/// one issued before it, on the daemon's path (a count across the limit, or ops issued in
/// another order), so its flag will never come: the peer fails at once ([`ELSEWHERE`]) instead
/// of at the op timeout. Ranks that issued the same ops never see such a mark: one of epoch e
/// was written before this rank's op e was issued, so its count is the peer's `dseq` at most.
pub const MARK_OFF: u64 = STATE_OFF + 128;
/// Offset of the data slots in a window.
pub const DATA_OFF: u64 = 4096;
/// Bytes of the failure record.
pub const RECORD_BYTES: u64 = 64;
/// Offset of the status words in the record page: an eager direct op (`status` non-zero)
/// writes its failure code into word `status - 1`; a word left 0 once the op's event completed
/// means the op succeeded.
pub const STATUS_OFF: u64 = RECORD_BYTES;
/// Status words in the record page (4096 bytes): eager direct ops of one communicator in flight
/// at once, at most.
// A constant, (4096 - 64) / 4 = 1008: the cast is exact.
#[allow(clippy::cast_possible_truncation)]
pub const STATUS_WORDS: u32 = ((4096 - STATUS_OFF) / 4) as u32;
/// Ranks a direct op supports (the flag area holds 8 sources per parity).
pub const MAX_RANKS: u32 = 8;

/// Failure codes of the record (and of the `dead` word).
pub const MISMATCH: u32 = 1;
/// A peer's flag did not come within the timeout.
pub const TIMEOUT: u32 = 2;
/// The daemon (or the client's watchdog) marked the communicator broken: a rank or the daemon
/// was lost.
pub const BROKEN: u32 = 3;
/// An earlier direct op of the communicator failed: this one did not run.
pub const POISONED: u32 = 4;
/// A peer reported that its op did not run (its flag carries [`ERR_SIG`]).
pub const PEER_FAILED: u32 = 5;
/// A peer ran this op (or one issued before it) on the daemon's path: its daemon mark
/// ([`MARK_OFF`]) names this epoch with more daemon-path collectives than this rank's.
pub const ELSEWHERE: u32 = 6;
/// Signature word of a flag written by a rank whose op did not run.
pub const ERR_SIG: u32 = u32::MAX;

/// What a direct op does (`struct commd_direct`'s `mode`): all-reduce.
pub const MODE_AR: u32 = 0;
/// All-gather: every rank's input into every rank's output, in rank order.
pub const MODE_AG: u32 = 1;
/// Reduce-scatter: rank `r` gets the reduction of every rank's chunk `r`.
pub const MODE_RS: u32 = 2;
/// Broadcast from `root`.
pub const MODE_BC: u32 = 3;
/// Reduce to `root`.
pub const MODE_RED: u32 = 4;
/// All-to-all: rank `r` gets chunk `r` of every rank's input, in rank order (chunks of `count`
/// elements).
pub const MODE_A2A: u32 = 5;

/// Scatter from `root` (a part of a broadcast split into direct ops): the root's input holds `n`
/// chunks of `count` elements; rank `r` gets chunk `r` in its output.
pub const MODE_SC: u32 = 6;
/// Gather to `root` (a part of a reduce split into direct ops): every rank's input (`count`
/// elements) into the root's output, in rank order; the other ranks write nothing.
pub const MODE_GA: u32 = 7;
/// Broadcast from `root`, forwarded (3+ ranks): the root pushes part q of its input (n - 1
/// parts) to one non-root each, which forwards it to the others once the root's flag came; the
/// same result as [`MODE_BC`] with the root's GPU sending the bytes once instead of n - 1 times.
pub const MODE_BCF: u32 = 8;

/// The largest direct op that may move by LL lines (`struct commd_direct`'s `ll`; one block):
/// 512 data lines of 8 bytes.
pub const LL_MAX_BYTES: u64 = 4096;
/// Bytes of the LL lines of one (parity, source) in a window's LL area (after the data slots):
/// 2 header lines, then `LL_MAX_BYTES / 8` data lines of 16 bytes.
pub const LL_SLOT_BYTES: u64 = (2 + LL_MAX_BYTES / 8) * 16;
/// Signature word of the flag of a rank whose op moves by LL lines: a peer that runs the op by
/// the flags (another count past the LL limit) reads it as a mismatch. Never a real signature
/// (their top byte is at most 0xf7: 0x10 | root below 8, `PART`, `ROOTED`, `LAST`) nor
/// [`ERR_SIG`].
pub const LL_SIG: u32 = u32::MAX - 1;

/// Threads per block of the direct kernel.
pub const THREADS: u32 = 256;

/// Appends the direct kernel `name` for elements `elem` of `es` bytes to `src`, which already
/// holds the (dtype, op) helpers and `commd_reduce_body` (see `kernels::source`): the device
/// functions it calls (`helpers`), then the kernel, one C function emitted phase by phase
/// (`kernel`).
pub fn push_source(src: &mut String, name: &str, elem: &str, es: u64) {
    helpers::push_args_struct(src);
    helpers::push_copies(src);
    helpers::push_memory_ops(src);
    helpers::push_fail_and_flags(src);
    helpers::push_stop_checks(src);
    helpers::push_wait(src);
    helpers::push_ll_line_ops(src);
    kernel::push_entry(src, name);
    kernel::push_setup(src, es);
    kernel::push_ll_lines_out(src);
    kernel::push_ll_header_check(src);
    kernel::push_ll_lines_in(src);
    kernel::push_forwarded_broadcast(src);
    kernel::push_plain_push(src);
    kernel::push_flag_and_wait(src);
    kernel::push_finish(src, elem);
}

mod helpers;
mod kernel;
