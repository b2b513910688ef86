//! Repeated WARN lines of one kind, rate-limited: a client (or anything on the network) that
//! sends garbage in a loop must not grow the log without bound or drown the lines that matter.
//!
//! Each call site of [`warn_limited!`](crate::telemetry::ratelimit::warn_limited) has its own
//! [`Limiter`]: at most [`BURST`] lines per [`PERIOD`]; the rest are counted, and the count is said
//! on the next line that site prints, or by [`flush`] (the housekeeping tick) once the period
//! is over: one summary line, never one per suppressed event.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lines one site prints per period.
pub const BURST: u32 = 5;
/// The period.
pub const PERIOD: Duration = Duration::from_secs(10);

#[derive(Default)]
struct State {
    window: Option<Instant>,
    printed: u32,
    suppressed: u64,
    registered: bool,
}

/// One call site's budget.
pub struct Limiter {
    /// Where the limited line comes from (`file:line`), for the summary.
    site: &'static str,
    state: Mutex<State>,
}

static SITES: Mutex<Vec<&'static Limiter>> = Mutex::new(Vec::new());

impl Limiter {
    pub const fn new(site: &'static str) -> Self {
        Self {
            site,
            state: Mutex::new(State {
                window: None,
                printed: 0,
                suppressed: 0,
                registered: false,
            }),
        }
    }

    /// `Some(note)` when this line may be printed, `note` naming the lines suppressed before it
    /// (empty when none were); `None` when it is suppressed (and counted).
    pub fn allow(&'static self) -> Option<String> {
        self.allow_at(Instant::now())
    }

    fn allow_at(&'static self, now: Instant) -> Option<String> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let fresh = s.window.is_none_or(|w| now.duration_since(w) >= PERIOD);
        if fresh {
            let note = suppressed_note(s.suppressed);
            s.window = Some(now);
            s.printed = 1;
            s.suppressed = 0;
            return Some(note);
        }
        if s.printed < BURST {
            s.printed += 1;
            return Some(String::new());
        }
        s.suppressed += 1;
        if !s.registered {
            s.registered = true;
            SITES.lock().unwrap_or_else(|e| e.into_inner()).push(self);
        }
        None
    }

    /// The summary owed once the period is over: (suppressed lines, site).
    fn take_due(&self, now: Instant) -> Option<(u64, &'static str)> {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let due = s.suppressed > 0 && s.window.is_some_and(|w| now.duration_since(w) >= PERIOD);
        if !due {
            return None;
        }
        let n = s.suppressed;
        s.suppressed = 0;
        s.window = None;
        Some((n, self.site))
    }
}

fn suppressed_note(n: u64) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(
            " ({n} similar line(s) suppressed in the previous {} s)",
            PERIOD.as_secs()
        )
    }
}

/// Says the counts of lines suppressed in periods that have ended (called by the housekeeping
/// tick); returns how many summary lines it wrote.
pub fn flush() -> usize {
    let now = Instant::now();
    let sites: Vec<&'static Limiter> = SITES.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut n = 0;
    for l in sites {
        if let Some((count, site)) = l.take_due(now) {
            tracing::warn!(target: "commd::log", "{count} more WARN line(s) like the last one from {site} were suppressed in {} s", PERIOD.as_secs());
            n += 1;
        }
    }
    n
}

/// `tracing::warn!` with a per-call-site budget (the module doc): `warn_limited!(target:
/// "commd::net", "format {}", args)`.
macro_rules! warn_limited {
    (target: $t:literal, $($arg:tt)+) => {{
        static LIMIT: $crate::telemetry::ratelimit::Limiter =
            $crate::telemetry::ratelimit::Limiter::new(concat!(file!(), ":", line!()));
        if let Some(note) = LIMIT.allow() {
            tracing::warn!(target: $t, "{}{}", format_args!($($arg)+), note);
        }
    }};
}
pub(crate) use warn_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_counted_then_said_once() {
        static L: Limiter = Limiter::new("here:1");
        let t0 = Instant::now();
        let printed = (0..100).filter(|_| L.allow_at(t0).is_some()).count();
        assert_eq!(printed, BURST as usize);
        // Not due inside the period.
        assert!(L.take_due(t0 + PERIOD / 2).is_none());
        // The next period's first line names the 95 suppressed.
        let note = L.allow_at(t0 + PERIOD).expect("a new period prints");
        assert!(note.contains("95 similar line(s) suppressed"), "{note}");
        // Suppressed again, then summarized by the flush once the period ended, once.
        for _ in 0..10 {
            L.allow_at(t0 + PERIOD);
        }
        assert_eq!(L.take_due(t0 + PERIOD * 2), Some((6, "here:1")));
        assert!(L.take_due(t0 + PERIOD * 3).is_none());
    }
}
