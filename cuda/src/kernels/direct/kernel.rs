//! The direct kernel's own function (`extern "C" __global__`, `direct::push_source`), emitted
//! in its phases, in this order: the entry (epoch, poisoned op, deferred wait), the op's layout,
//! the exchange by LL lines (out, the header check, in) or by the flags (a forwarded broadcast,
//! or the plain pushes; then the flags and the wait), and the finish (copies or the
//! reduction).

use std::fmt::Write as _;

use super::{
    DATA_OFF, DEAD_OFF, DEFER_BYTES, DEFER_OFF, FLAGS_OFF, LL_MAX_BYTES, LL_SIG, LL_SLOT_BYTES,
    MODE_A2A, MODE_AG, MODE_BC, MODE_BCF, MODE_GA, MODE_RED, MODE_RS, MODE_SC, POISONED, PRE_OFF,
    STATE_OFF, THREADS,
};

// Every `write!` below is to a String: it cannot fail. Each text starts with a newline; one that
// stops inside a C function ends without its last newline, which the next text starts with.

/// The kernel's first phase: its epoch (a ticket, or the host's for an eager op), the stop of
/// an op after a failure ([`POISONED`]), and the wait that the previous op deferred
/// ([`DEFER_OFF`]).
pub(super) fn push_entry(src: &mut String, name: &str) {
    let _ = write!(
        src,
        r#"
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
    }}"#
    );
}

/// The kernel's layout of this op: its slot, word 1 of its flags (and a forwarded broadcast's
/// early signature), the ranks it pushes to, and the `COMMD_SLOT` macro.
pub(super) fn push_setup(src: &mut String, es: u64) {
    let _ = write!(
        src,
        r#"
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
#define COMMD_SLOT(r) (mine + {DATA_OFF}ull + ((u64)p * (u64)a.n + (u64)(r)) * a.slot)"#
    );
}

/// An op by LL lines ([`LL_MAX_BYTES`] at most, one block): its header lines and data lines
/// into the peers' LL areas, and its flag word marked [`LL_SIG`].
pub(super) fn push_ll_lines_out(src: &mut String) {
    let ll_max = LL_MAX_BYTES;
    let ll_slot = LL_SLOT_BYTES;
    let ll_sig = LL_SIG;
    let _ = write!(
        src,
        r#"
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
        }}"#
    );
}

/// An op by LL lines: thread `r` polls rank `r`'s header lines and checks they name this op.
pub(super) fn push_ll_header_check(src: &mut String) {
    let ll_sig = LL_SIG;
    let _ = write!(
        src,
        r#"
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
        }}"#
    );
}

/// An op by LL lines: the data lines of every rank that pushed to this one, into its slots,
/// where the copies and reductions of `push_finish` read them.
pub(super) fn push_ll_lines_in(src: &mut String) {
    let _ = write!(
        src,
        r#"
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
#undef COMMD_LINES"#
    );
}

/// An op by the flags, a forwarded broadcast ([`MODE_BCF`]): the root pushes part `q` to one
/// non-root each, which forwards it to the others once the root's flag came.
pub(super) fn push_forwarded_broadcast(src: &mut String) {
    let _ = write!(
        src,
        r#"
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
            }}"#
    );
}

/// An op by the flags, any other mode: the input (or each peer's chunk) into the peers' slots,
/// every peer's chunk at once when there are several.
pub(super) fn push_plain_push(src: &mut String) {
    let _ = write!(
        src,
        r#"
        }} else {{
            u64 j0 = 0;
            if ((a.in & 15ull) == 0ull && (!chunked || (bytes & 15ull) == 0ull)) {{
                const u64 nv = bytes / 16ull;
                if (chunked && __popc(to_mask) > 1) {{
                    /* Chunk r to rank r, every rank at once: a step loads vector j of every
                       peer's chunk, for two j, before it stores them. One rank after the
                       other (below) took up to 1.5x the time on 4x H200 (the log linked from
                       docs/benchmarks.md, "Every peer's chunk at once"). */
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
        }}"#
    );
}

/// An op by the flags, after its pushes: the last block writes the flags of this epoch into
/// every window; then the wait for every rank's flag (or its deferral, [`DEFER_OFF`]).
pub(super) fn push_flag_and_wait(src: &mut String) {
    let _ = write!(
        src,
        r#"
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
    }}"#
    );
}

/// The kernel's last phase: the copies out of the slots (gathers, all-to-all, broadcasts and
/// scatters), or the reduction of every rank's input (its own, and the peers' slots) in
/// ascending rank order.
pub(super) fn push_finish(src: &mut String, elem: &str) {
    let _ = write!(
        src,
        r#"
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
    /* Reduce: every rank's input in ascending rank order, this rank's own (its own chunk for
       reduce-scatter) at its place: the order of the eager kernels and of the host engine, so
       every rank computes the same bits (float rounding and a NaN's min/max depend on the
       order) and a replay is bit for bit the eager result. */
    struct commd_ins ins;
    for (u32 r = 0; r < 8u; ++r) {{
        ins.p[r] = r >= a.n ? (const void *)0
                 : r == a.me ? (const void *)(a.in + (chunked ? (u64)a.me * bytes : 0ull))
                 : (const void *)COMMD_SLOT(r);
    }}
    ins.m = a.n;
    commd_reduce_body(({elem} *)a.out, ins, a.count, a.divisor, tid, stride);
#undef COMMD_SLOT
}}
"#
    );
}
