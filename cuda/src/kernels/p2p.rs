//! The kernels of a *direct* send and receive (docs/design.md, "Send/recv as direct ops"; the
//! protocol is `direct/p2p_model.rs`'s; the host side `direct/p2p.rs`), in every `(dtype, sum)`
//! module: one op per launch, or a group's ops in one launch (`commd_p2p_group`: at most one op
//! per direction of a pair, so that a direction's ops stay one after another, as the model has
//! them, and an ack always means every earlier sequence was read).
//!
//! One inbox per ordered pair, in the receiver's GPU memory, opened by the sender (offsets from
//! its base):
//! - `FLAG_OFF`: per parity `p` (sequence & 1), 16 bytes: word 0 = sequence (high 32 bits) |
//!   signature (low 32), word 1 = bytes. The sender writes word 1 before its pushes (the slot is
//!   free: the ack said so) and word 0 after one system fence once every block pushed.
//! - `ACK_OFF`: the last sequence *of this rank's sends to the peer* that the peer has read
//!   (written by the peer; a send of q waits until it is at least q - 2).
//! - `STATE_OFF`: arrival counters of this rank's kernels for the pair (send, recv; per parity).
//! - `DEAD_OFF`: non-zero once an op of the pair failed, on either side: every later op stops.
//! - `SEND_MARK_OFF`, `RECV_MARK_OFF`: this rank's *daemon marks* for the pair, written by its
//!   own stream before each eager send to (receive from) the peer that takes the daemon's path:
//!   [`mark`] of the next direct sequence of that direction and the daemon-path ops so far
//!   (with this one). Read by the peer's waits (its receive reads the send mark, its send
//!   the receive mark, every 1024 spins), which fail at once ([`ELSEWHERE`]) when the mark
//!   proves the two ranks put other messages on the daemon's path before the op (see
//!   `commd_p2p_wait`).
//! - `LL_OFF`: per parity, `LL_SLOT` bytes of 16-byte lines for small messages (the *LL*
//!   protocol, as NCCL's: each line `{data lo, flag, data hi, flag}`, stored as one vector, so
//!   8 bytes of data and their flag arrive together and no fence or separate flag is needed).
//!   Line 0 is the header `{signature, flag, bytes, flag}`, line 1 + i the message's bytes
//!   8i..8i+8. The flag is the sequence's low 32 bits; a receive takes a line only when both
//!   flags equal it.
//! - `DATA_OFF`: two slots of `slot` bytes (messages over the LL limit; the *simple* protocol).
//!
//! Stale flags: a location keeps the flag of the last message that wrote it, which may be of
//! a sequence 2^32 older (the same low 32 bits) if nothing wrote it since. So every send whose
//! sequence [`refreshes`] rewrites the flag locations of its parity that it does not write
//! anyway (the LL lines past its own, or all of them; the simple flag) with the marker
//! `seq - 2`: no flag is ever more than `2^30 + 2` sequences old, and an exact or wrap-aware
//! comparison of 32 bits never takes an old flag for a new one (`tests::ll_flags_*` model it).

use std::fmt::Write as _;

use super::direct::{BROKEN, ELSEWHERE, MISMATCH, POISONED, STATUS_OFF, THREADS, TIMEOUT};

/// Offset of the flags in an inbox.
pub const FLAG_OFF: u64 = 0;
/// Offset of the ack word.
pub const ACK_OFF: u64 = 64;
/// Offset of the arrival counters.
pub const STATE_OFF: u64 = 128;
/// Offset of the `dead` word.
pub const DEAD_OFF: u64 = 160;
/// Offset of this rank's daemon mark of its sends to the peer (module doc).
pub const SEND_MARK_OFF: u64 = 192;
/// Offset of this rank's daemon mark of its receives from the peer.
pub const RECV_MARK_OFF: u64 = 200;
/// Bits of a mark's (and a signature's) count of daemon-path ops.
pub const MARK_COUNT_BITS: u32 = 20;

/// A daemon mark: the next direct sequence `seq` of the direction and its daemon-path ops
/// `count` (modulo 2^20).
pub fn mark(seq: u64, count: u64) -> u64 {
    (seq << MARK_COUNT_BITS) | (count & ((1 << MARK_COUNT_BITS) - 1))
}

