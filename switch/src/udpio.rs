//! Batched UDP I/O for the switch data plane: generic segmentation offload on send
//! (`UDP_SEGMENT`: up to 63 same-size packets to one destination in one `sendmsg`, one trip
//! through the stack) and generic receive offload (`UDP_GRO`: the kernel hands back runs of
//! packets from one source as one buffer), with `sendmmsg`/`recvmmsg` as the fallback where the
//! kernel lacks either. Per packet this saves most of the kernel's work, which is what bounds a
//! software switch and its workers (docs/benchmarks.md row `switch-allreduce-4M`).

#![allow(unsafe_code)] // batched UDP system calls (sendmmsg/recvmmsg, GSO/GRO) on raw buffers

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Data-plane counters of one endpoint (a session's worker threads, or the switch).
#[derive(Debug, Default)]
pub struct Stats {
    pub ops: AtomicU64,
    pub packets_sent: AtomicU64,
    pub retransmits: AtomicU64,
    pub results: AtomicU64,
    pub dropped_results: AtomicU64,
    pub bytes: AtomicU64,
    pub send_calls: AtomicU64,
    pub recv_calls: AtomicU64,
}

const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
/// Largest UDP payload of one GSO send.
const MAX_GSO_BYTES: usize = 65_000;
/// Receive buffer per message (a GRO run is at most 64 KiB).
pub const RECV_BUF: usize = 65_536;

/// Whether GSO sends work on this host (cleared at the first refusal).
static GSO_OK: AtomicBool = AtomicBool::new(true);

/// `size_of::<T>()` as the C APIs take it (`socklen_t`, the `c_uint` of `CMSG_SPACE`), for the
/// small plain types passed to them.
fn c_size_of<T>() -> u32 {
    u32::try_from(std::mem::size_of::<T>()).expect("a socket argument is a few bytes")
}

/// `setsockopt(level, opt, v)` for an int option; true on success.
fn set_int(sock: &impl AsFd, level: libc::c_int, opt: libc::c_int, v: libc::c_int) -> bool {
    // SAFETY: setsockopt reads sizeof(int) bytes from a live int.
    let r = unsafe {
        libc::setsockopt(
            sock.as_fd().as_raw_fd(),
            level,
            opt,
            (&v as *const libc::c_int).cast(),
            c_size_of::<libc::c_int>(),
        )
    };
    r == 0
}

/// Turns on GRO for `sock`; false where the kernel does not support it.
pub fn enable_gro(sock: &impl AsFd) -> bool {
    set_int(sock, libc::SOL_UDP, UDP_GRO, 1)
}

/// Sets the socket's receive and send buffers to `bytes`: beyond `net.core.rmem_max` /
/// `wmem_max` where the process may (`SO_RCVBUFFORCE`, CAP_NET_ADMIN), else up to those limits.
/// A window of in-flight packets larger than the buffers is lost to overflow and then waits for
/// retransmission, so the buffers bound the useful window. Returns the receive buffer the
/// kernel granted.
pub fn size_buffers(sock: &impl AsFd, bytes: usize) -> usize {
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        if !set_int(sock, libc::SOL_SOCKET, force, v) {
            set_int(sock, libc::SOL_SOCKET, plain, v);
        }
    }
    rustix::net::sockopt::socket_recv_buffer_size(sock).unwrap_or(0)
}

fn sockaddr(a: SocketAddr) -> libc::sockaddr_in {
    // SAFETY: sockaddr_in is plain data; zero is valid.
    let mut s: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    s.sin_family = libc::sa_family_t::try_from(libc::AF_INET).expect("AF_INET is 2");
    s.sin_port = a.port().to_be();
    if let IpAddr::V4(ip) = a.ip() {
        s.sin_addr.s_addr = u32::from(ip).to_be();
    }
    s
}

