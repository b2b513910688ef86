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

mod error;
pub mod gpu;
pub mod hostmem;

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use commd_proto::desc::{CompletionDesc, DType, OpKind, RedOp, SubmitDesc, status};
use commd_proto::fdproto::{self, FdMsg, kind};
use commd_proto::pb;
use commd_proto::pb::local_client::LocalClient;
use commd_proto::ring::Ring;
use memmap2::{MmapOptions, MmapRaw};
use tonic::transport::{Channel, Endpoint, Uri};

pub use commd_proto::MIN_PACING_BYTES_PER_SEC;
pub use commd_proto::desc;
pub use error::{Error, OpErrorKind, Result};

/// The socket a daemon of this user serves by default (`commd_host`'s, re-exported).
pub use commd_host::default_socket_path;

/// Where a client looks for the daemon: `$COMMD_SOCKET`, else this user's default socket if it
/// exists, else the system daemon's `/run/commd/commd.sock`.
pub fn resolve_socket_path() -> PathBuf {
    if let Some(p) = commd_settings::get_os(&commd_settings::keys::SOCKET).filter(|p| !p.is_empty())
    {
        return PathBuf::from(p);
    }
    let mine = default_socket_path();
    if mine.exists() {
        mine
    } else {
        PathBuf::from("/run/commd/commd.sock")
    }
}

/// Client-side tuning.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long a waiter polls (yielding the core between looks) before sleeping on the
    /// completion futex (default 50 us, `COMMD_CLIENT_SPIN_US`).
    pub spin: Duration,
    /// Shown in `commd status`.
    pub name: String,
    /// Ring sizes (0: daemon default).
    pub ring_entries: u32,
    /// A waiter that sees the daemon's heartbeat word stand still this long fails with
    /// [`Error::DaemonLost`] instead of waiting on (a daemon stopped with SIGSTOP, hung, or
    /// starved): default 10 s, `COMMD_DAEMON_TIMEOUT_MS` (0: wait forever). The daemon's ring
    /// poller bumps the word at least every 100 ms while it runs.
    pub daemon_timeout: Option<Duration>,
}

/// [`Options::daemon_timeout`]'s default.
pub const DEFAULT_DAEMON_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for Options {
    fn default() -> Self {
        let spin_us = commd_settings::get(&commd_settings::keys::CLIENT_SPIN_US)
            .and_then(|v| v.parse().ok())
            .unwrap_or(50);
        // An invalid value is refused by `Client::connect_with` (`daemon_timeout_env`).
        let daemon_timeout = daemon_timeout_env()
            .ok()
            .flatten()
            .unwrap_or(Some(DEFAULT_DAEMON_TIMEOUT));
        Self {
            spin: Duration::from_micros(spin_us),
            name: format!("pid {}", std::process::id()),
            ring_entries: 0,
            daemon_timeout,
        }
    }
}

/// `COMMD_DAEMON_TIMEOUT_MS`: `Ok(None)` when unset, `Ok(Some(None))` for 0 (wait forever),
/// `Err` naming the variable for anything that is not a number of milliseconds.
fn daemon_timeout_env() -> std::result::Result<Option<Option<Duration>>, String> {
    let Some(v) = commd_settings::get_os(&commd_settings::keys::DAEMON_TIMEOUT_MS) else {
        return Ok(None);
    };
    match v
        .to_str()
        .map(str::trim)
        .and_then(|s| s.parse::<u64>().ok())
    {
        Some(0) => Ok(Some(None)),
        Some(ms) => Ok(Some(Some(Duration::from_millis(ms)))),
        None => Err(format!(
            "COMMD_DAEMON_TIMEOUT_MS={v:?}: expected milliseconds (0: wait for a stopped daemon forever; default 10000)"
        )),
    }
}

/// The daemon's heartbeat as this client last saw it: (value, when it last changed).
struct Beat {
    value: u64,
    changed: Instant,
}

