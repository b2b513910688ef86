//! Every daemon setting in one typed registry: name, `COMMD_*` variable, TOML key, default,
//! description. Precedence: flags (`--set key=value` and the dedicated flags) > environment >
//! TOML file (`--config`, else `/etc/commd/commd.toml` if present) > defaults. Unknown keys and
//! invalid values are rejected by name. `commd config` prints each value and where it came from.
//!
//! This module only reads and validates; it starts nothing. `keys`: the registry table;
//! `settings`: the typed values whose behaviour other modules own (observability, the switch
//! client, the RDMA GID), kept here so that config depends on no module above it.
//!
//! May use: std, `pacing` (rate bounds), `commd_host::private` (the config file is opened as
//! a trusted file: owned by root or the daemon's user, writable by no one else, reached through
//! no name another user controls).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

pub const DEFAULT_CONFIG_PATH: &str = "/etc/commd/commd.toml";

mod derived;
mod keys;
mod settings;

pub use derived::Derived;

use keys::Kind;
pub use keys::{KEYS, Key, SUBSYSTEMS};
pub use settings::*;

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("unknown config key '{0}'{hint} (see `commd config` for the list)", hint = did_you_mean(.0, KEYS.iter().map(|k| k.name)))]
    UnknownKey(String),
    #[error("invalid value '{value}' for {key} (from {origin}): {why}")]
    Invalid {
        key: String,
        value: String,
        origin: String,
        why: String,
    },
    #[error("reading config file {path}: {err}")]
    Read { path: PathBuf, err: std::io::Error },
    #[error("parsing config file {path}: {err}")]
    Parse { path: PathBuf, err: String },
    #[error("--set expects KEY=VALUE, got '{0}'")]
    SetSyntax(String),
}

/// Where a value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Default,
    File(PathBuf),
    Env(&'static str),
    Flag,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Default => write!(f, "default"),
            Source::File(p) => write!(f, "file {}", p.display()),
            Source::Env(e) => write!(f, "env {e}"),
            Source::Flag => write!(f, "flag"),
        }
    }
}

/// The effective, validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub socket: PathBuf,
    pub op_timeout: Duration,
    pub join_timeout: Duration,
    pub attach_timeout: Duration,
    pub liveness_interval: Duration,
    pub workers: usize,
    pub cuda: bool,
    pub gpu_scratch_slot_bytes: u64,
    /// Default GPU copy pacing of new communicators, bytes/s (`None`: uncapped).
    pub gpu_pacing: Option<u64>,
    pub poll_spin: Duration,
    pub ring_entries: u32,
    pub max_sessions: usize,
    pub max_sessions_per_uid: usize,
    pub max_unique_ids_per_uid: usize,
    pub max_registered_bytes_per_uid: u64,
    pub max_comms_per_uid: usize,
    pub max_registered_bytes: u64,
    /// Registrations (host and GPU) the daemon holds at once, and one uid's share.
    pub max_registrations: usize,
    pub max_registrations_per_uid: usize,
    /// Fds staged on the fd socket and not registered: daemon-wide, per uid, and how long one
    /// may wait for its registration.
    pub max_staged_fds: usize,
    pub max_staged_fds_per_uid: usize,
    pub staged_fd_timeout: Duration,
    /// Control-socket (gRPC) connections one uid may hold open.
    pub max_connections_per_uid: usize,
    /// `None`: no peer service (single-node daemon).
    pub peer_listen: Option<std::net::SocketAddr>,
    /// Whether `peer_listen` was set explicitly (a bind failure is then fatal).
    pub peer_listen_explicit: bool,
    /// Joins must announce addresses of the IP they come from (`peer_addr_check`).
    pub peer_addr_check: bool,
    /// Legacy CUDA IPC handles only from the session's own process (`cuda_ipc_owner_check`).
    pub cuda_ipc_owner_check: bool,
    pub advertise: String,
    /// (cert, key, ca) paths when mutual TLS is configured.
    pub peer_tls: Option<(PathBuf, PathBuf, PathBuf)>,
    pub data_port: u16,
    pub tcp_streams: usize,
    pub peer_timeout: Duration,
    pub net_chunk_bytes: u64,
    pub net_small_bytes: u64,
    pub net_algo: String,
    pub switch: SwitchSettings,
    /// `auto`, `tcp` or `rdma`.
    pub transport: String,
    pub rdma_device: String,
    pub rdma_gid: String,
    pub rdma_qps_per_peer: usize,
    pub rdma_buffer_bytes: u64,
    pub debug: String,
    pub debug_subsys: Vec<String>,
    pub telemetry: TelemetrySettings,
    /// Every key's effective value (as text) and source, for `commd config`.
    pub effective: BTreeMap<&'static str, (String, Source)>,
    pub file: Option<PathBuf>,
}