/// Sends `pkts` (all of one size, except that the last may be shorter) to `dst` (None: the
/// connected peer). Losses (full buffers, unreachable ports) are left to retransmission.
pub fn send(
    sock: &impl AsFd,
    dst: Option<SocketAddr>,
    pkts: &[&[u8]],
    stats: &Stats,
) -> Result<(), String> {
    let Some(first) = pkts.first() else {
        return Ok(());
    };
    let seg = first.len().max(1);
    let per = (MAX_GSO_BYTES / seg).clamp(1, 63);
    send_batched(
        sock,
        dst,
        seg,
        stats,
        pkts.len() > 1,
        pkts.chunks(per),
        || pkts.to_vec(),
    )
}

/// Sends `buf`, packets of `seg` bytes back to back (the last may be shorter), to `dst`: one
/// GSO `sendmsg` per up to 63 packets, without gathering them first.
pub fn send_contig(
    sock: &impl AsFd,
    dst: Option<SocketAddr>,
    buf: &[u8],
    seg: usize,
    stats: &Stats,
) -> Result<(), String> {
    let seg = seg.max(1);
    if buf.is_empty() {
        return Ok(());
    }
    let per = (MAX_GSO_BYTES / seg).clamp(1, 63) * seg;
    send_batched(
        sock,
        dst,
        seg,
        stats,
        buf.len() > seg,
        buf.chunks(per).map(|c| [c]),
        || buf.chunks(seg).collect(),
    )
}

/// One GSO `sendmsg` per batch (each the iovecs of up to 63 segments of `seg` bytes) when GSO
/// works and `batching` is worth it; else, or once the kernel refuses GSO, every packet
/// (`packets()`) by `sendmmsg`.
fn send_batched<'a, B: AsRef<[&'a [u8]]>>(
    sock: &impl AsFd,
    dst: Option<SocketAddr>,
    seg: usize,
    stats: &Stats,
    batching: bool,
    batches: impl Iterator<Item = B>,
    packets: impl Fn() -> Vec<&'a [u8]>,
) -> Result<(), String> {
    if !(GSO_OK.load(Ordering::Relaxed) && batching) {
        return send_mmsg(sock, dst, &packets(), stats);
    }
    for batch in batches {
        match send_gso(sock, dst, batch.as_ref(), seg, stats) {
            Ok(()) => {}
            Err(e)
                if e.raw_os_error() == Some(libc::EIO)
                    || e.raw_os_error() == Some(libc::EINVAL) =>
            {
                GSO_OK.store(false, Ordering::Relaxed);
                tracing::info!(target: "commd::switch", "UDP GSO unavailable ({e}); sending packets one by one with sendmmsg");
                return send_mmsg(sock, dst, &packets(), stats);
            }
            Err(e) => return lost_or_err(e),
        }
    }
    Ok(())
}

fn lost_or_err(e: std::io::Error) -> Result<(), String> {
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR) | Some(libc::ECONNREFUSED) => {
            Ok(())
        }
        _ => Err(format!("UDP send: {e}")),
    }
}

fn send_gso(
    sock: &impl AsFd,
    dst: Option<SocketAddr>,
    pkts: &[&[u8]],
    seg: usize,
    stats: &Stats,
) -> std::io::Result<()> {
    let mut iov: Vec<libc::iovec> = pkts
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    let mut name = dst.map(sockaddr);
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(c_size_of::<u16>()) } as usize;
    let mut ctrl = vec![0u64; space.div_ceil(8)];
    // The kernel splits the payload at `seg` bytes: a segment size that does not fit the
    // option's u16 is refused, never truncated.
    let seg = u16::try_from(seg).map_err(|_| {
        std::io::Error::other(format!("UDP segment of {seg} bytes is over 65535 (GSO)"))
    })?;
    // SAFETY: msghdr is plain data; zero is valid.
    let mut m: libc::msghdr = unsafe { std::mem::zeroed() };
    m.msg_iov = iov.as_mut_ptr();
    m.msg_iovlen = iov.len();
    if let Some(n) = name.as_mut() {
        m.msg_name = (n as *mut libc::sockaddr_in).cast();
        m.msg_namelen = c_size_of::<libc::sockaddr_in>();
    }
    m.msg_control = ctrl.as_mut_ptr().cast();
    m.msg_controllen = space;
    // SAFETY: the control buffer holds one cmsg of a u16, as sized above.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&m);
        (*c).cmsg_level = libc::SOL_UDP;
        (*c).cmsg_type = UDP_SEGMENT;
        (*c).cmsg_len = libc::CMSG_LEN(c_size_of::<u16>()) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<u16>(), seg);
    }
    let mut spins = 0;
    loop {
        stats.send_calls.fetch_add(1, Ordering::Relaxed);
        // SAFETY: m points at live iovecs, name and control for the duration of the call.
        let r = unsafe { libc::sendmsg(sock.as_fd().as_raw_fd(), &m, 0) };
        if r >= 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EAGAIN) && spins < 1000 {
            spins += 1;
            std::thread::yield_now();
            continue;
        }
        return Err(e);
    }
}