struct CqState {
    head: u32,
    done: HashMap<u64, CompletionDesc>,
    /// Ops whose [`Request`] was dropped unwaited: their completions are discarded on arrival.
    abandoned: HashSet<u64>,
}

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
    /// for yet, or a dropped one) takes no ring entry, so it does not count: counting it made a
    /// process with `limit` unclaimed ops wait here forever (2026-11-27: torch's
    /// all_to_all_single on GPUs hung after about 1000 calls).
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
    /// Connects to the daemon at `socket` (or [`resolve_socket_path`]).
    pub fn connect(socket: Option<&Path>) -> Result<Self> {
        Self::connect_with(socket, Options::default())
    }

    pub fn connect_with(socket: Option<&Path>, opts: Options) -> Result<Self> {
        daemon_timeout_env().map_err(Error::InvalidArgument)?;
        let path = socket
            .map(Path::to_path_buf)
            .unwrap_or_else(resolve_socket_path);
        let unavailable = |reason: String| Error::DaemonUnavailable {
            path: path.clone(),
            reason,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let channel = uds_channel(&rt, &path).map_err(unavailable)?;
        let mut rpc = LocalClient::new(channel).max_decoding_message_size(16 << 20);
        let hello = pb::HelloRequest {
            client_version: commd_proto::VERSION.to_string(),
            name: opts.name.clone(),
            sq_entries: opts.ring_entries,
            cq_entries: opts.ring_entries,
        };
        // A stopped (SIGSTOP) or hung daemon still has its connections accepted by the
        // kernel: the hello and the attach reply are bounded by COMMD_DAEMON_TIMEOUT_MS, as
        // every later wait on the daemon is.
        let limit = opts.daemon_timeout;
        let stalled = |what: &str| {
            unavailable(format!(
                "the daemon took the connection but did not answer {what} within {} ms \
                 (COMMD_DAEMON_TIMEOUT_MS): is it stopped (SIGSTOP) or hung?",
                limit.unwrap_or_default().as_millis()
            ))
        };
        let reply = rt
            .block_on(async {
                let call = rpc.hello(hello);
                match limit {
                    Some(t) => tokio::time::timeout(t, call).await.ok(),
                    None => Some(call.await),
                }
            })
            .ok_or_else(|| stalled("its hello"))?
            .map_err(|s| match s.code() {
                tonic::Code::Unavailable | tonic::Code::Unknown => {
                    unavailable(s.message().to_string())
                }
                _ => Error::rpc("hello", s),
            })?;
        let reply = reply.into_inner();
        let fd_sock = fdproto::connect(Path::new(&reply.fd_socket))
            .map_err(|e| unavailable(format!("fd socket {}: {e}", reply.fd_socket)))?;
        let mut secret = [0u8; 16];
        if reply.attach_secret.len() != 16 {
            return Err(unavailable("daemon sent a malformed attach secret".into()));
        }
        secret.copy_from_slice(&reply.attach_secret);
        let attach = FdMsg {
            kind: kind::ATTACH,
            session_id: reply.session_id,
            secret,
            ..Default::default()
        };
        let io = |e: std::io::Error| unavailable(format!("attaching the session: {e}"));
        fdproto::send(fd_sock.as_fd(), &attach, None).map_err(io)?;
        rustix::net::sockopt::set_socket_timeout(
            &fd_sock,
            rustix::net::sockopt::Timeout::Recv,
            limit,
        )
        .map_err(|e| io(e.into()))?;
        let got = match fdproto::recv(fd_sock.as_fd()) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(stalled("the attach of the session"));
            }
            other => other.map_err(io)?,
        };
        // Later reads on the socket wait as long as they need (the heartbeat bounds them).
        rustix::net::sockopt::set_socket_timeout(
            &fd_sock,
            rustix::net::sockopt::Timeout::Recv,
            None,
        )
        .map_err(|e| io(e.into()))?;
        let ring_fd = match got {
            Some((m, Some(fd))) if m.kind == kind::ATTACH_OK => fd,
            Some((m, _)) if m.kind == kind::ERROR => {
                return Err(unavailable(format!("attach refused: {}", m.text)));
            }
            Some(_) => return Err(unavailable("unexpected reply to attach".into())),
            None => {
                return Err(unavailable(
                    "daemon closed the fd socket during attach".into(),
                ));
            }
        };
        let ring = Ring::attach(&File::from(ring_fd))?;
        let l = ring.layout();
        let beat = Beat {
            value: ring.daemon_beat().load(Ordering::Relaxed),
            changed: Instant::now(),
        };
        let fd_sock_ctl = fd_sock.try_clone().ok();
        let inner = Inner {
            rt,
            rpc,
            session_id: reply.session_id,
            socket: path,
            fd_sock: Mutex::new(fd_sock),
            limit: l.sq_entries.min(l.cq_entries),
            ring,
            sq_tail: Mutex::new(0),
            cq: Mutex::new(CqState {
                head: 0,
                done: HashMap::new(),
                abandoned: HashSet::new(),
            }),
            next_user_data: AtomicU64::new(1),
            next_token: AtomicU64::new(1),
            inflight: AtomicU32::new(0),
            spin: opts.spin,
            daemon_timeout: opts.daemon_timeout,
            beat: Mutex::new(beat),
            abandoned: AtomicBool::new(false),
            abandoned_why: Mutex::new(String::new()),
            watchdog: std::sync::Once::new(),
            fd_sock_ctl,
            pid: std::process::id(),
            gpu: Mutex::new(gpu::SessionGpu::default()),
            graphs_used: AtomicBool::new(false),
        };
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

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

    /// Joins the communicator `unique_id` as `rank` of `nranks`; returns when all ranks joined.
    pub fn communicator(&self, unique_id: &[u8], rank: u32, nranks: u32) -> Result<Communicator> {
        self.communicator_with(unique_id, rank, nranks, CommOptions::default())
    }

    pub fn communicator_with(
        &self,
        unique_id: &[u8],
        rank: u32,
        nranks: u32,
        o: CommOptions,
    ) -> Result<Communicator> {
        let i = &self.inner;
        i.check_owner()?;
        let req = pb::CreateCommunicatorRequest {
            session_id: i.session_id,
            unique_id: unique_id.to_vec(),
            rank,
            nranks,
            op_timeout_ms: o
                .op_timeout
                .map(|d| d.as_millis().max(1) as u64)
                .unwrap_or(0),
            join_timeout_ms: o
                .join_timeout
                .map(|d| d.as_millis().max(1) as u64)
                .unwrap_or(0),
            switch: o.switch.clone().unwrap_or_default(),
            pacing_bytes_per_sec: o.pacing_bytes_per_sec,
        };
        let r = i
            .watched(i.rpc.clone().create_communicator(req))?
            .map_err(|s| Error::rpc("create_communicator", s))?;
        let r = r.into_inner();
        Ok(Communicator {
            client: self.inner.clone(),
            handle: r.comm,
            comm_id: r.comm_id,
            rank,
            nranks,
            doorbell_slot: r.doorbell_slot,
            nodes: r.nodes.max(1),
            paths: r.paths,
            ranks_share_a_process: r.ranks_share_a_process,
            op_timeout: o.op_timeout,
            gpu: Mutex::new(gpu::CommGpu::default()),
        })
    }

    /// Allocates `bytes` of shared host memory registered with the daemon.
    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "cannot allocate a 0-byte buffer".into(),
            ));
        }
        use rustix::fs::{MemfdFlags, SealFlags};
        // What the system refuses (a size past the address space or the memory limits, out of
        // file descriptors) is the caller's request, named with its size: not a bug of commd.
        let refused = |what: &str, e: std::io::Error| {
            Error::InvalidArgument(format!(
                "cannot allocate a shared buffer of {bytes} bytes: {what}: {e}"
            ))
        };
        let fd =
            rustix::fs::memfd_create("commd-buf", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .map_err(|e| refused("memfd_create", e.into()))?;
        rustix::fs::ftruncate(&fd, bytes).map_err(|e| refused("ftruncate", e.into()))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(std::io::Error::from)?;
        let file = File::from(fd);
        let len = usize::try_from(bytes)
            .map_err(|_| refused("mmap", std::io::ErrorKind::InvalidInput.into()))?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| refused("mmap", e))?;
        let mem_id = self.register_fd(file.as_fd(), bytes)?;
        Ok(Buffer {
            client: self.inner.clone(),
            mem_id,
            map: Mapping::Own(map),
            len: bytes,
        })
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

    /// Daemon-wide status (counts of sessions, communicators, registrations...).
    /// (allocations registered with the daemon, registration cache hits) by this session's GPU
    /// ops: a steady-state loop over the same tensors adds hits only.
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

