//! `ncclGroupStart`/`ncclGroupEnd`, per thread as in NCCL. Collectives on device memory are
//! posted when called (they never block the CPU); what must wait for the group's end is
//! gathered here: the stream waits of send/recv ops (so a group's sends and receives match in
//! any order without a stream blocking on the first), host-path ops, communicator joins
//! started inside the group (several ranks of one communicator initialised from one thread),
//! and window registrations (collective, like the joins).
//!
//! May use: `comm`, `host`, `ffi`, `commd_client` GPU flushes.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::cell::RefCell;
use std::sync::Arc;

use commd_cuda::{self as cu, sys};

use super::host::HostOp;
use super::{Comm, Op, Ready};
use crate::ffi::{self, Failure, Outcome, usage};

#[derive(Default)]
struct Group {
    depth: u32,
    /// (communicator, stream, its device): the device's context is made current for the wait.
    flush: Vec<(Arc<Ready>, usize, i32)>,
    host: Vec<HostOp>,
    joins: Vec<Arc<Comm>>,
    /// Send/recv ops on device memory held for the group's end (with COMMD_P2P_DIRECT: a
    /// direct receive's kernel waits for its send, so every send of the group is launched
    /// before any receive), and whether the end is posting them now.
    p2p: Vec<(Arc<Comm>, Op)>,
    posting: bool,
    /// Communicators that were given a `launchCompletionEvent` in this group (one each).
    launch_events: Vec<usize>,
    /// Window registrations held for the group's end (collective: one thread may register
    /// the windows of several ranks), in call order.
    windows: Vec<(Arc<Comm>, Deferred)>,
}

/// A call held for the group's end (a window registration), run once.
pub type Deferred = Box<dyn FnOnce() -> Outcome + Send>;

thread_local! {
    static G: RefCell<Group> = RefCell::new(Group::default());
}

/// Inside a group, claims `c`'s one `launchCompletionEvent` of the group (NCCL's rule: at most
/// one per communicator in a group, counted by calls). Outside a group, nothing to check.
pub fn claim_launch_event(c: &Arc<Comm>, func: &str) -> Outcome {
    G.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Ok(());
        }
        let id = Arc::as_ptr(c) as usize;
        if g.launch_events.contains(&id) {
            return Err(usage(format!(
                "{func}: only one launch-completion event may be provided in one NCCL group \
                 (per communicator); this group already has one"
            )));
        }
        g.launch_events.push(id);
        Ok(())
    })
}

/// Groups nest; only the outermost end does the work.
pub fn start() {
    G.with(|g| g.borrow_mut().depth += 1);
}

pub fn active() -> bool {
    G.with(|g| g.borrow().depth > 0)
}

/// Whether a send/recv on device memory should wait for the group's end (`defer_p2p`): in a
/// group, with direct send/recv on (`COMMD_P2P_DIRECT`), unless the end is posting them.
pub fn holds_p2p() -> bool {
    G.with(|g| {
        let g = g.borrow();
        g.depth > 0 && !g.posting
    }) && commd_client::gpu::P2pConfig::cached().is_ok_and(|c| c.enabled)
}

/// Holds a send/recv for the group's end.
pub fn defer_p2p(c: Arc<Comm>, op: Op) {
    G.with(|g| g.borrow_mut().p2p.push((c, op)));
}

/// The stream of a deferred send/recv on `r` (a communicator of `device`), waited for at the
/// group's end.
pub fn flush_later(r: Arc<Ready>, stream: usize, device: i32) {
    G.with(|g| {
        let mut g = g.borrow_mut();
        if !g
            .flush
            .iter()
            .any(|(c, s, _)| Arc::ptr_eq(c, &r) && *s == stream)
        {
            g.flush.push((r, stream, device));
        }
    });
}