fn send_mmsg(
    sock: &impl AsFd,
    dst: Option<SocketAddr>,
    pkts: &[&[u8]],
    stats: &Stats,
) -> Result<(), String> {
    let mut iov: Vec<libc::iovec> = pkts
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    let mut name = dst.map(sockaddr);
    // SAFETY: mmsghdr is plain data; zero is a valid empty header.
    let mut msgs: Vec<libc::mmsghdr> = (0..pkts.len())
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    for (m, v) in msgs.iter_mut().zip(iov.iter_mut()) {
        m.msg_hdr.msg_iov = v;
        m.msg_hdr.msg_iovlen = 1;
        if let Some(n) = name.as_mut() {
            m.msg_hdr.msg_name = (n as *mut libc::sockaddr_in).cast();
            m.msg_hdr.msg_namelen = c_size_of::<libc::sockaddr_in>();
        }
    }
    let mut off = 0;
    let mut spins = 0;
    while off < msgs.len() {
        stats.send_calls.fetch_add(1, Ordering::Relaxed);
        // SAFETY: msgs[off..] point at iovecs over live buffers for the duration of the call.
        let r = unsafe {
            libc::sendmmsg(
                sock.as_fd().as_raw_fd(),
                msgs.as_mut_ptr().add(off),
                // More than u32::MAX at once is sent in several calls (the loop goes on).
                u32::try_from(msgs.len() - off).unwrap_or(u32::MAX),
                0,
            )
        };
        // A negative count is a failure.
        let Ok(sent) = usize::try_from(r) else {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) | Some(libc::ENOBUFS) | Some(libc::EINTR) if spins < 1000 => {
                    spins += 1;
                    std::thread::yield_now();
                    continue;
                }
                // A closed port answered (ICMP): skip that packet, retransmission covers it.
                Some(libc::ECONNREFUSED) => {
                    off += 1;
                    continue;
                }
                _ => return lost_or_err(e),
            }
        };
        off += sent;
    }
    Ok(())
}

/// Receive buffers and the packets of the last [`recv`]: each GRO run is split at its segment
/// size into packets that are read in place (no per-packet copy or allocation).
pub struct RecvBufs {
    big: Vec<Vec<u8>>,
    /// (buffer, offset, length, source) of each packet received by the last call.
    pkts: Vec<(usize, usize, usize, SocketAddr)>,
}

impl Default for RecvBufs {
    fn default() -> Self {
        Self::new()
    }
}

impl RecvBufs {
    /// Messages per `recvmmsg`.
    const MSGS: usize = 16;

    pub fn new() -> Self {
        Self {
            big: (0..Self::MSGS).map(|_| vec![0u8; RECV_BUF]).collect(),
            pkts: Vec::new(),
        }
    }

    /// Packets received by the last call.
    pub fn len(&self) -> usize {
        self.pkts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pkts.is_empty()
    }

    /// Packet `i` of the last call and its source.
    pub fn packet(&self, i: usize) -> (&[u8], SocketAddr) {
        let (b, off, len, from) = self.pkts[i];
        (&self.big[b][off..off + len], from)
    }
}

