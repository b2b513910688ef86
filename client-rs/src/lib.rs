//! commd-client: the Rust client core used by every commd client (Rust, Python, C/C++).
//!
//! A [`Client`] is one session with the local daemon: the gRPC control plane over the Unix
//! socket, plus the session's shared-memory rings and its fd-socket connection (which also tells
//! the daemon when this process dies). Host buffers are [`Buffer`]s: sealed memfds mapped here and
//! in the daemon, so data never crosses a socket. Ops are posted to the submission ring and
//! completed through the completion ring; waiting spins briefly, then sleeps on a futex.
//!
//! Ownership rules (as for NCCL and nonblocking MPI): do not read or write a buffer that an
//! in-flight op writes, and do not write a buffer an in-flight op reads, until that op completes.
//! [`Pending`] borrows the buffers it names and waits for its op when dropped.
//!
//! Blocking calls drive an internal current-thread tokio runtime: call them from plain threads,
//! not from inside another async runtime.

#![deny(unsafe_code)] // allowed only in the modules that say why

mod buffer;
mod comm;
mod completion;
mod connect;
mod error;
pub mod gpu;
pub mod hostmem;
mod options;
mod request;
mod session;
mod watchdog;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use commd_proto::pb;
use commd_proto::pb::local_client::LocalClient;
use commd_proto::ring::Ring;
use tonic::transport::Channel;

pub use buffer::{At, Buffer, Pending};
pub use comm::{ANY_SOURCE, Communicator, OpArgs, ShrinkOptions};
pub use commd_proto::MIN_PACING_BYTES_PER_SEC;
pub use commd_proto::desc;
pub use connect::uds_channel;
pub use error::{Error, OpErrorKind, Result};
pub use options::{CommOptions, DEFAULT_DAEMON_TIMEOUT, Options, resolve_socket_path};
pub use request::Request;

use buffer::Mapping;
use completion::CqState;
use watchdog::Beat;

/// The socket a daemon of this user serves by default (`commd_host`'s, re-exported).
pub use commd_host::default_socket_path;

struct Inner {
    rt: tokio::runtime::Runtime,
    rpc: LocalClient<Channel>,
    session_id: u64,
    socket: PathBuf,
    fd_sock: Mutex<OwnedFd>,
    ring: Ring,
    sq_tail: Mutex<u32>,
    cq: Mutex<CqState>,
    next_user_data: AtomicU64,
    next_token: AtomicU64,
    /// Ops posted whose completions are not yet read off the completion ring (`reap`). Kept
    /// at most `limit`, so the daemon always has room for every completion it owes. A
    /// completion read off the ring but not yet claimed by its request (a `Work` nobody waited
    /// for yet, or a dropped one) takes no ring entry, so it does not count (else a process
    /// with `limit` unclaimed ops would wait here forever).
    inflight: AtomicU32,
    limit: u32,
    spin: Duration,
    daemon_timeout: Option<Duration>,
    beat: Mutex<Beat>,
    /// Set when the daemon stopped answering: the session takes no new work (a resumed daemon
    /// could still carry out the ops it had, into buffers the caller reuses after the error).
    abandoned: AtomicBool,
    /// Why it was abandoned (the first reason), for the calls after it.
    abandoned_why: Mutex<String>,
    /// Starts the watchdog thread once (first GPU op).
    watchdog: std::sync::Once,
    /// A second descriptor of the fd socket, to shut the connection down when the session is
    /// abandoned (the fd socket's mutex may be held by the waiter that notices).
    fd_sock_ctl: Option<OwnedFd>,
    /// The process that created the session: after fork() the child must not use (or end) it.
    pid: u32,
    gpu: Mutex<gpu::SessionGpu>,
    /// The graph doorbell area was registered (ops were captured into CUDA graphs).
    graphs_used: AtomicBool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.owned_here() {
            return;
        }
        let mut rpc = self.rpc.clone();
        let _ = self.watched(rpc.goodbye(pb::SessionRef {
            session_id: self.session_id,
        }));
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One session with the local daemon. Cheap to clone; the session ends when the last clone,
/// communicator and buffer are dropped, or when the process exits.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Client(session {})", self.inner.session_id)
    }
}

