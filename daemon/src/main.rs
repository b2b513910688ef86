//! `commd`: the per-node communication daemon and its command-line tools. Wiring only.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use commd_daemon::config::{self, Config, Inputs};
use commd_daemon::serve::exit;

#[derive(Parser)]
#[command(
    name = "commd",
    version,
    about = "Per-node communication daemon for GPU hosts"
)]
struct Cli {
    /// Config file (default: /etc/commd/commd.toml if present).
    #[arg(long, global = true, env = "COMMD_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC socket path (same as --set socket=PATH).
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    /// Set any config key, e.g. --set op_timeout_ms=5000 (repeatable). See `commd config`.
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    set: Vec<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the daemon in the foreground.
    Serve,
    /// Print every effective setting and where it came from.
    Config,
    /// Show the running daemon's sessions, communicators and registrations.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Live traffic per link (shared memory, GPU paths, peers, NICs): rates every second, totals on exit.
    Stat {
        #[command(flatten)]
        args: commd_daemon::cli::stat::StatArgs,
    },
    /// The daemon's GPUs, their peer matrix and copy engines, and the path each GPU pair uses.
    Topo {
        #[arg(long)]
        json: bool,
    },
    /// Check that the daemon serves: one line, exit 0 if healthy, 1 if not (for probes).
    Health {
        /// Give up after this many milliseconds.
        #[arg(long, default_value_t = 5000)]
        timeout_ms: u64,
    },
    /// nccl-tests style benchmark with local client processes (embedded daemon unless --socket).
    Bench {
        #[command(flatten)]
        args: commd_daemon::cli::bench::BenchArgs,
    },
    /// Run a command whose NCCL calls go to this daemon (torch's "nccl" backend, nccl-tests,
    /// vLLM's pynccl): preloads commd's libnccl.so.2 and sets VLLM_NCCL_SO_PATH and COMMD_SOCKET.
    Exec {
        /// The library (default: COMMD_NCCL_LIB, beside this binary, or PREFIX/lib/commd/).
        #[arg(long)]
        nccl_lib: Option<PathBuf>,
        /// Print the environment given to the command on stderr.
        #[arg(short, long)]
        verbose: bool,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        cmd: Vec<std::ffi::OsString>,
    },
    /// A software SwitchML switch: the controller gRPC API and the UDP aggregation data plane.
    Switch {
        #[command(flatten)]
        args: commd_daemon::cli::switch::SwitchArgs,
    },
    #[command(hide = true)]
    BenchWorker {
        #[arg(long)]
        uid: String,
        #[arg(long)]
        rank: u32,
        #[arg(long)]
        args: String,
    },
}

fn load_config(cli: &Cli) -> Result<Config, String> {
    let mut flags = Vec::new();
    if let Some(s) = &cli.socket {
        flags.push(("socket".to_string(), s.display().to_string()));
    }
    for s in &cli.set {
        flags.push(config::parse_set(s).map_err(|e| e.to_string())?);
    }
    Config::load(&Inputs::from_process(cli.config.clone(), flags)).map_err(|e| e.to_string())
}

fn init_logging(cfg: &Config, serving: bool) {
    commd_daemon::telemetry::logging::init(cfg, serving);
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let code = match &cli.cmd {
        Cmd::BenchWorker { uid, rank, args } => {
            let socket = cli
                .socket
                .clone()
                .unwrap_or_else(commd_client::resolve_socket_path);
            match commd_daemon::cli::bench::worker(socket, uid, *rank, args) {
                Ok(()) => exit::OK,
                Err(e) => {
                    eprintln!("commd bench-worker rank {rank}: {e}");
                    exit::RUNTIME
                }
            }
        }
        _ => {
            let cfg = match load_config(&cli) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("commd: {e}");
                    return ExitCode::from(exit::USAGE as u8);
                }
            };
            init_logging(&cfg, matches!(cli.cmd, Cmd::Serve));
            run(&cli, cfg)
        }
    };
    ExitCode::from(code as u8)
}

