//! NCCL's logging habit on commd: `NCCL_DEBUG` (VERSION, WARN, INFO, TRACE; `COMMD_DEBUG` when
//! it is unset) and `NCCL_DEBUG_SUBSYS` (INIT, COLL, P2P, ENV, ALL, `^` to exclude) select what
//! the library prints on stderr, one line each, prefixed like NCCL's
//! (`host:pid:tid [device] NCCL INFO ...`) so the usual greps keep working.
//!
//! Every `NCCL_*` variable set is logged once, at INFO (subsystem ENV), with what commd does
//! with it (`env`).
//!
//! May use: std, `env` (the variables' table).

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::io::Write;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Once, OnceLock};

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Level {
    None,
    Version,
    Warn,
    Info,
    Trace,
}

pub const INIT: u32 = 1;
pub const COLL: u32 = 2;
pub const P2P: u32 = 4;
pub const ENV: u32 = 8;
const ALL: u32 = INIT | COLL | P2P | ENV;

impl Level {
    fn code(self) -> u32 {
        self as u32
    }

    fn of(code: u32) -> Level {
        [
            Level::None,
            Level::Version,
            Level::Warn,
            Level::Info,
            Level::Trace,
        ]
        .get(code as usize)
        .copied()
        .unwrap_or(Level::None)
    }
}

fn parse_level(v: Option<&str>) -> Level {
    match v.map(|s| s.trim().to_ascii_uppercase()).as_deref() {
        Some("VERSION") => Level::Version,
        Some("WARN") | Some("WARNING") | Some("ERROR") => Level::Warn,
        Some("INFO") | Some("DEBUG") => Level::Info,
        Some("TRACE") => Level::Trace,
        _ => Level::None,
    }
}

/// The subsystems a `NCCL_DEBUG_SUBSYS` value selects (NCCL's default: INIT and ENV).
fn parse_subsys(v: Option<&str>) -> u32 {
    let Some(v) = v.filter(|s| !s.trim().is_empty()) else {
        return INIT | ENV;
    };
    let (exclude, list) = match v.trim().strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, v.trim()),
    };
    let mut mask = 0;
    for name in list.split(',') {
        mask |= match name.trim().to_ascii_uppercase().as_str() {
            "INIT" => INIT,
            "COLL" => COLL,
            "P2P" => P2P,
            "ENV" => ENV,
            "ALL" => ALL,
            _ => 0,
        };
    }
    if exclude { ALL & !mask } else { mask }
}

/// The level and subsystems as read from the environment, read again after [`reset`]
/// (`ncclResetDebugInitInternal`); `UNREAD` until the first look.
const UNREAD: u32 = u32::MAX;
static LEVEL: AtomicU32 = AtomicU32::new(UNREAD);
static SUBSYS: AtomicU32 = AtomicU32::new(0);

fn level_and_subsys() -> (Level, u32) {
    let mut code = LEVEL.load(Ordering::Acquire);
    if code == UNREAD {
        let level = commd_settings::get(&commd_settings::keys::NCCL_DEBUG)
            .or_else(|| commd_settings::get(&commd_settings::keys::DEBUG));
        let subsys =
            parse_subsys(commd_settings::get(&commd_settings::keys::NCCL_DEBUG_SUBSYS).as_deref());
        SUBSYS.store(subsys, Ordering::Release);
        code = parse_level(level.as_deref()).code();
        LEVEL.store(code, Ordering::Release);
    }
    (Level::of(code), SUBSYS.load(Ordering::Acquire))
}

/// Reads `NCCL_DEBUG` and `NCCL_DEBUG_SUBSYS` again at the next line (NCCL's
/// `ncclResetDebugInitInternal`, for a program that changed them in its environment).
pub fn reset() {
    LEVEL.store(UNREAD, Ordering::Release);
}

fn host() -> &'static str {
    static HOST: OnceLock<String> = OnceLock::new();
    HOST.get_or_init(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into())
    })
}

pub fn enabled(level: Level, subsys: u32) -> bool {
    let (l, s) = level_and_subsys();
    level <= l && (level <= Level::Warn || s & subsys != 0)
}

fn emit(kind: &str, device: i32, text: &str) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc_gettid() };
    let line = format!(
        "{}:{}:{} [{}] NCCL {kind} {text}\n",
        host(),
        std::process::id(),
        tid,
        device.max(0)
    );
    let _ = std::io::stderr().write_all(line.as_bytes());
}

unsafe extern "C" {
    #[link_name = "gettid"]
    fn libc_gettid() -> i32;
}

/// An INFO line; `text` is built only when the line is printed (op lines are on the hot path).
pub fn info(subsys: u32, device: i32, text: impl FnOnce() -> String) {
    if enabled(Level::Info, subsys) {
        emit("INFO", device, &text());
    }
}

/// A WARN line printed whatever `NCCL_DEBUG` says: for settings a job asked for that commd does
/// not apply.
pub fn notice(text: &str) {
    emit("WARN", -1, text);
}

pub fn warn(text: &str) {
    if enabled(Level::Warn, ALL) {
        emit("WARN", -1, text);
    }
}

/// Once per process, at the first communicator: the version line and the ignored variables.
pub fn startup(device: i32) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if enabled(Level::Version, ALL) {
            emit(
                "INFO",
                device,
                &format!(
                    "commd NCCL-compatible library {} (NCCL API {}), collectives run by the commd daemon",
                    env!("CARGO_PKG_VERSION"),
                    crate::version_code()
                ),
            );
        }
        let mut vars = commd_settings::vars_with_prefix("NCCL_");
        vars.sort();
        for (k, v) in vars {
            info(ENV, device, || crate::env::describe(&k, &v));
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_and_subsystems_parse_like_nccl() {
        assert_eq!(parse_level(Some("info")), Level::Info);
        assert_eq!(parse_level(Some("WARN")), Level::Warn);
        assert_eq!(parse_level(None), Level::None);
        assert_eq!(parse_level(Some("bogus")), Level::None);
        assert_eq!(parse_subsys(None), INIT | ENV);
        assert_eq!(parse_subsys(Some("COLL,P2P")), COLL | P2P);
        assert_eq!(parse_subsys(Some("^INIT")), COLL | P2P | ENV);
        assert_eq!(parse_subsys(Some("ALL")), ALL);
    }
}