/// Inputs to [`Config::load`]: explicit so that tests never touch the real environment.
#[derive(Debug, Default)]
pub struct Inputs {
    pub config_file: Option<PathBuf>,
    /// `(key, value)` from flags, in order (later wins).
    pub flags: Vec<(String, String)>,
    pub env: BTreeMap<String, String>,
}

impl Inputs {
    pub fn from_process(config_file: Option<PathBuf>, flags: Vec<(String, String)>) -> Self {
        let env = commd_settings::vars_with_prefix("COMMD_")
            .into_iter()
            .collect();
        Self {
            config_file,
            flags,
            env,
        }
    }
}

/// Parses `KEY=VALUE` as given to `--set`.
pub fn parse_set(s: &str) -> Result<(String, String), ConfigError> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| ConfigError::SetSyntax(s.to_string()))?;
    Ok((k.trim().to_string(), v.trim().to_string()))
}

/// `" (did you mean 'x'?)"` for the known name closest to `name` when it is close enough to be
/// a typo (at most 2 edits, and fewer than a third of the name), else `""`.
pub fn did_you_mean<'a>(name: &str, known: impl Iterator<Item = &'a str>) -> String {
    let limit = (name.len() / 3).clamp(1, 2);
    known
        .map(|k| {
            (
                edits(&name.to_ascii_lowercase(), &k.to_ascii_lowercase()),
                k,
            )
        })
        .filter(|(d, _)| *d <= limit)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| format!(" (did you mean '{k}'?)"))
        .unwrap_or_default()
}

/// Levenshtein distance (insertions, deletions, substitutions) between two short names.
fn edits(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}

/// The `COMMD_*` variables of `env` that nothing of commd reads (neither a daemon setting nor
/// an environment-only one of `commd_settings`), each as a warning with the closest known name
/// when there is one. Warned, not refused: clients' variables share the prefix, and a job's
/// environment reaches the daemon in `commd bench` and `commd exec`.
pub fn unknown_env(env: &BTreeMap<String, String>) -> Vec<String> {
    let known = || {
        KEYS.iter()
            .map(|k| k.env)
            .chain(commd_settings::KEYS.iter().map(|k| k.name))
    };
    env.keys()
        .filter(|v| v.starts_with("COMMD_") && !known().any(|k| k == v.as_str()))
        .map(|v| {
            format!(
                "{v} is not a commd setting and is ignored{} (`commd config` and `commd config --client` list them)",
                did_you_mean(v, known())
            )
        })
        .collect()
}

fn key(name: &str) -> Result<&'static Key, ConfigError> {
    KEYS.iter()
        .find(|k| k.name == name)
        .ok_or_else(|| ConfigError::UnknownKey(name.to_string()))
}

