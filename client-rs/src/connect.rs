//! Opening a session: the hello on the control plane, the attach on the fd socket, and the
//! shared rings mapped from the daemon.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::AsFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use commd_proto::fdproto::{self, FdMsg, kind};
use commd_proto::pb;
use commd_proto::pb::local_client::LocalClient;
use commd_proto::ring::Ring;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::options::daemon_timeout_env;
use crate::{Beat, Client, CqState, Error, Inner, Options, Result, gpu, resolve_socket_path};

impl Client {
    /// Connects to the daemon at `socket` (or [`resolve_socket_path`]).
    pub fn connect(socket: Option<&Path>) -> Result<Self> {
        Self::connect_with(socket, Options::default())
    }

    pub fn connect_with(socket: Option<&Path>, opts: Options) -> Result<Self> {
        daemon_timeout_env().map_err(Error::InvalidArgument)?;
        let path = socket
            .map(Path::to_path_buf)
            .unwrap_or_else(resolve_socket_path);
        let unavailable = |reason: String| Error::DaemonUnavailable {
            path: path.clone(),
            reason,
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let channel = uds_channel(&rt, &path).map_err(unavailable)?;
        let mut rpc = LocalClient::new(channel).max_decoding_message_size(16 << 20);
        let hello = pb::HelloRequest {
            client_version: commd_proto::VERSION.to_string(),
            name: opts.name.clone(),
            sq_entries: opts.ring_entries,
            cq_entries: opts.ring_entries,
        };
        // A stopped (SIGSTOP) or hung daemon still has its connections accepted by the
        // kernel: the hello and the attach reply are bounded by COMMD_DAEMON_TIMEOUT_MS, as
        // every later wait on the daemon is.
        let limit = opts.daemon_timeout;
        let stalled = |what: &str| {
            unavailable(format!(
                "the daemon took the connection but did not answer {what} within {} ms \
                 (COMMD_DAEMON_TIMEOUT_MS): is it stopped (SIGSTOP) or hung?",
                limit.unwrap_or_default().as_millis()
            ))
        };
        let reply = rt
            .block_on(async {
                let call = rpc.hello(hello);
                match limit {
                    Some(t) => tokio::time::timeout(t, call).await.ok(),
                    None => Some(call.await),
                }
            })
            .ok_or_else(|| stalled("its hello"))?
            .map_err(|s| match s.code() {
                tonic::Code::Unavailable | tonic::Code::Unknown => {
                    unavailable(s.message().to_string())
                }
                _ => Error::rpc("hello", s),
            })?;
        let reply = reply.into_inner();
        let fd_sock = fdproto::connect(Path::new(&reply.fd_socket))
            .map_err(|e| unavailable(format!("fd socket {}: {e}", reply.fd_socket)))?;
        let mut secret = [0u8; 16];
        if reply.attach_secret.len() != 16 {
            return Err(unavailable("daemon sent a malformed attach secret".into()));
        }
        secret.copy_from_slice(&reply.attach_secret);
        let attach = FdMsg {
            kind: kind::ATTACH,
            session_id: reply.session_id,
            secret,
            ..Default::default()
        };
        let io = |e: std::io::Error| unavailable(format!("attaching the session: {e}"));
        fdproto::send(fd_sock.as_fd(), &attach, None).map_err(io)?;
        rustix::net::sockopt::set_socket_timeout(
            &fd_sock,
            rustix::net::sockopt::Timeout::Recv,
            limit,
        )
        .map_err(|e| io(e.into()))?;
        let got = match fdproto::recv(fd_sock.as_fd()) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                return Err(stalled("the attach of the session"));
            }
            other => other.map_err(io)?,
        };
        // Later reads on the socket wait as long as they need (the heartbeat bounds them).
        rustix::net::sockopt::set_socket_timeout(
            &fd_sock,
            rustix::net::sockopt::Timeout::Recv,
            None,
        )
        .map_err(|e| io(e.into()))?;
        let ring_fd = match got {
            Some((m, Some(fd))) if m.kind == kind::ATTACH_OK => fd,
            Some((m, _)) if m.kind == kind::ERROR => {
                return Err(unavailable(format!("attach refused: {}", m.text)));
            }
            Some(_) => return Err(unavailable("unexpected reply to attach".into())),
            None => {
                return Err(unavailable(
                    "daemon closed the fd socket during attach".into(),
                ));
            }
        };
        let ring = Ring::attach(&File::from(ring_fd))?;
        let l = ring.layout();
        let beat = Beat {
            value: ring.daemon_beat().load(Ordering::Relaxed),
            changed: Instant::now(),
        };
        let fd_sock_ctl = fd_sock.try_clone().ok();
        let inner = Inner {
            rt,
            rpc,
            session_id: reply.session_id,
            socket: path,
            fd_sock: Mutex::new(fd_sock),
            limit: l.sq_entries.min(l.cq_entries),
            ring,
            sq_tail: Mutex::new(0),
            cq: Mutex::new(CqState {
                head: 0,
                done: HashMap::new(),
                abandoned: HashSet::new(),
            }),
            next_user_data: AtomicU64::new(1),
            next_token: AtomicU64::new(1),
            inflight: AtomicU32::new(0),
            spin: opts.spin,
            daemon_timeout: opts.daemon_timeout,
            beat: Mutex::new(beat),
            abandoned: AtomicBool::new(false),
            abandoned_why: Mutex::new(String::new()),
            watchdog: std::sync::Once::new(),
            fd_sock_ctl,
            pid: std::process::id(),
            gpu: Mutex::new(gpu::SessionGpu::default()),
            graphs_used: AtomicBool::new(false),
        };
        Ok(Self {
            inner: Arc::new(inner),
        })
    }
}

/// A gRPC channel to the daemon's Unix socket `path`, connected on `rt` (the daemon's CLI uses
/// it for the admin service too). The error text includes every cause.
pub fn uds_channel(
    rt: &tokio::runtime::Runtime,
    path: &Path,
) -> std::result::Result<Channel, String> {
    let p = path.to_path_buf();
    rt.block_on(async move {
        // The URI is required by the API but unused: the connector dials the Unix socket.
        Endpoint::try_from("http://commd.invalid")?
            .connect_with_connector(tower::service_fn(move |_: Uri| {
                let p = p.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(p).await?,
                    ))
                }
            }))
            .await
    })
    .map_err(|e| source_chain(&e))
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let t = c.to_string();
        // Wrappers often repeat their source's text; say each thing once.
        if !s.ends_with(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        cur = c.source();
    }
    s
}
