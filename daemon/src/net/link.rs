//! The byte streams under [`super::wire::Wire`]: a TCP socket or an RDMA queue pair
//! ([`super::rdma::stream::RdmaStream`]). Both are nonblocking one-way streams with the same
//! `read`/`write` contract (`WouldBlock` when nothing can move now) and an fd to poll, so the
//! wire's framing, chunking, posted receives, heartbeats, ABORT and END are written once.
//!
//! A trait object would do too; an enum keeps the per-call dispatch a branch and lets the
//! connection pool take the TCP streams back by value.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::os::fd::{AsFd, BorrowedFd};
use std::time::Duration;

use rustix::event::PollFlags;

use super::rdma::stream::RdmaStream;

pub enum Link {
    Tcp(TcpStream),
    Rdma(RdmaStream),
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Link::Tcp(s) => write!(f, "Tcp({:?})", s.peer_addr().ok()),
            Link::Rdma(s) => write!(f, "{s:?}"),
        }
    }
}

impl Link {
    pub fn kind(&self) -> &'static str {
        match self {
            Link::Tcp(_) => "tcp",
            Link::Rdma(_) => "rdma",
        }
    }

    /// Prepares the stream for the wire (nonblocking, no Nagle).
    pub fn setup(&self) -> io::Result<()> {
        match self {
            Link::Tcp(s) => {
                s.set_nonblocking(true)?;
                s.set_nodelay(true)
            }
            Link::Rdma(_) => Ok(()),
        }
    }

    /// The fd and events to poll for: a socket's own readiness, or the RDMA stream's eventfd
    /// (readable whenever its completions changed something).
    pub fn poll_fd(&self, write: bool) -> (BorrowedFd<'_>, PollFlags) {
        match self {
            Link::Tcp(s) => (
                s.as_fd(),
                if write { PollFlags::OUT } else { PollFlags::IN },
            ),
            Link::Rdma(s) => (s.event_fd(), PollFlags::IN),
        }
    }

    /// True when the stream can move bytes right now without waiting for its fd: an RDMA
    /// stream's eventfd is an edge (a completion happened), not a level like a socket's
    /// readiness, so the wire asks here before it sleeps in `poll`.
    pub fn ready(&self, write: bool) -> bool {
        match self {
            Link::Tcp(_) => false,
            Link::Rdma(s) => s.ready(write),
        }
    }

    pub fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => s.read(buf),
            Link::Rdma(s) => s.read(buf),
        }
    }

    pub fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    pub fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => s.write_vectored(bufs),
            Link::Rdma(s) => s.write_vectored(bufs),
        }
    }

    /// Reads exactly `buf.len()` bytes, blocking up to `timeout` (short control texts).
    pub fn read_exact_timeout(&mut self, buf: &mut [u8], timeout: Duration) -> io::Result<()> {
        match self {
            Link::Tcp(s) => {
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(Some(timeout));
                let r = s.read_exact(buf);
                let _ = s.set_nonblocking(true);
                r
            }
            Link::Rdma(s) => s.read_exact_timeout(buf, timeout),
        }
    }
}