/// Runs `f` with the primary context of `device` current (a group may span the devices of a
/// process, one communicator each, and ends with the last one current), then restores the
/// thread's context.
pub fn on_device<T>(device: i32, f: impl FnOnce() -> T) -> T {
    if device < 0 {
        return f();
    }
    let mut prev: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out pointer; the driver is loaded (the group posted GPU ops).
    unsafe { sys::cuCtxGetCurrent(&mut prev) };
    let mut cur: sys::CUdevice = -1;
    // SAFETY: valid out pointer; fails (leaving -1) when no context is current.
    let r = unsafe { sys::cuCtxGetDevice(&mut cur) };
    if !prev.is_null() && r == sys::CUresult::CUDA_SUCCESS && cur == device {
        // Already on that device (whatever its context, the caller's streams belong to it).
        return f();
    }
    let switched = cu::context::device(device)
        .and_then(cu::primary_ctx)
        .ok()
        .filter(|c| *c != prev)
        .is_some_and(|c| cu::set_current(c).is_ok());
    let out = f();
    if switched {
        let _ = cu::set_current(prev);
    }
    out
}

/// Holds a window registration of `c` for the group's end.
pub fn register_later(c: Arc<Comm>, f: Deferred) {
    G.with(|g| g.borrow_mut().windows.push((c, f)));
}

/// Runs the window registrations held for a group's end: each communicator's in call order,
/// the communicators' on threads of their own (each registration waits for every rank of its
/// communicator, and one thread may hold several ranks' registrations). The first failure.
fn register_windows(held: Vec<(Arc<Comm>, Deferred)>) -> Option<Failure> {
    let mut by_comm: Vec<(Arc<Comm>, Vec<Deferred>)> = Vec::new();
    for (c, f) in held {
        match by_comm.iter_mut().find(|(x, _)| Arc::ptr_eq(x, &c)) {
            Some((_, v)) => v.push(f),
            None => by_comm.push((c, vec![f])),
        }
    }
    let run = |v: Vec<Deferred>| -> Option<Failure> {
        let mut first = None;
        for f in v {
            if let Err(e) = f() {
                first.get_or_insert(e);
            }
        }
        first
    };
    if by_comm.len() == 1 {
        return by_comm.pop().and_then(|(_, v)| run(v));
    }
    std::thread::scope(|s| {
        let ts: Vec<_> = by_comm
            .into_iter()
            .map(|(_, v)| s.spawn(move || run(v)))
            .collect();
        ts.into_iter()
            .filter_map(|t| {
                t.join()
                    .unwrap_or_else(|_| Some(usage("a window registration panicked")))
            })
            .next()
    })
}

pub fn finish_later(h: HostOp) {
    G.with(|g| g.borrow_mut().host.push(h));
}

/// A join that runs on its own thread: the outermost group end waits for it when the
/// communicator is blocking (outside a group nothing is recorded).
pub fn joined_later(c: Arc<Comm>) {
    G.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth > 0 {
            g.joins.push(c);
        }
    });
}

