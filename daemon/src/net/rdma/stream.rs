//! A one-way byte stream over one RC queue pair, with the same nonblocking `read`/`write`
//! contract as a TCP socket, so [`crate::net::wire::Wire`] frames, chunks and heartbeats run
//! unchanged over RDMA.
//!
//! Data: the sender copies into its registered staging ring and posts RDMA WRITE WITH IMMEDIATE
//! at the same offset of the receiver's registered ring (the immediate is the byte count); the
//! receiver's completion adds to its readable bytes. Flow control: the receiver returns credits
//! (bytes consumed) as a zero-length SEND WITH IMMEDIATE (inline, no payload) once it has
//! consumed an eighth of the ring, so the sender never overwrites unread data. Rings are
//! registered once and pooled per device ([`super::Nic`]): no per-op registration, no
//! per-chunk allocation on our side.
//!
//! Completions are polled by one thread per device (`commd-rdma-poll`, adaptive backoff: spin,
//! then sleeps growing to 1 ms); it reposts receives, updates the stream's counters and signals
//! its eventfd, which the wire thread polls like a socket. A failed completion (retry exceeded
//! when the peer died, a flushed QP, ...) makes every later `read`/`write` of the stream fail
//! with the status text, which the wire reports as a lost node.

#![allow(unsafe_code)] // verbs calls and memory registered with the NIC

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, GenericCompletionQueue};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};

use super::Nic;

/// Receive work requests kept posted per QP (each WRITE WITH IMM or credit consumes one).
pub const RQ_DEPTH: u32 = 256;
/// Send work requests in flight per QP.
pub const SQ_DEPTH: u32 = 128;
/// Inline data asked for at QP creation (bytes).
const INLINE_MAX: usize = 64;
const WR_SEND: u64 = 1;
const WR_RECV: u64 = 2;

/// Bytes the sender may write into a ring of `len` bytes after writing `pos` in total, of which
/// the receiver consumed `consumed`.
fn ring_free(len: u64, pos: u64, consumed: u64) -> u64 {
    len - (pos - consumed)
}

/// `n` bytes at ring offset `pos % len`: the lengths before and after the wrap.
fn ring_split(len: u64, pos: u64, n: u64) -> (u64, u64) {
    let at = pos % len;
    let first = (len - at).min(n);
    (first, n - first)
}

/// Whether the receiver returns `owed` consumed bytes as credits now: once an eighth of the
/// ring, or anything when it has nothing left to read (so the sender never waits on a remainder).
fn credit_due(owed: u64, len: u64, idle: bool) -> bool {
    owed > 0 && (idle || owed >= len / 8)
}

/// A registered host buffer (page aligned), pooled per device and reused across communicators.
pub struct Staging {
    // Field order matters: the MR is deregistered (dropped) before the mapping is unmapped.
    pub mr: Arc<MemoryRegion>,
    pub map: memmap2::MmapMut,
}

impl Staging {
    pub fn new(nic: &Nic, len: usize) -> io::Result<Self> {
        let mut map = memmap2::MmapMut::map_anon(len)?;
        let ptr = map.as_mut_ptr() as usize;
        // SAFETY: the mapping is valid for len bytes and lives in the same struct as the MR; the
        // MR field is declared first, so it is deregistered before the mapping goes away.
        let mr = unsafe {
            nic.pd
                .reg_mr(ptr, len, AccessFlags::LocalWrite | AccessFlags::RemoteWrite)
        }
        .map_err(|e| io::Error::other(format!("registering {len} bytes on {}: {e}", nic.name)))?;
        Ok(Self { mr, map })
    }

    #[allow(clippy::len_without_is_empty)] // a ring is never empty
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }
}

/// What one side tells the other to connect a QP (carried by `Peer.RdmaConnect`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Endpoint {
    pub qpn: u32,
    pub psn: u32,
    pub gid: [u8; 16],
    pub lid: u16,
    pub mtu: u32,
    /// The receiving side's ring (zero on the sending side).
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
    pub device: String,
}

