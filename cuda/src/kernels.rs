//! Reduction kernels that run in the caller's CUDA context, on the caller's stream.
//!
//! One kernel per (dtype, op) computes `out[i] = op(ins[0][i], ..., ins[m-1][i])` for up to
//! [`MAX_INPUTS`] inputs, with the semantics of the daemon's host reduction
//! (`daemon/src/engine/reduce.rs`) and of the reference in `commd_proto::check`: f16/bf16 accumulate in
//! f32 and round once to nearest-even; integer sum/prod wrap; integer AVG is NCCL's: the wrapped
//! sum divided, truncated toward zero; float AVG is `sum / divisor`; float MIN/MAX compare with
//! `<`/`>`, so a NaN propagates only from the running result (as in a sequential loop).
//!
//! The source is generated here and compiled at run time with NVRTC (through cudarc, loaded
//! dynamically): no CUDA headers are used, since the NVRTC of the `nvidia-cuda-nvrtc` wheel may not
//! find them. f16 and bf16 are `unsigned short` bit patterns converted by hand (f16 through PTX
//! `cvt`, NaNs as the `half` crate converts them).
//!
//! [`Kernels`] compiles each kernel once per GPU architecture, to SASS (CUBIN) for the device's
//! exact compute capability: a cubin from a newer NVRTC 13.x loads on an older 13.0 driver, which
//! PTX from it would not (the driver refuses PTX newer than itself). It loads each kernel once per
//! context. This module only reduces; it never synchronizes, allocates or copies.

#![allow(unsafe_code)] // module loads and kernel launches through the driver and NVRTC

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::ffi::{CString, c_void};
use std::sync::Mutex;

use commd_proto::desc::{DType, DescError, RedOp};
use cudarc::driver::sys::{self as cu_sys, CUcontext, CUdeviceptr, CUfunction, CUmodule, CUstream};

use crate::{self as cu, CuError};

/// Most inputs one launch reduces.
pub const MAX_INPUTS: usize = 8;
/// Threads per block.
pub const THREADS: u32 = 256;
/// Default grid cap, in blocks per SM (of the 8 that fit at 256 threads): enough loads in flight
/// to approach memory bandwidth while leaving room on every SM for the job's own kernels.
pub const DEFAULT_BLOCKS_PER_SM: u32 = 4;

/// Why a kernel could not be built or launched. Nothing here panics.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("{0}")]
    Unsupported(#[from] DescError),
    #[error("invalid reduction arguments: {0}")]
    InvalidArgument(String),
    #[error(
        "libnvrtc.so.13 not found: install nvidia-cuda-nvrtc==13.0.* (pip) or the CUDA toolkit and \
         put its lib dir on LD_LIBRARY_PATH (scripts/nvrtc-env.sh does this)"
    )]
    NvrtcMissing,
    #[error("NVRTC could not compile {kernel} with {options:?} ({status}); log:\n{log}")]
    Compile {
        kernel: String,
        options: Vec<String>,
        status: String,
        log: String,
    },
    #[error("NVRTC {call} failed for {kernel}: {status}")]
    Nvrtc {
        call: &'static str,
        kernel: String,
        status: String,
    },
    #[error("CUDA is unavailable: {0}")]
    NoCuda(String),
    #[error(
        "no CUDA context is current on this thread: make the device current (e.g. \
         torch.cuda.set_device) before launching a reduction"
    )]
    NoContext,
    #[error("{0}")]
    Cuda(#[from] CuError),
}

/// The stable `extern "C"` name of the kernel for `(dtype, op)`, e.g. `commd_reduce_bf16_sum`.
pub fn kernel_name(dtype: DType, op: RedOp) -> String {
    format!("commd_reduce_{}_{}", dtype.name(), op.name())
}

/// The `extern "C"` name of the direct all-reduce kernel for `(dtype, op)` (docs/design-gpu.md, direct collectives),
/// compiled into the same module as the reduction kernel.
pub fn direct_kernel_name(dtype: DType, op: RedOp) -> String {
    format!("commd_direct_{}_{}", dtype.name(), op.name())
}

