//! Pacing: a per-communicator cap on the bandwidth of the daemon's GPU copies.
//!
//! Full-rate copy-engine traffic slows a concurrent GEMM in the user's job (to 0.84 of its speed
//! on an H100); a cap lets background collectives leave room for compute. One [`Pacer`] belongs to
//! one communicator on this node and is shared by the control plane (which sets the cap at
//! creation and through `SetCommPacing`) and the `commd-gpu` executor thread (which asks
//! [`Pacer::admit`] before issuing each phase's copies).
//!
//! The pacer is a token bucket over *bytes issued*, not bytes completed: it decides when a phase
//! may start, and never blocks, sleeps or reads the clock itself (callers pass `now`), so it is
//! cheap on the executor's path and deterministic under test. It owns no thread and touches no
//! GPU state. The host-memory data path is not paced.

use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub use commd_proto::MIN_PACING_BYTES_PER_SEC as MIN_RATE;

/// Token bucket depth floor: the bucket holds max(1 ms of the rate, this many bytes).
pub const MIN_BURST_BYTES: u64 = 4 << 20;

/// Tokens are counted in nano-bytes (bytes x 1e9): one nanosecond at `rate` bytes/s refills
/// exactly `rate` of them, so the refill is an integer product, without rounding drift.
const NANO: i128 = 1_000_000_000;

/// The longest wait `admit` reports (an `Instant` this far ahead always exists in practice).
const MAX_WAIT: Duration = Duration::from_secs(365 * 86_400);

/// A communicator's GPU copy pacing: a token bucket of `rate` bytes/s whose depth (burst) is
/// max(1 ms of the rate, 4 MiB). Thread-safe: every method takes `&self`.
///
/// A phase is admitted as soon as the bucket is not negative, and its bytes are then debited in
/// full: the bucket may go into debt by one phase, so a phase larger than the bucket still
/// starts (once the debt of the previous one is repaid) and the long-run average is the rate.
#[derive(Debug)]
pub struct Pacer {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    /// Bytes per second; `None`: uncapped.
    rate: Option<u64>,
    /// Nano-bytes available; negative while in debt. Valid as of `last`.
    tokens: i128,
    /// When `tokens` was last brought up to date; `None` until the first admission at the
    /// current cap (the bucket then starts full).
    last: Option<Instant>,
    /// The open wait: (first refused `admit`, the instant the last refusal named).
    wait: Option<(Instant, Instant)>,
    /// Closed waits, summed (see [`Pacer::delayed`]).
    delayed: Duration,
    waits: u64,
}

