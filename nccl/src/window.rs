//! Memory windows and one-sided ops (NCCL 2.29+): `ncclCommWindowRegister`/`Deregister`,
//! `ncclWinGetUserPtr`, `ncclPutSignal`, `ncclSignal`, `ncclWaitSignal`, on the client's
//! windows (`commd_client` `gpu::rma`: copy engines and stream memory operations on the
//! caller's stream). Argument checks as NCCL's (`sigIdx`, `ctx` and `flags` must be 0).
//!
//! A registration is collective. Inside a group it is held for the group's end (`group`), as
//! NCCL does, so one thread can register the windows of several ranks (nccl-tests `-g 2 -R 2`):
//! the handle is returned at once and usable after `ncclGroupEnd`.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use commd_cuda::sys;

use crate::comm::{self, Comm, group};
use crate::ffi::{Failure, Outcome, guard, invalid, ncclResult_t, put, usage};
use crate::{cudaStream_t, ncclComm_t, ok};

/// `ncclWindow_t`: an opaque pointer (a live key of [`windows`]).
pub type ncclWindow_t = *mut c_void;

/// `ncclWaitSignalDesc_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclWaitSignalDesc_t {
    pub opCnt: c_int,
    pub peer: c_int,
    pub sigIdx: c_int,
    pub ctx: c_int,
}

const WIN_COLL_SYMMETRIC: c_int = 0x01;
const WIN_STRICT_ORDERING: c_int = 0x02;
const WIN_GIN_ONLY: c_int = 0x04;
const WIN_CFT_COUNTED: c_int = 0x08;

/// A window handle's state: registered (the client's window id), held for its group's end, or
/// failed there.
#[derive(Clone, Debug)]
enum Win {
    Held,
    Live(u64),
    Failed(Failure),
}

struct Entry {
    comm: usize,
    /// The caller's buffer (`ncclWinGetUserPtr`).
    user: usize,
    win: Win,
}

/// The live window handles of the process.
fn windows() -> &'static Mutex<HashMap<usize, Entry>> {
    static W: OnceLock<Mutex<HashMap<usize, Entry>>> = OnceLock::new();
    W.get_or_init(Default::default)
}

/// A registration, run now or at its group's end.
struct Held {
    comm: Arc<Comm>,
    handle: usize,
    ptr: u64,
    bytes: u64,
}

impl Held {
    /// Registers the window now (on the communicator's device), recording the outcome in its
    /// handle.
    fn register(&self) -> Outcome {
        let out = register_now(&self.comm, self.ptr, self.bytes);
        let state = match &out {
            Ok(id) => Win::Live(*id),
            Err(f) => Win::Failed(f.clone()),
        };
        if let Some(e) = comm::lock(windows()).get_mut(&self.handle) {
            e.win = state;
        }
        out.map(|_| ())
    }
}

fn register_now(c: &Arc<Comm>, ptr: u64, bytes: u64) -> Outcome<u64> {
    let r = c.usable()?;
    group::on_device(c.device, || r.c.register_window(ptr, bytes)).map_err(Failure::from)
}

/// The client's window behind handle `w` of communicator `c`.
fn live(c: ncclComm_t, w: ncclWindow_t, func: &str) -> Outcome<(u64, usize)> {
    if w.is_null() {
        return Err(invalid(format!("{func}: the window is NULL")));
    }
    match comm::lock(windows()).get(&(w as usize)) {
        Some(e) if e.comm != c as usize => Err(usage(format!(
            "{func}: window {w:p} was registered with another communicator"
        ))),
        Some(Entry {
            win: Win::Live(id),
            user,
            ..
        }) => Ok((*id, *user)),
        Some(Entry { win: Win::Held, .. }) => Err(usage(format!(
            "{func}: window {w:p} is registered at the end of its group (ncclGroupEnd), which has not come yet"
        ))),
        Some(Entry {
            win: Win::Failed(f),
            ..
        }) => Err(Failure {
            code: f.code,
            message: format!("{func}: window {w:p} failed to register: {}", f.message),
        }),
        None => Err(invalid(format!(
            "{func}: {w:p} is not a live window (not returned by ncclCommWindowRegister, or deregistered already)"
        ))),
    }
}