/// The CUDA C++ source of the kernel for `(dtype, op)`, named [`kernel_name`].
///
/// Signature: `(T *out, struct commd_ins ins, u64 count, u32 divisor)`, where `ins` holds 8
/// pointers and the number `m` of them in use (1..=8). `out` may be `ins.p[0]` (each element is
/// read before it is written, by the same thread). A grid-stride loop; any grid size works.
///
/// The module holds, in this order: the prelude and the reduction kernel (`reduce`), the direct
/// kernel (`direct::push_source`), the rounds kernel (`rounds::push_source`) and, in sum modules
/// only, the scale kernel and the direct send/recv kernels (`p2p::push_source`).
pub fn source(dtype: DType, op: RedOp) -> Result<String, KernelError> {
    let s = reduce::shape(dtype, op)?;
    let es = dtype.size();
    let mut src = String::with_capacity(4096);
    reduce::push_prelude(&mut src, dtype);
    reduce::push_reduce(&mut src, &s, &kernel_name(dtype, op), es);
    direct::push_source(&mut src, &direct_kernel_name(dtype, op), s.elem, es);
    rounds::push_source(&mut src, &rounds_kernel_name(dtype, op), s.elem, es);
    if op == RedOp::Sum {
        reduce::push_scale(&mut src, &s, &scale_kernel_name(dtype));
        // Direct send/recv (`direct/p2p.rs`), single and grouped.
        p2p::push_source(&mut src, P2P_SEND, P2P_RECV, P2P_GROUP, P2P_TWO);
    }
    Ok(src)
}

/// Launches kernel `f` (a `CUfunction`) with `grid` blocks of `direct::THREADS` threads and
/// one by-value parameter `args`; `name` names it in the error.
///
/// # Safety
/// `f` is a kernel of the current context whose single parameter has `T`'s layout, and what
/// `args` points to is valid for it; `stream` is a live stream of the context.
unsafe fn launch_one<T: Copy>(
    f: usize,
    grid: u32,
    stream: CUstream,
    args: &T,
    name: impl FnOnce() -> String,
) -> Result<(), KernelError> {
    let mut a = *args;
    let mut params: [*mut c_void; 1] = [(&raw mut a).cast()];
    // SAFETY: the caller's contract; `params` points at one live value, which the driver
    // copies before returning.
    let r = unsafe {
        cu_sys::cuLaunchKernel(
            f as CUfunction,
            grid.max(1),
            1,
            1,
            direct::THREADS,
            1,
            1,
            0,
            stream,
            params.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    };
    cu::ck_with(r, || format!("cuLaunchKernel({})", name()))?;
    Ok(())
}

/// The `extern "C"` names of the direct send and receive kernels (`p2p::push_source`), in every
/// `(dtype, sum)` module.
pub const P2P_SEND: &str = "commd_p2p_send";
pub const P2P_RECV: &str = "commd_p2p_recv";
/// The `extern "C"` name of the kernel of a group's direct send/recv ops (`p2p::push_source`).
pub const P2P_GROUP: &str = "commd_p2p_group";
/// The `extern "C"` name of the kernel of a group of two direct send/recv ops.
pub const P2P_TWO: &str = "commd_p2p_two";

/// The `extern "C"` name of the rounds kernel for `(dtype, op)` (`rounds::push_source`).
pub fn rounds_kernel_name(dtype: DType, op: RedOp) -> String {
    format!("commd_rounds_{}_{}", dtype.name(), op.name())
}

/// The `extern "C"` name of the scale kernel for `dtype` (in the `(dtype, sum)` module).
pub fn scale_kernel_name(dtype: DType) -> String {
    format!("commd_scale_{}", dtype.name())
}

/// The argument block every kernel takes by value (`struct commd_ins`).
#[repr(C)]
#[derive(Clone, Copy)]
struct InsArg {
    p: [CUdeviceptr; MAX_INPUTS],
    m: u32,
}
const _: () = assert!(std::mem::size_of::<InsArg>() == 72);

/// The parameter of the direct all-reduce kernel (`struct commd_direct`,
/// `direct::push_source`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DirectArgs {
    /// Each rank's window, mapped in this context.
    pub win: [CUdeviceptr; 8],
    pub input: CUdeviceptr,
    pub out: CUdeviceptr,
    pub count: u64,
    /// Bytes of one data slot.
    pub slot: u64,
    /// The failure record (host memory mapped for the device).
    pub rec: CUdeviceptr,
    /// The communicator's doorbell hint word (mapped for the device).
    pub hint: CUdeviceptr,
    pub timeout_ns: u64,
    pub me: u32,
    pub n: u32,
    pub sig: u32,
    /// Index of the op among the communicator's captured direct ops.
    pub k: u32,
    pub divisor: u32,
    /// `direct::MODE_*`.
    pub mode: u32,
    /// Broadcast and reduce: the root.
    pub root: u32,
    /// An eager op's status word (index + 1 in the record page, `direct::STATUS_OFF`); 0 for
    /// a captured op.
    pub status: u32,
    /// What each block adds to the window's `entered` counter: the launch's grid times `unit`
    /// is the communicator's fixed ticket count per op, so an op may run on a fraction of it.
    pub unit: u32,
    /// Non-zero: the op moves by LL lines (one block, at most `direct::LL_MAX_BYTES`).
    pub ll: u32,
    /// Non-zero: a rank that reads nothing of its peers in this op defers its wait to its next
    /// op (`direct::DEFER_OFF`), which then waits first.
    pub defer: u32,
    /// An eager op: the communicator's collectives sent to the daemon's path before it since
    /// its eager windows were set up (`direct::MARK_OFF`: a peer's daemon mark past it fails
    /// the op at once). 0 for a captured op.
    pub dseq: u32,
    /// An eager op's epoch, numbered by the host (its windows hold eager ops only, which run
    /// in issue order); 0: a captured op, whose blocks count tickets for it.
    pub epoch: u64,
}