fn validate(k: &Key, value: &str, source: &Source) -> Result<(), ConfigError> {
    let bad = |why: String| ConfigError::Invalid {
        key: k.name.to_string(),
        value: value.to_string(),
        origin: source.to_string(),
        why,
    };
    match k.kind {
        Kind::Path if value.is_empty() => Err(bad("empty path".into())),
        Kind::Path => Ok(()),
        Kind::U64 { min, max } => {
            let v: u64 = value
                .parse()
                .map_err(|_| bad("not an unsigned integer".into()))?;
            if v < min || v > max {
                return Err(bad(format!("must be in {min}..={max}")));
            }
            if k.name == "ring_entries" && !v.is_power_of_two() {
                return Err(bad("must be a power of two".into()));
            }
            Ok(())
        }
        Kind::F64 { min, max } => {
            let v: f64 = value
                .parse()
                .ok()
                .filter(|v: &f64| v.is_finite())
                .ok_or_else(|| bad("not a decimal number".into()))?;
            if v < min || v > max {
                return Err(bad(format!("must be in {min}..={max}")));
            }
            if k.name == "gpu_pacing_gbps" {
                gbps_to_rate(v).map_err(bad)?;
            }
            Ok(())
        }
        Kind::Str => match k.name {
            "debug" => match value.to_ascii_uppercase().as_str() {
                "ERROR" | "WARN" | "INFO" | "DEBUG" | "TRACE" => Ok(()),
                _ => Err(bad("expected ERROR, WARN, INFO, DEBUG or TRACE".into())),
            },
            "debug_subsys" => {
                for s in value.split(',').map(|s| s.trim().to_ascii_uppercase()) {
                    if s != "ALL" && !SUBSYSTEMS.contains(&s.as_str()) {
                        return Err(bad(format!(
                            "unknown subsystem '{s}' (known: ALL, {})",
                            SUBSYSTEMS.join(", ")
                        )));
                    }
                }
                Ok(())
            }
            "peer_addr_check" | "cuda_ipc_owner_check" => match value {
                "on" | "off" => Ok(()),
                _ => Err(bad("expected on or off".into())),
            },
            "peer_listen" if value.eq_ignore_ascii_case("off") => Ok(()),
            "peer_listen" => value
                .parse::<std::net::SocketAddr>()
                .map(|_| ())
                .map_err(|_| bad("expected IP:PORT (e.g. 0.0.0.0:7400) or 'off'".into())),
            "advertise" if value.is_empty() => Ok(()),
            "advertise" => {
                if value.parse::<std::net::IpAddr>().is_ok()
                    || value.parse::<std::net::SocketAddr>().is_ok()
                {
                    Ok(())
                } else {
                    Err(bad("expected an IP or IP:PORT".into()))
                }
            }
            "net_algo" => match value {
                "auto" | "oneshot" | "chain" => Ok(()),
                _ => Err(bad("expected auto, oneshot or chain".into())),
            },
            "switch" => check_controller(value).map_err(bad),
            "switch_bind" if value.is_empty() => Ok(()),
            "switch_bind" => value
                .parse::<std::net::Ipv4Addr>()
                .map(|_| ())
                .map_err(|_| bad("expected an IPv4 address".into())),
            "switch_packet_bytes" => match value {
                "256" | "1024" => Ok(()),
                _ => Err(bad("expected 256 or 1024".into())),
            },
            "switch_pin" => match value {
                "auto" | "off" => Ok(()),
                _ => Err(bad("expected auto or off".into())),
            },
            "transport" => match value {
                "auto" | "tcp" | "rdma" => Ok(()),
                _ => Err(bad("expected auto, tcp or rdma".into())),
            },
            "rdma_device" => Ok(()),
            "rdma_gid" => GidChoice::parse(value).map(|_| ()).map_err(bad),
            other => validate_telemetry_key(other, value).map_err(bad),
        },
    }
}