fn run(cli: &Cli, cfg: Config) -> i32 {
    match &cli.cmd {
        Cmd::Serve => match commd_daemon::serve::run(cfg, None, None) {
            Ok(()) => exit::OK,
            Err(e) => {
                eprintln!("commd: {e}");
                e.exit_code()
            }
        },
        Cmd::Config => {
            print!("{}", cfg.render());
            exit::OK
        }
        Cmd::Status { json } => {
            commd_daemon::cli::stat::status(&cfg, *json).unwrap_or_else(|| status(&cfg, *json))
        }
        Cmd::Stat { args } => commd_daemon::cli::stat::stat(&cfg, args),
        Cmd::Topo { json } => match topo(&cfg, *json) {
            exit::OK if !*json => {
                commd_daemon::cli::stat::print_links(&cfg);
                exit::OK
            }
            code => code,
        },
        Cmd::Health { timeout_ms } => {
            let timeout = std::time::Duration::from_millis(*timeout_ms);
            match commd_daemon::cli::health::check(&cfg.socket, timeout) {
                Ok(h) => {
                    println!("{h}");
                    exit::OK
                }
                Err(e) => {
                    eprintln!("commd health: {e}");
                    exit::RUNTIME
                }
            }
        }
        Cmd::Bench { args } => {
            // Explicit --socket/COMMD_SOCKET: use that daemon; otherwise embed one on a private socket.
            let explicit = cli.socket.is_some()
                || std::env::var_os("COMMD_SOCKET").is_some()
                || cli.set.iter().any(|s| s.starts_with("socket"));
            let result = if explicit {
                commd_daemon::cli::bench::run(args, Some(cfg.socket.clone()), None)
            } else {
                let dir = std::env::temp_dir().join(format!("commd-bench-{}", std::process::id()));
                let mut cfg = cfg;
                cfg.socket = dir.join("commd.sock");
                let r = commd_daemon::cli::bench::run(args, None, Some(cfg));
                let _ = std::fs::remove_dir_all(&dir);
                r
            };
            match result {
                Ok(true) => exit::OK,
                Ok(false) => {
                    eprintln!("commd bench: some results were wrong");
                    exit::RUNTIME
                }
                Err(e) => {
                    eprintln!("commd bench: {e}");
                    exit::RUNTIME
                }
            }
        }
        Cmd::Switch { args } => commd_daemon::cli::switch::main(args),
        Cmd::Exec {
            nccl_lib,
            verbose,
            cmd,
        } => match commd_daemon::exec::find_lib(nccl_lib.as_deref()) {
            Ok(lib) => commd_daemon::exec::run(&lib, &cfg.socket, cmd, *verbose),
            Err(e) => {
                eprintln!("commd exec: {e}");
                exit::USAGE
            }
        },
        Cmd::BenchWorker { .. } => exit::USAGE,
    }
}

/// The RDMA part of `commd topo`: probed by this command on this host (the same library and
/// devices the daemon uses).
fn rdma_topo(cfg: &Config) -> String {
    let choice = commd_daemon::net::rdma::GidChoice::parse(&cfg.rdma_gid)
        .unwrap_or(commd_daemon::net::rdma::GidChoice::Auto);
    let listen = cfg
        .peer_listen
        .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |a| a.ip());
    let (ip, _) = commd_daemon::peer::advertise_ip(&cfg.advertise, listen);
    commd_daemon::net::rdma::device::topo_text(&choice, ip)
}

