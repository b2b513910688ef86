//! The registry of every setting: name, `COMMD_*` variable, default, description and the kind
//! of value it takes. Adding a setting starts here (then its typed field in `Config`).
//!
//! May use: `settings` (bounds it shares with the modules that use the values), std.

use super::settings::MAX_CHUNK_BYTES;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kind {
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
    pub(super) kind: Kind,
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
        help: "host memory all sessions of one uid may register in total (0: half of the host's physical memory); beyond it RegisterMemory is refused naming the uid. A share, not all of it: registered pages stay mapped in the daemon until the session ends, and the daemon is shielded from the OOM killer (OOMScoreAdjust), so the killer would pick other users' jobs",
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
        name: "max_registrations",
        env: "COMMD_MAX_REGISTRATIONS",
        default: Some("0"),
        help: "memory registrations (host memfds and GPU allocations) the daemon holds at once, for all users (0: vm.max_map_count less a reserve of max(8192, 1/8) maps for sessions, threads and CUDA); each host registration is one memory map of the daemon, and past vm.max_map_count every new session of every user would fail",
        kind: Kind::U64 {
            min: 0,
            max: 100_000_000,
        },
    },
    Key {
        name: "max_registrations_per_uid",
        env: "COMMD_MAX_REGISTRATIONS_PER_UID",
        default: Some("0"),
        help: "memory registrations all sessions of one uid may hold at once (0: a quarter of max_registrations); beyond it RegisterMemory is refused naming the uid",
        kind: Kind::U64 {
            min: 0,
            max: 100_000_000,
        },
    },
    Key {
        name: "max_staged_fds",
        env: "COMMD_MAX_STAGED_FDS",
        default: Some("0"),
        help: "fds sent on the fd socket and not yet registered, for all users (0: a quarter of the daemon's fd limit, RLIMIT_NOFILE, which the daemon raises to its hard limit, after a reserve of max(256, 1/8))",
        kind: Kind::U64 {
            min: 0,
            max: 100_000_000,
        },
    },
    Key {
        name: "max_staged_fds_per_uid",
        env: "COMMD_MAX_STAGED_FDS_PER_UID",
        default: Some("0"),
        help: "fds all sessions of one uid may have staged and not registered (0: a quarter of max_staged_fds, at least 16); each session holds at most 256",
        kind: Kind::U64 {
            min: 0,
            max: 100_000_000,
        },
    },
    Key {
        name: "staged_fd_timeout_ms",
        env: "COMMD_STAGED_FD_TIMEOUT_MS",
        default: Some("30000"),
        help: "a staged fd not registered within this time is closed (a client registers right after staging)",
        kind: Kind::U64 {
            min: 100,
            max: 86_400_000,
        },
    },
    Key {
        name: "max_connections_per_uid",
        env: "COMMD_MAX_CONNECTIONS_PER_UID",
        default: Some("0"),
        help: "control-socket (gRPC) connections one uid may hold open (0: an eighth of the daemon's fd limit after its reserve); more are closed at accept, with a rate-limited WARN",
        kind: Kind::U64 {
            min: 0,
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
        name: "cuda_ipc_owner_check",
        env: "COMMD_CUDA_IPC_OWNER_CHECK",
        default: Some("on"),
        help: "on: the daemon opens a legacy CUDA IPC handle only for a session whose own process exported it and holds that GPU's device open, i.e. one that could open it itself (a handle copied from another process is refused, naming it); legacy handles are refused outright on a driver whose handles do not say their exporter. off: any handle a session sends is opened, for nodes where every local user is trusted. cuMem memory (fd export) is checked by the kernel either way",
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
            max: MAX_CHUNK_BYTES as u64,
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
