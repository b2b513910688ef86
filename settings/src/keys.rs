//! Every environment-only setting, grouped by the side that reads it: the client library, the
//! CUDA layer, the host-wide facilities, the NCCL-compatible library, the Python package, the
//! daemon outside its config file, and the test harnesses. The daemon's config-file keys are in
//! `daemon/src/config/keys.rs`; `COMMD_SOCKET`, `COMMD_DEBUG` and `COMMD_DEBUG_SUBSYS` are also
//! keys there (the daemon's own meaning is said in their help here).
//!
//! Defaults are in the reader's words; `None` where the value is computed (the help says how)
//! or the setting is off when unset. Kinds carry the bounds and words the reader's parser
//! enforces; the reader keeps its own parser and error messages.

use crate::{Key, Kind, Reader};

// The client library (`commd-client`): every process that talks to the daemon.

pub static SOCKET: Key = Key {
    name: "COMMD_SOCKET",
    default: None,
    kind: Kind::Path,
    read_by: Reader::Client,
    help: "The daemon socket a client connects to; unset or empty: this user's default socket \
           (root: /run/commd/commd.sock, else $XDG_RUNTIME_DIR/commd/commd.sock or \
           /tmp/commd-$UID/commd.sock) if it exists, else /run/commd/commd.sock. Read at each \
           connect without an explicit socket; the daemon reads it as its `socket` key, \
           `commd bench` uses the daemon it names instead of embedding one, and `commd exec` \
           sets it for the job.",
};

pub static CLIENT_SPIN_US: Key = Key {
    name: "COMMD_CLIENT_SPIN_US",
    default: Some("50"),
    kind: Kind::U64 {
        min: 0,
        max: u64::MAX,
    },
    read_by: Reader::Client,
    help: "Microseconds a waiting client polls (yielding the core between looks) before \
           sleeping on its completion futex; a value that is not a whole number is ignored \
           (50). Read each time default client options are made (each connect without \
           options).",
};

pub static DAEMON_TIMEOUT_MS: Key = Key {
    name: "COMMD_DAEMON_TIMEOUT_MS",
    default: Some("10000"),
    kind: Kind::U64 {
        min: 0,
        max: u64::MAX,
    },
    read_by: Reader::Client,
    help: "Milliseconds a client waits while the daemon's heartbeat stands still (a daemon \
           stopped, hung or starved) before failing the op or call with DaemonLost; 0: wait \
           forever. Read at each connect, which refuses a value that is not a number of \
           milliseconds.",
};

pub static CPU_CACHE_MIB: Key = Key {
    name: "COMMD_CPU_CACHE_MIB",
    default: Some("256"),
    kind: Kind::U64 {
        min: 0,
        max: u64::MAX,
    },
    read_by: Reader::Client,
    help: "MiB of freed blocks of commd's CPU allocator (torch's and numpy's in the Python \
           package) kept for reuse by allocations of the same page count; a value that is not \
           a whole number is named on stderr and 256 kept. Read once per process, at the first \
           freed block.",
};

pub static ALLREDUCE_ALGO: Key = Key {
    name: "COMMD_ALLREDUCE_ALGO",
    default: Some("auto"),
    kind: Kind::Choice(&["auto", "oneshot", "one-shot", "one_shot", "rsag"]),
    read_by: Reader::Client,
    help: "The algorithm of a GPU all-reduce, for benchmarking, the same on every rank: auto \
           (one-shot up to COMMD_ONESHOT_MAX_BYTES), oneshot (also one-shot, one_shot; rsag \
           when the input does not fit one scratch slot) or rsag (reduce-scatter + \
           all-gather). Read once per process; an invalid value fails every GPU all-reduce.",
};

pub static ONESHOT_MAX_BYTES: Key = Key {
    name: "COMMD_ONESHOT_MAX_BYTES",
    default: Some("2097152"),
    kind: Kind::U64 {
        min: 0,
        max: u64::MAX,
    },
    read_by: Reader::Client,
    help: "With COMMD_ALLREDUCE_ALGO=auto, the largest GPU all-reduce input (bytes per rank) \
           that goes one-shot (default 2 MiB), the same on every rank. Read once per process; \
           a value that is not a number fails every GPU all-reduce.",
};

