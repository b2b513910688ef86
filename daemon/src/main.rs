//! `commd`: the per-node communication daemon and its command-line tools. Wiring only.

#![deny(unsafe_code)] // allowed only in the modules that say why

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
    Config {
        /// The environment-only settings of the clients, the NCCL library, the Python package
        /// and the daemon's GPU knobs (commd-settings' registry) as this process sees them,
        /// instead of the daemon's config.
        #[arg(long)]
        client: bool,
    },
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
            match commd_daemon::cli::bench::worker(cli.socket.clone(), uid, *rank, args) {
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
                    return ExitCode::from(status_byte(exit::USAGE));
                }
            };
            init_logging(&cfg, matches!(cli.cmd, Cmd::Serve));
            if matches!(cli.cmd, Cmd::Serve) {
                let env = commd_settings::vars_with_prefix("COMMD_")
                    .into_iter()
                    .collect();
                for w in config::unknown_env(&env) {
                    tracing::warn!(target: "commd::init", "{w}");
                }
            }
            run(&cli, cfg)
        }
    };
    ExitCode::from(status_byte(code))
}

/// `code` as the exit status the OS reports: its low 8 bits, which is what `exit(3)` passes on.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn status_byte(code: i32) -> u8 {
    code as u8
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
        Cmd::Config { client: false } => {
            print!("{}", cfg.render());
            exit::OK
        }
        Cmd::Config { client: true } => {
            let table = commd_settings::table();
            print!("{table}");
            // A value its reader refuses is an error there too: say so in the exit code.
            if table.contains("  INVALID: ") {
                exit::USAGE
            } else {
                exit::OK
            }
        }
        Cmd::Status { json } => commd_daemon::cli::stat::status(&cfg, *json)
            .unwrap_or_else(|| commd_daemon::cli::status::status(&cfg, *json)),
        Cmd::Stat { args } => commd_daemon::cli::stat::stat(&cfg, args),
        Cmd::Topo { json } => match commd_daemon::cli::topo::topo(&cfg, *json) {
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
                || commd_settings::get_os(&commd_settings::keys::SOCKET).is_some()
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
