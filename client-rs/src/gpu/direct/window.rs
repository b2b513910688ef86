//! A direct window's memory: allocated zeroed on this rank's GPU and exported by IPC handle,
//! or a peer's window opened from its offer. Shared by the collectives' windows and the
//! send/recv channels.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use crate::gpu::cu::{self, ck, sys};
use commd_proto::num::usize_of;

/// A window of `bytes` on the current context's device, its first `zero` bytes zeroed, and its
/// IPC handle: (address, handle).
pub(crate) fn alloc_window(
    bytes: u64,
    zero: &[(u64, u64)],
) -> std::result::Result<(sys::CUdeviceptr, [u8; 64]), cu::CuError> {
    let mut win: sys::CUdeviceptr = 0;
    ck(
        // SAFETY: valid out pointer; the caller made the device's context current.
        unsafe { sys::cuMemAlloc_v2(&mut win, usize_of(bytes)) },
        "cuMemAlloc",
    )?;
    let fail = |e| {
        // SAFETY: allocated above; nothing uses it.
        unsafe { sys::cuMemFree_v2(win) };
        e
    };
    // A stream of its own: a memset on the legacy stream would invalidate the caller's capture.
    let s = cu::context::stream_nonblocking().map_err(fail)?;
    let r = zero
        .iter()
        .try_for_each(|&(at, len)| {
            let len = len.min(bytes.saturating_sub(at));
            // SAFETY: `[at, at + len)` lies within the `bytes` of `win`; `s` is live.
            ck(
                unsafe { sys::cuMemsetD8Async(win + at, 0, usize_of(len), s) },
                "cuMemsetD8Async",
            )
        })
        .and_then(|()| {
            ck(
                // SAFETY: as above.
                unsafe { sys::cuStreamSynchronize(s) },
                "cuStreamSynchronize",
            )
        });
    // SAFETY: `s` was created above.
    unsafe { sys::cuStreamDestroy_v2(s) };
    r.map_err(fail)?;
    let out = cu::mem::ipc_handle(win).map_err(fail)?;
    Ok((win, out))
}

/// Maps the window that a peer's offer names, in the current context (of `dev`).
pub(super) fn open_peer(dev: i32, offer: &[u8]) -> std::result::Result<sys::CUdeviceptr, String> {
    let uuid: [u8; 16] = offer[64..80]
        .try_into()
        .map_err(|_| "short offer".to_string())?;
    // The handle names a live allocation of the peer: it is in the all-gather, which the peer
    // completed after exporting it.
    open_ipc(dev, &offer[..64], uuid)
}

/// Opens IPC `handle` of an allocation on the GPU with `uuid` in the current context (of
/// `dev`): the GPU must be visible in this process and reachable from `dev`.
pub(crate) fn open_ipc(
    dev: i32,
    handle: &[u8],
    uuid: [u8; 16],
) -> std::result::Result<sys::CUdeviceptr, String> {
    let count = cu::device_count().map_err(|e| e.to_string())?;
    let peer = (0..count)
        .find(|&o| crate::gpu::device_uuid(o).is_ok_and(|u| u == uuid))
        .ok_or("its GPU is not visible in this process (CUDA_VISIBLE_DEVICES)")?;
    if !cu::context::can_access_peer(dev, peer).map_err(|e| e.to_string())? {
        return Err(format!("no peer access from GPU {dev} to GPU {peer}"));
    }
    cu::ipc_open(handle, "cuIpcOpenMemHandle").map_err(|e| e.to_string())
}