/// Receives without waiting: up to 16 messages (GRO runs), split into packets in `rb`; returns
/// how many packets arrived.
pub fn recv(sock: &impl AsFd, rb: &mut RecvBufs, stats: &Stats) -> Result<usize, String> {
    const MSGS: usize = RecvBufs::MSGS;
    const VLEN: u32 = 16;
    const _: () = assert!(VLEN as usize == MSGS);
    rb.pkts.clear();
    let mut iov: Vec<libc::iovec> = rb
        .big
        .iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: sockaddr_in and mmsghdr are plain data; zero is valid for both.
    let mut names: [libc::sockaddr_in; MSGS] = unsafe { std::mem::zeroed() };
    // SAFETY: a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(c_size_of::<libc::c_int>()) } as usize;
    let stride = space.div_ceil(8);
    let mut ctrl = [0u64; 64];
    debug_assert!(stride * MSGS <= ctrl.len());
    // SAFETY: as above.
    let mut msgs: [libc::mmsghdr; MSGS] = unsafe { std::mem::zeroed() };
    for (i, ((m, v), a)) in msgs
        .iter_mut()
        .zip(iov.iter_mut())
        .zip(names.iter_mut())
        .enumerate()
    {
        m.msg_hdr.msg_iov = v;
        m.msg_hdr.msg_iovlen = 1;
        m.msg_hdr.msg_name = (a as *mut libc::sockaddr_in).cast();
        m.msg_hdr.msg_namelen = c_size_of::<libc::sockaddr_in>();
        // SAFETY: each message gets its own `space`-byte slice of ctrl.
        m.msg_hdr.msg_control = unsafe { ctrl.as_mut_ptr().add(i * stride) }.cast();
        m.msg_hdr.msg_controllen = space;
    }
    stats.recv_calls.fetch_add(1, Ordering::Relaxed);
    // SAFETY: every iovec, name and control area points into live buffers of the stated sizes.
    let r = unsafe {
        libc::recvmmsg(
            sock.as_fd().as_raw_fd(),
            msgs.as_mut_ptr(),
            VLEN,
            libc::MSG_DONTWAIT,
            std::ptr::null_mut(),
        )
    };
    // A negative count is a failure.
    let Ok(got) = usize::try_from(r) else {
        let e = std::io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) | Some(libc::EINTR) | Some(libc::ECONNREFUSED) => Ok(0),
            _ => Err(format!("UDP receive: {e}")),
        };
    };
    for (i, m) in msgs.iter().enumerate().take(got) {
        let len = m.msg_len as usize;
        let mut seg = len;
        // SAFETY: the kernel filled msg_control up to msg_controllen with valid cmsgs.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&m.msg_hdr);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_UDP && (*c).cmsg_type == UDP_GRO {
                    let g = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<libc::c_int>());
                    if let Ok(g) = usize::try_from(g)
                        && g > 0
                    {
                        seg = g;
                    }
                }
                c = libc::CMSG_NXTHDR(&m.msg_hdr, c);
            }
        }
        let a = &names[i];
        let from = SocketAddr::new(
            IpAddr::V4(Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr))),
            u16::from_be(a.sin_port),
        );
        let seg = seg.max(1);
        let mut off = 0;
        while off < len {
            let l = seg.min(len - off);
            rb.pkts.push((i, off, l, from));
            off += l;
        }
    }
    Ok(rb.pkts.len())
}

/// Waits up to `wait` for `sock` to become readable.
pub fn wait_readable(sock: &impl AsFd, wait: std::time::Duration) {
    let mut fds = [rustix::event::PollFd::new(
        sock,
        rustix::event::PollFlags::IN,
    )];
    let ts = rustix::event::Timespec {
        // A wait past i64::MAX seconds is forever all the same.
        tv_sec: i64::try_from(wait.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(wait.subsec_nanos()),
    };
    let _ = rustix::event::poll(&mut fds, Some(&ts));
}
