//! Service-manager readiness notification (the `sd_notify(3)` protocol), without libsystemd.
//!
//! When systemd starts a `Type=notify` unit it sets `$NOTIFY_SOCKET` to a Unix datagram socket:
//! a filesystem path (`/run/systemd/notify`) or, with a leading `@`, a name in the abstract
//! namespace. The service sends newline-separated `KEY=VALUE` assignments in one datagram:
//! `READY=1` once it serves, `STOPPING=1` when it begins to shut down, `STATUS=...` as a one-line
//! human-readable state shown by `systemctl status`. The kernel attaches the sender's credentials,
//! which is how `NotifyAccess=main` tells the main process from others.
//!
//! This module only formats and sends those datagrams. It decides nothing about *when* the daemon
//! is ready: `serve` calls [`Notifier::ready`] after both sockets are bound and the control plane
//! runs, and [`Notifier::stopping`] when a stop signal arrives. A missing `$NOTIFY_SOCKET` (not
//! started by systemd) makes every call a no-op; a failed send is logged and never fatal, since
//! the daemon serves either way (systemd then reports a start timeout, which names the cause).
//!
//! Why not the `sd-notify` crate (checked with sd-notify 0.5.0 and a probe program against a
//! bound socket): it connects to `$NOTIFY_SOCKET` as a filesystem path, so an
//! `@abstract` address (what systemd hands services in some containers and nspawn machines)
//! fails with ENOENT and the manager never hears READY=1; it sends `STATUS=` text unchanged,
//! so a status line with a newline ("a\nREADY=1") delivers a second assignment; and its send
//! has no timeout. The tests below pin each of these (`abstract_socket_gets_ready`,
//! `newlines_in_values_cannot_inject_assignments`). This module stays small (formatting and one
//! datagram send) for those reasons.
//!
//! Socket activation (`$LISTEN_FDS`) is not implemented: the daemon binds its gRPC and fd
//! sockets itself and guards them with `<socket>.lock` (see `docs/deploy.md`).

use std::ffi::OsStr;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};
use std::time::Duration;

use thiserror::Error;

/// The environment variable systemd sets for `Type=notify` services.
pub const ENV: &str = "NOTIFY_SOCKET";

#[derive(Debug, Error)]
pub enum NotifyError {
    #[error(
        "{ENV}={0:?} is not a Unix socket path or @abstract name (vsock and other transports are not supported)"
    )]
    Unsupported(String),
    #[error("{ENV}={addr:?}: invalid socket address: {err}")]
    Address { addr: String, err: std::io::Error },
    #[error("sending {what:?} to {ENV}={addr:?}: {err}")]
    Send {
        what: String,
        addr: String,
        err: std::io::Error,
    },
}

/// Where notifications go: the service manager's datagram socket.
#[derive(Clone, Debug)]
pub struct Notifier {
    addr: SocketAddr,
    /// `$NOTIFY_SOCKET` as given, for messages.
    text: String,
}

impl Notifier {
    /// From `$NOTIFY_SOCKET`: `None` when unset or empty (not run by a service manager).
    pub fn from_env() -> Option<Result<Self, NotifyError>> {
        let v = commd_settings::system(ENV)?;
        if v.is_empty() {
            return None;
        }
        Some(Self::parse(&v))
    }

    /// [`Notifier::from_env`], logging (not failing on) a malformed value.
    pub fn from_env_or_warn() -> Option<Self> {
        match Self::from_env()? {
            Ok(n) => Some(n),
            Err(e) => {
                tracing::warn!(target: "commd::init", "readiness notification disabled: {e}");
                None
            }
        }
    }

    /// Parses a `$NOTIFY_SOCKET` value: `/abs/path` or `@abstract-name`.
    pub fn parse(value: &OsStr) -> Result<Self, NotifyError> {
        let text = value.to_string_lossy().into_owned();
        let bytes = value.as_bytes();
        let addr = match bytes.first() {
            Some(b'/') => SocketAddr::from_pathname(value),
            Some(b'@') => SocketAddr::from_abstract_name(&bytes[1..]),
            _ => return Err(NotifyError::Unsupported(text)),
        }
        .map_err(|err| NotifyError::Address {
            addr: text.clone(),
            err,
        })?;
        Ok(Self { addr, text })
    }

    /// Sends one datagram of `KEY=VALUE` lines (as `sd_notify`).
    pub fn send(&self, assignments: &[(&str, &str)]) -> Result<(), NotifyError> {
        let msg = format_message(assignments);
        let err = |err| NotifyError::Send {
            what: msg.clone(),
            addr: self.text.clone(),
            err,
        };
        let sock = UnixDatagram::unbound().map_err(err)?;
        // systemd drains its socket promptly; never let a wedged manager hold the daemon.
        sock.set_write_timeout(Some(Duration::from_secs(2)))
            .map_err(err)?;
        sock.send_to_addr(msg.as_bytes(), &self.addr).map_err(err)?;
        Ok(())
    }

