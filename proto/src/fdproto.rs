//! The fd socket: a SOCK_SEQPACKET Unix socket beside the gRPC socket that carries what gRPC
//! cannot, file descriptors (SCM_RIGHTS), in fixed 256-byte messages.
//!
//! A client opens one connection per session and keeps it for the session's life; the daemon
//! treats its closing (the kernel closes it when the client dies, SIGKILL included) as the end of
//! the session. Messages:
//! - `ATTACH {session_id, secret}` -> `ATTACH_OK {arg = ring bytes}` + the ring memfd, or `ERROR`.
//! - `STAGE {token}` + a memfd -> `STAGE_OK {token}` or `ERROR`; the fd is then named by `token`
//!   in the `RegisterMemory` RPC.

use std::io::{self, IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

pub const MSG_BYTES: usize = 256;
const MAGIC: u32 = u32::from_le_bytes(*b"cmFD");
const TEXT_MAX: usize = 200;

pub mod kind {
    pub const ATTACH: u32 = 1;
    pub const ATTACH_OK: u32 = 2;
    pub const STAGE: u32 = 3;
    pub const STAGE_OK: u32 = 4;
    pub const ERROR: u32 = 5;
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FdMsg {
    pub kind: u32,
    pub session_id: u64,
    pub secret: [u8; 16],
    pub token: u64,
    pub arg: u64,
    pub text: String,
}

impl FdMsg {
    pub fn error(text: impl Into<String>) -> Self {
        Self {
            kind: kind::ERROR,
            text: text.into(),
            ..Default::default()
        }
    }

    pub fn encode(&self) -> [u8; MSG_BYTES] {
        let mut b = [0u8; MSG_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.kind.to_le_bytes());
        b[8..16].copy_from_slice(&self.session_id.to_le_bytes());
        b[16..32].copy_from_slice(&self.secret);
        b[32..40].copy_from_slice(&self.token.to_le_bytes());
        b[40..48].copy_from_slice(&self.arg.to_le_bytes());
        let mut t = self.text.as_bytes();
        if t.len() > TEXT_MAX {
            t = &t[..TEXT_MAX];
        }
        let len = u32::try_from(t.len()).expect("the text is clipped to TEXT_MAX bytes");
        b[48..52].copy_from_slice(&len.to_le_bytes());
        b[56..56 + t.len()].copy_from_slice(t);
        b
    }

    /// Decodes a message; `None` for anything malformed (wrong size or magic).
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != MSG_BYTES {
            return None;
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        if u32_at(0) != MAGIC {
            return None;
        }
        let mut secret = [0u8; 16];
        secret.copy_from_slice(&b[16..32]);
        let tlen = (u32_at(48) as usize).min(TEXT_MAX);
        Some(Self {
            kind: u32_at(4),
            session_id: u64_at(8),
            secret,
            token: u64_at(32),
            arg: u64_at(40),
            text: String::from_utf8_lossy(&b[56..56 + tlen]).into_owned(),
        })
    }
}

/// Sends one message, optionally passing one file descriptor.
pub fn send(sock: BorrowedFd<'_>, msg: &FdMsg, pass: Option<BorrowedFd<'_>>) -> io::Result<()> {
    let bytes = msg.encode();
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut anc = SendAncillaryBuffer::new(&mut space);
    let fds;
    if let Some(fd) = pass {
        fds = [fd];
        if !anc.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(io::Error::other("ancillary buffer too small"));
        }
    }
    let n = rustix::net::sendmsg(sock, &[IoSlice::new(&bytes)], &mut anc, SendFlags::NOSIGNAL)?;
    if n != MSG_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short fd-socket message",
        ));
    }
    Ok(())
}

/// Receives one message and at most one fd. `Ok(None)` means the peer closed the connection.
/// A malformed message is an `InvalidData` error; surplus fds are closed, never leaked.
pub fn recv(sock: BorrowedFd<'_>) -> io::Result<Option<(FdMsg, Option<OwnedFd>)>> {
    let mut buf = [0u8; MSG_BYTES + 1];
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut anc = RecvAncillaryBuffer::new(&mut space);
    let r = loop {
        match rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut buf)],
            &mut anc,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            other => break other?,
        }
    };
    let mut fd = None;
    for m in anc.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                // Keep the first, drop (close) any extras.
                if fd.is_none() {
                    fd = Some(f);
                }
            }
        }
    }
    if r.bytes == 0 {
        return Ok(None);
    }
    match FdMsg::decode(&buf[..r.bytes]) {
        Some(m) => Ok(Some((m, fd))),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "malformed fd-socket message",
        )),
    }
}

fn seqpacket() -> io::Result<OwnedFd> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType};
    Ok(rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Connects a SOCK_SEQPACKET client socket to `path`.
pub fn connect(path: &std::path::Path) -> io::Result<OwnedFd> {
    let fd = seqpacket()?;
    rustix::net::connect(&fd, &rustix::net::SocketAddrUnix::new(path)?)?;
    Ok(fd)
}

/// Binds and listens on `path` (the daemon side), replacing a stale socket file.
pub fn listen(path: &std::path::Path) -> io::Result<OwnedFd> {
    let _ = std::fs::remove_file(path);
    let fd = seqpacket()?;
    rustix::net::bind(&fd, &rustix::net::SocketAddrUnix::new(path)?)?;
    rustix::net::listen(&fd, 128)?;
    Ok(fd)
}

/// Convenience for `send(sock.as_fd(), ...)` on owned sockets.
pub fn send_owned(sock: &OwnedFd, msg: &FdMsg, pass: Option<BorrowedFd<'_>>) -> io::Result<()> {
    send(sock.as_fd(), msg, pass)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::{AddressFamily, SocketFlags, SocketType};

    #[test]
    fn encode_decode_round_trip() {
        let m = FdMsg {
            kind: kind::STAGE,
            session_id: 9,
            secret: [3; 16],
            token: 77,
            arg: 5,
            text: "hi".into(),
        };
        assert_eq!(FdMsg::decode(&m.encode()), Some(m));
        assert_eq!(FdMsg::decode(&[0u8; MSG_BYTES]), None);
        assert_eq!(FdMsg::decode(&[0u8; 10]), None);
        let long = FdMsg::error("x".repeat(1000));
        assert_eq!(FdMsg::decode(&long.encode()).unwrap().text.len(), TEXT_MAX);
    }

    #[test]
    fn passes_an_fd_and_reports_eof() {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        let memfd = rustix::fs::memfd_create("t", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::fs::ftruncate(&memfd, 4096).unwrap();
        let m = FdMsg {
            kind: kind::STAGE,
            token: 1,
            ..Default::default()
        };
        send(a.as_fd(), &m, Some(memfd.as_fd())).unwrap();
        let (got, fd) = recv(b.as_fd()).unwrap().unwrap();
        assert_eq!(got, m);
        assert_eq!(rustix::fs::fstat(fd.unwrap()).unwrap().st_size, 4096);
        drop(a);
        assert!(recv(b.as_fd()).unwrap().is_none());
    }

    #[test]
    fn rejects_garbage() {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        rustix::net::send(&a, b"garbage", SendFlags::empty()).unwrap();
        assert_eq!(
            recv(b.as_fd()).unwrap_err().kind(),
            io::ErrorKind::InvalidData
        );
    }
}