/// A gRPC channel to the daemon's Unix socket `path`, connected on `rt` (the daemon's CLI uses
/// it for the admin service too). The error text includes every cause.
pub fn uds_channel(
    rt: &tokio::runtime::Runtime,
    path: &Path,
) -> std::result::Result<Channel, String> {
    let p = path.to_path_buf();
    rt.block_on(async move {
        // The URI is required by the API but unused: the connector dials the Unix socket.
        Endpoint::try_from("http://commd.invalid")?
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let p = p.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(p).await?,
                    ))
                }
            }))
            .await
    })
    .map_err(|e| source_chain(&e))
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        // Wrappers often repeat their source's text; say each thing once.
        if !s.ends_with(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}

impl Inner {
    /// Passes `fd` to the daemon on the fd socket; returns the token a registration names it by.
    fn stage_fd(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<u64> {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let sock = lock(&self.fd_sock);
        let gone = |e: std::io::Error| {
            self.lost(&format!(
                "the daemon's fd socket failed ({e}): the daemon exited or closed this session"
            ))
        };
        fdproto::send(
            sock.as_fd(),
            &FdMsg {
                kind: kind::STAGE,
                session_id: self.session_id,
                token,
                ..Default::default()
            },
            Some(fd),
        )
        .map_err(gone)?;
        // Wait for the reply in slices, so a stopped daemon is reported, not waited for forever.
        loop {
            let mut fds = [rustix::event::PollFd::new(
                &*sock,
                rustix::event::PollFlags::IN | rustix::event::PollFlags::RDHUP,
            )];
            let slice = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            match rustix::event::poll(&mut fds, Some(&slice)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => {
                    if let Some(e) = self.daemon_stalled() {
                        return Err(e);
                    }
                }
                Ok(_) => break,
                Err(e) => return Err(gone(e.into())),
            }
        }
        match fdproto::recv(sock.as_fd()).map_err(gone)? {
            Some((m, _)) if m.kind == kind::STAGE_OK && m.token == token => Ok(token),
            Some((m, _)) if m.kind == kind::ERROR => Err(Error::InvalidArgument(format!(
                "daemon refused the fd: {}",
                m.text
            ))),
            Some(_) => Err(Error::DaemonLost {
                session: self.session_id,
                reason: "unexpected fd-socket reply".into(),
            }),
            None => Err(Error::DaemonLost {
                session: self.session_id,
                reason: "fd socket closed".into(),
            }),
        }
    }

    fn owned_here(&self) -> bool {
        self.pid == std::process::id()
    }

    fn check_owner(&self) -> Result<()> {
        if self.abandoned.load(Ordering::Acquire) {
            let why = lock(&self.abandoned_why).clone();
            return Err(self.lost(&format!(
                "this session was abandoned when its daemon exited or stopped answering ({why}; \
                 a stopped daemon that resumes could still carry out the ops it had, so the \
                 session takes no new ones): connect again"
            )));
        }
        if self.owned_here() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "this commd session belongs to process {} (it was inherited through fork); \
                 connect again in process {}",
                self.pid,
                std::process::id()
            )))
        }
    }

    /// `FailCommunicator` for communicator `handle` of this session ([`Communicator::fail`]).
    fn fail_comm(&self, handle: u32, status: u32, message: &str) -> Result<()> {
        self.watched(
            self.rpc
                .clone()
                .fail_communicator(pb::FailCommunicatorRequest {
                    session_id: self.session_id,
                    comm: handle,
                    status,
                    message: message.to_string(),
                }),
        )?
        .map_err(|s| Error::rpc("fail_communicator", s))?;
        Ok(())
    }

    /// `GetCommFailure` for communicator `handle` of this session ([`Communicator::failure`]).
    fn comm_failure(&self, handle: u32) -> Result<Option<(u32, String)>> {
        let r = self
            .watched(self.rpc.clone().get_comm_failure(pb::CommRef {
                session_id: self.session_id,
                comm: handle,
            }))?
            .map_err(|s| Error::rpc("get_comm_failure", s))?
            .into_inner();
        Ok((r.status != 0).then_some((r.status, r.message)))
    }

    fn lost(&self, reason: &str) -> Error {
        Error::DaemonLost {
            session: self.session_id,
            reason: reason.to_string(),
        }
    }

    /// Ends the session from this side, once the daemon exited or stopped answering: it takes
    /// no new work, the fd connection is shut down (a resumed daemon then ends the session,
    /// failing what it still has, before it runs more of it), and every GPU stream of this
    /// process waiting on one of its doorbells is released with the error word set.
    fn abandon_session(&self, why: &str) {
        {
            // Before the flag: a call that sees the flag finds the reason.
            let mut w = lock(&self.abandoned_why);
            if w.is_empty() {
                *w = why.to_string();
            }
        }
        if self.abandoned.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(fd) = &self.fd_sock_ctl {
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
        self.release_gpu_streams();
        self.release_graph_streams();
    }

    /// DESIGN.md contract 5 done by the client for a daemon that can no longer do it: each
    /// doorbell's done counter moves 2^30 past its ready counter, past every ticket a stream of
    /// this process can still wait for (tickets in flight are a few phases ahead of ready), and
    /// its error word says the daemon was lost, which the next call raises. Only once the
    /// session is abandoned: no new op can be posted, so no later wait is satisfied by this.
    fn release_gpu_streams(&self) {
        for slot in 0..commd_proto::desc::doorbell::SLOTS {
            if let Some((ready, done, err)) = self.ring.doorbell(slot) {
                let _ =
                    err.compare_exchange(0, status::PEER_LOST, Ordering::AcqRel, Ordering::Acquire);
                done.store(
                    ready.load(Ordering::Acquire).wrapping_add(1 << 30),
                    Ordering::Release,
                );
            }
            // Direct captured ops (contract 7) waiting for a peer stop on this bit.
            if let Some(h) = self.ring.doorbell_hint(slot) {
                h.fetch_or(commd_proto::desc::doorbell::HINT_BROKEN, Ordering::AcqRel);
            }
        }
    }

    /// A thread that watches the daemon while this session has GPU ops: a stream waiting on a
    /// doorbell would otherwise wait forever for a daemon that died or stopped, with no CPU
    /// thread of the job in a commd call to notice (the CPU is blocked in CUDA). Every 100 ms it
    /// checks the fd connection and the heartbeat, and abandons the session when either says
    /// the daemon is gone. Started by the first GPU op; ends with the session.
    pub(crate) fn start_watchdog(self: &Arc<Self>) {
        self.watchdog.call_once(|| {
            let weak = Arc::downgrade(self);
            let r = std::thread::Builder::new()
                .name("commd-watchdog".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_millis(100));
                        let Some(i) = weak.upgrade() else { return };
                        if i.abandoned.load(Ordering::Acquire) {
                            break;
                        }
                        if i.daemon_gone() {
                            i.abandon_session("the daemon exited: its socket closed");
                            break;
                        }
                        if i.daemon_stalled().is_some() {
                            break;
                        }
                        // Graphs destroyed since the last look: the daemon drops their ops.
                        i.release_destroyed_graphs();
                        // A direct op failed because a peer ran it on the daemon's path: the
                        // peer waits in the daemon, which is told.
                        i.report_direct_failures(None);
                    }
                    // Abandoned (or the daemon stalled, which abandons at the next call). A
                    // captured op's stream resets its done word at the end of each replay,
                    // so its release is repeated while the process replays graphs.
                    loop {
                        let Some(i) = weak.upgrade() else { return };
                        if !i.graphs_used.load(Ordering::Acquire) {
                            return;
                        }
                        if i.abandoned.load(Ordering::Acquire) {
                            i.release_graph_streams();
                        }
                        drop(i);
                        std::thread::sleep(Duration::from_millis(10));
                    }
                });
            if let Err(e) = r {
                eprintln!("commd: cannot start the watchdog thread ({e}); a GPU stream waiting on a lost daemon is then released only by the next commd call that notices");
            }
        });
    }

    /// Whether the daemon side of the fd socket hung up (daemon exited).
    fn daemon_gone(&self) -> bool {
        let guard;
        let sock: std::os::fd::BorrowedFd<'_> = match &self.fd_sock_ctl {
            Some(fd) => fd.as_fd(),
            None => {
                guard = lock(&self.fd_sock);
                guard.as_fd()
            }
        };
        let mut fds = [rustix::event::PollFd::new(
            &sock,
            rustix::event::PollFlags::RDHUP | rustix::event::PollFlags::HUP,
        )];
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
            && fds[0].revents().intersects(
                rustix::event::PollFlags::HUP
                    | rustix::event::PollFlags::RDHUP
                    | rustix::event::PollFlags::ERR,
            )
    }

    /// Moves every available completion into the `done` map.
    fn reap(&self, cq: &mut CqState) {
        let tail = self.ring.cq_tail().load(Ordering::Acquire);
        let avail = tail.wrapping_sub(cq.head);
        if avail == 0 || avail > self.ring.layout().cq_entries {
            return;
        }
        for _ in 0..avail {
            let c = self.ring.read_cq(cq.head);
            cq.head = cq.head.wrapping_add(1);
            if !cq.abandoned.remove(&c.user_data) {
                cq.done.insert(c.user_data, c);
            }
        }
        self.ring.cq_head().store(cq.head, Ordering::Release);
        self.inflight.fetch_sub(avail, Ordering::AcqRel);
    }

    /// Waits (a short nap at most) for completions to come off the completion ring, for
    /// `post` when `limit` ops are in flight. An error once the daemon is gone or stalled.
    fn wait_cq_room(&self) -> Result<()> {
        {
            let mut cq = lock(&self.cq);
            self.reap(&mut cq);
        }
        if self.inflight.load(Ordering::Acquire) < self.limit {
            return Ok(());
        }
        self.nap_on_cq(Duration::from_millis(10));
        if self.ring.cq_tail().load(Ordering::Acquire) == lock(&self.cq).head {
            self.check_daemon("while this process waited for room to post an op")?;
        }
        Ok(())
    }

    /// Sleeps on the CQ doorbell for up to `nap` unless a completion is already there,
    /// announcing the sleeper so the daemon's next completion wakes it.
    fn nap_on_cq(&self, nap: Duration) {
        let r = &self.ring;
        r.cq_sleepers().fetch_add(1, Ordering::SeqCst);
        let bell = r.cq_bell().load(Ordering::SeqCst);
        if r.cq_tail().load(Ordering::SeqCst) == lock(&self.cq).head {
            commd_proto::futex::wait(r.cq_bell(), bell, nap);
        }
        r.cq_sleepers().fetch_sub(1, Ordering::SeqCst);
    }

    /// For a waiter that saw no progress: an error once the session was closed, the daemon
    /// exited (`when` says what was waiting), or its heartbeat stood still too long.
    fn check_daemon(&self, when: &str) -> Result<()> {
        if self.ring.session_error().load(Ordering::Acquire) != 0 && self.daemon_gone() {
            return Err(self.session_closed_error());
        }
        if self.daemon_gone() {
            let why = format!("the daemon exited (its socket closed) {when}");
            self.abandon_session(&why);
            return Err(self.lost(&why));
        }
        match self.daemon_stalled() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn post(&self, mut d: SubmitDesc) -> Result<u64> {
        self.check_owner()?;
        if self.ring.session_error().load(Ordering::Acquire) != 0 {
            return Err(self.session_closed_error());
        }
        // Never more ops in flight than the completion ring holds.
        while self.inflight.load(Ordering::Acquire) >= self.limit {
            self.wait_cq_room()?;
        }
        self.inflight.fetch_add(1, Ordering::AcqRel);
        d.user_data = self.next_user_data.fetch_add(1, Ordering::Relaxed);
        let mut tail = lock(&self.sq_tail);
        let entries = self.ring.layout().sq_entries;
        let mut spins = 0u32;
        while tail.wrapping_sub(self.ring.sq_head().load(Ordering::Acquire)) >= entries {
            std::thread::yield_now();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096)
                && let Some(e) = self.daemon_stalled()
            {
                self.inflight.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        }
        self.ring.write_sq(*tail, &d);
        *tail = tail.wrapping_add(1);
        self.ring.sq_tail().store(*tail, Ordering::Release);
        Ring::ring_bell(self.ring.sq_bell(), self.ring.sq_sleeping());
        Ok(d.user_data)
    }

    fn session_closed_error(&self) -> Error {
        match self.ring.session_error().load(Ordering::Acquire) {
            status::SHUTDOWN => self.lost("the daemon is shutting down"),
            _ => self.lost("the daemon closed this session"),
        }
    }

    /// Forgets op `user_data`: its completion (now or later) is discarded.
    fn abandon(&self, user_data: u64) {
        let mut cq = lock(&self.cq);
        self.reap(&mut cq);
        if cq.done.remove(&user_data).is_none() {
            cq.abandoned.insert(user_data);
        }
    }

    /// Waits for `user_data`, up to `limit`. Returns the completion, or `None` when `limit`
    /// passed first.
    fn wait(&self, user_data: u64, limit: Option<Duration>) -> Result<Option<CompletionDesc>> {
        let t0 = Instant::now();
        loop {
            {
                let mut cq = lock(&self.cq);
                self.reap(&mut cq);
                if let Some(c) = cq.done.remove(&user_data) {
                    drop(cq);
                    return self.finish(c).map(Some);
                }
                if limit.is_some_and(|l| t0.elapsed() >= l) {
                    return Ok(None);
                }
            }
            if t0.elapsed() < self.spin {
                // Yield rather than burn: other ranks on this node may need this core.
                std::thread::yield_now();
                continue;
            }
            let mut nap = Duration::from_millis(100);
            if let Some(l) = limit {
                nap = nap.min(
                    l.saturating_sub(t0.elapsed())
                        .max(Duration::from_micros(50)),
                );
            }
            self.nap_on_cq(nap);
            let r = &self.ring;
            let idle = {
                let cq = lock(&self.cq);
                r.cq_tail().load(Ordering::Acquire) == cq.head && !cq.done.contains_key(&user_data)
            };
            if idle {
                self.check_daemon("with this op in flight")?;
            }
        }
    }

    /// Runs a control-plane call to completion, unless the daemon's heartbeat stands still for
    /// `daemon_timeout` first (a stopped daemon would otherwise hang the call forever): then
    /// [`Error::DaemonLost`]. Calls that legitimately take long (a join waiting for its ranks)
    /// keep going: the daemon's ring poller beats while its control plane works.
    fn watched<F: std::future::Future>(&self, fut: F) -> Result<F::Output> {
        if self.daemon_timeout.is_none() {
            return Ok(self.rt.block_on(fut));
        }
        self.rt.block_on(async {
            tokio::pin!(fut);
            loop {
                tokio::select! {
                    out = &mut fut => return Ok(out),
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {
                        if let Some(e) = self.daemon_stalled() {
                            return Err(e);
                        }
                    }
                }
            }
        })
    }

    /// `Some(error)` when the daemon's heartbeat has stood still for `daemon_timeout`.
    fn daemon_stalled(&self) -> Option<Error> {
        let limit = self.daemon_timeout?;
        let now = self.ring.daemon_beat().load(Ordering::Relaxed);
        let mut b = lock(&self.beat);
        if now != b.value {
            *b = Beat {
                value: now,
                changed: Instant::now(),
            };
            return None;
        }
        let still = b.changed.elapsed();
        (still >= limit).then(|| {
            drop(b);
            let why = format!(
                "the daemon stopped answering: its heartbeat has not moved for {:.1} s (the daemon \
                 process is stopped, e.g. by SIGSTOP, hung, or starved of CPU)",
                still.as_secs_f64()
            );
            let limit_ms = limit.as_millis();
            self.abandon_session(&format!(
                "{why}. COMMD_DAEMON_TIMEOUT_MS={limit_ms} sets this limit"
            ));
            self.lost(&format!(
                "{why} with this op in flight; the op's outcome is unknown and this session takes \
                 no new work (connect again). COMMD_DAEMON_TIMEOUT_MS={limit_ms} sets this limit \
                 (0: wait forever)"
            ))
        })
    }

    fn finish(&self, c: CompletionDesc) -> Result<CompletionDesc> {
        if c.status == status::OK {
            return Ok(c);
        }
        let kind = OpErrorKind::from_status(c.status);
        let message = match self.watched(self.rpc.clone().get_op_error(pb::OpRef {
            session_id: self.session_id,
            user_data: c.user_data,
        })) {
            Ok(Ok(r)) => r.into_inner().message,
            Ok(Err(_)) | Err(_) => format!(
                "op failed with status {} (the daemon is gone, so no message is available)",
                status::name(c.status)
            ),
        };
        Err(Error::Op { kind, message })
    }
}

