//! The kernel of a *direct* captured collective (DESIGN.md contract 7): one launch that pushes
//! this rank's input (or its chunks) into the peers' windows (NVLink/PCIe stores through
//! IPC-mapped pointers), signals each peer with a flag, waits for every rank's flag of the same
//! epoch (every op, whatever it moves, so the ranks stay in lockstep), checks that the peers run
//! the same op, and reduces (or copies) its window into the output; reductions in the eager
//! order (own input, then the peers in ascending rank order), so a replay is bit for bit the
//! eager result. No daemon and no host work per replay. `mode` picks the op (`MODE_*`).
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
//! ops (contract 7 rule 8; [`STATUS_OFF`]): each failing op writes its code into its own word
//! too, so every op's outcome is known, not only the first failure's.

use std::fmt::Write as _;

/// 16-byte loads in flight per thread before their stores in a direct op's pushes and copies
/// (`commd_vloop`). 4x H200, 2026-11-28 (docs/benchmarks.md, "Loads in flight"; nccl-tests, us,
/// against one load per step, and 8): alltoall 4 MiB 24.5 (28.5, 28.5), all-gather 4 MiB 19.5
/// (21.2, 21.2), broadcast 16 MiB 93.9 (100.7, 94.1), reduce 64 MiB 448 (468, 446).
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
/// holds the (dtype, op) helpers and `commd_reduce_body` (see `kernels::source`).
pub fn push_source(src: &mut String, name: &str, elem: &str, es: u64) {
    let hint_broken = commd_proto::desc::doorbell::HINT_BROKEN;
    let (ll_max, ll_slot, ll_sig) = (LL_MAX_BYTES, LL_SLOT_BYTES, LL_SIG);
    let (unroll, unroll_m1) = (VEC_UNROLL, VEC_UNROLL - 1);
    // `write!` to a String cannot fail.
    let _ = write!(
        src,
        r#"
struct commd_direct {{
    u64 win[8];
    u64 in;
    u64 out;
    u64 count;
    u64 slot;
    u64 rec;
    u64 hint;
    u64 timeout_ns;
    u32 me;
    u32 n;
    u32 sig;
    u32 k;
    u32 divisor;
    u32 mode;
    u32 root;
    u32 status;
    u32 unit;
    u32 ll;
    u32 defer;
    u32 dseq;
    u64 epoch;
}};

/* Vectors lo..hi (16 bytes each) of thread `tid` of `stride`: st(j, ld(j)), {unroll} loads in
   flight before their stores (one load per step left a push or a copy bounded by the load's
   latency, not by the link or HBM). */
template <typename Ld, typename St>
static __device__ __forceinline__ void commd_vloop(u64 lo, u64 hi, u64 tid, u64 stride, Ld ld, St st) {{
    u64 j = lo + tid;
    for (; j + {unroll_m1}ull * stride < hi; j += {unroll}ull * stride) {{
        commd_v16 v[{unroll}];
#pragma unroll
        for (u32 u = 0; u < {unroll}u; ++u) {{
            v[u] = ld(j + (u64)u * stride);
        }}
#pragma unroll
        for (u32 u = 0; u < {unroll}u; ++u) {{
            st(j + (u64)u * stride, v[u]);
        }}
    }}
    for (; j < hi; j += stride) {{
        st(j, ld(j));
    }}
}}

static __device__ __forceinline__ void commd_copy(u64 dst, u64 src, u64 bytes, u64 tid, u64 stride) {{
    if (dst == src) {{
        return;
    }}
    u64 j0 = 0;
    if (((dst | src) & 15ull) == 0ull) {{
        const u64 nv = bytes / 16ull;
        commd_vloop(0ull, nv, tid, stride, [&](u64 j) {{ return ((const commd_v16 *)src)[j]; }},
                    [&](u64 j, const commd_v16 &v) {{ ((commd_v16 *)dst)[j] = v; }});
        j0 = nv * 16ull;
    }}
    for (u64 j = j0 + tid; j < bytes; j += stride) {{
        ((u8 *)dst)[j] = ((const u8 *)src)[j];
    }}
}}

static __device__ __forceinline__ u64 commd_ld_acquire(const u64 *p) {{
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}}

static __device__ __forceinline__ void commd_st_release(u64 *p, u64 v) {{
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}}

/* A strong store with no fence of its own: after a fence, the two are a release pattern. */
static __device__ __forceinline__ void commd_st_relaxed(u64 *p, u64 v) {{
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}}

static __device__ __forceinline__ u64 commd_globaltimer() {{
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}}

/* Marks the communicator's direct ops failed (first failure wins the `dead` word) and fills the
   host record if the client has taken the previous one (code last). */
static __device__ void commd_direct_fail(const struct commd_direct &a, u32 code, u32 rank, u64 e,
                                         u64 m0, u64 m1, u64 t0, u64 t1) {{
    u32 *dead = (u32 *)(a.win[a.me] + {DEAD_OFF}ull);
    u32 was = atomicCAS(dead, 0u, code);
    if (a.status != 0u) {{
        /* An eager op: its own status word says it failed (read once its event completed). */
        ((volatile u32 *)(a.rec + {STATUS_OFF}ull))[a.status - 1u] = code;
        __threadfence_system();
    }}
    volatile u32 *rc = (volatile u32 *)a.rec;
    if (was == 0u || rc[0] == 0u) {{
        volatile u64 *r = (volatile u64 *)a.rec;
        rc[1] = rank;
        r[1] = e;
        r[2] = m0;
        r[3] = m1;
        r[4] = t0;
        r[5] = t1;
        __threadfence_system();
        rc[0] = code;
    }}
}}

static __device__ __forceinline__ void commd_direct_flag(const struct commd_direct &a, u32 r, u32 p, u64 w0, u64 w1) {{
    u64 *f = (u64 *)(a.win[r] + {FLAGS_OFF}ull + (u64)(p * 8u + a.me) * 16ull);
    ((volatile u64 *)f)[1] = w1;
    commd_st_release(f, w0);
}}

/* Tells every rank (this one too) that this rank's op of epoch e (parity p) does not run: its
   flag carries ERR_SIG, which a peer's wait reads as PEER_FAILED at once. */
static __device__ void commd_direct_flag_failed(const struct commd_direct &a, u32 p, u64 e, u64 w1) {{
    for (u32 r = 0; r < a.n; ++r) {{
        commd_direct_flag(a, r, p, (e << 32) | {ERR_SIG}ull, w1);
    }}
}}

/* Every 1024 spins of a wait for rank r: whether to stop (an op of the communicator failed,
   or this one now: broken, rank r on the daemon's path, or timed out, recorded). `dseq`: this
   rank's daemon-path collectives before the awaited op (MARK_OFF). */
static __device__ bool commd_direct_stop(const struct commd_direct &a, const volatile u32 *s_fail, u32 r,
                                         u64 e, u64 w0, u64 w1, u64 v, u64 &t0, u32 dseq) {{
    if (*s_fail != 0u || *(volatile const u32 *)(a.win[a.me] + {DEAD_OFF}ull) != 0u) {{
        return true;
    }}
    if (a.epoch != 0ull && r != a.me) {{
        /* Rank r's daemon mark (its own window): this epoch, with more daemon-path ops than
           this rank's, means its flag never comes. */
        const u64 m = *(volatile const u64 *)(a.win[r] + {MARK_OFF}ull);
        if ((u32)(m >> 32) == (u32)e && (int)((u32)m - dseq) > 0) {{
            commd_direct_fail(a, {ELSEWHERE}u, r, e, w0, w1, m, (u64)dseq);
            return true;
        }}
    }}
    if ((*(volatile const u32 *)a.hint & {hint_broken}u) != 0u) {{
        commd_direct_fail(a, {BROKEN}u, r, e, w0, w1, v, 0ull);
        return true;
    }}
    const u64 now = commd_globaltimer();
    if (t0 == 0ull) {{
        t0 = now;
    }} else if (now - t0 > a.timeout_ns) {{
        commd_direct_fail(a, {TIMEOUT}u, r, e, w0, w1, v, 0ull);
        return true;
    }}
    return false;
}}

/* Rank r's flag words (v, v1) of epoch e name another op than this one (w0, w1): the op fails,
   as the peer's own op failed (its signature ERR_SIG), or as a mismatch. */
static __device__ void commd_direct_other(const struct commd_direct &a, u32 r, u64 e, u64 w0, u64 w1,
                                          u64 v, u64 v1) {{
    commd_direct_fail(a, ((u32)v == {ERR_SIG}u) ? {PEER_FAILED}u : {MISMATCH}u, r, e, w0, w1, v, v1);
}}

/* Whether rank r's flag words (v, v1) of epoch e name this op (w0, w1); if not, the op fails
   (commd_direct_other). */
static __device__ bool commd_direct_same(const struct commd_direct &a, u32 r, u64 e, u64 w0, u64 w1,
                                         u64 v, u64 v1) {{
    if (v == w0 && v1 == w1) {{
        return true;
    }}
    commd_direct_other(a, r, e, w0, w1, v, v1);
    return false;
}}

/* Waits for rank r's flag of epoch e (phase p) and checks it names this op (w0, w1); false if
   the op failed (recorded). `dseq` as commd_direct_stop's. With `early`, it also fails at once as a mismatch when a peer's
   early signature of epoch e names another op: a forwarded broadcast's non-root waits on its
   root before it flags, and a peer running another op may wait on this rank in turn. */
static __device__ bool commd_direct_wait(const struct commd_direct &a, const volatile u32 *s_fail, u32 r,
                                         u32 p, u64 e, u64 w0, u64 w1, bool early, u32 dseq) {{
    const u64 mine = a.win[a.me];
    const u64 *f = (const u64 *)(mine + {FLAGS_OFF}ull + (u64)(p * 8u + r) * 16ull);
    u64 v = 0ull;
    u64 t0 = 0ull;
    u32 spins = 0u;
    for (;;) {{
        v = commd_ld_acquire(f);
        if ((int)((u32)(v >> 32) - (u32)e) >= 0) {{
            break;
        }}
        if ((++spins & 1023u) != 0u) {{
            continue;
        }}
        if (commd_direct_stop(a, s_fail, r, e, w0, w1, v, t0, dseq)) {{
            return false;
        }}
        for (u32 q = 0; early && q < a.n; ++q) {{
            const u64 pre = *(volatile const u64 *)(mine + {PRE_OFF}ull + (u64)(p * 8u + q) * 8ull);
            if (q != a.me && (u32)(pre >> 32) == (u32)e && pre != w0) {{
                /* Its flag's word 1 was written before its early signature. */
                const u64 pre1 = ((volatile const u64 *)(mine + {FLAGS_OFF}ull + (u64)(p * 8u + q) * 16ull))[1];
                commd_direct_fail(a, {MISMATCH}u, q, e, w0, w1, pre, pre1);
                return false;
            }}
        }}
    }}
    return commd_direct_same(a, r, e, w0, w1, v, ((volatile const u64 *)f)[1]);
}}

/* One LL line {{lo, e, hi, e}} at `at`, stored at once. */
static __device__ __forceinline__ void commd_ll_store(u64 at, u32 lo, u32 hi, u32 e) {{
    asm volatile("st.volatile.global.v4.u32 [%0], {{%1, %2, %3, %4}};" :: "l"(at), "r"(lo), "r"(e), "r"(hi), "r"(e) : "memory");
}}

/* The LL line at `at` when both its epochs are `e` (its 8 bytes in `v`). */
static __device__ __forceinline__ bool commd_ll_load(u64 at, u32 e, u64 &v) {{
    u32 lo, f0, hi, f1;
    asm volatile("ld.volatile.global.v4.u32 {{%0, %1, %2, %3}}, [%4];" : "=r"(lo), "=r"(f0), "=r"(hi), "=r"(f1) : "l"(at) : "memory");
    v = ((u64)hi << 32) | (u64)lo;
    return f0 == e && f1 == e;
}}

/* Bytes 8j .. 8j + 8 of the `bytes` at `base` (zeros past the end), any alignment. */
static __device__ __forceinline__ u64 commd_ld8(u64 base, u64 j, u64 bytes) {{
    const u64 at = base + j * 8ull;
    if ((at & 7ull) == 0ull && j * 8ull + 8ull <= bytes) {{
        return *(const u64 *)at;
    }}
    u64 v = 0ull;
    for (u64 b = 0; b < 8ull && j * 8ull + b < bytes; ++b) {{
        v |= (u64)((const u8 *)at)[b] << (8ull * b);
    }}
    return v;
}}

extern "C" __global__ void __launch_bounds__({THREADS}) {name}(struct commd_direct a) {{
    __shared__ u64 s_e;
    __shared__ u32 s_first;
    __shared__ volatile u32 s_fail;
    const u64 mine = a.win[a.me];
    u32 *dead = (u32 *)(mine + {DEAD_OFF}ull);
    if (threadIdx.x == 0) {{
        if (a.epoch != 0ull) {{
            /* An eager op: the host numbers them (no ticket on the critical path). */
            s_e = a.epoch;
            s_first = blockIdx.x == 0u ? 1u : 0u;
        }} else {{
            /* Every op takes gridDim.x x unit tickets (the communicator's fixed count), whatever
               its grid. */
            const u64 per_op = (u64)gridDim.x * (u64)a.unit;
            const u64 ticket = atomicAdd((unsigned long long *)(mine + {STATE_OFF}ull), (u64)a.unit);
            s_e = ticket / per_op + 1ull;
            s_first = (ticket % per_op) == 0ull ? 1u : 0u;
        }}
        s_fail = *(volatile u32 *)dead;
    }}
    __syncthreads();
    const u64 e = s_e;
    const u32 p = (u32)(e & 1ull);
    const u64 w0 = (e << 32) | (u64)a.sig;
    const u64 w1 = ((u64)a.k << 32) | (a.count & 0xFFFFFFFFull);
    if (s_fail != 0u) {{
        /* An earlier op failed: this one does not run. The peers are told at once. */
        if (blockIdx.x == 0 && threadIdx.x == 0) {{
            commd_direct_flag_failed(a, p, e, w1);
            commd_direct_fail(a, {POISONED}u, a.me, e, w0, w1, 0ull, 0ull);
        }}
        return;
    }}
    if (a.defer != 0u && e >= 2ull) {{
        /* This rank's previous op deferred its wait (DEFER_OFF): every rank's flag of that
           epoch first, checked against its words, before this op writes into any window. */
        const u32 q = p ^ 1u;
        const u64 *d = (const u64 *)(mine + {DEFER_OFF}ull + (u64)q * {DEFER_BYTES}ull);
        if (d[0] == e - 1ull) {{
            if (threadIdx.x < a.n && !commd_direct_wait(a, &s_fail, threadIdx.x, q, e - 1ull, d[1], d[2], false, (u32)d[3])) {{
                s_fail = 1u;
            }}
            __syncthreads();
            if (s_fail != 0u) {{
                /* Recorded (with the deferred op's epoch and words); the peers are told at once
                   that this op does not run. */
                if (threadIdx.x == 0) {{
                    commd_direct_flag_failed(a, p, e, w1);
                }}
                return;
            }}
        }}
    }}
    /* Push into slot (p, me) of the peers' windows: the whole input (all-reduce, all-gather),
       the peer's chunk of it (reduce-scatter, all-to-all), the root's input (broadcast), every
       input to the root (reduce). */
    const u64 tid = (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x;
    const u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    const u64 bytes = a.count * {es}ull;
    const u64 slot_off = {DATA_OFF}ull + ((u64)p * (u64)a.n + (u64)a.me) * a.slot;
    const u32 mode = a.mode;
    if (s_first != 0u && threadIdx.x < a.n) {{
        /* Word 1 of this rank's flag in window r, before any push (see the module doc). */
        ((volatile u64 *)(a.win[threadIdx.x] + {FLAGS_OFF}ull + (u64)(p * 8u + a.me) * 16ull))[1] = w1;
        if (mode == {MODE_BCF}u) {{
            /* A forwarded broadcast's non-root waits for the root before it writes its flag:
               this early signature lets a rank waiting on a peer that waits in turn (ranks
               whose roots differ) see the mismatch at once. */
            *(volatile u64 *)(a.win[threadIdx.x] + {PRE_OFF}ull + (u64)(p * 8u + a.me) * 8ull) = w0;
        }}
    }}
    const bool chunked = mode == {MODE_RS}u || mode == {MODE_A2A}u || mode == {MODE_SC}u;
    const bool from_root = mode == {MODE_BC}u || mode == {MODE_SC}u || mode == {MODE_BCF}u;
    const bool to_root = mode == {MODE_RED}u || mode == {MODE_GA}u;
    u32 to_mask = 0u;
    for (u32 r = 0; r < a.n; ++r) {{
        const bool to = r != a.me && (from_root ? a.me == a.root : to_root ? r == a.root : true);
        if (to) {{
            to_mask |= 1u << r;
        }}
    }}
    /* The slot rank r pushed into this window (or this rank copied rank r's lines into). */
#define COMMD_SLOT(r) (mine + {DATA_OFF}ull + ((u64)p * (u64)a.n + (u64)(r)) * a.slot)
    if (a.ll != 0u) {{
        /* LL (one block, at most {ll_max} bytes): each 16-byte line carries 8 bytes and the
           epoch twice, {{lo, e, hi, e}}, stored at once; the reader polls each line for its
           epoch, so no fence and no flag round trip. Lines of (parity p, source me) in each
           peer's LL area: 2 header lines (signature and count; capture index), then the data. */
        const u32 e32 = (u32)e;
        /* Offset of the lines of (parity p, source r) in a window: after the data slots. */
#define COMMD_LINES(r) ({DATA_OFF}ull + 2ull * (u64)a.n * a.slot + ((u64)p * (u64)a.n + (u64)(r)) * {ll_slot}ull)
        const u64 my_lines = COMMD_LINES(a.me);
        if (threadIdx.x < a.n && threadIdx.x != a.me) {{
            const u64 h = a.win[threadIdx.x] + my_lines;
            commd_ll_store(h, a.sig, (u32)a.count, e32);
            commd_ll_store(h + 16ull, a.k, 0u, e32);
            /* The flag word says "lines": a peer that runs this op by the flags (another count)
               fails at once on it instead of timing out. No fence: it only ever fails. */
            commd_st_relaxed((u64 *)(a.win[threadIdx.x] + {FLAGS_OFF}ull + (u64)(p * 8u + a.me) * 16ull),
                             (e << 32) | (u64){ll_sig}u);
        }}
        const u64 lines = (bytes + 7ull) / 8ull;
        for (u64 j = tid; j < lines; j += stride) {{
            for (u32 r = 0; r < a.n; ++r) {{
                if ((to_mask >> r) & 1u) {{
                    const u64 v = commd_ld8(a.in + (chunked ? (u64)r * bytes : 0ull), j, bytes);
                    commd_ll_store(a.win[r] + my_lines + (2ull + j) * 16ull, (u32)v, (u32)(v >> 32), e32);
                }}
            }}
        }}
        /* Thread r checks rank r's header: the same op, or the op's failure. */
        if (threadIdx.x < a.n && threadIdx.x != a.me) {{
            const u32 r = threadIdx.x;
            const u64 lines_r = mine + COMMD_LINES(r);
            const u64 *f = (const u64 *)(mine + {FLAGS_OFF}ull + (u64)(p * 8u + r) * 16ull);
            u64 t0 = 0ull;
            u32 spins = 0u;
            u64 h0 = 0ull, h1 = 0ull;
            bool ok = true;
            for (u32 i = 0; ok && i < 2u; ++i) {{
                u64 h = 0ull;
                while (!commd_ll_load(lines_r + (u64)i * 16ull, e32, h)) {{
                    if ((++spins & 1023u) == 0u) {{
                        /* A peer that failed, or runs this op by the flags, says so there. */
                        const u64 v = *(volatile const u64 *)f;
                        if ((int)((u32)(v >> 32) - e32) >= 0 && (u32)v != {ll_sig}u) {{
                            /* Never this op, even with the same words (another count, and a
                               stale second word): a failure either way. */
                            commd_direct_other(a, r, e, w0, w1, v, ((volatile const u64 *)f)[1]);
                            ok = false;
                            break;
                        }}
                        if (commd_direct_stop(a, &s_fail, r, e, w0, w1, v, t0, a.dseq)) {{
                            ok = false;
                            break;
                        }}
                    }}
                }}
                if (i == 0u) {{
                    h0 = h;
                }} else {{
                    h1 = h;
                }}
            }}
            if (ok) {{
                /* As the flag words: signature and epoch; capture index and count. */
                ok = commd_direct_same(a, r, e, w0, w1, (e << 32) | (h0 & 0xFFFFFFFFull), (h1 << 32) | (h0 >> 32));
            }}
            if (!ok) {{
                s_fail = 1u;
            }}
        }}
        __syncthreads();
        if (s_fail != 0u) {{
            return;
        }}
        /* The data lines of every rank that pushed to this one, into its slot here (free in
           this epoch: a rank pushes into it only at an epoch of the same parity, after this
           rank's next op started), so the copies and reductions below read them as usual. */
        for (u32 r = 0; r < a.n; ++r) {{
            const bool from = r != a.me && (from_root ? r == a.root : to_root ? a.me == a.root : true);
            if (!from) {{
                continue;
            }}
            const u64 lines_r = mine + COMMD_LINES(r);
            u64 t0 = 0ull;
            for (u64 j = tid; j < lines; j += stride) {{
                u64 v;
                u32 spins = 0u;
                while (!commd_ll_load(lines_r + (2ull + j) * 16ull, e32, v)) {{
                    if ((++spins & 1023u) == 0u && commd_direct_stop(a, &s_fail, r, e, w0, w1, 0ull, t0, a.dseq)) {{
                        s_fail = 1u;
                        break;
                    }}
                }}
                if (s_fail != 0u) {{
                    break;
                }}
                *(u64 *)(COMMD_SLOT(r) + j * 8ull) = v;
            }}
        }}
#undef COMMD_LINES
    }} else {{
        if (mode == {MODE_BCF}u) {{
            /* A forwarded broadcast: the input in n - 1 parts of `ps` bytes (a multiple of 16),
               part q for non-root root + 1 + q (mod n). The root pushes part q into that rank's
               slot (p, root) only, which forwards it into the other non-roots' slots (p, root)
               once the root's flag of this epoch said it arrived: the root's GPU sends the bytes
               once, not n - 1 times, and the second hops run side by side. Every rank's slot
               (p, root) then holds the whole input, as after a plain broadcast, and a non-root's
               flag says its forwards landed. The slots' reuse follows the plain argument (a
               forward of epoch e into rank j's slot comes after this rank saw j's flag of e - 1).
               A non-root whose wait for the root fails tells every peer at once (ERR_SIG), having
               pushed nothing. */
            const u64 ps = ((bytes + (u64)a.n - 2ull) / (u64)(a.n - 1u) + 15ull) & ~15ull;
            const bool root_me = a.me == a.root;
            const u32 q_me = (a.me + a.n - a.root - 1u) % a.n;
            const u64 q_lo = (u64)q_me * ps;
            const u64 lo = root_me ? 0ull : (q_lo < bytes ? q_lo : bytes);
            const u64 hi = root_me ? bytes : (lo + ps < bytes ? lo + ps : bytes);
            const u64 root_off = {DATA_OFF}ull + ((u64)p * (u64)a.n + (u64)a.root) * a.slot;
            const u64 src = root_me ? a.in : COMMD_SLOT(a.root);
            u32 fwd_mask = 0u;
            for (u32 r = 0; r < a.n; ++r) {{
                if (r != a.me && r != a.root) {{
                    fwd_mask |= 1u << r;
                }}
            }}
            if (!root_me) {{
                /* Thread 0 of each block waits for the root's flag (its part is in), then the block
                   forwards its share of the part. */
                if (threadIdx.x == 0) {{
                    const bool ok = commd_direct_wait(a, &s_fail, a.root, p, e, w0, w1, true, a.dseq);
                    if (!ok) {{
                        s_fail = 1u;
                        commd_direct_flag_failed(a, p, e, w1);
                    }}
                }}
                __syncthreads();
                if (s_fail != 0u) {{
                    return;
                }}
            }}
            u64 j0 = lo;
            if ((src & 15ull) == 0ull) {{
                const u64 hv = hi / 16ull;
                commd_vloop(lo / 16ull, hv, tid, stride, [&](u64 j) {{ return ((const commd_v16 *)src)[j]; }},
                            [&](u64 j, const commd_v16 &v) {{
                                if (root_me) {{
                                    const u32 r = (a.root + 1u + (u32)(j * 16ull / ps)) % a.n;
                                    ((commd_v16 *)(a.win[r] + root_off))[j] = v;
                                }} else {{
                                    for (u32 r = 0; r < a.n; ++r) {{
                                        if ((fwd_mask >> r) & 1u) {{
                                            ((commd_v16 *)(a.win[r] + root_off))[j] = v;
                                        }}
                                    }}
                                }}
                            }});
                j0 = hv * 16ull;
            }}
            for (u64 j = j0 + tid; j < hi; j += stride) {{
                const u8 v = ((const u8 *)src)[j];
                if (root_me) {{
                    const u32 r = (a.root + 1u + (u32)(j / ps)) % a.n;
                    ((u8 *)(a.win[r] + root_off))[j] = v;
                }} else {{
                    for (u32 r = 0; r < a.n; ++r) {{
                        if ((fwd_mask >> r) & 1u) {{
                            ((u8 *)(a.win[r] + root_off))[j] = v;
                        }}
                    }}
                }}
            }}
        }} else {{
            u64 j0 = 0;
            if ((a.in & 15ull) == 0ull && (!chunked || (bytes & 15ull) == 0ull)) {{
                const u64 nv = bytes / 16ull;
                if (chunked && __popc(to_mask) > 1) {{
                    /* Chunk r to rank r, every rank at once: a step loads vector j of every
                       peer's chunk, for two j, before it stores them. One rank after the
                       other (below) took up to 1.5x the time on 4x H200 (docs/benchmarks.md,
                       2026-11-28, "Every peer's chunk at once"): all-to-all 16 MiB 78.7 us
                       against 53.0. */
                    u64 j = tid;
                    for (; j + stride < nv; j += 2ull * stride) {{
                        commd_v16 v[2][8];
#pragma unroll
                        for (u32 u = 0; u < 2u; ++u) {{
#pragma unroll
                            for (u32 r = 0; r < 8u; ++r) {{
                                if (r < a.n && ((to_mask >> r) & 1u)) {{
                                    v[u][r] = ((const commd_v16 *)(a.in + (u64)r * bytes))[j + (u64)u * stride];
                                }}
                            }}
                        }}
#pragma unroll
                        for (u32 u = 0; u < 2u; ++u) {{
#pragma unroll
                            for (u32 r = 0; r < 8u; ++r) {{
                                if (r < a.n && ((to_mask >> r) & 1u)) {{
                                    ((commd_v16 *)(a.win[r] + slot_off))[j + (u64)u * stride] = v[u][r];
                                }}
                            }}
                        }}
                    }}
                    for (; j < nv; j += stride) {{
                        for (u32 r = 0; r < a.n; ++r) {{
                            if ((to_mask >> r) & 1u) {{
                                ((commd_v16 *)(a.win[r] + slot_off))[j] = ((const commd_v16 *)(a.in + (u64)r * bytes))[j];
                            }}
                        }}
                    }}
                }} else if (chunked) {{
                    /* One peer: its chunk with VEC_UNROLL loads in flight. */
                    for (u32 r = 0; r < a.n; ++r) {{
                        if ((to_mask >> r) & 1u) {{
                            commd_copy(a.win[r] + slot_off, a.in + (u64)r * bytes, nv * 16ull, tid, stride);
                        }}
                    }}
                }} else if (to_mask != 0u) {{
                    commd_vloop(0ull, nv, tid, stride, [&](u64 j) {{ return ((const commd_v16 *)a.in)[j]; }},
                                [&](u64 j, const commd_v16 &v) {{
                                    for (u32 r = 0; r < a.n; ++r) {{
                                        if ((to_mask >> r) & 1u) {{
                                            ((commd_v16 *)(a.win[r] + slot_off))[j] = v;
                                        }}
                                    }}
                                }});
                }}
                j0 = nv * 16ull;
            }}
            for (u64 j = j0 + tid; j < bytes; j += stride) {{
                for (u32 r = 0; r < a.n; ++r) {{
                    if ((to_mask >> r) & 1u) {{
                        ((u8 *)(a.win[r] + slot_off))[j] = ((const u8 *)a.in)[(chunked ? (u64)r * bytes : 0ull) + j];
                    }}
                }}
            }}
        }}
        /* The block's pushes (and word 1 of the flags) are ordered before its arrival by one
           fence of one thread after the barrier (the barrier orders the other threads' stores
           before that fence; causality is transitive), not one fence per thread. */
        __syncthreads();
        /* The last block to finish pushing writes this epoch's flag into every window (its own
           too: no block reduces, and so writes the output, before every block has pushed). */
        if (threadIdx.x == 0) {{
            __threadfence_system();
            /* A one-block op is its own last block: its fence released its pushes. */
            bool last = gridDim.x == 1u;
            u32 *arrive = (u32 *)(mine + {STATE_OFF}ull + 8ull) + p;
            if (!last && atomicAdd(arrive, 1u) == gridDim.x - 1u) {{
                *arrive = 0u;
                /* One fence (acquiring the other blocks' arrivals, releasing their pushes), then
                   word 0 into every window with no fence between the stores. */
                __threadfence_system();
                last = true;
            }}
            if (last) {{
                for (u32 i = 1; i <= a.n; ++i) {{
                    const u32 r = (a.me + i) % a.n; /* the peers first, this rank's own last */
                    commd_st_relaxed((u64 *)(a.win[r] + {FLAGS_OFF}ull + (u64)(p * 8u + a.me) * 16ull), w0);
                }}
            }}
        }}
        if (a.defer != 0u && (from_root ? a.me == a.root : to_root && a.me != a.root)) {{
            /* This rank reads nothing of its peers: its next op waits for their flags of this
               epoch first (DEFER_OFF). */
            if (blockIdx.x == 0 && threadIdx.x == 0) {{
                u64 *d = (u64 *)(mine + {DEFER_OFF}ull + (u64)p * {DEFER_BYTES}ull);
                d[1] = w0;
                d[2] = w1;
                d[3] = (u64)a.dseq;
                d[0] = e;
            }}
        }} else if (threadIdx.x < a.n) {{
            /* Thread r waits for rank r's flag of epoch e and checks it is the same op. */
            if (!commd_direct_wait(a, &s_fail, threadIdx.x, p, e, w0, w1, false, a.dseq)) {{
                s_fail = 1u;
            }}
        }}
    }}
    __syncthreads();
    if (s_fail != 0u) {{
        return;
    }}
    if (mode == {MODE_GA}u && a.me != a.root) {{
        return;
    }}
    if (mode == {MODE_AG}u || mode == {MODE_GA}u) {{
        for (u32 r = 0; r < a.n; ++r) {{
            commd_copy(a.out + (u64)r * bytes, r == a.me ? a.in : COMMD_SLOT(r), bytes, tid, stride);
        }}
        return;
    }}
    if (mode == {MODE_A2A}u) {{
        /* In place is safe: this rank's own chunk stays where it is, and the others are
           written only now, after every block of this rank has pushed. */
        for (u32 r = 0; r < a.n; ++r) {{
            commd_copy(a.out + (u64)r * bytes, r == a.me ? a.in + (u64)a.me * bytes : COMMD_SLOT(r),
                       bytes, tid, stride);
        }}
        return;
    }}
    if (from_root) {{
        /* Broadcast: the root's input; scatter: its chunk of this rank. */
        const u64 own = a.in + (mode == {MODE_SC}u ? (u64)a.me * bytes : 0ull);
        commd_copy(a.out, a.me == a.root ? own : COMMD_SLOT(a.root), bytes, tid, stride);
        return;
    }}
    if (mode == {MODE_RED}u && a.me != a.root) {{
        return;
    }}
    /* Reduce: own input (its own chunk for reduce-scatter) first, then the peers' slots in
       ascending rank order (the eager order, so the result is bit for bit the eager one). */
    struct commd_ins ins;
    ins.p[0] = (const void *)(a.in + (chunked ? (u64)a.me * bytes : 0ull));
    u32 m = 1u;
    for (u32 r = 0; r < a.n; ++r) {{
        if (r != a.me) {{
            ins.p[m] = (const void *)COMMD_SLOT(r);
            m += 1u;
        }}
    }}
    for (u32 r = m; r < 8u; ++r) {{
        ins.p[r] = (const void *)0;
    }}
    ins.m = m;
    commd_reduce_body(({elem} *)a.out, ins, a.count, a.divisor, tid, stride);
#undef COMMD_SLOT
}}
"#
    );
}