/// Drops the window handles of a released communicator (NCCL frees them with it; the client
/// closes its mappings when the communicator goes).
pub(crate) fn forget_windows(c: ncclComm_t) {
    comm::lock(windows()).retain(|&h, e| {
        if e.comm != c as usize {
            return true;
        }
        // SAFETY: made by Box::into_raw in ncclCommWindowRegister and still live (in the map).
        drop(unsafe { Box::from_raw(h as *mut u8) });
        false
    });
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowRegister(
    c: ncclComm_t,
    buff: *mut c_void,
    size: usize,
    win: *mut ncclWindow_t,
    flags: c_int,
) -> ncclResult_t {
    guard("ncclCommWindowRegister", || {
        let comm = comm::get(c)?;
        if buff.is_null() || size == 0 {
            return Err(invalid(format!(
                "a window needs a buffer and a size (got {buff:p}, {size} bytes)"
            )));
        }
        if win.is_null() {
            return Err(invalid("win is a null pointer"));
        }
        let known = WIN_COLL_SYMMETRIC | WIN_STRICT_ORDERING | WIN_GIN_ONLY | WIN_CFT_COUNTED;
        if flags & !known != 0 {
            return Err(invalid(format!("unknown window flags {flags:#x}")));
        }
        if flags & (WIN_GIN_ONLY | WIN_CFT_COUNTED) != 0 {
            return Err(usage(
                "NCCL_WIN_GIN_ONLY and NCCL_WIN_CFT_COUNTED register for NCCL's device API, which commd does not have (its collectives run in the daemon and on copy engines)",
            ));
        }
        // Symmetric or not, ordered or not: commd's collectives take any buffer, and its
        // one-sided ops to a peer run in program order.
        let ptr = buff as u64;
        // A heap address is the handle: unique among live handles, and never NULL.
        let handle = Box::into_raw(Box::new(0u8)) as usize;
        let held = Held {
            comm: comm.clone(),
            handle,
            ptr,
            bytes: size as u64,
        };
        comm::lock(windows()).insert(
            handle,
            Entry {
                comm: c as usize,
                user: buff as usize,
                win: Win::Held,
            },
        );
        // SAFETY: checked non-null; NCCL's contract on the out pointer.
        unsafe { win.write(handle as ncclWindow_t) };
        if group::active() {
            group::register_later(comm, Box::new(move || held.register()));
            return ok();
        }
        held.register()?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommWindowDeregister(c: ncclComm_t, w: ncclWindow_t) -> ncclResult_t {
    guard("ncclCommWindowDeregister", || {
        let comm = comm::get(c)?;
        let out = match live(c, w, "ncclCommWindowDeregister") {
            Ok((id, _)) => {
                let r = comm.usable()?;
                group::on_device(comm.device, || r.c.deregister_window(id)).map_err(Failure::from)
            }
            // A registration that failed at its group's end is released all the same.
            Err(f) if f.message.contains("failed to register") => Ok(()),
            Err(f) => return Err(f),
        };
        if comm::lock(windows()).remove(&(w as usize)).is_some() {
            // SAFETY: made by Box::into_raw in ncclCommWindowRegister, removed from the live
            // map just now, so freed once.
            drop(unsafe { Box::from_raw(w.cast::<u8>()) });
        }
        out?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclWinGetUserPtr(
    c: ncclComm_t,
    w: ncclWindow_t,
    out: *mut *mut c_void,
) -> ncclResult_t {
    guard("ncclWinGetUserPtr", || {
        comm::get(c)?;
        let (_, ptr) = live(c, w, "ncclWinGetUserPtr")?;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(out, ptr as *mut c_void, "outUserPtr") }?;
        ok()
    })
}

/// NCCL's rules for the reserved arguments of the one-sided ops (ncclInvalidArgument).
fn reserved(func: &str, sig_idx: c_int, ctx: c_int, flags: c_uint) -> Outcome {
    if ctx != 0 {
        return Err(invalid(format!(
            "{func}: context {ctx} is invalid (must be 0)"
        )));
    }
    if sig_idx != 0 {
        return Err(invalid(format!(
            "{func}: signal index {sig_idx} is invalid (must be 0)"
        )));
    }
    if flags != 0 {
        return Err(invalid(format!(
            "{func}: flags {flags} is invalid (must be 0)"
        )));
    }
    Ok(())
}

fn peer_of(func: &str, peer: c_int, comm: &Comm) -> Outcome<u32> {
    u32::try_from(peer)
        .ok()
        .filter(|&p| p < comm.nranks)
        .ok_or_else(|| {
            invalid(format!(
                "{func}: peer {peer} is not a rank of this communicator of {}",
                comm.nranks
            ))
        })
}

/// A put (`data`: the source, its bytes, the window and offset) or a bare signal to `peer`,
/// after NCCL's checks of the arguments they share.
fn put_or_signal(
    func: &str,
    c: ncclComm_t,
    peer: c_int,
    (sig_idx, ctx, flags): (c_int, c_int, c_uint),
    data: Option<(*const c_void, usize, c_int, ncclWindow_t, usize)>,
    stream: cudaStream_t,
) -> ncclResult_t {
    guard(func, || {
        let comm = comm::get(c)?;
        reserved(func, sig_idx, ctx, flags)?;
        let p = peer_of(func, peer, &comm)?;
        let (src, bytes, win) = match data {
            None => (0, 0, None),
            Some((local, count, dtype, w, offset)) => {
                let bytes = (count as u64)
                    .checked_mul(comm::elem_size(dtype)?)
                    .ok_or_else(|| invalid(format!("{func}: {count} elements overflow")))?;
                if local.is_null() && bytes > 0 {
                    return Err(invalid(format!("{func}: localbuff is NULL")));
                }
                let (id, _) = live(c, w, func)?;
                (local as u64, bytes, Some((id, offset as u64)))
            }
        };
        let r = comm.usable()?;
        group::on_device(comm.device, || {
            // SAFETY: NCCL's contract: the source is device memory of this process holding
            // the elements until the stream passes the put, and the stream is live.
            unsafe { r.c.put_signal(src, bytes, p, win, stream as sys::CUstream) }
        })?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclPutSignal(
    local: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    peer_win: ncclWindow_t,
    peer_win_offset: usize,
    sig_idx: c_int,
    ctx: c_int,
    flags: c_uint,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    put_or_signal(
        "ncclPutSignal",
        c,
        peer,
        (sig_idx, ctx, flags),
        Some((local, count, dtype, peer_win, peer_win_offset)),
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclSignal(
    peer: c_int,
    sig_idx: c_int,
    ctx: c_int,
    flags: c_uint,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    put_or_signal("ncclSignal", c, peer, (sig_idx, ctx, flags), None, stream)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclWaitSignal(
    n: c_int,
    descs: *const ncclWaitSignalDesc_t,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    const F: &str = "ncclWaitSignal";
    guard(F, || {
        let comm = comm::get(c)?;
        let len = usize::try_from(n).unwrap_or(0);
        if descs.is_null() || len == 0 {
            return Err(invalid(format!(
                "{F}: invalid arguments ({n} descriptors at {descs:p})"
            )));
        }
        // SAFETY: NCCL's contract: `descs` points to `n` descriptors.
        let ds = unsafe { std::slice::from_raw_parts(descs, len) };
        let mut waits = Vec::with_capacity(len);
        for (i, d) in ds.iter().enumerate() {
            if d.opCnt <= 0 {
                return Err(invalid(format!(
                    "{F}: descriptor {i} has invalid opCnt {}",
                    d.opCnt
                )));
            }
            reserved(&format!("{F}: descriptor {i}"), d.sigIdx, d.ctx, 0)?;
            let p = peer_of(&format!("{F}: descriptor {i}"), d.peer, &comm)?;
            waits.push((p, u64::from(d.opCnt.unsigned_abs())));
        }
        let r = comm.usable()?;
        group::on_device(comm.device, || {
            // SAFETY: NCCL's contract: the stream is live.
            unsafe { r.c.wait_signals(&waits, stream as sys::CUstream) }
        })?;
        ok()
    })
}
