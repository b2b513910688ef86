//! Sessions: one per client process. A session owns its ring (a daemon-created memfd), its
//! memory registrations and its communicator handles, and runs one ring-poller thread
//! (`commd-ring-<id>`) that validates each descriptor and posts it to its communicator.
//!
//! Everything read from the ring is hostile input: the SQ tail is checked against the capacity,
//! each descriptor is copied out before it is decoded, and memory is resolved only through this
//! session's own registration table with bounds and alignment checks.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use commd_proto::desc::{CompletionDesc, status};
use commd_proto::ring::{Ring, RingLayout};

use crate::comm::{Comm, CudaTicket, Posted};
use crate::cuda::{DevMem, GpuBufs, GpuSpan};
use crate::engine::{RankBufs, Span};
use crate::shm::MemRegion;

/// Error messages kept per session for `GetOpError` (oldest dropped first).
const MAX_ERRORS: usize = 4096;
/// Fds staged on the fd socket but not yet registered.
pub const MAX_STAGED: usize = 256;

#[derive(Default)]
pub struct Tables {
    pub mems: HashMap<u32, Arc<MemRegion>>,
    pub next_mem: u32,
    pub registered_bytes: u64,
    pub comms: HashMap<u32, (Arc<Comm>, u32)>,
    pub next_comm: u32,
    /// Fds staged on the fd socket, with when (expired by `Daemon::expire_staged`).
    pub staged: HashMap<u64, (OwnedFd, Instant)>,
    /// CUDA registrations (same id space as `mems`), and the IPC handle -> mem id cache that
    /// makes the daemon open each allocation once per session.
    pub cuda_mems: HashMap<u32, Arc<DevMem>>,
    pub ipc_cache: HashMap<Vec<u8>, u32>,
    /// GPUs (bit per index) this session's process was seen to hold open
    /// (`cuda_ipc_owner_check`): checked once per GPU, not at every open.
    pub gpus_held: u64,
    /// Communicator handle -> doorbell slot.
    pub doorbell_slots: HashMap<u32, u32>,
    /// GPU scratch shared by this session's communicators, by (GPU, bytes): a rank's
    /// communicators on one GPU reduce through the same scratch, one op at a time (the
    /// executor serializes the jobs that share one), instead of one allocation each
    /// (with an allocation each, 64 communicators of 2 ranks would hold 8 GiB per rank).
    pub scratch_pool: HashMap<(usize, u64), Arc<DevMem>>,
    errors: HashMap<u64, (u32, String)>,
    error_order: VecDeque<u64>,
    /// Graph doorbell slot -> the status and message of the first failed replay of the
    /// persistent op there (`GetGraphOpError`); at most one per slot, so bounded by the area.
    graph_errors: HashMap<u32, (u32, String)>,
}

pub struct Session {
    pub id: u64,
    pub uid: u32,
    pub pid: i32,
    pub name: String,
    pub secret: [u8; 16],
    pub created: Instant,
    pub ring_file: File,
    pub ring: Ring,
    cq_tail: Mutex<u32>,
    tables: Mutex<Tables>,
    closed: AtomicBool,
    pub attached: AtomicBool,
    /// Set when the client broke the ring protocol; the poller closes the session.
    violation: Mutex<Option<String>>,
    pub ops_completed: AtomicU64,
    pub ops_failed: AtomicU64,
    pub ipc_opens: AtomicU64,
    pub ipc_hits: AtomicU64,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Session({} pid {})", self.id, self.pid)
    }
}

/// Communicators complete the ops of a session through this (they never name `Session`).
impl crate::comm::Origin for Session {
    fn complete(
        &self,
        user_data: u64,
        comm: u32,
        seq: u64,
        st: u32,
        msg: Option<String>,
        source: u64,
    ) {
        Session::complete_from(self, user_data, comm, seq, st, msg, source)
    }
}

/// The GPU executor sees a session through this (it never names `Session`).
impl crate::cuda::Client for Session {
    fn id(&self) -> u64 {
        self.id
    }
    fn pid(&self) -> i32 {
        self.pid
    }
    fn ring(&self) -> &Ring {
        &self.ring
    }
    fn is_closed(&self) -> bool {
        Session::is_closed(self)
    }
    fn set_graph_error(&self, slot: u32, st: u32, msg: &str) {
        Session::set_graph_error(self, slot, st, msg)
    }
}

