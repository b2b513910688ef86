//! Watching the daemon: its heartbeat word and fd connection, and the thread that releases
//! GPU streams waiting on a daemon that died or stopped.

use crate::{Error, Inner, Result, lock};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The daemon's heartbeat as this client last saw it: (value, when it last changed).
pub(crate) struct Beat {
    pub(crate) value: u64,
    pub(crate) changed: Instant,
}

impl Inner {
    /// A thread that watches the daemon while this session has GPU ops: a stream waiting on a
    /// doorbell would otherwise wait forever for a daemon that died or stopped, with no CPU
    /// thread of the job in a commd call to notice (the CPU is blocked in CUDA). Every 100 ms it
    /// checks the fd connection and the heartbeat, and abandons the session when either says
    /// the daemon is gone. Started by the first GPU op; ends with the session.
    pub(crate) fn start_watchdog(self: &Arc<Self>) {
        self.watchdog.call_once(|| {
            let weak = Arc::downgrade(self);
            let r = std::thread::Builder::new()
                .name("commd-watchdog".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_millis(100));
                        let Some(i) = weak.upgrade() else { return };
                        if i.abandoned.load(Ordering::Acquire) {
                            break;
                        }
                        if i.daemon_gone() {
                            i.abandon_session("the daemon exited: its socket closed");
                            break;
                        }
                        if i.daemon_stalled().is_some() {
                            break;
                        }
                        // Graphs destroyed since the last look: the daemon drops their ops.
                        i.release_destroyed_graphs();
                        // A direct op failed because a peer ran it on the daemon's path: the
                        // peer waits in the daemon, which is told.
                        i.report_direct_failures(None);
                    }
                    // Abandoned (or the daemon stalled, which abandons at the next call). A
                    // captured op's stream resets its done word at the end of each replay,
                    // so its release is repeated while the process replays graphs.
                    loop {
                        let Some(i) = weak.upgrade() else { return };
                        if !i.graphs_used.load(Ordering::Acquire) {
                            return;
                        }
                        if i.abandoned.load(Ordering::Acquire) {
                            i.release_graph_streams();
                        }
                        drop(i);
                        std::thread::sleep(Duration::from_millis(10));
                    }
                });
            if let Err(e) = r {
                eprintln!("commd: cannot start the watchdog thread ({e}); a GPU stream waiting on a lost daemon is then released only by the next commd call that notices");
            }
        });
    }

    /// Whether the daemon side of the fd socket hung up (daemon exited).
    pub(crate) fn daemon_gone(&self) -> bool {
        let guard;
        let sock: std::os::fd::BorrowedFd<'_> = match &self.fd_sock_ctl {
            Some(fd) => fd.as_fd(),
            None => {
                guard = lock(&self.fd_sock);
                guard.as_fd()
            }
        };
        let mut fds = [rustix::event::PollFd::new(
            &sock,
            rustix::event::PollFlags::RDHUP | rustix::event::PollFlags::HUP,
        )];
        let zero = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(rustix::event::poll(&mut fds, Some(&zero)), Ok(n) if n > 0)
            && fds[0].revents().intersects(
                rustix::event::PollFlags::HUP
                    | rustix::event::PollFlags::RDHUP
                    | rustix::event::PollFlags::ERR,
            )
    }

    /// For a waiter that saw no progress: an error once the session was closed, the daemon
    /// exited (`when` says what was waiting), or its heartbeat stood still too long.
    pub(crate) fn check_daemon(&self, when: &str) -> Result<()> {
        if self.ring.session_error().load(Ordering::Acquire) != 0 && self.daemon_gone() {
            return Err(self.session_closed_error());
        }
        if self.daemon_gone() {
            let why = format!("the daemon exited (its socket closed) {when}");
            self.abandon_session(&why);
            return Err(self.lost(&why));
        }
        match self.daemon_stalled() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `Some(error)` when the daemon's heartbeat has stood still for `daemon_timeout`.
    pub(crate) fn daemon_stalled(&self) -> Option<Error> {
        let limit = self.daemon_timeout?;
        let now = self.ring.daemon_beat().load(Ordering::Relaxed);
        let mut b = lock(&self.beat);
        if now != b.value {
            *b = Beat {
                value: now,
                changed: Instant::now(),
            };
            return None;
        }
        let still = b.changed.elapsed();
        (still >= limit).then(|| {
            drop(b);
            let why = format!(
                "the daemon stopped answering: its heartbeat has not moved for {:.1} s (the daemon \
                 process is stopped, e.g. by SIGSTOP, hung, or starved of CPU)",
                still.as_secs_f64()
            );
            let limit_ms = limit.as_millis();
            self.abandon_session(&format!(
                "{why}. COMMD_DAEMON_TIMEOUT_MS={limit_ms} sets this limit"
            ));
            self.lost(&format!(
                "{why} with this op in flight; the op's outcome is unknown and this session takes \
                 no new work (connect again). COMMD_DAEMON_TIMEOUT_MS={limit_ms} sets this limit \
                 (0: wait forever)"
            ))
        })
    }
}
