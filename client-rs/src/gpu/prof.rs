//! `COMMD_EAGER_PROFILE=N` (diagnostics, off by default): where the host time of one posted GPU
//! op goes, by phase, per thread; every `N` ops the means are printed to stderr and reset.
//! Phases are marked where the work happens (`mark`); a caller that wraps the post (the NCCL
//! library's API functions) starts the op (`begin`) and ends it (`end`), so its own cost shows
//! as the first and last phases. Off, each call is one load of a cached value.

use std::cell::RefCell;
use std::sync::OnceLock;
use std::time::Instant;

/// The phases, in order of an op's path.
pub const PHASES: [&str; 8] = [
    "caller",  // the wrapper's entry to the client's post
    "checks",  // owner, driver, earlier failures, capture state
    "buffers", // pointer queries and the device's context
    "prepare", // windows, kernel module, stream order, status word
    "launch",  // the kernel launch
    "event",   // the completion event and the request
    "daemon",  // an op of the daemon's path, from the checks to its post
    "return",  // back to the wrapper's exit
];
pub const CALLER: usize = 0;
pub const CHECKS: usize = 1;
pub const BUFFERS: usize = 2;
pub const PREPARE: usize = 3;
pub const LAUNCH: usize = 4;
pub const EVENT: usize = 5;
pub const DAEMON: usize = 6;
const RETURN: usize = 7;

fn every() -> u64 {
    static N: OnceLock<u64> = OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("COMMD_EAGER_PROFILE")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    })
}

#[derive(Default)]
struct Acc {
    open: bool,
    last: Option<Instant>,
    ns: [u64; PHASES.len()],
    ops: u64,
}

thread_local! {
    static ACC: RefCell<Acc> = RefCell::new(Acc::default());
}

/// An op starts (the wrapper's entry).
pub fn begin() {
    if every() == 0 {
        return;
    }
    ACC.with(|a| {
        let mut a = a.borrow_mut();
        a.open = true;
        a.last = Some(Instant::now());
    });
}

/// The time since the last mark goes to `phase`. Without an open op (no wrapper), the first
/// mark opens one.
pub fn mark(phase: usize) {
    if every() == 0 {
        return;
    }
    ACC.with(|a| {
        let mut a = a.borrow_mut();
        let now = Instant::now();
        if let Some(l) = a.last.filter(|_| a.open) {
            a.ns[phase] += (now - l).as_nanos() as u64;
        }
        a.open = true;
        a.last = Some(now);
    });
}

/// The op ends (the wrapper's exit); every `COMMD_EAGER_PROFILE` ops, the means go to stderr.
pub fn end() {
    let n = every();
    if n == 0 {
        return;
    }
    ACC.with(|a| {
        let mut a = a.borrow_mut();
        if !a.open {
            return;
        }
        let now = Instant::now();
        if let Some(l) = a.last {
            a.ns[RETURN] += (now - l).as_nanos() as u64;
        }
        a.open = false;
        a.ops += 1;
        if a.ops >= n {
            let total: u64 = a.ns.iter().sum();
            let mut line = format!(
                "commd profile: {} ops, {:.2} us per op on the host:",
                a.ops,
                total as f64 / a.ops as f64 / 1e3
            );
            for (name, ns) in PHASES.iter().zip(a.ns) {
                line += &format!(" {name} {:.2}", ns as f64 / a.ops as f64 / 1e3);
            }
            eprintln!("{line}");
            a.ns = [0; PHASES.len()];
            a.ops = 0;
        }
    });
}
