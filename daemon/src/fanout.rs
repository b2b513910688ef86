//! A small fan-out pool: runs `f(0)`, ..., `f(n - 1)` at once, `f(0)` on the calling thread
//! and the others on persistent helper threads, and returns when all are done. The GPU executor
//! uses it to issue each source GPU's copies from its own thread: one thread issuing the 12
//! copies of a 4-GPU phase spends 36-48 us in driver calls (3-4 us each, measured on 4x H200),
//! which is the whole latency budget of a small all-reduce.
//!
//! Helpers spin for [`SPIN`] after their last task (a stream of ops keeps them awake, so a
//! phase pays no thread wake-up) and then park until the next one.

#![allow(unsafe_code)] // borrowed closures run on pool threads and joined before return

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle helper spins before parking.
pub const SPIN: Duration = Duration::from_millis(1);
/// The first part of [`SPIN`] is a busy spin; the rest yields between looks.
const SPIN_HARD: Duration = Duration::from_micros(50);

type Task = &'static (dyn Fn(usize) + Sync);

struct Shared {
    /// Bumped once per `run`; a helper runs each epoch once.
    epoch: AtomicU64,
    /// The task of the current epoch and its width.
    task: Mutex<Option<(Task, usize)>>,
    /// Helpers that have not finished the current epoch.
    remaining: AtomicUsize,
    panicked: AtomicBool,
    stop: AtomicBool,
}

pub struct Fanout {
    shared: Arc<Shared>,
    threads: Vec<Thread>,
    joins: Vec<JoinHandle<()>>,
    /// One `run` at a time.
    running: Mutex<()>,
}

impl Fanout {
    /// A pool with `helpers` helper threads (it runs up to `helpers + 1` calls at once).
    pub fn new(helpers: usize, name: &str) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            epoch: AtomicU64::new(0),
            task: Mutex::new(None),
            remaining: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        });
        let mut joins = Vec::with_capacity(helpers);
        for w in 0..helpers {
            let sh = shared.clone();
            joins.push(
                std::thread::Builder::new()
                    .name(format!("{name}-{}", w + 1))
                    .spawn(move || helper(&sh, w + 1))?,
            );
        }
        let threads = joins.iter().map(|j| j.thread().clone()).collect();
        Ok(Self {
            shared,
            threads,
            joins,
            running: Mutex::new(()),
        })
    }

    /// Calls `f(i)` for every `i < n` (`n` at most the helpers + 1), concurrently; returns when
    /// all calls have returned. Err if a call panicked (the others still ran to their end).
    pub fn run(&self, n: usize, f: &(dyn Fn(usize) + Sync)) -> Result<(), String> {
        if n > self.threads.len() + 1 {
            return Err(format!(
                "fan-out of {n} calls on a pool of {} threads",
                self.threads.len() + 1
            ));
        }
        let _one = self.running.lock().unwrap_or_else(|e| e.into_inner());
        let sh = &self.shared;
        sh.panicked.store(false, Ordering::Relaxed);
        if n > 1 {
            // SAFETY: the 'static lifetime is a lie told only to the helpers, and it holds: this
            // function does not return (or unwind: the caller's own call is caught below) before
            // every helper has finished the epoch, and the task is cleared before returning.
            let task: Task = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), Task>(f) };
            *sh.task.lock().unwrap_or_else(|e| e.into_inner()) = Some((task, n));
            sh.remaining.store(self.threads.len(), Ordering::Release);
            sh.epoch.fetch_add(1, Ordering::AcqRel);
            for t in &self.threads {
                t.unpark();
            }
        }
        if catch_unwind(AssertUnwindSafe(|| f(0))).is_err() {
            sh.panicked.store(true, Ordering::Relaxed);
        }
        if n > 1 {
            let mut spins = 0u32;
            while sh.remaining.load(Ordering::Acquire) > 0 {
                spins += 1;
                if spins < 2000 {
                    std::hint::spin_loop();
                } else {
                    // A helper that is not running (few cores, or parked): let it run.
                    std::thread::yield_now();
                }
            }
            *sh.task.lock().unwrap_or_else(|e| e.into_inner()) = None;
        }
        if sh.panicked.load(Ordering::Relaxed) {
            return Err("a fanned-out call panicked".into());
        }
        Ok(())
    }
}

fn helper(sh: &Shared, index: usize) {
    // Epoch 0 is the pool's creation: every later one must be run, even one bumped before this
    // thread got to read the counter.
    let mut seen = 0;
    let mut idle_since = Instant::now();
    loop {
        if sh.stop.load(Ordering::Acquire) {
            return;
        }
        let e = sh.epoch.load(Ordering::Acquire);
        if e == seen {
            let idle = idle_since.elapsed();
            if idle < SPIN_HARD {
                std::hint::spin_loop();
            } else if idle < SPIN {
                // Let other threads run where cores are few (the caller may share ours).
                std::thread::yield_now();
            } else {
                std::thread::park_timeout(Duration::from_millis(100));
            }
            continue;
        }
        seen = e;
        let task = *sh.task.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((f, n)) = task
            && index < n
            && catch_unwind(AssertUnwindSafe(|| f(index))).is_err()
        {
            sh.panicked.store(true, Ordering::Relaxed);
        }
        sh.remaining.fetch_sub(1, Ordering::AcqRel);
        idle_since = Instant::now();
    }
}

impl Drop for Fanout {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        for t in &self.threads {
            t.unpark();
        }
        for j in self.joins.drain(..) {
            let _ = j.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_index_runs_once_per_call_and_borrowed_state_is_safe() {
        let pool = Fanout::new(3, "t-fan").unwrap();
        for round in 0..300u32 {
            let n = 1 + (round as usize % 4);
            let hits: Vec<AtomicU32> = (0..4).map(|_| AtomicU32::new(0)).collect();
            let local = [round; 4]; // borrowed by the task
            pool.run(n, &|i| {
                hits[i].fetch_add(local[i] - round + 1, Ordering::Relaxed);
            })
            .unwrap();
            for (i, h) in hits.iter().enumerate() {
                assert_eq!(
                    h.load(Ordering::Relaxed),
                    u32::from(i < n),
                    "round {round} i {i}"
                );
            }
            if round == 150 {
                // Let the helpers park, then wake them again.
                std::thread::sleep(SPIN * 3);
            }
        }
    }

    #[test]
    fn calls_run_concurrently() {
        let pool = Fanout::new(3, "t-fan2").unwrap();
        let inside = AtomicU32::new(0);
        let max = AtomicU32::new(0);
        pool.run(4, &|_| {
            let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
            max.fetch_max(now, Ordering::SeqCst);
            // Wait (bounded) for the others to arrive.
            let t = Instant::now();
            while inside.load(Ordering::SeqCst) < 4 && t.elapsed() < Duration::from_secs(5) {
                std::hint::spin_loop();
            }
        })
        .unwrap();
        assert_eq!(max.load(Ordering::SeqCst), 4);
    }

    #[test]
    fn a_panic_is_an_error_not_a_hang_and_too_wide_is_refused() {
        let pool = Fanout::new(2, "t-fan3").unwrap();
        let r = pool.run(3, &|i| {
            if i == 2 {
                panic!("boom");
            }
        });
        assert!(r.is_err());
        assert!(pool.run(3, &|_| {}).is_ok(), "usable after a panic");
        assert!(pool.run(4, &|_| {}).is_err());
    }
}
