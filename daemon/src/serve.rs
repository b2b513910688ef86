//! `commd serve`: wiring only. Takes the socket lock, binds the gRPC and fd sockets, starts the
//! fd-socket and housekeeping threads and the tokio runtime for the control plane, and on
//! SIGTERM/SIGINT fails in-flight ops with a clear error and exits 0.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use thiserror::Error;
use tokio::sync::oneshot;

use crate::config::Config;
use crate::control::LocalService;
use crate::daemon::Daemon;

/// The stop reason of a daemon embedded in another process (`commd bench`) that the embedder
/// stopped: its normal end, logged at INFO.
const STOPPED_BY_EMBEDDER: &str = "stopped by its embedding process";

pub use crate::exit;

#[derive(Debug, Error)]
pub enum ServeError {
    #[error(
        "another commd (pid {pid}) already serves {socket}; stop it first or pass a different --socket"
    )]
    SocketBusy { socket: PathBuf, pid: String },
    #[error("cannot set up socket {path}: {err}")]
    Setup { path: PathBuf, err: std::io::Error },
    #[error("control plane failed: {0}")]
    Runtime(String),
    #[error(
        "transport=rdma, but this node cannot use RDMA: {0} (use transport=auto to fall back to TCP)"
    )]
    Rdma(String),
}

impl ServeError {
    pub fn exit_code(&self) -> i32 {
        match self {
            ServeError::SocketBusy { .. } => exit::SOCKET_BUSY,
            ServeError::Setup { .. } => exit::SOCKET_SETUP,
            ServeError::Runtime(_) => exit::RUNTIME,
            ServeError::Rdma(_) => exit::NO_TRANSPORT,
        }
    }
}

fn lock_path(socket: &Path) -> PathBuf {
    let mut s = socket.as_os_str().to_owned();
    s.push(".lock");
    PathBuf::from(s)
}

/// Holds the exclusive lock on `<socket>.lock` for the daemon's life.
struct SocketLock {
    _file: File,
    paths: Vec<PathBuf>,
}

