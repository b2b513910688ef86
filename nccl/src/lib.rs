//! commd's NCCL-compatible library: `libcommd_nccl.so`, SONAME `libnccl.so.2`, exporting
//! NCCL's C API with NCCL's types, enums, struct layouts and result codes, so that programs
//! written for NCCL (torch's "nccl" backend, vLLM's pynccl, nccl-tests, MPI+NCCL codes) run their
//! collectives on the node's commd daemon with no code change: preload it
//! (`LD_PRELOAD=.../libnccl.so.2`, or `commd exec -- ...`) or point `VLLM_NCCL_SO_PATH` at it.
//!
//! Every function of NCCL's host API that libtorch_cuda imports is defined (a preloaded
//! library that lacked one would let the real NCCL be called with a commd communicator).
//! What commd does not do returns `ncclInvalidUsage`, and `ncclGetLastError` says what and why;
//! nothing here panics into C or hangs on bad input.
//!
//! Layers: `lib` (the C entry points: argument checks and conversions only) -> `comm`
//! (communicators, op dispatch) and `group` -> `host` (the host-memory extension) -> `ffi`,
//! `log`. Device memory goes through `commd_client`'s stream-ordered GPU ops (DESIGN.md
//! contracts 4 and 6: ops issued while a stream is captured become persistent graph ops).

#![deny(unsafe_code)] // allowed only in the modules that say why
// cast/unwrap lints: fixed in the next change
#![allow(
    clippy::cast_possible_truncation,
    clippy::cast_possible_wrap,
    clippy::cast_sign_loss,
    clippy::unwrap_used
)]
#![allow(non_camel_case_types, non_snake_case, clippy::missing_safety_doc)]

mod comm;
mod ffi;
mod log;
mod premul;
mod staging;

use std::ffi::{c_char, c_int, c_void};
use std::sync::Arc;

use commd_client::desc::OpKind;
use commd_cuda::{self as cu, sys};

use comm::{Comm, Op, UNIQUE_ID_BYTES};
use ffi::{Failure, Outcome, guard, invalid, ncclResult_t, put, unsupported, usage};

/// `ncclComm_t`.
pub type ncclComm_t = *mut Comm;
/// `cudaStream_t` (a driver stream handle; 0 is the legacy default stream).
pub type cudaStream_t = *mut c_void;

/// `ncclUniqueId`: 128 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// The head of `ncclConfig_t` (NCCL 2.14+): size, magic, version, then `blocking`. The rest
/// tunes NCCL's own kernels and transports, which commd does not have.
#[repr(C)]
pub struct ConfigHead {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
}

const API_MAGIC: u32 = 0xcafe_beef;
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
const SPLIT_NOCOLOR: c_int = -1;

/// The NCCL API version this library reports (`NCCL_COMMD_VERSION_CODE` overrides it): 2.28,
/// the release whose host API it implements.
pub fn version_code() -> c_int {
    commd_settings::get(&commd_settings::keys::NCCL_COMMD_VERSION_CODE)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(22800)
}

/// Whether a config asks for a blocking communicator (the default).
///
/// # Safety
/// `config` is null or points to an `ncclConfig_t` the caller initialised.
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
unsafe fn blocking(config: *const ConfigHead) -> Outcome<bool> {
    if config.is_null() {
        return Ok(true);
    }
    // SAFETY: the caller's contract; the head is read only after its size says it is there.
    let size = unsafe { (*config).size };
    // SAFETY: as above (the magic and version follow the size in every config version).
    let magic = unsafe { (*config).magic };
    if magic != API_MAGIC || size < std::mem::size_of::<ConfigHead>() {
        return Err(invalid(
            "config was not initialised with NCCL_CONFIG_INITIALIZER (bad magic or size)",
        ));
    }
    // SAFETY: size covers the field.
    let b = unsafe { (*config).blocking };
    match b {
        CONFIG_UNDEF_INT | 1 => Ok(true),
        0 => Ok(false),
        _ => Err(invalid(format!(
            "config blocking attribute {b} is invalid (0 or 1)"
        ))),
    }
}

