//! `ncclGroupStart`/`ncclGroupEnd`, per thread as in NCCL. Collectives on device memory are
//! posted when called (they never block the CPU); what must wait for the group's end is
//! gathered here: the stream waits of send/recv ops (so a group's sends and receives match in
//! any order without a stream blocking on the first), host-path ops, and communicator joins
//! started inside the group (several ranks of one communicator initialised from one thread).
//!
//! May use: `comm`, `host`, `ffi`, `commd_client` GPU flushes.

use std::cell::RefCell;
use std::sync::Arc;

use commd_client::gpu::cu::sys;

use crate::comm::{Comm, Ready};
use crate::ffi::{self, Failure, Outcome, usage};
use crate::host::HostOp;

#[derive(Default)]
struct Group {
    depth: u32,
    flush: Vec<(Arc<Ready>, usize)>,
    host: Vec<HostOp>,
    joins: Vec<Arc<Comm>>,
}

thread_local! {
    static G: RefCell<Group> = RefCell::new(Group::default());
}

/// Groups nest; only the outermost end does the work.
pub fn start() {
    G.with(|g| g.borrow_mut().depth += 1);
}

pub fn active() -> bool {
    G.with(|g| g.borrow().depth > 0)
}

/// The stream of a deferred send/recv on `r`, waited for at the group's end.
pub fn flush_later(r: Arc<Ready>, stream: usize) {
    G.with(|g| {
        let mut g = g.borrow_mut();
        if !g
            .flush
            .iter()
            .any(|(c, s)| Arc::ptr_eq(c, &r) && *s == stream)
        {
            g.flush.push((r, stream));
        }
    });
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
    let work = G.with(|g| {
        let mut g = g.borrow_mut();
        if g.depth == 0 {
            return Err(usage("ncclGroupEnd without a matching ncclGroupStart"));
        }
        g.depth -= 1;
        if g.depth > 0 {
            return Ok(None);
        }
        Ok(Some((
            std::mem::take(&mut g.flush),
            std::mem::take(&mut g.host),
            std::mem::take(&mut g.joins),
        )))
    })?;
    let Some((flush, host, joins)) = work else {
        return Ok(ffi::SUCCESS);
    };
    let mut first: Option<Failure> = None;
    for (r, stream) in flush {
        // SAFETY: the stream the group's send/recv ops were posted on (live, NCCL's contract).
        if let Err(e) = unsafe { r.c.cuda_flush(stream as sys::CUstream) } {
            first.get_or_insert(e.into());
        }
    }
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
    match first {
        Some(f) => Err(f),
        None if in_progress => Ok(ffi::IN_PROGRESS),
        None => Ok(ffi::SUCCESS),
    }
}