/// The argument of the direct send and receive kernels (`struct commd_p2p`, `p2p::push_source`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct P2pArgs {
    /// This rank's inbox from the peer (its own GPU memory).
    pub local: CUdeviceptr,
    /// The peer's inbox from this rank (opened here).
    pub remote: CUdeviceptr,
    /// The send's input or the receive's output.
    pub buf: CUdeviceptr,
    pub bytes: u64,
    /// Bytes of one data slot.
    pub slot: u64,
    /// The failure record and status words (host memory mapped for the device).
    pub rec: CUdeviceptr,
    /// The communicator's doorbell hint word.
    pub hint: CUdeviceptr,
    pub timeout_ns: u64,
    /// The op's sequence number on its direction of the pair, from 1.
    pub seq: u64,
    pub sig: u32,
    /// The op's status word (index + 1 in the record page).
    pub status: u32,
    /// Non-zero: the LL protocol (`p2p` module doc; both sides choose it by the bytes).
    pub ll: u32,
    pub pad: u32,
}
const _: () = assert!(std::mem::size_of::<DirectArgs>() == 176);
const _: () = assert!(std::mem::size_of::<P2pArgs>() == 88);

/// The parameter of the rounds kernel (`struct commd_rounds`, `rounds::push_source`): the pieces
/// and scratch slots of every round as `Communicator::post_cuda_ordered` computes them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct RoundsArgs {
    /// Where the op's output starts (round `j`'s piece at `dst + start * es`).
    pub dst: CUdeviceptr,
    /// Where this rank's own input starts.
    pub src: CUdeviceptr,
    /// This rank's scratch (`commd_proto::desc::cuda_scratch_off` layout).
    pub scratch: CUdeviceptr,
    pub slot_bytes: u64,
    pub round_elems: u64,
    pub count: u64,
    /// The doorbell's ready and done words, mapped for the device.
    pub ready: CUdeviceptr,
    pub done: CUdeviceptr,
    /// Four zeroed u32 of device memory, the communicator's own (the grid barrier and `go`).
    pub bar: CUdeviceptr,
    pub n: u32,
    pub rank: u32,
    /// 1: the rank reduces its piece of each round (all-reduce, reduce-scatter + all-gather);
    /// 0: the whole round.
    pub piecewise: u32,
    pub rounds: u32,
    /// Round 0's ticket (the stream wrote and waited for it before the launch).
    pub ticket: u32,
    pub divisor: u32,
}
const _: () = assert!(std::mem::size_of::<RoundsArgs>() == 96);

/// The argument of the group kernel (`struct commd_p2p_group`, `p2p::push_source`, which checks
/// the size): op i runs on blocks `first[i]..first[i + 1]`, as a send where bit i of `sends` is
/// set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct P2pGroupArgs {
    pub n: u32,
    pub sends: u32,
    pub first: [u32; p2p::GROUP_MAX + 1],
    pub ops: [P2pArgs; p2p::GROUP_MAX],
}

/// The argument of the kernel of a group of two (`struct commd_p2p_two`): op 0 on blocks
/// `0..split`, op 1 on the rest, a send where bit i of `sends` is set.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct P2pTwoArgs {
    pub split: u32,
    pub sends: u32,
    pub ops: [P2pArgs; 2],
}
const _: () = assert!(std::mem::size_of::<P2pTwoArgs>() == 184);

/// What is known about one context (by its process-unique id, `cuCtxGetId`).
#[derive(Clone, Copy)]
struct CtxInfo {
    arch: (u32, u32),
    sm_count: u32,
}