impl Client {
    pub fn session_id(&self) -> u64 {
        self.inner.session_id
    }

    pub fn socket(&self) -> &Path {
        &self.inner.socket
    }

    /// A fresh communicator id (128 opaque bytes) to pass to every rank.
    pub fn unique_id(&self) -> Result<Vec<u8>> {
        let i = &self.inner;
        i.check_owner()?;
        let r = i.watched(i.rpc.clone().get_unique_id(pb::SessionRef {
            session_id: i.session_id,
        }))?;
        Ok(r.map_err(|s| Error::rpc("get_unique_id", s))?
            .into_inner()
            .unique_id)
    }

    /// Passes `fd` to the daemon and registers its first `bytes` bytes. The fd must be a memfd
    /// sealed against shrinking. Returns the memory handle.
    pub fn register_fd(&self, fd: std::os::fd::BorrowedFd<'_>, bytes: u64) -> Result<u32> {
        let i = &self.inner;
        i.check_owner()?;
        let token = i.stage_fd(fd)?;
        let req = pb::RegisterMemoryRequest {
            session_id: i.session_id,
            fd_token: token,
            bytes,
        };
        let r = i
            .watched(i.rpc.clone().register_memory(req))?
            .map_err(|s| Error::rpc("register_memory", s))?;
        Ok(r.into_inner().mem_id)
    }

    /// Sends `fd` on the fd socket without registering it; returns its token. For the tenancy
    /// tests (`commd-testclient`'s attacks): a client never needs it.
    #[doc(hidden)]
    pub fn stage_fd_only(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<u64> {
        self.inner.check_owner()?;
        self.inner.stage_fd(fd)
    }

    /// Registers CUDA IPC handle bytes as given, with nothing behind them in this process.
    /// For the tenancy tests (`commd-testclient`'s `ipc` attack): a client never needs it.
    #[doc(hidden)]
    pub fn register_ipc_handle_raw(
        &self,
        handle: &[u8],
        device_uuid: &[u8],
        bytes: u64,
    ) -> Result<u32> {
        let i = &self.inner;
        i.check_owner()?;
        let rep = i
            .watched(
                i.rpc
                    .clone()
                    .register_cuda_memory(pb::RegisterCudaMemoryRequest {
                        session_id: i.session_id,
                        ipc_handle: handle.to_vec(),
                        device_uuid: device_uuid.to_vec(),
                        bytes,
                        buffer_id: 0,
                        vmm: false,
                    }),
            )?
            .map_err(|s| Error::rpc("register_cuda_memory", s))?;
        Ok(rep.into_inner().mem_id)
    }

    pub fn deregister(&self, mem_id: u32) -> Result<()> {
        let i = &self.inner;
        i.check_owner()?;
        i.watched(i.rpc.clone().deregister_memory(pb::MemRef {
            session_id: i.session_id,
            mem_id,
        }))?
        .map_err(|s| Error::rpc("deregister_memory", s))?;
        Ok(())
    }

    /// This session's GPU registrations: (allocations registered with the daemon, registration
    /// cache hits) by its GPU ops; a steady-state loop over the same tensors adds hits only.
    pub fn cuda_registration_stats(&self) -> (u64, u64) {
        gpu::stats(&self.inner)
    }

    /// The daemon's GPUs, peer matrix and copy paths (or why it has no CUDA).
    pub fn topology(&self) -> Result<pb::TopologyReply> {
        let i = &self.inner;
        Ok(i.rt
            .block_on(i.rpc.clone().topology(pb::Empty {}))
            .map_err(|s| Error::rpc("topology", s))?
            .into_inner())
    }

    /// Daemon-wide status (counts of sessions, communicators, registrations...).
    pub fn status(&self) -> Result<pb::StatusReply> {
        let i = &self.inner;
        i.check_owner()?;
        Ok(i.rt
            .block_on(i.rpc.clone().status(pb::Empty {}))
            .map_err(|s| Error::rpc("status", s))?
            .into_inner())
    }

    /// Waits for the op `user_data` posted on this session.
    pub fn wait(&self, user_data: u64) -> Result<()> {
        self.inner.wait(user_data, None).map(|_| ())
    }
}