pub static GPU_FUSED_ROUNDS: Key = Key {
    name: "COMMD_GPU_FUSED_ROUNDS",
    default: Some("1"),
    kind: Kind::Choice(&["1", "on", "auto", "plain", "0", "off"]),
    read_by: Reader::Client,
    help: "How an eager GPU reduction of several rounds launches its kernels: 1 (also on, \
           auto) one cooperative launch for every round, plain the same kernel by an ordinary \
           launch (measurements), 0 (also off) one launch per round. A rank's own choice; read \
           once per process, and an invalid value fails every multi-round op.",
};

pub static GPU_FUSED_BLOCKS: Key = Key {
    name: "COMMD_GPU_FUSED_BLOCKS",
    default: Some("0"),
    kind: Kind::U64 {
        min: 0,
        max: u32::MAX as u64,
    },
    read_by: Reader::Client,
    help: "The most blocks of the fused launch of COMMD_GPU_FUSED_ROUNDS; 0: the reduction \
           kernels' cap (4 per SM). Read once per process; a value that is not a number fails \
           every multi-round op.",
};

pub static GPU_WAIT: Key = Key {
    name: "COMMD_GPU_WAIT",
    default: Some("auto"),
    kind: Kind::Choice(&["auto", "kernel", "memop"]),
    read_by: Reader::Client,
    help: "How the caller's stream waits for an op's done counter: auto uses the polling \
           kernel for ops of at least 2 MiB per rank whose daemon plan has no copy within a \
           GPU and cuStreamWaitValue32 for the rest; kernel or memop (any case) forces one \
           way. Read once per process; an invalid value fails every GPU op.",
};

pub static GRAPH_DIRECT: Key = Key {
    name: "COMMD_GRAPH_DIRECT",
    default: Some("auto"),
    kind: Kind::Choice(&["auto", "1", "on", "0", "off", "shared"]),
    read_by: Reader::Client,
    help: "Whether collectives captured in a CUDA graph run as direct ops (one kernel on the \
           peers' windows, no daemon round trip): auto (also 1, on), 0/off the daemon's path, \
           shared (tests only) also ranks that share a GPU. Read at each captured op; an \
           invalid value fails it.",
};

pub static GRAPH_DIRECT_MAX_BYTES: Key = Key {
    name: "COMMD_GRAPH_DIRECT_MAX_BYTES",
    default: None,
    kind: Kind::U64 {
        min: 0,
        max: 1 << 30,
    },
    read_by: Reader::Client,
    help: "The largest captured direct op of every kind (bytes per rank), the same on every \
           rank; unset: limits from the communicator's size (whole ops 16 MiB on 2 ranks, \
           else the power of two at most 8 MiB / (n - 1) and 4 MiB; pushes to a peer and split \
           shares have larger ones). Read at each captured op.",
};

pub static GRAPH_DIRECT_BLOCKS: Key = Key {
    name: "COMMD_GRAPH_DIRECT_BLOCKS",
    default: Some("64"),
    kind: Kind::U64 { min: 1, max: 1024 },
    read_by: Reader::Client,
    help: "Blocks of a small direct op (a large one runs on twice as many), capped at half the \
           GPU's SMs; the same on every rank. Read at each captured op, and once per process \
           for eager direct ops.",
};

pub static EAGER_DIRECT: Key = Key {
    name: "COMMD_EAGER_DIRECT",
    default: Some("auto"),
    kind: Kind::Choice(&["auto", "1", "on", "0", "off", "shared"]),
    read_by: Reader::Client,
    help: "Whether eager (uncaptured) GPU collectives run as direct ops on windows of their \
           own: auto (also 1, on), 0/off every eager op through the daemon, shared (tests \
           only) also ranks that share a GPU. Read once per process; an invalid value fails \
           every eager GPU op.",
};

