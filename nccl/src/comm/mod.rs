//! NCCL communicators on commd communicators: the process's one daemon session, creation
//! (blocking, non-blocking and inside groups), the handle table that turns a stale or foreign
//! `ncclComm_t` into `ncclInvalidArgument` instead of a crash, asynchronous errors, split, and
//! the dispatch of each op to the GPU path (stream-ordered, docs/contracts.md #4 and #6) or
//! the host path (`host`, a commd extension).
//!
//! Children: `group` (the thread's group of calls, `ncclGroupStart`/`ncclGroupEnd`, which posts
//! the ops this module defers) and `host` (the host-memory path). They use this module's `Comm`,
//! `Op` and `Ready`; nothing below the crate root uses them but this module and the ABI.
//!
//! May use: `commd_client` (sessions, communicators, GPU ops), `ffi`, `log`, `premul`,
//! `staging`.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

pub(crate) mod group;
mod host;

use std::collections::{BTreeSet, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use commd_client::desc::{DType, OpKind, RedOp};
use commd_client::gpu::CudaOpArgs;
use commd_client::{Client, Communicator, Request};
use commd_cuda::{self as cu, sys};

use crate::ffi::{self, Failure, Outcome, invalid, usage};
use crate::staging::Staging;
use crate::{log, premul};

pub const UNIQUE_ID_BYTES: usize = 128;

/// Requests kept per communicator for their outcome (a failed op's daemon message); older ones
/// are dropped (their failure still shows in the communicator's error word).
const MAX_PENDING: usize = 4096;
/// Finished requests are dropped when this many more were queued (`Comm::track`).
const REAP_EVERY: usize = 16;

pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The process's session with the local daemon (a new one after fork).
pub fn client() -> Outcome<Arc<Client>> {
    static C: Mutex<Option<(u32, Arc<Client>)>> = Mutex::new(None);
    let pid = std::process::id();
    let mut g = lock(&C);
    if let Some((p, c)) = g.as_ref()
        && *p == pid
    {
        return Ok(c.clone());
    }
    let c = Arc::new(Client::connect(None)?);
    *g = Some((pid, c.clone()));
    Ok(c)
}

/// Whether this process can use CUDA (the driver loads and has a device).
pub fn cuda() -> bool {
    cu::driver().is_ok()
}

/// The number of CUDA devices this process sees, when CUDA is loaded.
pub fn device_count() -> Option<i32> {
    if !cuda() {
        return None;
    }
    let mut n = 0;
    // SAFETY: valid out pointer; the driver is loaded.
    let r = unsafe { sys::cuDeviceGetCount(&mut n) };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(n)
}

/// Whether the calling thread has a CUDA context current (CUDA is loaded: [`cuda`]).
fn has_context() -> bool {
    let mut c: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: valid out pointer; the driver is loaded.
    let r = unsafe { sys::cuCtxGetCurrent(&mut c) };
    r == sys::CUresult::CUDA_SUCCESS && !c.is_null()
}

/// The calling thread's current CUDA device (NCCL binds a communicator to it), or -1 without
/// CUDA.
pub fn current_device() -> i32 {
    if !cuda() {
        return -1;
    }
    let mut d: sys::CUdevice = 0;
    // SAFETY: valid out pointer; the driver is loaded. Without a current context it fails and
    // the device is 0, as cudaGetDevice reports then.
    let r = unsafe { sys::cuCtxGetDevice(&mut d) };
    if r == sys::CUresult::CUDA_SUCCESS {
        d
    } else {
        0
    }
}

/// Where an op's buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Memory {
    Device,
    Host,
}

pub fn memory_of(p: u64) -> Memory {
    if !cuda() {
        return Memory::Host;
    }
    let mut t: u32 = 0;
    // SAFETY: MEMORY_TYPE writes one u32 to the valid out pointer; any address may be asked
    // about (unknown host memory answers CUDA_ERROR_INVALID_VALUE).
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut t as *mut u32).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            p,
        )
    };
    if r == sys::CUresult::CUDA_SUCCESS && t == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        Memory::Device
    } else {
        Memory::Host
    }
}

enum Init {
    Joining,
    Ready(Arc<Ready>),
    Failed(Failure),
}