/// Whether mark `m` (of the peer, for this direction) proves that an op of sequence `seq` whose
/// own side counted `count` daemon-path ops before it is mismatched: the peer's direct op of
/// some sequence at most `seq` comes after more daemon-path ops than `count` (modulo 2^20,
/// wrap-aware), so the peer's op of `seq` does too (its counts only grow). In a program whose
/// two sides put the same messages on each path in the same order, the peer's count before its
/// op `seq` equals `count`, and no mark before it exceeds that. `commd_p2p_wait` computes the
/// same on the GPU.
// Truncation is the point: only the low MARK_COUNT_BITS bits of the counts take part (they are
// modulo 2^20), shifted to the top of a u32 so that the signed difference is wrap-aware.
#[allow(clippy::cast_possible_truncation)]
pub fn mark_proves_mismatch(m: u64, seq: u64, count: u64) -> bool {
    let bits = MARK_COUNT_BITS;
    let diff = ((m as u32).wrapping_sub(count as u32)) << (32 - bits);
    m != 0 && (m >> bits) <= seq && diff.cast_signed() > 0
}

/// Offset of the LL lines (two parities).
pub const LL_OFF: u64 = 4096;
/// The largest message the LL protocol may carry (`COMMD_P2P_LL_MAX_BYTES` chooses up to it).
pub const LL_CAP: u64 = 256 << 10;
/// Data lines of an LL slot (8 bytes each); line 0 is the header.
pub const LL_LINES: u64 = LL_CAP / 8;
/// Bytes of one parity's LL lines (header included), rounded up to 4 KiB.
pub const LL_SLOT: u64 = (16 * (LL_LINES + 1)).div_ceil(4096) * 4096;
/// Offset of the data slots.
pub const DATA_OFF: u64 = LL_OFF + 2 * LL_SLOT;
/// A send of sequence `seq` refreshes its parity's flags when `(seq - 1) / 2` is a multiple
/// of this (the first send of each parity, then every 2^30 sequences).
pub const REFRESH_PERIOD: u64 = 1 << 29;

/// Whether a send of `seq` rewrites its parity's stale flag locations (module doc).
pub fn refreshes(seq: u64, period: u64) -> bool {
    (seq.saturating_sub(1) >> 1).is_multiple_of(period)
}
/// What a send or receive writes into its status word once every block of it is done and
/// none failed (a failure writes its code instead): the host sees the op finished without a
/// driver call (`StatusPool::poll`). Unlike the failure codes, never a `dead` word's value.
pub const DONE: u32 = 0x444F_4E45;
/// The most send/recv ops one group kernel carries (`struct commd_p2p_group`).
pub const GROUP_MAX: usize = 16;

/// Appends the send and receive kernels to `src`, which already holds the direct kernel's
/// helpers (`direct::push_source`: `commd_copy`, `commd_ld_acquire`, `commd_st_relaxed`,
/// `commd_globaltimer`): the device functions, `commd_p2p_send_run` and `commd_p2p_recv_run`
/// (each in two phases), then the kernels that run them.
pub fn push_source(src: &mut String, send: &str, recv: &str, group: &str, two: &str) {
    push_args_and_lines(src);
    push_outcomes(src);
    push_wait(src);
    push_ll_bytes(src);
    push_send_start(src);
    push_send_data(src);
    push_recv_start(src);
    push_recv_data(src);
    push_kernels(src, send, recv, group, two);
}

// Every `write!` below is to a String: it cannot fail. Each text starts with a newline; one that
// stops inside a C function ends without its last newline, which the next text starts with.

