//! How the caller's stream waits for a done counter (docs/contracts.md #4): a one-thread
//! kernel that polls the counter in host memory, or `cuStreamWaitValue32`.
//!
//! Why a kernel: a stream blocked in `cuStreamWaitValue32` is slow to resume once the daemon
//! has submitted any work to the same GPU while it waited: the doorbell round trip is short
//! when the daemon only writes counters from the CPU, but much longer as soon as it also
//! records an event or issues a copy there, with or without MPS. A kernel polling the counter
//! keeps the stream running, so a send/recv takes less GPU time per op (docs/benchmarks.md row
//! `probe-doorbell-wait-64K`, measured by `scripts/probes/copy_doorbell.py`).
//!
//! Why not always: launching the kernel costs the CPU more per op than the memory op, which matters
//! where the CPU's issue rate bounds the op (torch send/recv below 2 MiB). So the default (`auto`)
//! polls with the kernel for ops of at least [`AUTO_KERNEL_MIN_BYTES`] and uses
//! `cuStreamWaitValue32` for smaller ones, and for ops whose daemon plan copies within a GPU
//! ([`auto_bytes`]: such a copy is a kernel in the daemon's context, which waits for a time slice
//! while this context's kernel polls). `COMMD_GPU_WAIT=kernel|memop` forces one way. (Ops replayed
//! from a CUDA graph would cost no CPU per op and favour the kernel at every size; the doorbell
//! protocol has no replayable ops yet, so nothing here depends on capture.)
//!
//! The kernel is one thread of one block, runs only while the stream would otherwise sit in the
//! memory-op wait, reads the counter with `ld.acquire.sys` (wrap-aware `>=`, as
//! `CU_STREAM_WAIT_VALUE_GEQ`), and is hand-written PTX, so it needs no NVRTC: the driver
//! compiles it once per context. A context where the module does not load (a GPU older than
//! sm_70) uses the memory op, with one warning.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys::{self as cu_sys, CUdeviceptr, CUfunction, CUmodule, CUstream};

use super::cu::{self, CuError};

/// `commd_wait_geq(addr, value)`: returns once `(int)(*addr - value) >= 0`.
const PTX: &str = "
.version 6.0
.target sm_70
.address_size 64
.visible .entry commd_wait_geq(.param .u64 p, .param .u32 v)
{
  .reg .u64 %a;
  .reg .u32 %x, %w, %d;
  .reg .pred %q;
  ld.param.u64 %a, [p];
  ld.param.u32 %w, [v];
  cvta.to.global.u64 %a, %a;
WAIT:
  ld.acquire.sys.global.u32 %x, [%a];
  sub.u32 %d, %x, %w;
  setp.lt.s32 %q, %d, 0;
  @%q bra WAIT;
  ret;
}
\0";

/// Ops of at least this many bytes (per rank: count x element size) wait with the kernel in the
/// `auto` mode: from 4 MiB the kernel is faster per send/recv, at 1 MiB the two are even.
pub const AUTO_KERNEL_MIN_BYTES: u64 = 2 << 20;

/// How streams wait for done counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitMode {
    /// The kernel for ops of at least [`AUTO_KERNEL_MIN_BYTES`], the memory op for smaller
    /// ones (the default).
    Auto,
    /// The polling kernel.
    Kernel,
    /// `cuStreamWaitValue32`.
    MemOp,
}

impl WaitMode {
    /// Parses `COMMD_GPU_WAIT`'s value.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Self::Auto),
            "kernel" => Ok(Self::Kernel),
            "memop" => Ok(Self::MemOp),
            other => Err(format!(
                "COMMD_GPU_WAIT={other:?}: expected \"auto\" (the default), \"kernel\" or \"memop\""
            )),
        }
    }

    /// The process's mode, from `COMMD_GPU_WAIT` (read once; an invalid value is an error on
    /// every GPU op rather than a silent default).
    pub fn current() -> Result<Self, String> {
        static MODE: OnceLock<Result<WaitMode, String>> = OnceLock::new();
        MODE.get_or_init(|| {
            WaitMode::parse(
                &commd_settings::get(&commd_settings::keys::GPU_WAIT).unwrap_or_default(),
            )
        })
        .clone()
    }
}

/// The loaded kernel per context id (`None`: it did not load there; use the memory op).
static FUNCS: OnceLock<Mutex<HashMap<u64, Option<usize>>>> = OnceLock::new();

