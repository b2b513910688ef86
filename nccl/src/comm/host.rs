//! The host-memory path, a commd extension NCCL does not have: when an op's buffers are host
//! memory (or the process has no CUDA), the library stages them through shared memory of the
//! session and runs the op in the daemon's host engine. Synchronous outside a group (the call
//! returns once the op is done); inside a group every op is posted first and waited for at
//! `ncclGroupEnd`, so send/recv pairs match in any order. One copy in and one out per op: this
//! path exists for hosts without GPUs (CI, CPU jobs), not for speed.
//!
//! May use: `commd_client` buffers and host ops, `ffi`.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use commd_client::desc::{DType, OpKind, RedOp};
use commd_client::{Buffer, OpArgs, Request};

use super::Ready;
use crate::ffi::{Failure, Outcome, invalid};

/// A posted host op: its request, its staging buffers, and where its result goes.
pub struct HostOp {
    req: Request,
    _send: Option<Buffer>,
    recv: Option<Buffer>,
    out: u64,
    out_len: usize,
}

fn stage(r: &Ready, bytes: u64) -> Outcome<Buffer> {
    Ok(r.client.alloc(bytes.max(1))?)
}

/// Copies the op's input into staging buffers and posts it.
///
/// # Safety
/// `send` must be readable for the op's send elements and `recv` writable for its receive
/// elements until [`HostOp::finish`] returns.
#[allow(clippy::too_many_arguments)]
pub unsafe fn start(
    r: &Ready,
    kind: OpKind,
    dtype: DType,
    redop: Option<RedOp>,
    count: u64,
    peer: i32,
    send: Option<u64>,
    recv: Option<u64>,
    premul: Option<crate::premul::Scalar>,
) -> Outcome<HostOp> {
    let n = u64::from(r.c.nranks());
    let es = dtype.size();
    // The op's bytes, for the daemon (u64) and for this process's copies (usize).
    let bytes = |elems: Option<u64>| {
        elems
            .and_then(|e| e.checked_mul(es))
            .and_then(|b| Some((b, usize::try_from(b).ok()?)))
            .ok_or_else(|| invalid(format!("count {count} overflows the buffer size")))
    };
    let send_buf = match send {
        Some(p) => {
            let (len, ulen) = bytes(kind.send_elems(count, n))?;
            let mut b = stage(r, len)?;
            // SAFETY: the caller's contract: `p` is readable for `len` bytes.
            let src = unsafe { std::slice::from_raw_parts(p as *const u8, ulen) };
            b.as_mut_slice()[..ulen].copy_from_slice(src);
            if let Some(sc) = premul {
                crate::premul::scale_host(&mut b.as_mut_slice()[..ulen], dtype, sc)?;
            }
            Some(b)
        }
        None => None,
    };
    let (out_len, out_ulen) = match recv {
        Some(_) => bytes(kind.recv_elems(count, n))?,
        None => (0, 0),
    };
    let recv_buf = match recv {
        Some(_) => Some(stage(r, out_len)?),
        None => None,
    };
    let a = OpArgs {
        kind,
        dtype,
        redop,
        count,
        peer: u32::try_from(peer).unwrap_or(0),
        send: send_buf.as_ref().map(|b| (b, 0)),
        recv: recv_buf.as_ref().map(|b| (b, 0)),
    };
    // SAFETY: the staging buffers live in the returned HostOp until its request completes
    // (`finish` waits; a dropped HostOp only loses the data).
    let req = unsafe { r.c.post_detached(a) }?;
    Ok(HostOp {
        req,
        _send: send_buf,
        recv: recv_buf,
        out: recv.unwrap_or(0),
        out_len: out_ulen,
    })
}

impl HostOp {
    /// Waits for the op and copies its result out.
    pub fn finish(self) -> Outcome {
        self.req.wait().map_err(Failure::from)?;
        if let Some(b) = &self.recv {
            let src = &b.as_slice()[..self.out_len];
            // SAFETY: `start`'s contract: `out` is writable for the op's receive bytes.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.out as *mut u8, src.len()) };
        }
        Ok(())
    }
}
