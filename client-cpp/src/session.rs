//! Sessions, unique ids, communicators and buffers.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::ffi::{CStr, OsStr};
use std::os::raw::{c_char, c_void};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::Duration;

use commd_client::{Client, CommOptions};

use crate::error::{Failure, ffi, ffi_void, invalid};
use crate::types::commd_status_t::{self, COMMD_INTERNAL, COMMD_OK};
use crate::types::*;
use crate::{handle, set_out};

/// Opens a session with the local daemon.
///
/// `socket_path`: the daemon's socket; NULL or "" means $COMMD_SOCKET, else this user's default
/// socket if it exists, else /run/commd/commd.sock. Fails with COMMD_DAEMON_UNAVAILABLE (the
/// message names the path) when no daemon answers there.
///
/// # Safety
/// `socket_path` is NULL or a NUL-terminated string; `out` is a writable pointer.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_session_open(
    socket_path: *const c_char,
    out: *mut *mut commd_session_t,
) -> commd_status_t {
    ffi("commd_session_open", || {
        // SAFETY: the caller passes a writable `out` (checked for NULL in set_out).
        unsafe { set_out(out, std::ptr::null_mut(), "out")? };
        let path = if socket_path.is_null() {
            None
        } else {
            // SAFETY: the caller passes a NUL-terminated string that outlives this call.
            let bytes = unsafe { CStr::from_ptr(socket_path) }.to_bytes();
            (!bytes.is_empty()).then(|| Path::new(OsStr::from_bytes(bytes)))
        };
        let client = Client::connect(path)?;
        let s = Box::into_raw(Box::new(commd_session_t { client }));
        // SAFETY: as above.
        unsafe { set_out(out, s, "out")? };
        Ok(COMMD_OK)
    })
}

/// Closes a session handle (NULL is ignored). Communicators and buffers made from it stay
/// valid; the session with the daemon ends when the last of them is gone too.
///
/// # Safety
/// `session` is NULL or an open session handle, not used after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_session_close(session: *mut commd_session_t) {
    ffi_void("commd_session_close", || {
        if !session.is_null() {
            // SAFETY: a handle from commd_session_open (Box::into_raw), closed once.
            drop(unsafe { Box::from_raw(session) });
        }
    })
}

/// Gets a fresh unique id for a new communicator (call on one rank, share with all).
///
/// # Safety
/// `session` is NULL or an open session; `out` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_get_unique_id(
    session: *const commd_session_t,
    out: *mut commd_unique_id_t,
) -> commd_status_t {
    ffi("commd_get_unique_id", || {
        // SAFETY: the caller passes NULL or an open session handle.
        let s = unsafe { handle(session, "session")? };
        if out.is_null() {
            return Err(invalid("out is NULL"));
        }
        let uid = s.client.unique_id()?;
        let bytes: [u8; COMMD_UNIQUE_ID_BYTES] =
            uid.as_slice().try_into().map_err(|_| Failure {
                status: COMMD_INTERNAL,
                message: format!(
                    "the daemon sent a {}-byte unique id, expected {COMMD_UNIQUE_ID_BYTES} (client and daemon versions differ?)",
                    uid.len()
                ),
            })?;
        // SAFETY: `out` is non-NULL and the caller promised it is writable.
        unsafe { out.write(commd_unique_id_t { bytes }) };
        Ok(COMMD_OK)
    })
}

/// Joins the communicator `id` as `rank` of `nranks`; returns when every rank joined.
///
/// `op_timeout_ms`: an op that some ranks never post fails after this long with COMMD_TIMEOUT
/// naming them (0: the daemon's op_timeout_ms). `join_timeout_ms`: how long to wait for the
/// other ranks to join before failing with COMMD_TIMEOUT (0: the daemon's default).
///
/// # Safety
/// `session` is NULL or an open session; `id` is NULL or readable; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_comm_init(
    session: *const commd_session_t,
    id: *const commd_unique_id_t,
    rank: u32,
    nranks: u32,
    op_timeout_ms: u64,
    join_timeout_ms: u64,
    out: *mut *mut commd_comm_t,
) -> commd_status_t {
    ffi("commd_comm_init", || {
        // SAFETY: the caller passes a writable `out` (checked for NULL in set_out).
        unsafe { set_out(out, std::ptr::null_mut(), "out")? };
        // SAFETY: the caller passes NULL or valid pointers.
        let (s, id) = unsafe { (handle(session, "session")?, handle(id, "id")?) };
        if rank >= nranks {
            return Err(invalid(format!(
                "rank {rank} is out of range for {nranks} ranks (ranks are 0..nranks-1)"
            )));
        }
        let ms = |v: u64| (v > 0).then(|| Duration::from_millis(v));
        let opts = CommOptions {
            op_timeout: ms(op_timeout_ms),
            join_timeout: ms(join_timeout_ms),
            ..Default::default()
        };
        let comm = s.client.communicator_with(&id.bytes, rank, nranks, opts)?;
        let c = Box::into_raw(Box::new(commd_comm_t { comm }));
        // SAFETY: as above.
        unsafe { set_out(out, c, "out")? };
        Ok(COMMD_OK)
    })
}