/// `ncclGroupEnd`: the first failure among the group's deferred work, else success (or
/// `ncclInProgress` while a non-blocking communicator of the group is still joining).
pub fn end() -> Outcome<ffi::ncclResult_t> {
    // The outermost end first posts the send/recv ops held for it, every send before any
    // receive, while the group is still open (their stream waits are deferred as usual).
    let held = G.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 1 {
            g.posting = true;
            std::mem::take(&mut g.p2p)
        } else {
            Vec::new()
        }
    });
    let mut held_failed: Option<Failure> = None;
    // Every pair of the held ops gets its channel before any op is posted (the setup is an
    // exchange with each peer: posted one op at a time, a ring's pairs would wait on each
    // other).
    let mut pairs: Vec<(Arc<Comm>, Vec<u32>)> = Vec::new();
    for (c, op) in &held {
        let peer = u32::try_from(op.peer).unwrap_or(0);
        match pairs.iter_mut().find(|(x, _)| Arc::ptr_eq(x, c)) {
            Some((_, peers)) if !peers.contains(&peer) => peers.push(peer),
            Some(_) => {}
            None => pairs.push((c.clone(), vec![peer])),
        }
    }
    for (c, peers) in &pairs {
        c.prepare_p2p(peers);
    }
    let (sends, recvs): (Vec<_>, Vec<_>) = held
        .into_iter()
        .partition(|(_, op)| op.kind == commd_client::desc::OpKind::Send);
    let ordered: Vec<(Arc<Comm>, Op)> = sends.into_iter().chain(recvs).collect();
    // Each communicator's ops that can be direct go as one kernel (`Comm::post_p2p_group`);
    // the rest one at a time, every send before any receive.
    let mut posted = vec![false; ordered.len()];
    for (c, _) in &pairs {
        let mine: Vec<usize> = (0..ordered.len())
            .filter(|&i| Arc::ptr_eq(&ordered[i].0, c))
            .collect();
        let ops: Vec<Op> = mine.iter().map(|&i| ordered[i].1).collect();
        for (i, done) in mine.into_iter().zip(c.post_p2p_group(&ops)) {
            posted[i] = done;
        }
    }
    // The rest: those that run as direct ops first, then those of the daemon's path (each pass
    // sends first). Every rank then issues each direction's messages of the group in the same order
    // across the two paths, whether or not it ran some as one kernel (the signatures' daemon-path
    // counts and the daemon marks rely on it: docs/design-gpu.md, send/recv rule 3).
    let left: Vec<(Arc<Comm>, Op)> = ordered
        .into_iter()
        .zip(posted)
        .filter(|(_, done)| !done)
        .map(|(x, _)| x)
        .collect();
    let (direct, daemon): (Vec<_>, Vec<_>) = left
        .into_iter()
        .partition(|(c, op)| c.p2p_direct_eligible(op));
    for (c, op) in direct.into_iter().chain(daemon) {
        if let Err(f) = c.run(op) {
            held_failed.get_or_insert(f);
        }
    }
    G.with(|g| g.borrow_mut().posting = false);
    let work = G.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(usage("ncclGroupEnd without a matching ncclGroupStart"));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok(None);
        }
        g.launch_events.clear();
        Ok(Some((
            std::mem::take(&mut g.flush),
            std::mem::take(&mut g.host),
            std::mem::take(&mut g.joins),
            std::mem::take(&mut g.windows),
        )))
    })?;
    let Some((flush, host, joins, windows)) = work else {
        return Ok(ffi::SUCCESS);
    };
    // A call of the group that failed returned its error then; the end does not repeat it
    // (NCCL's does): torch's group guard checks ncclGroupEnd in its destructor, which would
    // throw while that call's exception unwinds, and the process would abort instead of
    // raising it.
    let mut first: Option<Failure> = held_failed;
    for (r, stream, device) in flush {
        crate::log::info(crate::log::P2P, device, || {
            format!("group end: stream {stream:#x} waits for the group's send/recv ops")
        });
        // SAFETY: the stream the group's send/recv ops were posted on (live, NCCL's contract),
        // with its device's context current.
        let res = on_device(device, || unsafe {
            r.c.cuda_flush(stream as sys::CUstream)
        });
        if let Err(e) = res {
            first.get_or_insert(e.into());
        }
    }
    commd_client::gpu::prof::mark(commd_client::gpu::prof::FLUSHED);
    for h in host {
        if let Err(f) = h.finish() {
            first.get_or_insert(f);
        }
    }
    let mut in_progress = false;
    for c in joins {
        if c.blocking {
            if let Err(f) = c.ready() {
                first.get_or_insert(f);
            }
        } else if c.joining() {
            in_progress = true;
        }
    }
    // After the joins: a window may be registered in the group that made its communicator.
    if !windows.is_empty()
        && let Some(f) = register_windows(windows)
    {
        first.get_or_insert(f);
    }
    match first {
        Some(f) => Err(f),
        None if in_progress => Ok(ffi::IN_PROGRESS),
        None => Ok(ffi::SUCCESS),
    }
}
