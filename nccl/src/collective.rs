//! Collectives (all-reduce, reduce, broadcast, reduce-scatter, all-gather, all-to-all) and their
//! per-call config variants, user reduction ops (`ncclRedOpCreatePreMulSum`), and the group
//! calls. Each entry point builds one `comm::Op` and runs it on its communicator; the op's
//! checks and dispatch are `comm`'s.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::ffi::{c_int, c_void};

use commd_client::desc::OpKind;

use crate::comm::{self, Op};
use crate::ffi::{guard, invalid, ncclResult_t, put};
use crate::{cudaStream_t, ncclComm_t, ok};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut c_int,
    scalar: *mut c_void,
    datatype: c_int,
    residence: c_int,
    c: ncclComm_t,
) -> ncclResult_t {
    guard("ncclRedOpCreatePreMulSum", || {
        let comm = comm::get(c)?;
        if op.is_null() {
            return Err(invalid("op is NULL"));
        }
        // SAFETY: NCCL's contract: a host scalar is readable for one element of the type.
        let id = unsafe {
            comm::lock(&comm.premul).create(scalar.cast::<u8>().cast_const(), datatype, residence)
        }?;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(op, id, "op") }?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclRedOpDestroy(op: c_int, c: ncclComm_t) -> ncclResult_t {
    guard("ncclRedOpDestroy", || {
        let comm = comm::get(c)?;
        comm::lock(&comm.premul).destroy(op)?;
        ok()
    })
}

pub(crate) fn run(func: &str, c: ncclComm_t, op: Op) -> ncclResult_t {
    commd_client::gpu::prof::begin();
    let r = guard(func, || {
        comm::get(c)?.run(op)?;
        ok()
    });
    prof_exit();
    r
}

/// The exit of a profiled API call (`COMMD_EAGER_PROFILE`): inside a group the op waits for
/// the group's end and counts with it.
fn prof_exit() {
    if comm::group::active() {
        commd_client::gpu::prof::pause();
    } else {
        commd_client::gpu::prof::end();
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn coll(
    kind: OpKind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    redop: c_int,
    root: c_int,
    stream: cudaStream_t,
) -> Op {
    Op {
        kind,
        dtype,
        redop,
        count: count as u64,
        peer: root,
        send: send as u64,
        recv: recv as u64,
        stream: stream as usize,
        span: None,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclAllReduce",
        c,
        coll(OpKind::AllReduce, send, recv, count, dtype, op, 0, stream),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclReduce",
        c,
        coll(OpKind::Reduce, send, recv, count, dtype, op, root, stream),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclBroadcast",
        c,
        coll(OpKind::Broadcast, send, recv, count, dtype, 0, root, stream),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclBcast(
    buff: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclBcast",
        c,
        coll(OpKind::Broadcast, buff, buff, count, dtype, 0, root, stream),
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    recvcount: usize,
    dtype: c_int,
    op: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = coll(
        OpKind::ReduceScatter,
        send,
        recv,
        recvcount,
        dtype,
        op,
        0,
        stream,
    );
    run("ncclReduceScatter", c, o)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    sendcount: usize,
    dtype: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    let o = coll(
        OpKind::AllGather,
        send,
        recv,
        sendcount,
        dtype,
        0,
        0,
        stream,
    );
    run("ncclAllGather", c, o)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclAlltoAll(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    c: ncclComm_t,
    stream: cudaStream_t,
) -> ncclResult_t {
    run(
        "ncclAlltoAll",
        c,
        coll(OpKind::AllToAll, send, recv, count, dtype, 0, 0, stream),
    )
}

// The per-collective config variants (NCCL 2.31+): the config is read and checked, its event
// recorded, and the plain call runs (`collconfig` says what each field does).
macro_rules! with_config {
    ($($name:ident => $base:ident($($arg:ident: $ty:ty),*) on $c:ident, $s:ident;)*) => {
        $(
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name(
                $($arg: $ty,)*
                config: *const c_void,
            ) -> ncclResult_t {
                let func = stringify!($name);
                // SAFETY: NCCL's contract: NULL or an initialized config.
                let cfg = match unsafe { crate::collconfig::read(config, func) } {
                    Ok(cfg) => cfg,
                    Err(f) => return crate::ffi::guard(func, || Err(f)),
                };
                // SAFETY: the plain form's arguments, under its contract.
                crate::collconfig::run(func, $c, $s, cfg, || unsafe { $base($($arg),*) })
            }
        )*
    };
}

pub(crate) use with_config;

with_config! {
    ncclAllReduceConfig => ncclAllReduce(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, op: c_int, c: ncclComm_t, stream: cudaStream_t) on c, stream;
    ncclBroadcastConfig => ncclBroadcast(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, root: c_int, c: ncclComm_t, stream: cudaStream_t) on c, stream;
    ncclReduceConfig => ncclReduce(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, op: c_int, root: c_int, c: ncclComm_t, stream: cudaStream_t) on c, stream;
    ncclAllGatherConfig => ncclAllGather(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, c: ncclComm_t, stream: cudaStream_t) on c, stream;
    ncclReduceScatterConfig => ncclReduceScatter(send: *const c_void, recv: *mut c_void,
        count: usize, dtype: c_int, op: c_int, c: ncclComm_t, stream: cudaStream_t) on c, stream;
    ncclAlltoAllConfig => ncclAlltoAll(send: *const c_void, recv: *mut c_void, count: usize,
        dtype: c_int, c: ncclComm_t, stream: cudaStream_t) on c, stream;
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupStart() -> ncclResult_t {
    guard("ncclGroupStart", || {
        comm::group::start();
        ok()
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclGroupEnd() -> ncclResult_t {
    commd_client::gpu::prof::begin();
    let r = guard("ncclGroupEnd", comm::group::end);
    prof_exit();
    r
}