    /// `READY=1` with a status line; logged, not returned, on failure.
    pub fn ready(&self, status: &str) {
        self.send_or_warn(&[("READY", "1"), ("STATUS", status)]);
    }

    /// `STOPPING=1` with a status line; logged, not returned, on failure.
    pub fn stopping(&self, status: &str) {
        self.send_or_warn(&[("STOPPING", "1"), ("STATUS", status)]);
    }

    /// `WATCHDOG=1`: the service is alive (systemd's `WatchdogSec=`).
    pub fn watchdog(&self) {
        self.send_or_warn(&[("WATCHDOG", "1")]);
    }

    /// `STATUS=...` alone.
    pub fn status(&self, status: &str) {
        self.send_or_warn(&[("STATUS", status)]);
    }

    fn send_or_warn(&self, assignments: &[(&str, &str)]) {
        match self.send(assignments) {
            Ok(()) => {
                tracing::debug!(target: "commd::init", "notified service manager: {assignments:?}")
            }
            Err(e) => tracing::warn!(target: "commd::init", "{e}"),
        }
    }
}

/// How often to send `WATCHDOG=1`: half of `$WATCHDOG_USEC` (set by systemd for a unit with
/// `WatchdogSec=`), when `$WATCHDOG_PID` is unset or names this process.
pub fn watchdog_interval() -> Option<Duration> {
    if let Some(pid) = commd_settings::system("WATCHDOG_PID")
        && pid.to_string_lossy().trim().parse::<u32>().ok() != Some(std::process::id())
    {
        return None;
    }
    let usec: u64 = commd_settings::system("WATCHDOG_USEC")?
        .to_str()?
        .trim()
        .parse()
        .ok()?;
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}

/// `KEY=VALUE\n...`; a newline inside a value would start a new assignment, so it becomes a space.
fn format_message(assignments: &[(&str, &str)]) -> String {
    let mut msg = String::new();
    for (k, v) in assignments {
        msg.push_str(k);
        msg.push('=');
        msg.push_str(&v.replace(['\n', '\r'], " "));
        msg.push('\n');
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn tmp_sock(tag: &str) -> PathBuf {
        std::env::temp_dir().join(format!(
            "commd-notify-{tag}-{}-{}.sock",
            std::process::id(),
            rand::random::<u64>()
        ))
    }

    fn recv(sock: &UnixDatagram) -> String {
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 4096];
        let n = sock.recv(&mut buf).unwrap();
        String::from_utf8(buf[..n].to_vec()).unwrap()
    }

    #[test]
    fn path_socket_gets_ready_and_stopping() {
        let path = tmp_sock("path");
        let server = UnixDatagram::bind(&path).unwrap();
        let n = Notifier::parse(path.as_os_str()).unwrap();
        n.send(&[("READY", "1"), ("STATUS", "serving /run/commd/commd.sock")])
            .unwrap();
        assert_eq!(
            recv(&server),
            "READY=1\nSTATUS=serving /run/commd/commd.sock\n"
        );
        n.stopping("shutting down: SIGTERM");
        assert_eq!(recv(&server), "STOPPING=1\nSTATUS=shutting down: SIGTERM\n");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn abstract_socket_gets_ready() {
        let name = format!("commd-notify-test-{}", rand::random::<u64>());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let server = UnixDatagram::bind_addr(&addr).unwrap();
        let n = Notifier::parse(OsStr::new(&format!("@{name}"))).unwrap();
        n.ready("up");
        assert_eq!(recv(&server), "READY=1\nSTATUS=up\n");
    }

    #[test]
    fn newlines_in_values_cannot_inject_assignments() {
        assert_eq!(
            format_message(&[("STATUS", "a\nREADY=1\r")]),
            "STATUS=a READY=1 \n"
        );
    }

    #[test]
    fn unsupported_and_missing_targets_are_errors() {
        assert!(matches!(
            Notifier::parse(OsStr::new("vsock:2:1234")),
            Err(NotifyError::Unsupported(_))
        ));
        assert!(matches!(
            Notifier::parse(OsStr::new("")),
            Err(NotifyError::Unsupported(_))
        ));
        // Nobody listens there: the send fails with a message naming the socket, and the
        // logging variant does not panic.
        let path = tmp_sock("absent");
        let n = Notifier::parse(path.as_os_str()).unwrap();
        let e = n.send(&[("READY", "1")]).unwrap_err().to_string();
        assert!(e.contains("NOTIFY_SOCKET") && e.contains("READY=1"), "{e}");
        n.ready("nobody listens");
    }
}