impl Session {
    pub fn new(
        id: u64,
        uid: u32,
        pid: i32,
        name: String,
        secret: [u8; 16],
        layout: RingLayout,
    ) -> std::io::Result<Self> {
        let fd = rustix::fs::memfd_create(
            format!("commd-ring-{id}"),
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )?;
        rustix::fs::ftruncate(&fd, layout.total_bytes)?;
        rustix::fs::fcntl_add_seals(
            &fd,
            rustix::fs::SealFlags::SHRINK
                | rustix::fs::SealFlags::GROW
                | rustix::fs::SealFlags::SEAL,
        )?;
        let ring_file = File::from(fd);
        let ring = Ring::create(&ring_file, layout, id, std::process::id())
            .map_err(std::io::Error::other)?;
        Ok(Self {
            id,
            uid,
            pid,
            name,
            secret,
            created: Instant::now(),
            ring_file,
            ring,
            cq_tail: Mutex::new(0),
            tables: Mutex::new(Tables::default()),
            closed: AtomicBool::new(false),
            attached: AtomicBool::new(false),
            violation: Mutex::new(None),
            ops_completed: AtomicU64::new(0),
            ops_failed: AtomicU64::new(0),
            ipc_opens: AtomicU64::new(0),
            ipc_hits: AtomicU64::new(0),
        })
    }

    pub fn tables(&self) -> MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Marks the session closed (idempotent); returns true the first time. Wakes the poller and
    /// any client waiter. Cleanup of communicators is the daemon's job.
    pub fn mark_closed(&self, st: u32) -> bool {
        if self.closed.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.ring
            .session_error()
            .store(st.max(1), Ordering::Release);
        Ring::ring_bell(self.ring.sq_bell(), self.ring.sq_sleeping());
        commd_proto::futex::wake_all(self.ring.sq_bell());
        Ring::ring_bell(self.ring.cq_bell(), self.ring.cq_sleepers());
        true
    }

    /// Posts a completion (and keeps the message for `GetOpError`). Never blocks on the client.
    pub fn complete(&self, user_data: u64, comm: u32, seq: u64, st: u32, msg: Option<String>) {
        self.complete_from(user_data, comm, seq, st, msg, 0)
    }

    /// [`Session::complete`] with the completion's `source` field (a receive from any source).
    pub fn complete_from(
        &self,
        user_data: u64,
        comm: u32,
        seq: u64,
        st: u32,
        msg: Option<String>,
        source: u64,
    ) {
        if st == status::OK {
            self.ops_completed.fetch_add(1, Ordering::Relaxed);
        } else {
            self.ops_failed.fetch_add(1, Ordering::Relaxed);
        }
        if self.is_closed() {
            return;
        }
        if let Some(m) = msg {
            let mut t = self.tables();
            if t.error_order.len() >= MAX_ERRORS
                && let Some(old) = t.error_order.pop_front()
            {
                t.errors.remove(&old);
            }
            t.errors.insert(user_data, (st, m));
            t.error_order.push_back(user_data);
        }
        let mut tail = self.cq_tail.lock().unwrap_or_else(|e| e.into_inner());
        let head = self.ring.cq_head().load(Ordering::Acquire);
        if tail.wrapping_sub(head) >= self.ring.layout().cq_entries {
            // The client promised never to have more ops in flight than CQ entries.
            *self.violation.lock().unwrap_or_else(|e| e.into_inner()) = Some(format!(
                "completion queue overflow (head {head}, tail {}): client exceeded its in-flight limit",
                *tail
            ));
            return;
        }
        let c = CompletionDesc {
            user_data,
            status: st,
            comm,
            seq,
            source,
        };
        self.ring.write_cq(*tail, &c);
        *tail = tail.wrapping_add(1);
        self.ring.cq_tail().store(*tail, Ordering::Release);
        Ring::ring_bell(self.ring.cq_bell(), self.ring.cq_sleepers());
    }

