//! The fd-socket server (SOCK_SEQPACKET beside the gRPC socket): attaches sessions, hands them
//! their ring memfd, stages client memfds for registration, and ends a session when its
//! connection closes (the kernel closes it when the client dies, SIGKILL included).
//!
//! One blocking thread per connection (`commd-fd-<session>`); connections are few (one per client
//! process) and long-lived. A connection that has not attached yet holds its thread for at most
//! `attach_timeout_ms`, and one uid may have at most [`MAX_UNATTACHED_PER_UID`] of those at once,
//! so idle connections cannot grow the daemon's threads without limit; attached ones are bounded
//! by the sessions a uid may hold (`max_sessions_per_uid`).

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use commd_proto::desc::status;
use commd_proto::fdproto::{self, FdMsg, kind};
use rustix::net::SocketFlags;

use crate::daemon::Daemon;

/// Connections of one uid that may wait for ATTACH at once. A client attaches right after its
/// Hello, so even a process opening sessions from many threads stays far below this.
pub const MAX_UNATTACHED_PER_UID: usize = 64;

/// Unattached connections per uid.
type Pending = Arc<Mutex<HashMap<u32, usize>>>;

/// Counts one unattached connection of a uid until dropped.
struct PendingSlot {
    pending: Pending,
    uid: u32,
}

impl Drop for PendingSlot {
    fn drop(&mut self) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = p.get_mut(&self.uid) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                p.remove(&self.uid);
            }
        }
    }
}

/// Accept loop; runs until the process exits.
pub fn serve(daemon: Arc<Daemon>, listener: OwnedFd) {
    let pending: Pending = Arc::default();
    loop {
        match rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
            Ok(conn) => {
                let uid = match rustix::net::sockopt::socket_peercred(&conn) {
                    Ok(c) => c.uid.as_raw(),
                    Err(e) => {
                        reply_err(&conn, format!("cannot read peer credentials: {e}"));
                        continue;
                    }
                };
                let slot = {
                    let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
                    let n = p.entry(uid).or_default();
                    if *n >= MAX_UNATTACHED_PER_UID {
                        drop(p);
                        reply_err(
                            &conn,
                            format!(
                                "uid {uid} has {MAX_UNATTACHED_PER_UID} fd-socket connections waiting to attach; refusing more until they attach or time out (attach_timeout_ms)"
                            ),
                        );
                        continue;
                    }
                    *n += 1;
                    PendingSlot {
                        pending: pending.clone(),
                        uid,
                    }
                };
                let d = daemon.clone();
                let r = std::thread::Builder::new()
                    .name("commd-fd-conn".into())
                    .spawn(move || handle(d, conn, slot));
                if let Err(e) = r {
                    tracing::error!(target: "commd::session", "cannot start fd-socket thread: {e}");
                }
            }
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                crate::telemetry::ratelimit::warn_limited!(target: "commd::session", "fd socket accept failed: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn reply_err(conn: &OwnedFd, text: String) {
    crate::telemetry::ratelimit::warn_limited!(target: "commd::session", "fd socket: {text}");
    let _ = fdproto::send(conn.as_fd(), &FdMsg::error(text), None);
}

fn handle(daemon: Arc<Daemon>, conn: OwnedFd, slot: PendingSlot) {
    let cred = match rustix::net::sockopt::socket_peercred(&conn) {
        Ok(c) => c,
        Err(e) => return reply_err(&conn, format!("cannot read peer credentials: {e}")),
    };
    // The first message must arrive promptly.
    let _ = rustix::net::sockopt::set_socket_timeout(
        &conn,
        rustix::net::sockopt::Timeout::Recv,
        Some(daemon.cfg.attach_timeout),
    );
    let first = match fdproto::recv(conn.as_fd()) {
        Ok(Some((m, _))) => m,
        Ok(None) => return,
        Err(e) => return reply_err(&conn, format!("expected ATTACH: {e}")),
    };
    if first.kind != kind::ATTACH {
        return reply_err(
            &conn,
            format!("expected ATTACH, got message kind {}", first.kind),
        );
    }
    let Some(s) = daemon.session(first.session_id) else {
        return reply_err(&conn, format!("no session {}", first.session_id));
    };
    let uid = cred.uid.as_raw();
    let pid = cred.pid.as_raw_nonzero().get();
    if s.uid != uid || s.pid != pid || !constant_time_eq(&s.secret, &first.secret) {
        return reply_err(
            &conn,
            format!("session {} cannot be attached by uid {uid} pid {pid}", s.id),
        );
    }
    if s.attached.swap(true, Ordering::AcqRel) {
        return reply_err(&conn, format!("session {} is already attached", s.id));
    }
    let ok = FdMsg {
        kind: kind::ATTACH_OK,
        session_id: s.id,
        arg: s.ring.layout().total_bytes,
        ..Default::default()
    };
    if let Err(e) = fdproto::send(conn.as_fd(), &ok, Some(s.ring_file.as_fd())) {
        daemon.close_session(
            s.id,
            status::PEER_LOST,
            &format!("sending ring memory failed: {e}"),
        );
        return;
    }
    let _ =
        rustix::net::sockopt::set_socket_timeout(&conn, rustix::net::sockopt::Timeout::Recv, None);
    // The session's ring poller.
    let sp = s.clone();
    let dp = daemon.clone();
    let spin = daemon.cfg.poll_spin;
    let started = std::thread::Builder::new()
        .name(format!("commd-ring-{}", s.id))
        .spawn(move || {
            if let Some(violation) = sp.poll_loop(spin) {
                dp.close_session(
                    sp.id,
                    status::INVALID,
                    &format!("ring protocol violation: {violation}"),
                );
            }
        });
    if let Err(e) = started {
        daemon.close_session(
            s.id,
            status::INTERNAL,
            &format!("cannot start ring poller: {e}"),
        );
        return;
    }
    drop(slot);
    tracing::debug!(target: "commd::session", session = s.id, "attached");
    let reason = loop {
        match fdproto::recv(conn.as_fd()) {
            Ok(None) => {
                break "client closed its session connection (exited or was killed)".to_string();
            }
            Err(e) => break format!("fd socket error: {e}"),
            Ok(Some((m, fd))) => {
                if s.is_closed() {
                    break "session closed".into();
                }
                match (m.kind, fd) {
                    (kind::STAGE, Some(fd)) => match daemon.stage_fd(&s, m.token, fd) {
                        Ok(()) => {
                            let ok = FdMsg {
                                kind: kind::STAGE_OK,
                                session_id: s.id,
                                token: m.token,
                                ..Default::default()
                            };
                            if fdproto::send(conn.as_fd(), &ok, None).is_err() {
                                break "fd socket closed while replying".into();
                            }
                        }
                        Err(e) => reply_err(&conn, e.to_string()),
                    },
                    (kind::STAGE, None) => {
                        reply_err(&conn, "STAGE without a file descriptor".into())
                    }
                    (k, _) => reply_err(&conn, format!("unexpected message kind {k}")),
                }
            }
        }
    };
    daemon.close_session(s.id, status::PEER_LOST, &reason);
}

fn constant_time_eq(a: &[u8; 16], b: &[u8; 16]) -> bool {
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
