//! Posting to the submission ring and waiting on the completion ring.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::{Error, Inner, Result, lock};
use commd_proto::desc::{CompletionDesc, SubmitDesc, status};
use commd_proto::ring::Ring;

pub(crate) struct CqState {
    pub(crate) head: u32,
    pub(crate) done: HashMap<u64, CompletionDesc>,
    /// Ops whose [`Request`] was dropped unwaited: their completions are discarded on arrival.
    pub(crate) abandoned: HashSet<u64>,
}

impl Inner {
    /// Moves every available completion into the `done` map.
    pub(crate) fn reap(&self, cq: &mut CqState) {
        let tail = self.ring.cq_tail().load(Ordering::Acquire);
        let avail = tail.wrapping_sub(cq.head);
        if avail == 0 || avail > self.ring.layout().cq_entries {
            return;
        }
        for _ in 0..avail {
            let c = self.ring.read_cq(cq.head);
            cq.head = cq.head.wrapping_add(1);
            if !cq.abandoned.remove(&c.user_data) {
                cq.done.insert(c.user_data, c);
            }
        }
        self.ring.cq_head().store(cq.head, Ordering::Release);
        self.inflight.fetch_sub(avail, Ordering::AcqRel);
    }

    /// Waits (a short nap at most) for completions to come off the completion ring, for
    /// `post` when `limit` ops are in flight. An error once the daemon is gone or stalled.
    pub(crate) fn wait_cq_room(&self) -> Result<()> {
        {
            let mut cq = lock(&self.cq);
            self.reap(&mut cq);
        }
        if self.inflight.load(Ordering::Acquire) < self.limit {
            return Ok(());
        }
        self.nap_on_cq(Duration::from_millis(10));
        if self.ring.cq_tail().load(Ordering::Acquire) == lock(&self.cq).head {
            self.check_daemon("while this process waited for room to post an op")?;
        }
        Ok(())
    }

    /// Sleeps on the CQ doorbell for up to `nap` unless a completion is already there,
    /// announcing the sleeper so the daemon's next completion wakes it.
    pub(crate) fn nap_on_cq(&self, nap: Duration) {
        let r = &self.ring;
        r.cq_sleepers().fetch_add(1, Ordering::SeqCst);
        let bell = r.cq_bell().load(Ordering::SeqCst);
        if r.cq_tail().load(Ordering::SeqCst) == lock(&self.cq).head {
            commd_proto::futex::wait(r.cq_bell(), bell, nap);
        }
        r.cq_sleepers().fetch_sub(1, Ordering::SeqCst);
    }

    pub(crate) fn post(&self, mut d: SubmitDesc) -> Result<u64> {
        self.check_owner()?;
        if self.ring.session_error().load(Ordering::Acquire) != 0 {
            return Err(self.session_closed_error());
        }
        // Never more ops in flight than the completion ring holds.
        while self.inflight.load(Ordering::Acquire) >= self.limit {
            self.wait_cq_room()?;
        }
        self.inflight.fetch_add(1, Ordering::AcqRel);
        d.user_data = self.next_user_data.fetch_add(1, Ordering::Relaxed);
        let mut tail = lock(&self.sq_tail);
        let entries = self.ring.layout().sq_entries;
        let mut spins = 0u32;
        while tail.wrapping_sub(self.ring.sq_head().load(Ordering::Acquire)) >= entries {
            std::thread::yield_now();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096)
                && let Some(e) = self.daemon_stalled()
            {
                self.inflight.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        }
        self.ring.write_sq(*tail, &d);
        *tail = tail.wrapping_add(1);
        self.ring.sq_tail().store(*tail, Ordering::Release);
        Ring::ring_bell(self.ring.sq_bell(), self.ring.sq_sleeping());
        Ok(d.user_data)
    }

    pub(crate) fn session_closed_error(&self) -> Error {
        match self.ring.session_error().load(Ordering::Acquire) {
            status::SHUTDOWN => self.lost("the daemon is shutting down"),
            _ => self.lost("the daemon closed this session"),
        }
    }

    /// Forgets op `user_data`: its completion (now or later) is discarded.
    pub(crate) fn abandon(&self, user_data: u64) {
        let mut cq = lock(&self.cq);
        self.reap(&mut cq);
        if cq.done.remove(&user_data).is_none() {
            cq.abandoned.insert(user_data);
        }
    }

    /// Waits for `user_data`, up to `limit`. Returns the completion, or `None` when `limit`
    /// passed first.
    pub(crate) fn wait(
        &self,
        user_data: u64,
        limit: Option<Duration>,
    ) -> Result<Option<CompletionDesc>> {
        let t0 = Instant::now();
        loop {
            {
                let mut cq = lock(&self.cq);
                self.reap(&mut cq);
                if let Some(c) = cq.done.remove(&user_data) {
                    drop(cq);
                    return self.finish(c).map(Some);
                }
                if limit.is_some_and(|l| t0.elapsed() >= l) {
                    return Ok(None);
                }
            }
            if t0.elapsed() < self.spin {
                // Yield rather than burn: other ranks on this node may need this core.
                std::thread::yield_now();
                continue;
            }
            let mut nap = Duration::from_millis(100);
            if let Some(l) = limit {
                nap = nap.min(
                    l.saturating_sub(t0.elapsed())
                        .max(Duration::from_micros(50)),
                );
            }
            self.nap_on_cq(nap);
            let r = &self.ring;
            let idle = {
                let cq = lock(&self.cq);
                r.cq_tail().load(Ordering::Acquire) == cq.head && !cq.done.contains_key(&user_data)
            };
            if idle {
                self.check_daemon("with this op in flight")?;
            }
        }
    }
}
