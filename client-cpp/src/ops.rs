//! Collective and point-to-point ops, and requests.
//!
//! Every op takes `(buffer, byte offset)` pairs and a `request` out-pointer: NULL blocks until
//! the op completes and returns its result; non-NULL returns at once with a request to wait on.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::time::Duration;

use commd_client::OpArgs;
use commd_proto::desc::{DType, OpKind, RedOp};

use crate::error::{Outcome, ffi, invalid};
use crate::types::commd_status_t::{self, COMMD_IN_PROGRESS, COMMD_OK};
use crate::types::*;
use crate::{handle, set_out};

fn dtype(code: commd_dtype_t) -> Outcome<DType> {
    u8::try_from(code)
        .ok()
        .and_then(DType::from_code)
        .ok_or_else(|| {
            invalid(format!(
                "unknown dtype code {code} (known: COMMD_FLOAT32=1, COMMD_FLOAT64=2, COMMD_FLOAT16=3, COMMD_BFLOAT16=4, COMMD_INT8=5, COMMD_UINT8=6, COMMD_INT32=7, COMMD_INT64=8, COMMD_UINT32=9, COMMD_UINT64=10, COMMD_FLOAT8E4M3=11, COMMD_FLOAT8E5M2=12)"
            ))
        })
}

fn redop(code: commd_redop_t) -> Outcome<RedOp> {
    u8::try_from(code)
        .ok()
        .and_then(RedOp::from_code)
        .ok_or_else(|| {
            invalid(format!(
                "unknown or unsupported reduction code {code} (COMMD_SUM=1, COMMD_PROD=2, COMMD_MIN=3, COMMD_MAX=4, COMMD_AVG=5; COMMD_BAND=6, COMMD_BOR=7, COMMD_BXOR=8 need a commd that supports them)"
            ))
        })
}

/// One op as the C caller gave it.
struct Call {
    kind: OpKind,
    dtype: commd_dtype_t,
    redop: Option<commd_redop_t>,
    count: u64,
    peer: u32,
    send: (*const commd_buffer_t, u64),
    recv: (*const commd_buffer_t, u64),
}

/// Validates and posts `call` on `comm`; blocks if `request` is NULL.
///
/// # Safety
/// Every pointer is NULL or valid for its type; the caller follows the ownership rule for the
/// buffers until the op completes.
unsafe fn post(
    func: &str,
    comm: *const commd_comm_t,
    call: Call,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    ffi(func, || {
        if !request.is_null() {
            // SAFETY: non-NULL, and the caller passes a writable request pointer.
            unsafe { request.write(std::ptr::null_mut()) };
        }
        // SAFETY: the caller passes NULL or a communicator handle.
        let c = unsafe { handle(comm, "comm")? };
        let dtype = dtype(call.dtype)?;
        let redop = call.redop.map(redop).transpose()?;
        // SAFETY: the caller passes NULL or buffer handles, alive for this call.
        let (send, recv) = unsafe { (call.send.0.as_ref(), call.recv.0.as_ref()) };
        // Missing buffers are caught here with a clear message; everything else (bounds,
        // alignment, ranks) is checked by the daemon, which fails the op on every rank.
        let root_is_me = call.peer == c.comm.rank();
        let name = call.kind.name();
        // The Rust client reads a peer of u32::MAX as "any source"; the C API has no such
        // receive (nothing would name the sender), so a peer of -1 (rank - 1 on rank 0, say)
        // must be an error, not a receive from whichever rank sends first.
        let n = c.comm.nranks();
        if (call.kind.is_p2p() || call.kind.has_root()) && call.peer >= n {
            let what = if call.kind.is_p2p() { "peer" } else { "root" };
            return Err(invalid(format!(
                "{name}: {what} {} is out of range for {n} ranks",
                call.peer
            )));
        }
        if call.kind.uses_send(root_is_me) && send.is_none() {
            return Err(invalid(format!(
                "{name} needs a send buffer here, got NULL"
            )));
        }
        if call.kind.uses_recv(root_is_me) && recv.is_none() {
            return Err(invalid(format!(
                "{name} needs a recv buffer here, got NULL"
            )));
        }
        let args = OpArgs {
            kind: call.kind,
            dtype,
            redop,
            count: call.count,
            peer: call.peer,
            send: send.map(|b| (&b.buf, call.send.1)),
            recv: recv.map(|b| (&b.buf, call.recv.1)),
        };
        if request.is_null() {
            c.comm.post(args)?.wait()?;
        } else {
            // SAFETY: the caller keeps to the ownership rule (commd.h) until the request
            // completes; buffer lifetime is not a memory-safety concern (the daemon holds
            // its own mapping).
            let req = unsafe { c.comm.post_detached(args)? };
            let r = Box::into_raw(Box::new(commd_request_t {
                req,
                kind: call.kind,
            }));
            // SAFETY: `request` is non-NULL and writable (above).
            unsafe { set_out(request, r, "request")? };
        }
        Ok(COMMD_OK)
    })
}