fn topo(cfg: &Config, json: bool) -> i32 {
    // Operators run `topo` first, like `nvidia-smi topo -m`: with no daemon answering, this
    // command probes the host itself with the daemon's own code, and says so.
    let (t, source) =
        match commd_client::Client::connect(Some(&cfg.socket)).and_then(|c| c.topology()) {
            Ok(t) => (t, "daemon".to_string()),
            Err(e) => {
                let why = e.to_string();
                let why = why.split(". ").next().unwrap_or(&why).to_string();
                if !json {
                    println!("no daemon answered ({why}): probed this host directly");
                }
                // The probe a daemon runs at start (CUDA only if the config allows it).
                let _ = commd_daemon::cuda::init(cfg.cuda, cfg.gpu_scratch_slot_bytes);
                (
                    commd_daemon::cuda::topology_reply(),
                    "host probe".to_string(),
                )
            }
        };
    let uuid = commd_client::gpu::cu::uuid_string;
    if json {
        let gpus: Vec<_> = t.gpus.iter().map(|g| serde_json::json!({"ordinal": g.ordinal, "name": g.name,
            "uuid": uuid(&g.uuid), "pci_bus_id": g.pci_bus_id, "memory_bytes": g.memory_bytes,
            "copy_engines": g.copy_engines, "sm_count": g.sm_count, "compute_capability": g.compute_capability})).collect();
        let links: Vec<_> = t.links.iter().map(|l| serde_json::json!({"from": l.from, "to": l.to, "p2p": l.p2p,
            "path": l.path, "performance_rank": l.performance_rank, "native_atomics": l.native_atomics})).collect();
        // The daemon's data links (what the text lists under "Links"), when a daemon answered.
        let data_links: Vec<_> = commd_daemon::cli::stat::link_list(cfg)
            .into_iter()
            .map(|(name, kind, what)| serde_json::json!({"name": name, "kind": kind, "description": what}))
            .collect();
        let j = serde_json::json!({"source": source, "cuda_available": t.cuda_available, "cuda_reason": t.cuda_reason,
            "driver_version": t.driver_version, "gpus": gpus, "links": links, "data_links": data_links,
            "rdma": rdma_topo(cfg)});
        println!("{j}");
        return exit::OK;
    }
    if !t.cuda_available {
        let who = if source == "daemon" {
            "the daemon serves"
        } else {
            "a daemon here would serve"
        };
        println!(
            "CUDA: unavailable ({}); {who} host memory only",
            t.cuda_reason
        );
        print!("{}", rdma_topo(cfg));
        return exit::OK;
    }
    println!("CUDA driver {}, {} GPU(s)", t.driver_version, t.gpus.len());
    for g in &t.gpus {
        println!(
            "  GPU{} {} {} pci {} {} GiB sm_{} {} SMs {} copy engines",
            g.ordinal,
            g.name,
            uuid(&g.uuid),
            g.pci_bus_id,
            g.memory_bytes >> 30,
            g.compute_capability.replace('.', ""),
            g.sm_count,
            g.copy_engines
        );
    }
    if t.gpus.len() > 1 {
        print!("P2P   ");
        for g in &t.gpus {
            print!(" GPU{:<3}", g.ordinal);
        }
        println!();
        for a in &t.gpus {
            print!("GPU{:<3}", a.ordinal);
            for b in &t.gpus {
                let cell = if a.ordinal == b.ordinal {
                    "X".to_string()
                } else {
                    match t
                        .links
                        .iter()
                        .find(|l| l.from == a.ordinal && l.to == b.ordinal)
                    {
                        Some(l) if l.p2p => format!(
                            "P{}{}",
                            l.performance_rank,
                            if l.native_atomics { "a" } else { "" }
                        ),
                        Some(_) => "HOST".into(),
                        None => "?".into(),
                    }
                };
                print!(" {cell:<6}");
            }
            println!();
        }
        println!(
            "  P<n>: peer access, driver performance rank n (a: native atomics); HOST: no P2P, the driver stages copies through host memory"
        );
        for l in &t.links {
            println!("  GPU{} -> GPU{}: {}", l.from, l.to, l.path);
        }
    }
    print!("{}", rdma_topo(cfg));
    exit::OK
}

fn status(cfg: &Config, json: bool) -> i32 {
    let c = match commd_client::Client::connect(Some(&cfg.socket)) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("commd status: {e}");
            return exit::RUNTIME;
        }
    };
    let s = match c.status() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("commd status: {e}");
            return exit::RUNTIME;
        }
    };
    // Our own session is counted by the daemon; leave it out so the numbers describe others.
    let others: Vec<_> = s
        .session_list
        .iter()
        .filter(|x| x.session_id != c.session_id())
        .collect();
    if json {
        let sessions: Vec<_> = others
            .iter()
            .map(|x| serde_json::json!({"session_id": x.session_id, "uid": x.uid, "pid": x.pid, "name": x.name,
                "communicators": x.communicators, "registrations": x.registrations, "mapped_bytes": x.mapped_bytes,
                "ops_completed": x.ops_completed, "ops_failed": x.ops_failed}))
            .collect();
        let j = serde_json::json!({"daemon_version": s.daemon_version, "pid": s.pid, "uptime_ms": s.uptime_ms,
            "sessions": others.len(), "communicators": s.communicators, "registrations": s.registrations,
            "mapped_bytes": s.mapped_bytes, "ops_completed": s.ops_completed, "ops_failed": s.ops_failed,
            "pending_joins": s.pending_joins, "workers": s.workers, "session_list": sessions});
        println!("{j}");
    } else {
        println!(
            "commd {} pid {} up {:.1}s: {} sessions, {} communicators ({} forming), {} registrations ({} bytes), ops {} ok / {} failed",
            s.daemon_version,
            s.pid,
            s.uptime_ms as f64 / 1e3,
            others.len(),
            s.communicators,
            s.pending_joins,
            s.registrations,
            s.mapped_bytes,
            s.ops_completed,
            s.ops_failed
        );
        for x in others {
            println!("{}", commd_daemon::cli::stat::session_line(x));
        }
    }
    exit::OK
}
