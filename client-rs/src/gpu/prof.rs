//! `COMMD_EAGER_PROFILE=N` (diagnostics, off by default): where the host time of one posted GPU
//! op goes, by phase, per thread; every `N` ops the means are printed to stderr and reset.
//! Only ops a caller wraps are counted (the NCCL library's API functions): it starts the op
//! (`begin`) and ends it (`end`), so its own cost shows as the first and last phases; the
//! phases between are marked where the work happens (`mark`, a no-op outside a wrapped op).
//! Ops inside a group `pause` instead of ending: a group and its ops count as one op.
//! Off, each call is one load of a cached value; a value that is not a count is named on
//! stderr once and leaves it off.

use std::cell::RefCell;
use std::sync::OnceLock;
use std::time::Instant;

/// The phases, in order of an op's path.
pub const PHASES: [&str; 12] = [
    "caller",   // the wrapper's entry to the client's post
    "checks",   // owner, driver, earlier failures, capture state
    "buffers",  // pointer queries and the device's context
    "prepare",  // windows, kernel module, stream order, status word
    "launch",   // the kernel launch
    "event",    // the completion event and the request
    "daemon",   // an op of the daemon's path, from the checks to its post
    "return",   // back to the wrapper's exit
    "held",     // ops of a group, held for its end (their whole wrapper)
    "requests", // a group's requests made (after its event)
    "tracked",  // the library's bookkeeping of a group's posted ops
    "flushed",  // the group end's stream waits
];
pub const CALLER: usize = 0;
pub const CHECKS: usize = 1;
pub const BUFFERS: usize = 2;
pub const PREPARE: usize = 3;
pub const LAUNCH: usize = 4;
pub const EVENT: usize = 5;
pub const DAEMON: usize = 6;
const RETURN: usize = 7;
const HELD: usize = 8;
pub const REQUESTS: usize = 9;
pub const TRACKED: usize = 10;
pub const FLUSHED: usize = 11;

/// `COMMD_EAGER_PROFILE`'s value: ops per report (0: off), or why it is not one.
fn parse(v: Option<&str>) -> Result<u64, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(0),
        Some(t) => t.parse().map_err(|_| {
            format!("COMMD_EAGER_PROFILE={t:?} is not a count of ops (0: off); profiling stays off")
        }),
    }
}

fn every() -> u64 {
    static N: OnceLock<u64> = OnceLock::new();
    *N.get_or_init(|| {
        parse(commd_settings::get(&commd_settings::keys::EAGER_PROFILE).as_deref()).unwrap_or_else(
            |e| {
                eprintln!("commd: {e}");
                0
            },
        )
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

/// Adds the time since the open op's last mark to `phase`; `close`: the op stops there.
/// Whether an op was open (nothing outside a `begin` / `end` pair).
fn lap(a: &mut Acc, phase: usize, close: bool) -> bool {
    if !a.open {
        return false;
    }
    let now = Instant::now();
    if let Some(l) = a.last {
        a.ns[phase] += u64::try_from((now - l).as_nanos()).unwrap_or(u64::MAX);
    }
    a.last = Some(now);
    a.open = !close;
    true
}

/// The time since the last mark of the open op goes to `phase` (nothing outside a `begin` /
/// `end` pair).
pub fn mark(phase: usize) {
    if every() == 0 {
        return;
    }
    ACC.with(|a| {
        lap(&mut a.borrow_mut(), phase, false);
    });
}

/// An op inside a group stops for now (the wrapper's exit): its time so far stays with the
/// group, which counts as one op when its end (a wrapped `ncclGroupEnd`) ends.
pub fn pause() {
    if every() == 0 {
        return;
    }
    ACC.with(|a| {
        lap(&mut a.borrow_mut(), HELD, true);
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
        if !lap(&mut a, RETURN, true) {
            return;
        }
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

#[cfg(test)]
mod tests {
    use super::parse;

    #[test]
    fn the_setting_is_a_count_or_named_as_wrong() {
        assert_eq!(parse(None), Ok(0));
        assert_eq!(parse(Some(" 2000 ")), Ok(2000));
        let e = parse(Some("lots")).unwrap_err();
        assert!(
            e.contains("COMMD_EAGER_PROFILE=\"lots\"") && e.contains("stays off"),
            "{e}"
        );
        assert!(parse(Some("-5")).is_err());
    }
}