/// A joined communicator.
pub struct Ready {
    pub c: Communicator,
    pub client: Arc<Client>,
}

struct State {
    /// The first asynchronous error (sticky, as NCCL's).
    error: Option<Failure>,
    pending: VecDeque<Request>,
}

/// What an `ncclComm_t` points to.
pub struct Comm {
    pub rank: u32,
    pub nranks: u32,
    pub device: i32,
    pub blocking: bool,
    init: Mutex<Init>,
    joined: Condvar,
    st: Mutex<State>,
    /// Device memory an in-place all-to-all stages its input in (the daemon refuses copies
    /// whose destination overlaps a source).
    staging: Mutex<Staging>,
    /// The text `ncclGetLastError(comm)` returns for this communicator.
    last_error: Mutex<std::ffi::CString>,
    /// Ops made by `ncclRedOpCreatePreMulSum`, and where their scaled inputs are staged.
    pub premul: Mutex<premul::Ops>,
    premul_staging: Mutex<Staging>,
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Every op that read them was waited for by its stream before the communicator could
        // be destroyed.
        lock(&self.staging).free();
        lock(&self.premul_staging).free();
    }
}

/// One op as NCCL's entry points describe it.
#[derive(Clone, Copy, Debug)]
pub struct Op {
    pub kind: OpKind,
    pub dtype: i32,
    pub redop: i32,
    pub count: u64,
    /// Root (rooted ops) or peer (send/recv).
    pub peer: i32,
    pub send: u64,
    pub recv: u64,
    pub stream: usize,
    /// send/recv on device memory: its buffer's allocation (base, size, device), asked once
    /// when the op is called (`execute`) and passed on to the client's direct path.
    pub span: Option<(u64, u64, i32)>,
}

fn live() -> MutexGuard<'static, BTreeSet<usize>> {
    static LIVE: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());
    lock(&LIVE)
}

/// The handle C code holds for `c` (registered as live until [`release`]).
pub fn handle(c: Arc<Comm>) -> *mut Comm {
    let p = Arc::into_raw(c) as *mut Comm;
    live().insert(p as usize);
    p
}

/// The communicator behind a handle the caller passed.
pub fn get(h: *const Comm) -> Outcome<Arc<Comm>> {
    if h.is_null() {
        return Err(invalid("comm is NULL"));
    }
    let l = live();
    if !l.contains(&(h as usize)) {
        return Err(invalid(format!(
            "comm {h:p} is not a live communicator of this library (destroyed, aborted, or never created)"
        )));
    }
    // SAFETY: `h` came from `Arc::into_raw` and is still live (its reference is only given up
    // by `release`, under the same lock), so one more strong reference is valid.
    unsafe {
        Arc::increment_strong_count(h);
        Ok(Arc::from_raw(h))
    }
}

/// Gives up the handle's reference; later calls with it fail cleanly.
pub fn release(h: *const Comm) -> Outcome<Arc<Comm>> {
    let c = get(h)?;
    if live().remove(&(h as usize)) {
        // SAFETY: the reference `handle` created, given up exactly once (removed from LIVE).
        unsafe { drop(Arc::from_raw(h)) };
    }
    Ok(c)
}

impl Comm {
    /// Joins communicator `uid` as `rank` of `nranks` on `device`. Blocking and outside a group:
    /// returns once every rank joined. Otherwise the join runs on its own thread: the handle
    /// is usable at once, ops wait for the join, `ncclCommGetAsyncError` says
    /// `ncclInProgress` until then, and `ncclGroupEnd` waits for joins started in its group.
    /// `name` (`ncclConfig_t.commName`) names it in `commd status` and the daemon's messages.
    pub fn create(
        uid: &[u8; UNIQUE_ID_BYTES],
        rank: i32,
        nranks: i32,
        device: i32,
        blocking: bool,
        name: Option<String>,
    ) -> Outcome<Arc<Comm>> {
        let uid = *uid;
        Self::create_with(rank, nranks, device, blocking, move |cl, rank, nranks| {
            let opts = commd_client::CommOptions {
                name,
                ..Default::default()
            };
            cl.communicator_with(&uid, rank, nranks, opts)
        })
    }