/// A loaded kernel: its `CUfunction` (kept as an address: the cache is shared across threads).
#[derive(Clone, Copy)]
struct Loaded {
    func: usize,
    direct: usize,
    /// The scale kernel (sum modules only; 0 otherwise).
    scale: usize,
    /// The direct send and receive kernels (sum modules only; 0 otherwise).
    p2p_send: usize,
    p2p_recv: usize,
    p2p_group: usize,
    p2p_two: usize,
    rounds: usize,
    /// Blocks of the rounds kernel that fit on one SM at once (its cooperative launch limit).
    rounds_per_sm: u32,
    sm_count: u32,
}

#[derive(Default)]
struct State {
    /// Compiled CUBINs by (arch, dtype, op), shared by contexts on devices of one architecture.
    images: HashMap<((u32, u32), DType, RedOp), Vec<u8>>,
    ctxs: HashMap<u64, CtxInfo>,
    loaded: HashMap<(u64, DType, RedOp), Loaded>,
}

/// The reduction kernels, compiled on first use per architecture and loaded on first use per CUDA
/// context. Thread-safe; keep one per process (modules stay loaded until their context is
/// destroyed, so dropping a `Kernels` does not unload them).
pub struct Kernels {
    state: Mutex<State>,
    blocks_per_sm: u32,
}

impl Default for Kernels {
    fn default() -> Self {
        Self::with_blocks_per_sm(DEFAULT_BLOCKS_PER_SM)
    }
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.state.lock().map(|s| s.loaded.len()).unwrap_or(0);
        write!(f, "Kernels({n} loaded)")
    }
}

impl Kernels {
    pub fn new() -> Self {
        Self::default()
    }

    /// Caps every launch's grid at `n` blocks of 256 threads per SM (at least 1).
    pub fn with_blocks_per_sm(n: u32) -> Self {
        Self {
            state: Mutex::default(),
            blocks_per_sm: n.max(1),
        }
    }

    /// Compiles (if needed) and loads the kernel for `(dtype, op)` in the current context, so a
    /// later [`launch`](Self::launch) does no module loading (e.g. before CUDA graph capture).
    pub fn prepare(&self, dtype: DType, op: RedOp) -> Result<(), KernelError> {
        op.check_dtype(dtype)?;
        let ctx = current_ctx_id()?;
        self.get(ctx, dtype, op).map(|_| ())
    }

