//! The entry of every stream-ordered GPU op: the checks, then the path: a direct op
//! (`direct/`), or the daemon's (`daemon_path`); and the communicator's error word, raised by
//! the next call after a failed op (docs/contracts.md #5).

#![allow(unsafe_code)] // the caller's streams and device pointers

use std::time::Duration;

use commd_proto::desc::doorbell;

use super::{CudaOpArgs, CudaPosted, driver, graph, prof};
use crate::{Communicator, Error, Request, Result, lock};

impl Communicator {
    /// The communicator's doorbell error word: a failed GPU op's status, 0 while none failed.
    fn error_word(&self) -> Option<&std::sync::atomic::AtomicU32> {
        self.client
            .ring
            .doorbell(self.doorbell_slot)
            .map(|(_, _, e)| e)
    }

    /// The doorbell error word of this communicator (a failed GPU op's status), cleared on read.
    pub fn cuda_take_error(&self) -> Option<u32> {
        match self
            .error_word()?
            .swap(0, std::sync::atomic::Ordering::AcqRel)
        {
            0 => None,
            s => {
                // A later failure sets the word anew: `post_cuda_ordered` checks again.
                lock(&self.gpu).error_word_survived = false;
                Some(s)
            }
        }
    }

    /// Posts a stream-ordered GPU op (docs/contracts.md #4): the op starts once `stream` reaches
    /// it, and work enqueued on `stream` afterwards runs once it is done; the CPU never blocks.
    /// The returned [`Request`] completes (or fails) when the daemon is done; a failure also
    /// releases the stream and sets the communicator's error word.
    ///
    /// # Safety
    /// Pointers must be device memory of this process holding the op's element counts, stay
    /// allocated until the request completes, and `stream` must be a live stream of the device's
    /// context (current on this thread, or the device's primary context is made current).
    pub unsafe fn post_cuda(&self, a: CudaOpArgs) -> Result<Request> {
        // SAFETY: same contract as ours.
        unsafe { self.post_cuda_ordered(a) }.map(|p| p.request)
    }

    /// [`Communicator::post_cuda`], also ordered after `a.after` and returning the event
    /// recorded after the op when `a.record` is set: everything one op needs from the stream
    /// in one call (the per-op path of the torch backend).
    ///
    /// # Safety
    /// As [`Communicator::post_cuda`]; `a.after`, if any, must be a live stream.
    pub unsafe fn post_cuda_ordered(&self, a: CudaOpArgs) -> Result<CudaPosted> {
        // Contract 5 (docs/contracts.md): a failed GPU op releases its stream and sets the
        // communicator's error word, and the communicator's next call raises. Its completion
        // reaches this process asynchronously, so one rank may already raise (at `wait()`)
        // while another posts its next op. The daemon breaks a communicator whose eager GPU op
        // failed (every later op fails at once, naming the first error, on every rank: no rank
        // waits for a peer that stopped), and here a call made after the word was set waits for
        // that answer, so it raises the error itself rather than leaving it to a later look.
        // One load per op while nothing failed; the lock only once the word is set.
        let check = self
            .error_word()
            .is_some_and(|e| e.load(std::sync::atomic::Ordering::Acquire) != 0)
            && !lock(&self.gpu).error_word_survived;
        // SAFETY: same contract as ours.
        let p = unsafe { self.post_cuda_once(a)? };
        prof::mark(prof::DAEMON);
        if check && p.request.local.is_none() && !p.captured {
            match p.request.wait_for(Some(Duration::from_millis(500))) {
                Err(e) => return Err(e),
                // Completed: the communicator still works (the word was a failed replay's).
                Ok(true) => lock(&self.gpu).error_word_survived = true,
                Ok(false) => {}
            }
        }
        Ok(p)
    }