/// State shared between a stream (wire thread) and the device's completion poller.
pub struct Shared {
    pub qp: Mutex<Option<BasicQueuePair>>,
    pub cq: Arc<BasicCompletionQueue>,
    pub event: OwnedFd,
    /// Receiver: bytes the peer wrote; sender: bytes the peer consumed (credits).
    pub avail: AtomicU64,
    pub sq_done: AtomicU64,
    pub failed: AtomicBool,
    pub error: Mutex<Option<String>>,
    pub label: String,
    /// The ring, returned to the device's pool after the QP is gone.
    pub ring: Mutex<Option<Staging>>,
    pub nic: Arc<Nic>,
}

impl Shared {
    fn signal(&self) {
        let _ = rustix::io::write(&self.event, &1u64.to_ne_bytes());
    }

    pub fn fail(&self, why: String) {
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            *e = Some(why);
        }
        self.failed.store(true, Ordering::Release);
        drop(e);
        self.signal();
    }

    fn post_recvs(&self, n: u32) -> Result<(), String> {
        let mut g = self.qp.lock().unwrap_or_else(|e| e.into_inner());
        let Some(qp) = g.as_mut() else {
            return Ok(());
        };
        let mut guard = qp.start_post_recv();
        for _ in 0..n {
            // Zero-length receives: WRITE WITH IMM and credit SENDs carry no payload into them.
            guard.construct_wr(WR_RECV);
        }
        guard
            .post()
            .map_err(|e| format!("posting receives on {}: {e}", self.label))
    }

    /// Drains up to 32 completions; returns how many there were.
    pub fn poll(&self) -> usize {
        let mut n = 0;
        let mut recvs = 0u32;
        if let Ok(p) = self.cq.start_poll() {
            for wc in p {
                n += 1;
                let st = wc.status();
                if st != 0 {
                    let text: sideway::ibverbs::completion::WorkCompletionStatus = st.into();
                    let what = if wc.wr_id() == WR_SEND {
                        "send"
                    } else {
                        "receive"
                    };
                    self.fail(format!(
                        "RDMA {what} completion error on {}: {text:?} (status {st}{})",
                        self.label,
                        if st == 12 {
                            ": the peer stopped acknowledging (daemon exited or link cut)"
                        } else {
                            ""
                        }
                    ));
                    continue;
                }
                tracing::trace!(target: "commd::rdma", "{}: completion wr {} opcode {} imm {}", self.label, wc.wr_id(), wc.opcode(), u32::from_be(wc.imm_data()));
                match wc.wr_id() {
                    WR_SEND => {
                        self.sq_done.fetch_add(1, Ordering::AcqRel);
                    }
                    _ => {
                        let imm = u32::from_be(wc.imm_data());
                        self.avail.fetch_add(u64::from(imm), Ordering::AcqRel);
                        recvs += 1;
                    }
                }
            }
        }
        if recvs > 0
            && let Err(e) = self.post_recvs(recvs)
        {
            self.fail(e);
        }
        if n > 0 {
            self.signal();
        }
        n
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // The QP goes first: nothing can write into the ring after this.
        let qp = self.qp.get_mut().unwrap_or_else(|e| e.into_inner()).take();
        drop(qp);
        if let Some(r) = self
            .ring
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            self.nic.give_back(r);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Send,
    Recv,
}

/// A QP created and moved to INIT, waiting for the other side's [`Endpoint`].
pub struct Pending {
    sh: Arc<Shared>,
    role: Role,
    psn: u32,
    /// The ring (owned by `sh`): address, local key, size.
    base: *mut u8,
    lkey: u32,
    len: u64,
    pub local: Endpoint,
}