    /// Enqueues `out[i] = op(ins[0][i], ..., ins[m-1][i])` for `i < count` on `stream` in the
    /// current context; returns without waiting. `divisor` is the AVG denominator (the number of
    /// ranks, which may differ from `ins.len()`); other ops ignore it. `count == 0` launches
    /// nothing.
    ///
    /// # Safety
    /// `stream` (or null, the legacy default stream) belongs to the context current on this
    /// thread (no current context is an error). Every `ins[k]` is a device address readable for `count` elements of `dtype`
    /// and `out` writable for `count` elements, until the kernel has run on `stream`. `out` may be
    /// exactly `ins[0]` but must not otherwise overlap any input.
    // The arguments are the kernel's own; a struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        stream: CUstream,
        dtype: DType,
        op: RedOp,
        out: CUdeviceptr,
        ins: &[CUdeviceptr],
        count: u64,
        divisor: u32,
    ) -> Result<(), KernelError> {
        op.check_dtype(dtype)?;
        if ins.is_empty() || ins.len() > MAX_INPUTS {
            return Err(KernelError::InvalidArgument(format!(
                "{} inputs (1 to {MAX_INPUTS} allowed)",
                ins.len()
            )));
        }
        check_divisor(op, divisor)?;
        if count == 0 {
            return Ok(());
        }
        let ctx = current_ctx_id()?;
        let k = self.get(ctx, dtype, op)?;
        let mut arg = InsArg {
            p: [0; MAX_INPUTS],
            m: u32::try_from(ins.len()).expect("at most MAX_INPUTS inputs (checked above)"),
        };
        arg.p[..ins.len()].copy_from_slice(ins);
        let blocks = self.grid(k, count);
        let mut out = out;
        let mut count = count;
        let mut divisor = divisor;
        let mut params: [*mut c_void; 4] = [
            (&raw mut out).cast(),
            (&raw mut arg).cast(),
            (&raw mut count).cast(),
            (&raw mut divisor).cast(),
        ];
        // SAFETY: `func` was loaded in the current context (cached by its id); `params` points at
        // four live values laid out as the kernel's parameters (u64 pointer, 72-byte struct, u64,
        // u32), which the driver copies before returning; the caller vouches for the stream and
        // the device ranges.
        let r = unsafe {
            cu_sys::cuLaunchKernel(
                k.func as CUfunction,
                blocks,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        cu::ck_with(r, || format!("cuLaunchKernel({})", kernel_name(dtype, op)))?;
        Ok(())
    }

    /// Enqueues the direct all-reduce kernel for `(dtype, op)` (docs/design-gpu.md, direct collectives) on
    /// `stream` with `grid` blocks: `grid` x `args.unit` must be the same for every direct op of
    /// a communicator (its epochs count tickets, `unit` per block).
    ///
    /// # Safety
    /// `stream` belongs to the current context; `args` names live windows (mapped in this
    /// context), a record and hint word mapped for the device, and `in`/`out` buffers of `count`
    /// elements, as `direct::push_source` describes.
    pub unsafe fn launch_direct(
        &self,
        stream: CUstream,
        dtype: DType,
        op: RedOp,
        grid: u32,
        args: &DirectArgs,
    ) -> Result<(), KernelError> {
        op.check_dtype(dtype)?;
        if args.n < 2 || args.n > direct::MAX_RANKS || args.me >= args.n {
            return Err(KernelError::InvalidArgument(format!(
                "direct all-reduce of rank {} of {} ranks (2 to {} supported)",
                args.me,
                args.n,
                direct::MAX_RANKS
            )));
        }
        if args.ll != 0
            && (grid != 1 || args.count.saturating_mul(dtype.size()) > direct::LL_MAX_BYTES)
        {
            return Err(KernelError::InvalidArgument(format!(
                "direct op by LL lines on {grid} blocks of {} elements (one block, at most {} bytes)",
                args.count,
                direct::LL_MAX_BYTES
            )));
        }
        if args.unit == 0 {
            return Err(KernelError::InvalidArgument(
                "direct op with a ticket unit of 0 (every block must count)".into(),
            ));
        }
        if args.mode > direct::MODE_BCF {
            return Err(KernelError::InvalidArgument(format!(
                "direct op of unknown mode {}",
                args.mode
            )));
        }
        let ctx = current_ctx_id()?;
        let k = self.get(ctx, dtype, op)?;
        // SAFETY: `k.direct` was loaded in the current context; its parameter is
        // `struct commd_direct`, laid out as `DirectArgs`; the caller vouches for the rest.
        unsafe {
            launch_one(k.direct, grid, stream, args, || {
                direct_kernel_name(dtype, op)
            })
        }
    }

    /// A direct send/recv kernel (`pick` of the loaded ones) of the `(dtype, sum)` module in the
    /// current context, loading the module if needed.
    fn p2p_kernel(
        &self,
        dtype: DType,
        pick: impl Fn(&Loaded) -> usize,
    ) -> Result<usize, KernelError> {
        let k = self.get(current_ctx_id()?, dtype, RedOp::Sum)?;
        match pick(&k) {
            0 => Err(KernelError::InvalidArgument(format!(
                "no direct send/recv kernel in the {} module",
                dtype.name()
            ))),
            f => Ok(f),
        }
    }

    /// Enqueues the direct send (`send`) or receive kernel of the `(dtype, sum)` module on
    /// `stream` with `grid` blocks.
    ///
    /// # Safety
    /// The inboxes, buffer, record and hint word in `args` are valid for the kernel in the
    /// current context, and `stream` is a live stream of it.
    pub unsafe fn launch_p2p(
        &self,
        stream: CUstream,
        dtype: DType,
        send: bool,
        grid: u32,
        args: &P2pArgs,
    ) -> Result<(), KernelError> {
        let f = self.p2p_kernel(dtype, |k| if send { k.p2p_send } else { k.p2p_recv })?;
        // SAFETY: `f` was loaded in the current context; its parameter is `struct commd_p2p`,
        // laid out as `P2pArgs`; the caller vouches for the rest.
        unsafe {
            launch_one(f, grid, stream, args, || {
                (if send { P2P_SEND } else { P2P_RECV }).to_string()
            })
        }
    }

    /// Enqueues the group kernel of the `(dtype, sum)` module on `stream`: `args.n` send/recv
    /// ops on `args.first[args.n]` blocks (the caller keeps that within [`Self::sm_count`]:
    /// a block that waits for the peer must not keep the peer's counterpart from running).
    ///
    /// # Safety
    /// As [`Self::launch_p2p`], for every op of `args`.
    pub unsafe fn launch_p2p_group(
        &self,
        stream: CUstream,
        dtype: DType,
        args: &P2pGroupArgs,
    ) -> Result<(), KernelError> {
        let f = self.p2p_kernel(dtype, |k| k.p2p_group)?;
        let n = (args.n as usize).min(p2p::GROUP_MAX);
        // SAFETY: loaded in the current context; its parameter is `struct commd_p2p_group`,
        // laid out as `P2pGroupArgs` (the source asserts the size); the caller vouches for the
        // rest.
        unsafe { launch_one(f, args.first[n], stream, args, || P2P_GROUP.to_string()) }
    }

    /// As [`Self::launch_p2p_group`] for a group of two ops on `grid` blocks.
    ///
    /// # Safety
    /// As [`Self::launch_p2p`], for both ops of `args`.
    pub unsafe fn launch_p2p_two(
        &self,
        stream: CUstream,
        dtype: DType,
        grid: u32,
        args: &P2pTwoArgs,
    ) -> Result<(), KernelError> {
        let f = self.p2p_kernel(dtype, |k| k.p2p_two)?;
        // SAFETY: loaded in the current context; its parameter is `struct commd_p2p_two`, laid
        // out as `P2pTwoArgs` (the source asserts the size); the caller vouches for the rest.
        unsafe { launch_one(f, grid, stream, args, || P2P_TWO.to_string()) }
    }

    /// Enqueues the rounds kernel for `(dtype, op)` (`rounds::push_source`) on `stream`: every
    /// round of a multi-round reduction in one cooperative launch of at most `max_blocks` blocks
    /// (0: the reduction kernels' cap, `blocks_per_sm` per SM), never more than fit on the GPU
    /// at once. `cooperative` false launches it the ordinary way (for measurement). Returns the
    /// grid used.
    ///
    /// # Safety
    /// `stream` belongs to the current context; `args` addresses live buffers as
    /// [`RoundsArgs`] describes (inputs, output and scratch for every round, the doorbell words
    /// mapped for the device, and a barrier no other launch uses at the same time).
    pub unsafe fn launch_rounds(
        &self,
        stream: CUstream,
        dtype: DType,
        op: RedOp,
        max_blocks: u32,
        cooperative: bool,
        args: &RoundsArgs,
    ) -> Result<u32, KernelError> {
        op.check_dtype(dtype)?;
        if args.n < 1 || args.n as usize > MAX_INPUTS || args.rank >= args.n.max(1) {
            return Err(KernelError::InvalidArgument(format!(
                "rounds kernel for rank {} of {} ranks (1 to {MAX_INPUTS} supported)",
                args.rank, args.n
            )));
        }
        check_divisor(op, args.divisor)?;
        if args.bar == 0 || args.ready == 0 || args.done == 0 {
            return Err(KernelError::InvalidArgument(
                "rounds kernel without its barrier or doorbell words".into(),
            ));
        }
        let ctx = current_ctx_id()?;
        let k = self.get(ctx, dtype, op)?;
        let fit = k.sm_count.saturating_mul(k.rounds_per_sm);
        if fit == 0 {
            return Err(KernelError::InvalidArgument(format!(
                "{} does not fit on this GPU ({} blocks of {} threads per SM)",
                rounds_kernel_name(dtype, op),
                k.rounds_per_sm,
                rounds::THREADS
            )));
        }
        let want = if max_blocks == 0 {
            k.sm_count.saturating_mul(self.blocks_per_sm)
        } else {
            max_blocks
        };
        let grid = want.min(fit).max(1);
        let mut a = *args;
        let mut params: [*mut c_void; 1] = [(&raw mut a).cast()];
        let (f, t, p) = (k.rounds as CUfunction, rounds::THREADS, params.as_mut_ptr());
        // SAFETY: `rounds` was loaded in the current context with `func`; `params` points at one
        // live value laid out as the kernel's parameter (`struct commd_rounds`), which the driver
        // copies before returning; `grid` blocks fit on the device at once (occupancy above);
        // the caller vouches for the stream and the pointers.
        let r = unsafe {
            if cooperative {
                cu_sys::cuLaunchCooperativeKernel(f, grid, 1, 1, t, 1, 1, 0, stream, p)
            } else {
                cu_sys::cuLaunchKernel(f, grid, 1, 1, t, 1, 1, 0, stream, p, std::ptr::null_mut())
            }
        };
        cu::ck_with(r, || format!("launching {}", rounds_kernel_name(dtype, op)))?;
        Ok(grid)
    }

    /// Enqueues `out[i] = in[i] * s` for `i < count` on `stream`: `s` is the `dtype` value at
    /// device address `sp` when it is not 0 (read when the kernel runs), else the low
    /// `dtype.size()` bytes of `imm` (little-endian bits). f16/bf16 multiply in f32 and round
    /// once; integers wrap. `out` may be `in`.
    ///
    /// # Safety
    /// `stream` belongs to the current context; `in` and `out` address `count` elements, and
    /// `sp` (if not 0) one element, of device memory valid until the kernel has run.
    // The arguments are the kernel's own; a struct would only rename them.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch_scale(
        &self,
        stream: CUstream,
        dtype: DType,
        out: CUdeviceptr,
        input: CUdeviceptr,
        count: u64,
        sp: CUdeviceptr,
        imm: u64,
    ) -> Result<(), KernelError> {
        if count == 0 {
            return Ok(());
        }
        let ctx = current_ctx_id()?;
        let k = self.get(ctx, dtype, RedOp::Sum)?;
        let blocks = self.grid(k, count);
        let (mut out, mut input, mut count, mut sp, mut imm) = (out, input, count, sp, imm);
        let mut params: [*mut c_void; 5] = [
            (&raw mut out).cast(),
            (&raw mut input).cast(),
            (&raw mut count).cast(),
            (&raw mut sp).cast(),
            (&raw mut imm).cast(),
        ];
        // SAFETY: `scale` was loaded in the current context with the (dtype, sum) module;
        // `params` points at five live 8-byte values laid out as the kernel's parameters,
        // which the driver copies before returning; the caller vouches for the rest.
        let r = unsafe {
            cu_sys::cuLaunchKernel(
                k.scale as CUfunction,
                blocks,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        cu::ck_with(r, || {
            format!("cuLaunchKernel({})", scale_kernel_name(dtype))
        })?;
        Ok(())
    }

    /// Blocks of a grid-stride launch over `count` elements: one thread each, capped at
    /// `blocks_per_sm` per SM.
    fn grid(&self, k: Loaded, count: u64) -> u32 {
        let cap = k.sm_count.saturating_mul(self.blocks_per_sm);
        let blocks = count
            .div_ceil(u64::from(THREADS))
            .min(u64::from(cap))
            .max(1);
        // At most `cap` (or 1), a u32.
        u32::try_from(blocks).unwrap_or(cap)
    }

    /// SMs of the current context's device.
    pub fn sm_count(&self) -> Result<u32, KernelError> {
        let ctx = current_ctx_id()?;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let info = match st.ctxs.entry(ctx) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => *e.insert(ctx_info()?),
        };
        Ok(info.sm_count)
    }

    /// The kernel for `(dtype, op)` in context `id` (current on this thread), loading it if
    /// needed. The lock is held while compiling: that happens once per kernel and architecture.
    fn get(&self, id: u64, dtype: DType, op: RedOp) -> Result<Loaded, KernelError> {
        let mut guard = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut *guard;
        if let Some(k) = st.loaded.get(&(id, dtype, op)) {
            return Ok(*k);
        }
        let info = match st.ctxs.entry(id) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => *e.insert(ctx_info()?),
        };
        let image = match st.images.entry((info.arch, dtype, op)) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(compile_cubin(dtype, op, info.arch)?),
        };
        let name = CString::new(kernel_name(dtype, op))
            .map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: the context is current on this thread; `image` is a complete CUBIN that lives
        // across the call; `module` is a valid out pointer.
        let r = unsafe { cu_sys::cuModuleLoadData(&mut module, image.as_ptr().cast()) };
        cu::ck(r, &format!("cuModuleLoadData({})", kernel_name(dtype, op)))?;
        let mut func: CUfunction = std::ptr::null_mut();
        // SAFETY: `module` was just loaded; `name` is NUL-terminated; `func` is a valid out pointer.
        let r = unsafe { cu_sys::cuModuleGetFunction(&mut func, module, name.as_ptr()) };
        if let Err(e) = cu::ck(r, "cuModuleGetFunction") {
            // SAFETY: `module` was loaded above and nothing refers to it.
            let _ = unsafe { cu_sys::cuModuleUnload(module) };
            return Err(e.into());
        }
        let dname = CString::new(direct_kernel_name(dtype, op))
            .map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
        let mut direct: CUfunction = std::ptr::null_mut();
        // SAFETY: as above.
        let r = unsafe { cu_sys::cuModuleGetFunction(&mut direct, module, dname.as_ptr()) };
        if let Err(e) = cu::ck(r, "cuModuleGetFunction(direct)") {
            // SAFETY: `module` was loaded above and nothing refers to it.
            let _ = unsafe { cu_sys::cuModuleUnload(module) };
            return Err(e.into());
        }
        let mut scale: CUfunction = std::ptr::null_mut();
        let mut p2p_send: CUfunction = std::ptr::null_mut();
        let mut p2p_recv: CUfunction = std::ptr::null_mut();
        let mut p2p_group: CUfunction = std::ptr::null_mut();
        let mut p2p_two: CUfunction = std::ptr::null_mut();
        if op == RedOp::Sum {
            for (f, name) in [
                (&mut scale, scale_kernel_name(dtype)),
                (&mut p2p_send, P2P_SEND.to_string()),
                (&mut p2p_recv, P2P_RECV.to_string()),
                (&mut p2p_group, P2P_GROUP.to_string()),
                (&mut p2p_two, P2P_TWO.to_string()),
            ] {
                let cname =
                    CString::new(name).map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
                // SAFETY: as above.
                let r = unsafe { cu_sys::cuModuleGetFunction(f, module, cname.as_ptr()) };
                if let Err(e) = cu::ck(r, "cuModuleGetFunction(scale, p2p)") {
                    // SAFETY: `module` was loaded above and nothing refers to it.
                    let _ = unsafe { cu_sys::cuModuleUnload(module) };
                    return Err(e.into());
                }
            }
        }
        let rname = CString::new(rounds_kernel_name(dtype, op))
            .map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
        let mut rounds: CUfunction = std::ptr::null_mut();
        // SAFETY: as above.
        let r = unsafe { cu_sys::cuModuleGetFunction(&mut rounds, module, rname.as_ptr()) };
        let mut rounds_per_sm: std::ffi::c_int = 0;
        let r = cu::ck(r, "cuModuleGetFunction(rounds)").and_then(|()| {
            cu::ck(
                // SAFETY: `rounds` was just loaded; `rounds_per_sm` is a valid out pointer.
                unsafe {
                    cu_sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                        &mut rounds_per_sm,
                        rounds,
                        std::ffi::c_int::try_from(rounds::THREADS)
                            .expect("the rounds kernel's block size is small"),
                        0,
                    )
                },
                "cuOccupancyMaxActiveBlocksPerMultiprocessor(rounds)",
            )
        });
        if let Err(e) = r {
            // SAFETY: `module` was loaded above and nothing refers to it.
            let _ = unsafe { cu_sys::cuModuleUnload(module) };
            return Err(e.into());
        }
        let k = Loaded {
            func: func as usize,
            direct: direct as usize,
            scale: scale as usize,
            p2p_send: p2p_send as usize,
            p2p_recv: p2p_recv as usize,
            p2p_group: p2p_group as usize,
            p2p_two: p2p_two as usize,
            rounds: rounds as usize,
            rounds_per_sm: u32::try_from(rounds_per_sm).unwrap_or(0),
            sm_count: info.sm_count,
        };
        st.loaded.insert((id, dtype, op), k);
        Ok(k)
    }
}

