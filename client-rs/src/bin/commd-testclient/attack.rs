//! What one user might do to take the daemon away from the others (the tenancy tests in
//! `tests/test_security.py`). Each attack returns one step result: `ok` when the daemon let it
//! through in full, else the refusal, with what got through in the message.
//!
//! - `registrations`: registers `count` 4 KiB memfds (each one of the daemon's memory maps);
//! - `stage`: sends `count` memfds on the fd socket and never registers them;
//! - `sparse`: registers a `count`-byte memfd that was never written and all-reduces it in place
//!   (the daemon would allocate its pages);
//! - `punch`: the same over a buffer written in full, with a hole punched after registering;
//! - `ipc`: registers a CUDA IPC handle given in hex (`HANDLE:DEVICE_UUID:BYTES`, `@pid` in
//!   the handle standing for this process's pid), one another process exported
//!   (`tests/gpu/tenancy.py`).

#![allow(unsafe_code)] // posts raw descriptors over this process's own registrations

use std::os::fd::{AsFd, OwnedFd};

use commd_client::desc::{DType, OpKind, RedOp, SubmitDesc};
use commd_client::{Client, Communicator};

type Outcome = (String, u64, String);

pub fn run(
    client: &Client,
    comms: &[Communicator],
    kind: &str,
    count: u64,
    ipc: Option<&str>,
) -> Outcome {
    let r = match kind {
        "ipc" => foreign_handle(client, ipc.unwrap_or("")),
        "registrations" => registrations(client, count),
        "stage" => stage(client, count),
        "sparse" => over_holes(client, comms, count, false),
        "punch" => over_holes(client, comms, count, true),
        other => Err(format!("unknown attack {other}")),
    };
    match r {
        Ok(msg) => ("ok".into(), 0, msg),
        Err(msg) => ("refused".into(), 0, msg),
    }
}

/// A sealed memfd of `bytes`, its first `written` bytes written.
fn memfd(bytes: u64, written: u64) -> Result<OwnedFd, String> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create("attack", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| format!("memfd_create: {e}"))?;
    rustix::fs::ftruncate(&fd, bytes).map_err(|e| format!("ftruncate: {e}"))?;
    if written > 0 {
        let f = std::fs::File::from(fd.try_clone().map_err(|e| e.to_string())?);
        std::os::unix::fs::FileExt::write_all_at(
            &f,
            &vec![1u8; usize::try_from(written).unwrap_or(0)],
            0,
        )
        .map_err(|e| format!("write: {e}"))?;
    }
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW)
        .map_err(|e| format!("seal: {e}"))?;
    Ok(fd)
}

fn registrations(client: &Client, count: u64) -> Result<String, String> {
    for i in 0..count {
        let fd = memfd(4096, 4096)?;
        if let Err(e) = client.register_fd(fd.as_fd(), 4096) {
            return Err(format!("registered {i} of {count}: {e}"));
        }
    }
    Ok(format!("registered {count} of {count}"))
}

fn foreign_handle(client: &Client, spec: &str) -> Result<String, String> {
    let mut it = spec.split(':');
    let (Some(h), Some(u), Some(n), None) = (it.next(), it.next(), it.next(), it.next()) else {
        return Err(format!("expected HANDLE:UUID:BYTES, got {spec:?}"));
    };
    // `@pid`: this process's pid, little-endian (a handle rewritten to look like its own).
    let h = h.replace("@pid", &super::hex(&std::process::id().to_le_bytes()));
    let bytes = n.parse().map_err(|_| format!("bytes: {n:?}"))?;
    let id = client
        .register_ipc_handle_raw(&super::unhex(&h)?, &super::unhex(u)?, bytes)
        .map_err(|e| e.to_string())?;
    Ok(format!("registered as mem {id}"))
}

fn stage(client: &Client, count: u64) -> Result<String, String> {
    for i in 0..count {
        let fd = memfd(4096, 0)?;
        if let Err(e) = client.stage_fd_only(fd.as_fd()) {
            return Err(format!("staged {i} of {count}: {e}"));
        }
    }
    Ok(format!("staged {count} of {count}"))
}

fn over_holes(
    client: &Client,
    comms: &[Communicator],
    bytes: u64,
    punch: bool,
) -> Result<String, String> {
    let comm = comms.first().ok_or("the attack needs a communicator")?;
    let bytes = bytes.max(8192) / 4 * 4;
    let fd = memfd(bytes, if punch { bytes } else { 0 })?;
    let mem = client
        .register_fd(fd.as_fd(), bytes)
        .map_err(|e| format!("register: {e}"))?;
    if punch {
        rustix::fs::fallocate(
            &fd,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            0,
            bytes,
        )
        .map_err(|e| format!("punch: {e}"))?;
    }
    let d = SubmitDesc {
        opcode: OpKind::AllReduce.code(),
        dtype: DType::F32.code(),
        redop: RedOp::Sum.code(),
        count: bytes / 4,
        send_mem: mem,
        recv_mem: mem,
        ..Default::default()
    };
    // SAFETY: the descriptor names this attack's own registration, untouched until the op ends.
    let r = unsafe { comm.post_raw(d) }.and_then(|ud| client.wait(ud));
    match r {
        Ok(()) => Ok(format!(
            "the daemon ran an all-reduce over {bytes} bytes of holes"
        )),
        Err(e) => Err(e.to_string()),
    }
}