fn mtu_enum(bytes: u32) -> Mtu {
    match bytes {
        0..=256 => Mtu::Mtu256,
        257..=512 => Mtu::Mtu512,
        513..=1024 => Mtu::Mtu1024,
        1025..=2048 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

impl Pending {
    pub fn new(nic: &Arc<Nic>, role: Role, label: String) -> Result<Self, String> {
        let ctx = &nic.ctx;
        let cq = ctx
            .create_cq_builder()
            .setup_cqe(RQ_DEPTH + SQ_DEPTH + 8)
            .build()
            .map_err(|e| format!("creating a completion queue on {}: {e}", nic.name))?;
        let mut qp = nic
            .pd
            .create_qp_builder()
            .setup_max_inline_data(u32::try_from(INLINE_MAX).expect("INLINE_MAX is 64"))
            .setup_send_cq(GenericCompletionQueue::from(cq.clone()))
            .setup_recv_cq(GenericCompletionQueue::from(cq.clone()))
            .setup_max_send_wr(SQ_DEPTH)
            .setup_max_recv_wr(RQ_DEPTH)
            .setup_max_send_sge(2)
            .setup_max_recv_sge(1)
            .build()
            .map_err(|e| format!("creating a queue pair on {}: {e}", nic.name))?;
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(nic.port)
            .setup_access_flags(AccessFlags::LocalWrite | AccessFlags::RemoteWrite);
        qp.modify(&attr)
            .map_err(|e| format!("queue pair to INIT on {}: {e}", nic.name))?;
        // Sender: the staging ring it copies from; receiver: the ring the peer writes into.
        let ring = nic.take_ring().map_err(|e| e.to_string())?;
        let (addr, rkey) = match role {
            Role::Recv => (ring.addr(), ring.mr.rkey()),
            Role::Send => (0, 0),
        };
        let len = ring.len() as u64;
        let (base, lkey) = (ring.addr() as *mut u8, ring.mr.lkey());
        let qpn = qp.qp_number();
        let event = rustix::event::eventfd(
            0,
            rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
        )
        .map_err(|e| format!("eventfd: {e}"))?;
        let psn = rand::random::<u32>() & 0xff_ffff;
        let sh = Arc::new(Shared {
            qp: Mutex::new(Some(qp)),
            cq,
            event,
            avail: AtomicU64::new(0),
            sq_done: AtomicU64::new(0),
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
            label: format!("{} QP {qpn:#x} ({label})", nic.name),
            ring: Mutex::new(Some(ring)),
            nic: nic.clone(),
        });
        sh.post_recvs(RQ_DEPTH)?;
        Ok(Self {
            base,
            lkey,
            len,
            local: Endpoint {
                qpn,
                psn,
                gid: nic.gid,
                lid: nic.lid,
                mtu: nic.mtu,
                addr,
                rkey,
                len,
                device: nic.name.clone(),
            },
            sh,
            role,
            psn,
        })
    }

    /// Moves the QP to RTR and RTS towards `remote` and hands the stream to the poller.
    pub fn connect(self, remote: &Endpoint) -> Result<RdmaStream, String> {
        let nic = self.sh.nic.clone();
        let mtu = mtu_enum(nic.mtu.min(remote.mtu));
        {
            let mut g = self.sh.qp.lock().unwrap_or_else(|e| e.into_inner());
            let Some(qp) = g.as_mut() else {
                return Err("queue pair gone".into());
            };
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(mtu)
                .setup_dest_qp_num(remote.qpn)
                .setup_rq_psn(remote.psn)
                .setup_max_dest_read_atomic(0)
                .setup_min_rnr_timer(1);
            let mut ah = AddressHandleAttribute::new();
            ah.setup_dest_lid(remote.lid)
                .setup_port(nic.port)
                .setup_service_level(0);
            if !nic.ib || remote.gid != [0u8; 16] {
                // The GRH's source GID index is 8 bits wide: a larger index is refused, not wrapped.
                let gid_index = u8::try_from(nic.gid_index).map_err(|_| {
                    format!(
                        "GID index {} on {} does not fit the 8-bit GRH field; check rdma_gid",
                        nic.gid_index, nic.name
                    )
                })?;
                ah.setup_grh_src_gid_index(gid_index)
                    .setup_grh_dest_gid(&Gid { raw: remote.gid })
                    .setup_grh_hop_limit(64);
            }
            attr.setup_address_vector(&ah);
            qp.modify(&attr).map_err(|e| {
                format!(
                    "queue pair {:#x} on {} to RTR (remote QP {:#x} on {}, GID index {}): {e}; check rdma_gid",
                    self.local.qpn, nic.name, remote.qpn, remote.device, nic.gid_index
                )
            })?;
            let mut attr = QueuePairAttribute::new();
            // timeout 14: 67 ms per try, 7 tries: a dead peer fails sends in about 0.5 s.
            attr.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(self.psn)
                .setup_timeout(14)
                .setup_retry_cnt(7)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(0);
            qp.modify(&attr)
                .map_err(|e| format!("queue pair {:#x} to RTS: {e}", self.local.qpn))?;
        }
        nic.watch(self.sh.clone());
        Ok(RdmaStream {
            sh: self.sh,
            role: self.role,
            base: self.base,
            lkey: self.lkey,
            len: match self.role {
                Role::Send => self.len.min(remote.len),
                Role::Recv => self.len,
            },
            remote_addr: remote.addr,
            remote_rkey: remote.rkey,
            pos: 0,
            sq_posted: 0,
            credited: 0,
            peer_device: remote.device.clone(),
        })
    }
}

/// One direction of data over one QP; see the module docs.
pub struct RdmaStream {
    sh: Arc<Shared>,
    role: Role,
    base: *mut u8,
    lkey: u32,
    len: u64,
    remote_addr: u64,
    remote_rkey: u32,
    /// Sender: bytes written; receiver: bytes consumed.
    pos: u64,
    sq_posted: u64,
    /// Receiver: consumed bytes already returned as credits.
    credited: u64,
    pub peer_device: String,
}

// SAFETY: `base` points into the ring owned by `sh` (kept alive by the Arc); the stream is used
// by one thread at a time (the communicator's net thread), like the TCP streams it stands in for.
unsafe impl Send for RdmaStream {}

impl std::fmt::Debug for RdmaStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RdmaStream({})", self.sh.label)
    }
}

