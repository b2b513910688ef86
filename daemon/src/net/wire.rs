//! The inter-node wire of one communicator: nonblocking streams (TCP sockets or RDMA queue
//! pairs, see [`super::link::Link`]) to every peer node, tagged
//! chunked messages, posted receives that land directly in their destination, buffering of data
//! that arrives before its receive is posted, heartbeats, and abort notices.
//!
//! Driven by exactly one thread (the communicator's net thread) through [`Wire::pump`]; algorithms
//! post sends and receives and [`Wire::wait`] for them. Nothing here allocates per chunk in the
//! steady state (early chunks borrow buffers from a pool that is recycled).
//!
//! The frame (a 64-byte header, then the payload) is [`frame`]'s; reading frames off the streams
//! is [`recv`]'s.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

use std::collections::{HashMap, VecDeque};
use std::io::{ErrorKind, IoSlice};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use thiserror::Error;

use super::link::Link;

mod frame;
mod recv;

pub use frame::{
    CLASS_COLL, CLASS_P2P, HDR, KIND_ABORT, KIND_DATA, KIND_END, KIND_HEARTBEAT, Key, Sig,
};
use frame::{MAGIC, put_hdr, sig_of, u32_at, u64_at};

const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// Early-arriving data buffered per communicator before the wire stops reading (backpressure).
const MAX_UNEXPECTED: u64 = 512 << 20;
/// Longest abort text accepted.
const MAX_ABORT_TEXT: u32 = 64 << 10;
pub use crate::config::MAX_CHUNK_BYTES;

#[derive(Debug, Error, Clone)]
pub enum NetError {
    #[error("lost node {node}: {why}")]
    PeerLost { node: usize, why: String },
    #[error("{msg}")]
    Aborted { node: usize, st: u32, msg: String },
    #[error("{0}")]
    Mismatch(String),
    #[error("{0}")]
    Timeout(String),
    #[error("{0}")]
    Local(String),
    /// A rank on this node died, or its GPU stream never reached the op.
    #[error("{1}")]
    LocalRank(u32, String),
}

struct TxItem {
    hdr: [u8; HDR],
    ptr: *const u8,
    len: usize,
    /// Bytes written so far (header included).
    pos: usize,
    send: Option<usize>,
    /// Payload owned by the item (abort text).
    owned: Option<Vec<u8>>,
}

struct RxCur {
    key: Key,
    offset: u64,
    total: u64,
    len: usize,
    pos: usize,
    /// Into a posted receive, or into a pooled buffer (early data).
    dest: *mut u8,
    early: Option<Vec<u8>>,
    sig: Sig,
}

struct Rx {
    sock: Link,
    hdr: [u8; HDR],
    hpos: usize,
    cur: Option<RxCur>,
    eof: bool,
    /// Got END: the stream is clean and can be reused.
    ended: bool,
}

struct Tx {
    sock: Link,
    q: VecDeque<TxItem>,
}

pub struct PeerLinks {
    pub tx: Vec<Link>,
    pub rx: Vec<Link>,
}

struct Peer {
    tx: Vec<Tx>,
    rx: Vec<Rx>,
    next: usize,
    last_rx: Instant,
    last_hb: Instant,
    /// The peer said END (it destroyed its side of the communicator).
    ended: bool,
    /// Latest progress the peer reported in a heartbeat (its ranks' lowest posted collective).
    progress: u64,
}

struct Posted {
    ptr: *mut u8,
    total: u64,
    got: u64,
    /// Chunks arrived (a message of 0 bytes still has one).
    arrived: u32,
    sig: Option<Sig>,
}

/// Counters a communicator exposes (bytes and frames per peer and direction).
#[derive(Default, Clone, Debug)]
pub struct LinkStats {
    pub tx_bytes: u64,
    pub rx_bytes: u64,
    pub tx_frames: u64,
    pub rx_frames: u64,
}

