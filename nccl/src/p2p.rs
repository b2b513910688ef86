//! Point-to-point: `ncclSend`/`ncclRecv`, and `ncclGather`/`ncclScatter` (with their config
//! variants) as groups of sends and receives with the root, since commd has no rooted gather
//! of its own.

#![allow(unsafe_code)] // the C ABI and the CUDA driver: raw pointers from C callers

use std::ffi::{c_int, c_void};

use commd_client::desc::OpKind;
use commd_cuda::{self as cu, sys};

use crate::collective::{coll, run, with_config};
use crate::comm::{self, Op};
use crate::ffi::{Outcome, guard, invalid, ncclResult_t};
use crate::memory::cuda_failure;
use crate::{cudaStream_t, ncclComm_t};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclSend(
    send: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = coll(
        OpKind::Send,
        send,
        std::ptr::null_mut(),
        count,
        dtype,
        0,
        peer,
        stream,
    );
    run("ncclSend", c, o)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRecv(
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = coll(
        OpKind::Recv,
        std::ptr::null(),
        recv,
        count,
        dtype,
        0,
        peer,
        stream,
    );
    run("ncclRecv", c, o)
}

/// Copies this rank's own block of a gather/scatter: on the stream for device memory, at once
/// for host memory (the group's host ops complete at its end, after this).
fn local_copy(dst: u64, src: u64, bytes: u64, stream: cudaStream_t) -> Outcome {
    if dst == src || bytes == 0 {
        return Ok(());
    }
    let len = usize::try_from(bytes)
        .map_err(|_| invalid(format!("a block of {bytes} bytes is too large")))?;
    if comm::memory_of(dst) == comm::Memory::Device {
        // SAFETY: NCCL's contract: both ranges are device memory of this process, `bytes` long.
        let r = unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, len, stream as sys::CUstream) };
        return cu::ck(r, "cuMemcpyDtoDAsync").map_err(cuda_failure);
    }
    // SAFETY: NCCL's contract: both ranges are host memory of this process, `bytes` long.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
    Ok(())
}

/// `ncclGather`/`ncclScatter` as one group of send/recv ops with the root (commd has no
/// rooted gather of its own).
#[allow(clippy::too_many_arguments)]
fn rooted(
    func: &str,
    gather: bool,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    guard(func, || {
        let comm = comm::get(c)?;
        let es = comm::elem_size(dtype)?;
        let n = comm.c_nranks()?;
        if root < 0 || root >= n {
            return Err(invalid(format!(
                "root {root} is out of range for {n} ranks"
            )));
        }
        let too_large = || invalid(format!("count {count} is too large"));
        if count as u64 > commd_client::desc::MAX_COUNT {
            return Err(too_large());
        }
        let bytes = (count as u64).checked_mul(es).ok_or_else(too_large)?;
        (bytes * u64::from(comm.nranks) <= isize::MAX as u64)
            .then_some(())
            .ok_or_else(too_large)?;
        let me = comm.c_rank()?;
        // The root's own block is copied here, before any op checks its buffers.
        if me == root && count > 0 {
            let (all, own) = if gather {
                (("recvbuff", recv as u64), ("sendbuff", send as u64))
            } else {
                (("sendbuff", send as u64), ("recvbuff", recv as u64))
            };
            for (what, p) in [all, own] {
                if p == 0 {
                    return Err(invalid(format!(
                        "{what} is NULL at the root with count {count}"
                    )));
                }
            }
        }
        let p2p = |kind: OpKind, buf: u64, peer: i32| Op {
            kind,
            dtype,
            redop: 0,
            count: count as u64,
            peer,
            send: if kind == OpKind::Send { buf } else { 0 },
            recv: if kind == OpKind::Recv { buf } else { 0 },
            stream: stream as usize,
            span: None,
        };
        comm::group::start();
        let body = || -> Outcome {
            if me == root {
                for (r, i) in (0..n).zip(0u64..) {
                    let block = if gather { recv as u64 } else { send as u64 } + i * bytes;
                    if r == me {
                        let (dst, src) = if gather {
                            (block, send as u64)
                        } else {
                            (recv as u64, block)
                        };
                        local_copy(dst, src, bytes, stream)?;
                    } else if gather {
                        comm.run(p2p(OpKind::Recv, block, r))?;
                    } else {
                        comm.run(p2p(OpKind::Send, block, r))?;
                    }
                }
            } else if gather {
                comm.run(p2p(OpKind::Send, send as u64, root))?;
            } else {
                comm.run(p2p(OpKind::Recv, recv as u64, root))?;
            }
            Ok(())
        };
        // The root's own block is copied with its device current too (as `Comm::run`).
        let out = comm::group::on_device(comm.device, body);
        let end = comm::group::end();
        out?;
        end
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    rooted(
        "ncclGather",
        true,
        send,
        recv,
        count,
        dtype,
        root,
        c,
        stream,
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    rooted(
        "ncclScatter",
        false,
        send,
        recv,
        count,
        dtype,
        root,
        c,
        stream,
    )
}

with_config! {
    ncclGatherConfig => ncclGather(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, root: c_int, c: ncclComm_t, stream: cudaStream_t) on c, stream;
    ncclScatterConfig => ncclScatter(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, root: c_int, c: ncclComm_t, stream: cudaStream_t) on c, stream;
}
