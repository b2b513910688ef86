//! CUDA events of a session's pool: recorded on a stream after an op, so another stream (or
//! the host) can wait for the op with no CPU involvement.

#![allow(unsafe_code)] // events are driver objects passed to the driver

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::cu::{self, ck, sys};
use super::{ensure_context, graph};
use crate::{Result, lock};

/// Free CUDA events (created with timing disabled) per device ordinal. Events are created in
/// the device's primary context, the one torch's streams live in.
#[derive(Default)]
pub(crate) struct EventPool {
    free: Mutex<HashMap<i32, Vec<usize>>>,
}

impl EventPool {
    pub(crate) fn get(self: &Arc<Self>, device: i32) -> Result<CudaEvent> {
        let reused = lock(&self.free).get_mut(&device).and_then(|v| v.pop());
        let ev = match reused {
            Some(e) => e as sys::CUevent,
            None => cu::context::event_on(device)?,
        };
        Ok(CudaEvent {
            ev,
            device,
            pool: self.clone(),
        })
    }
}

/// A CUDA event of the session's pool: recorded on a stream after an op, so another stream can
/// wait for the op with no CPU involvement. Goes back to the pool when dropped (an event may be
/// recorded again while streams still wait on an earlier record: each wait keeps the record it
/// saw).
pub struct CudaEvent {
    ev: sys::CUevent,
    device: i32,
    pool: Arc<EventPool>,
}

// SAFETY: an event handle is a driver object usable from any thread.
unsafe impl Send for CudaEvent {}

// SAFETY: as above; the methods only pass the handle to the driver.
unsafe impl Sync for CudaEvent {}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaEvent(device {})", self.device)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        lock(&self.pool.free)
            .entry(self.device)
            .or_default()
            .push(self.ev as usize);
    }
}

impl CudaEvent {
    /// Records the event on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the event's device.
    pub unsafe fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller passes a live stream of this event's device.
        let r = unsafe { sys::cuEventRecord(self.ev, stream) };
        ck(r, "cuEventRecord")?;
        Ok(())
    }

    /// Makes `stream` wait (on the GPU) for the work recorded before the event.
    ///
    /// # Safety
    /// `stream` must be a live stream.
    pub unsafe fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        ck(
            // SAFETY: live stream (caller) and event (owned here).
            unsafe { sys::cuStreamWaitEvent(stream, self.ev, 0) },
            "cuStreamWaitEvent",
        )?;
        Ok(())
    }

    /// [`CudaEvent::done`] from any thread at any time: with the event's device's primary
    /// context made current if the thread has none, and in relaxed capture mode (a query
    /// while another thread captures in global mode would invalidate that capture).
    pub fn query(&self) -> Result<bool> {
        ensure_context(self.device)?;
        let _relaxed = graph::Relaxed::enter()?;
        self.done()
    }

    /// Whether the recorded work completed (never blocks).
    pub fn done(&self) -> Result<bool> {
        // SAFETY: the event is owned here and live.
        let r = unsafe { sys::cuEventQuery(self.ev) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        ck(r, "cuEventQuery")?;
        Ok(true)
    }
}