/// Communicator options.
#[derive(Clone, Debug, Default)]
pub struct CommOptions {
    /// Per-op timeout (daemon default: `op_timeout_ms`).
    pub op_timeout: Option<Duration>,
    /// How long to wait for the other ranks to join (daemon default: `join_timeout_ms`).
    pub join_timeout: Option<Duration>,
    /// Switch session for the inter-node step of all-reduce: `off` or a SwitchML controller
    /// `HOST:PORT` (daemon default: its `switch` setting).
    pub switch: Option<String>,
    /// Cap on the bandwidth of the daemon's GPU copies for this communicator on this node, in
    /// bytes per second: `None` = the daemon's `gpu_pacing_gbps`, `Some(0)` = uncapped, else at
    /// least 1 MB/s ([`commd_proto::MIN_PACING_BYTES_PER_SEC`]). Every rank on a node must end
    /// up with the same cap (`None` counts as the daemon's default), else creation fails naming
    /// both values. Host-memory ops are not paced.
    pub pacing_bytes_per_sec: Option<u64>,
}

/// A host buffer in shared memory, registered with the daemon. Deregistered on drop.
pub struct Buffer {
    client: Arc<Inner>,
    mem_id: u32,
    map: Mapping,
    len: u64,
}

/// Where a [`Buffer`]'s bytes are mapped in this process.
enum Mapping {
    /// The buffer's own mapping, unmapped with it.
    Own(MmapRaw),
    /// A [`hostmem`] block's address: the block owns the mapping; the buffer is its registration.
    Block(usize),
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer(mem {}, {} bytes)", self.mem_id, self.len)
    }
}

