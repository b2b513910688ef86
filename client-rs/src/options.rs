//! Client-side settings: where the daemon's socket is, the session's [`Options`] and a
//! communicator's [`CommOptions`].

use crate::default_socket_path;
use std::path::PathBuf;
use std::time::Duration;

/// Where a client looks for the daemon: `$COMMD_SOCKET`, else this user's default socket if it
/// exists, else the system daemon's `/run/commd/commd.sock`.
pub fn resolve_socket_path() -> PathBuf {
    if let Some(p) = commd_settings::get_os(&commd_settings::keys::SOCKET).filter(|p| !p.is_empty())
    {
        return PathBuf::from(p);
    }
    let mine = default_socket_path();
    if mine.exists() {
        mine
    } else {
        PathBuf::from("/run/commd/commd.sock")
    }
}

/// Client-side tuning.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long a waiter polls (yielding the core between looks) before sleeping on the
    /// completion futex (default 50 us, `COMMD_CLIENT_SPIN_US`).
    pub spin: Duration,
    /// Shown in `commd status`.
    pub name: String,
    /// Ring sizes (0: daemon default).
    pub ring_entries: u32,
    /// A waiter that sees the daemon's heartbeat word stand still this long fails with
    /// [`Error::DaemonLost`] instead of waiting on (a daemon stopped with SIGSTOP, hung, or
    /// starved): default 10 s, `COMMD_DAEMON_TIMEOUT_MS` (0: wait forever). The daemon's ring
    /// poller bumps the word at least every 100 ms while it runs.
    pub daemon_timeout: Option<Duration>,
}

/// [`Options::daemon_timeout`]'s default.
pub const DEFAULT_DAEMON_TIMEOUT: Duration = Duration::from_secs(10);

impl Default for Options {
    fn default() -> Self {
        let spin_us = commd_settings::get(&commd_settings::keys::CLIENT_SPIN_US)
            .and_then(|v| v.parse().ok())
            .unwrap_or(50);
        // An invalid value is refused by `Client::connect_with` (`daemon_timeout_env`).
        let daemon_timeout = daemon_timeout_env()
            .ok()
            .flatten()
            .unwrap_or(Some(DEFAULT_DAEMON_TIMEOUT));
        Self {
            spin: Duration::from_micros(spin_us),
            name: format!("pid {}", std::process::id()),
            ring_entries: 0,
            daemon_timeout,
        }
    }
}

/// `COMMD_DAEMON_TIMEOUT_MS`: `Ok(None)` when unset, `Ok(Some(None))` for 0 (wait forever),
/// `Err` naming the variable for anything that is not a number of milliseconds.
pub(crate) fn daemon_timeout_env() -> std::result::Result<Option<Option<Duration>>, String> {
    let Some(v) = commd_settings::get_os(&commd_settings::keys::DAEMON_TIMEOUT_MS) else {
        return Ok(None);
    };
    match v
        .to_str()
        .map(str::trim)
        .and_then(|s| s.parse::<u64>().ok())
    {
        Some(0) => Ok(Some(None)),
        Some(ms) => Ok(Some(Some(Duration::from_millis(ms)))),
        None => Err(format!(
            "COMMD_DAEMON_TIMEOUT_MS={v:?}: expected milliseconds (0: wait for a stopped daemon forever; default 10000)"
        )),
    }
}

/// Communicator options.
#[derive(Clone, Debug, Default)]
pub struct CommOptions {
    /// Per-op timeout (daemon default: `op_timeout_ms`).
    pub op_timeout: Option<Duration>,
    /// How long to wait for the other ranks to join (daemon default: `join_timeout_ms`).
    pub join_timeout: Option<Duration>,
    /// Switch session for the inter-node step of all-reduce: `off` or a SwitchML controller
    /// `HOST:PORT` (daemon default: its `switch` setting).
    pub switch: Option<String>,
    /// Cap on the bandwidth of the daemon's GPU copies for this communicator on this node, in
    /// bytes per second: `None` = the daemon's `gpu_pacing_gbps`, `Some(0)` = uncapped, else at
    /// least 1 MB/s ([`commd_proto::MIN_PACING_BYTES_PER_SEC`]). Every rank on a node must end
    /// up with the same cap (`None` counts as the daemon's default), else creation fails naming
    /// both values. Host-memory ops are not paced.
    pub pacing_bytes_per_sec: Option<u64>,
    /// A name for the communicator (NCCL's `commName`, torch's group), shown in `commd status`,
    /// logs and errors beside its id: at most 128 bytes of printable text. The first rank on a
    /// node to give one names it there.
    pub name: Option<String>,
}