/// The size the `auto` rule sees for an op of `kind` moving `bytes` per rank: 0 (the memory op)
/// for ops whose daemon plan copies within a rank's own GPU (all_gather, broadcast, all_to_all:
/// the rank's own block). A copy within one GPU runs as a kernel in the daemon's context,
/// time-sliced against this context's polling kernel: on 4 GPUs an all_gather of 16-256 MiB
/// then takes one time slice per op whatever the size, far behind NCCL. Send/recv between GPUs
/// and the reductions (whose plans have no copy within a GPU) keep the kernel. Ranks sharing
/// one GPU make every copy such a copy: once the daemon has seen that (every rank bound its
/// reduction scratch), it sets the communicator's `HINT_SHARED_GPU` doorbell hint and the
/// client passes 0 here (`post_cuda_ordered`); send/recv-only communicators on a shared GPU
/// still need `COMMD_GPU_WAIT=memop`.
pub fn auto_bytes(kind: commd_proto::desc::OpKind, bytes: u64) -> u64 {
    use commd_proto::desc::OpKind as K;
    match kind {
        K::AllGather | K::Broadcast | K::AllToAll => 0,
        _ => bytes,
    }
}

/// Whether a wait for an op of `bytes` uses the kernel under `mode`.
fn wants_kernel(mode: WaitMode, bytes: u64) -> bool {
    match mode {
        WaitMode::Kernel => true,
        WaitMode::MemOp => false,
        WaitMode::Auto => bytes >= AUTO_KERNEL_MIN_BYTES,
    }
}

/// The polling kernel for a wait of an op of `bytes` on `stream`, or `None` where the memory op
/// is used: the mode says so, the stream is not of the current context (a launch needs its
/// function's context current), or the module does not load in this context.
fn kernel_for(stream: CUstream, bytes: u64) -> Result<Option<CUfunction>, CuError> {
    let mode = WaitMode::current().map_err(|e| CuError {
        what: "COMMD_GPU_WAIT".into(),
        code: 0,
        name: "invalid".into(),
        text: e,
    })?;
    if !wants_kernel(mode, bytes) {
        return Ok(None);
    }
    let mut cur: cu_sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the driver is initialized (callers went through `driver()`); valid out pointer.
    let r = unsafe { cu_sys::cuCtxGetCurrent(&mut cur) };
    cu::ck(r, "cuCtxGetCurrent")?;
    if cur.is_null() {
        return Ok(None);
    }
    let mut sctx: cu_sys::CUcontext = std::ptr::null_mut();
    // SAFETY: the caller vouches for `stream`; `sctx` is a valid out pointer.
    let r = unsafe { cu_sys::cuStreamGetCtx(stream, &mut sctx) };
    cu::ck(r, "cuStreamGetCtx")?;
    if sctx != cur {
        return Ok(None);
    }
    let mut id: std::ffi::c_ulonglong = 0;
    // SAFETY: `cur` is the live current context; `id` is a valid out pointer.
    cu::ck(unsafe { cu_sys::cuCtxGetId(cur, &mut id) }, "cuCtxGetId")?;
    let mut map = FUNCS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(f) = map.get(&id) {
        return Ok(f.map(|f| f as CUfunction));
    }
    let loaded = load();
    if let Err(e) = &loaded {
        // The library has no logger; this happens at most once per context.
        eprintln!(
            "commd: the done-counter polling kernel did not load in this CUDA context ({e}); streams wait with cuStreamWaitValue32 there"
        );
    }
    let f = loaded.ok().map(|f| f as usize);
    map.insert(id, f);
    Ok(f.map(|f| f as CUfunction))
}

/// Loads the module in the current context.
fn load() -> Result<CUfunction, CuError> {
    let mut module: CUmodule = std::ptr::null_mut();
    // SAFETY: a context is current; `PTX` is NUL-terminated text that lives for the program.
    let r = unsafe { cu_sys::cuModuleLoadData(&mut module, PTX.as_ptr().cast()) };
    cu::ck(r, "cuModuleLoadData(commd_wait_geq)")?;
    let mut func: CUfunction = std::ptr::null_mut();
    // SAFETY: `module` was just loaded; the name is NUL-terminated; `func` is a valid out pointer.
    let r = unsafe { cu_sys::cuModuleGetFunction(&mut func, module, c"commd_wait_geq".as_ptr()) };
    if let Err(e) = cu::ck(r, "cuModuleGetFunction(commd_wait_geq)") {
        // SAFETY: `module` was loaded above and nothing refers to it.
        let _ = unsafe { cu_sys::cuModuleUnload(module) };
        return Err(e);
    }
    Ok(func)
}

/// How one op's waits are enqueued: the polling kernel (loaded in the stream's context) or the
/// memory op. Resolve it once per op ([`Waiter::new`]), then enqueue each of its waits.
#[derive(Debug, Clone, Copy)]
pub struct Waiter(Option<usize>);