    /// Records why a replay of the persistent op in graph doorbell `slot` failed (the first
    /// reason is kept until the client reads it).
    pub fn set_graph_error(&self, slot: u32, st: u32, msg: &str) {
        if slot < commd_proto::desc::graph_doorbell::SLOTS {
            self.tables()
                .graph_errors
                .entry(slot)
                .or_insert_with(|| (st, msg.to_string()));
        }
    }

    /// The failure recorded for graph doorbell `slot`, removed.
    pub fn take_graph_error(&self, slot: u32) -> Option<(u32, String)> {
        self.tables().graph_errors.remove(&slot)
    }

    pub fn take_error(&self, user_data: u64) -> Option<(u32, String)> {
        let mut t = self.tables();
        let e = t.errors.remove(&user_data);
        if e.is_some() {
            t.error_order.retain(|u| *u != user_data);
        }
        e
    }

    fn take_violation(&self) -> Option<String> {
        self.violation
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Resolves `(mem_id, off)` for `bytes` bytes of `esize`-sized elements.
    fn span(&self, what: &str, mem: u32, off: u64, bytes: u64, esize: u64) -> Result<Span, String> {
        let region = self
            .tables()
            .mems
            .get(&mem)
            .cloned()
            .ok_or_else(|| format!("{what} buffer names unknown memory handle {mem}"))?;
        if !off.is_multiple_of(esize) {
            return Err(format!(
                "{what} buffer offset {off} is not aligned to the element size {esize}"
            ));
        }
        let len = region.len();
        let span = Span::new(region.clone(), off, bytes)
            .ok_or_else(|| format!("{what} buffer (mem {mem}, offset {off}, {bytes} bytes) lies outside its registration of {len} bytes"))?;
        region.check_populated(off, bytes).map_err(|why| {
            format!("{what} buffer (mem {mem}, offset {off}, {bytes} bytes): {why}")
        })?;
        Ok(span)
    }

    /// Resolves `(mem_id, off)` of a CUDA registration.
    fn gpu_span(
        &self,
        what: &str,
        mem: u32,
        off: u64,
        bytes: u64,
        esize: u64,
    ) -> Result<GpuSpan, String> {
        let t = self.tables();
        let m = t.cuda_mems.get(&mem).cloned().ok_or_else(|| {
            if t.mems.contains_key(&mem) {
                format!("{what} buffer (mem {mem}) is host memory, but the op is a GPU op")
            } else {
                format!("{what} buffer names unknown GPU memory handle {mem}")
            }
        })?;
        drop(t);
        if !off.is_multiple_of(esize) {
            return Err(format!(
                "{what} buffer offset {off} is not aligned to the element size {esize}"
            ));
        }
        let len = m.len;
        let mut span = GpuSpan::new(m, off, bytes).ok_or_else(|| {
            format!("{what} buffer (mem {mem}, offset {off}, {bytes} bytes) lies outside its registration of {len} bytes")
        })?;
        span.pin = span.mem.pin(off, bytes).map_err(|why| {
            format!("{what} buffer (mem {mem}, offset {off}, {bytes} bytes): {why}")
        })?;
        Ok(span)
    }

    /// The doorbell of a GPU op on communicator handle `comm` of `nranks` ranks.
    fn cuda_ticket(&self, op: &commd_proto::desc::Op, nranks: u32) -> Option<CudaTicket> {
        let ticket = op.cuda_ticket?;
        let comm_slot = self
            .tables()
            .doorbell_slots
            .get(&op.comm)
            .copied()
            .unwrap_or(commd_proto::desc::doorbell::NO_SLOT);
        // A persistent op names its graph doorbell slot; its phase values start at 1.
        let (slot, ticket) = if op.persistent {
            (ticket, commd_proto::graph::phase_value(0))
        } else {
            (comm_slot, ticket)
        };
        let slot_bytes = crate::cuda::get().map(|c| c.slot_bytes).unwrap_or(1 << 20);
        // Host-staged (multi-node) GPU ops have one phase (`flags::HOST_STAGED`).
        let phases = if op.staged {
            1
        } else {
            commd_proto::desc::cuda_phases(
                op.kind,
                op.count,
                op.dtype.size(),
                nranks,
                slot_bytes,
                op.one_shot,
            )
        };
        Some(CudaTicket {
            slot,
            ticket,
            phases: u32::try_from(phases.min(u64::from(u32::MAX / 2)))
                .expect("clamped to u32::MAX / 2"),
            graph: op.persistent,
            comm_slot,
        })
    }

    /// Checks the decoded op's field combinations, then resolves both buffers of the op for a
    /// communicator of `nranks` where this rank is `rank`.
    fn resolve(
        &self,
        op: &commd_proto::desc::Op,
        rank: u32,
        nranks: u32,
    ) -> Result<(RankBufs, GpuBufs), String> {
        // Field combinations (a bitwise reduction on a float dtype) are checked here rather than
        // in `decode`, so the op keeps its sequence number and every rank learns of the error.
        op.check().map_err(|e| e.to_string())?;
        if (op.kind.has_root() || op.kind.is_p2p()) && op.peer >= nranks {
            let what = if op.kind.is_p2p() { "peer" } else { "root" };
            return Err(format!(
                "{what} rank {} is out of range for {nranks} ranks",
                op.peer
            ));
        }
        let es = op.dtype.size();
        let n = u64::from(nranks);
        let me_root = op.peer == rank;
        let bytes = |elems: Option<u64>| {
            elems
                .and_then(|e| e.checked_mul(es))
                .ok_or_else(|| format!("count {} overflows the buffer size", op.count))
        };
        let mut bufs = RankBufs::default();
        let mut gbufs = GpuBufs::default();
        if op.cuda_ticket.is_some() {
            if let Err(why) = crate::cuda::get() {
                return Err(format!("GPU op, but this daemon has no CUDA: {why}"));
            }
            if self
                .tables()
                .doorbell_slots
                .get(&op.comm)
                .is_none_or(|s| *s == commd_proto::desc::doorbell::NO_SLOT)
            {
                return Err("GPU op on a communicator without a doorbell slot (more than 256 communicators in this process)".into());
            }
            if op.kind.uses_send(me_root) {
                let b = bytes(op.kind.send_elems(op.count, n))?;
                gbufs.send = Some(self.gpu_span("send", op.send_mem, op.send_off, b, es)?);
            }
            if op.kind.uses_recv(me_root) {
                let b = bytes(op.kind.recv_elems(op.count, n))?;
                gbufs.recv = Some(self.gpu_span("recv", op.recv_mem, op.recv_off, b, es)?);
            }
            return Ok((bufs, gbufs));
        }
        if op.kind.uses_send(me_root) {
            let b = bytes(op.kind.send_elems(op.count, n))?;
            bufs.send = Some(self.span("send", op.send_mem, op.send_off, b, es)?);
        }
        if op.kind.uses_recv(me_root) {
            let b = bytes(op.kind.recv_elems(op.count, n))?;
            bufs.recv = Some(self.span("recv", op.recv_mem, op.recv_off, b, es)?);
        }
        Ok((bufs, gbufs))
    }

    /// Handles one descriptor copied out of the SQ.
    fn process(self: &Arc<Self>, d: commd_proto::desc::SubmitDesc) {
        let op = match d.decode() {
            Ok(op) => op,
            Err(e) => {
                self.complete(
                    d.user_data,
                    d.comm,
                    0,
                    status::INVALID,
                    Some(format!("invalid descriptor: {e}")),
                );
                return;
            }
        };
        let entry = self.tables().comms.get(&op.comm).cloned();
        let Some((comm, rank)) = entry else {
            self.complete(
                op.user_data,
                op.comm,
                0,
                status::INVALID,
                Some(format!(
                    "{} names unknown communicator handle {}",
                    op.kind.name(),
                    op.comm
                )),
            );
            return;
        };
        let cuda = self.cuda_ticket(&op, comm.nranks);
        let ((bufs, gbufs), invalid) = match self.resolve(&op, rank, comm.nranks) {
            Ok(b) => (b, None),
            Err(why) => ((RankBufs::default(), GpuBufs::default()), Some(why)),
        };
        if let (Some(why), true) = (&invalid, op.kind.is_p2p() && op.peer >= comm.nranks) {
            // A p2p op with a bad peer can never be matched: fail it alone, now.
            if let Some(c) = cuda
                && c.graph
            {
                if let Ok(cu) = crate::cuda::get() {
                    let bell = crate::cuda::Bell {
                        session: self.clone() as Arc<dyn crate::cuda::Client>,
                        rank,
                        slot: c.slot,
                        ticket: c.ticket,
                        graph: true,
                        comm_slot: c.comm_slot,
                    };
                    cu.poison_graph_op(vec![bell], c.phases, status::INVALID, why.clone());
                }
            } else if let Some(c) = cuda {
                crate::cuda::fail_doorbell(
                    &**self,
                    c.slot,
                    c.ticket.wrapping_add(c.phases.max(1) - 1),
                    status::INVALID,
                );
            }
            self.complete(
                op.user_data,
                op.comm,
                0,
                status::INVALID,
                Some(format!(
                    "{}: {} on rank {rank}: {why}",
                    comm.label(),
                    op.kind.name()
                )),
            );
            return;
        }
        // A receive from any source owes no rank its failure (it has no sequence number yet),
        // so one that cannot run fails alone, now: an invalid one, and one on a communicator
        // that spans nodes (other nodes' ranks send through their own daemons, which match by
        // pair sequence number).
        let refuse_any = match (&invalid, op.any_source) {
            (_, false) => None,
            (Some(why), true) => Some(why.clone()),
            (None, true) if comm.members.iter().any(|m| !m.local) => Some(format!(
                "supported among the ranks of one node, and this communicator spans {} nodes; name the source rank",
                crate::comm::comm_nodes(&comm)
            )),
            (None, true) => None,
        };
        if let Some(why) = refuse_any {
            self.complete(
                op.user_data,
                op.comm,
                0,
                status::INVALID,
                Some(format!(
                    "{}: recv from any source on rank {rank}: {why}",
                    comm.label()
                )),
            );
            return;
        }
        comm.post(Posted {
            op,
            rank,
            session: self.clone(),
            bufs,
            posted_at: Instant::now(),
            seq: 0,
            invalid,
            cuda,
            gbufs,
            transport: crate::telemetry::transport::SHM,
        });
    }

    /// The ring-poller loop; returns when the session is closed or the client breaks the protocol
    /// (the returned string says how).
    pub fn poll_loop(self: &Arc<Self>, spin: Duration) -> Option<String> {
        let ring = &self.ring;
        let entries = ring.layout().sq_entries;
        let mut head: u32 = 0;
        loop {
            if self.is_closed() {
                return None;
            }
            if let Some(v) = self.take_violation() {
                return Some(v);
            }
            let tail = ring.sq_tail().load(Ordering::Acquire);
            let avail = tail.wrapping_sub(head);
            if avail > entries {
                return Some(format!(
                    "submission queue tail {tail} is {avail} entries past head {head} (capacity {entries})"
                ));
            }
            if avail == 0 {
                self.idle_wait(head, spin);
                continue;
            }
            for _ in 0..avail {
                let d = ring.read_sq(head);
                head = head.wrapping_add(1);
                ring.sq_head().store(head, Ordering::Release);
                self.process(d);
            }
        }
    }

    /// Polls (yielding between looks) for `spin`, then sleeps on the SQ doorbell until the tail moves (or 100 ms pass).
    fn idle_wait(&self, head: u32, spin: Duration) {
        let ring = &self.ring;
        let t0 = Instant::now();
        while t0.elapsed() < spin {
            if ring.sq_tail().load(Ordering::Acquire) != head || self.is_closed() {
                return;
            }
            // Yield rather than burn: on a busy node the client processes need the core more.
            std::thread::yield_now();
        }
        ring.sq_sleeping().store(1, Ordering::SeqCst);
        let bell = ring.sq_bell().load(Ordering::SeqCst);
        if ring.sq_tail().load(Ordering::SeqCst) == head && !self.is_closed() {
            commd_proto::futex::wait(ring.sq_bell(), bell, Duration::from_millis(100));
        }
        ring.sq_sleeping().store(0, Ordering::SeqCst);
        ring.daemon_beat().fetch_add(1, Ordering::Relaxed);
    }
}