pub struct Wire {
    me: usize,
    peers: Vec<Option<Peer>>,
    chunk: usize,
    peer_timeout: Duration,
    posted: HashMap<Key, Posted>,
    early: HashMap<Key, Vec<Early>>,
    early_bytes: u64,
    pool: Vec<Vec<u8>>,
    sends: Vec<usize>,
    free_sends: Vec<usize>,
    wake: OwnedFd,
    /// Reported in heartbeats.
    pub progress: u64,
    /// This side sent END: no more heartbeats. The peer hands a stream whose END it read to
    /// the pool, where the next bytes must be a BIND: a heartbeat after END made it reject
    /// the pooled connection, and the next communicator between the two nodes then failed to
    /// connect (seen on 4x H200: "opened 1 of 2 data connections ... in time").
    sent_end: bool,
    pub stats: Vec<LinkStats>,
    /// Per node: the daemon-wide link counters of `commd stat -l` and /metrics (set by the
    /// caller after `new`; `None` for this node).
    pub links: Vec<Option<crate::telemetry::Link>>,
}

pub type RecvId = Key;

/// A message's tag: its class (tag space) and two words (collective: seq and message index;
/// p2p: (src << 32 | dst) and the pair's sequence number).
#[derive(Clone, Copy, Debug)]
pub struct Tag {
    pub class: u8,
    pub a: u64,
    pub b: u64,
}

/// What [`Wire::into_streams`] hands back per peer: (node, tx streams, rx streams with "clean").
pub type PeerStreams = (usize, Vec<Link>, Vec<(Link, bool)>);

/// A chunk that arrived before its receive was posted.
struct Early {
    offset: u64,
    len: u64,
    buf: Vec<u8>,
    sig: Sig,
    total: u64,
}

fn check_sig(
    peer: usize,
    posted: &Posted,
    sig: &Sig,
    total: u64,
    fmt: SigFmt,
) -> Result<(), NetError> {
    if let Some(s) = &posted.sig
        && s != sig
    {
        return Err(NetError::Mismatch(format!(
            "node {peer} posted {} where this node posted {}",
            fmt(sig),
            fmt(s)
        )));
    }
    if total != posted.total {
        return Err(NetError::Mismatch(format!(
            "node {peer} sends {total} bytes where this node expects {} ({})",
            posted.total,
            fmt(sig)
        )));
    }
    Ok(())
}
pub type SendId = usize;

/// Describes a signature for mismatch errors.
pub type SigFmt = fn(&Sig) -> String;

impl Wire {
    /// `links[i]` are the streams to node i (`None` for this node, `me`).
    pub fn new(
        me: usize,
        links: Vec<Option<PeerLinks>>,
        chunk: u64,
        peer_timeout: Duration,
        wake: OwnedFd,
    ) -> std::io::Result<Self> {
        // A chunk's length travels in the header's 32-bit field.
        let chunk = u32::try_from(chunk.max(4096)).map_err(|_| {
            std::io::Error::new(
                ErrorKind::InvalidInput,
                format!("a network chunk of {chunk} bytes does not fit the header's 32-bit length"),
            )
        })?;
        let now = Instant::now();
        let n = links.len();
        let mut peers = Vec::with_capacity(n);
        for l in links {
            peers.push(match l {
                None => None,
                Some(l) => {
                    for s in l.tx.iter().chain(l.rx.iter()) {
                        s.setup()?;
                    }
                    Some(Peer {
                        tx: l
                            .tx
                            .into_iter()
                            .map(|sock| Tx {
                                sock,
                                q: VecDeque::new(),
                            })
                            .collect(),
                        rx: l
                            .rx
                            .into_iter()
                            .map(|sock| Rx {
                                sock,
                                hdr: [0; HDR],
                                hpos: 0,
                                cur: None,
                                eof: false,
                                ended: false,
                            })
                            .collect(),
                        next: 0,
                        last_rx: now,
                        last_hb: now,
                        ended: false,
                        progress: 0,
                    })
                }
            });
        }
        Ok(Self {
            me,
            peers,
            chunk: commd_proto::num::usize_of(u64::from(chunk)),
            peer_timeout,
            posted: HashMap::new(),
            early: HashMap::new(),
            early_bytes: 0,
            sent_end: false,
            pool: Vec::new(),
            sends: Vec::new(),
            free_sends: Vec::new(),
            wake,
            progress: 0,
            stats: vec![LinkStats::default(); n],
            links: vec![None; n],
        })
    }

