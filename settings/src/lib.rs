//! The registry of every environment-only setting of commd, whichever side reads it: the client
//! library, the CUDA layer, the NCCL-compatible library, the Python package, the daemon's
//! environment-only knobs and the test harness; and the one reader of the process environment.
//!
//! The daemon's own settings, which also come from its config file and flags, are typed in
//! `daemon/src/config/keys.rs`; the same rule holds for both tables: a `COMMD_*` name is read
//! only through its registry, which says its default, its range and what it means, and
//! `commd config` (daemon) or `commd config --client` (this table) prints each value and where it
//! came from.
//!
//! This crate depends on nothing: every other crate of the workspace may use it. It parses no
//! value: each reader keeps the parser that gives its errors their words; the registry documents
//! the accepted values and [`check`] applies the documented kind to a value for
//! `commd config --client`.

#![forbid(unsafe_code)]

pub mod keys;

use std::ffi::OsString;

pub use keys::KEYS;

/// Who reads a setting.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reader {
    /// The client library (`commd-client`), in every process that talks to the daemon.
    Client,
    /// The CUDA layer (`commd-cuda`).
    Cuda,
    /// Host-wide facilities (`commd-host`): the daemon and the software switch.
    Host,
    /// The NCCL-compatible library (`libnccl.so.2`).
    Nccl,
    /// The C ABI (`commd-cpp`) at build or run time.
    CAbi,
    /// The Python package (`commd`, `commd.torch`, `commd.vllm`).
    Python,
    /// The daemon binary, outside its config file (`commd exec`, the GPU executors).
    Daemon,
    /// Test harnesses only (the Rust unit tests, the end-to-end tests).
    Tests,
}

impl Reader {
    pub fn name(self) -> &'static str {
        match self {
            Reader::Client => "client",
            Reader::Cuda => "cuda",
            Reader::Host => "host",
            Reader::Nccl => "nccl",
            Reader::CAbi => "c-abi",
            Reader::Python => "python",
            Reader::Daemon => "daemon",
            Reader::Tests => "tests",
        }
    }
}

/// The kind of value a setting takes, as its reader accepts it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    /// Unsigned integer within `[min, max]`.
    U64 { min: u64, max: u64 },
    /// One of these words (compared after trimming, case as written).
    Choice(&'static [&'static str]),
    /// Set (any non-empty value other than `0`) or not.
    Flag,
    /// A file-system path.
    Path,
    /// Free text (its reader's docs say what it parses).
    Str,
}

/// One setting.
#[derive(Debug)]
pub struct Key {
    /// The environment variable.
    pub name: &'static str,
    /// The value used when it is unset, in the words of [`Key::kind`]; `None`: computed (the
    /// help says how) or off.
    pub default: Option<&'static str>,
    pub kind: Kind,
    pub read_by: Reader,
    pub help: &'static str,
}

/// The registry's entry for `name`.
pub fn key(name: &str) -> Option<&'static Key> {
    KEYS.iter().copied().find(|k| k.name == name)
}

/// The value of `key` in this process's environment, as text (`None`: unset, or not UTF-8).
pub fn get(key: &'static Key) -> Option<String> {
    get_os(key).and_then(|v| v.into_string().ok())
}

/// As [`get`], the raw value (paths need not be UTF-8).
pub fn get_os(key: &'static Key) -> Option<OsString> {
    read(key.name)
}

/// The value of the registered setting `name`. A name missing from the registry is a bug of
/// the caller: debug builds panic, release builds read it anyway (no setting is ever ignored).
pub fn by_name(name: &str) -> Option<String> {
    debug_assert!(
        key(name).is_some(),
        "{name} is not in commd-settings' registry"
    );
    read(name).and_then(|v| v.into_string().ok())
}

/// A variable of the process's environment that is not a commd setting (`XDG_RUNTIME_DIR`,
/// `LD_PRELOAD`, systemd's `NOTIFY_SOCKET`, ...). `COMMD_*` names go through [`get`].
pub fn system(name: &str) -> Option<OsString> {
    debug_assert!(
        !name.starts_with("COMMD_"),
        "{name}: read commd settings through the registry"
    );
    read(name)
}

