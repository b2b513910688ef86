//! Every daemon setting in one typed registry: name, `COMMD_*` variable, TOML key, default,
//! description. Precedence: flags (`--set key=value` and the dedicated flags) > environment >
//! TOML file (`--config`, else `/etc/commd/commd.toml` if present) > defaults. Unknown keys and
//! invalid values are rejected by name. `commd config` prints each value and where it came from.
//!
//! This module only reads and validates; it starts nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;

pub const DEFAULT_CONFIG_PATH: &str = "/etc/commd/commd.toml";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Path,
    /// Unsigned integer within `[min, max]`.
    U64 {
        min: u64,
        max: u64,
    },
    /// Finite decimal number within `[min, max]` (TOML integers and floats both parse).
    F64 {
        min: f64,
        max: f64,
    },
    Str,
}

#[derive(Debug)]
pub struct Key {
    pub name: &'static str,
    pub env: &'static str,
    /// `None` means "computed at start" (see `Config::default_for`).
    pub default: Option<&'static str>,
    pub help: &'static str,
    kind: Kind,
}

/// The registry. Keep it sorted by subsystem; every key documented.
pub static KEYS: &[Key] = &[
    Key {
        name: "socket",
        env: "COMMD_SOCKET",
        default: None,
        help: "gRPC Unix socket path (root: /run/commd/commd.sock, else $XDG_RUNTIME_DIR/commd/commd.sock or /tmp/commd-$UID/commd.sock)",
        kind: Kind::Path,
    },
    Key {
        name: "op_timeout_ms",
        env: "COMMD_OP_TIMEOUT_MS",
        default: Some("600000"),
        help: "per-op timeout: an op some ranks never posted fails after this long, naming those ranks",
        kind: Kind::U64 {
            min: 1,
            max: 86_400_000,
        },
    },
    Key {
        name: "join_timeout_ms",
        env: "COMMD_JOIN_TIMEOUT_MS",
        default: Some("300000"),
        help: "how long CreateCommunicator waits for the other ranks to join",
        kind: Kind::U64 {
            min: 1,
            max: 86_400_000,
        },
    },
    Key {
        name: "attach_timeout_ms",
        env: "COMMD_ATTACH_TIMEOUT_MS",
        default: Some("10000"),
        help: "a session that does not attach to the fd socket within this long after Hello is closed",
        kind: Kind::U64 {
            min: 1,
            max: 3_600_000,
        },
    },
    Key {
        name: "liveness_interval_ms",
        env: "COMMD_LIVENESS_INTERVAL_MS",
        default: Some("500"),
        help: "how often session processes are checked for liveness (a closed fd socket is seen at once; this catches a dead process whose socket a forked child still holds)",
        kind: Kind::U64 {
            min: 10,
            max: 60_000,
        },
    },
    Key {
        name: "workers",
        env: "COMMD_WORKERS",
        default: None,
        help: "data-plane threads used to split one large host-memory op (default: CPU count)",
        kind: Kind::U64 { min: 1, max: 1024 },
    },
    Key {
        name: "poll_spin_us",
        env: "COMMD_POLL_SPIN_US",
        default: Some("50"),
        help: "how long a ring poller keeps polling an empty ring (yielding the core between looks) before sleeping on its futex",
        kind: Kind::U64 {
            min: 0,
            max: 1_000_000,
        },
    },
    Key {
        name: "cuda",
        env: "COMMD_CUDA",
        default: Some("1"),
        help: "1: serve GPU memory through CUDA when libcuda and a GPU are present (else host memory only, with the reason logged); 0: never load CUDA",
        kind: Kind::U64 { min: 0, max: 1 },
    },
    Key {
        name: "gpu_scratch_slot_bytes",
        env: "COMMD_GPU_SCRATCH_SLOT_BYTES",
        default: Some("67108864"),
        help: "GPU reductions: device scratch per peer and round for each rank of a communicator (the daemon allocates two buffers of (nranks-1) slots per rank on first use: 384 MiB per rank on 4 GPUs at the default); larger ops run in rounds. 64 MiB: on 4x H200, 16 MiB slots gave 0.82x NCCL's all-reduce busbw at 512 MiB, 64 MiB slots 1.00x (docs/benchmarks.md)",
        kind: Kind::U64 {
            min: 65536,
            max: 1 << 34,
        },
    },
    Key {
        name: "gpu_pacing_gbps",
        env: "COMMD_GPU_PACING_GBPS",
        default: Some("0"),
        help: "default cap on the bandwidth of each new communicator's GPU copies on this node, in GB/s (1e9 bytes/s; decimals allowed; at least 0.001), so background collectives leave room for compute; 0: uncapped. A communicator can set its own at creation and change it at run time (SetCommPacing); host-memory ops are not paced",
        kind: Kind::F64 { min: 0.0, max: 1e6 },
    },
    Key {
        name: "ring_entries",
        env: "COMMD_RING_ENTRIES",
        default: Some("1024"),
        help: "default submission/completion ring size per session (power of two)",
        kind: Kind::U64 { min: 1, max: 65536 },
    },
    Key {
        name: "max_sessions",
        env: "COMMD_MAX_SESSIONS",
        default: Some("4096"),
        help: "sessions (client processes) served at once; Hello beyond this is refused",
        kind: Kind::U64 {
            min: 1,
            max: 1_000_000,
        },
    },
    Key {
        name: "max_sessions_per_uid",
        env: "COMMD_MAX_SESSIONS_PER_UID",
        default: Some("1024"),
        help: "sessions one uid may hold at once (so one user cannot lock the others out); Hello beyond this is refused naming the uid",
        kind: Kind::U64 {
            min: 1,
            max: 1_000_000,
        },
    },
    Key {
        name: "max_unique_ids_per_uid",
        env: "COMMD_MAX_UNIQUE_IDS_PER_UID",
        default: Some("4096"),
        help: "unused unique ids one uid may hold; beyond this each new id drops that uid's oldest unused one (ids are single-use and expire after 24 h)",
        kind: Kind::U64 {
            min: 1,
            max: 1_000_000,
        },
    },
    Key {
        name: "max_registered_bytes_per_uid",
        env: "COMMD_MAX_REGISTERED_BYTES_PER_UID",
        default: Some("0"),
        help: "host memory all sessions of one uid may register in total (0: the host's physical memory); beyond it RegisterMemory is refused naming the uid",
        kind: Kind::U64 {
            min: 0,
            max: u64::MAX,
        },
    },
    Key {
        name: "max_comms_per_uid",
        env: "COMMD_MAX_COMMS_PER_UID",
        default: Some("65536"),
        help: "communicator memberships all sessions of one uid may hold at once; a join beyond it is refused naming the uid",
        kind: Kind::U64 {
            min: 1,
            max: 100_000_000,
        },
    },
    Key {
        name: "max_registered_bytes",
        env: "COMMD_MAX_REGISTERED_BYTES",
        default: Some("1099511627776"),
        help: "host memory one session may register in total",
        kind: Kind::U64 {
            min: 4096,
            max: u64::MAX,
        },
    },
    Key {
        name: "peer_listen",
        env: "COMMD_PEER_LISTEN",
        default: Some("off"),
        help: "address of the peer service (gRPC over TCP, multi-node rendezvous), e.g. 10.0.0.1:7400 (the IP other nodes reach; 0.0.0.0 for every interface), or 'off' (the default: nothing listens on the network and communicators stay on this node); port 0 picks a free port. An address that cannot be bound stops the daemon. Trust model: docs/multinode.md",
        kind: Kind::Str,
    },
    Key {
        name: "peer_addr_check",
        env: "COMMD_PEER_ADDR_CHECK",
        default: Some("on"),
        help: "on: the root daemon refuses a join whose announced node or data address is not the IP the join came from (a token holder cannot make this daemon's peers dial an address of its choosing); off: accept them (NAT or a node whose peer and data traffic leave from different IPs)",
        kind: Kind::Str,
    },
    Key {
        name: "advertise",
        env: "COMMD_ADVERTISE",
        default: Some(""),
        help: "the IP (or IP:port) other daemons reach this one at; empty: the listen IP, or when that is 0.0.0.0 the IP of the interface holding the default route (Kubernetes passes status.hostIP here)",
        kind: Kind::Str,
    },
    Key {
        name: "peer_tls_cert",
        env: "COMMD_PEER_TLS_CERT",
        default: Some(""),
        help: "mutual TLS for the peer service: this daemon's certificate (PEM; with peer_tls_key and peer_tls_ca, all three or none). Its SAN must hold the advertised IP. Empty: plain TCP",
        kind: Kind::Str,
    },
    Key {
        name: "peer_tls_key",
        env: "COMMD_PEER_TLS_KEY",
        default: Some(""),
        help: "mutual TLS: the private key of peer_tls_cert (PEM)",
        kind: Kind::Str,
    },
    Key {
        name: "peer_tls_ca",
        env: "COMMD_PEER_TLS_CA",
        default: Some(""),
        help: "mutual TLS: the CA (PEM) that signs every daemon's certificate; peers without one are refused",
        kind: Kind::Str,
    },
    Key {
        name: "data_port",
        env: "COMMD_DATA_PORT",
        default: Some("0"),
        help: "TCP port of the inter-node data listener on the advertised IP (0: any free port; it is exchanged during rendezvous)",
        kind: Kind::U64 { min: 0, max: 65535 },
    },
    Key {
        name: "tcp_streams",
        env: "COMMD_TCP_STREAMS",
        default: Some("2"),
        help: "parallel TCP connections per peer node and direction for each multi-node communicator (more streams: more bandwidth on fast NICs)",
        kind: Kind::U64 { min: 1, max: 16 },
    },
    Key {
        name: "peer_timeout_ms",
        env: "COMMD_PEER_TIMEOUT_MS",
        default: Some("5000"),
        help: "a peer node that sends nothing (not even its 1 s heartbeat) for this long is declared lost: its communicators fail naming it",
        kind: Kind::U64 {
            min: 100,
            max: 3_600_000,
        },
    },
    Key {
        name: "net_chunk_bytes",
        env: "COMMD_NET_CHUNK_BYTES",
        default: Some("1048576"),
        help: "inter-node pipelining unit: messages are cut into chunks of this size, spread over the streams",
        kind: Kind::U64 {
            min: 4096,
            max: crate::net::wire::MAX_CHUNK_BYTES as u64,
        },
    },
    Key {
        name: "net_small_bytes",
        env: "COMMD_NET_SMALL_BYTES",
        default: Some("65536"),
        help: "reductions of at most this many bytes per rank use the one-shot (low-latency) inter-node algorithm, larger ones the pipelined chain",
        kind: Kind::U64 {
            min: 0,
            max: 1 << 40,
        },
    },
    Key {
        name: "net_algo",
        env: "COMMD_NET_ALGO",
        default: Some("auto"),
        help: "inter-node reduction algorithm: auto (by net_small_bytes), oneshot or chain (for benchmarking)",
        kind: Kind::Str,
    },
    Key {
        name: "switch",
        env: "COMMD_SWITCH",
        default: Some("off"),
        help: "SwitchML controller (HOST:PORT, e.g. a `commd switch` or a Tofino's controller on port 50099) for the inter-node step of int32/float32 sum all-reduces, or 'off'. A communicator can override it at creation. Falls back to TCP, with the reason logged, when the switch is unreachable or the job does not fit",
        kind: Kind::Str,
    },
    Key {
        name: "switch_bind",
        env: "COMMD_SWITCH_BIND",
        default: Some(""),
        help: "IPv4 this node's switch workers send from (registered with the controller); empty: the advertised IP",
        kind: Kind::Str,
    },
    Key {
        name: "switch_threads",
        env: "COMMD_SWITCH_THREADS",
        default: Some("1"),
        help: "data-plane threads per switch session (each on its own UDP port, each pinned to a core no other polling thread on the host holds)",
        kind: Kind::U64 { min: 1, max: 16 },
    },
    Key {
        name: "switch_window",
        env: "COMMD_SWITCH_WINDOW",
        default: Some("256"),
        help: "outstanding packets (switch slots) per data-plane thread",
        kind: Kind::U64 { min: 1, max: 4096 },
    },
    Key {
        name: "switch_packet_bytes",
        env: "COMMD_SWITCH_PACKET_BYTES",
        default: Some("1024"),
        help: "value payload per packet: 256 (64 values, the standard pipe) or 1024 (256 values, the folded pipe)",
        kind: Kind::U64 {
            min: 256,
            max: 1024,
        },
    },
    Key {
        name: "switch_timeout_ms",
        env: "COMMD_SWITCH_TIMEOUT_MS",
        default: Some("10"),
        help: "smallest retransmission timeout of a switch packet: the timeout follows the measured round trip (smoothed RTT + 4 deviations) but never goes below this; doubled after every 100 timeouts, as SwitchML's client",
        kind: Kind::U64 {
            min: 1,
            max: 10_000,
        },
    },
    Key {
        name: "switch_pin",
        env: "COMMD_SWITCH_PIN",
        default: Some("auto"),
        help: "pin switch data-plane threads to free cores (auto) or not (off); a core is never given to two polling threads on the host",
        kind: Kind::Str,
    },
    Key {
        name: "transport",
        env: "COMMD_TRANSPORT",
        default: Some("auto"),
        help: "inter-node transport: auto (RDMA verbs between two nodes that both have a usable RDMA device, else TCP, with the reason logged), tcp, or rdma (a node pair without RDMA fails its communicators with the reason)",
        kind: Kind::Str,
    },
    Key {
        name: "rdma_device",
        env: "COMMD_RDMA_DEVICE",
        default: Some(""),
        help: "RDMA device (and optional port) to use, e.g. mlx5_0 or mlx5_0:1; several separated by commas are striped over; empty: every device with an active port",
        kind: Kind::Str,
    },
    Key {
        name: "rdma_gid",
        env: "COMMD_RDMA_GID",
        default: Some(""),
        help: "GID to use, as a table index (e.g. 3) or an address (e.g. ::ffff:10.0.0.1 or fe80::...); empty: the RoCE v2 GID of the advertised IP (IB: index 0)",
        kind: Kind::Str,
    },
    Key {
        name: "rdma_qps_per_peer",
        env: "COMMD_RDMA_QPS_PER_PEER",
        default: Some("2"),
        help: "RC queue pairs per peer node and direction for each multi-node communicator (spread over the devices)",
        kind: Kind::U64 { min: 1, max: 16 },
    },
    Key {
        name: "rdma_buffer_bytes",
        env: "COMMD_RDMA_BUFFER_BYTES",
        default: Some("4194304"),
        help: "registered staging ring per queue pair and direction (pooled and reused across communicators)",
        kind: Kind::U64 {
            min: 65536,
            max: 1 << 30,
        },
    },
    Key {
        name: "debug",
        env: "COMMD_DEBUG",
        default: Some("WARN"),
        help: "log level: ERROR, WARN, INFO, DEBUG or TRACE",
        kind: Kind::Str,
    },
    Key {
        name: "debug_subsys",
        env: "COMMD_DEBUG_SUBSYS",
        default: Some("ALL"),
        help: "comma-separated subsystems to log: INIT, CTRL, SESSION, COMM, ENGINE, NET, BENCH, CUDA, TELEMETRY, SWITCH, RDMA, or ALL",
        kind: Kind::Str,
    },
    // Observability (telemetry module; docs/observability.md).
    Key {
        name: "log_format",
        env: "COMMD_LOG_FORMAT",
        default: Some("text"),
        help: "log line format on stderr: text, or json (one object per line)",
        kind: Kind::Str,
    },
    Key {
        name: "metrics_listen",
        env: "COMMD_METRICS_LISTEN",
        default: Some("127.0.0.1:9464"),
        help: "TCP address (IP:PORT) serving Prometheus /metrics, or off",
        kind: Kind::Str,
    },
    Key {
        name: "metrics_per_job",
        env: "COMMD_METRICS_PER_JOB",
        default: Some("off"),
        help: "on: ring and pacing series per session and communicator (labels session, pid, comm, unique_id: new series with every job); off: the same figures summed, bounded labels",
        kind: Kind::Str,
    },
    Key {
        name: "otlp_endpoint",
        env: "COMMD_OTLP_ENDPOINT",
        default: Some(""),
        help: "OpenTelemetry collector URL (http://HOST:PORT) for trace export; empty: no export",
        kind: Kind::Str,
    },
    Key {
        name: "otlp_protocol",
        env: "COMMD_OTLP_PROTOCOL",
        default: Some("http/protobuf"),
        help: "OTLP protocol: http/protobuf or http/json (collector port 4318), or grpc (port 4317)",
        kind: Kind::Str,
    },
    Key {
        name: "otlp_sample_ratio",
        env: "COMMD_OTLP_SAMPLE_RATIO",
        default: Some("1"),
        help: "fraction of op traces exported (0..1); sessions and communicator init are always kept",
        kind: Kind::Str,
    },
];