    /// As [`Self::create`], the client's communicator made by `join` (a join by unique id,
    /// or a shrink of a parent) with this rank and size.
    pub fn create_with(
        rank: i32,
        nranks: i32,
        device: i32,
        blocking: bool,
        join: impl FnOnce(&Client, u32, u32) -> commd_client::Result<Communicator> + Send + 'static,
    ) -> Outcome<Arc<Comm>> {
        let n = u32::try_from(nranks)
            .ok()
            .filter(|n| (1..=commd_client::desc::MAX_RANKS).contains(n))
            .ok_or_else(|| {
                invalid(format!(
                    "nranks {nranks} is out of range (1 to {})",
                    commd_client::desc::MAX_RANKS
                ))
            })?;
        let me = u32::try_from(rank)
            .ok()
            .filter(|&r| r < n)
            .ok_or_else(|| invalid(format!("rank {rank} is out of range for {nranks} ranks")))?;
        log::startup(device);
        crate::env::check_init().map_err(usage)?;
        let cl = client()?;
        let comm = Arc::new(Comm {
            rank: me,
            nranks: n,
            device,
            blocking,
            init: Mutex::new(Init::Joining),
            joined: Condvar::new(),
            st: Mutex::new(State {
                error: None,
                pending: VecDeque::new(),
            }),
            staging: Mutex::default(),
            last_error: Mutex::new(std::ffi::CString::default()),
            premul: Mutex::default(),
            premul_staging: Mutex::default(),
        });
        let join = {
            let comm = comm.clone();
            move || {
                let out = join(&cl, comm.rank, comm.nranks)
                    .map(|c| Arc::new(Ready { c, client: cl }))
                    .map_err(Failure::from);
                if let Ok(r) = &out {
                    log::info(log::INIT, comm.device, || {
                        format!(
                            "comm {:p} rank {} nranks {} cudaDev {} commd communicator {:#x} ({} node(s)) - Init COMPLETE",
                            Arc::as_ptr(&comm),
                            comm.rank,
                            comm.nranks,
                            comm.device,
                            r.c.id(),
                            r.c.nodes()
                        )
                    });
                    for p in r.c.paths() {
                        log::info(log::INIT, comm.device, || {
                            format!("commd communicator {:#x}: {p}", r.c.id())
                        });
                    }
                }
                *lock(&comm.init) = match out {
                    Ok(r) => Init::Ready(r),
                    Err(f) => Init::Failed(f),
                };
                comm.joined.notify_all();
            }
        };
        if blocking && !group::active() {
            join();
            comm.ready()?;
        } else {
            std::thread::Builder::new()
                .name("commd-nccl-join".into())
                .spawn(join)
                .map_err(|e| Failure {
                    code: ffi::SYSTEM_ERROR,
                    message: format!("cannot start the join thread: {e}"),
                })?;
            group::joined_later(comm.clone());
        }
        Ok(comm)
    }

    /// This rank as NCCL's `int`.
    pub fn c_rank(&self) -> Outcome<i32> {
        c_int_of(self.rank)
    }

    /// The number of ranks as NCCL's `int`.
    pub fn c_nranks(&self) -> Outcome<i32> {
        c_int_of(self.nranks)
    }

    /// Waits for the join; the joined communicator or why joining failed.
    pub fn ready(&self) -> Outcome<Arc<Ready>> {
        let mut g = lock(&self.init);
        loop {
            match &*g {
                Init::Joining => g = self.joined.wait(g).unwrap_or_else(|p| p.into_inner()),
                Init::Ready(r) => return Ok(r.clone()),
                Init::Failed(f) => return Err(f.clone()),
            }
        }
    }

    pub fn joining(&self) -> bool {
        matches!(&*lock(&self.init), Init::Joining)
    }

    /// The joined communicator for an op or a split: as [`Self::ready`], but a non-blocking
    /// communicator still joining is an error, as in NCCL (its caller must first see
    /// `ncclCommGetAsyncError` report something other than `ncclInProgress`).
    pub fn usable(&self) -> Outcome<Arc<Ready>> {
        if !self.blocking && self.joining() {
            return Err(invalid(
                "attempt to use a non-blocking communicator before its initialisation finished (poll ncclCommGetAsyncError until it is not ncclInProgress)",
            ));
        }
        self.ready()
    }