#[allow(unsafe_code)] // the ring and doorbell pages are shared memory mapped from the daemon
impl Buffer {
    pub fn mem_id(&self) -> u32 {
        self.mem_id
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.map {
            Mapping::Own(m) => m.as_mut_ptr(),
            Mapping::Block(a) => *a as *mut u8,
        }
    }
    /// True for the registration of a [`hostmem`] block (its bytes belong to the block, which
    /// the allocator may unmap while this registration lives on in an op): never hand such a
    /// buffer's bytes out.
    pub fn is_block(&self) -> bool {
        matches!(self.map, Mapping::Block(_))
    }
    /// Does `self` belong to `client`'s session?
    pub fn is_of(&self, client: &Client) -> bool {
        Arc::ptr_eq(&self.client, &client.inner)
    }
    /// The buffer's bytes. Do not hold this across an op that writes the buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, lives as long as self, and is only written by the
        // daemon during ops that name it, which the module-level ownership rules exclude here.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len as usize) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only reference from this process.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len as usize) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let i = &self.client;
        if i.owned_here() && i.ring.session_error().load(Ordering::Acquire) == 0 {
            let _ = i.watched(i.rpc.clone().deregister_memory(pb::MemRef {
                session_id: i.session_id,
                mem_id: self.mem_id,
            }));
        }
    }
}