/// All-reduce of `count` elements: every rank's recv gets the reduction of all ranks' send.
/// In place: send and recv at the same (buffer, offset).
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers; see the ownership rule in the header.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_all_reduce(
    comm: *const commd_comm_t,
    send: *const commd_buffer_t,
    send_offset: u64,
    recv: *const commd_buffer_t,
    recv_offset: u64,
    count: u64,
    dtype: commd_dtype_t,
    op: commd_redop_t,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::AllReduce,
        dtype,
        redop: Some(op),
        count,
        peer: 0,
        send: (send, send_offset),
        recv: (recv, recv_offset),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_all_reduce", comm, call, request) }
}

/// Reduce of `count` elements to `root`: root's recv gets the reduction of all ranks' send.
/// recv may be NULL on the other ranks.
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers; see the ownership rule in the header.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_reduce(
    comm: *const commd_comm_t,
    send: *const commd_buffer_t,
    send_offset: u64,
    recv: *const commd_buffer_t,
    recv_offset: u64,
    count: u64,
    dtype: commd_dtype_t,
    op: commd_redop_t,
    root: u32,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::Reduce,
        dtype,
        redop: Some(op),
        count,
        peer: root,
        send: (send, send_offset),
        recv: (recv, recv_offset),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_reduce", comm, call, request) }
}

/// Reduce-scatter: send holds `recv_count * nranks` elements; rank r's recv gets the reduction
/// of block r (`recv_count` elements) over all ranks. In place: recv at
/// `send_offset + rank * recv_count * element size` of the send buffer.
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers; see the ownership rule in the header.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_reduce_scatter(
    comm: *const commd_comm_t,
    send: *const commd_buffer_t,
    send_offset: u64,
    recv: *const commd_buffer_t,
    recv_offset: u64,
    recv_count: u64,
    dtype: commd_dtype_t,
    op: commd_redop_t,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::ReduceScatter,
        dtype,
        redop: Some(op),
        count: recv_count,
        peer: 0,
        send: (send, send_offset),
        recv: (recv, recv_offset),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_reduce_scatter", comm, call, request) }
}

/// All-gather: every rank sends `send_count` elements; recv gets `send_count * nranks`
/// elements, rank r's block at position r. In place: send at
/// `recv_offset + rank * send_count * element size` of the recv buffer.
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers; see the ownership rule in the header.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_all_gather(
    comm: *const commd_comm_t,
    send: *const commd_buffer_t,
    send_offset: u64,
    recv: *const commd_buffer_t,
    recv_offset: u64,
    send_count: u64,
    dtype: commd_dtype_t,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::AllGather,
        dtype,
        redop: None,
        count: send_count,
        peer: 0,
        send: (send, send_offset),
        recv: (recv, recv_offset),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_all_gather", comm, call, request) }
}

/// Broadcast of `count` elements from `root`'s send to every rank's recv. send may be NULL on
/// the other ranks; in place on root: send and recv at the same (buffer, offset).
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers; see the ownership rule in the header.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_broadcast(
    comm: *const commd_comm_t,
    send: *const commd_buffer_t,
    send_offset: u64,
    recv: *const commd_buffer_t,
    recv_offset: u64,
    count: u64,
    dtype: commd_dtype_t,
    root: u32,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::Broadcast,
        dtype,
        redop: None,
        count,
        peer: root,
        send: (send, send_offset),
        recv: (recv, recv_offset),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_broadcast", comm, call, request) }
}

/// All-to-all: send and recv hold `count_per_peer * nranks` elements; block p of rank r's send
/// goes to block r of rank p's recv.
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers; see the ownership rule in the header.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_all_to_all(
    comm: *const commd_comm_t,
    send: *const commd_buffer_t,
    send_offset: u64,
    recv: *const commd_buffer_t,
    recv_offset: u64,
    count_per_peer: u64,
    dtype: commd_dtype_t,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::AllToAll,
        dtype,
        redop: None,
        count: count_per_peer,
        peer: 0,
        send: (send, send_offset),
        recv: (recv, recv_offset),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_all_to_all", comm, call, request) }
}