/// A cap in GB/s (1e9 bytes/s; 0: uncapped) as a pacing rate in bytes/s.
// `as` saturates (negative and NaN to 0, too large to u64::MAX); the registry bounds keep the
// product far below u64::MAX anyway.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn gbps_to_rate(gbps: f64) -> Result<Option<u64>, String> {
    crate::pacing::check_rate((gbps * 1e9).round() as u64).map_err(|_| {
        format!(
            "a nonzero cap must be at least {} GB/s (0 means uncapped)",
            crate::pacing::gbps_text(crate::pacing::MIN_RATE)
        )
    })
}

/// Reads a file the daemon trusts (its config, its TLS files): refused when another user owns
/// it, can write it, or controls a directory or link on the way to it (`commd_host::private`).
pub fn read_trusted(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut f = commd_host::private::open_file(path, commd_host::private::Access::ReadTrusted)?;
    let mut out = Vec::new();
    f.read_to_end(&mut out)?;
    Ok(out)
}

/// The default socket path for the current user (shared with clients).
pub fn default_socket() -> PathBuf {
    commd_host::default_socket_path()
}

fn computed_default(name: &str) -> String {
    match name {
        "socket" => default_socket().display().to_string(),
        "workers" => std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
            .to_string(),
        _ => String::new(),
    }
}