/// Leaves and destroys this rank's communicator (NULL is ignored). The other ranks' later ops
/// on it fail with COMMD_PEER_LOST. Ops still in flight on it fail too.
///
/// # Safety
/// `comm` is NULL or a communicator handle, not used after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_comm_destroy(comm: *mut commd_comm_t) {
    ffi_void("commd_comm_destroy", || {
        if !comm.is_null() {
            // SAFETY: a handle from commd_comm_init (Box::into_raw), destroyed once.
            drop(unsafe { Box::from_raw(comm) });
        }
    })
}

/// This process's rank in `comm`.
///
/// # Safety
/// `comm` is NULL or a communicator handle; `rank` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_comm_rank(
    comm: *const commd_comm_t,
    rank: *mut u32,
) -> commd_status_t {
    ffi("commd_comm_rank", || {
        // SAFETY: the caller passes NULL or valid pointers.
        unsafe {
            let c = handle(comm, "comm")?;
            set_out(rank, c.comm.rank(), "rank")?;
        }
        Ok(COMMD_OK)
    })
}

/// The number of ranks in `comm`.
///
/// # Safety
/// `comm` is NULL or a communicator handle; `nranks` is NULL or writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_comm_size(
    comm: *const commd_comm_t,
    nranks: *mut u32,
) -> commd_status_t {
    ffi("commd_comm_size", || {
        // SAFETY: the caller passes NULL or valid pointers.
        unsafe {
            let c = handle(comm, "comm")?;
            set_out(nranks, c.comm.nranks(), "nranks")?;
        }
        Ok(COMMD_OK)
    })
}

/// Caps the bandwidth of the daemon's GPU copies for `comm` at `bytes_per_sec` bytes per second
/// (0: uncapped; otherwise at least 1000000, i.e. 1 MB/s, else COMMD_INVALID_ARGUMENT). Applies
/// to every rank of the communicator on this node from its next copy phase on; any rank may
/// call it. Use it to keep background collectives from slowing the job's compute. Host-memory
/// ops are not paced.
///
/// # Safety
/// `comm` is NULL or a communicator handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_comm_set_pacing(
    comm: *const commd_comm_t,
    bytes_per_sec: u64,
) -> commd_status_t {
    ffi("commd_comm_set_pacing", || {
        // SAFETY: the caller passes NULL or a valid communicator handle.
        let c = unsafe { handle(comm, "comm")? };
        c.comm.set_pacing(Some(bytes_per_sec))?;
        Ok(COMMD_OK)
    })
}

/// Allocates `bytes` (> 0) of host memory shared with the daemon, zero-filled. Ops may only
/// name buffers of the session that runs them.
///
/// # Safety
/// `session` is NULL or an open session; `out` is writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_buffer_alloc(
    session: *const commd_session_t,
    bytes: u64,
    out: *mut *mut commd_buffer_t,
) -> commd_status_t {
    ffi("commd_buffer_alloc", || {
        // SAFETY: the caller passes a writable `out` (checked for NULL in set_out).
        unsafe { set_out(out, std::ptr::null_mut(), "out")? };
        // SAFETY: the caller passes NULL or an open session handle.
        let s = unsafe { handle(session, "session")? };
        let buf = s.client.alloc(bytes)?;
        let b = Box::into_raw(Box::new(commd_buffer_t { buf }));
        // SAFETY: as above.
        unsafe { set_out(out, b, "out")? };
        Ok(COMMD_OK)
    })
}

/// The buffer's memory (valid until commd_buffer_free; page-aligned), or NULL for a NULL
/// buffer.
///
/// # Safety
/// `buffer` is NULL or a buffer handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_buffer_data(buffer: *const commd_buffer_t) -> *mut c_void {
    let mut p = std::ptr::null_mut();
    ffi("commd_buffer_data", || {
        // SAFETY: the caller passes NULL or a buffer handle.
        p = unsafe { handle(buffer, "buffer")? }.buf.as_ptr().cast();
        Ok(COMMD_OK)
    });
    p
}

/// The buffer's size in bytes, or 0 for a NULL buffer.
///
/// # Safety
/// `buffer` is NULL or a buffer handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_buffer_size(buffer: *const commd_buffer_t) -> u64 {
    let mut n = 0;
    ffi("commd_buffer_size", || {
        // SAFETY: the caller passes NULL or a buffer handle.
        n = unsafe { handle(buffer, "buffer")? }.buf.len();
        Ok(COMMD_OK)
    });
    n
}

/// Frees a buffer (NULL is ignored). Freeing a buffer that an in-flight op uses is safe for
/// memory (the daemon keeps its own mapping until the op ends) but that op's data is lost.
///
/// # Safety
/// `buffer` is NULL or a buffer handle, not used after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn commd_buffer_free(buffer: *mut commd_buffer_t) {
    ffi_void("commd_buffer_free", || {
        if !buffer.is_null() {
            // SAFETY: a handle from commd_buffer_alloc (Box::into_raw), freed once.
            drop(unsafe { Box::from_raw(buffer) });
        }
    })
}