    pub fn me(&self) -> usize {
        self.me
    }

    pub fn peer_progress(&self, node: usize) -> Option<u64> {
        self.peers.get(node)?.as_ref().map(|p| p.progress)
    }

    /// Queues `len` bytes at `ptr` for node `peer` under `key`'s tag, cut into chunks spread
    /// over the peer's streams.
    ///
    /// # Safety
    /// `ptr` must stay valid for `len` reads until the send completes (or the wire is dropped).
    pub unsafe fn send(
        &mut self,
        peer: usize,
        tag: Tag,
        sig: &Sig,
        ptr: *const u8,
        len: usize,
    ) -> Result<SendId, NetError> {
        let chunk = self.chunk;
        let id = match self.free_sends.pop() {
            Some(i) => i,
            None => {
                self.sends.push(0);
                self.sends.len() - 1
            }
        };
        let key = Key {
            peer: self.me,
            class: tag.class,
            a: tag.a,
            b: tag.b,
        };
        let p = self.peer_mut(peer)?;
        let mut off = 0usize;
        let mut chunks = 0;
        loop {
            let n = chunk.min(len - off);
            let s = p.next % p.tx.len();
            p.next += 1;
            p.tx[s].q.push_back(TxItem {
                hdr: put_hdr(
                    KIND_DATA,
                    &key,
                    sig,
                    off as u64,
                    len as u64,
                    u32::try_from(n).expect("n <= chunk, which Wire::new checked fits u32"),
                ),
                // SAFETY: off <= len; the caller keeps ptr valid for len bytes.
                ptr: unsafe { ptr.add(off) },
                len: n,
                pos: 0,
                send: Some(id),
                owned: None,
            });
            chunks += 1;
            off += n;
            if off >= len {
                break;
            }
        }
        self.sends[id] = chunks;
        Ok(id)
    }

    pub fn send_done(&self, id: SendId) -> bool {
        self.sends[id] == 0
    }

    /// Releases a completed send id for reuse.
    pub fn release_send(&mut self, id: SendId) {
        if self.sends[id] == 0 {
            self.free_sends.push(id);
        }
    }