fn would_block() -> io::Error {
    io::Error::from(io::ErrorKind::WouldBlock)
}

impl RdmaStream {
    pub fn label(&self) -> &str {
        &self.sh.label
    }

    /// The fd to poll for readiness (readable when anything changed).
    pub fn event_fd(&self) -> BorrowedFd<'_> {
        self.sh.event.as_fd()
    }

    /// Whether `write` (sender) or `read` (receiver) would make progress (or fail) now.
    pub fn ready(&self, write: bool) -> bool {
        if self.sh.failed.load(Ordering::Acquire) {
            return true;
        }
        let avail = self.sh.avail.load(Ordering::Acquire);
        if write {
            self.role == Role::Send
                && ring_free(self.len, self.pos, avail) > 0
                && self.sq_free() >= 2
        } else {
            self.role == Role::Recv && avail > self.pos
        }
    }

    fn drain_event(&self) {
        let mut b = [0u8; 8];
        let _ = rustix::io::read(&self.sh.event, &mut b);
    }

    fn check(&self) -> io::Result<()> {
        if self.sh.failed.load(Ordering::Acquire) {
            let e = self.sh.error.lock().unwrap_or_else(|e| e.into_inner());
            return Err(io::Error::other(
                e.clone().unwrap_or_else(|| "RDMA stream failed".into()),
            ));
        }
        Ok(())
    }

    fn sq_free(&self) -> u64 {
        let done = self.sh.sq_done.load(Ordering::Acquire);
        u64::from(SQ_DEPTH).saturating_sub(self.sq_posted - done)
    }

    /// Nonblocking write of up to the free ring space from `bufs` (gathered).
    pub fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.drain_event();
        self.check()?;
        if self.role != Role::Send {
            return Err(io::Error::other("write on a receiving RDMA stream"));
        }
        let want: usize = bufs.iter().map(|b| b.len()).sum();
        if want == 0 {
            return Ok(0);
        }
        let consumed = self.sh.avail.load(Ordering::Acquire);
        let free = ring_free(self.len, self.pos, consumed);
        if free == 0 || self.sq_free() < 2 {
            return Err(would_block());
        }
        let n = commd_proto::num::usize_of((want as u64).min(free));
        // Copy into the staging ring at pos (wrapping), then post one or two writes.
        let mut copied = 0usize;
        for b in bufs {
            if copied == n {
                break;
            }
            let take = b.len().min(n - copied);
            let mut src = &b[..take];
            let mut at = (self.pos + copied as u64) % self.len;
            while !src.is_empty() {
                let room = commd_proto::num::usize_of(self.len - at);
                let k = room.min(src.len());
                // SAFETY: at + k <= len (the ring's size); the ring region [pos, pos+n) is free
                // (the peer consumed it: credits), and no one else writes the staging ring.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        src.as_ptr(),
                        self.base.add(commd_proto::num::usize_of(at)),
                        k,
                    )
                };
                src = &src[k..];
                at = (at + k as u64) % self.len;
            }
            copied += take;
        }
        let (first, second) = ring_split(self.len, self.pos, n as u64);
        self.post_write(self.pos % self.len, commd_proto::num::usize_of(first))?;
        if second > 0 {
            self.post_write(0, commd_proto::num::usize_of(second))?;
        }
        self.pos += n as u64;
        Ok(n)
    }

    fn post_write(&mut self, at: u64, len: usize) -> io::Result<()> {
        // A write is at most the staging ring, whose size the immediate's 32 bits carry.
        let len32 = u32::try_from(len).map_err(|_| {
            io::Error::other(format!("an RDMA write of {len} bytes exceeds 32 bits"))
        })?;
        let mut g = self.sh.qp.lock().unwrap_or_else(|e| e.into_inner());
        let Some(qp) = g.as_mut() else {
            return Err(io::Error::other("queue pair gone"));
        };
        let mut guard = qp.start_post_send();
        // Small writes (heartbeats, frame headers, control texts) go inline: the provider copies
        // them into the work request, so the NIC does not fetch them from memory.
        let flags = if len <= INLINE_MAX {
            WorkRequestFlags::Signaled | WorkRequestFlags::Inline
        } else {
            WorkRequestFlags::Signaled
        };
        let wr = guard.construct_wr(WR_SEND, flags).setup_write_imm(
            self.remote_rkey,
            self.remote_addr + at,
            len32.to_be(),
        );
        // SAFETY: [base+at, base+at+len) lies in the registered staging ring (lkey), which stays
        // registered until the QP is destroyed (Shared's Drop).
        unsafe { wr.setup_sge(self.lkey, self.base as u64 + at, len32) };
        guard.post().map_err(|e| {
            io::Error::other(format!("posting an RDMA write on {}: {e}", self.sh.label))
        })?;
        self.sq_posted += 1;
        tracing::trace!(target: "commd::rdma", "{}: posted write of {len} at {at}", self.sh.label);
        Ok(())
    }

    /// Nonblocking read of what the peer has written.
    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.drain_event();
        if self.role != Role::Recv {
            return Err(io::Error::other("read on a sending RDMA stream"));
        }
        let written = self.sh.avail.load(Ordering::Acquire);
        let ready = written - self.pos;
        if ready == 0 {
            self.check()?;
            self.return_credits(true)?;
            return Err(would_block());
        }
        let n = commd_proto::num::usize_of(ready.min(buf.len() as u64));
        let mut done = 0usize;
        while done < n {
            let at = (self.pos + done as u64) % self.len;
            let k = commd_proto::num::usize_of(self.len - at).min(n - done);
            // SAFETY: at + k <= len; the peer wrote these bytes (its immediate completions say
            // so) and will not overwrite them before we return credits for them.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.base.add(commd_proto::num::usize_of(at)),
                    buf[done..].as_mut_ptr(),
                    k,
                )
            };
            done += k;
        }
        self.pos += n as u64;
        self.return_credits(false)?;
        Ok(n)
    }

    /// Tells the sender how much was consumed, once an eighth of the ring (or, when `idle`,
    /// anything) is pending.
    fn return_credits(&mut self, idle: bool) -> io::Result<()> {
        let owed = self.pos - self.credited;
        if !credit_due(owed, self.len, idle) || self.sq_free() < 1 {
            return Ok(());
        }
        // Credits are at most the ring's size, which the immediate's 32 bits carry.
        let owed32 = u32::try_from(owed)
            .map_err(|_| io::Error::other(format!("{owed} bytes of credits exceed 32 bits")))?;
        let mut g = self.sh.qp.lock().unwrap_or_else(|e| e.into_inner());
        let Some(qp) = g.as_mut() else {
            return Ok(());
        };
        let mut guard = qp.start_post_send();
        guard
            .construct_wr(
                WR_SEND,
                WorkRequestFlags::Signaled | WorkRequestFlags::Inline,
            )
            .setup_send_imm(owed32.to_be());
        guard
            .post()
            .map_err(|e| io::Error::other(format!("posting credits on {}: {e}", self.sh.label)))?;
        self.sq_posted += 1;
        self.credited = self.pos;
        Ok(())
    }

    /// Blocking read of exactly `buf.len()` bytes (short control texts), within `timeout`.
    pub fn read_exact_timeout(&mut self, buf: &mut [u8], timeout: Duration) -> io::Result<()> {
        let until = std::time::Instant::now() + timeout;
        let mut got = 0;
        while got < buf.len() {
            match self.read(&mut buf[got..]) {
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if std::time::Instant::now() >= until {
                        return Err(io::Error::from(io::ErrorKind::TimedOut));
                    }
                    std::thread::sleep(Duration::from_micros(50));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Sender: every write was handed to the NIC and acknowledged.
    pub fn flushed(&self) -> bool {
        self.sh.sq_done.load(Ordering::Acquire) >= self.sq_posted
    }
}

impl Drop for RdmaStream {
    fn drop(&mut self) {
        // The poller drops its reference on its next pass; the QP and ring go with the last.
        self.sh.failed.store(true, Ordering::Release);
        self.sh.nic.unwatch(&self.sh);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_arithmetic_wraps_and_never_overwrites_unread_bytes() {
        let len = 1024;
        assert_eq!(ring_free(len, 0, 0), 1024);
        assert_eq!(ring_free(len, 1000, 200), 224);
        assert_eq!(
            ring_free(len, 5000, 3976),
            0,
            "full: the sender must wait for credits"
        );
        assert_eq!(ring_split(len, 1000, 100), (24, 76));
        assert_eq!(ring_split(len, 1024, 100), (100, 0));
        assert_eq!(ring_split(len, 3 * 1024 + 1023, 1), (1, 0));
        // A sender that writes whatever is free and a receiver that consumes and credits keep
        // the invariant 0 <= written - consumed <= len through many wraps.
        let (mut pos, mut consumed, mut credited, mut read) = (0u64, 0u64, 0u64, 0u64);
        for i in 0..10_000u64 {
            let n = ring_free(len, pos, credited).min(1 + (i * 37) % 700);
            let (a, b) = ring_split(len, pos, n);
            assert_eq!(a + b, n);
            pos += n;
            assert!(pos - credited <= len);
            let r = (pos - read).min(1 + (i * 53) % 500);
            read += r;
            consumed = consumed.max(read);
            if credit_due(consumed - credited, len, read == pos) {
                credited = consumed;
            }
        }
        assert!(pos > 100 * len);
        assert!(!credit_due(0, len, true));
        assert!(!credit_due(len / 8 - 1, len, false));
        assert!(credit_due(len / 8, len, false));
        assert!(credit_due(1, len, true));
    }
}
