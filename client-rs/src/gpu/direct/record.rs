//! The failure records of direct ops: read from the record page, watched by the watchdog, and
//! turned into the op's error (with the daemon's reason for a broken communicator).

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::sync::atomic::{AtomicU32, Ordering};

use super::signature::{Record, explain};
use crate::gpu::kernels::direct as k;
use crate::{Error, lock};

/// An eager window set's failure record that the watchdog looks at (every 100 ms:
/// [`crate::Inner::report_direct_failures`]). A direct op that failed because a peer sent the
/// same op to the daemon's path ([`k::ELSEWHERE`]) leaves that peer waiting in the daemon,
/// which never sees the direct op: this rank then fails the communicator in the daemon
/// (`FailCommunicator`) with its own error, once, so every rank is told at once.
pub(crate) struct RecordWatch {
    pub(crate) page: usize,
    pub(crate) handle: u32,
    pub(crate) rank: u32,
    pub(crate) told: bool,
    /// The record of the communicator's direct send/recv (`p2p::P2pShared`), whose
    /// [`k::ELSEWHERE`] is a peer's send or receive on the daemon's path.
    pub(crate) p2p: bool,
}

impl crate::Inner {
    /// Tells the daemon, once per window set, of a record `r` (read from `page`) saying that a
    /// peer ran this rank's direct op on the daemon's path; `None`: looks at every window set's
    /// record (the watchdog). Errors of the call are dropped: the peers then fail at the op
    /// timeout, as before.
    pub(crate) fn report_direct_failures(&self, seen: Option<(usize, &Record)>) {
        let todo: Vec<(u32, String)> = {
            let mut g = lock(&self.gpu);
            g.records
                .iter_mut()
                .filter(|w| !w.told && seen.is_none_or(|(p, _)| p == w.page))
                .filter_map(|w| {
                    let r = match seen {
                        Some((_, r)) => *r,
                        None => read_record(w.page, false)?,
                    };
                    (r.code == k::ELSEWHERE).then(|| {
                        w.told = true;
                        let why = if w.p2p {
                            super::signature::explain_p2p(&r)
                        } else {
                            explain(&r, w.rank, true)
                        };
                        (w.handle, why)
                    })
                })
                .collect()
        };
        for (handle, why) in todo {
            let _ = self.fail_comm(handle, commd_proto::desc::status::MISMATCH, &why);
        }
    }
}

impl crate::Inner {
    /// The error of a direct op of communicator `handle` that failed with `code` (`message`:
    /// what failed, and why as the GPU saw it). One that stopped on the broken hint
    /// ([`k::BROKEN`]) knows only that the communicator is broken: the daemon's reason is
    /// added, with its status (`GetCommFailure`), so the error names the lost rank, the timed
    /// out op or the rank that failed the communicator.
    pub(crate) fn direct_error(&self, handle: u32, code: u32, message: String) -> Error {
        if code == k::BROKEN {
            return match self.comm_failure(handle) {
                Ok(Some((st, why))) => Error::Op {
                    kind: crate::OpErrorKind::from_status(st),
                    message: format!("{message}: {why}"),
                },
                Ok(None) | Err(_) => Error::Op {
                    kind: super::signature::op_error_kind(code),
                    message: format!(
                        "{message} (a rank's process or the daemon was lost, an op of it timed out in the daemon, or a rank failed it; the daemon could not say which: the next op on the communicator names it)"
                    ),
                },
            };
        }
        Error::Op {
            kind: super::signature::op_error_kind(code),
            message,
        }
    }
}

/// The failure record at `page` (a set of windows' record page), if the kernel wrote one since
/// the last look; `take`: cleared (the kernel writes the next failure's there).
pub(super) fn read_record(page: usize, take: bool) -> Option<Record> {
    let base = page as *mut u8;
    // SAFETY: the record is a leaked page (see `setup`), 8-byte aligned; the GPU writes
    // it with volatile stores, code last, so code is read first with acquire.
    unsafe {
        let code = &*base.cast::<AtomicU32>();
        let c = code.load(Ordering::Acquire);
        if c == 0 {
            return None;
        }
        let w = |i: usize| std::ptr::read_volatile(base.cast::<u64>().add(i));
        let r = Record {
            code: c,
            rank: std::ptr::read_volatile(base.cast::<u32>().add(1)),
            epoch: w(1),
            mine: (w(2), w(3)),
            theirs: (w(4), w(5)),
        };
        if take {
            code.store(0, Ordering::Release);
        }
        Some(r)
    }
}