    /// Drops the finished requests at the front of `pending` (every finished one with `all`),
    /// keeping the first failure. In place: up to `MAX_PENDING` requests may be queued.
    fn reap(st: &mut State, all: bool) {
        let mut failed = Vec::new();
        if all {
            st.pending.retain(|q| match q.test() {
                Ok(done) => !done,
                Err(e) => {
                    failed.push(e);
                    false
                }
            });
        } else {
            while let Some(q) = st.pending.front() {
                match q.test() {
                    Ok(false) => break,
                    Ok(true) => {}
                    Err(e) => failed.push(e),
                }
                st.pending.pop_front();
            }
        }
        for e in failed {
            // A failed request carries the daemon's reason: it replaces a bare error-word
            // failure.
            let f = Failure::from(e);
            if st
                .error
                .as_ref()
                .is_none_or(|x| x.message.starts_with("a GPU op"))
            {
                st.error = Some(f);
            }
        }
    }

    fn track(&self, q: Request) {
        let mut st = lock(&self.st);
        st.pending.push_back(q);
        // Every REAP_EVERY ops, not every op: a look costs a completion query (an event query
        // for an eager direct op), a measurable part of a small op's host time (COMMD_EAGER_PROFILE).
        // A failure is still seen at once by `ncclCommGetAsyncError` (it reaps) and by the
        // client, which fails every later op of a broken communicator.
        if st.pending.len().is_multiple_of(REAP_EVERY) {
            Self::reap(&mut st, false);
        }
        if st.pending.len() > MAX_PENDING {
            st.pending.pop_front();
        }
    }