impl Drop for SocketLock {
    fn drop(&mut self) {
        for p in &self.paths {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn take_lock(cfg: &Config) -> Result<SocketLock, ServeError> {
    let socket = &cfg.socket;
    let setup = |err| ServeError::Setup {
        path: socket.clone(),
        err,
    };
    // The socket's directory is made if missing and checked either way (commd_host::private): the
    // lock file is rewritten below, so no other user may be able to plant a link to it.
    // Root's /run/commd is reachable by every local user (calls are authorized by peer
    // credentials); a user daemon's directory is private to that user.
    let mode = if rustix::process::geteuid().is_root() {
        0o755
    } else {
        0o700
    };
    if let Some(dir) = socket.parent().filter(|d| !d.as_os_str().is_empty()) {
        commd_host::private::open_dir(dir, Some(mode)).map_err(|e| setup(e.into()))?;
    }
    let lp = lock_path(socket);
    let mut f = commd_host::private::open_file(&lp, commd_host::private::Access::ReadWrite(0o644))
        .map_err(|e| setup(e.into()))?;
    if rustix::fs::flock(&f, rustix::fs::FlockOperation::NonBlockingLockExclusive).is_err() {
        let mut pid = String::new();
        let _ = f.read_to_string(&mut pid);
        return Err(ServeError::SocketBusy {
            socket: socket.clone(),
            pid: pid.trim().to_string(),
        });
    }
    f.set_len(0).map_err(setup)?;
    f.rewind().map_err(setup)?;
    write!(f, "{}", std::process::id()).map_err(setup)?;
    Ok(SocketLock {
        _file: f,
        paths: vec![socket.clone(), cfg.fd_socket(), lp],
    })
}

/// A running daemon: its state and the trigger that stops it.
pub struct Running {
    pub daemon: Arc<Daemon>,
    stop: Option<oneshot::Sender<&'static str>>,
    thread: Option<std::thread::JoinHandle<Result<(), ServeError>>>,
}

impl Running {
    /// Stops the daemon as SIGTERM would, and waits for it.
    pub fn stop(mut self) -> Result<(), ServeError> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), ServeError> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(STOPPED_BY_EMBEDDER);
        }
        match self.thread.take() {
            Some(t) => t.join().unwrap_or_else(|_| {
                Err(ServeError::Runtime("control-plane thread panicked".into()))
            }),
            None => Ok(()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// Starts a daemon in background threads of this process (for `commd bench` and tests).
pub fn start(cfg: Config) -> Result<Running, ServeError> {
    let (stop_tx, stop_rx) = oneshot::channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("commd-control".into())
        .spawn(move || run(cfg, Some(stop_rx), Some(ready_tx)))
        .map_err(|e| ServeError::Runtime(e.to_string()))?;
    match ready_rx.recv() {
        Ok(daemon) => Ok(Running {
            daemon,
            stop: Some(stop_tx),
            thread: Some(thread),
        }),
        Err(_) => Err(thread
            .join()
            .unwrap_or_else(|_| Err(ServeError::Runtime("panicked".into())))
            .err()
            .unwrap_or_else(|| ServeError::Runtime("daemon exited during start".into()))),
    }
}

/// Serves until SIGTERM/SIGINT (or `stop` fires). Blocks.
pub fn run(
    cfg: Config,
    stop: Option<oneshot::Receiver<&'static str>>,
    ready: Option<std::sync::mpsc::Sender<Arc<Daemon>>>,
) -> Result<(), ServeError> {
    // Only a daemon that is this process's main job tells the service manager it is ready;
    // embedded ones (`commd bench`, tests) pass a stop trigger and stay quiet.
    let notifier = if stop.is_none() {
        crate::notify::Notifier::from_env_or_warn()
    } else {
        None
    };
    let lock = take_lock(&cfg)?;
    let (std_listener, fd_listener) = bind_sockets(&cfg)?;

    let daemon = Daemon::new(cfg.clone());
    let peer_listener = start_net(&daemon)?;
    spawn_threads(&daemon, fd_listener)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("commd-ctl")
        .enable_all()
        .build()
        .map_err(|e| ServeError::Runtime(e.to_string()))?;
    let listeners = Listeners {
        control: std_listener,
        peer: peer_listener,
    };
    let result = rt.block_on(serve(&daemon, &notifier, stop, ready, listeners));
    rt.shutdown_timeout(Duration::from_millis(200));
    crate::telemetry::shutdown();
    drop(lock);
    result
}

/// Binds the control (gRPC) socket and the fd socket, open to whom may call this daemon.
fn bind_sockets(cfg: &Config) -> Result<(std::os::unix::net::UnixListener, OwnedFd), ServeError> {
    let setup = |path: &Path| {
        let path = path.to_path_buf();
        move |err| ServeError::Setup { path, err }
    };
    let _ = std::fs::remove_file(&cfg.socket);
    let std_listener =
        std::os::unix::net::UnixListener::bind(&cfg.socket).map_err(setup(&cfg.socket))?;
    std_listener
        .set_nonblocking(true)
        .map_err(setup(&cfg.socket))?;
    let fd_listener =
        commd_proto::fdproto::listen(&cfg.fd_socket()).map_err(setup(&cfg.fd_socket()))?;
    let mode = if rustix::process::geteuid().is_root() {
        0o666
    } else {
        0o600
    };
    for p in [&cfg.socket, &cfg.fd_socket()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).map_err(setup(p))?;
    }
    Ok((std_listener, fd_listener))
}

/// The fd-socket accept thread and the housekeeping timer.
fn spawn_threads(daemon: &Arc<Daemon>, fd_listener: OwnedFd) -> Result<(), ServeError> {
    let d = daemon.clone();
    std::thread::Builder::new()
        .name("commd-fd-accept".into())
        .spawn(move || crate::fdsock::serve(d, fd_listener))
        .map_err(|e| ServeError::Runtime(e.to_string()))?;
    let d = daemon.clone();
    std::thread::Builder::new()
        .name("commd-timer".into())
        .spawn(move || housekeeping(d))
        .map_err(|e| ServeError::Runtime(e.to_string()))?;
    Ok(())
}

/// The one line a serving daemon prints at the default log level (target `commd::ready`):
/// where clients, Prometheus and peers reach it.
fn log_ready(daemon: &Daemon, peers: Option<std::net::SocketAddr>) {
    let metrics = crate::telemetry::metrics_addr()
        .map_or_else(|| "off".to_string(), |a| format!("http://{a}/metrics"));
    let peers = peers.map_or_else(
        || "off (single-node communicators only)".to_string(),
        |a| a.to_string(),
    );
    tracing::info!(target: "commd::ready", "commd {} ready: socket {}, metrics {metrics}, peers {peers}",
        commd_proto::VERSION, daemon.cfg.socket.display());
}

/// The bound listeners the control runtime serves: the control socket and, unless
/// `peer_listen=off`, the peer service's.
struct Listeners {
    control: std::os::unix::net::UnixListener,
    peer: Option<std::net::TcpListener>,
}

/// The control plane, inside the tokio runtime: the local and admin services, the peer
/// service, the stop task and the watchdog; returns once the server ended (or, shutting down,
/// did not end in time).
async fn serve(
    daemon: &Arc<Daemon>,
    notifier: &Option<crate::notify::Notifier>,
    stop: Option<oneshot::Receiver<&'static str>>,
    ready: Option<std::sync::mpsc::Sender<Arc<Daemon>>>,
    listeners: Listeners,
) -> Result<(), ServeError> {
    let listener = tokio::net::UnixListener::from_std(listeners.control)
        .map_err(|e| ServeError::Runtime(e.to_string()))?;
    let incoming = crate::accept::Incoming::new(listener, daemon.cfg.max_connections_per_uid);
    let svc = commd_proto::pb::local_server::LocalServer::new(LocalService {
        daemon: daemon.clone(),
    });
    let admin = commd_proto::pb::admin_server::AdminServer::new(crate::admin::AdminService::new(
        daemon.clone(),
    ));
    crate::report::start(daemon);
    // A daemon that is this process's main job (`commd serve`) says it is ready at the default
    // log level; embedded ones (`commd bench`, tests) pass a stop trigger and stay quiet.
    let main_job = stop.is_none();
    let peer_addr = listeners.peer.as_ref().and_then(|l| l.local_addr().ok());
    let sig_rx = spawn_stop(daemon, notifier, stop);
    tracing::info!(target: "commd::init", socket = %daemon.cfg.socket.display(), workers = daemon.cfg.workers, "commd {} serving", commd_proto::VERSION);
    if let Some(r) = ready {
        let _ = r.send(daemon.clone());
    }
    if let Some(l) = listeners.peer {
        spawn_peer_service(daemon, l)?;
    }
    let server = tonic::transport::Server::builder()
        .add_service(svc)
        .add_service(admin)
        .serve_with_incoming_shutdown(incoming, async {
            let _ = sig_rx.await;
            // Let clients read their failed completions before the sockets go away.
            tokio::time::sleep(Duration::from_millis(200)).await;
        });
    // Graceful shutdown waits for open RPCs; do not let a stuck one hold the exit.
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    let server = async move {
        let r = server.await;
        let _ = done_tx.send(true);
        r
    };
    let srv = tokio::spawn(server);
    // Both sockets are bound and listening and the server task runs: clients can connect.
    if main_job {
        log_ready(daemon, peer_addr);
    }
    if let Some(n) = notifier {
        n.ready(&format!("serving {}", daemon.cfg.socket.display()));
        if let Some(every) = crate::notify::watchdog_interval() {
            spawn_watchdog(n, daemon, every);
        }
    }
    wait_for_server(daemon, done_rx, srv).await
}

/// The task that waits for SIGTERM/SIGINT (or the embedder's stop), tells the service manager,
/// and shuts the daemon down; the receiver fires with the reason once it has.
fn spawn_stop(
    daemon: &Arc<Daemon>,
    notifier: &Option<crate::notify::Notifier>,
    stop: Option<oneshot::Receiver<&'static str>>,
) -> oneshot::Receiver<&'static str> {
    let (sig_tx, sig_rx) = oneshot::channel::<&'static str>();
    let d = daemon.clone();
    let n = notifier.clone();
    tokio::spawn(async move {
        let reason = wait_for_stop(stop).await;
        if let Some(n) = &n {
            n.stopping(&format!("shutting down: {reason}; failing in-flight ops"));
        }
        if reason == STOPPED_BY_EMBEDDER {
            // The normal end of an embedded daemon (`commd bench`): not a warning.
            tracing::info!(target: "commd::init", "shutting down: {reason}");
        } else {
            tracing::warn!(target: "commd::init", "shutting down: {reason}");
        }
        d.shutdown(reason);
        let _ = sig_tx.send(reason);
    });
    sig_rx
}

/// Serves the peer service (mutual TLS when configured) on `l` until the daemon shuts down.
fn spawn_peer_service(daemon: &Arc<Daemon>, l: std::net::TcpListener) -> Result<(), ServeError> {
    let l = tokio::net::TcpListener::from_std(l).map_err(|e| ServeError::Runtime(e.to_string()))?;
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(l);
    let svc = commd_proto::pb::peer_server::PeerServer::new(crate::peer::PeerService {
        daemon: daemon.clone(),
    });
    let d = daemon.clone();
    let mut builder = tonic::transport::Server::builder();
    if let Some(t) = daemon.net().and_then(|n| n.tls.clone()) {
        use tonic::transport::{Certificate, Identity, ServerTlsConfig};
        let c = ServerTlsConfig::new()
            .identity(Identity::from_pem(&t.cert, &t.key))
            .client_ca_root(Certificate::from_pem(&t.ca));
        builder = builder
            .tls_config(c)
            .map_err(|e| ServeError::Runtime(format!("peer TLS configuration: {e}")))?;
        tracing::info!(target: "commd::init", "peer service requires mutual TLS");
    }
    tokio::spawn(async move {
        let r = builder
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, async move {
                while !d.is_shutting_down() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            })
            .await;
        if let Err(e) = r {
            tracing::error!(target: "commd::net", "peer service failed: {e}");
        }
    });
    Ok(())
}

/// WatchdogSec=: a ping only while the control runtime runs (this task) and the daemon's
/// tables answer within the interval (a deadlocked daemon stops pinging and systemd restarts
/// it).
fn spawn_watchdog(n: &crate::notify::Notifier, daemon: &Arc<Daemon>, every: Duration) {
    let (n, d) = (n.clone(), daemon.clone());
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            if d.is_shutting_down() {
                break;
            }
            let probe = d.clone();
            let answered =
                tokio::time::timeout(every, tokio::task::spawn_blocking(move || probe.counts()))
                    .await;
            if matches!(answered, Ok(Ok(_))) && !d.is_shutting_down() {
                n.watchdog();
            } else {
                tracing::warn!(target: "commd::init", "watchdog: the daemon's state did not answer within {every:?}; no WATCHDOG=1 sent");
            }
        }
    });
}

