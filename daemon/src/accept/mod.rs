//! Connections to the control socket, accepted for tonic: at most `max_connections_per_uid`
//! open per uid (each is an fd of the daemon's), and an accept that fails for want of fds
//! (`EMFILE`, `ENFILE`) backs off instead of failing again at once in a busy loop (tonic retries
//! a failed accept immediately).
//!
//! A connection over the cap is closed at once, with a rate-limited WARN naming the uid; the
//! client sees its connection closed. What a client sends is read through [`authority`] until
//! its first request shows an authority h2 accepts (so gRPC C-core clients work as they are);
//! the peer credentials (`UdsConnectInfo`) the services read and the writes pass unchanged.

mod authority;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{UnixListener, UnixStream};
use tonic::transport::server::{Connected, UdsConnectInfo};

/// How long accepting pauses after the daemon ran out of fds.
const BACKOFF: Duration = Duration::from_millis(50);

type Counts = Arc<Mutex<HashMap<u32, usize>>>;

/// One accepted connection; its uid's count goes down when tonic drops it.
pub struct Conn {
    io: UnixStream,
    uid: u32,
    counts: Counts,
    /// Until the connection is known to need no rewriting (then `None`).
    rewrite: Option<Box<authority::Rewriter>>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        if let Some(n) = self
            .rewrite
            .as_ref()
            .map(|r| r.rewritten())
            .filter(|n| *n > 0)
        {
            tracing::debug!(target: "commd::session", "control connection of uid {} closed; the :authority of its {n} request(s) was rewritten to localhost", self.uid);
        }
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = c.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                c.remove(&self.uid);
            }
        }
    }
}

impl Connected for Conn {
    type ConnectInfo = UdsConnectInfo;
    fn connect_info(&self) -> UdsConnectInfo {
        self.io.connect_info()
    }
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let me = &mut *self;
        loop {
            let Some(rw) = me.rewrite.as_mut() else {
                return Pin::new(&mut me.io).poll_read(cx, buf);
            };
            if rw.has_output() {
                buf.put_slice(&rw.take(buf.remaining()));
                return Poll::Ready(Ok(()));
            }
            if rw.done() {
                me.rewrite = None;
                continue;
            }
            let mut chunk = [0u8; 16384];
            let mut rb = ReadBuf::new(&mut chunk);
            ready!(Pin::new(&mut me.io).poll_read(cx, &mut rb))?;
            if rb.filled().is_empty() {
                return Poll::Ready(Ok(())); // end of stream
            }
            if let Err(why) = rw.feed(rb.filled()) {
                crate::telemetry::ratelimit::warn_limited!(target: "commd::session", "control socket: uid {}: {why}; closed the connection", me.uid);
                return Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    why,
                )));
            }
        }
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// The stream of accepted connections tonic serves.
pub struct Incoming {
    listener: UnixListener,
    per_uid: usize,
    counts: Counts,
    pause: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Incoming {
    pub fn new(listener: UnixListener, per_uid: usize) -> Self {
        Self {
            listener,
            per_uid,
            counts: Counts::default(),
            pause: None,
        }
    }

    /// Counts `io` for its uid, or `None` (closed) when the uid is at its cap.
    fn admit(&self, io: UnixStream) -> Option<Conn> {
        let uid = match io.peer_cred() {
            Ok(c) => c.uid(),
            Err(e) => {
                crate::telemetry::ratelimit::warn_limited!(target: "commd::session", "control socket: cannot read a connection's peer credentials: {e}; closed it");
                return None;
            }
        };
        let mut c = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        let n = c.entry(uid).or_default();
        if *n >= self.per_uid {
            let held = *n;
            drop(c);
            crate::telemetry::ratelimit::warn_limited!(target: "commd::session", "control socket: uid {uid} holds {held} connections, its maximum (max_connections_per_uid); closed a new one");
            return None;
        }
        *n += 1;
        drop(c);
        Some(Conn {
            io,
            uid,
            counts: self.counts.clone(),
            rewrite: Some(Box::default()),
        })
    }
}

impl tokio_stream::Stream for Incoming {
    type Item = std::io::Result<Conn>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(p) = self.pause.as_mut() {
                ready!(p.as_mut().poll(cx));
                self.pause = None;
            }
            match ready!(self.listener.poll_accept(cx)) {
                Ok((io, _)) => {
                    if let Some(conn) = self.admit(io) {
                        return Poll::Ready(Some(Ok(conn)));
                    }
                }
                Err(e) => {
                    let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                    crate::telemetry::ratelimit::warn_limited!(target: "commd::session", "control socket accept failed: {e}");
                    if out_of_fds {
                        self.pause = Some(Box::pin(tokio::time::sleep(BACKOFF)));
                    }
                }
            }
        }
    }
}