    /// Posts a receive of exactly `total` bytes from node `peer` into `ptr`.
    ///
    /// # Safety
    /// `ptr` must stay valid for `total` writes, and not be read by anyone else, until the
    /// receive completes (or the wire is dropped).
    pub unsafe fn recv(
        &mut self,
        peer: usize,
        tag: Tag,
        sig: Option<Sig>,
        ptr: *mut u8,
        total: u64,
        fmt: SigFmt,
    ) -> Result<RecvId, NetError> {
        self.peer_mut(peer)?;
        let key = Key {
            peer,
            class: tag.class,
            a: tag.a,
            b: tag.b,
        };
        let mut slot = Posted {
            ptr,
            total,
            got: 0,
            arrived: 0,
            sig,
        };
        if let Some(chunks) = self.early.remove(&key) {
            for e in chunks {
                self.early_bytes -= e.len;
                check_sig(peer, &slot, &e.sig, e.total, fmt)?;
                // SAFETY: offset + len <= total (checked when the header came, and total equals
                // the posted size, checked above); ptr is valid for total writes (caller).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        e.buf.as_ptr(),
                        ptr.add(commd_proto::num::usize_of(e.offset)),
                        commd_proto::num::usize_of(e.len),
                    )
                };
                slot.got += e.len;
                slot.arrived += 1;
                self.pool.push(e.buf);
            }
        }
        self.posted.insert(key, slot);
        Ok(key)
    }

    pub fn recv_done(&self, id: &RecvId) -> bool {
        self.posted
            .get(id)
            .is_some_and(|p| p.got >= p.total && p.arrived > 0)
    }

    /// Forgets a completed receive.
    pub fn release_recv(&mut self, id: &RecvId) {
        self.posted.remove(id);
    }

    /// Pumps until every listed send and receive is complete. `deadline` bounds the wait for
    /// data from peers that are alive (op timeout); a silent peer fails after `peer_timeout`.
    pub fn wait(
        &mut self,
        sends: &[SendId],
        recvs: &[RecvId],
        deadline: Instant,
        fmt: SigFmt,
        what: &dyn Fn(&[usize]) -> String,
    ) -> Result<(), NetError> {
        loop {
            let done = sends.iter().all(|s| self.sends[*s] == 0)
                && recvs.iter().all(|r| self.recv_done(r));
            if done {
                return Ok(());
            }
            if let Some(r) = recvs
                .iter()
                .find(|r| !self.recv_done(r) && self.peer_ended(r.peer))
            {
                return Err(NetError::PeerLost {
                    node: r.peer,
                    why: "it left the communicator (its ranks destroyed it) while this node still waits for its data".into(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                let mut waiting: Vec<usize> = recvs
                    .iter()
                    .filter(|r| !self.recv_done(r))
                    .map(|r| r.peer)
                    .collect();
                waiting.sort_unstable();
                waiting.dedup();
                return Err(NetError::Timeout(what(&waiting)));
            }
            self.pump(Some(deadline.min(now + Duration::from_millis(250))), fmt)?;
        }
    }

    fn peer_mut(&mut self, peer: usize) -> Result<&mut Peer, NetError> {
        match self.peers.get_mut(peer) {
            Some(Some(p)) => Ok(p),
            _ => Err(NetError::Local(format!("no link to node {peer}"))),
        }
    }

    /// One round of I/O: waits (until `until`, or returns at once with `None`) for readable or
    /// writable streams or the wake fd, then moves bytes. Also sends heartbeats and checks peer
    /// liveness.
    pub fn pump(&mut self, until: Option<Instant>, fmt: SigFmt) -> Result<(), NetError> {
        use rustix::event::{PollFd, PollFlags};
        let now = Instant::now();
        self.heartbeats(now);
        let read_ok = self.early_bytes < MAX_UNEXPECTED;
        let mut idx: Vec<(usize, bool, usize)> = Vec::new();
        // Streams that can move bytes without waiting (RDMA: see `Link::ready`).
        let mut now_ready: Vec<bool> = Vec::new();
        {
            let mut fds: Vec<PollFd<'_>> = Vec::new();
            fds.push(PollFd::new(&self.wake, PollFlags::IN));
            for (pi, p) in self.peers.iter().enumerate() {
                let Some(p) = p else { continue };
                for (si, t) in p.tx.iter().enumerate() {
                    if !t.q.is_empty() {
                        let (fd, ev) = t.sock.poll_fd(true);
                        fds.push(PollFd::from_borrowed_fd(fd, ev));
                        idx.push((pi, true, si));
                        now_ready.push(t.sock.ready(true));
                    }
                }
                for (si, r) in p.rx.iter().enumerate() {
                    if !r.eof && (read_ok || r.cur.as_ref().is_some_and(|c| c.early.is_none())) {
                        let (fd, ev) = r.sock.poll_fd(false);
                        fds.push(PollFd::from_borrowed_fd(fd, ev));
                        idx.push((pi, false, si));
                        now_ready.push(r.sock.ready(false));
                    }
                }
            }
            let until = if now_ready.iter().any(|&r| r) {
                None
            } else {
                until
            };
            let timeout = until.map(|u| {
                let d = u.saturating_duration_since(now).min(HEARTBEAT_EVERY);
                rustix::event::Timespec {
                    tv_sec: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
                    tv_nsec: d.subsec_nanos() as i64,
                }
            });
            let zero = rustix::event::Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            match rustix::event::poll(&mut fds, Some(timeout.as_ref().unwrap_or(&zero))) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(NetError::Local(format!("poll: {e}"))),
            }
            let ready: Vec<bool> = fds.iter().map(|f| !f.revents().is_empty()).collect();
            if ready[0] {
                let mut b = [0u8; 8];
                let _ = rustix::io::read(&self.wake, &mut b);
            }
            idx = idx
                .into_iter()
                .zip(ready.into_iter().skip(1).zip(now_ready))
                .filter(|(_, (r, n))| *r || *n)
                .map(|(i, _)| i)
                .collect();
        }
        for (pi, is_tx, si) in idx {
            if is_tx {
                self.write_stream(pi, si)?;
            } else {
                self.read_stream(pi, si, fmt)?;
            }
        }
        self.check_liveness(Instant::now())
    }

    fn heartbeats(&mut self, now: Instant) {
        if self.sent_end {
            return;
        }
        let progress = self.progress;
        for p in self.peers.iter_mut().flatten() {
            // A peer that ended its side may have closed its streams (RDMA: destroyed its queue
            // pairs, so a heartbeat would come back as a retry error, not a lost node).
            if p.ended {
                continue;
            }
            if now.duration_since(p.last_hb) >= HEARTBEAT_EVERY {
                p.last_hb = now;
                let key = Key {
                    peer: 0,
                    class: 0,
                    a: progress,
                    b: 0,
                };
                // On the least loaded stream, so it is not stuck behind bulk data.
                if let Some(t) = p.tx.iter_mut().min_by_key(|t| t.q.len())
                    && t.q.len() < 4
                {
                    t.q.push_back(TxItem {
                        hdr: put_hdr(KIND_HEARTBEAT, &key, &Sig::default(), 0, 0, 0),
                        ptr: std::ptr::null(),
                        len: 0,
                        pos: 0,
                        send: None,
                        owned: None,
                    });
                }
            }
        }
    }

    fn check_liveness(&self, now: Instant) -> Result<(), NetError> {
        for (i, p) in self.peers.iter().enumerate() {
            let Some(p) = p else { continue };
            // A stream we stopped reading (backpressure) says nothing about the peer.
            if self.early_bytes >= MAX_UNEXPECTED {
                continue;
            }
            let quiet = now.saturating_duration_since(p.last_rx);
            if quiet > self.peer_timeout && !p.ended {
                return Err(NetError::PeerLost {
                    node: i,
                    why: format!(
                        "nothing received for {:.1} s (no heartbeat; peer_timeout_ms={})",
                        quiet.as_secs_f64(),
                        self.peer_timeout.as_millis()
                    ),
                });
            }
        }
        Ok(())
    }

    fn write_stream(&mut self, pi: usize, si: usize) -> Result<(), NetError> {
        let r = self.write_stream_inner(pi, si);
        if r.is_err()
            && let Some(Some(p)) = self.peers.get_mut(pi)
            && p.ended
            && p.tx[si].q.iter().all(|it| it.send.is_none())
        {
            // The peer left cleanly and no data of ours was pending: only control frames
            // (heartbeat, END) were lost, which is not an error.
            p.tx[si].q.clear();
            return Ok(());
        }
        r
    }

    fn write_stream_inner(&mut self, pi: usize, si: usize) -> Result<(), NetError> {
        let Some(Some(p)) = self.peers.get_mut(pi) else {
            return Ok(());
        };
        let t = &mut p.tx[si];
        let st = &mut self.stats[pi];
        while let Some(it) = t.q.front_mut() {
            let total = HDR + it.len;
            let payload: &[u8] = if it.len == 0 {
                &[]
            } else if let Some(o) = &it.owned {
                &o[..it.len]
            } else {
                // SAFETY: the sender keeps ptr valid for len bytes until completion (send()).
                unsafe { std::slice::from_raw_parts(it.ptr, it.len) }
            };
            let r = if it.pos < HDR {
                t.sock
                    .write_vectored(&[IoSlice::new(&it.hdr[it.pos..]), IoSlice::new(payload)])
            } else {
                t.sock.write(&payload[it.pos - HDR..])
            };
            match r {
                Ok(0) => {
                    return Err(NetError::PeerLost {
                        node: pi,
                        why: "connection closed while sending".into(),
                    });
                }
                Ok(n) => {
                    it.pos += n;
                    st.tx_bytes += n as u64;
                    let link = self.links.get(pi).and_then(Option::as_ref);
                    if let Some(l) = link {
                        l.tx(n as u64, 0);
                    }
                    if it.pos == total {
                        st.tx_frames += 1;
                        if let Some(l) = link {
                            l.tx(0, 1);
                        }
                        if let Some(s) = it.send {
                            self.sends[s] -= 1;
                        }
                        t.q.pop_front();
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    return Err(NetError::PeerLost {
                        node: pi,
                        why: format!("send failed: {e}"),
                    });
                }
            }
        }
        Ok(())
    }

    /// Best effort: tells every peer why this node gives up on the communicator, drops queued
    /// data that has not started, and flushes for up to `flush`.
    /// Tells peers the communicator failed with status `st` and `msg` (the status in the
    /// frame's `a`, so a lost rank stays "peer lost" and a revoke "revoked" on every node).
    pub fn abort(&mut self, st: u32, msg: &str, flush: Duration) {
        let text = msg.as_bytes()[..msg.len().min(MAX_ABORT_TEXT as usize)].to_vec();
        self.enqueue_control(KIND_ABORT, u64::from(st), Some(text));
        self.flush(flush);
    }

    /// Graceful end: tells peers this node leaves the communicator.
    pub fn end(&mut self, flush: Duration) {
        self.sent_end = true;
        self.enqueue_control(KIND_END, 0, None);
        self.flush(flush);
    }

    fn enqueue_control(&mut self, kind: u8, a: u64, text: Option<Vec<u8>>) {
        let key = Key {
            peer: 0,
            class: 0,
            a,
            b: 0,
        };
        for p in self.peers.iter_mut().flatten() {
            for t in &mut p.tx {
                t.q.retain(|it| it.pos > 0);
                let len = text.as_ref().map_or(0, |t| t.len());
                let len32 =
                    u32::try_from(len).expect("an abort text is cut to MAX_ABORT_TEXT bytes");
                t.q.push_back(TxItem {
                    hdr: put_hdr(kind, &key, &Sig::default(), 0, len as u64, len32),
                    ptr: std::ptr::null(),
                    len,
                    pos: 0,
                    send: None,
                    owned: text.clone(),
                });
            }
        }
        for s in &mut self.sends {
            *s = 0;
        }
    }

    fn flush(&mut self, within: Duration) {
        let until = Instant::now() + within;
        let fmt: SigFmt = |_| String::new();
        while Instant::now() < until
            && self
                .peers
                .iter()
                .flatten()
                .any(|p| p.tx.iter().any(|t| !t.q.is_empty()))
        {
            let mut progressed = false;
            for pi in 0..self.peers.len() {
                let n = self.peers[pi].as_ref().map_or(0, |p| p.tx.len());
                for si in 0..n {
                    if self.write_stream(pi, si).is_err() {
                        if let Some(Some(p)) = self.peers.get_mut(pi) {
                            p.tx[si].q.clear();
                        }
                    } else {
                        progressed = true;
                    }
                }
            }
            let _ = fmt;
            if progressed {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    /// True if the peer ended its side (END on every stream).
    pub fn peer_ended(&self, node: usize) -> bool {
        self.peers
            .get(node)
            .and_then(|p| p.as_ref())
            .is_some_and(|p| p.ended)
    }

    /// The streams after the communicator ended: per peer, its clean tx streams (every queued
    /// frame written) and its rx streams with whether each saw END.
    pub fn into_streams(self) -> Vec<PeerStreams> {
        self.peers
            .into_iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let p = p?;
                let tx =
                    p.tx.into_iter()
                        .filter(|t| t.q.is_empty())
                        .map(|t| t.sock)
                        .collect();
                let rx =
                    p.rx.into_iter()
                        .map(|r| (r.sock, r.ended && r.cur.is_none()))
                        .collect();
                Some((i, tx, rx))
            })
            .collect()
    }
}
