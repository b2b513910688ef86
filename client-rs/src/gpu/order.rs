//! How the caller's stream waits for posted ops outside the op's own call: the end of a
//! send/recv group (`cuda_flush`), a wait for a given ticket, an event after an op, and the
//! refusal of a wait for eager ops inside a capture (docs/contracts.md #4 and #6).

#![allow(unsafe_code)] // stream waits through the driver

use std::sync::Arc;

use commd_proto::desc::{doorbell, graph_doorbell};

use super::cu::{self, ck, sys};
use super::{CommGpu, CudaEvent, CudaOpArgs, EventPool, driver, graph, wait};
use crate::{Communicator, Error, Result, lock};

impl Communicator {
    /// Enqueues on `stream` the wait for every deferred p2p op of this communicator (end of a
    /// send/recv group). A no-op when nothing is deferred.
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context.
    pub unsafe fn cuda_flush(&self, stream: sys::CUstream) -> Result<()> {
        let mut c = lock(&self.gpu);
        // SAFETY: the caller's contract.
        if unsafe { self.flush_captured(&mut c, stream)? } || c.deferred.is_none() {
            return Ok(());
        }
        // The deferred ops were posted outside any capture: a captured wait for them would be
        // a no-op on replay. Refused with the deferred wait kept for a later flush.
        // SAFETY: the caller's contract.
        unsafe { refuse_capture(stream, "the wait for a send/recv group")? };
        let Some((t, bytes)) = c.deferred.take() else {
            return Ok(());
        };
        let db = self.client.doorbell_dev(&mut lock(&self.client.gpu))?;
        let done = db + doorbell::DONE_OFF + 4 * u64::from(self.doorbell_slot);
        // SAFETY: `done` is a device-mapped address of the registered doorbell page.
        unsafe { wait::wait_geq(stream, done, t, bytes)? };
        Ok(())
    }