/// A buffer location: `(buffer, byte offset)`.
pub type At<'b> = (&'b Buffer, u64);

/// A posted op. Waits for completion when dropped, so buffers outlive the daemon's use of them.
#[must_use = "an op is only known to be done after wait()"]
pub struct Pending<'b> {
    client: Arc<Inner>,
    user_data: u64,
    done: bool,
    _bufs: PhantomData<&'b Buffer>,
}

impl Pending<'_> {
    pub fn user_data(&self) -> u64 {
        self.user_data
    }

    /// Blocks until the op completes; a failed op becomes an [`Error::Op`].
    pub fn wait(mut self) -> Result<()> {
        self.done = true;
        self.client.wait(self.user_data, None).map(|_| ())
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.client.wait(self.user_data, None);
        }
    }
}

/// A posted op that borrows nothing: for bindings (Python, C) whose callers keep the buffers
/// alive and untouched until the op completes. Thread-safe; the outcome is kept, so every
/// `wait`/`test` after completion returns the same result. Dropping it unwaited is allowed (the
/// completion is discarded when it arrives).
pub struct Request {
    client: Arc<Inner>,
    user_data: u64,
    /// Once done: the completion's `source` field (a receive from any source), or the error.
    outcome: Mutex<Option<std::result::Result<u64, Error>>>,
    /// An eager GPU op run as a direct op (DESIGN.md contract 7 rule 8): it completes from the
    /// event after its kernel and its status word, not from the daemon (`user_data` is 0).
    local: Option<gpu::direct::LocalDone>,
    /// A thread is waiting for the op in the client (with `outcome` unlocked): the others wait
    /// on `settled` for what it finds, up to their own limits.
    waiting: std::sync::atomic::AtomicBool,
    settled: std::sync::Condvar,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Request(op {})", self.user_data)
    }
}

impl Request {
    pub(crate) fn new(
        client: Arc<Inner>,
        user_data: u64,
        outcome: Option<std::result::Result<u64, Error>>,
        local: Option<gpu::direct::LocalDone>,
    ) -> Self {
        Self {
            client,
            user_data,
            outcome: Mutex::new(outcome),
            local,
            waiting: std::sync::atomic::AtomicBool::new(false),
            settled: std::sync::Condvar::new(),
        }
    }

    pub fn user_data(&self) -> u64 {
        self.user_data
    }