pub const SUBSYSTEMS: &[&str] = &[
    "INIT",
    "CTRL",
    "SESSION",
    "COMM",
    "ENGINE",
    "NET",
    "BENCH",
    "CUDA",
    "TELEMETRY",
    "SWITCH",
    "RDMA",
];

#[derive(Debug, Error)]
pub enum ConfigError {
    #[error("unknown config key '{0}' (see `commd config` for the list)")]
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
    /// `None`: no peer service (single-node daemon).
    pub peer_listen: Option<std::net::SocketAddr>,
    /// Whether `peer_listen` was set explicitly (a bind failure is then fatal).
    pub peer_listen_explicit: bool,
    /// Joins must announce addresses of the IP they come from (`peer_addr_check`).
    pub peer_addr_check: bool,
    pub advertise: String,
    /// (cert, key, ca) paths when mutual TLS is configured.
    pub peer_tls: Option<(PathBuf, PathBuf, PathBuf)>,
    pub data_port: u16,
    pub tcp_streams: usize,
    pub peer_timeout: Duration,
    pub net_chunk_bytes: u64,
    pub net_small_bytes: u64,
    pub net_algo: String,
    pub switch: crate::switch::Settings,
    /// `auto`, `tcp` or `rdma`.
    pub transport: String,
    pub rdma_device: String,
    pub rdma_gid: String,
    pub rdma_qps_per_peer: usize,
    pub rdma_buffer_bytes: u64,
    pub debug: String,
    pub debug_subsys: Vec<String>,
    pub telemetry: crate::telemetry::Settings,
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
        let env = std::env::vars()
            .filter(|(k, _)| k.starts_with("COMMD_"))
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
            "peer_addr_check" => match value {
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
            "switch" => crate::switch::check_controller(value).map_err(bad),
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
            "rdma_gid" => crate::net::rdma::GidChoice::parse(value)
                .map(|_| ())
                .map_err(bad),
            other => crate::telemetry::validate_key(other, value).map_err(bad),
        },
    }
}