    /// Enqueues on `stream` a wait for this communicator's done counter to reach `ticket` (the
    /// `last_ticket` of a posted op): the stream then waits for that op and every op posted
    /// before it on this communicator (done counters advance contiguously). This is how a
    /// deferred send/recv is waited for on whatever stream is current at `wait()` time, with
    /// no event and no communication stream. `bytes` is the op's [`CudaPosted::bytes`].
    ///
    /// # Safety
    /// `stream` must be a live stream.
    pub unsafe fn cuda_wait_ticket(
        &self,
        stream: sys::CUstream,
        ticket: u32,
        bytes: u64,
    ) -> Result<()> {
        driver()?;
        // SAFETY: the caller's contract.
        if unsafe { self.flush_captured(&mut lock(&self.gpu), stream)? } {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { refuse_capture(stream, "the wait for a GPU op")? };
        let db = self.client.doorbell_dev(&mut lock(&self.client.gpu))?;
        let done = db + doorbell::DONE_OFF + 4 * u64::from(self.doorbell_slot);
        // SAFETY: `done` is a device-mapped address of the registered doorbell page.
        unsafe { wait::wait_geq(stream, done, ticket, bytes)? };
        // Done counters advance contiguously: deferred p2p ops up to `ticket` are waited for.
        let mut c = lock(&self.gpu);
        if c.deferred
            // Wrap-aware: the tickets' difference read as signed.
            .is_some_and(|(t, _)| ticket.wrapping_sub(t).cast_signed() >= 0)
        {
            c.deferred = None;
        }
        Ok(())
    }

    /// Records an event of the session's pool on `stream` (a stream of `device`), e.g. after
    /// [`Communicator::cuda_flush`] for deferred p2p ops.
    ///
    /// # Safety
    /// `stream` must be a live stream of `device`.
    pub unsafe fn cuda_record(&self, stream: sys::CUstream, device: i32) -> Result<CudaEvent> {
        let pool = lock(&self.client.gpu).events.clone();
        let ev = pool.get(device)?;
        // SAFETY: the caller's contract.
        unsafe { ev.record(stream)? };
        Ok(ev)
    }
}

impl Communicator {
    /// Captured send/recv ops whose waits were deferred (end of their group): when `stream` is
    /// being captured, enqueues each op's wait and done reset on it and returns true. Ops
    /// deferred in another capture (one that ended without waiting for them) are an error:
    /// that graph signals ops it never waits for, so its results would not be ordered.
    ///
    /// # Safety
    /// `stream` must be a live stream.
    unsafe fn flush_captured(&self, c: &mut CommGpu, stream: sys::CUstream) -> Result<bool> {
        if c.captured_deferred.is_empty() {
            return Ok(false);
        }
        // SAFETY: the caller's contract.
        let cap = unsafe { graph::capture_of(stream, "the wait for captured send/recv ops")? };
        let Some(cap) = cap else {
            return Err(Error::Unsupported(format!(
                "{} send/recv op(s) were captured into a CUDA graph but their wait was not: call wait() on their Work objects (or end the send/recv group) before the capture ends. Destroy that graph: its replays would not wait for those transfers",
                c.captured_deferred.len()
            )));
        };
        if let Some(other) = c.captured_deferred.iter().find(|d| d.0 != cap.id) {
            let n = c.captured_deferred.len();
            let _ = other;
            c.captured_deferred.clear();
            return Err(Error::Unsupported(format!(
                "{n} send/recv op(s) captured into another CUDA graph were never waited for in that capture; destroy that graph: its replays would not wait for those transfers"
            )));
        }
        let gdev = self.client.graph_dev(&mut lock(&self.client.gpu))?;
        let most = c.captured_deferred.iter().map(|d| d.3).max().unwrap_or(0);
        // SAFETY: the caller's contract.
        let waiter = unsafe { wait::Waiter::new(stream, most)? };
        for (_, slot, phases, _) in c.captured_deferred.drain(..) {
            let done = gdev + graph_doorbell::DONE_OFF + 4 * u64::from(slot);
            let last = commd_proto::graph::phase_value(phases.max(1) - 1);
            // SAFETY: `done` is a device-mapped address of the registered graph area.
            unsafe { waiter.enqueue(stream, done, last)? };
            ck(
                // SAFETY: as above.
                unsafe {
                    sys::cuStreamWriteValue32_v2(stream, done, commd_proto::graph::DONE_RESET, 0)
                },
                "cuStreamWriteValue32",
            )?;
        }
        Ok(true)
    }
}

/// docs/contracts.md #6: a wait for *eager* GPU ops (their tickets) enqueued on a stream that
/// is being captured is refused before anything is enqueued: the wait would bake the eager
/// ticket into the graph, so every replay after the first would pass it at once (stale data,
/// no error). Ops issued during capture are persistent ops instead (`graph`).
///
/// # Safety
/// `stream` must be a stream handle of this process (null: the legacy default stream); the
/// driver validates it and only reads it.
pub unsafe fn refuse_capture(stream: sys::CUstream, what: &str) -> Result<()> {
    use cu::context::Capture;
    // SAFETY: the caller's contract.
    let why = match unsafe { cu::context::capture_status(stream) }? {
        Capture::None => return Ok(()),
        Capture::Active => "its stream is being captured into a CUDA graph",
        Capture::Invalidated => {
            "its stream's CUDA graph capture was already invalidated by an earlier error"
        }
        Capture::ImplicitLegacy => {
            "it uses the legacy default stream while another stream is being captured into a CUDA graph"
        }
    };
    Err(Error::Unsupported(format!(
        "{what}: {why}. It waits for GPU ops issued outside the capture, whose doorbell values \
         were fixed when they were issued, so a replay would pass the wait at once and leave \
         stale data. Refused (nothing was enqueued); wait for those ops before the capture \
         begins (docs/design-gpu.md, persistent ops rule 7)"
    )))
}

/// Orders `a.stream` after the work queued on `a.after`, if that is another stream: an event of
/// the pool recorded there and waited on by `a.stream`, all on the GPU (the event goes back to
/// the pool at once: the wait keeps the record it saw).
///
/// # Safety
/// `a.stream` and `a.after` must be live streams of device `dev`.
pub(crate) unsafe fn wait_after(pool: &Arc<EventPool>, dev: i32, a: &CudaOpArgs) -> Result<()> {
    if let Some(after) = a.after
        && after != a.stream
    {
        let ev = pool.get(dev)?;
        // SAFETY: the caller's contract.
        unsafe { ev.record(after)? };
        // SAFETY: as above.
        unsafe { ev.wait_on(a.stream)? };
    }
    Ok(())
}