/// Waits for the server task to end, or, once the daemon shuts down, at most 2 s more; the
/// server's own error if it ended with one.
async fn wait_for_server(
    daemon: &Daemon,
    mut done_rx: tokio::sync::watch::Receiver<bool>,
    srv: tokio::task::JoinHandle<Result<(), tonic::transport::Error>>,
) -> Result<(), ServeError> {
    loop {
        if *done_rx.borrow() {
            break;
        }
        if daemon.is_shutting_down() {
            let _ = tokio::time::timeout(Duration::from_secs(2), done_rx.changed()).await;
            break;
        }
        let _ = tokio::time::timeout(Duration::from_millis(100), done_rx.changed()).await;
    }
    if srv.is_finished() {
        match srv.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ServeError::Runtime(e.to_string())),
            Err(e) => Err(ServeError::Runtime(e.to_string())),
        }
    } else {
        Ok(())
    }
}

/// Binds the peer service and the data listener (unless `peer_listen=off`) and gives the daemon
/// its network context. A busy default port leaves a single-node daemon (with a warning); an
/// explicitly configured address that cannot be bound is an error.
fn start_net(daemon: &Arc<Daemon>) -> Result<Option<std::net::TcpListener>, ServeError> {
    let cfg = &daemon.cfg;
    let Some(listen) = cfg.peer_listen else {
        tracing::info!(target: "commd::init", "peer service off (peer_listen=off, the default): single-node communicators only; set peer_listen=IP:7400 to join communicators across nodes");
        return Ok(None);
    };
    let setup = |err: std::io::Error| ServeError::Setup {
        path: PathBuf::from(format!("tcp://{listen}")),
        err,
    };
    let l = match std::net::TcpListener::bind(listen) {
        Ok(l) => l,
        Err(e) if !cfg.peer_listen_explicit => {
            tracing::warn!(target: "commd::init", "peer service not started: cannot bind the default {listen} ({e}); this daemon serves single-node communicators only (set peer_listen to use another address)");
            return Ok(None);
        }
        Err(e) => return Err(setup(e)),
    };
    l.set_nonblocking(true).map_err(setup)?;
    let bound = l.local_addr().map_err(setup)?;
    let tls = match &cfg.peer_tls {
        None => None,
        Some((c, k, a)) => {
            let read = |p: &PathBuf| {
                crate::config::read_trusted(p).map_err(|err| ServeError::Setup {
                    path: p.clone(),
                    err,
                })
            };
            Some(crate::net::PeerTls {
                cert: read(c)?,
                key: read(k)?,
                ca: read(a)?,
            })
        }
    };
    let (ip, port) = crate::peer::advertise_ip(&cfg.advertise, bound.ip());
    let node = std::net::SocketAddr::new(ip, port.unwrap_or(bound.port())).to_string();
    let data = crate::net::conn::DataPlane::start(bound.ip(), cfg.data_port, ip).map_err(setup)?;
    let algo = match cfg.net_algo.as_str() {
        "oneshot" => crate::net::algo::Algo::OneShot,
        "chain" => crate::net::algo::Algo::Chain,
        _ => crate::net::algo::Algo::Auto,
    };
    tracing::info!(target: "commd::init", "peer service on {bound}, node id {node}, data listener {} ({} TCP stream(s) per peer)", data.addr, cfg.tcp_streams);
    let rdma = match cfg.transport.as_str() {
        "tcp" => Err("transport=tcp".to_string()),
        _ => crate::net::rdma::RdmaCtx::open(&crate::net::rdma::Settings {
            devices: &cfg.rdma_device,
            gid: &cfg.rdma_gid,
            qps_per_peer: cfg.rdma_qps_per_peer,
            ring_bytes: cfg.rdma_buffer_bytes,
            advertise: ip,
        }),
    };
    match &rdma {
        Ok(r) => crate::net::rdma::set_summary(
            if cfg.transport == "rdma" {
                "RDMA"
            } else {
                "RDMA/TCP"
            },
            format!(
                "RDMA ({}) to nodes that have it too (transport={}), else pooled TCP streams; the network thread logs each pair's choice",
                r.desc, cfg.transport
            ),
        ),
        Err(why) => crate::net::rdma::set_summary(
            "TCP",
            format!("pooled TCP streams between the daemons (no RDMA here: {why})"),
        ),
    }
    match (&rdma, cfg.transport.as_str()) {
        (Ok(r), _) => {
            tracing::info!(target: "commd::init", "RDMA transport: {} ({} QP(s) per peer and direction)", r.desc, r.qps_per_peer)
        }
        (Err(why), "rdma") => {
            return Err(ServeError::Rdma(why.clone()));
        }
        (Err(why), "tcp") => {
            tracing::info!(target: "commd::init", "RDMA transport off ({why}): inter-node data goes over TCP")
        }
        (Err(why), _) => {
            tracing::info!(target: "commd::init", "RDMA transport unavailable, falling back to TCP: {why}")
        }
    }
    daemon.set_net(Arc::new(crate::net::NetCtx {
        node,
        data,
        streams: cfg.tcp_streams,
        peer_timeout: cfg.peer_timeout,
        tls,
        switch: cfg.switch.clone(),
        switch_ip: match ip {
            std::net::IpAddr::V4(a) if !a.is_unspecified() => Some(a),
            _ => None,
        },
        transport: cfg.transport.clone(),
        rdma,
        tuning: crate::net::algo::Tuning {
            chunk: cfg.net_chunk_bytes,
            small: cfg.net_small_bytes,
            algo,
            workers: cfg.workers,
        },
    }));
    Ok(Some(l))
}

async fn wait_for_stop(stop: Option<oneshot::Receiver<&'static str>>) -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    let embedded = async {
        match stop {
            Some(rx) => rx.await.unwrap_or("embedding process dropped the daemon"),
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = async { match term.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => "SIGTERM",
        _ = async { match int.as_mut() { Some(s) => { s.recv().await; } None => std::future::pending().await } } => "SIGINT",
        r = embedded => r,
    }
}

fn housekeeping(d: Arc<Daemon>) {
    let mut last_liveness = Instant::now();
    let mut last_beat = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(20));
        if d.is_shutting_down() {
            return;
        }
        // Every session's heartbeat word (ring CTRL_DAEMON_BEAT), from this thread rather than
        // only from the session's poller: a poller may run a long host op itself for many
        // seconds, and its clients must not take that for a stopped daemon.
        if last_beat.elapsed() >= Duration::from_millis(100) {
            last_beat = Instant::now();
            for s in d.sessions() {
                s.ring
                    .daemon_beat()
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
        let live = last_liveness.elapsed() >= d.cfg.liveness_interval;
        if live {
            last_liveness = Instant::now();
            crate::telemetry::ratelimit::flush();
        }
        d.tick(live);
    }
}