/// A cap in GB/s (1e9 bytes/s; 0: uncapped) as a pacing rate in bytes/s.
fn gbps_to_rate(gbps: f64) -> Result<Option<u64>, String> {
    // `as` saturates; the registry bounds keep the product far below u64::MAX anyway.
    crate::pacing::check_rate((gbps * 1e9).round() as u64).map_err(|_| {
        format!(
            "a nonzero cap must be at least {} GB/s (0 means uncapped)",
            crate::pacing::gbps_text(crate::pacing::MIN_RATE)
        )
    })
}

/// The host's physical memory in bytes (u64::MAX when it cannot be read).
fn physical_memory() -> u64 {
    // SAFETY: sysconf only reads system constants.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if pages <= 0 || size <= 0 {
        return u64::MAX;
    }
    (pages as u64).saturating_mul(size as u64)
}

/// The default socket path for the current user (shared with clients).
pub fn default_socket() -> PathBuf {
    commd_client::default_socket_path()
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
            let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read {
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
        let ms = |n: &str| u(n).map(Duration::from_millis);
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
            workers: u("workers")? as usize,
            cuda: u("cuda")? == 1,
            gpu_scratch_slot_bytes: u("gpu_scratch_slot_bytes")? / 256 * 256,
            gpu_pacing: gbps("gpu_pacing_gbps")?,
            poll_spin: Duration::from_micros(u("poll_spin_us")?),
            ring_entries: u("ring_entries")? as u32,
            max_sessions: u("max_sessions")? as usize,
            max_sessions_per_uid: u("max_sessions_per_uid")? as usize,
            max_unique_ids_per_uid: u("max_unique_ids_per_uid")? as usize,
            max_registered_bytes_per_uid: match u("max_registered_bytes_per_uid")? {
                0 => physical_memory(),
                n => n,
            },
            max_comms_per_uid: u("max_comms_per_uid")? as usize,
            max_registered_bytes: u("max_registered_bytes")?,
            peer_listen: if s("peer_listen").eq_ignore_ascii_case("off") {
                None
            } else {
                s("peer_listen").parse().ok()
            },
            peer_listen_explicit: eff["peer_listen"].1 != Source::Default,
            peer_addr_check: s("peer_addr_check") == "on",
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
            data_port: u("data_port")? as u16,
            tcp_streams: u("tcp_streams")? as usize,
            peer_timeout: ms("peer_timeout_ms")?,
            net_chunk_bytes: u("net_chunk_bytes")?,
            net_small_bytes: u("net_small_bytes")?,
            net_algo: s("net_algo"),
            switch: crate::switch::Settings {
                controller: s("switch"),
                bind: s("switch_bind"),
                threads: u("switch_threads")? as usize,
                window: u("switch_window")? as usize,
                packet_bytes: u("switch_packet_bytes")? as usize,
                timeout: ms("switch_timeout_ms")?,
                pin: s("switch_pin") != "off",
            },
            transport: s("transport"),
            rdma_device: s("rdma_device"),
            rdma_gid: s("rdma_gid"),
            rdma_qps_per_peer: u("rdma_qps_per_peer")? as usize,
            rdma_buffer_bytes: u("rdma_buffer_bytes")?,
            debug: s("debug").to_ascii_uppercase(),
            debug_subsys: s("debug_subsys")
                .split(',')
                .map(|x| x.trim().to_ascii_uppercase())
                .collect(),
            telemetry: crate::telemetry::Settings::from_values(s),
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
            out.push_str(&format!(
                "{:<22} = {:<40} # {} [{}; {}]\n",
                k.name, v, k.help, src, k.env
            ));
        }
        out
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
    /// The docs list the same subsystems as the code (they drifted once).
    #[test]
    fn documented_subsystems_are_the_real_ones() {
        let docs = [
            ("README.md", include_str!("../../README.md")),
            (
                "docs/observability.md",
                include_str!("../../docs/observability.md"),
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
            ("gpu_pacing_gbps = 40\n", 40e9),
            ("gpu_pacing_gbps = 2.5\n", 2.5e9),
        ] {
            let (p, _d) = tmp_toml(text);
            let c = Config::load(&inputs(Some(p), &[], &[])).unwrap();
            assert_eq!(c.gpu_pacing, Some(want as u64), "{text}");
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
        // The keys of the hardening review (issue 30) refuse bad values by name too.
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