    /// `ncclCommGetAsyncError`: in progress while joining, else the first failure of any op of
    /// this communicator (a lost peer or daemon, a timeout, a mismatch), sticky.
    pub fn async_error(&self) -> (ffi::ncclResult_t, Option<String>) {
        let r = match &*lock(&self.init) {
            Init::Joining => return (ffi::IN_PROGRESS, None),
            Init::Failed(f) => return (f.code, Some(f.message.clone())),
            Init::Ready(r) => r.clone(),
        };
        let mut st = lock(&self.st);
        if st.error.is_none() {
            Self::reap(&mut st, false);
        }
        if st.error.is_none() {
            if let Some(s) = r.c.cuda_take_error() {
                st.error = Some(Failure {
                    code: ffi::status_result(s),
                    message: format!(
                        "a GPU op on commd communicator {:#x} failed ({})",
                        r.c.id(),
                        commd_client::desc::status::name(s)
                    ),
                });
                // The failed op's completion carries the daemon's reason; it follows the
                // error word closely.
                for _ in 0..20 {
                    Self::reap(&mut st, true);
                    if st
                        .error
                        .as_ref()
                        .is_some_and(|f| !f.message.starts_with("a GPU op"))
                    {
                        break;
                    }
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
            } else if let Err(e) = r.c.cuda_graph_check() {
                st.error = Some(e.into());
            }
        }
        match &st.error {
            Some(f) => (f.code, Some(f.message.clone())),
            None => (ffi::SUCCESS, None),
        }
    }

    fn check_failed(&self) -> Outcome {
        match &lock(&self.st).error {
            Some(f) => Err(Failure {
                code: f.code,
                message: format!("the communicator failed earlier: {}", f.message),
            }),
            None => Ok(()),
        }
    }

    /// Waits for every op this library posted on the communicator (`ncclCommFinalize`).
    pub fn finalize(&self) -> Outcome {
        if self.joining() && !self.blocking {
            // A non-blocking join still running: finalize must not hang on it.
            return Err(Failure {
                code: ffi::IN_PROGRESS,
                message: "the communicator is still joining".into(),
            });
        }
        self.ready()?;
        let pending: Vec<Request> = lock(&self.st).pending.drain(..).collect();
        for q in pending {
            if let Err(e) = q.wait() {
                let f = Failure::from(e);
                lock(&self.st).error.get_or_insert(f.clone());
                return Err(f);
            }
        }
        Ok(())
    }

    /// Drops outstanding requests without waiting (`ncclCommAbort`): the daemon ends the
    /// communicator when the last handle goes, failing peers' ops with "peer lost".
    pub fn abort(&self) {
        lock(&self.st).pending.clear();
    }

    /// Runs one op: on the caller's stream when its buffers are device memory, else through
    /// host staging. A failure of the op itself (not of its arguments) is also the
    /// communicator's sticky async error, as in NCCL.
    pub fn run(self: &Arc<Self>, op: Op) -> Outcome {
        // One process may drive the communicators of several GPUs from one thread (NCCL's
        // `ncclCommInitAll`; nccl-tests `-g 2` posts both ranks' ops in one group without
        // switching devices): the op runs with this communicator's device current, as NCCL
        // does (its buffers' kind asked, its staging allocated, its stream waited on there).
        let out = group::on_device(self.device, || self.execute(op));
        if let Err(f) = &out
            && matches!(
                f.code,
                ffi::REMOTE_ERROR | ffi::SYSTEM_ERROR | ffi::TIMEOUT | ffi::INTERNAL_ERROR
            )
        {
            lock(&self.st).error.get_or_insert(f.clone());
        }
        out
    }

    /// GPU memory held for this communicator (`ncclCommMemStats`): the client's direct-op
    /// windows and send/recv inboxes (`Communicator::cuda_memory_bytes`), and the library's
    /// in-place all-to-all and PreMulSum staging. None of it can be suspended.
    pub fn gpu_memory_bytes(&self) -> u64 {
        let client = match &*lock(&self.init) {
            Init::Ready(r) => r.c.cuda_memory_bytes(),
            _ => 0,
        };
        client + lock(&self.staging).bytes() + lock(&self.premul_staging).bytes()
    }

    /// Sets up the direct send/recv channels with `peers` (`COMMD_P2P_DIRECT`) before a
    /// group's send/recv ops are posted: every pair of the group at once, so that pairs in a
    /// cycle (a ring) cannot wait on each other. A failure leaves the pairs on the daemon's
    /// path; the ops then say why if they fail.
    pub fn prepare_p2p(self: &Arc<Self>, peers: &[u32]) {
        let Ok(r) = self.ready() else { return };
        group::on_device(self.device, || {
            if let Err(e) = r.c.cuda_p2p_prepare(peers, self.device) {
                log::info(log::P2P, self.device, || {
                    format!("direct send/recv setup with ranks {peers:?}: {e}")
                });
            }
        });
    }

    /// Posts held send/recv ops of a group (`ops`, sends first; each already checked by
    /// `execute` before it was held) that can be direct ops as one kernel
    /// (`Communicator::post_cuda_p2p_group`). One flag per op: posted here, or left for `run`
    /// (which also reports any failure of it).
    pub fn post_p2p_group(self: &Arc<Self>, ops: &[Op]) -> Vec<bool> {
        let mut done = vec![false; ops.len()];
        if ops.len() < 2 {
            return done;
        }
        let Ok(r) = self.ready() else { return done };
        if self.check_failed().is_err() {
            return done;
        }
        let args: Vec<CudaOpArgs> = ops.iter().map(p2p_args).collect();
        // SAFETY: NCCL's contract for every op: device buffers holding its elements until its
        // stream passes it, live streams (checked by `execute` when each op was held).
        let posted = group::on_device(self.device, || unsafe { r.c.post_cuda_p2p_group(&args) });
        let Ok(posted) = posted else { return done };
        for ((op, p), d) in ops.iter().zip(posted).zip(done.iter_mut()) {
            let Some(p) = p else { continue };
            log::info(log::P2P, self.device, || {
                format!(
                    "{} posted as part of the group's direct kernel (wait deferred to the group's end)",
                    op.kind.name()
                )
            });
            self.track(p.request);
            group::flush_later(r.clone(), op.stream, self.device);
            *d = true;
        }
        commd_client::gpu::prof::mark(commd_client::gpu::prof::TRACKED);
        done
    }

    /// Whether a held send/recv `op` of a group would run as a direct op if posted now
    /// (`Communicator::cuda_p2p_direct_eligible`): the group's end posts such ops before the
    /// others, on every rank alike.
    pub fn p2p_direct_eligible(self: &Arc<Self>, op: &Op) -> bool {
        let Ok(r) = self.ready() else { return false };
        op.count > 0
            && op.kind.is_p2p()
            && group::on_device(self.device, || r.c.cuda_p2p_direct_eligible(&p2p_args(op)))
    }

    fn execute(self: &Arc<Self>, op: Op) -> Outcome {
        let r = self.usable()?;
        self.check_failed()?;
        // A PreMulSum op (`premul`): this rank's input scaled, then summed.
        let pre = if op.kind.reduces() && op.redop >= premul::FIRST_OP {
            Some(lock(&self.premul).get(op.redop, op.dtype)?)
        } else {
            None
        };
        let (dtype, redop) = if let Some(p) = pre {
            (p.dtype, Some(RedOp::Sum))
        } else if op.kind.reduces() {
            let (d, o) = ffi::reduce_types(op.dtype, op.redop)?;
            (d, Some(o))
        } else {
            (ffi::copy_dtype(op.dtype)?, None)
        };
        if (op.kind.has_root() || op.kind.is_p2p())
            && !u32::try_from(op.peer).is_ok_and(|p| p < self.nranks)
        {
            let what = if op.kind.is_p2p() { "peer" } else { "root" };
            return Err(invalid(format!(
                "{what} {} is out of range for {} ranks",
                op.peer, self.nranks
            )));
        }
        if op.count > commd_client::desc::MAX_COUNT {
            return Err(invalid(format!("count {} is too large", op.count)));
        }
        if op.count == 0 {
            return Ok(());
        }
        let me = u32::try_from(op.peer) == Ok(self.rank);
        let send = op.kind.uses_send(me).then_some(op.send);
        let recv = op.kind.uses_recv(me).then_some(op.recv);
        if send == Some(0) {
            return Err(invalid("sendbuff is NULL"));
        }
        if recv == Some(0) {
            return Err(invalid("recvbuff is NULL"));
        }
        // Asked with the communicator's device current (`run`): without a context the driver
        // answers nothing, and device memory taken for host memory would be read by the CPU.
        // One query for both buffers in place (a driver call each: part of a small op's cost).
        // A send/recv has one buffer: asked for its allocation at once (device memory's base,
        // size and device, which its direct path needs too), else for the kind of memory.
        let mut op = op;
        let mem: Vec<Memory> = match (send, recv) {
            (Some(s), Some(r)) if s == r => vec![memory_of(s); 2],
            (Some(b), None) | (None, Some(b)) if op.kind.is_p2p() && cuda() => {
                match commd_client::gpu::pointer_span(b) {
                    Ok(span) => {
                        op.span = Some(span);
                        vec![Memory::Device]
                    }
                    Err(_) => vec![memory_of(b)],
                }
            }
            _ => [send, recv].into_iter().flatten().map(memory_of).collect(),
        };
        if mem.len() == 2 && mem[0] != mem[1] {
            return Err(usage(
                "sendbuff and recvbuff are in different kinds of memory (one CUDA device memory, one host memory)",
            ));
        }
        let subsys = if op.kind.is_p2p() {
            log::P2P
        } else {
            log::COLL
        };
        log::info(subsys, self.device, || {
            format!(
                "{}: count {} datatype {} op {} root/peer {} comm {:p} [nranks={}] stream {:#x} {:?}",
                op.kind.name(),
                op.count,
                op.dtype,
                op.redop,
                op.peer,
                Arc::as_ptr(self),
                self.nranks,
                op.stream,
                mem.first().copied().unwrap_or(Memory::Host)
            )
        });
        if mem.first() == Some(&Memory::Device) {
            if op.kind.is_p2p() && group::holds_p2p() {
                // Checked above; posted at the group's end, every send before any receive.
                group::defer_p2p(self.clone(), op);
                return Ok(());
            }
            return self.post_on_device(&r, &op, pre, (dtype, redop), (send, recv));
        }
        if cuda() && (op.stream != 0 || has_context()) {
            // Host memory a stream may still be writing (pinned memory a copy fills, say):
            // ordered after it, conservatively. The NULL stream too (the legacy default
            // stream of the current context; a thread with no context has queued nothing).
            // SAFETY: the caller's live stream.
            let e = unsafe { sys::cuStreamSynchronize(op.stream as sys::CUstream) };
            cu::ck(e, "cuStreamSynchronize").map_err(|e| Failure {
                code: ffi::UNHANDLED_CUDA_ERROR,
                message: e.to_string(),
            })?;
        }
        // SAFETY: NCCL's contract: the pointers hold the op's elements (host memory).
        let h = unsafe {
            host::start(
                &r,
                op.kind,
                dtype,
                redop,
                op.count,
                op.peer,
                send,
                recv,
                pre.map(|p| p.scalar),
            )
        }?;
        if group::active() {
            group::finish_later(h);
            Ok(())
        } else {
            h.finish()
        }
    }

    /// The device-memory branch of [`Self::execute`]: the op on the caller's stream, with
    /// this communicator's device current.
    fn post_on_device(
        &self,
        r: &Arc<Ready>,
        op: &Op,
        pre: Option<premul::PreMul>,
        (dtype, redop): (DType, Option<RedOp>),
        (send, recv): (Option<u64>, Option<u64>),
    ) -> Outcome {
        let subsys = if op.kind.is_p2p() {
            log::P2P
        } else {
            log::COLL
        };
        let mut a = CudaOpArgs::new(op.kind, dtype, op.count, op.stream as sys::CUstream);
        a.redop = redop;
        a.peer = u32::try_from(op.peer).unwrap_or(0);
        a.send = send;
        a.recv = recv;
        let mut staged = None;
        if op.kind == OpKind::AllToAll {
            let bytes = op.count * u64::from(self.nranks) * dtype.size();
            if op.send < op.recv + bytes && op.recv < op.send + bytes {
                // NCCL allows it, the daemon's copy plan does not: the input is staged.
                let mut st = lock(&self.staging);
                // SAFETY: NCCL's contract: the input is device memory of this process,
                // `bytes` long, and the stream is live.
                a.send = Some(unsafe {
                    st.copy_in(op.send, bytes, op.stream, "in-place all-to-all staging")
                }?);
                staged = Some(st);
            }
        }
        a.defer_wait = op.kind.is_p2p();
        a.p2p_direct = op.kind.is_p2p();
        if let (Some(p), Some(s)) = (pre, send) {
            let elems = op
                .kind
                .send_elems(op.count, u64::from(self.nranks))
                .unwrap_or(op.count);
            let mut st = lock(&self.premul_staging);
            // SAFETY: NCCL's contract for `s` and the stream.
            a.send = Some(unsafe { premul::scale(&mut st, &p, s, elems, op.stream) }?);
            staged = Some(st);
        }
        // SAFETY: NCCL's contract: the buffers are device memory of this process holding
        // the op's elements until the stream passes the op, and the stream is live (the
        // staged input lives with the communicator).
        let posted = unsafe { r.c.post_cuda_ordered(a) };
        if let Some(mut st) = staged {
            st.done(op.stream)?;
        }
        let posted = posted?;
        log::info(subsys, self.device, || {
            format!(
                "{} posted: last ticket {}{}",
                op.kind.name(),
                posted.last_ticket,
                if a.defer_wait {
                    " (wait deferred to the group's end)"
                } else {
                    ""
                }
            )
        });
        // A captured op (docs/contracts.md #6) runs at each replay; its failures come back through
        // the error word and the graph check, not through this request.
        if !posted.captured {
            self.track(posted.request);
        }
        if a.defer_wait {
            if group::active() {
                group::flush_later(r.clone(), op.stream, self.device);
            } else {
                // SAFETY: the caller's live stream.
                unsafe { r.c.cuda_flush(op.stream as sys::CUstream) }?;
            }
        }
        Ok(())
    }

    /// The text `ncclGetLastError(comm)` gives: this communicator's failure, if it has one.
    pub fn last_error_ptr(&self) -> Option<*const std::ffi::c_char> {
        let msg = lock(&self.st).error.as_ref()?.message.replace('\0', "\\0");
        let mut g = lock(&self.last_error);
        // Replaced only when the text changed, so a pointer handed out earlier stays valid
        // while the text is the same.
        if g.as_bytes() != msg.as_bytes() {
            *g = std::ffi::CString::new(msg).unwrap_or_default();
        }
        Some(g.as_ptr())
    }

    /// `ncclCommSplit`: every rank of this communicator calls it; ranks of one color form a
    /// new communicator, ordered by key then by their rank here. Two host all-gathers on this
    /// communicator carry (color, key) and the new communicators' ids.
    pub fn split(&self, color: i32, key: i32, blocking: bool) -> Outcome<Option<Arc<Comm>>> {
        let r = self.usable()?;
        self.check_failed()?;
        if color < -1 {
            return Err(invalid(format!(
                "color {color} is invalid (a color is >= 0, or NCCL_SPLIT_NOCOLOR)"
            )));
        }
        let n = self.nranks as usize;
        let cl = &r.client;
        let mut mine = cl.alloc(8)?;
        mine.as_mut_slice()[..4].copy_from_slice(&color.to_le_bytes());
        mine.as_mut_slice()[4..8].copy_from_slice(&key.to_le_bytes());
        let all = cl.alloc(8 * n as u64)?;
        r.c.all_gather((&mine, 0), (&all, 0), 8, DType::U8)?
            .wait()?;
        let ck: Vec<(i32, i32)> = all
            .as_slice()
            .chunks_exact(8)
            .map(|b| {
                (
                    i32::from_le_bytes([b[0], b[1], b[2], b[3]]),
                    i32::from_le_bytes([b[4], b[5], b[6], b[7]]),
                )
            })
            .collect();
        let mut members: Vec<usize> = (0..n).filter(|&i| color >= 0 && ck[i].0 == color).collect();
        let leader = members.first().copied();
        members.sort_by_key(|&i| (ck[i].1, i));
        let mut uid_mine = cl.alloc(UNIQUE_ID_BYTES as u64)?;
        if leader == Some(self.rank as usize) {
            let u = cl.unique_id()?;
            if u.len() != UNIQUE_ID_BYTES {
                return Err(Failure {
                    code: ffi::INTERNAL_ERROR,
                    message: format!("the daemon's unique id has {} bytes, not 128", u.len()),
                });
            }
            uid_mine.as_mut_slice().copy_from_slice(&u);
        }
        let uids = cl.alloc((UNIQUE_ID_BYTES * n) as u64)?;
        r.c.all_gather(
            (&uid_mine, 0),
            (&uids, 0),
            UNIQUE_ID_BYTES as u64,
            DType::U8,
        )?
        .wait()?;
        let Some(leader) = leader else {
            return Ok(None);
        };
        let mut uid = [0u8; UNIQUE_ID_BYTES];
        uid.copy_from_slice(&uids.as_slice()[leader * UNIQUE_ID_BYTES..][..UNIQUE_ID_BYTES]);
        let new_rank = members
            .iter()
            .position(|&i| i == self.rank as usize)
            .unwrap_or(0);
        log::info(log::INIT, self.device, || {
            format!(
                "ncclCommSplit comm {:p} rank {} color {color} key {key} -> rank {new_rank} of {}",
                self as *const Comm,
                self.rank,
                members.len()
            )
        });
        Comm::create(
            &uid,
            c_int_of(new_rank)?,
            c_int_of(members.len())?,
            self.device,
            blocking,
            None,
        )
        .map(Some)
    }
}

/// A rank or rank count of a communicator as NCCL's `int`: exact, as `Comm::create` keeps
/// them within `MAX_RANKS` (2^16); the error is for a broken invariant only.
fn c_int_of<T: TryInto<i32> + Copy + std::fmt::Display>(v: T) -> Outcome<i32> {
    v.try_into().map_err(|_| Failure {
        code: ffi::INTERNAL_ERROR,
        message: format!("rank {v} does not fit a C int"),
    })
}

/// Element size of an NCCL data type.
pub fn elem_size(dtype: i32) -> Outcome<u64> {
    Ok(ffi::copy_dtype(dtype)?.size())
}

/// The client's arguments for a held send/recv of a group (`Comm::post_p2p_group`).
fn p2p_args(op: &Op) -> CudaOpArgs {
    let dtype = ffi::copy_dtype(op.dtype);
    let mut a = CudaOpArgs::new(
        op.kind,
        *dtype.as_ref().unwrap_or(&DType::U8),
        op.count,
        op.stream as sys::CUstream,
    );
    a.peer = u32::try_from(op.peer).unwrap_or(0);
    if op.kind == OpKind::Send {
        a.send = Some(op.send);
    } else {
        a.recv = Some(op.recv);
    }
    a.defer_wait = true;
    // An op whose dtype has no copy type is left to `run`, which reports it.
    a.p2p_direct = dtype.is_ok();
    a.span = op.span;
    a
}
