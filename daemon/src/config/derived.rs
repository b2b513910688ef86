//! Defaults derived from the machine and the daemon's own process limits: physical memory,
//! `vm.max_map_count` and `RLIMIT_NOFILE`. The per-uid bounds of the registry (`max_*_per_uid`,
//! 0: derived) default to a share of what the daemon itself can hold, so that no single user's
//! registrations, staged fds or connections can use up a limit that every other user's sessions
//! need (docs/reliability.md, "Tenancy").
//!
//! May use: std, libc, rustix (reads limits; raises the soft fd limit once).

use std::sync::OnceLock;

/// The host's physical memory in bytes (u64::MAX when it cannot be read).
#[allow(unsafe_code)] // sysconf(3)
pub fn physical_memory() -> u64 {
    // SAFETY: sysconf only reads system constants.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    match (u64::try_from(pages), u64::try_from(size)) {
        (Ok(pages @ 1..), Ok(size @ 1..)) => pages.saturating_mul(size),
        _ => u64::MAX,
    }
}

/// `vm.max_map_count`: the memory maps one process may hold (the kernel's default, 65530, when
/// it cannot be read).
pub fn max_map_count() -> u64 {
    std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|n| *n > 0)
        .unwrap_or(65530)
}

/// The daemon's fd limit, after raising the soft limit to the hard one (once per process; what
/// systemd recommends for services that hold many fds; `select(2)` is not used anywhere).
pub fn nofile() -> u64 {
    static N: OnceLock<u64> = OnceLock::new();
    *N.get_or_init(|| {
        use rustix::process::{Resource, getrlimit, setrlimit};
        let mut l = getrlimit(Resource::Nofile);
        if l.current != l.maximum {
            l.current = l.maximum;
            let _ = setrlimit(Resource::Nofile, l);
        }
        getrlimit(Resource::Nofile).current.unwrap_or(1 << 20)
    })
}

/// Memory maps kept for everything but registrations: sessions' rings, thread stacks, the
/// runtime, CUDA.
pub fn map_reserve(max_map_count: u64) -> u64 {
    (max_map_count / 8).max(8192).min(max_map_count / 2)
}

/// Fds kept for everything but staged fds and control connections: sessions' fd sockets and
/// rings, listeners, peers, logs, so that `accept` keeps working.
pub fn fd_reserve(nofile: u64) -> u64 {
    (nofile / 8).max(256).min(nofile / 2)
}

/// A uid's default share of a daemon-wide bound: a quarter, so at least four users (or one
/// user's four jobs at their limit) fit beside each other.
pub fn per_uid_share(total: u64) -> u64 {
    (total / 4).max(1)
}

/// The daemon-wide derived bounds, from the machine's values (separate from the reads above, so
/// tests can feed any values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Derived {
    /// Registrations (host and GPU) the daemon holds at once.
    pub registrations: u64,
    /// Fds staged on the fd socket and not yet registered, daemon-wide.
    pub staged_fds: u64,
    /// Control-socket connections of one uid.
    pub connections_per_uid: u64,
    /// Registered host memory of one uid.
    pub registered_bytes_per_uid: u64,
}

impl Derived {
    pub fn of(max_map_count: u64, nofile: u64, memory: u64) -> Self {
        let fds = nofile.saturating_sub(fd_reserve(nofile));
        Self {
            registrations: max_map_count
                .saturating_sub(map_reserve(max_map_count))
                .max(1),
            staged_fds: (fds / 4).max(16),
            connections_per_uid: (fds / 8).max(16),
            registered_bytes_per_uid: (memory / 2).max(1 << 20),
        }
    }

    pub fn here() -> Self {
        Self::of(max_map_count(), nofile(), physical_memory())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_leave_room_for_every_other_user() {
        let d = Derived::of(65530, 1 << 20, 64 << 30);
        // The kernel's default map count: a reserve of 8192 maps for sessions.
        assert_eq!(d.registrations, 65530 - 8192);
        assert_eq!(per_uid_share(d.registrations), (65530 - 8192) / 4);
        // Staged fds and connections together stay below the fds left after the reserve.
        let fds = (1u64 << 20) - (1 << 17);
        assert!(d.staged_fds + d.connections_per_uid * 2 <= fds);
        assert_eq!(d.registered_bytes_per_uid, 32 << 30);
        // A small fd limit still leaves a working daemon (and a usable minimum per uid).
        let small = Derived::of(65530, 1024, 1 << 30);
        assert!(small.staged_fds >= 16 && small.staged_fds < 1024 - fd_reserve(1024));
        assert!(fd_reserve(1024) >= 256);
        // A tiny map count keeps half for the daemon.
        assert_eq!(Derived::of(10000, 1024, 1 << 30).registrations, 5000);
    }

    #[test]
    fn the_soft_fd_limit_is_raised_to_the_hard_one() {
        let n = nofile();
        let l = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        assert_eq!(Some(n), l.current);
        assert_eq!(l.current, l.maximum);
    }
}