/// AVG divides by the number of ranks: 0 is a caller's bug, refused before any launch.
fn check_divisor(op: RedOp, divisor: u32) -> Result<(), KernelError> {
    if op == RedOp::Avg && divisor == 0 {
        return Err(KernelError::InvalidArgument(
            "avg with divisor 0 (the divisor is the number of ranks)".into(),
        ));
    }
    Ok(())
}

/// The process-unique id of the current context (a context destroyed and another created at the
/// same address get different ids, so cached functions are never used in the wrong one).
fn current_ctx_id() -> Result<u64, KernelError> {
    cu::driver().map_err(KernelError::NoCuda)?;
    let mut ctx: CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is loaded and initialized; `ctx` is a valid out pointer.
    let r = unsafe { cu_sys::cuCtxGetCurrent(&mut ctx) };
    cu::ck(r, "cuCtxGetCurrent")?;
    if ctx.is_null() {
        return Err(KernelError::NoContext);
    }
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: `ctx` is the live current context; `id` is a valid out pointer.
    let r = unsafe { cu_sys::cuCtxGetId(ctx, &mut id) };
    cu::ck(r, "cuCtxGetId")?;
    Ok(id)
}

/// Compute capability and SM count of the current context's device.
fn ctx_info() -> Result<CtxInfo, KernelError> {
    let mut dev = 0;
    // SAFETY: a context is current (checked by the caller); `dev` is a valid out pointer.
    let r = unsafe { cu_sys::cuCtxGetDevice(&mut dev) };
    cu::ck(r, "cuCtxGetDevice")?;
    use cu_sys::CUdevice_attribute as A;
    let major = cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let sms = cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    Ok(CtxInfo {
        // The driver's ints, negatives read as 0 (and no SMs as one).
        arch: (
            u32::try_from(major).unwrap_or(0),
            u32::try_from(minor).unwrap_or(0),
        ),
        sm_count: u32::try_from(sms).unwrap_or(0).max(1),
    })
}

pub mod direct;
mod nvrtc;
pub mod p2p;
mod reduce;
pub mod rounds;

pub use nvrtc::{compile_cubin, compile_ptx, nvrtc_version};
#[cfg(test)]
mod tests;
