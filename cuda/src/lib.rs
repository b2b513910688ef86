//! commd's CUDA layer, below the daemon and every client: the one place that talks to the
//! CUDA driver.
//!
//! - the driver itself (this module's root: [`driver`], [`ck`], [`CuError`], device queries,
//!   IPC open), loaded at run time through cudarc's `dynamic-loading`; cudarc panics when
//!   libcuda is missing, so every user calls [`driver`] first, which checks
//!   `is_culib_present()` once;
//! - [`context`]: devices, primary contexts, events, streams and capture status: the small safe
//!   helpers for raw calls that the daemon, the client and the NCCL library all make;
//! - [`mem`]: device-pointer attributes, cuMem (VMM) export of an allocation's pieces, host
//!   memory mapped for the GPU;
//! - [`kernels`]: the reduction, direct-collective and send/recv kernel sources, generated here
//!   and compiled by NVRTC per GPU architecture;
//! - [`piece`]: how a segment is split among ranks, the one rule the daemon's copies and the
//!   client's kernels share.
//!
//! This crate holds no policy of its own (no sessions, no daemon protocol): it wraps calls and
//! generates kernels. It depends only on `commd-proto` (dtypes, reductions, status words).

#![deny(unsafe_code)]

pub mod context;
mod driver;
pub mod kernels;
pub mod mem;

pub use driver::{
    CuError, ck, ck_with, describe, device_attr, device_count, device_uuid, driver, ipc_open,
    primary_ctx, set_current, sys, uuid_string,
};

/// Piece `r` of `n` of the segment `[s0, s0 + len)` in elements, as `(start, len)`: the first
/// `len % n` pieces are one element longer. The daemon's copies and the client's kernels split
/// segments by this one rule.
pub fn piece(s0: u64, len: u64, n: u64, r: u64) -> (u64, u64) {
    let base = len / n;
    let rem = len % n;
    (s0 + r * base + r.min(rem), base + u64::from(r < rem))
}
