//! The replay protocol of persistent GPU ops (docs/contracts.md #6), on one rank's graph
//! doorbell words (`desc::graph_doorbell`). Both sides use these functions, so the values a
//! captured stream writes and waits for and the ones the daemon publishes are defined once.
//!
//! Values are constant per replay, so a graph can replay them: for phase `p` of an op of
//! `phases` phases the stream writes `ready = 1 + p` and then waits for `done >= 1 + p`
//! (wrap-aware, as `cuStreamWaitValue32(GEQ)` compares). After the last phase the daemon writes
//! `ready = 0` *before* `done = phases`; the stream, once past its last wait, writes `done = 0`.
//! So between replays both words are 0, and:
//! - the daemon never mistakes the previous replay's `ready` for a new one (it cleared it before
//!   the stream could go on);
//! - the stream's `done = 0` is ordered before its next `ready = 1` (same stream), and the daemon
//!   publishes the next replay's `done` only after seeing that `ready`.
//!
//! A failed replay ([`Words::fail`]) sets the sticky error word, clears `ready` and raises
//! `done` to `phases`, which releases every wait of the replay (docs/contracts.md #5). A stream
//! that goes on writing later phases' `ready` after such a release is released again by the
//! daemon (an op that failed stays failed: every later replay fails the same way, never runs
//! with stale state); `done` only ever goes down by the stream's own reset at the end of a
//! replay, after which its next `ready` is seen, so no interleaving leaves a stream waiting.

use std::sync::atomic::{AtomicU32, Ordering};

/// One rank's words of one persistent op.
#[derive(Clone, Copy)]
pub struct Words<'a> {
    pub ready: &'a AtomicU32,
    pub done: &'a AtomicU32,
    pub error: &'a AtomicU32,
}

/// The `ready` value the stream writes, and the `done` value it waits for, at phase `p`.
pub fn phase_value(p: u32) -> u32 {
    p.wrapping_add(1)
}

/// The value the stream writes into `done` after its last wait of a replay.
pub const DONE_RESET: u32 = 0;

/// The `done` value a watchdog writes for a session whose daemon is gone: past every phase, and
/// far enough that a stream's reset in flight is overwritten on the next pass.
pub const RELEASED: u32 = 1 << 30;

impl Words<'_> {
    /// Daemon: whether this rank's stream reached phase `p` of the current replay.
    pub fn reached(&self, p: u32) -> bool {
        self.ready
            .load(Ordering::Acquire)
            .wrapping_sub(phase_value(p))
            // Wrap-aware >=: the difference read as signed, as GEQ stream waits compare.
            .cast_signed()
            >= 0
    }

    /// Daemon: whether this rank's stream started a replay of the op.
    pub fn fired(&self) -> bool {
        self.reached(0)
    }

    /// Daemon: phase `p` of the replay is done on this rank; `last` re-arms the op for the next
    /// replay (ready cleared before done is published).
    pub fn phase_done(&self, p: u32, last: bool) {
        if last {
            self.ready.store(0, Ordering::Release);
        }
        self.done.store(phase_value(p), Ordering::Release);
    }

    /// Daemon: the replay failed with status `st` (nonzero): sets the error word (first error
    /// wins), clears ready and releases every phase.
    pub fn fail(&self, phases: u32, st: u32) {
        let _ = self
            .error
            .compare_exchange(0, st.max(1), Ordering::AcqRel, Ordering::Acquire);
        self.ready.store(0, Ordering::Release);
        self.done.store(phases.max(1), Ordering::Release);
    }

    /// Stream side, for tests and the client's watchdog: whether a wait for phase `p` passes.
    pub fn passes(&self, p: u32) -> bool {
        self.done
            .load(Ordering::Acquire)
            .wrapping_sub(phase_value(p))
            // Wrap-aware >=: the difference read as signed, as GEQ stream waits compare.
            .cast_signed()
            >= 0
    }
}

#[cfg(test)]
mod tests {
    //! The protocol against simulated streams: threads that run what a captured graph runs
    //! (write ready, wait done, ..., reset done) for many replays, and a daemon thread that runs
    //! the replay loop of the executor on the same words. Each phase's "copy" is a write of the
    //! replay number into every rank's mailbox; each stream checks, after its wait for a phase,
    //! that the mailbox holds its current replay number, so a replay that passed a wait without
    //! its phase having run (a stale `done`), or a phase run twice or early, fails the test.
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicU64;
    use std::time::{Duration, Instant};

    struct Rank {
        ready: AtomicU32,
        done: AtomicU32,
        error: AtomicU32,
        /// (replay << 8) | phase last published by the daemon for this rank.
        mailbox: AtomicU64,
    }

