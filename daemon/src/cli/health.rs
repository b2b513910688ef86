//! `commd health`: is the daemon on this socket serving? For systemd `ExecStartPost`-style checks,
//! Kubernetes readiness/liveness probes and scripts.
//!
//! A check opens a real session (gRPC `Hello`, attach on the fd socket, ring memory) and asks for
//! `Status`, so both sockets and the control plane are exercised, all within a deadline. A daemon
//! that answers but refuses the session because it serves its maximum of sessions is reported as
//! alive (it is working, only full): restarting it would kill every job it serves. This module
//! only checks and reports; printing and exit codes belong to `main.rs`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use commd_client::{Client, Error, Options};
use thiserror::Error;

/// What a healthy daemon reported.
#[derive(Debug, Clone)]
pub struct Healthy {
    pub socket: PathBuf,
    pub version: String,
    pub pid: i32,
    pub uptime: Duration,
    /// Other clients' sessions (the check's own session is not counted).
    pub sessions: usize,
    pub communicators: u32,
    /// `Some(reason)` when the daemon answered but could not take another session.
    pub saturated: Option<String>,
}

impl std::fmt::Display for Healthy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.saturated {
            Some(why) => write!(
                f,
                "commd healthy (busy): {} answers but refused a session: {why}",
                self.socket.display()
            ),
            None => write!(
                f,
                "commd healthy: {} serves {}, pid {}, up {:.1}s, {} sessions, {} communicators",
                self.socket.display(),
                self.version,
                self.pid,
                self.uptime.as_secs_f64(),
                self.sessions,
                self.communicators
            ),
        }
    }
}

#[derive(Debug, Error)]
pub enum HealthError {
    #[error("unhealthy: {0}")]
    Unreachable(String),
    #[error(
        "unhealthy: no answer from the commd daemon at {} within {} ms (it is hung or overloaded)",
        socket.display(),
        timeout.as_millis()
    )]
    Timeout { socket: PathBuf, timeout: Duration },
    #[error("unhealthy: the commd daemon at {} failed a status call: {err}", socket.display())]
    Status { socket: PathBuf, err: String },
}

/// Checks the daemon at `socket` within `timeout`.
pub fn check(socket: &Path, timeout: Duration) -> Result<Healthy, HealthError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let path = socket.to_path_buf();
    // The client API blocks without a deadline; run it on its own thread and stop waiting at the
    // deadline. The process exits right after a check, taking a stuck thread with it.
    std::thread::Builder::new()
        .name("commd-health".into())
        .spawn(move || {
            let _ = tx.send(probe(&path));
        })
        .map_err(|e| HealthError::Unreachable(format!("cannot start the check: {e}")))?;
    rx.recv_timeout(timeout).unwrap_or_else(|_| {
        Err(HealthError::Timeout {
            socket: socket.to_path_buf(),
            timeout,
        })
    })
}

fn probe(socket: &Path) -> Result<Healthy, HealthError> {
    let opts = Options {
        name: "commd health".into(),
        // The smallest ring: the check posts no ops.
        ring_entries: 1,
        ..Options::default()
    };
    let client = match Client::connect_with(Some(socket), opts) {
        Ok(c) => c,
        Err(Error::Rpc {
            code: tonic::Code::ResourceExhausted,
            message,
            ..
        }) => {
            return Ok(Healthy {
                socket: socket.to_path_buf(),
                version: String::new(),
                pid: 0,
                uptime: Duration::ZERO,
                sessions: 0,
                communicators: 0,
                saturated: Some(message),
            });
        }
        Err(e) => return Err(HealthError::Unreachable(e.to_string())),
    };
    let s = client.status().map_err(|e| HealthError::Status {
        socket: socket.to_path_buf(),
        err: e.to_string(),
    })?;
    Ok(Healthy {
        socket: socket.to_path_buf(),
        version: s.daemon_version,
        pid: s.pid,
        uptime: Duration::from_millis(s.uptime_ms),
        sessions: s
            .session_list
            .iter()
            .filter(|x| x.session_id != client.session_id())
            .count(),
        communicators: s.communicators,
        saturated: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_socket_is_unhealthy_with_a_clear_message() {
        let p = std::env::temp_dir().join(format!("commd-health-none-{}.sock", std::process::id()));
        let e = check(&p, Duration::from_secs(5)).unwrap_err().to_string();
        assert!(e.starts_with("unhealthy:"), "{e}");
        assert!(e.contains(&p.display().to_string()), "{e}");
        assert!(e.contains("commd serve"), "{e}");
    }

    #[test]
    fn socket_that_never_answers_times_out() {
        // A listener nobody accepts on: connect succeeds (backlog), the RPC never completes.
        let p = std::env::temp_dir().join(format!(
            "commd-health-mute-{}-{}.sock",
            std::process::id(),
            rand::random::<u32>()
        ));
        let _l = std::os::unix::net::UnixListener::bind(&p).unwrap();
        let t0 = std::time::Instant::now();
        let e = check(&p, Duration::from_millis(300)).unwrap_err();
        assert!(matches!(e, HealthError::Timeout { .. }), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(3));
        assert!(e.to_string().contains("within 300 ms"), "{e}");
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn healthy_line_names_socket_and_pid() {
        let h = Healthy {
            socket: "/run/commd/commd.sock".into(),
            version: "0.1.0".into(),
            pid: 42,
            uptime: Duration::from_millis(1500),
            sessions: 2,
            communicators: 1,
            saturated: None,
        };
        let s = h.to_string();
        assert!(
            s.starts_with("commd healthy:")
                && s.contains("pid 42")
                && s.contains("/run/commd/commd.sock")
        );
    }
}