/// `struct commd_p2p`, laid out as `P2pArgs`; the 16-byte line store and load, the system
/// fence, and whether a send refreshes its parity's flags ([`refreshes`]).
fn push_args_and_lines(src: &mut String) {
    let refresh = REFRESH_PERIOD;
    let _ = write!(
        src,
        r#"
struct commd_p2p {{
    u64 local;
    u64 remote;
    u64 buf;
    u64 bytes;
    u64 slot;
    u64 rec;
    u64 hint;
    u64 timeout_ns;
    u64 seq;
    u32 sig;
    u32 status;
    u32 ll;
    u32 pad;
}};

static __device__ __forceinline__ void commd_st_line(u64 p, u32 a, u32 b, u32 c, u32 d) {{
    asm volatile("st.volatile.global.v4.u32 [%0], {{%1, %2, %3, %4}};" :: "l"(p), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}}

static __device__ __forceinline__ uint4 commd_ld_line(u64 p) {{
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {{%0, %1, %2, %3}}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}}

/* A release and acquire fence at system scope: the patterns of this protocol need no more
   (fence.sc, __threadfence_system, also orders against every other sc fence). */
static __device__ __forceinline__ void commd_fence_sys() {{
    asm volatile("fence.acq_rel.sys;" ::: "memory");
}}

/* Whether the send of `seq` refreshes its parity's flags (`refreshes` in kernels/p2p.rs). */
static __device__ __forceinline__ bool commd_p2p_refresh(u64 seq) {{
    return (((seq - 1ull) >> 1) & ({refresh}ull - 1ull)) == 0ull;
}}
"#
    );
}

/// How an op ends: `commd_p2p_fail` (the status word, both `dead` words, the record),
/// `commd_p2p_done` ([`DONE`]), and `commd_p2p_marked` ([`mark_proves_mismatch`]).
fn push_outcomes(src: &mut String) {
    let bits = MARK_COUNT_BITS;
    let _ = write!(
        src,
        r#"
/* A failed op of the pair: its status word, both sides' dead words (the peer's next op stops
   too), and the record if none is pending. */
static __device__ void commd_p2p_fail(const struct commd_p2p &a, u32 code, u64 m0, u64 t0) {{
    const u32 was = atomicCAS((u32 *)(a.local + {DEAD_OFF}ull), 0u, code);
    atomicCAS((u32 *)(a.remote + {DEAD_OFF}ull), 0u, code);
    if (a.status != 0u) {{
        ((volatile u32 *)(a.rec + {STATUS_OFF}ull))[a.status - 1u] = code;
    }}
    volatile u32 *rc = (volatile u32 *)a.rec;
    if (was == 0u && rc[0] == 0u) {{
        volatile u64 *r = (volatile u64 *)a.rec;
        r[1] = a.seq;
        r[2] = m0;
        r[4] = t0;
        __threadfence_system();
        rc[0] = code;
    }}
    __threadfence_system();
}}

/* The op's last block (or only one) is done and none failed: its status word says so. */
static __device__ __forceinline__ void commd_p2p_done(const struct commd_p2p &a) {{
    if (a.status != 0u) {{
        ((volatile u32 *)(a.rec + {STATUS_OFF}ull))[a.status - 1u] = {DONE}u;
    }}
}}

/* Whether the peer's daemon mark `m` proves that this op (the direction's sequence `seq`, after
   `count` daemon-path ops of this side) is mismatched (`mark_proves_mismatch` in
   kernels/p2p.rs). */
static __device__ __forceinline__ bool commd_p2p_marked(u64 m, u64 seq, u32 count) {{
    return m != 0ull && (m >> {bits}) <= seq && (int)(((u32)m - count) << (32u - {bits}u)) > 0;
}}
"#
    );
}

/// `commd_p2p_wait`: thread 0's wait for a flag or ack word, with its checks every 1024 spins.
fn push_wait(src: &mut String) {
    let hint_broken = commd_proto::desc::doorbell::HINT_BROKEN;
    let count_mask = (1u32 << MARK_COUNT_BITS) - 1;
    let _ = write!(
        src,
        r#"
/* Thread 0 of a block: waits until the word at `p` reaches `want` (32-bit wrap-aware, in the
   high half when `high`), watching the pair's dead word, the broken hint and the timeout,
   `alt` when not null: the other protocol's flag word of the same sequence (its high half
   reaching `want`: the peer sent a message of another size class, a mismatched pair), and the
   peer's daemon mark at `mark` (for the direction's sequence `mseq`, after this side's daemon-
   path ops of the signature). Returns the word, or 0 with `*fail` set. */
static __device__ u64 commd_p2p_wait(const struct commd_p2p &a, const u64 *p, u32 want, bool high, const u64 *alt, const u64 *mark, u64 mseq, u32 *fail) {{
    u64 t0 = 0ull;
    u32 spins = 0u;
    for (;;) {{
        const u64 v = commd_ld_acquire(p);
        const u32 got = high ? (u32)(v >> 32) : (u32)v;
        if ((int)(got - want) >= 0) {{
            return v;
        }}
        if ((++spins & 1023u) == 0u) {{
            if (*(volatile u32 *)(a.local + {DEAD_OFF}ull) != 0u) {{
                *fail = {POISONED}u;
                return 0ull;
            }}
            if ((*(volatile const u32 *)a.hint & {hint_broken}u) != 0u) {{
                *fail = {BROKEN}u;
                return 0ull;
            }}
            if (alt != nullptr && (int)((u32)(commd_ld_acquire(alt) >> 32) - want) >= 0) {{
                *fail = {MISMATCH}u;
                return 0ull;
            }}
            if (commd_p2p_marked(commd_ld_acquire(mark), mseq, (a.sig >> 8) & {count_mask}u)) {{
                *fail = {ELSEWHERE}u;
                return 0ull;
            }}
            const u64 now = commd_globaltimer();
            if (t0 == 0ull) {{
                t0 = now;
            }} else if (now - t0 > a.timeout_ns) {{
                *fail = {TIMEOUT}u;
                return 0ull;
            }}
        }}
    }}
}}
"#
    );
}

/// The 8 bytes of a message's line `i`, loaded and stored at any alignment.
fn push_ll_bytes(src: &mut String) {
    let _ = write!(
        src,
        r#"
/* The 8 bytes of line `i` of a message of `bytes` at `buf` (zero past the end). */
static __device__ __forceinline__ u64 commd_ll_load(u64 buf, u64 bytes, u64 i) {{
    const u64 at = i * 8ull;
    if (at + 8ull <= bytes && (buf & 7ull) == 0ull) {{
        return *(const u64 *)(buf + at);
    }}
    u64 v = 0ull;
    for (u64 j = 0ull; j < 8ull && at + j < bytes; ++j) {{
        v |= (u64)((const u8 *)buf)[at + j] << (8ull * j);
    }}
    return v;
}}

static __device__ __forceinline__ void commd_ll_store(u64 buf, u64 bytes, u64 i, u64 v) {{
    const u64 at = i * 8ull;
    if (at + 8ull <= bytes && (buf & 7ull) == 0ull) {{
        *(u64 *)(buf + at) = v;
        return;
    }}
    for (u64 j = 0ull; j < 8ull && at + j < bytes; ++j) {{
        ((u8 *)buf)[at + j] = (u8)(v >> (8ull * j));
    }}
}}
"#
    );
}

/// The start of `commd_p2p_send_run`: the wait for the slot's ack, the header (or word 1 of
/// the flag), and the failure of a block that stops.
fn push_send_start(src: &mut String) {
    let _ = write!(
        src,
        r#"
/* Send `bytes` at `buf` as sequence `seq` into the peer's inbox (`remote`): block `lb` of the
   op's `nb` blocks (a kernel of its own, or a share of a group kernel). */
static __device__ void commd_p2p_send_run(const struct commd_p2p &a, u32 lb, u32 nb, u32 &s_fail) {{
    const u32 p = (u32)(a.seq & 1ull);
    const u32 f = (u32)a.seq;
    /* The marker of a refresh: an older sequence of this parity, never taken for a new one. */
    const u32 m = f - 2u;
    const bool refresh = commd_p2p_refresh(a.seq);
    const u64 ll = a.remote + {LL_OFF}ull + (u64)p * {LL_SLOT}ull;
    if (threadIdx.x == 0) {{
        s_fail = *(volatile u32 *)(a.local + {DEAD_OFF}ull) != 0u ? {POISONED}u : 0u;
        if (s_fail == 0u) {{
            /* The slot of sequence seq - 2 is free once the peer acknowledged it. */
            /* The peer's receive mark: a receive of sequence at most seq - 2 (the one this
               waits for, or earlier) after more of its receives on the daemon's path than
               this send's sends there. */
            (void)commd_p2p_wait(a, (const u64 *)(a.local + {ACK_OFF}ull), (u32)a.seq - 2u, false, nullptr, (const u64 *)(a.remote + {RECV_MARK_OFF}ull), a.seq - 2ull, &s_fail);
        }}
        if (s_fail == 0u && lb == 0u) {{
            if (a.ll != 0u) {{
                commd_st_line(ll, a.sig, f, (u32)a.bytes, f);
                if (refresh) {{
                    commd_st_relaxed((u64 *)(a.remote + {FLAG_OFF}ull + (u64)p * 16ull), (u64)m << 32);
                }}
            }} else {{
                ((volatile u64 *)(a.remote + {FLAG_OFF}ull + (u64)p * 16ull))[1] = a.bytes;
            }}
        }}
        if (s_fail != 0u) {{
            /* Any block that stops says so: the op never reports success with a block's
               share unsent (the receiver, with no flag, fails too). A mark's failure records
               the mark, with the top bit: a send's. */
            const u64 t0 = s_fail == {ELSEWHERE}u ? (commd_ld_acquire((const u64 *)(a.remote + {RECV_MARK_OFF}ull)) | (1ull << 63)) : 0ull;
            commd_p2p_fail(a, s_fail, (a.seq << 32) | (u64)a.sig, t0);
        }}
    }}
    __syncthreads();
    if (s_fail != 0u) {{
        return;
    }}"#
    );
}

/// The rest of `commd_p2p_send_run`: the LL lines (with a refresh's markers), or the copy into
/// the peer's slot and the flag written by the last block.
fn push_send_data(src: &mut String) {
    let _ = write!(
        src,
        r#"
    const u64 tid = (u64)lb * (u64)blockDim.x + (u64)threadIdx.x;
    const u64 stride = (u64)nb * (u64)blockDim.x;
    if (a.ll != 0u) {{
        /* LL: each line carries its flag; nothing to fence, no flag to write after. */
        const u64 lines = (a.bytes + 7ull) / 8ull;
        const u64 upto = refresh ? {LL_LINES}ull : lines;
        for (u64 i = tid; i < upto; i += stride) {{
            if (i < lines) {{
                const u64 v = commd_ll_load(a.buf, a.bytes, i);
                commd_st_line(ll + 16ull * (i + 1ull), (u32)v, f, (u32)(v >> 32), f);
            }} else {{
                commd_st_line(ll + 16ull * (i + 1ull), 0u, m, 0u, m);
            }}
        }}
        __syncthreads();
        if (threadIdx.x == 0) {{
            u32 *arrive = (u32 *)(a.local + {STATE_OFF}ull) + p;
            if (nb == 1u || atomicAdd(arrive, 1u) == nb - 1u) {{
                if (nb != 1u) {{
                    *arrive = 0u;
                }}
                commd_p2p_done(a);
            }}
        }}
        return;
    }}
    commd_copy(a.remote + {DATA_OFF}ull + (u64)p * a.slot, a.buf, a.bytes, tid, stride);
    if (refresh) {{
        for (u64 i = tid; i <= {LL_LINES}ull; i += stride) {{
            commd_st_line(ll + 16ull * i, 0u, m, 0u, m);
        }}
    }}
    __syncthreads();
    if (threadIdx.x == 0) {{
        commd_fence_sys();
        u32 *arrive = (u32 *)(a.local + {STATE_OFF}ull) + p;
        /* One block: its fence orders its pushes before the flag. More: the last to arrive
           writes it, after a second fence (the others' pushes, seen through the counter). */
        if (nb == 1u || atomicAdd(arrive, 1u) == nb - 1u) {{
            if (nb != 1u) {{
                *arrive = 0u;
                commd_fence_sys();
            }}
            commd_st_relaxed((u64 *)(a.remote + {FLAG_OFF}ull + (u64)p * 16ull), (a.seq << 32) | (u64)a.sig);
            commd_p2p_done(a);
        }}
    }}
}}
"#
    );
}

/// The start of `commd_p2p_recv_run`: thread 0 waits for the header (LL) or the flag and
/// checks it names this op.
fn push_recv_start(src: &mut String) {
    let _ = write!(
        src,
        r#"
/* Receive sequence `seq` from the peer's pushes into this rank's inbox (`local`) into `buf`,
   then acknowledge it in the peer's inbox from this rank (`remote`). */
static __device__ void commd_p2p_recv_run(const struct commd_p2p &a, u32 lb, u32 nb, u32 &s_fail) {{
    const u32 p = (u32)(a.seq & 1ull);
    const u32 f = (u32)a.seq;
    const u64 ll = a.local + {LL_OFF}ull + (u64)p * {LL_SLOT}ull;
    const u64 *flag = (const u64 *)(a.local + {FLAG_OFF}ull + (u64)p * 16ull);
    /* The peer's send mark: its send of a sequence at most this one after more of its sends on
       the daemon's path than this receive's receives there. */
    const u64 *smark = (const u64 *)(a.remote + {SEND_MARK_OFF}ull);
    if (threadIdx.x == 0) {{
        s_fail = *(volatile u32 *)(a.local + {DEAD_OFF}ull) != 0u ? {POISONED}u : 0u;
        const u64 want = (a.seq << 32) | (u64)a.sig;
        u64 v = 0ull;
        if (a.ll != 0u) {{
            /* The header's two halves (each arrives whole, not necessarily together). */
            if (s_fail == 0u) {{
                v = commd_p2p_wait(a, (const u64 *)ll, f, true, flag, smark, a.seq, &s_fail);
            }}
            u64 w = 0ull;
            if (s_fail == 0u) {{
                w = commd_p2p_wait(a, (const u64 *)ll + 1, f, true, flag, smark, a.seq, &s_fail);
            }}
            if (s_fail == 0u && (v != want || w != (((u64)f << 32) | (u64)(u32)a.bytes))) {{
                s_fail = {MISMATCH}u;
                v = v == want ? w : v;
            }}
        }} else {{
            if (s_fail == 0u) {{
                v = commd_p2p_wait(a, flag, f, true, (const u64 *)ll, smark, a.seq, &s_fail);
            }}
            if (s_fail == 0u && (v != want || ((volatile const u64 *)flag)[1] != a.bytes)) {{
                s_fail = {MISMATCH}u;
            }}
        }}
        if (s_fail == {ELSEWHERE}u) {{
            v = commd_ld_acquire(smark);
        }}
        if (s_fail != 0u) {{
            commd_p2p_fail(a, s_fail, want, v);
        }}
    }}
    __syncthreads();
    if (s_fail != 0u) {{
        return;
    }}"#
    );
}

/// The rest of `commd_p2p_recv_run`: the LL lines polled one by one, or the copy out of the
/// slot; then the ack written by the last block.
fn push_recv_data(src: &mut String) {
    let hint_broken = commd_proto::desc::doorbell::HINT_BROKEN;
    let _ = write!(
        src,
        r#"
    const u64 tid = (u64)lb * (u64)blockDim.x + (u64)threadIdx.x;
    const u64 stride = (u64)nb * (u64)blockDim.x;
    if (a.ll != 0u) {{
        /* The header came: the lines are on their way. Each is taken once both its flags are
           this sequence's; a thread stuck on one watches the dead word, the hint, the timeout
           and its block's other threads. */
        const u64 lines = (a.bytes + 7ull) / 8ull;
        u32 fail = 0u;
        for (u64 i = tid; i < lines && fail == 0u; i += stride) {{
            const u64 at = ll + 16ull * (i + 1ull);
            uint4 v = commd_ld_line(at);
            u32 spins = 0u;
            u64 t0 = 0ull;
            while (v.y != f || v.w != f) {{
                if ((++spins & 1023u) == 0u) {{
                    if (*(volatile u32 *)&s_fail != 0u) {{
                        fail = *(volatile u32 *)&s_fail;
                        break;
                    }}
                    if (*(volatile u32 *)(a.local + {DEAD_OFF}ull) != 0u) {{
                        fail = {POISONED}u;
                    }} else if ((*(volatile const u32 *)a.hint & {hint_broken}u) != 0u) {{
                        fail = {BROKEN}u;
                    }} else {{
                        const u64 now = commd_globaltimer();
                        if (t0 == 0ull) {{
                            t0 = now;
                        }} else if (now - t0 > a.timeout_ns) {{
                            fail = {TIMEOUT}u;
                        }}
                    }}
                    if (fail != 0u) {{
                        atomicCAS(&s_fail, 0u, fail);
                        break;
                    }}
                }}
                v = commd_ld_line(at);
            }}
            if (fail == 0u) {{
                commd_ll_store(a.buf, a.bytes, i, (u64)v.x | ((u64)v.z << 32));
            }}
        }}
        __syncthreads();
        if (s_fail != 0u) {{
            if (threadIdx.x == 0) {{
                commd_p2p_fail(a, s_fail, (a.seq << 32) | (u64)a.sig, 0ull);
            }}
            return;
        }}
    }} else {{
        commd_copy(a.buf, a.local + {DATA_OFF}ull + (u64)p * a.slot, a.bytes, tid, stride);
        __syncthreads();
    }}
    if (threadIdx.x == 0) {{
        /* The block's reads are done before the fence; the last block's ack frees the slot
           (one block: its own, with no counter). */
        commd_fence_sys();
        u32 *arrive = (u32 *)(a.local + {STATE_OFF}ull) + 2u + p;
        if (nb == 1u || atomicAdd(arrive, 1u) == nb - 1u) {{
            if (nb != 1u) {{
                *arrive = 0u;
                commd_fence_sys();
            }}
            commd_st_relaxed((u64 *)(a.remote + {ACK_OFF}ull), a.seq);
            commd_p2p_done(a);
        }}
    }}
}}
"#
    );
}

/// The kernels: send `send` and receive `recv` (one op per launch), the group kernel `group`
/// ([`GROUP_MAX`] ops) and the group of two `two`, with their parameters' layouts checked.
fn push_kernels(src: &mut String, send: &str, recv: &str, group: &str, two: &str) {
    let group_max = GROUP_MAX;
    let group_size = std::mem::size_of::<super::P2pGroupArgs>();
    let two_size = std::mem::size_of::<super::P2pTwoArgs>();
    let _ = write!(
        src,
        r#"
extern "C" __global__ void __launch_bounds__({THREADS}) {send}(struct commd_p2p a) {{
    __shared__ u32 s_fail;
    commd_p2p_send_run(a, blockIdx.x, gridDim.x, s_fail);
}}

extern "C" __global__ void __launch_bounds__({THREADS}) {recv}(struct commd_p2p a) {{
    __shared__ u32 s_fail;
    commd_p2p_recv_run(a, blockIdx.x, gridDim.x, s_fail);
}}

/* A group's send/recv ops on one stream in one launch: op i has blocks first[i] to
   first[i + 1] - 1; bit i of `sends` says it is a send. No block waits for another block of
   this kernel (a send waits for the peer's acks, a receive for the peer's flags), and the host
   keeps the grid within one block per SM. */
struct commd_p2p_group {{
    u32 n;
    u32 sends;
    u32 first[{group_max} + 1];
    struct commd_p2p op[{group_max}];
}};
static_assert(sizeof(struct commd_p2p_group) == {group_size}, "commd_p2p_group layout");

extern "C" __global__ void __launch_bounds__({THREADS}) {group}(struct commd_p2p_group g) {{
    __shared__ u32 s_fail;
    u32 i = 0u;
    while (i + 1u < g.n && blockIdx.x >= g.first[i + 1u]) {{
        ++i;
    }}
    const u32 lb = blockIdx.x - g.first[i];
    const u32 nb = g.first[i + 1u] - g.first[i];
    if (((g.sends >> i) & 1u) != 0u) {{
        commd_p2p_send_run(g.op[i], lb, nb, s_fail);
    }} else {{
        commd_p2p_recv_run(g.op[i], lb, nb, s_fail);
    }}
}}

/* A group of two ops (a send and a receive, most often): the group kernel with a parameter of
   184 bytes instead of about 1.5 KiB, which the launch copies (its host and GPU cost). Op 0
   has blocks 0 to split - 1, op 1 the rest. */
struct commd_p2p_two {{
    u32 split;
    u32 sends;
    struct commd_p2p op[2];
}};
static_assert(sizeof(struct commd_p2p_two) == {two_size}, "commd_p2p_two layout");

extern "C" __global__ void __launch_bounds__({THREADS}) {two}(struct commd_p2p_two g) {{
    __shared__ u32 s_fail;
    const u32 i = blockIdx.x < g.split ? 0u : 1u;
    const u32 lb = i == 0u ? blockIdx.x : blockIdx.x - g.split;
    const u32 nb = i == 0u ? g.split : gridDim.x - g.split;
    if (((g.sends >> i) & 1u) != 0u) {{
        commd_p2p_send_run(g.op[i], lb, nb, s_fail);
    }} else {{
        commd_p2p_recv_run(g.op[i], lb, nb, s_fail);
    }}
}}
"#
    );
}