/// Every variable of this process's environment whose name starts with `prefix`, with its
/// value (a value that is not UTF-8 converted lossily, so its reader refuses it by name): for the
/// readers that refuse unknown `COMMD_*` names (the daemon's config) or report ignored `NCCL_*`
/// ones (the NCCL library).
pub fn vars_with_prefix(prefix: &str) -> Vec<(String, String)> {
    #[allow(clippy::disallowed_methods)] // the registry's one reader of the environment
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v)))
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(k, v)| (k, v.to_string_lossy().into_owned()))
        .collect()
}

#[allow(clippy::disallowed_methods)] // the registry's one reader of the environment
fn read(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}

/// Where an effective value came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    Env,
    Default,
}

/// `key`'s effective value in this process and its source; `Err` when the environment's value
/// is not of the documented kind (its reader refuses it too).
pub fn effective(key: &'static Key) -> (Option<String>, Source, Result<(), String>) {
    match get_os(key) {
        Some(v) => {
            let text = v.to_string_lossy().into_owned();
            let ok = check(key, &text);
            (Some(text), Source::Env, ok)
        }
        None => (key.default.map(str::to_string), Source::Default, Ok(())),
    }
}

/// Whether `value` is of `key`'s documented kind (empty: the default, always fine).
pub fn check(key: &Key, value: &str) -> Result<(), String> {
    let v = value.trim();
    if v.is_empty() {
        return Ok(());
    }
    let bad = |want: String| Err(format!("{}={value:?}: expected {want}", key.name));
    match key.kind {
        Kind::U64 { min, max } => match v.parse::<u64>() {
            Ok(x) if (min..=max).contains(&x) => Ok(()),
            _ => bad(format!("an integer from {min} to {max}")),
        },
        Kind::Choice(words) if !words.contains(&v) => bad(format!("one of {}", words.join(", "))),
        Kind::Choice(_) | Kind::Flag | Kind::Path | Kind::Str => Ok(()),
    }
}

/// The table `commd config --client` prints: every setting, its effective value, its source
/// and its reader; lines of settings whose value is refused end in `INVALID: <why>`.
pub fn table() -> String {
    use std::fmt::Write as _;
    let mut out = String::new();
    let w = KEYS.iter().map(|k| k.name.len()).max().unwrap_or(0);
    for &k in KEYS {
        let (v, src, ok) = effective(k);
        let src = match src {
            Source::Env => "env",
            Source::Default => "default",
        };
        let v = v.unwrap_or_else(|| "(unset)".into());
        let _ = write!(out, "{:w$}  {v}  [{src}; {}]", k.name, k.read_by.name());
        if let Err(e) = ok {
            let _ = write!(out, "  INVALID: {e}");
        }
        let _ = writeln!(out, "\n{:w$}  {}", "", k.help);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_commd_or_nccl_names_with_help() {
        let mut seen = std::collections::HashSet::new();
        for &k in KEYS {
            assert!(seen.insert(k.name), "{} registered twice", k.name);
            assert!(
                k.name.starts_with("COMMD_") || k.name.starts_with("NCCL_"),
                "{}: not a commd or NCCL name",
                k.name
            );
            assert!(!k.help.is_empty(), "{} has no help", k.name);
        }
    }

    #[test]
    fn defaults_are_of_their_kind() {
        for &k in KEYS {
            if let Some(d) = k.default {
                assert_eq!(check(k, d), Ok(()), "{}'s default", k.name);
            }
        }
    }

    #[test]
    fn check_refuses_values_outside_the_kind() {
        let k = Key {
            name: "COMMD_X",
            default: None,
            kind: Kind::U64 { min: 1, max: 8 },
            read_by: Reader::Client,
            help: "x",
        };
        assert!(check(&k, "4").is_ok() && check(&k, " ").is_ok());
        assert!(check(&k, "9").unwrap_err().contains("from 1 to 8"));
        assert!(check(&k, "x").is_err());
        let c = Key {
            kind: Kind::Choice(&["auto", "off"]),
            ..k
        };
        assert!(check(&c, "auto").is_ok());
        assert!(check(&c, "on").unwrap_err().contains("auto, off"));
    }
}
