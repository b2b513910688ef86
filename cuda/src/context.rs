//! Devices, primary contexts, events, streams and a stream's capture status: safe helpers for
//! the raw driver calls that the daemon, the client and the NCCL library each need.
//!
//! Every function expects [`crate::driver`] to have succeeded in this process; the driver
//! validates the handles passed to it (an invalid one is an error, not undefined behaviour).

#![allow(unsafe_code)] // thin wrappers over driver calls

use crate::{CuError, ck, sys};

/// The driver's device handle of ordinal `ordinal`.
pub fn device(ordinal: i32) -> Result<sys::CUdevice, CuError> {
    let mut dev = 0;
    // SAFETY: `dev` is a valid out pointer; the driver checks the ordinal.
    let r = unsafe { sys::cuDeviceGet(&mut dev, ordinal) };
    ck(r, "cuDeviceGet")?;
    Ok(dev)
}

/// The UUID of device ordinal `ordinal` (ordinals differ between processes, UUIDs do not).
pub fn ordinal_uuid(ordinal: i32) -> Result<[u8; 16], CuError> {
    crate::device_uuid(device(ordinal)?)
}

/// Whether device `dev` can map memory of device `peer` (true for the same device).
pub fn can_access_peer(dev: i32, peer: i32) -> Result<bool, CuError> {
    let (d, p) = (device(dev)?, device(peer)?);
    if d == p {
        return Ok(true);
    }
    let mut can = 0;
    // SAFETY: `can` is a valid out pointer; both devices came from `cuDeviceGet`.
    let r = unsafe { sys::cuDeviceCanAccessPeer(&mut can, d, p) };
    ck(r, "cuDeviceCanAccessPeer")?;
    Ok(can != 0)
}

/// Makes the primary context of device ordinal `ordinal` current if the calling thread has no
/// context (a thread of the caller's may already have the one it wants).
pub fn ensure_context(ordinal: i32) -> Result<(), CuError> {
    let mut cur = std::ptr::null_mut();
    // SAFETY: `cur` is a valid out pointer.
    ck(unsafe { sys::cuCtxGetCurrent(&mut cur) }, "cuCtxGetCurrent")?;
    if cur.is_null() {
        crate::set_current(crate::primary_ctx(device(ordinal)?)?)?;
    }
    Ok(())
}

/// Runs `f` with the primary context of device ordinal `ordinal` pushed on the calling thread,
/// popping it again after (the thread's own context, if any, is current again). The retain of
/// the primary context is kept: objects created in it must outlive `f`.
pub fn with_primary_ctx<T>(
    ordinal: i32,
    f: impl FnOnce() -> Result<T, CuError>,
) -> Result<T, CuError> {
    let ctx = crate::primary_ctx(device(ordinal)?)?;
    // SAFETY: `ctx` is a retained primary context; it is popped below whatever `f` returns.
    ck(unsafe { sys::cuCtxPushCurrent_v2(ctx) }, "cuCtxPushCurrent")?;
    let r = f();
    let mut prev = std::ptr::null_mut();
    // SAFETY: pops the context pushed above; `prev` is a valid out pointer.
    unsafe { sys::cuCtxPopCurrent_v2(&mut prev) };
    r
}

/// A new event with timing disabled (the kind every stream-ordering wait uses) in the current
/// context.
pub fn event() -> Result<sys::CUevent, CuError> {
    let mut e = std::ptr::null_mut();
    ck(
        // SAFETY: `e` is a valid out pointer.
        unsafe { sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) },
        "cuEventCreate",
    )?;
    Ok(e)
}

/// A new event with timing disabled in the primary context of device ordinal `ordinal`, the
/// context torch's streams live in.
pub fn event_on(ordinal: i32) -> Result<sys::CUevent, CuError> {
    with_primary_ctx(ordinal, event)
}

/// A new non-blocking stream (no implicit order with the legacy default stream) in the current
/// context.
pub fn stream_nonblocking() -> Result<sys::CUstream, CuError> {
    let mut s = std::ptr::null_mut();
    ck(
        // SAFETY: `s` is a valid out pointer.
        unsafe { sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32) },
        "cuStreamCreate",
    )?;
    Ok(s)
}

/// What a stream's capture status says about enqueuing work on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture {
    /// Not being captured: work runs eagerly.
    None,
    /// Being captured into a CUDA graph.
    Active,
    /// Its capture was already invalidated by an earlier error.
    Invalidated,
    /// The legacy default stream while another stream is being captured (any use of it would
    /// invalidate that capture).
    ImplicitLegacy,
}

/// The capture status of `stream` (null: the legacy default stream).
///
/// # Safety
/// `stream` must be null or a live stream handle of this process; the driver only reads it.
pub unsafe fn capture_status(stream: sys::CUstream) -> Result<Capture, CuError> {
    use sys::CUstreamCaptureStatus as S;
    let mut st = S::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: the caller's contract for `stream`; `st` is a valid out pointer.
    let r = unsafe { sys::cuStreamIsCapturing(stream, &mut st) };
    match (r, st) {
        (sys::CUresult::CUDA_SUCCESS, S::CU_STREAM_CAPTURE_STATUS_NONE) => Ok(Capture::None),
        (sys::CUresult::CUDA_SUCCESS, S::CU_STREAM_CAPTURE_STATUS_ACTIVE) => Ok(Capture::Active),
        (sys::CUresult::CUDA_SUCCESS, _) => Ok(Capture::Invalidated),
        (sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, _) => Ok(Capture::ImplicitLegacy),
        (r, _) => ck(r, "cuStreamIsCapturing").map(|()| Capture::None),
    }
}