fn toml_value_text(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl Config {
    pub fn load(inputs: &Inputs) -> Result<Self, ConfigError> {
        let mut eff: BTreeMap<&'static str, (String, Source)> = BTreeMap::new();
        for k in KEYS {
            let v = k
                .default
                .map(str::to_string)
                .unwrap_or_else(|| computed_default(k.name));
            eff.insert(k.name, (v, Source::Default));
        }
        // File: explicit path must exist; the default path is optional.
        let file = match &inputs.config_file {
            Some(p) => Some(p.clone()),
            None => Path::new(DEFAULT_CONFIG_PATH)
                .exists()
                .then(|| PathBuf::from(DEFAULT_CONFIG_PATH)),
        };
        if let Some(path) = &file {
            let text = read_trusted(path)
                .and_then(|b| {
                    String::from_utf8(b).map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text")
                    })
                })
                .map_err(|err| ConfigError::Read {
                    path: path.clone(),
                    err,
                })?;
            let table: toml::Table =
                text.parse()
                    .map_err(|e: toml::de::Error| ConfigError::Parse {
                        path: path.clone(),
                        err: e.to_string(),
                    })?;
            for (name, value) in &table {
                let k = key(name)?;
                let src = Source::File(path.clone());
                let text = toml_value_text(value);
                validate(k, &text, &src)?;
                eff.insert(k.name, (text, src));
            }
        }
        for k in KEYS {
            if let Some(v) = inputs.env.get(k.env) {
                let src = Source::Env(k.env);
                validate(k, v, &src)?;
                eff.insert(k.name, (v.clone(), src));
            }
        }
        for (name, v) in &inputs.flags {
            let k = key(name)?;
            validate(k, v, &Source::Flag)?;
            eff.insert(k.name, (v.clone(), Source::Flag));
        }
        Self::from_effective(eff, file)
    }

    fn from_effective(
        eff: BTreeMap<&'static str, (String, Source)>,
        file: Option<PathBuf>,
    ) -> Result<Self, ConfigError> {
        let s = |n: &str| eff[n].0.clone();
        // Values were validated above; a parse failure here would be a registry bug, reported as such.
        let u = |n: &str| -> Result<u64, ConfigError> {
            s(n).parse().map_err(|_| ConfigError::Invalid {
                key: n.to_string(),
                value: s(n),
                origin: eff[n].1.to_string(),
                why: "not an unsigned integer".into(),
            })
        };
        // The registry bounds keep every value in its field's range; one that is not is refused.
        let out_of_range = |n: &str| ConfigError::Invalid {
            key: n.to_string(),
            value: s(n),
            origin: eff[n].1.to_string(),
            why: "out of range".into(),
        };
        let uz = |n: &str| -> Result<usize, ConfigError> {
            usize::try_from(u(n)?).map_err(|_| out_of_range(n))
        };
        let u32_of = |n: &str| -> Result<u32, ConfigError> {
            u32::try_from(u(n)?).map_err(|_| out_of_range(n))
        };
        let u16_of = |n: &str| -> Result<u16, ConfigError> {
            u16::try_from(u(n)?).map_err(|_| out_of_range(n))
        };
        let ms = |n: &str| u(n).map(Duration::from_millis);
        // 0 in a `max_*` key of these means "derived from this machine's limits".
        let derived = Derived::here();
        let or_derived = |n: &str, d: u64| -> Result<u64, ConfigError> {
            Ok(match u(n)? {
                0 => d,
                v => v,
            })
        };
        let uz_or_derived = |n: &str, d: u64| -> Result<usize, ConfigError> {
            usize::try_from(or_derived(n, d)?).map_err(|_| out_of_range(n))
        };
        let max_registrations = uz_or_derived("max_registrations", derived.registrations)?;
        let max_staged_fds = uz_or_derived("max_staged_fds", derived.staged_fds)?;
        let gbps = |n: &str| -> Result<Option<u64>, ConfigError> {
            let invalid = |why: String| ConfigError::Invalid {
                key: n.to_string(),
                value: s(n),
                origin: eff[n].1.to_string(),
                why,
            };
            let v: f64 = s(n)
                .parse()
                .map_err(|_| invalid("not a decimal number".into()))?;
            gbps_to_rate(v).map_err(invalid)
        };
        Ok(Self {
            socket: PathBuf::from(s("socket")),
            op_timeout: ms("op_timeout_ms")?,
            join_timeout: ms("join_timeout_ms")?,
            attach_timeout: ms("attach_timeout_ms")?,
            liveness_interval: ms("liveness_interval_ms")?,
            workers: uz("workers")?,
            cuda: u("cuda")? == 1,
            gpu_scratch_slot_bytes: u("gpu_scratch_slot_bytes")? / 256 * 256,
            gpu_pacing: gbps("gpu_pacing_gbps")?,
            poll_spin: Duration::from_micros(u("poll_spin_us")?),
            ring_entries: u32_of("ring_entries")?,
            max_sessions: uz("max_sessions")?,
            max_sessions_per_uid: uz("max_sessions_per_uid")?,
            max_unique_ids_per_uid: uz("max_unique_ids_per_uid")?,
            max_registered_bytes_per_uid: or_derived(
                "max_registered_bytes_per_uid",
                derived.registered_bytes_per_uid,
            )?,
            max_comms_per_uid: uz("max_comms_per_uid")?,
            max_registered_bytes: u("max_registered_bytes")?,
            max_registrations,
            max_registrations_per_uid: uz_or_derived(
                "max_registrations_per_uid",
                derived::per_uid_share(max_registrations as u64),
            )?,
            max_staged_fds,
            max_staged_fds_per_uid: uz_or_derived(
                "max_staged_fds_per_uid",
                derived::per_uid_share(max_staged_fds as u64).max(16),
            )?,
            staged_fd_timeout: ms("staged_fd_timeout_ms")?,
            max_connections_per_uid: uz_or_derived(
                "max_connections_per_uid",
                derived.connections_per_uid,
            )?,
            peer_listen: if s("peer_listen").eq_ignore_ascii_case("off") {
                None
            } else {
                s("peer_listen").parse().ok()
            },
            peer_listen_explicit: eff["peer_listen"].1 != Source::Default,
            peer_addr_check: s("peer_addr_check") == "on",
            cuda_ipc_owner_check: s("cuda_ipc_owner_check") == "on",
            advertise: s("advertise"),
            peer_tls: {
                let t = [s("peer_tls_cert"), s("peer_tls_key"), s("peer_tls_ca")];
                match t.iter().filter(|x| !x.is_empty()).count() {
                    0 => None,
                    3 => Some((
                        PathBuf::from(&t[0]),
                        PathBuf::from(&t[1]),
                        PathBuf::from(&t[2]),
                    )),
                    _ => {
                        return Err(ConfigError::Invalid {
                            key: "peer_tls_cert".into(),
                            value: t.join(", "),
                            origin: eff["peer_tls_cert"].1.to_string(),
                            why: "peer_tls_cert, peer_tls_key and peer_tls_ca go together: set all three or none".into(),
                        });
                    }
                }
            },
            data_port: u16_of("data_port")?,
            tcp_streams: uz("tcp_streams")?,
            peer_timeout: ms("peer_timeout_ms")?,
            net_chunk_bytes: u("net_chunk_bytes")?,
            net_small_bytes: u("net_small_bytes")?,
            net_algo: s("net_algo"),
            switch: SwitchSettings {
                controller: s("switch"),
                bind: s("switch_bind"),
                threads: uz("switch_threads")?,
                window: uz("switch_window")?,
                packet_bytes: uz("switch_packet_bytes")?,
                timeout: ms("switch_timeout_ms")?,
                pin: s("switch_pin") != "off",
            },
            transport: s("transport"),
            rdma_device: s("rdma_device"),
            rdma_gid: s("rdma_gid"),
            rdma_qps_per_peer: uz("rdma_qps_per_peer")?,
            rdma_buffer_bytes: u("rdma_buffer_bytes")?,
            debug: s("debug").to_ascii_uppercase(),
            debug_subsys: s("debug_subsys")
                .split(',')
                .map(|x| x.trim().to_ascii_uppercase())
                .collect(),
            telemetry: TelemetrySettings::from_values(s),
            effective: eff,
            file,
        })
    }

    /// `commd config` output: one line per key with value, source and description.
    pub fn render(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "# commd effective configuration (precedence: flag > env > file > default); file: {}\n",
            self.file
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_else(|| "none".into())
        ));
        for k in KEYS {
            let (v, src) = &self.effective[k.name];
            let derived = match self.derived_value(k.name) {
                Some(d) if v == "0" => format!(" (derived here: {d})"),
                _ => String::new(),
            };
            out.push_str(&format!(
                "{:<22} = {:<40} # {}{derived} [{}; {}]\n",
                k.name, v, k.help, src, k.env
            ));
        }
        out
    }

    /// The value in effect of a key whose 0 means "derived from the daemon's limits".
    fn derived_value(&self, key: &str) -> Option<u64> {
        let uz = |v: usize| v as u64;
        Some(match key {
            "max_registrations" => uz(self.max_registrations),
            "max_registrations_per_uid" => uz(self.max_registrations_per_uid),
            "max_staged_fds" => uz(self.max_staged_fds),
            "max_staged_fds_per_uid" => uz(self.max_staged_fds_per_uid),
            "max_connections_per_uid" => uz(self.max_connections_per_uid),
            "max_registered_bytes_per_uid" => self.max_registered_bytes_per_uid,
            _ => return None,
        })
    }

    /// The fd socket lives beside the gRPC socket.
    pub fn fd_socket(&self) -> PathBuf {
        fd_socket_for(&self.socket)
    }
}