pub static EAGER_DIRECT_MAX_BYTES: Key = Key {
    name: "COMMD_EAGER_DIRECT_MAX_BYTES",
    default: None,
    kind: Kind::U64 {
        min: 1,
        max: 1 << 30,
    },
    read_by: Reader::Client,
    help: "The largest eager direct op of every kind (bytes per rank), the same on every rank; \
           unset: the limits COMMD_GRAPH_DIRECT_MAX_BYTES has unset (from the communicator's \
           size). Read once per process with COMMD_EAGER_DIRECT.",
};

pub static DIRECT_SPLIT_MAX_BYTES: Key = Key {
    name: "COMMD_DIRECT_SPLIT_MAX_BYTES",
    default: None,
    kind: Kind::U64 {
        min: 0,
        max: 1 << 40,
    },
    read_by: Reader::Client,
    help: "The largest all-reduce, broadcast or reduce (bytes per rank) past the direct limit \
           that runs as direct ops (e.g. a reduce-scatter then an all-gather); unset: every one \
           whose share (1/n of it) fits the limit, i.e. up to n x the limit; 0: none. The same \
           on every rank (checked at the windows' setup); read once per process.",
};

pub static DIRECT_ONE_BLOCK_MAX_BYTES: Key = Key {
    name: "COMMD_DIRECT_ONE_BLOCK_MAX_BYTES",
    default: Some("4096"),
    kind: Kind::U64 {
        min: 0,
        max: 1 << 20,
    },
    read_by: Reader::Client,
    help: "The largest direct op (bytes per rank) that runs on one block (4096: one pass of \
           its 256 threads x 16 bytes); 0: none. A rank's own choice; read once per process.",
};

pub static DIRECT_BCAST_FORWARD_MIN_BYTES: Key = Key {
    name: "COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES",
    default: Some("2097152"),
    kind: Kind::U64 {
        min: 0,
        max: u64::MAX,
    },
    read_by: Reader::Client,
    help: "The smallest direct broadcast (bytes per rank) on 3+ ranks that runs forwarded (the \
           root pushes one part to each non-root, which forwards it to the others); default \
           2 MiB, 0: every one. The same on every rank (checked at the windows' setup); read \
           once per process.",
};

pub static DIRECT_LL_MAX_BYTES: Key = Key {
    name: "COMMD_DIRECT_LL_MAX_BYTES",
    default: Some("4096"),
    kind: Kind::U64 { min: 0, max: 4096 },
    read_by: Reader::Client,
    help: "The largest direct op (bytes per rank) that moves by LL lines (eager ops on one \
           block, not broadcast or reduce); 0: none. The same on every rank (checked at the \
           windows' setup); read once per process.",
};

pub static DIRECT_DEFER_WAIT: Key = Key {
    name: "COMMD_DIRECT_DEFER_WAIT",
    default: Some("0"),
    kind: Kind::U64 { min: 0, max: 1 },
    read_by: Reader::Client,
    help: "1, for measurements only: a rank that reads nothing of its peers in a direct op \
           ends it without waiting for their flags and waits for them at its next direct op; \
           0: off. A rank's own choice; read once per process.",
};

pub static P2P_DIRECT: Key = Key {
    name: "COMMD_P2P_DIRECT",
    default: Some("auto"),
    kind: Kind::Choice(&["auto", "1", "on", "shared", "0", "off"]),
    read_by: Reader::Client,
    help: "Whether eager GPU send/recv (the NCCL library's) run as direct ops on a channel per \
           pair: auto on (a pair that cannot keeps the daemon's path quietly), 1/on the same \
           saying why on stderr, shared also ranks sharing a GPU (tests), 0/off the daemon's \
           path; the same on every rank. Read once per process; an invalid value fails every \
           GPU send/recv.",
};

pub static P2P_DIRECT_MAX_BYTES: Key = Key {
    name: "COMMD_P2P_DIRECT_MAX_BYTES",
    default: Some("4194304"),
    kind: Kind::U64 {
        min: 1,
        max: 1 << 30,
    },
    read_by: Reader::Client,
    help: "The largest direct send/recv (bytes), the channel's slot size (default 4 MiB). Read \
           once per process with COMMD_P2P_DIRECT.",
};