/// Sends `count` elements to rank `peer`, which posts a matching commd_recv. Consecutive
/// sends/recvs of a rank match their peers' in per-pair order, so exchanges cannot deadlock;
/// post both sides with request pointers (or from one thread each) to overlap them.
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers; see the ownership rule in the header.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_send(
    comm: *const commd_comm_t,
    buffer: *const commd_buffer_t,
    offset: u64,
    count: u64,
    dtype: commd_dtype_t,
    peer: u32,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::Send,
        dtype,
        redop: None,
        count,
        peer,
        send: (buffer, offset),
        recv: (std::ptr::null(), 0),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_send", comm, call, request) }
}

/// Receives `count` elements from rank `peer` (see commd_send).
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers; see the ownership rule in the header.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_recv(
    comm: *const commd_comm_t,
    buffer: *const commd_buffer_t,
    offset: u64,
    count: u64,
    dtype: commd_dtype_t,
    peer: u32,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::Recv,
        dtype,
        redop: None,
        count,
        peer,
        send: (std::ptr::null(), 0),
        recv: (buffer, offset),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_recv", comm, call, request) }
}

/// Barrier: completes when every rank has posted it.
///
/// # Safety
/// Pointers are NULL or valid handles/out-pointers.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_barrier(
    comm: *const commd_comm_t,
    request: *mut *mut commd_request_t,
) -> commd_status_t {
    let call = Call {
        kind: OpKind::Barrier,
        dtype: COMMD_UINT8,
        redop: None,
        count: 0,
        peer: 0,
        send: (std::ptr::null(), 0),
        recv: (std::ptr::null(), 0),
    };
    // SAFETY: the caller's guarantees are this function's.
    unsafe { post("commd_barrier", comm, call, request) }
}

/// Runs a wait on `request`; the error message names the op.
///
/// # Safety
/// `request` is NULL or a request handle.
unsafe fn wait_on(
    func: &str,
    request: *const commd_request_t,
    limit: Option<Duration>,
) -> commd_status_t {
    ffi(func, || {
        // SAFETY: the caller passes NULL or a request handle.
        let r = unsafe { handle(request, "request")? };
        match r.req.wait_for(limit) {
            Ok(true) => Ok(COMMD_OK),
            Ok(false) => Ok(COMMD_IN_PROGRESS),
            Err(e) => {
                let mut f = crate::error::Failure::from(e);
                f.message = format!("{} failed: {}", r.kind.name(), f.message);
                Err(f)
            }
        }
    })
}

/// Blocks until the request's op completes; returns its result (the same on every later call).
///
/// # Safety
/// `request` is NULL or a request handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_request_wait(request: *mut commd_request_t) -> commd_status_t {
    // SAFETY: the caller's guarantees are this function's.
    unsafe { wait_on("commd_request_wait", request, None) }
}

/// Waits at most `timeout_ms` milliseconds: COMMD_OK if the op completed, COMMD_IN_PROGRESS if
/// it is still running, or the op's error.
///
/// # Safety
/// `request` is NULL or a request handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_request_wait_timeout(
    request: *mut commd_request_t,
    timeout_ms: u64,
) -> commd_status_t {
    let limit = Some(Duration::from_millis(timeout_ms));
    // SAFETY: the caller's guarantees are this function's.
    unsafe { wait_on("commd_request_wait_timeout", request, limit) }
}

/// Checks without blocking: COMMD_OK if the op completed, COMMD_IN_PROGRESS if not, or the
/// op's error.
///
/// # Safety
/// `request` is NULL or a request handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_request_test(request: *mut commd_request_t) -> commd_status_t {
    // SAFETY: the caller's guarantees are this function's.
    unsafe { wait_on("commd_request_test", request, Some(Duration::ZERO)) }
}

/// Frees a request (NULL is ignored), waited or not: an unwaited op still runs to completion
/// and its result is discarded. The ownership rule still applies to its buffers until the op
/// completes, which can no longer be observed: free only completed requests unless the buffers
/// are not touched again.
///
/// # Safety
/// `request` is NULL or a request handle, not used after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_request_free(request: *mut commd_request_t) {
    crate::error::ffi_void("commd_request_free", || {
        if !request.is_null() {
            // SAFETY: a handle from an op (Box::into_raw), freed once.
            drop(unsafe { Box::from_raw(request) });
        }
    })
}