pub fn fd_socket_for(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".fd");
    PathBuf::from(s)
}

#[cfg(test)]
mod tests {
    #[test]
    fn unknown_commd_variables_are_warned_with_the_closest_name() {
        let env: BTreeMap<String, String> = [
            ("COMMD_WROKERS", "4"),
            ("COMMD_WORKERS", "4"),
            ("COMMD_SOCKET", "/tmp/s"),
            ("COMMD_ZZZ_NOTHING_LIKE_IT", "1"),
            ("PATH", "/bin"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let w = super::unknown_env(&env);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[0].starts_with("COMMD_WROKERS is not a commd setting")
                && w[0].contains("did you mean 'COMMD_WORKERS'?"),
            "{w:?}"
        );
        assert!(
            w[1].starts_with("COMMD_ZZZ_NOTHING_LIKE_IT") && !w[1].contains("did you mean"),
            "{w:?}"
        );
    }

    /// The docs list the same subsystems as the code (they drifted once).
    #[test]
    fn documented_subsystems_are_the_real_ones() {
        let docs = [
            (
                "docs/features.md",
                include_str!("../../../docs/features.md"),
            ),
            (
                "docs/observability.md",
                include_str!("../../../docs/observability.md"),
            ),
        ];
        for (name, text) in docs {
            let row = text
                .lines()
                .find(|l| l.starts_with("| debug_subsys |"))
                .unwrap_or_else(|| panic!("{name} has no debug_subsys row"));
            for s in SUBSYSTEMS {
                assert!(
                    row.contains(s),
                    "{name}'s debug_subsys row lacks {s}: {row}"
                );
            }
        }
        let help = KEYS.iter().find(|k| k.name == "debug_subsys").unwrap().help;
        for s in SUBSYSTEMS {
            assert!(help.contains(s), "the key's help lacks {s}");
        }
    }

    use super::*;
    use std::io::Write;

    fn inputs(file: Option<PathBuf>, env: &[(&str, &str)], flags: &[(&str, &str)]) -> Inputs {
        Inputs {
            config_file: file,
            env: env
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
            flags: flags
                .iter()
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .collect(),
        }
    }

    fn tmp_toml(text: &str) -> (PathBuf, tempdir::Dir) {
        let d = tempdir::Dir::new();
        let p = d.0.join("commd.toml");
        std::fs::File::create(&p)
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
        (p, d)
    }

    mod tempdir {
        pub struct Dir(pub std::path::PathBuf);
        impl Dir {
            pub fn new() -> Self {
                let p = std::env::temp_dir().join(format!(
                    "commd-cfg-{}-{}",
                    std::process::id(),
                    rand::random::<u64>()
                ));
                std::fs::create_dir_all(&p).unwrap();
                Self(p)
            }
        }
        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }

    #[test]
    fn the_table_shows_what_a_derived_key_comes_to() {
        let c = Config::load(&inputs(None, &[], &[("max_staged_fds_per_uid", "40")])).unwrap();
        let text = c.render();
        let line = |k: &str| text.lines().find(|l| l.starts_with(k)).unwrap().to_string();
        let regs = line("max_registrations_per_uid ");
        assert!(
            regs.contains(&format!("(derived here: {})", c.max_registrations_per_uid)),
            "{regs}"
        );
        // Set explicitly: no derived note.
        assert!(!line("max_staged_fds_per_uid ").contains("derived here"));
    }

    #[test]
    fn precedence_flag_env_file_default() {
        let (p, _d) = tmp_toml("op_timeout_ms = 1000\nworkers = 3\npoll_spin_us = 7\n");
        let c = Config::load(&inputs(
            Some(p.clone()),
            &[("COMMD_OP_TIMEOUT_MS", "2000"), ("COMMD_WORKERS", "5")],
            &[("op_timeout_ms", "3000")],
        ))
        .unwrap();
        assert_eq!(c.op_timeout, Duration::from_millis(3000));
        assert_eq!(c.effective["op_timeout_ms"].1, Source::Flag);
        assert_eq!(c.workers, 5);
        assert_eq!(c.effective["workers"].1, Source::Env("COMMD_WORKERS"));
        assert_eq!(c.poll_spin, Duration::from_micros(7));
        assert_eq!(c.effective["poll_spin_us"].1, Source::File(p));
        assert_eq!(c.join_timeout, Duration::from_millis(300_000));
        assert_eq!(c.effective["join_timeout_ms"].1, Source::Default);
        assert!(c.render().contains("op_timeout_ms"));
    }

    #[test]
    fn gpu_pacing_is_a_decimal_number_of_gb_per_second() {
        let c = Config::load(&inputs(None, &[], &[])).unwrap();
        assert_eq!(c.gpu_pacing, None, "uncapped by default");
        let c = Config::load(&inputs(None, &[("COMMD_GPU_PACING_GBPS", "12.5")], &[])).unwrap();
        assert_eq!(c.gpu_pacing, Some(12_500_000_000));
        assert!(c.render().contains("gpu_pacing_gbps"));
        let c = Config::load(&inputs(None, &[], &[("gpu_pacing_gbps", "0")])).unwrap();
        assert_eq!(c.gpu_pacing, None);
        let c = Config::load(&inputs(None, &[], &[("gpu_pacing_gbps", "0.001")])).unwrap();
        assert_eq!(c.gpu_pacing, Some(1_000_000));
        // TOML: an integer or a float.
        for (text, want) in [
            ("gpu_pacing_gbps = 40\n", 40_000_000_000),
            ("gpu_pacing_gbps = 2.5\n", 2_500_000_000),
        ] {
            let (p, _d) = tmp_toml(text);
            let c = Config::load(&inputs(Some(p), &[], &[])).unwrap();
            assert_eq!(c.gpu_pacing, Some(want), "{text}");
        }
    }

    #[test]
    fn rejects_bad_values_by_name() {
        let e = Config::load(&inputs(None, &[("COMMD_WORKERS", "zero")], &[])).unwrap_err();
        assert!(
            e.to_string().contains("workers") && e.to_string().contains("COMMD_WORKERS"),
            "{e}"
        );
        let e = Config::load(&inputs(None, &[], &[("ring_entries", "100")])).unwrap_err();
        assert!(e.to_string().contains("power of two"), "{e}");
        let e = Config::load(&inputs(None, &[], &[("nope", "1")])).unwrap_err();
        assert!(matches!(e, ConfigError::UnknownKey(_)));
        let typo = Config::load(&Inputs {
            flags: vec![("wrokers".into(), "4".into())],
            ..Inputs::default()
        })
        .unwrap_err();
        assert!(
            typo.to_string().contains("(did you mean 'workers'?)"),
            "{typo}"
        );
        let (p, _d) = tmp_toml("bogus_key = 1\n");
        assert!(matches!(
            Config::load(&inputs(Some(p), &[], &[])),
            Err(ConfigError::UnknownKey(_))
        ));
        let (p, _d) = tmp_toml("workers = [\n");
        assert!(matches!(
            Config::load(&inputs(Some(p), &[], &[])),
            Err(ConfigError::Parse { .. })
        ));
        let e =
            Config::load(&inputs(Some("/nonexistent/commd.toml".into()), &[], &[])).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }));
        let e =
            Config::load(&inputs(None, &[("COMMD_DEBUG_SUBSYS", "INIT,BOGUS")], &[])).unwrap_err();
        assert!(e.to_string().contains("BOGUS"));
        // The hardening keys refuse bad values by name too.
        for (k, v) in [
            ("peer_addr_check", "maybe"),
            ("max_sessions_per_uid", "0"),
            ("max_unique_ids_per_uid", "x"),
            ("max_comms_per_uid", "0"),
            ("max_registered_bytes_per_uid", "-1"),
            ("net_chunk_bytes", "536870912"),
        ] {
            let e = Config::load(&inputs(None, &[], &[(k, v)])).unwrap_err();
            assert!(e.to_string().contains(k), "{k}={v}: {e}");
        }
        for bad in ["-1", "NaN", "inf", "fast", "0.0001", "2e6"] {
            let e = Config::load(&inputs(None, &[("COMMD_GPU_PACING_GBPS", bad)], &[]))
                .expect_err(bad)
                .to_string();
            assert!(
                e.contains("gpu_pacing_gbps") && e.contains("COMMD_GPU_PACING_GBPS"),
                "{e}"
            );
        }
        assert!(parse_set("novalue").is_err());
        assert_eq!(parse_set("a = b").unwrap(), ("a".into(), "b".into()));
    }
}