impl Waiter {
    /// Checks `COMMD_GPU_WAIT` and, if an op of `bytes` on `stream` waits with the kernel, loads
    /// it in this context: a bad setting fails an op before it is posted, and no wait loads a
    /// module.
    ///
    /// # Safety
    /// `stream` is a live stream.
    pub unsafe fn new(stream: CUstream, bytes: u64) -> Result<Self, CuError> {
        Ok(Self(kernel_for(stream, bytes)?.map(|f| f as usize)))
    }

    /// Enqueues on `stream` (the one given to [`Waiter::new`]) a wait until the counter at
    /// `addr` reaches `value` (wrap-aware `>=`).
    ///
    /// # Safety
    /// `stream` is the live stream this waiter was made for; `addr` is the device-mapped address
    /// of a 4-byte word of host memory registered in `stream`'s context, which stays mapped while
    /// the stream may run.
    pub unsafe fn enqueue(
        self,
        stream: CUstream,
        addr: CUdeviceptr,
        value: u32,
    ) -> Result<(), CuError> {
        if let Some(f) = self.0 {
            let mut a = addr;
            let mut v = value;
            let mut params: [*mut c_void; 2] = [(&raw mut a).cast(), (&raw mut v).cast()];
            // SAFETY: `f` was loaded in the current context, which is `stream`'s (checked in
            // `kernel_for`); `params` points at the kernel's two parameters (u64, u32), copied by
            // the driver before it returns; the caller vouches for `addr`.
            let r = unsafe {
                cu_sys::cuLaunchKernel(
                    f as CUfunction,
                    1,
                    1,
                    1,
                    1,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            return cu::ck(r, "cuLaunchKernel(commd_wait_geq)");
        }
        // SAFETY: the caller's contract.
        let r = unsafe {
            cu_sys::cuStreamWaitValue32_v2(
                stream,
                addr,
                value,
                cu_sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        };
        cu::ck(r, "cuStreamWaitValue32")
    }
}

/// One wait for an op of `bytes` per rank: [`Waiter::new`] then [`Waiter::enqueue`].
///
/// # Safety
/// As [`Waiter::enqueue`].
pub unsafe fn wait_geq(
    stream: CUstream,
    addr: CUdeviceptr,
    value: u32,
    bytes: u64,
) -> Result<(), CuError> {
    // SAFETY: the caller's contract.
    unsafe { Waiter::new(stream, bytes)?.enqueue(stream, addr, value) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_mode() {
        assert_eq!(WaitMode::parse("").unwrap(), WaitMode::Auto);
        assert_eq!(WaitMode::parse("AUTO").unwrap(), WaitMode::Auto);
        assert_eq!(WaitMode::parse("kernel").unwrap(), WaitMode::Kernel);
        assert_eq!(WaitMode::parse(" MemOp ").unwrap(), WaitMode::MemOp);
        let e = WaitMode::parse("spin").unwrap_err();
        assert!(e.contains("\"spin\"") && e.contains("memop"), "{e}");
    }

    #[test]
    fn auto_picks_by_size() {
        assert!(!wants_kernel(WaitMode::Auto, 0));
        assert!(!wants_kernel(WaitMode::Auto, AUTO_KERNEL_MIN_BYTES - 1));
        assert!(wants_kernel(WaitMode::Auto, AUTO_KERNEL_MIN_BYTES));
        use commd_proto::desc::OpKind as K;
        for k in [K::AllGather, K::Broadcast, K::AllToAll] {
            assert!(
                !wants_kernel(WaitMode::Auto, auto_bytes(k, 1 << 30)),
                "{k:?}"
            );
            assert!(wants_kernel(WaitMode::Kernel, auto_bytes(k, 1 << 30)));
        }
        for k in [K::Send, K::Recv, K::AllReduce, K::ReduceScatter, K::Reduce] {
            assert!(
                wants_kernel(WaitMode::Auto, auto_bytes(k, 1 << 30)),
                "{k:?}"
            );
            assert!(
                !wants_kernel(WaitMode::Auto, auto_bytes(k, 1 << 20)),
                "{k:?}"
            );
        }
        assert!(wants_kernel(WaitMode::Kernel, 0));
        assert!(!wants_kernel(WaitMode::MemOp, u64::MAX));
    }

    #[test]
    fn ptx_is_terminated_and_names_the_entry() {
        assert!(PTX.ends_with('\0'));
        assert_eq!(PTX.matches('\0').count(), 1);
        assert!(PTX.contains(".entry commd_wait_geq("));
        // The wrap-aware comparison the daemon's counters need (as CU_STREAM_WAIT_VALUE_GEQ).
        assert!(PTX.contains("setp.lt.s32"));
    }
}
