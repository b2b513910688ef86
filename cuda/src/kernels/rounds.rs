//! The *rounds* kernel: every reduction round of an eager multi-round op (docs/contracts.md #4:
//! a reduction whose data exceeds one scratch slot runs in rounds, phase `j` bringing round
//! `j`'s inputs into the scratch) in one launch instead of one launch per round.
//!
//! Why (docs/benchmarks.md row `gemm-overlap-2gpu-256M`): under a running GEMM whose kernels
//! hold every SM, a kernel of another stream starts only at a GEMM kernel boundary. With one
//! launch per round, a 2-round 256 MiB all-reduce waits for two boundaries: one all-reduce per
//! two GEMMs, half NCCL's rate. One launch per op waits for one.
//!
//! What the stream does for such an op: writes `ready = ticket` and waits for `done >= ticket`
//! as before (round 0's inputs are in; the kernel is not on the GPU while the copies run), then
//! launches this kernel, then writes and waits for the last phase as before. Inside, round 0 is
//! reduced at once; for each later round `j` the blocks meet at a grid barrier (every block's
//! piece of round `j - 1` is written), block 0 writes `ready = ticket + j` (system-scope
//! release: the daemon's copies then read the reduced piece) and polls `done >= ticket + j`
//! (system-scope acquire), then passes the ticket on in a device word (`go`, the barrier's third
//! word: GPU-scope release) that each other block's thread 0 polls (GPU-scope acquire) before
//! the block reduces round `j`. The acquires invalidate the SM's L1, so the round `j - 2` data
//! that the same scratch slot held is not read again; `__syncthreads` orders the block's loads
//! after them. Only one thread reads the host word: with a reader per block (hundreds of
//! host-memory reads in flight) the daemon's copies of the same phase take many times longer. The
//! pieces, scratch slots and reduction order are exactly those of the per-round launches
//! (`Communicator::post_cuda_ordered`), so the result is bit for bit the same.
//!
//! Every block must be resident at once for the grid barrier, so the kernel is launched
//! cooperatively (`cuLaunchCooperativeKernel`) with at most the occupancy limit of blocks. The
//! barrier's words (arrivals, generation, `go`) are the communicator's own device memory: its GPU
//! ops are ordered on the device (one stream, or events across streams), so two launches never
//! share them at the same time. The barrier resets its count and advances the generation, so the
//! words need no reset between launches.
//!
//! A lost peer or daemon: the daemon (or the client's watchdog) still advances `done` to the
//! op's last phase, as for the per-round waits, so the kernel never waits forever on a done
//! word; the op's error comes from its completion status as before.

use std::fmt::Write as _;

/// Threads per block of the rounds kernel: the reduction kernels' (it runs their body).
pub use super::THREADS;

/// Appends the rounds kernel `name` for elements of `es` bytes to `src`, which already holds
/// the (dtype, op) helpers and `commd_reduce_body` (see `kernels::source`).
pub fn push_source(src: &mut String, name: &str, elem: &str, es: u64) {
    // `write!` to a String cannot fail.
    let _ = write!(
        src,
        r#"
struct commd_rounds {{
    u64 dst;
    u64 src;
    u64 scratch;
    u64 slot_bytes;
    u64 round_elems;
    u64 count;
    u64 ready;
    u64 done;
    u64 bar;
    u32 n;
    u32 rank;
    u32 piecewise;
    u32 rounds;
    u32 ticket;
    u32 divisor;
}};

static __device__ __forceinline__ u32 commd_ld_acquire_sys32(const u32 *p) {{
    u32 v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}}

static __device__ __forceinline__ u32 commd_ld_acquire_gpu32(const u32 *p) {{
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}}

/* Every block of the (cooperatively launched) grid arrives; the last one resets the count and
   advances the generation the others wait on. Writes before the barrier, by any block, are
   visible at system scope after it. */
static __device__ void commd_grid_sync(u32 *bar) {{
    __syncthreads();
    if (threadIdx.x == 0) {{
        const u32 gen = commd_ld_acquire_gpu32(bar + 1);
        __threadfence_system();
        const u32 arrived = atomicAdd(bar, 1u) + 1u;
        if (arrived == gridDim.x) {{
            atomicExch(bar, 0u);
            asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(bar + 1), "r"(gen + 1u) : "memory");
        }} else {{
            while (commd_ld_acquire_gpu32(bar + 1) == gen) {{
            }}
        }}
    }}
    __syncthreads();
}}

extern "C" __global__ void __launch_bounds__({THREADS}) {name}(struct commd_rounds a) {{
    const u64 tid = (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x;
    const u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    for (u32 j = 0; j < a.rounds; ++j) {{
        const u32 t = a.ticket + j;
        if (j > 0) {{
            commd_grid_sync((u32 *)a.bar);
            if (threadIdx.x == 0) {{
                u32 *go = (u32 *)a.bar + 2;
                if (blockIdx.x == 0) {{
                    asm volatile("st.release.sys.global.u32 [%0], %1;" :: "l"(a.ready), "r"(t) : "memory");
                    /* One reader of the host word for the whole grid (wrap-aware >=, as
                       CU_STREAM_WAIT_VALUE_GEQ): a read from every block kept hundreds of
                       host-memory reads in flight and slowed the daemon's copies ~80x. */
                    while ((int)(commd_ld_acquire_sys32((const u32 *)a.done) - t) < 0) {{
                    }}
                    asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(go), "r"(t) : "memory");
                }} else {{
                    while ((int)(commd_ld_acquire_gpu32(go) - t) < 0) {{
                    }}
                }}
            }}
            __syncthreads();
        }}
        const u64 s0 = (u64)j * a.round_elems;
        const u64 rest = a.count - (s0 < a.count ? s0 : a.count);
        const u64 len = a.round_elems < rest ? a.round_elems : rest;
        u64 start = s0;
        u64 plen = len;
        if (a.piecewise) {{
            const u64 base = len / a.n;
            const u64 rem = len % a.n;
            start = s0 + (u64)a.rank * base + ((u64)a.rank < rem ? (u64)a.rank : rem);
            plen = base + ((u64)a.rank < rem ? 1ull : 0ull);
        }}
        if (plen == 0) {{
            continue;
        }}
        /* Every rank's input in ascending rank order (this rank's own at its place; the
           peers' in the scratch slots, which skip this rank), as the host engine reduces: so
           a one-shot all-reduce gives every rank the same bits. */
        struct commd_ins ins;
        ins.m = a.n;
        const u64 par = (u64)(j & 1u) * (u64)(a.n - 1u);
#pragma unroll
        for (u32 k = 0; k < {MAX_INPUTS}; ++k) {{
            const u64 slot = par + (u64)(k < a.rank ? k : k - 1u);
            ins.p[k] = k >= a.n ? (const void *)0
                     : k == a.rank ? (const void *)(a.src + start * {es}ull)
                     : (const void *)(a.scratch + slot * a.slot_bytes);
        }}
        commd_reduce_body(({elem} *)(a.dst + start * {es}ull), ins, plen, a.divisor, tid, stride);
    }}
}}
"#,
        MAX_INPUTS = super::MAX_INPUTS,
    );
}
