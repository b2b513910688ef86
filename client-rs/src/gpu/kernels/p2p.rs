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
//! - `DATA_OFF`: two slots of `slot` bytes.

use std::fmt::Write as _;

use super::direct::{BROKEN, MISMATCH, POISONED, STATUS_OFF, THREADS, TIMEOUT};

/// Offset of the flags in an inbox.
pub const FLAG_OFF: u64 = 0;
/// Offset of the ack word.
pub const ACK_OFF: u64 = 64;
/// Offset of the arrival counters.
pub const STATE_OFF: u64 = 128;
/// Offset of the `dead` word.
pub const DEAD_OFF: u64 = 160;
/// Offset of the data slots.
pub const DATA_OFF: u64 = 4096;
/// The most send/recv ops one group kernel carries (`struct commd_p2p_group`).
pub const GROUP_MAX: usize = 16;

/// Appends the send and receive kernels to `src`, which already holds the direct kernel's
/// helpers (`direct::push_source`: `commd_copy`, `commd_ld_acquire`, `commd_st_relaxed`,
/// `commd_globaltimer`).
pub fn push_source(src: &mut String, send: &str, recv: &str, group: &str) {
    let group_max = GROUP_MAX;
    let group_size = std::mem::size_of::<super::P2pGroupArgs>();
    let hint_broken = commd_proto::desc::doorbell::HINT_BROKEN;
    // `write!` to a String cannot fail.
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
}};

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

/* Thread 0 of a block: waits until the word at `p` reaches `want` (32-bit wrap-aware, in the
   high half when `high`), watching the pair's dead word, the broken hint and the timeout.
   Returns the word, or 0 with `*fail` set. */
static __device__ u64 commd_p2p_wait(const struct commd_p2p &a, const u64 *p, u32 want, bool high, u32 *fail) {{
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

/* Send `bytes` at `buf` as sequence `seq` into the peer's inbox (`remote`): block `lb` of the
   op's `nb` blocks (a kernel of its own, or a share of a group kernel). */
static __device__ void commd_p2p_send_run(const struct commd_p2p &a, u32 lb, u32 nb, u32 &s_fail) {{
    const u32 p = (u32)(a.seq & 1ull);
    if (threadIdx.x == 0) {{
        s_fail = *(volatile u32 *)(a.local + {DEAD_OFF}ull) != 0u ? {POISONED}u : 0u;
        if (s_fail == 0u) {{
            /* The slot of sequence seq - 2 is free once the peer acknowledged it. */
            (void)commd_p2p_wait(a, (const u64 *)(a.local + {ACK_OFF}ull), (u32)a.seq - 2u, false, &s_fail);
        }}
        if (s_fail == 0u && lb == 0u) {{
            ((volatile u64 *)(a.remote + {FLAG_OFF}ull + (u64)p * 16ull))[1] = a.bytes;
        }}
        if (s_fail != 0u) {{
            /* Any block that stops says so: the op never reports success with a block's
               share unsent (the receiver, with no flag, fails too). */
            commd_p2p_fail(a, s_fail, (a.seq << 32) | (u64)a.sig, 0ull);
        }}
    }}
    __syncthreads();
    if (s_fail != 0u) {{
        return;
    }}
    const u64 tid = (u64)lb * (u64)blockDim.x + (u64)threadIdx.x;
    const u64 stride = (u64)nb * (u64)blockDim.x;
    commd_copy(a.remote + {DATA_OFF}ull + (u64)p * a.slot, a.buf, a.bytes, tid, stride);
    __syncthreads();
    if (threadIdx.x == 0) {{
        __threadfence_system();
        u32 *arrive = (u32 *)(a.local + {STATE_OFF}ull) + p;
        if (atomicAdd(arrive, 1u) == nb - 1u) {{
            *arrive = 0u;
            __threadfence_system();
            commd_st_relaxed((u64 *)(a.remote + {FLAG_OFF}ull + (u64)p * 16ull), (a.seq << 32) | (u64)a.sig);
        }}
    }}
}}

/* Receive sequence `seq` from the peer's pushes into this rank's inbox (`local`) into `buf`,
   then acknowledge it in the peer's inbox from this rank (`remote`). */
static __device__ void commd_p2p_recv_run(const struct commd_p2p &a, u32 lb, u32 nb, u32 &s_fail) {{
    const u32 p = (u32)(a.seq & 1ull);
    if (threadIdx.x == 0) {{
        s_fail = *(volatile u32 *)(a.local + {DEAD_OFF}ull) != 0u ? {POISONED}u : 0u;
        const u64 *f = (const u64 *)(a.local + {FLAG_OFF}ull + (u64)p * 16ull);
        u64 v = 0ull;
        if (s_fail == 0u) {{
            v = commd_p2p_wait(a, f, (u32)a.seq, true, &s_fail);
        }}
        const u64 want = (a.seq << 32) | (u64)a.sig;
        if (s_fail == 0u && (v != want || ((volatile const u64 *)f)[1] != a.bytes)) {{
            s_fail = {MISMATCH}u;
        }}
        if (s_fail != 0u) {{
            commd_p2p_fail(a, s_fail, want, v);
        }}
    }}
    __syncthreads();
    if (s_fail != 0u) {{
        return;
    }}
    const u64 tid = (u64)lb * (u64)blockDim.x + (u64)threadIdx.x;
    const u64 stride = (u64)nb * (u64)blockDim.x;
    commd_copy(a.buf, a.local + {DATA_OFF}ull + (u64)p * a.slot, a.bytes, tid, stride);
    __syncthreads();
    if (threadIdx.x == 0) {{
        /* The block's reads are done before the fence; the last block's ack frees the slot. */
        __threadfence_system();
        u32 *arrive = (u32 *)(a.local + {STATE_OFF}ull) + 2u + p;
        if (atomicAdd(arrive, 1u) == nb - 1u) {{
            *arrive = 0u;
            __threadfence_system();
            commd_st_relaxed((u64 *)(a.remote + {ACK_OFF}ull), a.seq);
        }}
    }}
}}

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
"#
    );
}
