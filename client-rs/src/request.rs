//! [`Request`]: a posted op that borrows nothing, for the bindings.

use crate::{Error, Inner, Result, gpu, lock};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A posted op that borrows nothing: for bindings (Python, C) whose callers keep the buffers
/// alive and untouched until the op completes. Thread-safe; the outcome is kept, so every
/// `wait`/`test` after completion returns the same result. Dropping it unwaited is allowed (the
/// completion is discarded when it arrives).
pub struct Request {
    pub(crate) client: Arc<Inner>,
    pub(crate) user_data: u64,
    /// Once done: the completion's `source` field (a receive from any source), or the error.
    pub(crate) outcome: Mutex<Option<std::result::Result<u64, Error>>>,
    /// An eager GPU op run as a direct op (docs/design-gpu.md, direct collectives rule 8): it completes from the
    /// event after its kernel and its status word, not from the daemon (`user_data` is 0).
    pub(crate) local: Option<gpu::direct::LocalDone>,
    /// A thread is waiting for the op in the client (with `outcome` unlocked): the others wait
    /// on `settled` for what it finds, up to their own limits.
    pub(crate) waiting: std::sync::atomic::AtomicBool,
    pub(crate) settled: std::sync::Condvar,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Request(op {})", self.user_data)
    }
}

impl Request {
    pub(crate) fn new(
        client: Arc<Inner>,
        user_data: u64,
        outcome: Option<std::result::Result<u64, Error>>,
        local: Option<gpu::direct::LocalDone>,
    ) -> Self {
        Self {
            client,
            user_data,
            outcome: Mutex::new(outcome),
            local,
            waiting: std::sync::atomic::AtomicBool::new(false),
            settled: std::sync::Condvar::new(),
        }
    }

    pub fn user_data(&self) -> u64 {
        self.user_data
    }

    /// Waits up to `limit` (forever if `None`). `Ok(true)`: done; `Ok(false)`: still running;
    /// `Err`: the op failed (the same error on every later call). Several threads may wait at
    /// once: one waits in the client, the others for what it finds, each within its own limit
    /// (a `test()` beside a `wait()` returns at once).
    pub fn wait_for(&self, limit: Option<Duration>) -> Result<bool> {
        use std::sync::atomic::Ordering::Relaxed;
        let deadline = limit.map(|l| Instant::now() + l);
        let left = || deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let mut o = lock(&self.outcome);
        while o.is_none() {
            if !self.waiting.load(Relaxed) {
                // This thread waits in the client, with the outcome unlocked (`waiting` is
                // only changed under that lock).
                self.waiting.store(true, Relaxed);
                drop(o);
                // Should the wait unwind, the others must not wait for this thread forever.
                struct Handover<'a>(&'a Request);
                impl Drop for Handover<'_> {
                    fn drop(&mut self) {
                        if std::thread::panicking() {
                            let _o = lock(&self.0.outcome);
                            self.0.waiting.store(false, Relaxed);
                            self.0.settled.notify_all();
                        }
                    }
                }
                let handover = Handover(self);
                let found = self.wait_once(left());
                drop(handover);
                o = lock(&self.outcome);
                self.waiting.store(false, Relaxed);
                if o.is_none() {
                    *o = found;
                }
                self.settled.notify_all();
                if o.is_none() {
                    return Ok(false);
                }
                break;
            }
            match left() {
                None => o = self.settled.wait(o).unwrap_or_else(|p| p.into_inner()),
                Some(d) if d.is_zero() => return Ok(false),
                Some(d) => {
                    o = self
                        .settled
                        .wait_timeout(o, d)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            }
        }
        match o.as_ref() {
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(e.duplicate()),
            None => Ok(false),
        }
    }

    /// One wait of up to `limit` for the op: its outcome, or `None` while it runs.
    fn wait_once(&self, limit: Option<Duration>) -> Option<std::result::Result<u64, Error>> {
        if let Some(l) = &self.local {
            return match l.poll(limit, Some(&self.client)) {
                Ok(None) => None,
                Ok(Some(r)) => Some(r),
                Err(e) => Some(Err(e)),
            };
        }
        match self.client.wait(self.user_data, limit) {
            Ok(None) => None,
            Ok(Some(c)) => Some(Ok(c.source)),
            Err(e) => Some(Err(e)),
        }
    }

    /// Blocks until the op completes.
    pub fn wait(&self) -> Result<()> {
        self.wait_for(None).map(|_| ())
    }

    /// Whether the op completed, without blocking (an `Err` if it failed).
    pub fn test(&self) -> Result<bool> {
        self.wait_for(Some(Duration::ZERO))
    }

    /// The rank a receive from any source ([`ANY_SOURCE`]) received from, once it completed;
    /// `None` before that, after a failure, and for every other op.
    pub fn source(&self) -> Option<u32> {
        match lock(&self.outcome).as_ref() {
            Some(Ok(s)) if *s > 0 => u32::try_from(*s - 1).ok(),
            _ => None,
        }
    }
}

impl Drop for Request {
    fn drop(&mut self) {
        // A direct op's status word is read by its pool when the word is needed again.
        if self.local.is_none() && lock(&self.outcome).is_none() {
            self.client.abandon(self.user_data);
        }
    }
}