impl Pacer {
    /// A pacer capped at `rate` bytes/s (`None` or `Some(0)`: uncapped).
    pub fn new(rate: Option<u64>) -> Self {
        Self {
            state: Mutex::new(State {
                rate: rate.filter(|&r| r > 0),
                tokens: 0,
                last: None,
                wait: None,
                delayed: Duration::ZERO,
                waits: 0,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing here can panic while holding the lock; if something did, the state is still
        // a valid bucket, so keep using it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cap in bytes/s, `None` when uncapped.
    pub fn rate(&self) -> Option<u64> {
        self.lock().rate
    }

    /// Changes the cap (`None` or `Some(0)`: uncapped). It takes effect at the next admission:
    /// the time since the previous admission is credited at the new rate, and tokens above the
    /// new burst are dropped. A debt is kept and repaid at the new rate. Going from uncapped to
    /// capped starts with a full bucket.
    pub fn set_rate(&self, rate: Option<u64>) {
        let mut s = self.lock();
        let rate = rate.filter(|&r| r > 0);
        if rate.is_none() {
            s.last = None;
        }
        s.rate = rate;
    }

    /// The bucket depth in bytes at `rate`: max(1 ms of the rate, 4 MiB).
    pub fn burst_bytes(rate: u64) -> u64 {
        (rate / 1000).max(MIN_BURST_BYTES)
    }

    /// May a phase of `bytes` start at `now`? `Ok(())`: yes, and its bytes are debited. `Err(t)`:
    /// not before `t` (ask again then; nothing was debited). Uncapped: always `Ok`.
    ///
    /// `now` is the caller's clock; an `Instant` earlier than one seen before (another thread's
    /// older reading) refills nothing.
    pub fn admit(&self, bytes: u64, now: Instant) -> Result<(), Instant> {
        let mut s = self.lock();
        let Some(rate) = s.rate else {
            s.close_wait(now);
            return Ok(());
        };
        let burst = i128::from(Self::burst_bytes(rate)) * NANO;
        s.tokens = match s.last {
            None => burst,
            Some(last) => {
                let dt = now.saturating_duration_since(last).as_nanos();
                let refill =
                    i128::from(rate).saturating_mul(i128::try_from(dt).unwrap_or(i128::MAX));
                s.tokens.saturating_add(refill).min(burst)
            }
        };
        // Tokens are now valid as of the latest instant any caller has shown us.
        let last = s.last.map_or(now, |l| l.max(now));
        s.last = Some(last);
        if s.tokens >= 0 {
            s.tokens -= i128::from(bytes) * NANO;
            s.close_wait(now);
            return Ok(());
        }
        // ceil(debt / rate) ns until the bucket is back at zero.
        let ns = (-s.tokens + i128::from(rate) - 1) / i128::from(rate);
        let wait = u64::try_from(ns)
            .map(Duration::from_nanos)
            .unwrap_or(MAX_WAIT)
            .min(MAX_WAIT);
        // Cannot overflow in practice (an Instant is an i64 of seconds since boot); if it ever
        // did, the caller would just ask again sooner.
        let until = last.checked_add(wait).unwrap_or(last);
        let since = s.wait.map_or(now, |(since, _)| since);
        s.wait = Some((since, until));
        Err(until)
    }

    /// Total time phases were held back by this pacer. Counted per held-back phase, when it is
    /// finally admitted: from its first refused [`Pacer::admit`] to the instant the last refusal
    /// named (or to its admission, if that came earlier, e.g. after the cap was raised). So it
    /// is the delay pacing imposed, not how late the caller came back; a wait still open is not
    /// included yet. One wait is tracked at a time, which matches how the executor runs a
    /// communicator's phases (one after the other).
    pub fn delayed(&self) -> Duration {
        self.lock().delayed
    }

    /// Phases held back at least once (closed waits, as for [`Pacer::delayed`]).
    pub fn waits(&self) -> u64 {
        self.lock().waits
    }
}

impl State {
    fn close_wait(&mut self, now: Instant) {
        if let Some((since, until)) = self.wait.take() {
            self.delayed += now.min(until).saturating_duration_since(since);
            self.waits += 1;
        }
    }
}

/// "12.5 GB/s (12500000000 bytes/s)" or "uncapped": how messages and `commd status` name a cap.
pub fn describe(rate: Option<u64>) -> String {
    match rate {
        None => "uncapped".into(),
        Some(r) => format!("{} GB/s ({r} bytes/s)", gbps_text(r)),
    }
}

/// A rate in GB/s (1e9 bytes/s), without trailing zeros: "12.5", "0.001", "100".
pub fn gbps_text(rate: u64) -> String {
    let s = format!("{:.9}", rate as f64 / 1e9);
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// A requested cap in bytes/s (0: uncapped) as a rate, refusing values below [`MIN_RATE`]:
/// those are almost certainly a unit mistake (GB/s passed as bytes/s) and would stall every GPU
/// op of the communicator until it times out.
pub fn check_rate(bytes_per_sec: u64) -> Result<Option<u64>, String> {
    match bytes_per_sec {
        0 => Ok(None),
        r if r < MIN_RATE => Err(format!(
            "pacing of {r} bytes/s is below the minimum of {MIN_RATE} bytes/s (1 MB/s); the cap is in bytes per second (e.g. 5000000000 for 5 GB/s), and 0 means uncapped"
        )),
        r => Ok(Some(r)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    const MIB: u64 = 1 << 20;
    const GB: u64 = 1_000_000_000;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    /// Drives `p` like the executor would with copies that take no time: each phase is asked for
    /// until admitted, jumping the clock to the instant a refusal names. Returns the clock after
    /// the last admission.
    fn run(p: &Pacer, mut now: Instant, sizes: impl IntoIterator<Item = u64>) -> Instant {
        for b in sizes {
            let mut tries = 0;
            loop {
                match p.admit(b, now) {
                    Ok(()) => break,
                    Err(t) => {
                        assert!(t > now, "a refusal must name a later instant");
                        now = t;
                    }
                }
                tries += 1;
                assert!(
                    tries < 3,
                    "a phase was refused at the instant it was told to come back"
                );
            }
        }
        now
    }

    /// Bytes/s achieved by `sizes` after the initial burst: the clock starts when the bucket
    /// is drained, so the burst does not flatter the average.
    fn achieved(rate: u64, sizes: &[u64]) -> f64 {
        let p = Pacer::new(Some(rate));
        let t0 = Instant::now();
        // Drain the initial (full) bucket with one phase of exactly the burst.
        p.admit(Pacer::burst_bytes(rate), t0).unwrap();
        let end = run(&p, t0, sizes.iter().copied());
        // The last phase was admitted on credit: its bytes are paid for after `end`.
        let paid: u64 = sizes[..sizes.len() - 1].iter().sum();
        paid as f64 / end.duration_since(t0).as_secs_f64()
    }

    fn assert_close(got: f64, want: f64, tol: f64, what: &str) {
        let err = (got - want).abs() / want;
        assert!(
            err <= tol,
            "{what}: {got:.4e} bytes/s vs cap {want:.4e} ({:.2}% off)",
            err * 100.0
        );
    }

    #[test]
    fn uncapped_admits_everything_at_once() {
        for p in [Pacer::new(None), Pacer::new(Some(0))] {
            assert_eq!(p.rate(), None);
            let t = Instant::now();
            for _ in 0..1000 {
                assert_eq!(p.admit(1 << 30, t), Ok(()));
            }
            assert_eq!(p.delayed(), Duration::ZERO);
            assert_eq!(p.waits(), 0);
        }
    }

    #[test]
    fn average_rate_matches_the_cap_for_every_phase_size() {
        for rate in [GB / 1000, 2 * GB, 25 * GB, 400 * GB] {
            for phase in [4096, 256 * 1024, 16 * MIB, 200 * MIB] {
                // About 10 bursts' worth of data, at least 200 phases.
                let n = usize::try_from((10 * Pacer::burst_bytes(rate) / phase).max(200)).unwrap();
                let got = achieved(rate, &vec![phase; n]);
                assert_close(got, rate as f64, 0.03, &format!("{phase}-byte phases"));
            }
        }
    }

    #[test]
    fn average_rate_matches_the_cap_for_random_phase_sizes() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let sizes: Vec<u64> = (0..5000).map(|_| rng.random_range(1..64 * MIB)).collect();
        assert_close(achieved(10 * GB, &sizes), 10e9, 0.03, "random phases");
    }

    #[test]
    fn paced_traffic_never_beats_the_cap_over_any_window() {
        // Over any interval the bytes admitted are at most burst + one phase + rate x interval.
        let rate = 5 * GB;
        let p = Pacer::new(Some(rate));
        let mut now = Instant::now();
        let t0 = now;
        let mut admitted: Vec<(Instant, u64)> = Vec::new();
        let phase = 3 * MIB;
        for _ in 0..3000 {
            match p.admit(phase, now) {
                Ok(()) => admitted.push((now, phase)),
                Err(t) => now = t,
            }
        }
        assert!(admitted.len() > 100);
        let bound = |dt: Duration| {
            (Pacer::burst_bytes(rate) + phase) as f64 + rate as f64 * dt.as_secs_f64()
        };
        for (i, &(ti, _)) in admitted.iter().enumerate().step_by(37) {
            let mut sum = 0;
            for &(tj, b) in &admitted[i..] {
                sum += b;
                assert!(
                    sum as f64 <= bound(tj - ti) + 1.0,
                    "window from {:?}",
                    ti - t0
                );
            }
        }
    }

    #[test]
    fn full_bucket_gives_a_burst_of_max_1ms_and_4mib_then_one_phase_of_debt() {
        // 1 GB/s: 1 ms is 1 MB < 4 MiB, so the burst is 4 MiB: phases of 1 MiB at one instant
        // see 4, 3, 2, 1, 0 MiB left (all admitted), then -1 MiB (refused).
        let cases = [(GB, 4 * MIB, 5), (100 * GB, 100_000_000, 96)];
        for (rate, burst, admitted) in cases {
            assert_eq!(Pacer::burst_bytes(rate), burst);
            let p = Pacer::new(Some(rate));
            let t = Instant::now();
            let n = (0..1000).take_while(|_| p.admit(MIB, t).is_ok()).count();
            assert_eq!(n, admitted, "rate {rate}");
        }
    }

    #[test]
    fn a_phase_larger_than_the_bucket_is_admitted_and_repaid() {
        let p = Pacer::new(Some(GB));
        let t0 = Instant::now();
        // The bucket (4 MiB) is full: a 64 MiB phase starts at once, leaving 60 MiB of debt.
        assert_eq!(p.admit(64 * MIB, t0), Ok(()));
        let debt = Duration::from_nanos((60 * MIB * GB).div_ceil(GB));
        let want = t0 + debt;
        assert_eq!(p.admit(1, t0), Err(want));
        // Asking again early names the same instant; one nanosecond early is still refused.
        assert_eq!(p.admit(1, t0 + ms(10)), Err(want));
        assert_eq!(p.admit(64 * MIB, want - Duration::from_nanos(1)), Err(want));
        // At zero the next big phase is admitted again (debt by one phase, never two).
        assert_eq!(p.admit(64 * MIB, want), Ok(()));
        assert_eq!(p.admit(1, want), Err(want + Duration::from_nanos(64 * MIB)));
    }

    #[test]
    fn idle_time_refills_only_up_to_the_burst() {
        let p = Pacer::new(Some(GB));
        let t0 = Instant::now();
        assert_eq!(p.admit(4 * MIB, t0), Ok(()));
        // An hour idle is worth 4 MiB, not 3.6 TB: 4 MiB + one phase of debt, then a wait.
        let t1 = t0 + Duration::from_secs(3600);
        let n = (0..100).take_while(|_| p.admit(MIB, t1).is_ok()).count();
        assert_eq!(n, 5);
    }

    #[test]
    fn instants_from_the_past_refill_nothing_and_do_not_panic() {
        let p = Pacer::new(Some(GB));
        let t0 = Instant::now() + Duration::from_secs(10);
        assert_eq!(p.admit(8 * MIB, t0), Ok(()));
        let err = p.admit(1, t0 - ms(5)).unwrap_err();
        // The debt (4 MiB) is measured from t0, the latest instant seen.
        assert_eq!(err, t0 + Duration::from_nanos(4 * MIB));
    }

    #[test]
    fn rate_changes_take_effect_at_the_next_admission() {
        let p = Pacer::new(Some(GB));
        let t0 = Instant::now();
        assert_eq!(p.admit(4 * MIB + 100 * MIB, t0), Ok(()));
        // 100 MiB of debt: 104.9 ms at 1 GB/s, half that at 2 GB/s.
        assert_eq!(p.admit(1, t0), Err(t0 + Duration::from_nanos(100 * MIB)));
        p.set_rate(Some(2 * GB));
        assert_eq!(p.rate(), Some(2 * GB));
        assert_eq!(
            p.admit(1, t0),
            Err(t0 + Duration::from_nanos((100 * MIB).div_ceil(2)))
        );
        // Uncapped: admitted at once, whatever the debt.
        p.set_rate(None);
        assert_eq!(p.admit(1 << 40, t0), Ok(()));
        assert_eq!(p.rate(), None);
        // Capped again: a fresh, full bucket (the uncapped traffic left no debt).
        p.set_rate(Some(GB));
        let n = (0..100).take_while(|_| p.admit(MIB, t0).is_ok()).count();
        assert_eq!(n, 5);
        // Lowering the cap drops tokens above the new (smaller) burst: 95 MiB were left at
        // 100 GB/s, 4 MiB remain at 1 GB/s.
        let p = Pacer::new(Some(100 * GB));
        p.admit(MIB, t0).unwrap();
        p.set_rate(Some(GB));
        let n = (0..1000).take_while(|_| p.admit(MIB, t0).is_ok()).count();
        assert_eq!(n, 5);
    }

    #[test]
    fn average_follows_a_cap_changed_at_run_time() {
        let p = Pacer::new(Some(GB));
        let t0 = Instant::now();
        p.admit(Pacer::burst_bytes(GB), t0).unwrap();
        let phase = 2 * MIB;
        let t1 = run(&p, t0, std::iter::repeat_n(phase, 1000));
        let first = 999.0 * phase as f64 / (t1 - t0).as_secs_f64();
        assert_close(first, 1e9, 0.03, "before the change");
        p.set_rate(Some(8 * GB));
        // The debt of the last 1 GB/s phase is repaid at 8 GB/s; measure from then.
        let t2 = run(&p, t1, [phase]);
        let t3 = run(&p, t2, std::iter::repeat_n(phase, 4000));
        let second = 4000.0 * phase as f64 / (t3 - t2).as_secs_f64();
        assert_close(second, 8e9, 0.03, "after the change");
    }

    #[test]
    fn delayed_counts_the_wait_pacing_imposed_not_the_callers_lateness() {
        let p = Pacer::new(Some(GB));
        let t0 = Instant::now();
        p.admit(4 * MIB + 10 * MIB, t0).unwrap();
        let until = p.admit(MIB, t0).unwrap_err();
        // A second refusal of the same phase does not restart the wait.
        assert_eq!(p.admit(MIB, t0 + ms(3)), Err(until));
        // The caller comes back 50 ms late: only the 10.5 ms pacing demanded count.
        p.admit(MIB, until + ms(50)).unwrap();
        assert_eq!(p.delayed(), until - t0);
        assert_eq!(p.waits(), 1);
        // A phase admitted at once adds nothing.
        let t1 = until + Duration::from_secs(1);
        p.admit(MIB, t1).unwrap();
        assert_eq!(p.delayed(), until - t0);
        // A wait cut short by lifting the cap counts up to the admission.
        p.admit(100 * MIB, t1).unwrap();
        p.admit(MIB, t1).unwrap_err();
        p.set_rate(None);
        p.admit(MIB, t1 + ms(2)).unwrap();
        assert_eq!(p.delayed(), until - t0 + ms(2));
        assert_eq!(p.waits(), 2);
    }

    #[test]
    fn shared_across_threads() {
        fn assert_sync<T: Send + Sync>() {}
        assert_sync::<Pacer>();
        let p = std::sync::Arc::new(Pacer::new(Some(GB)));
        let t0 = Instant::now();
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let p = p.clone();
                std::thread::spawn(move || (0..100).filter(|_| p.admit(MIB, t0).is_ok()).count())
            })
            .collect();
        let total: usize = hs.into_iter().map(|h| h.join().unwrap()).sum();
        // All at one instant: exactly the burst plus one phase of debt, whatever the interleaving.
        assert_eq!(total, 5);
    }

    #[test]
    fn describing_and_checking_rates() {
        assert_eq!(describe(None), "uncapped");
        assert_eq!(
            describe(Some(12_500_000_000)),
            "12.5 GB/s (12500000000 bytes/s)"
        );
        assert_eq!(gbps_text(100 * GB), "100");
        assert_eq!(gbps_text(1_000_000), "0.001");
        assert_eq!(check_rate(0), Ok(None));
        assert_eq!(check_rate(MIN_RATE), Ok(Some(MIN_RATE)));
        let e = check_rate(5).unwrap_err();
        assert!(e.contains("5 bytes/s") && e.contains("minimum"), "{e}");
    }
}