fn uid_bytes(id: &ncclUniqueId) -> [u8; UNIQUE_ID_BYTES] {
    id.internal.map(|c| c as u8)
}

fn ok() -> Outcome<ncclResult_t> {
    Ok(ffi::SUCCESS)
}

/// The current result of a create: `ncclInProgress` for a non-blocking communicator whose
/// join still runs.
fn created(c: &Arc<Comm>) -> ncclResult_t {
    if !c.blocking && c.joining() {
        ffi::IN_PROGRESS
    } else {
        ffi::SUCCESS
    }
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> ncclResult_t {
    guard("ncclGetVersion", || {
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(version, version_code(), "version") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclGetUniqueId(out: *mut ncclUniqueId) -> ncclResult_t {
    guard("ncclGetUniqueId", || {
        let u = comm::client()?.unique_id()?;
        let mut id = ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        if u.len() != UNIQUE_ID_BYTES {
            return Err(Failure {
                code: ffi::INTERNAL_ERROR,
                message: format!("the daemon's unique id has {} bytes, not 128", u.len()),
            });
        }
        for (d, s) in id.internal.iter_mut().zip(&u) {
            *d = *s as c_char;
        }
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(out, id, "uniqueId") }?;
        ok()
    })
}

#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
unsafe fn init_rank(
    out: *mut ncclComm_t,
    nranks: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    config: *const ConfigHead,
) -> Outcome<ncclResult_t> {
    if out.is_null() {
        return Err(invalid("comm is a null pointer"));
    }
    // SAFETY: the caller's contract on config.
    let b = unsafe { blocking(config) }?;
    let c = Comm::create(&uid_bytes(id), rank, nranks, comm::current_device(), b)?;
    let r = created(&c);
    // SAFETY: checked non-null above; NCCL's contract.
    unsafe { out.write(comm::handle(c)) };
    Ok(r)
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommInitRank(
    out: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    // SAFETY: NCCL's contract on the pointers.
    guard("ncclCommInitRank", || unsafe {
        init_rank(out, nranks, &id, rank, std::ptr::null())
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommInitRankConfig(
    out: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *mut ConfigHead,
) -> ncclResult_t {
    // SAFETY: NCCL's contract on the pointers.
    guard("ncclCommInitRankConfig", || unsafe {
        init_rank(out, nranks, &id, rank, config)
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommInitRankScalable(
    out: *mut ncclComm_t,
    nranks: c_int,
    rank: c_int,
    n_id: c_int,
    ids: *mut ncclUniqueId,
    config: *mut ConfigHead,
) -> ncclResult_t {
    guard("ncclCommInitRankScalable", || {
        if n_id < 1 || ids.is_null() {
            return Err(invalid(format!(
                "{n_id} unique ids at {ids:p}: at least one is needed"
            )));
        }
        // The first id names the communicator (commd's daemons need no spread of roots).
        // SAFETY: NCCL's contract: `ids` holds `n_id` ids.
        let id = unsafe { *ids };
        // SAFETY: as above.
        unsafe { init_rank(out, nranks, &id, rank, config) }
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    guard("ncclCommInitAll", || {
        if comms.is_null() {
            return Err(invalid("comms is a null pointer"));
        }
        if ndev < 1 {
            return Err(invalid(format!("ndev {ndev} must be at least 1")));
        }
        let u = comm::client()?.unique_id()?;
        let mut id = [0u8; UNIQUE_ID_BYTES];
        if u.len() == UNIQUE_ID_BYTES {
            id.copy_from_slice(&u);
        }
        let devs: Vec<i32> = (0..ndev)
            .map(|i| {
                if devlist.is_null() {
                    i
                } else {
                    // SAFETY: NCCL's contract: devlist holds ndev entries.
                    unsafe { *devlist.add(i as usize) }
                }
            })
            .collect();
        // The same device may be listed more than once (ranks sharing a GPU: a commd
        // extension), but each must exist.
        let count = comm::device_count();
        if let Some(&d) = devs
            .iter()
            .find(|&&d| d < 0 || count.is_some_and(|n| d >= n))
        {
            return Err(invalid(format!(
                "invalid device {d} in devlist ({})",
                count.map_or("CUDA not loaded".into(), |n| format!(
                    "{n} CUDA devices visible"
                ))
            )));
        }
        // Every rank joins on its own thread (a join returns once all ranks joined).
        let joins: Vec<_> = devs
            .iter()
            .enumerate()
            .map(|(r, &d)| std::thread::spawn(move || Comm::create(&id, r as i32, ndev, d, true)))
            .collect();
        let mut made = Vec::new();
        let mut first = None;
        for j in joins {
            match j.join() {
                Ok(Ok(c)) => made.push(c),
                Ok(Err(f)) => {
                    first.get_or_insert(f);
                }
                Err(_) => {
                    first.get_or_insert(Failure {
                        code: ffi::INTERNAL_ERROR,
                        message: "a join thread panicked".into(),
                    });
                }
            }
        }
        if let Some(f) = first {
            return Err(f);
        }
        for (i, c) in made.into_iter().enumerate() {
            // SAFETY: NCCL's contract: comms holds ndev entries.
            unsafe { comms.add(i).write(comm::handle(c)) };
        }
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommFinalize(c: ncclComm_t) -> ncclResult_t {
    guard("ncclCommFinalize", || {
        comm::get(c)?.finalize()?;
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommDestroy(c: ncclComm_t) -> ncclResult_t {
    guard("ncclCommDestroy", || {
        if c.is_null() {
            return ok();
        }
        let comm = comm::release(c)?;
        forget_registrations(c);
        // Outstanding ops finish first (NCCL's destroy flushes them); a failure is already
        // the communicator's async error and does not stop the destroy.
        if !comm.joining() {
            let _ = comm.finalize();
        }
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommAbort(c: ncclComm_t) -> ncclResult_t {
    guard("ncclCommAbort", || {
        if c.is_null() {
            return ok();
        }
        let comm = comm::release(c)?;
        forget_registrations(c);
        comm.abort();
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommSplit(
    c: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ConfigHead,
) -> ncclResult_t {
    guard("ncclCommSplit", || {
        if newcomm.is_null() {
            return Err(invalid("newcomm is a null pointer"));
        }
        // NCCL_COMM_NULL until a communicator is made (as NCCL: a failed split leaves none).
        // SAFETY: checked non-null; NCCL's contract.
        unsafe { newcomm.write(std::ptr::null_mut()) };
        let parent = comm::get(c)?;
        // SAFETY: NCCL's contract on config.
        let b = match unsafe { blocking(config) } {
            Ok(b) => b,
            Err(f) => return Err(f),
        };
        let b = if config.is_null() { parent.blocking } else { b };
        let color = if color == SPLIT_NOCOLOR { -1 } else { color };
        let out = parent.split(color, key, b)?;
        let r = out.as_ref().map(created).unwrap_or(ffi::SUCCESS);
        let h = out.map(comm::handle).unwrap_or(std::ptr::null_mut());
        // SAFETY: checked non-null; NCCL's contract.
        unsafe { newcomm.write(h) };
        Ok(r)
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn ncclGetErrorString(result: ncclResult_t) -> *const c_char {
    ffi::result_name(result).as_ptr()
}

/// The communicator's own failure when it has one (so a watchdog thread reading it sees why
/// the communicator failed), else the calling thread's last failure.
#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn ncclGetLastError(comm: ncclComm_t) -> *const c_char {
    if !comm.is_null()
        && let Ok(c) = comm::get(comm)
        && let Some(p) = c.last_error_ptr()
    {
        return p;
    }
    ffi::last_error_ptr()
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn ncclResetDebugInit() {}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommGetAsyncError(
    c: ncclComm_t,
    async_error: *mut ncclResult_t,
) -> ncclResult_t {
    guard("ncclCommGetAsyncError", || {
        let comm = comm::get(c)?;
        let (r, message) = comm.async_error();
        if let Some(m) = message {
            // Where torch's watchdog reads the reason (ncclGetLastError after this call).
            ffi::set_last_error(&m);
        }
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(async_error, r, "asyncError") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommCount(c: ncclComm_t, count: *mut c_int) -> ncclResult_t {
    guard("ncclCommCount", || {
        let n = comm::get(c)?.nranks as c_int;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(count, n, "count") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommCuDevice(c: ncclComm_t, device: *mut c_int) -> ncclResult_t {
    guard("ncclCommCuDevice", || {
        let d = comm::get(c)?.device.max(0);
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(device, d, "device") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommUserRank(c: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
    guard("ncclCommUserRank", || {
        let r = comm::get(c)?.rank as c_int;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(rank, r, "rank") }?;
        ok()
    })
}

/// The live registration handles, each with its communicator's handle: commd registers
/// buffers with the daemon on first use and caches them per allocation, so registering ahead
/// only checks the range and hands out a token (an address no other live handle has).
fn registrations() -> &'static std::sync::Mutex<std::collections::HashMap<usize, usize>> {
    static R: std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<usize, usize>>> =
        std::sync::OnceLock::new();
    R.get_or_init(Default::default)
}

/// Drops the registrations of a released communicator (NCCL frees them with it).
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
fn forget_registrations(c: ncclComm_t) {
    comm::lock(registrations()).retain(|&token, owner| {
        if *owner != c as usize {
            return true;
        }
        // SAFETY: made by Box::into_raw in ncclCommRegister and still live (in the set).
        drop(unsafe { Box::from_raw(token as *mut u8) });
        false
    });
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommRegister(
    c: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    handle: *mut *mut c_void,
) -> ncclResult_t {
    guard("ncclCommRegister", || {
        comm::get(c)?;
        if buff.is_null() {
            return Err(invalid("buff is NULL"));
        }
        if handle.is_null() {
            return Err(invalid("handle is a null pointer"));
        }
        let _ = size;
        // A heap address is the token: unique among live handles, and never NULL.
        let token = Box::into_raw(Box::new(0u8)) as usize;
        comm::lock(registrations()).insert(token, c as usize);
        // SAFETY: checked non-null; NCCL's contract on the out pointer.
        unsafe { handle.write(token as *mut c_void) };
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommDeregister(c: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
    guard("ncclCommDeregister", || {
        comm::get(c)?;
        if handle.is_null() {
            return ok();
        }
        let mut live = comm::lock(registrations());
        match live.get(&(handle as usize)) {
            Some(&owner) if owner == c as usize => {
                live.remove(&(handle as usize));
                // SAFETY: made by Box::into_raw in ncclCommRegister, removed from the live
                // set just now, so freed once.
                drop(unsafe { Box::from_raw(handle.cast::<u8>()) });
                ok()
            }
            Some(_) => Err(usage(format!(
                "handle {handle:p} was registered with another communicator"
            ))),
            None => Err(usage(format!(
                "handle {handle:p} is not a live registration (not returned by ncclCommRegister, or deregistered already)"
            ))),
        }
    })
}

fn cuda_failure(e: cu::CuError) -> Failure {
    Failure {
        code: ffi::UNHANDLED_CUDA_ERROR,
        message: e.to_string(),
    }
}

/// Makes the current device's primary context current when the thread has none.
fn cuda_context() -> Outcome {
    if let Err(why) = cu::driver() {
        return Err(Failure {
            code: ffi::UNHANDLED_CUDA_ERROR,
            message: format!("CUDA is not available in this process: {why}"),
        });
    }
    cu::context::ensure_context(0).map_err(cuda_failure)
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
    guard("ncclMemAlloc", || {
        if ptr.is_null() {
            return Err(invalid("ptr is a null pointer"));
        }
        cuda_context()?;
        let mut d: sys::CUdeviceptr = 0;
        // Plain device memory: commd shares it with its daemon through a CUDA IPC handle.
        // SAFETY: valid out pointer; a context is current.
        let r = unsafe { sys::cuMemAlloc_v2(&mut d, size.max(1)) };
        cu::ck(r, "cuMemAlloc").map_err(cuda_failure)?;
        // SAFETY: checked non-null above.
        unsafe { ptr.write(d as usize as *mut c_void) };
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclMemFree(ptr: *mut c_void) -> ncclResult_t {
    guard("ncclMemFree", || {
        if ptr.is_null() {
            return ok();
        }
        cuda_context()?;
        // SAFETY: NCCL's contract: memory ncclMemAlloc returned, freed once.
        let r = unsafe { sys::cuMemFree_v2(ptr as usize as sys::CUdeviceptr) };
        cu::ck(r, "cuMemFree").map_err(cuda_failure)?;
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclCommMemStats(
    c: ncclComm_t,
    stat: c_int,
    value: *mut u64,
) -> ncclResult_t {
    guard("ncclCommMemStats", || {
        let comm = comm::get(c)?;
        // ncclStatGpuMemSuspend 0, ...Suspended 1, ...Persist 2, ...Total 3 (nccl.h). The GPU
        // memory this process holds for the communicator (direct-op windows, send/recv
        // inboxes, staging; the daemon's scratch is the daemon's, in `commd status`) cannot be
        // suspended: all of it is persistent, and nothing is suspended.
        let v = match stat {
            0 | 1 => 0,
            2 | 3 => comm.gpu_memory_bytes(),
            _ => return Err(invalid(format!("unknown memory statistic {stat}"))),
        };
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(value, v, "value") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut c_int,
    scalar: *mut c_void,
    datatype: c_int,
    residence: c_int,
    c: ncclComm_t,
) -> ncclResult_t {
    guard("ncclRedOpCreatePreMulSum", || {
        let comm = comm::get(c)?;
        if op.is_null() {
            return Err(invalid("op is NULL"));
        }
        // SAFETY: NCCL's contract: a host scalar is readable for one element of the type.
        let id = unsafe {
            comm::lock(&comm.premul).create(scalar.cast::<u8>().cast_const(), datatype, residence)
        }?;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(op, id, "op") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclRedOpDestroy(op: c_int, c: ncclComm_t) -> ncclResult_t {
    guard("ncclRedOpDestroy", || {
        let comm = comm::get(c)?;
        comm::lock(&comm.premul).destroy(op)?;
        ok()
    })
}

fn run(func: &str, c: ncclComm_t, op: Op) -> ncclResult_t {
    commd_client::gpu::prof::begin();
    let r = guard(func, || {
        comm::get(c)?.run(op)?;
        ok()
    });
    prof_exit();
    r
}

/// The exit of a profiled API call (`COMMD_EAGER_PROFILE`): inside a group the op waits for
/// the group's end and counts with it.
fn prof_exit() {
    if comm::group::active() {
        commd_client::gpu::prof::pause();
    } else {
        commd_client::gpu::prof::end();
    }
}

#[allow(clippy::too_many_arguments)]
fn coll(
    kind: OpKind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    redop: c_int,
    root: c_int,
    stream: cudaStream_t,
) -> Op {
    Op {
        kind,
        dtype,
        redop,
        count: count as u64,
        peer: root,
        send: send as u64,
        recv: recv as u64,
        stream: stream as usize,
        span: None,
    }
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclAllReduce",
        c,
        coll(OpKind::AllReduce, send, recv, count, dtype, op, 0, stream),
    )
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclReduce",
        c,
        coll(OpKind::Reduce, send, recv, count, dtype, op, root, stream),
    )
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclBroadcast",
        c,
        coll(OpKind::Broadcast, send, recv, count, dtype, 0, root, stream),
    )
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclBcast",
        c,
        coll(OpKind::Broadcast, buff, buff, count, dtype, 0, root, stream),
    )
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    recvcount: usize,
    dtype: c_int,
    op: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = coll(
        OpKind::ReduceScatter,
        send,
        recv,
        recvcount,
        dtype,
        op,
        0,
        stream,
    );
    run("ncclReduceScatter", c, o)
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    sendcount: usize,
    dtype: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = coll(
        OpKind::AllGather,
        send,
        recv,
        sendcount,
        dtype,
        0,
        0,
        stream,
    );
    run("ncclAllGather", c, o)
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclAlltoAll(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclAlltoAll",
        c,
        coll(OpKind::AllToAll, send, recv, count, dtype, 0, 0, stream),
    )
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclSend(
    send: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = coll(
        OpKind::Send,
        send,
        std::ptr::null_mut(),
        count,
        dtype,
        0,
        peer,
        stream,
    );
    run("ncclSend", c, o)
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclRecv(
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = coll(
        OpKind::Recv,
        std::ptr::null(),
        recv,
        count,
        dtype,
        0,
        peer,
        stream,
    );
    run("ncclRecv", c, o)
}

/// Copies this rank's own block of a gather/scatter: on the stream for device memory, at once
/// for host memory (the group's host ops complete at its end, after this).
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
fn local_copy(dst: u64, src: u64, bytes: u64, stream: cudaStream_t) -> Outcome {
    if dst == src || bytes == 0 {
        return Ok(());
    }
    if comm::memory_of(dst) == comm::Memory::Device {
        // SAFETY: NCCL's contract: both ranges are device memory of this process, `bytes` long.
        let r =
            unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes as usize, stream as sys::CUstream) };
        return cu::ck(r, "cuMemcpyDtoDAsync").map_err(cuda_failure);
    }
    // SAFETY: NCCL's contract: both ranges are host memory of this process, `bytes` long.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, bytes as usize) };
    Ok(())
}

/// `ncclGather`/`ncclScatter` as one group of send/recv ops with the root (commd has no
/// rooted gather of its own).
#[allow(clippy::too_many_arguments)]
fn rooted(
    func: &str,
    gather: bool,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    guard(func, || {
        let comm = comm::get(c)?;
        let es = comm::elem_size(dtype)?;
        let n = comm.nranks as i32;
        if root < 0 || root >= n {
            return Err(invalid(format!(
                "root {root} is out of range for {n} ranks"
            )));
        }
        let too_large = || invalid(format!("count {count} is too large"));
        if count as u64 > commd_client::desc::MAX_COUNT {
            return Err(too_large());
        }
        let bytes = (count as u64).checked_mul(es).ok_or_else(too_large)?;
        (bytes * n as u64 <= isize::MAX as u64)
            .then_some(())
            .ok_or_else(too_large)?;
        let me = comm.rank as i32;
        // The root's own block is copied here, before any op checks its buffers.
        if me == root && count > 0 {
            let (all, own) = if gather {
                (("recvbuff", recv as u64), ("sendbuff", send as u64))
            } else {
                (("sendbuff", send as u64), ("recvbuff", recv as u64))
            };
            for (what, p) in [all, own] {
                if p == 0 {
                    return Err(invalid(format!(
                        "{what} is NULL at the root with count {count}"
                    )));
                }
            }
        }
        let p2p = |kind: OpKind, buf: u64, peer: i32| Op {
            kind,
            dtype,
            redop: 0,
            count: count as u64,
            peer,
            send: if kind == OpKind::Send { buf } else { 0 },
            recv: if kind == OpKind::Recv { buf } else { 0 },
            stream: stream as usize,
            span: None,
        };
        comm::group::start();
        let body = || -> Outcome {
            if me == root {
                for r in 0..n {
                    let block = if gather { recv as u64 } else { send as u64 } + r as u64 * bytes;
                    if r == me {
                        let (dst, src) = if gather {
                            (block, send as u64)
                        } else {
                            (recv as u64, block)
                        };
                        local_copy(dst, src, bytes, stream)?;
                    } else if gather {
                        comm.run(p2p(OpKind::Recv, block, r))?;
                    } else {
                        comm.run(p2p(OpKind::Send, block, r))?;
                    }
                }
            } else if gather {
                comm.run(p2p(OpKind::Send, send as u64, root))?;
            } else {
                comm.run(p2p(OpKind::Recv, recv as u64, root))?;
            }
            Ok(())
        };
        // The root's own block is copied with its device current too (as `Comm::run`).
        let out = comm::group::on_device(comm.device, body);
        let end = comm::group::end();
        out?;
        end
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    rooted(
        "ncclGather",
        true,
        send,
        recv,
        count,
        dtype,
        root,
        c,
        stream,
    )
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub unsafe extern "C" fn ncclScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    rooted(
        "ncclScatter",
        false,
        send,
        recv,
        count,
        dtype,
        root,
        c,
        stream,
    )
}

// The per-collective config variants (NCCL 2.29+): the config tunes NCCL's kernels (CTAs,
// algorithm choice, profiler tags), which commd does not have; the op itself is the same.
macro_rules! with_config {
    ($($name:ident => $base:ident($($arg:ident: $ty:ty),*);)*) => {
        $(
            #[allow(unsafe_code)] // the C ABI: raw pointers from C callers
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name(
                $($arg: $ty,)*
                _config: *const c_void,
            ) -> ncclResult_t {
                // SAFETY: the plain form's arguments, under its contract.
                unsafe { $base($($arg),*) }
            }
        )*
    };
}

with_config! {
    ncclAllReduceConfig => ncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, op: c_int, c: ncclComm_t, stream: cudaStream_t);
    ncclBroadcastConfig => ncclBroadcast(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, root: c_int, c: ncclComm_t, stream: cudaStream_t);
    ncclReduceConfig => ncclReduce(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, op: c_int, root: c_int, c: ncclComm_t, stream: cudaStream_t);
    ncclAllGatherConfig => ncclAllGather(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, c: ncclComm_t, stream: cudaStream_t);
    ncclReduceScatterConfig => ncclReduceScatter(send: *const c_void, recv: *mut c_void,
        count: usize, dtype: c_int, op: c_int, c: ncclComm_t, stream: cudaStream_t);
    ncclAlltoAllConfig => ncclAlltoAll(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, c: ncclComm_t, stream: cudaStream_t);
    ncclGatherConfig => ncclGather(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, root: c_int, c: ncclComm_t, stream: cudaStream_t);
    ncclScatterConfig => ncclScatter(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, root: c_int, c: ncclComm_t, stream: cudaStream_t);
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    guard("ncclGroupStart", || {
        comm::group::start();
        ok()
    })
}

#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    commd_client::gpu::prof::begin();
    let r = guard("ncclGroupEnd", comm::group::end);
    prof_exit();
    r
}

/// Entry points of NCCL's API that commd does not implement: each returns
/// `ncclInvalidUsage` with `ncclGetLastError` naming it and why. Their arguments are not read
/// (all return `ncclResult_t`, so ignoring the arguments is ABI-safe on the caller's side).
macro_rules! unsupported {
    ($($name:ident: $why:expr;)*) => {
        $(
            #[allow(unsafe_code)] // exported by name: the C ABI
            #[unsafe(no_mangle)]
            pub extern "C" fn $name() -> ncclResult_t {
                guard(stringify!($name), || Err(unsupported(stringify!($name), $why)))
            }
        )*
    };
}

const NO_SHRINK: &str = "commd communicators are not resized; create a new one over the remaining ranks (ncclGetUniqueId + ncclCommInitRank, or ncclCommSplit before a rank is lost)";
const NO_WINDOWS: &str = "commd has no symmetric memory windows or one-sided puts and signals; use collectives or ncclSend/ncclRecv";
const NO_PARAMS: &str = "NCCL's parameters tune NCCL's own transports; commd's settings are in its commd.toml and `commd config`";
const NO_DEVICE_API: &str = "commd has no NCCL device API (its collectives run in the daemon and on copy engines, not in user kernels)";

unsupported! {
    ncclCommShrink: NO_SHRINK;
    ncclCommGrow: NO_SHRINK;
    ncclCommGetUniqueId: NO_SHRINK;
    ncclCommRevoke: "use ncclCommAbort, which ends the communicator's outstanding ops";
    ncclCommSuspend: "the library holds no GPU memory to release (the daemon owns its scratch)";
    ncclCommResume: "the library holds no GPU memory to release (the daemon owns its scratch)";
    ncclCommWindowRegister: NO_WINDOWS;
    ncclCommWindowDeregister: NO_WINDOWS;
    ncclWinGetUserPtr: NO_WINDOWS;
    ncclPutSignal: NO_WINDOWS;
    ncclSignal: NO_WINDOWS;
    ncclWaitSignal: NO_WINDOWS;
    ncclDevCommCreate: NO_DEVICE_API;
    ncclDevCommDestroy: NO_DEVICE_API;
    ncclCommQueryProperties: NO_DEVICE_API;
    ncclGetLsaMultimemDevicePointer: NO_DEVICE_API;
    ncclGetMultimemDevicePointer: NO_DEVICE_API;
    ncclGetLsaDevicePointer: NO_DEVICE_API;
    ncclGetPeerDevicePointer: NO_DEVICE_API;
    ncclGroupSimulateEnd: "commd has no cost model to simulate a group with";
    ncclSetEncryption: "commd's data between nodes is protected by its own transport settings, see docs/multinode.md";
    ncclParamBind: NO_PARAMS;
    ncclParamGetI8: NO_PARAMS;
    ncclParamGetI16: NO_PARAMS;
    ncclParamGetI32: NO_PARAMS;
    ncclParamGetI64: NO_PARAMS;
    ncclParamGetU8: NO_PARAMS;
    ncclParamGetU16: NO_PARAMS;
    ncclParamGetU32: NO_PARAMS;
    ncclParamGetU64: NO_PARAMS;
}

#[cfg(test)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
mod tests {
    use super::*;

    #[test]
    fn stale_handles_and_bad_arguments_are_errors_not_crashes() {
        let bogus = 0x1000 as ncclComm_t;
        let mut n = 0;
        // SAFETY: the library must refuse the handle before using it.
        let r = unsafe { ncclCommCount(bogus, &mut n) };
        assert_eq!(r, ffi::INVALID_ARGUMENT);
        // SAFETY: as above.
        let r = unsafe { ncclCommCount(std::ptr::null_mut(), &mut n) };
        assert_eq!(r, ffi::INVALID_ARGUMENT);
        // SAFETY: null is checked.
        let r = unsafe { ncclGetVersion(std::ptr::null_mut()) };
        assert_eq!(r, ffi::INVALID_ARGUMENT);
        let mut v = 0;
        // SAFETY: valid out pointer.
        assert_eq!(unsafe { ncclGetVersion(&mut v) }, ffi::SUCCESS);
        assert!(v >= 22800);
        assert_eq!(ncclGroupEnd(), ffi::INVALID_USAGE);
        assert_eq!(ncclGroupStart(), ffi::SUCCESS);
        assert_eq!(ncclGroupEnd(), ffi::SUCCESS);
        assert_eq!(ncclCommShrink(), ffi::INVALID_USAGE);
        // SAFETY: the message pointer is this thread's live last-error string.
        let m = unsafe { std::ffi::CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) };
        assert!(
            m.to_string_lossy()
                .contains("ncclCommShrink is not supported"),
            "{m:?}"
        );
        let bad = ConfigHead {
            size: 4,
            magic: 0,
            version: 0,
            blocking: 1,
        };
        // SAFETY: a valid (if uninitialised-by-NCCL) config.
        assert!(unsafe { blocking(&bad) }.is_err());
        let good = ConfigHead {
            size: std::mem::size_of::<ConfigHead>(),
            magic: API_MAGIC,
            version: 22800,
            blocking: 0,
        };
        // SAFETY: as above.
        assert!(!unsafe { blocking(&good) }.unwrap());
    }
}