    /// Waits up to `limit` (forever if `None`). `Ok(true)`: done; `Ok(false)`: still running;
    /// `Err`: the op failed (the same error on every later call). Several threads may wait at
    /// once: one waits in the client, the others for what it finds, each within its own limit
    /// (a `test()` beside a `wait()` returns at once).
    pub fn wait_for(&self, limit: Option<Duration>) -> Result<bool> {
        use std::sync::atomic::Ordering::Relaxed;
        let deadline = limit.map(|l| Instant::now() + l);
        let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let mut o = lock(&self.outcome);
        while o.is_none() {
            if !self.waiting.load(Relaxed) {
                // This thread waits in the client, with the outcome unlocked (`waiting` is
                // only changed under that lock).
                self.waiting.store(true, Relaxed);
                drop(o);
                // Should the wait unwind, the others must not wait for this thread forever.
                struct Handover<'a>(&'a Request);
                impl Drop for Handover<'_> {
                    fn drop(&mut self) {
                        if std::thread::panicking() {
                            let _o = lock(&self.0.outcome);
                            self.0.waiting.store(false, Relaxed);
                            self.0.settled.notify_all();
                        }
                    }
                }
                let handover = Handover(self);
                let found = self.wait_once(left());
                drop(handover);
                o = lock(&self.outcome);
                self.waiting.store(false, Relaxed);
                if o.is_none() {
                    *o = found;
                }
                self.settled.notify_all();
                if o.is_none() {
                    return Ok(false);
                }
                break;
            }
            match left() {
                None => o = self.settled.wait(o).unwrap_or_else(|p| p.into_inner()),
                Some(d) if d.is_zero() => return Ok(false),
                Some(d) => {
                    o = self
                        .settled
                        .wait_timeout(o, d)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            }
        }
        match o.as_ref() {
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(e.duplicate()),
            None => Ok(false),
        }
    }

    /// One wait of up to `limit` for the op: its outcome, or `None` while it runs.
    fn wait_once(&self, limit: Option<Duration>) -> Option<std::result::Result<u64, Error>> {
        if let Some(l) = &self.local {
            return match l.poll(limit, Some(&self.client)) {
                Ok(None) => None,
                Ok(Some(r)) => Some(r),
                Err(e) => Some(Err(e)),
            };
        }
        match self.client.wait(self.user_data, limit) {
            Ok(None) => None,
            Ok(Some(c)) => Some(Ok(c.source)),
            Err(e) => Some(Err(e)),
        }
    }

    /// Blocks until the op completes.
    pub fn wait(&self) -> Result<()> {
        self.wait_for(None).map(|_| ())
    }

    /// Whether the op completed, without blocking (an `Err` if it failed).
    pub fn test(&self) -> Result<bool> {
        self.wait_for(Some(Duration::ZERO))
    }

    /// The rank a receive from any source ([`ANY_SOURCE`]) received from, once it completed;
    /// `None` before that, after a failure, and for every other op.
    pub fn source(&self) -> Option<u32> {
        match lock(&self.outcome).as_ref() {
            Some(Ok(s)) if *s > 0 => u32::try_from(*s - 1).ok(),
            _ => None,
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // A direct op's status word is read by its pool when the word is needed again.
        if self.local.is_none() && lock(&self.outcome).is_none() {
            self.client.abandon(self.user_data);
        }
    }
}

/// A communicator handle in this session. Destroyed on drop (other ranks' later ops then fail
/// with "peer lost").
pub struct Communicator {
    client: Arc<Inner>,
    handle: u32,
    comm_id: u64,
    rank: u32,
    nranks: u32,
    doorbell_slot: u32,
    /// Nodes the communicator spans (its GPU ops are host-staged above 1).
    nodes: u32,
    /// How its data moves, as the daemon described it at init.
    paths: Vec<String>,
    /// Two of its ranks on this node are one process (the daemon's word at init): eager ops
    /// never take the direct path, whose setup blocks a rank until every rank takes part.
    ranks_share_a_process: bool,
    /// The op timeout asked for at creation (the daemon's default when `None`): how long a
    /// direct captured op waits for a peer (contract 7).
    op_timeout: Option<Duration>,
    gpu: Mutex<gpu::CommGpu>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator(comm {}, rank {}/{})",
            self.comm_id, self.rank, self.nranks
        )
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let i = &self.client;
        if i.owned_here() && i.ring.session_error().load(Ordering::Acquire) == 0 {
            // A direct op of it that a peer's daemon mark failed, not yet told: the peer
            // waiting on the daemon's path gets that reason, not only "destroyed".
            i.report_direct_failures(None);
            let _ = i.watched(i.rpc.clone().destroy_communicator(pb::CommRef {
                session_id: i.session_id,
                comm: self.handle,
            }));
        }
    }
}

/// The `peer` of a host receive that takes whichever rank's message comes first
/// ([`Request::source`] then names the sender; communicators on one node only).
pub const ANY_SOURCE: u32 = u32::MAX;

/// Arguments of one op, for [`Communicator::post`].
#[derive(Clone, Copy, Debug)]
pub struct OpArgs<'b> {
    pub kind: OpKind,
    pub dtype: DType,
    pub redop: Option<RedOp>,
    pub count: u64,
    /// Root (broadcast, reduce) or peer (send, recv; [`ANY_SOURCE`] for a host recv from any rank).
    pub peer: u32,
    pub send: Option<At<'b>>,
    pub recv: Option<At<'b>>,
}

#[allow(unsafe_code)] // the ring and doorbell pages are shared memory mapped from the daemon
impl Communicator {
    pub fn rank(&self) -> u32 {
        self.rank
    }
    pub fn nranks(&self) -> u32 {
        self.nranks
    }
    /// Nodes (daemons) this communicator spans: above 1, its GPU ops go through host staging
    /// in the daemons (see `commd_proto::desc::flags::HOST_STAGED`).
    pub fn nodes(&self) -> u32 {
        self.nodes
    }
    pub fn id(&self) -> u64 {
        self.comm_id
    }
    /// How the communicator's data moves on this node, one line per path, as the daemon
    /// described it at init ("0-3 (every local pair) via SHM: ..."); empty for one rank.
    pub fn paths(&self) -> &[String] {
        &self.paths
    }
    pub fn handle(&self) -> u32 {
        self.handle
    }
    /// Whether two of this communicator's ranks on this node are one process (threads of it,
    /// or one thread driving several GPUs), as the daemon said at init.
    pub fn ranks_share_a_process(&self) -> bool {
        self.ranks_share_a_process
    }

    /// Caps the bandwidth of the daemon's GPU copies for this communicator at `bytes_per_sec`
    /// (`None` or `Some(0)`: uncapped; else at least 1 MB/s). Applies to every rank of the
    /// communicator on this node, from its next copy phase on; any rank may call it.
    pub fn set_pacing(&self, bytes_per_sec: Option<u64>) -> Result<()> {
        let i = &self.client;
        i.check_owner()?;
        i.watched(i.rpc.clone().set_comm_pacing(pb::SetCommPacingRequest {
            session_id: i.session_id,
            comm: self.handle,
            bytes_per_sec: bytes_per_sec.unwrap_or(0),
        }))?
        .map_err(|s| Error::rpc("set_comm_pacing", s))?;
        Ok(())
    }

