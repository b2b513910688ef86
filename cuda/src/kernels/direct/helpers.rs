//! The device functions of the direct kernel's source (`direct::push_source`): its parameter
//! struct, the vector copy loops, the system-scope loads and stores, the failure record and
//! flag writers, the waits for a peer's flag with their checks, and the LL line accesses. The
//! send/recv kernels (`p2p::push_source`), which follow it in a sum module, call some of them
//! too.

use std::fmt::Write as _;

use super::{
    BROKEN, DEAD_OFF, ELSEWHERE, ERR_SIG, FLAGS_OFF, MARK_OFF, MISMATCH, PEER_FAILED, PRE_OFF,
    STATUS_OFF, TIMEOUT, VEC_UNROLL,
};

// Every `write!` below is to a String: it cannot fail.

/// `struct commd_direct`, the kernel's parameter, laid out as `DirectArgs`.
pub(super) fn push_args_struct(src: &mut String) {
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
"#
    );
}

/// `commd_vloop` (16-byte vectors, [`VEC_UNROLL`] loads in flight) and `commd_copy`, the
/// pushes' and copies' loops.
pub(super) fn push_copies(src: &mut String) {
    let unroll = VEC_UNROLL;
    let unroll_m1 = VEC_UNROLL - 1;
    let _ = write!(
        src,
        r#"
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
"#
    );
}

/// The system-scope acquire load, release and relaxed stores, and the global timer.
pub(super) fn push_memory_ops(src: &mut String) {
    let _ = write!(
        src,
        r#"
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
"#
    );
}

/// `commd_direct_fail` (the `dead` word, the op's status word, the failure record) and the
/// flag writers, `commd_direct_flag` and `commd_direct_flag_failed` ([`ERR_SIG`]).
pub(super) fn push_fail_and_flags(src: &mut String) {
    let _ = write!(
        src,
        r#"
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
"#
    );
}

/// `commd_direct_stop` (a wait's checks every 1024 spins: `dead`, the peer's daemon mark, the
/// broken hint, the timeout) and the flag comparisons `commd_direct_other` and
/// `commd_direct_same`.
pub(super) fn push_stop_checks(src: &mut String) {
    let hint_broken = commd_proto::desc::doorbell::HINT_BROKEN;
    let _ = write!(
        src,
        r#"
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
"#
    );
}

/// `commd_direct_wait`: a wait for one rank's flag of an epoch, with the early signatures of
/// forwarded broadcasts ([`PRE_OFF`]).
pub(super) fn push_wait(src: &mut String) {
    let _ = write!(
        src,
        r#"
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
"#
    );
}

/// The LL line store and load (16 bytes: 8 of data, the epoch twice) and `commd_ld8`.
pub(super) fn push_ll_line_ops(src: &mut String) {
    let _ = write!(
        src,
        r#"
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
"#
    );
}