pub static P2P_LL_MAX_BYTES: Key = Key {
    name: "COMMD_P2P_LL_MAX_BYTES",
    default: Some("262144"),
    kind: Kind::U64 {
        min: 0,
        max: 256 << 10,
    },
    read_by: Reader::Client,
    help: "The largest direct send/recv (bytes) sent by the LL protocol (default 256 KiB, the \
           most); 0: every message the simple way. Read once per process with \
           COMMD_P2P_DIRECT.",
};

pub static EAGER_PROFILE: Key = Key {
    name: "COMMD_EAGER_PROFILE",
    default: Some("0"),
    kind: Kind::U64 {
        min: 0,
        max: u64::MAX,
    },
    read_by: Reader::Client,
    help: "Diagnostics: every N ops wrapped by the NCCL library's API functions, print to \
           stderr the mean host time of a GPU op by phase, per thread; 0: off (a value that is \
           not a count is named on stderr once and leaves it off). Read once per process.",
};

// The CUDA layer (`commd-cuda`): clients, the NCCL library and the daemon.

pub static DISABLE_CUDA: Key = Key {
    name: "COMMD_DISABLE_CUDA",
    default: None,
    kind: Kind::Flag,
    read_by: Reader::Cuda,
    help: "Set (non-empty, not 0): the process treats CUDA as unavailable (\"disabled by \
           COMMD_DISABLE_CUDA\"), as without a driver: clients and the NCCL library degrade to \
           host memory and the daemon runs no GPU executor. Read once per process, at the first \
           driver load.",
};

// Host-wide facilities (`commd-host`): the daemon and the software switch.

pub static CPU_CLAIMS: Key = Key {
    name: "COMMD_CPU_CLAIMS",
    default: None,
    kind: Kind::Path,
    read_by: Reader::Host,
    help: "The registry file of CPU claims of polling threads (one core per live thread across \
           this user's commd processes); unset or empty: cpu-claims beside this user's default \
           socket (root: /run/commd/cpu-claims). Read at each claim or listing of the claims.",
};

// The NCCL-compatible library (`libnccl.so.2`).

pub static NCCL_DEBUG: Key = Key {
    name: "NCCL_DEBUG",
    default: None,
    kind: Kind::Str,
    read_by: Reader::Nccl,
    help: "What the NCCL library prints on stderr, as NCCL: VERSION, WARN (also WARNING, \
           ERROR), INFO (also DEBUG) or TRACE, any case; unset: COMMD_DEBUG, and unset or any \
           other word: nothing. Read once per process.",
};

pub static NCCL_DEBUG_SUBSYS: Key = Key {
    name: "NCCL_DEBUG_SUBSYS",
    default: Some("INIT,ENV"),
    kind: Kind::Str,
    read_by: Reader::Nccl,
    help: "The subsystems of the NCCL library's INFO lines: a comma list of INIT, COLL, P2P, \
           ENV or ALL (any case; unknown names ignored), ^ first to exclude them. Read once per \
           process with NCCL_DEBUG; every other NCCL_* variable set is logged once as ignored.",
};

pub static NCCL_COMMD_VERSION_CODE: Key = Key {
    name: "NCCL_COMMD_VERSION_CODE",
    default: Some("22800"),
    kind: Kind::U64 {
        min: 0,
        max: i32::MAX as u64,
    },
    read_by: Reader::Nccl,
    help: "The NCCL API version the library reports (ncclGetVersion and its version line; \
           22800: 2.28, the host API it implements); a value that is not an integer is ignored. \
           Read at each ncclGetVersion.",
};

// The Python package (`commd`, `commd.torch`, `commd.vllm`).

pub static DEBUG: Key = Key {
    name: "COMMD_DEBUG",
    default: None,
    kind: Kind::Str,
    read_by: Reader::Python,
    help: "In the job: under INFO (also DEBUG, TRACE; any case) each torch backend prints its \
           communicator and the daemon's paths at creation, and the NCCL library uses it when \
           NCCL_DEBUG is unset (VERSION, WARN, INFO, TRACE); unset or another word: quiet. Read \
           at each process group's creation (Python) or once per process (NCCL library); the \
           daemon reads it as its `debug` key (ERROR, WARN, INFO, DEBUG, TRACE; default WARN).",
};