    /// Fails the communicator for every rank (`status`, a failure code of
    /// `commd_proto::desc::status`; `message`, why): every queued and later op of every rank
    /// fails at once with them, and the local ranks' direct ops stop. For a failure the other
    /// ranks cannot see where they wait (a direct op of this rank whose peer sent the same op
    /// to the daemon: DESIGN.md contract 7 rule 8). Any rank may call it.
    pub fn fail(&self, status: u32, message: &str) -> Result<()> {
        self.client.fail_comm(self.handle, status, message)
    }

    /// Why the daemon holds this communicator broken for good (a rank's process lost, an op
    /// timed out, a rank failed it: [`Communicator::fail`]): the status its ops fail with and
    /// the reason, or `None` while it works. One round trip to the daemon; the cheap check is
    /// [`Communicator::is_broken`].
    pub fn failure(&self) -> Result<Option<(u32, String)>> {
        self.client.comm_failure(self.handle)
    }

    /// Posts an op; every buffer it names must belong to this client.
    pub fn post<'b>(&self, a: OpArgs<'b>) -> Result<Pending<'b>> {
        let user_data = self.submit(a)?;
        Ok(Pending {
            client: self.client.clone(),
            user_data,
            done: false,
            _bufs: PhantomData,
        })
    }

    fn submit(&self, a: OpArgs<'_>) -> Result<u64> {
        for b in [a.send, a.recv].into_iter().flatten() {
            if !Arc::ptr_eq(&b.0.client, &self.client) {
                return Err(Error::InvalidArgument(format!(
                    "{:?} belongs to another client session",
                    b.0
                )));
            }
        }
        let any = a.kind == OpKind::Recv && a.peer == ANY_SOURCE;
        let d = SubmitDesc {
            user_data: 0,
            opcode: a.kind.code(),
            dtype: a.dtype.code(),
            redop: a.redop.map(|r| r.code()).unwrap_or(0),
            flags: if any {
                commd_proto::desc::flags::ANY_SOURCE
            } else {
                0
            },
            comm: self.handle,
            peer: if any { 0 } else { a.peer },
            count: a.count,
            send_mem: a.send.map(|b| b.0.mem_id).unwrap_or(0),
            recv_mem: a.recv.map(|b| b.0.mem_id).unwrap_or(0),
            send_off: a.send.map(|b| b.1).unwrap_or(0),
            recv_off: a.recv.map(|b| b.1).unwrap_or(0),
            ticket: 0,
        };
        self.client.post(d)
    }

    /// Posts an op and returns a [`Request`] that borrows nothing.
    ///
    /// # Safety
    /// Until the request completes, the caller must not read bytes the op writes nor write bytes
    /// it reads (the daemon accesses them concurrently), and must keep each named buffer's
    /// registration alive if it wants the data (a dropped buffer only loses the data).
    pub unsafe fn post_detached(&self, a: OpArgs<'_>) -> Result<Request> {
        Ok(Request::new(
            self.client.clone(),
            self.submit(a)?,
            None,
            None,
        ))
    }

    /// Posts a raw descriptor (its `comm` is set to this communicator, `user_data` assigned).
    /// Returns the op's `user_data` for [`Client::wait`].
    ///
    /// # Safety
    /// The daemon may write any memory this session registered that the descriptor names until
    /// the op completes; the caller must not access those bytes meanwhile.
    pub unsafe fn post_raw(&self, mut d: SubmitDesc) -> Result<u64> {
        d.comm = self.handle;
        self.client.post(d)
    }

    pub fn all_reduce<'b>(
        &self,
        send: At<'b>,
        recv: At<'b>,
        count: u64,
        dtype: DType,
        op: RedOp,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::AllReduce,
            dtype,
            redop: Some(op),
            count,
            peer: 0,
            send: Some(send),
            recv: Some(recv),
        })
    }
    pub fn reduce<'b>(
        &self,
        send: At<'b>,
        recv: Option<At<'b>>,
        count: u64,
        dtype: DType,
        op: RedOp,
        root: u32,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::Reduce,
            dtype,
            redop: Some(op),
            count,
            peer: root,
            send: Some(send),
            recv,
        })
    }
    pub fn reduce_scatter<'b>(
        &self,
        send: At<'b>,
        recv: At<'b>,
        recv_count: u64,
        dtype: DType,
        op: RedOp,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::ReduceScatter,
            dtype,
            redop: Some(op),
            count: recv_count,
            peer: 0,
            send: Some(send),
            recv: Some(recv),
        })
    }
    pub fn all_gather<'b>(
        &self,
        send: At<'b>,
        recv: At<'b>,
        send_count: u64,
        dtype: DType,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::AllGather,
            dtype,
            redop: None,
            count: send_count,
            peer: 0,
            send: Some(send),
            recv: Some(recv),
        })
    }
    pub fn broadcast<'b>(
        &self,
        send: Option<At<'b>>,
        recv: At<'b>,
        count: u64,
        dtype: DType,
        root: u32,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::Broadcast,
            dtype,
            redop: None,
            count,
            peer: root,
            send,
            recv: Some(recv),
        })
    }
    pub fn all_to_all<'b>(
        &self,
        send: At<'b>,
        recv: At<'b>,
        count_per_peer: u64,
        dtype: DType,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::AllToAll,
            dtype,
            redop: None,
            count: count_per_peer,
            peer: 0,
            send: Some(send),
            recv: Some(recv),
        })
    }
    pub fn send<'b>(
        &self,
        buf: At<'b>,
        count: u64,
        dtype: DType,
        peer: u32,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::Send,
            dtype,
            redop: None,
            count,
            peer,
            send: Some(buf),
            recv: None,
        })
    }
    pub fn recv<'b>(
        &self,
        buf: At<'b>,
        count: u64,
        dtype: DType,
        peer: u32,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::Recv,
            dtype,
            redop: None,
            count,
            peer,
            send: None,
            recv: Some(buf),
        })
    }
    pub fn barrier(&self) -> Result<Pending<'static>> {
        self.post(OpArgs {
            kind: OpKind::Barrier,
            dtype: DType::U8,
            redop: None,
            count: 0,
            peer: 0,
            send: None,
            recv: None,
        })
    }
}
