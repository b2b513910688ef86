//! The `NCCL_*` variables a job may set, and what commd does with each (nccl/README.md, "NCCL_*
//! variables"): the few this library honours; those whose job a daemon setting does (named in
//! the log line, since one daemon serves every job of the node); and the families that tune
//! NCCL's own kernels and transports, which commd does not have. Each variable set is reported
//! once, at the first communicator (INFO, subsystem ENV). `NCCL_ALGO` is parsed in NCCL's
//! grammar (the 2.31 one, which contains the old): a value NCCL would refuse fails
//! communicator creation with `ncclInvalidUsage`, as NCCL's init does.
//!
//! May use: `commd_settings` (it is below `log`, which prints its lines).

/// What commd does with a variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Treatment {
    /// Read by this library.
    Honoured,
    /// Its job is done by the daemon setting named (per node, not per job).
    Daemon(&'static str),
    /// Tunes something of NCCL's that commd does not have; the reason.
    Ignored(&'static str),
}

const ALGOS: &str = "commd runs its own algorithms (the daemon's plans and the direct ops), none of NCCL's; per call, a forced algSelection fails instead";
const KERNELS: &str = "it sizes NCCL's kernels and channels; commd's GPU work is sized by the daemon (`commd config`: gpu_* settings)";
const TRANSPORTS: &str = "it selects NCCL's intra-node transports; the daemon moves intra-node data itself (shared memory, CUDA IPC, copy engines: `commd topo` shows the paths)";
const NO_NVLS: &str = "commd has no NVLS (NVLink SHARP) kernels";
const NO_COLLNET: &str =
    "commd has no CollNet; in-network aggregation is the daemon's switch setting";
const PLUGINS: &str = "commd loads no NCCL plugins (net, tuner, profiler, env); its daemon has its own transports and telemetry";

/// By exact name first, then by prefix (the longest that matches).
const TABLE: &[(&str, Treatment)] = &[
    ("NCCL_DEBUG", Treatment::Honoured),
    ("NCCL_DEBUG_SUBSYS", Treatment::Honoured),
    ("NCCL_COMMD_VERSION_CODE", Treatment::Honoured),
    (
        "NCCL_DEBUG_FILE",
        Treatment::Ignored("this library logs to stderr only"),
    ),
    ("NCCL_ALGO", Treatment::Ignored(ALGOS)),
    ("NCCL_PROTO", Treatment::Ignored(ALGOS)),
    ("NCCL_SYM_KERNEL", Treatment::Ignored(ALGOS)),
    ("NCCL_TUNER_", Treatment::Ignored(PLUGINS)),
    ("NCCL_NET_PLUGIN", Treatment::Ignored(PLUGINS)),
    ("NCCL_PROFILER_PLUGIN", Treatment::Ignored(PLUGINS)),
    ("NCCL_ENV_PLUGIN", Treatment::Ignored(PLUGINS)),
    (
        "NCCL_SOCKET_IFNAME",
        Treatment::Daemon("advertise / peer_listen (the address its peer service uses)"),
    ),
    (
        "NCCL_SOCKET_FAMILY",
        Treatment::Daemon("advertise / peer_listen"),
    ),
    ("NCCL_SOCKET_NTHREADS", Treatment::Daemon("tcp_streams")),
    ("NCCL_NSOCKS_PERTHREAD", Treatment::Daemon("tcp_streams")),
    ("NCCL_IB_HCA", Treatment::Daemon("rdma_device")),
    ("NCCL_IB_GID_INDEX", Treatment::Daemon("rdma_gid")),
    (
        "NCCL_IB_QPS_PER_CONNECTION",
        Treatment::Daemon("rdma_qps_per_peer"),
    ),
    (
        "NCCL_IB_DISABLE",
        Treatment::Daemon("transport (tcp to keep RDMA off)"),
    ),
    ("NCCL_NET", Treatment::Daemon("transport")),
    (
        "NCCL_IB_",
        Treatment::Daemon("the rdma_* settings (the daemon's RDMA transport)"),
    ),
    (
        "NCCL_NET_",
        Treatment::Daemon("transport and the tcp_*/rdma_* settings"),
    ),
    ("NCCL_SOCKET_", Treatment::Daemon("the tcp_* settings")),
    (
        "NCCL_TIMEOUT",
        Treatment::Daemon(
            "op_timeout_ms (per communicator: COMMD_COMM_* / the client's op timeout)",
        ),
    ),
    ("NCCL_P2P_", Treatment::Ignored(TRANSPORTS)),
    ("NCCL_SHM_", Treatment::Ignored(TRANSPORTS)),
    ("NCCL_CUMEM_", Treatment::Ignored(TRANSPORTS)),
    ("NCCL_NVB_", Treatment::Ignored(TRANSPORTS)),
    ("NCCL_NVLS_", Treatment::Ignored(NO_NVLS)),
    ("NCCL_COLLNET_", Treatment::Ignored(NO_COLLNET)),
    ("NCCL_NTHREADS", Treatment::Ignored(KERNELS)),
    ("NCCL_MIN_NCHANNELS", Treatment::Ignored(KERNELS)),
    ("NCCL_MAX_NCHANNELS", Treatment::Ignored(KERNELS)),
    ("NCCL_MIN_CTAS", Treatment::Ignored(KERNELS)),
    ("NCCL_MAX_CTAS", Treatment::Ignored(KERNELS)),
    ("NCCL_CTA_POLICY", Treatment::Ignored(KERNELS)),
    ("NCCL_BUFFSIZE", Treatment::Ignored(KERNELS)),
    ("NCCL_LL_", Treatment::Ignored(KERNELS)),
    ("NCCL_LL128_", Treatment::Ignored(KERNELS)),
    ("NCCL_CGA_CLUSTER_SIZE", Treatment::Ignored(KERNELS)),
    (
        "NCCL_GRAPH_",
        Treatment::Ignored(
            "it tunes NCCL's CUDA-graph registration; commd's captured ops are its own (docs/contracts.md #6)",
        ),
    ),
    ("NCCL_LAUNCH_", Treatment::Ignored(KERNELS)),
    (
        "NCCL_CHECK_POINTERS",
        Treatment::Ignored("commd checks every buffer's kind and bounds on each call"),
    ),
    (
        "NCCL_ASYNC_ERROR_HANDLING",
        Treatment::Ignored(
            "torch's variable (TORCH_NCCL_ASYNC_ERROR_HANDLING) reads errors through ncclCommGetAsyncError, which commd answers",
        ),
    ),
];

/// What commd does with `name` (an `NCCL_*` variable).
pub fn treatment(name: &str) -> Treatment {
    if let Some((_, t)) = TABLE.iter().find(|(k, _)| *k == name) {
        return *t;
    }
    TABLE
        .iter()
        .filter(|(k, _)| k.ends_with('_') && name.starts_with(k))
        .max_by_key(|(k, _)| k.len())
        .map(|(_, t)| *t)
        .unwrap_or(Treatment::Ignored(
            "it tunes NCCL's own kernels or transports, which commd does not have (the daemon chooses paths and transports: `commd topo`)",
        ))
}

/// The log line for a variable set to `value`.
pub fn describe(name: &str, value: &str) -> String {
    match treatment(name) {
        Treatment::Honoured => format!("{name}={value} read"),
        Treatment::Daemon(s) => {
            format!(
                "{name}={value} not read here: the commd daemon's {s} does this for every job of the node"
            )
        }
        Treatment::Ignored(why) => format!("{name}={value} ignored: {why}"),
    }
}

const FUNCS: &[&str] = &[
    "broadcast",
    "reduce",
    "allgather",
    "reducescatter",
    "allreduce",
];
const ALGO_NAMES: &[&str] = &[
    "tree",
    "ring",
    "collnetdirect",
    "collnetchain",
    "nvls",
    "nvlstree",
    "pat",
];

/// Checks an `NCCL_ALGO` value in NCCL's grammar: `;`-separated entries, each an optional
/// `function:` prefix (all but the first need one) and a comma list of algorithm names, the list
/// negated by a leading `^`; names case-insensitive.
pub fn check_algo(value: &str) -> Result<(), String> {
    let v = value.trim();
    if v.is_empty() {
        return Ok(());
    }
    for (i, entry) in v.split(';').enumerate() {
        let entry = entry.trim();
        let list = match entry.split_once(':') {
            Some((f, rest)) => {
                let f = f.trim().to_ascii_lowercase();
                if !FUNCS.contains(&f.as_str()) {
                    return Err(format!(
                        "\"{f}\" is not a collective (one of Broadcast, Reduce, AllGather, ReduceScatter, AllReduce)"
                    ));
                }
                rest
            }
            None if i == 0 => entry,
            None => {
                return Err(format!(
                    "entry \"{entry}\" after a ';' needs a \"function:\" prefix"
                ));
            }
        };
        let list = list.trim();
        let list = list.strip_prefix('^').unwrap_or(list);
        for name in list.split(',') {
            let n = name.trim().to_ascii_lowercase();
            if !ALGO_NAMES.contains(&n.as_str()) {
                return Err(format!(
                    "\"{}\" is not an algorithm (Tree, Ring, CollNetDirect, CollNetChain, NVLS, NVLSTree, PAT)",
                    name.trim()
                ));
            }
        }
    }
    Ok(())
}

/// The checks communicator creation makes, as NCCL's init: a value NCCL refuses is refused
/// (the caller returns it as `ncclInvalidUsage`).
pub fn check_init() -> Result<(), String> {
    if let Some(v) = commd_settings::system("NCCL_ALGO").and_then(|v| v.into_string().ok())
        && let Err(why) = check_algo(&v)
    {
        return Err(format!("NCCL_ALGO={v:?} is not valid: {why}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algo_grammar_old_and_new() {
        for ok in [
            "Ring",
            "ring,tree",
            "^NVLS",
            "allreduce:tree;broadcast:ring",
            "Tree;allgather:^ring",
            " PAT ",
        ] {
            assert!(check_algo(ok).is_ok(), "{ok}");
        }
        for bad in [
            "Rings",
            "allreduce:warp",
            "tree;ring",
            "sendrecv:ring",
            "ring,",
            "^",
        ] {
            assert!(check_algo(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn every_variable_gets_a_treatment_by_name_or_family() {
        assert_eq!(treatment("NCCL_DEBUG"), Treatment::Honoured);
        assert_eq!(treatment("NCCL_IB_HCA"), Treatment::Daemon("rdma_device"));
        assert!(
            matches!(treatment("NCCL_IB_TIMEOUT"), Treatment::Daemon(s) if s.contains("rdma_"))
        );
        assert!(
            matches!(treatment("NCCL_NVLS_ENABLE"), Treatment::Ignored(s) if s.contains("NVLS"))
        );
        assert!(matches!(treatment("NCCL_WHATEVER"), Treatment::Ignored(_)));
        assert!(describe("NCCL_ALGO", "ring").contains("commd runs its own algorithms"));
    }
}