pub static DEBUG_SUBSYS: Key = Key {
    name: "COMMD_DEBUG_SUBSYS",
    default: Some("ALL"),
    kind: Kind::Str,
    read_by: Reader::Python,
    help: "In the job: the torch backend's COMMD_DEBUG=INFO lines print unless this comma list \
           (any case, ^ first to exclude) leaves out INIT; unset or ALL: they print. Read at \
           each process group's creation; the daemon reads it as its `debug_subsys` key.",
};

pub static COMM_SWITCH: Key = Key {
    name: "COMMD_COMM_SWITCH",
    default: None,
    kind: Kind::Str,
    read_by: Reader::Python,
    help: "The inter-node step of all-reduce for communicators of the torch backend: off, or \
           HOST:PORT of a SwitchML controller; unset or empty: the daemon's `switch` setting \
           (Options.switch wins). Read at each process group's creation.",
};

pub static COMM_PACING_GBPS: Key = Key {
    name: "COMMD_COMM_PACING_GBPS",
    default: None,
    kind: Kind::Str,
    read_by: Reader::Python,
    help: "The cap on the daemon's GPU copies for each torch backend's communicator, a decimal \
           number of GB/s (0: uncapped); unset or empty: the daemon's `gpu_pacing_gbps` \
           (Options.pacing_gbps wins). Read at each process group's creation; a value that is \
           not a number fails it.",
};

pub static CPU_ALLOC: Key = Key {
    name: "COMMD_CPU_ALLOC",
    default: Some("1"),
    kind: Kind::Flag,
    read_by: Reader::Python,
    help: "0, off, false or no (any case): connect() does not make commd's allocator numpy's, \
           nor the torch backend torch's CPU allocator; unset, empty or another value: they do. \
           Read at each new session (connect) and each backend creation.",
};

pub static CPU_ALLOC_MIN: Key = Key {
    name: "COMMD_CPU_ALLOC_MIN",
    default: Some("1M"),
    kind: Kind::Str,
    read_by: Reader::Python,
    help: "The smallest allocation commd's numpy or torch CPU allocator serves: bytes, with an \
           optional K, M or G (binary; 0 counts as 1); a value that is not a byte count or is \
           negative fails the call. Read at each use_numpy_allocator or use_cpu_allocator call \
           without min_bytes.",
};

pub static TORCH_EXT: Key = Key {
    name: "COMMD_TORCH_EXT",
    default: Some("1"),
    kind: Kind::Flag,
    read_by: Reader::Python,
    help: "0, off, false or no (any case): commd.torch neither builds nor loads its C++ c10d \
           shell and hands torch its Python backend (with torch's limits on those); anything \
           else: it does. Read once per process, at the first load of the shell.",
};

pub static VLLM: Key = Key {
    name: "COMMD_VLLM",
    default: None,
    kind: Kind::Choice(&["1", "on", "true", "yes", "0", "off", "false", "no"]),
    read_by: Reader::Python,
    help: "1 (also on, true, yes; any case): commd's vLLM platform plugin names commd's CUDA \
           platform, so vLLM's collectives run through the daemon; unset, empty, 0, off, false \
           or no: vLLM's own; another value is an error. Read when vLLM's plugin loader asks, \
           in every vLLM process.",
};

// The daemon binary, outside its config file.

pub static CONFIG: Key = Key {
    name: "COMMD_CONFIG",
    default: None,
    kind: Kind::Path,
    read_by: Reader::Daemon,
    help: "The daemon's config file, as --config (which wins); unset: /etc/commd/commd.toml if \
           present. Read by clap at each `commd` command line.",
};

pub static NCCL_LIB: Key = Key {
    name: "COMMD_NCCL_LIB",
    default: None,
    kind: Kind::Path,
    read_by: Reader::Daemon,
    help: "The NCCL-compatible library `commd exec` preloads, after --nccl-lib; unset or empty: \
           libcommd_nccl.so beside the commd binary, then PREFIX/lib/commd/. Read at each \
           `commd exec`.",
};