    impl Rank {
        fn new() -> Self {
            Self {
                ready: AtomicU32::new(0),
                done: AtomicU32::new(0),
                error: AtomicU32::new(0),
                mailbox: AtomicU64::new(0),
            }
        }
        fn words(&self) -> Words<'_> {
            Words {
                ready: &self.ready,
                done: &self.done,
                error: &self.error,
            }
        }
    }

    fn spin_until(what: &str, f: impl Fn() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "hung waiting for {what}"
            );
            std::thread::yield_now();
        }
    }

    /// Runs `replays` replays of an op of `phases` phases on `n` ranks; the daemon fails replay
    /// `fail_at` (if any) at phase `fail_phase`. Returns each rank's count of replays that saw
    /// the error word.
    fn run(
        n: usize,
        phases: u32,
        replays: u64,
        fail_at: Option<(u64, u32)>,
        seed: u64,
    ) -> Vec<u64> {
        let ranks: Arc<Vec<Rank>> = Arc::new((0..n).map(|_| Rank::new()).collect());
        let finished = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let daemon = {
            let ranks = ranks.clone();
            let finished = finished.clone();
            std::thread::spawn(move || {
                let mut failed = false;
                for k in 1..=replays {
                    for p in 0..phases {
                        spin_until("every rank's ready", || {
                            ranks.iter().all(|r| {
                                // A failed op releases every later firing at once.
                                if failed && r.words().fired() {
                                    r.words().fail(phases, 7);
                                }
                                failed || r.words().reached(p)
                            })
                        });
                        if failed {
                            break;
                        }
                        if fail_at == Some((k, p)) {
                            for r in ranks.iter() {
                                r.words().fail(phases, 7);
                            }
                            failed = true;
                            break;
                        }
                        for r in ranks.iter() {
                            r.mailbox.store((k << 8) | u64::from(p), Ordering::Release);
                            r.words().phase_done(p, p + 1 == phases);
                        }
                    }
                }
                if failed {
                    // Keep releasing until the streams finish.
                    let t = Instant::now();
                    while finished.load(Ordering::Acquire) < n {
                        assert!(
                            t.elapsed() < Duration::from_secs(20),
                            "streams hung after a failure"
                        );
                        for r in ranks.iter() {
                            if r.words().fired() {
                                r.words().fail(phases, 7);
                            }
                        }
                        std::thread::yield_now();
                    }
                }
            })
        };
        let streams: Vec<_> = (0..n)
            .map(|i| {
                let ranks = ranks.clone();
                let finished = finished.clone();
                std::thread::spawn(move || {
                    let r = &ranks[i];
                    let mut x = seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    let mut errors = 0;
                    for k in 1..=replays {
                        for p in 0..phases {
                            r.ready.store(phase_value(p), Ordering::Release);
                            spin_until("done", || r.words().passes(p));
                            if r.error.load(Ordering::Acquire) != 0 {
                                continue; // released by a failure: data not checked
                            }
                            let m = r.mailbox.load(Ordering::Acquire);
                            assert_eq!(
                                m,
                                (k << 8) | u64::from(p),
                                "rank {i} replay {k} phase {p} passed its wait on stale data"
                            );
                            // Some jitter between phases (the kernel of the round).
                            x ^= x << 13;
                            x ^= x >> 7;
                            x ^= x << 17;
                            for _ in 0..(x % 64) {
                                std::hint::spin_loop();
                            }
                        }
                        r.done.store(DONE_RESET, Ordering::Release);
                        if r.error.load(Ordering::Acquire) != 0 {
                            errors += 1;
                        }
                    }
                    finished.fetch_add(1, Ordering::AcqRel);
                    errors
                })
            })
            .collect();
        let errs = streams.into_iter().map(|h| h.join().unwrap()).collect();
        daemon.join().unwrap();
        errs
    }

    #[test]
    fn every_replay_runs_every_phase_once_in_order() {
        for (n, phases, seed) in [(2, 1, 1), (3, 3, 2), (4, 5, 3), (8, 2, 4)] {
            let errs = run(n, phases, 300, None, seed);
            assert!(errs.iter().all(|&e| e == 0), "{errs:?}");
        }
    }

    #[test]
    fn a_failed_replay_releases_every_rank_and_stays_failed() {
        for (phases, at) in [(1, (5, 0)), (4, (9, 2)), (3, (1, 0))] {
            let replays = 20;
            let errs = run(3, phases, replays, Some(at), 9);
            // Every replay from the failed one on sees the error on every rank: none hangs.
            for e in errs {
                assert_eq!(e, replays - at.0 + 1);
            }
        }
    }

    #[test]
    fn values_are_wrap_aware() {
        let (r, d, e) = (AtomicU32::new(0), AtomicU32::new(0), AtomicU32::new(0));
        let w = Words {
            ready: &r,
            done: &d,
            error: &e,
        };
        assert!(!w.fired());
        r.store(1, Ordering::Relaxed);
        assert!(w.fired() && !w.reached(1));
        assert!(!w.passes(0));
        d.store(RELEASED, Ordering::Relaxed);
        assert!(w.passes(0) && w.passes(1000));
        w.fail(4, 0);
        assert_eq!(e.load(Ordering::Relaxed), 1, "status 0 still sets an error");
        assert_eq!(d.load(Ordering::Relaxed), 4);
        assert_eq!(r.load(Ordering::Relaxed), 0);
    }
}