    /// [`Communicator::post_cuda_ordered`] without the check of an earlier failure.
    ///
    /// # Safety
    /// As [`Communicator::post_cuda_ordered`].
    unsafe fn post_cuda_once(&self, a: CudaOpArgs) -> Result<CudaPosted> {
        prof::mark(prof::CALLER);
        // One-time setup below (host registration, kernel loading, scratch) is allowed in a
        // global-mode capture from this thread while `_relaxed` lives.
        // SAFETY: the caller's contract.
        let (cap, _relaxed) = unsafe { self.admit(&a)? };
        // SAFETY: the caller's contract.
        if let Some(p) = unsafe { self.try_direct_paths(&a, cap.is_some())? } {
            return Ok(p);
        }
        // SAFETY: the caller's contract.
        unsafe { self.post_daemon(&a, cap) }
    }

    /// The checks every GPU op passes before a path is chosen: the session is this process's
    /// and the daemon's watchdog runs, a failed replay on this communicator is raised, the
    /// stream's capture is read (an op whose stream is being captured, or joins a capture
    /// through `after`, becomes a persistent op: docs/contracts.md #6), the communicator has a
    /// doorbell slot and the reduction suits the dtype.
    ///
    /// # Safety
    /// As [`Communicator::post_cuda_ordered`].
    unsafe fn admit(
        &self,
        a: &CudaOpArgs,
    ) -> Result<(Option<graph::Capture>, Option<graph::Relaxed>)> {
        let i = &self.client;
        i.check_owner()?;
        driver()?;
        i.start_watchdog();
        self.cuda_graph_check()?;
        // Before any other stream call: a query of a capturing stream would invalidate the
        // caller's capture.
        // SAFETY: the caller's contract (live streams); the driver only reads the handles.
        let cap = unsafe { graph::capture_for(a.stream, a.after, a.kind.name())? };
        let relaxed = match cap {
            Some(_) => Some(graph::Relaxed::enter()?),
            None => None,
        };
        if cap.is_some() && lock(&i.gpu).graphs.exhausted() {
            // Destroyed graphs' slots come back now rather than at the watchdog's next look.
            i.release_destroyed_graphs();
        }
        if self.doorbell_slot == doorbell::NO_SLOT {
            return Err(Error::InvalidArgument(format!(
                "communicator {} has no doorbell slot (more than {} communicators in this process): GPU ops are unavailable on it",
                self.comm_id,
                doorbell::SLOTS
            )));
        }
        if let Some(r) = a.redop {
            r.check_dtype(a.dtype)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        }
        prof::mark(prof::CHECKS);
        Ok((cap, relaxed))
    }

    /// The direct paths, where the op may take one (docs/design-gpu.md, direct collectives
    /// rules 1 and 8, send/recv rules): a captured collective on ranks with a GPU each runs as
    /// one kernel of the graph, with no daemon work per replay; an eager one too
    /// (`COMMD_EAGER_DIRECT`), its request completing from the event after its kernel; an eager
    /// send/recv (`COMMD_P2P_DIRECT`). `None`: the op takes the daemon's path. A communicator
    /// the daemon broke for good (a lost rank, an op that timed out: its `HINT_BROKEN`) runs
    /// nothing more directly: its ops take the daemon's path, which fails them at once with the
    /// first failure's reason (`post_cuda_ordered` waits for that answer), rather than a direct
    /// op that would stop with "broken" and no reason.
    ///
    /// # Safety
    /// As [`Communicator::post_cuda_ordered`].
    unsafe fn try_direct_paths(
        &self,
        a: &CudaOpArgs,
        captured: bool,
    ) -> Result<Option<CudaPosted>> {
        if self.nodes > 1 || self.is_broken() {
            return Ok(None);
        }
        if captured {
            // SAFETY: the caller's contract.
            return unsafe { self.try_direct(a, false) };
        }
        if a.kind.is_p2p() {
            // SAFETY: the caller's contract.
            unsafe { self.try_direct_p2p(a) }
        } else {
            // SAFETY: the caller's contract.
            unsafe { self.try_direct(a, true) }
        }
    }
}