pub static GPU_ISSUE_THREADS: Key = Key {
    name: "COMMD_GPU_ISSUE_THREADS",
    default: Some("1"),
    kind: Kind::Flag,
    read_by: Reader::Daemon,
    help: "0, for measurements: the daemon's GPU executor issues every copy itself instead of \
           on one copy-issuing thread per further GPU; only 0 turns them off. Read once, when \
           the daemon probes its GPUs at start.",
};

pub static GPU_BCAST_CHAIN: Key = Key {
    name: "COMMD_GPU_BCAST_CHAIN",
    default: Some("1"),
    kind: Kind::Choice(&["0", "1", "all"]),
    read_by: Reader::Daemon,
    help: "When a GPU broadcast of at least 32 MiB on 3+ ranks is a pipelined chain instead of \
           the root's pushes: 1 when every rank has a GPU of its own, 0 never, all in every \
           layout (tests); another value warns and means 1. Read once per daemon process, at \
           the first broadcast plan.",
};

// Test harnesses only (the Rust unit tests).

pub static REQUIRE_NVRTC: Key = Key {
    name: "COMMD_REQUIRE_NVRTC",
    default: None,
    kind: Kind::Flag,
    read_by: Reader::Tests,
    help: "Exactly 1: commd-cuda's kernel tests fail instead of skipping when NVRTC is missing \
           (scripts/nvrtc-env.sh sets it). Read by each such test.",
};

pub static REQUIRE_GPU: Key = Key {
    name: "COMMD_REQUIRE_GPU",
    default: None,
    kind: Kind::Flag,
    read_by: Reader::Tests,
    help: "Exactly 1: commd-cuda's GPU kernel test fails instead of skipping when CUDA or NVRTC \
           is unavailable. Read by that test.",
};

pub static BLESS_HEADER: Key = Key {
    name: "COMMD_BLESS_HEADER",
    default: None,
    kind: Kind::Flag,
    read_by: Reader::Tests,
    help: "Set (any value, even empty or 0): commd-c's header_is_current test writes the \
           header cbindgen generates to client-cpp/include/commd.h instead of comparing them. \
           Read by that test.",
};

/// Every setting, in the order of the groups above.
pub static KEYS: &[&Key] = &[
    &SOCKET,
    &CLIENT_SPIN_US,
    &DAEMON_TIMEOUT_MS,
    &CPU_CACHE_MIB,
    &ALLREDUCE_ALGO,
    &ONESHOT_MAX_BYTES,
    &GPU_FUSED_ROUNDS,
    &GPU_FUSED_BLOCKS,
    &GPU_WAIT,
    &GRAPH_DIRECT,
    &GRAPH_DIRECT_MAX_BYTES,
    &GRAPH_DIRECT_BLOCKS,
    &EAGER_DIRECT,
    &EAGER_DIRECT_MAX_BYTES,
    &DIRECT_SPLIT_MAX_BYTES,
    &DIRECT_ONE_BLOCK_MAX_BYTES,
    &DIRECT_BCAST_FORWARD_MIN_BYTES,
    &DIRECT_LL_MAX_BYTES,
    &DIRECT_DEFER_WAIT,
    &P2P_DIRECT,
    &P2P_DIRECT_MAX_BYTES,
    &P2P_LL_MAX_BYTES,
    &EAGER_PROFILE,
    &DISABLE_CUDA,
    &CPU_CLAIMS,
    &NCCL_DEBUG,
    &NCCL_DEBUG_SUBSYS,
    &NCCL_COMMD_VERSION_CODE,
    &DEBUG,
    &DEBUG_SUBSYS,
    &COMM_SWITCH,
    &COMM_PACING_GBPS,
    &CPU_ALLOC,
    &CPU_ALLOC_MIN,
    &TORCH_EXT,
    &VLLM,
    &CONFIG,
    &NCCL_LIB,
    &GPU_ISSUE_THREADS,
    &GPU_BCAST_CHAIN,
    &REQUIRE_NVRTC,
    &REQUIRE_GPU,
    &BLESS_HEADER,
];
