//! The local gRPC service (tonic, over the Unix socket). Thin: authenticate the caller by
//! SO_PEERCRED, call into [`Daemon`], map errors to gRPC statuses. Nothing on the data path
//! awaits anything here.

use std::sync::Arc;
use std::time::{Duration, Instant};

use commd_proto::pb::{self, local_server::Local};
use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Response, Status};

use crate::daemon::{Daemon, DaemonError};

pub struct LocalService {
    pub daemon: Arc<Daemon>,
}

impl From<DaemonError> for Status {
    fn from(e: DaemonError) -> Self {
        let m = e.to_string();
        match e {
            DaemonError::InvalidArgument(_) => Status::invalid_argument(m),
            DaemonError::NotFound(_) => Status::not_found(m),
            DaemonError::PermissionDenied(_) => Status::permission_denied(m),
            DaemonError::AlreadyExists(_) => Status::already_exists(m),
            DaemonError::ResourceExhausted(_) => Status::resource_exhausted(m),
            DaemonError::DeadlineExceeded(_) => Status::deadline_exceeded(m),
            DaemonError::Unavailable(_) => Status::unavailable(m),
            DaemonError::Internal(_) => Status::internal(m),
        }
    }
}

/// The caller's (uid, pid) from the Unix socket's peer credentials.
fn caller<T>(req: &Request<T>) -> Result<(u32, i32), Status> {
    let cred = req
        .extensions()
        .get::<UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .ok_or_else(|| Status::unauthenticated("no peer credentials on this connection"))?;
    Ok((cred.uid(), cred.pid().unwrap_or(0)))
}

impl LocalService {
    fn session<T>(
        &self,
        req: &Request<T>,
        id: u64,
    ) -> Result<Arc<crate::session::Session>, Status> {
        let (uid, pid) = caller(req)?;
        Ok(self.daemon.session_for(id, uid, pid)?)
    }
}

fn check_version(client: &str) -> Result<(), Status> {
    let major = |v: &str| v.split('.').next().unwrap_or("").to_string();
    let minor = |v: &str| v.split('.').nth(1).unwrap_or("").to_string();
    let ours = commd_proto::VERSION;
    // 0.x: minor versions are breaking, as in semver.
    let compatible =
        major(client) == major(ours) && (major(ours) != "0" || minor(client) == minor(ours));
    if compatible {
        Ok(())
    } else {
        Err(Status::failed_precondition(format!(
            "client version {client} is incompatible with daemon version {ours}"
        )))
    }
}

#[tonic::async_trait]
impl Local for LocalService {
    async fn hello(
        &self,
        req: Request<pb::HelloRequest>,
    ) -> Result<Response<pb::HelloReply>, Status> {
        let (uid, pid) = caller(&req)?;
        let r = req.into_inner();
        check_version(&r.client_version)?;
        let s = self
            .daemon
            .hello(uid, pid, r.name, r.sq_entries, r.cq_entries)?;
        Ok(Response::new(pb::HelloReply {
            session_id: s.id,
            attach_secret: s.secret.to_vec(),
            fd_socket: self.daemon.cfg.fd_socket().display().to_string(),
            daemon_version: commd_proto::VERSION.to_string(),
            ring_abi_version: commd_proto::ring::RING_ABI_VERSION,
            attach_deadline_ms: u32::try_from(self.daemon.cfg.attach_timeout.as_millis())
                .unwrap_or(u32::MAX),
        }))
    }

    async fn goodbye(&self, req: Request<pb::SessionRef>) -> Result<Response<pb::Empty>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let d = self.daemon.clone();
        // Closing unmaps every registration of the session: time grows with the memory, so off
        // the async runtime like every call whose cost the client controls.
        tokio::task::spawn_blocking(move || {
            d.close_session(
                s.id,
                commd_proto::desc::status::PEER_LOST,
                "client said goodbye",
            )
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn get_unique_id(
        &self,
        req: Request<pb::SessionRef>,
    ) -> Result<Response<pb::UniqueIdReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        Ok(Response::new(pb::UniqueIdReply {
            unique_id: self.daemon.unique_id(s.uid).encode(),
        }))
    }

    async fn create_communicator(
        &self,
        req: Request<pb::CreateCommunicatorRequest>,
    ) -> Result<Response<pb::CreateCommunicatorReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let r = req.into_inner();
        check_comm_name(&r.name)?;
        let opts = crate::daemon::JoinOpts {
            op_timeout: (r.op_timeout_ms > 0).then(|| Duration::from_millis(r.op_timeout_ms)),
            pacing: self.daemon.resolve_pacing(r.pacing_bytes_per_sec)?,
        };
        let wait = if r.join_timeout_ms > 0 {
            Duration::from_millis(r.join_timeout_ms)
        } else {
            self.daemon.cfg.join_timeout
        };
        let t0 = Instant::now();
        self.daemon.note_switch(&r.unique_id, &r.switch)?;
        let rx = self
            .daemon
            .join(s, &r.unique_id, r.rank, r.nranks, opts, wait)?;
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(Ok(joined))) => Ok(Response::new(self.created(joined, &r.name, r.rank))),
            Ok(Ok(Err(e))) => Err(e.into()),
            Ok(Err(_)) => Err(Status::unavailable("daemon is shutting down")),
            Err(_) => Err(Status::deadline_exceeded(self.daemon.join_timed_out(
                &r.unique_id,
                r.rank,
                t0.elapsed(),
            ))),
        }
    }

    async fn shrink_communicator(
        &self,
        req: Request<pb::ShrinkCommunicatorRequest>,
    ) -> Result<Response<pb::ShrinkCommunicatorReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let r = req.into_inner();
        check_comm_name(&r.name)?;
        let wait = if r.join_timeout_ms > 0 {
            Duration::from_millis(r.join_timeout_ms)
        } else {
            self.daemon.cfg.join_timeout
        };
        let a = crate::daemon::ShrinkArgs {
            exclude: r.exclude,
            abort: r.abort,
            op_timeout: (r.op_timeout_ms > 0).then(|| Duration::from_millis(r.op_timeout_ms)),
            wait,
        };
        let t0 = Instant::now();
        let (parent, rank) = self.daemon.shrink_check(&s, r.comm, &a)?;
        // Without abort, this rank's ops on the parent finish first (they complete, or fail
        // once a lost rank is seen).
        while parent.queued_of(rank) > 0 {
            if t0.elapsed() >= wait {
                return Err(Status::deadline_exceeded(format!(
                    "{}: rank {rank} still has {} op(s) pending on it after {:.1} s; a shrink without abort waits for them (shrink with abort to fail them)",
                    parent.label(),
                    parent.queued_of(rank),
                    wait.as_secs_f64()
                )));
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let name = if r.name.is_empty() {
            parent.name().to_string()
        } else {
            r.name
        };
        let left = wait.saturating_sub(t0.elapsed());
        let sh = self.daemon.shrink_join(s, parent, rank, &a)?;
        match tokio::time::timeout(left, sh.joined).await {
            Ok(Ok(Ok(joined))) => {
                let comm = self.created(joined, &name, sh.rank);
                if let Some(c) = self.daemon.comm_by_id(comm.comm_id) {
                    tracing::info!(target: "commd::comm", comm = comm.comm_id, "{}: shrunk from {} (rank {rank} is rank {} of {}) in {:.1} ms", c.label(), sh.parent.label(), sh.rank, sh.nranks, t0.elapsed().as_secs_f64() * 1e3);
                }
                Ok(Response::new(pb::ShrinkCommunicatorReply {
                    comm: Some(comm),
                    rank: sh.rank,
                    nranks: sh.nranks,
                }))
            }
            Ok(Ok(Err(e))) => Err(e.into()),
            Ok(Err(_)) => Err(Status::unavailable("daemon is shutting down")),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "shrink of {}: {}",
                sh.parent.label(),
                self.daemon.join_timed_out(&sh.uid, sh.rank, t0.elapsed())
            ))),
        }
    }

    async fn destroy_communicator(
        &self,
        req: Request<pb::CommRef>,
    ) -> Result<Response<pb::Empty>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        self.daemon.destroy_comm(&s, req.get_ref().comm)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn fail_communicator(
        &self,
        req: Request<pb::FailCommunicatorRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let r = req.get_ref();
        self.daemon.fail_comm(&s, r.comm, r.status, &r.message)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn get_comm_failure(
        &self,
        req: Request<pb::CommRef>,
    ) -> Result<Response<pb::OpErrorReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let (status, message) = self
            .daemon
            .comm_failure(&s, req.get_ref().comm)?
            .unwrap_or((0, String::new()));
        Ok(Response::new(pb::OpErrorReply { status, message }))
    }

    async fn set_comm_pacing(
        &self,
        req: Request<pb::SetCommPacingRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let r = req.get_ref();
        self.daemon.set_comm_pacing(&s, r.comm, r.bytes_per_sec)?;
        Ok(Response::new(pb::Empty {}))
    }

    async fn register_memory(
        &self,
        req: Request<pb::RegisterMemoryRequest>,
    ) -> Result<Response<pb::RegisterMemoryReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let r = req.into_inner();
        let d = self.daemon.clone();
        // Mapping and prefaulting take time proportional to the memory: off the async runtime,
        // so one large registration never stalls other clients' calls or `commd health`.
        let mem_id = tokio::task::spawn_blocking(move || d.register(&s, r.fd_token, r.bytes))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(pb::RegisterMemoryReply { mem_id }))
    }

    async fn register_cuda_memory(
        &self,
        req: Request<pb::RegisterCudaMemoryRequest>,
    ) -> Result<Response<pb::RegisterCudaMemoryReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let r = req.into_inner();
        let d = self.daemon.clone();
        // cuIpcOpenMemHandle takes 70-240 us (ms elsewhere): off the async runtime.
        let (mem_id, cached, open_us) = tokio::task::spawn_blocking(move || {
            d.register_cuda(&s, &r.ipc_handle, &r.device_uuid, r.bytes, r.vmm)
        })
        .await
        .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(pb::RegisterCudaMemoryReply {
            mem_id,
            cached,
            open_us,
        }))
    }

    async fn map_cuda_pieces(
        &self,
        req: Request<pb::MapCudaPiecesRequest>,
    ) -> Result<Response<pb::MapCudaPiecesReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let r = req.into_inner();
        let pieces: Vec<(u64, u64, u64)> = r
            .pieces
            .iter()
            .map(|p| (p.offset, p.bytes, p.fd_token))
            .collect();
        let d = self.daemon.clone();
        // Imports and maps take tens of microseconds each; a replacement may wait for ops.
        let map_us = tokio::task::spawn_blocking(move || d.map_cuda_pieces(&s, r.mem_id, &pieces))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(pb::MapCudaPiecesReply { map_us }))
    }

    async fn get_comm_scratch(
        &self,
        req: Request<pb::CommScratchRequest>,
    ) -> Result<Response<pb::CommScratchReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let r = req.into_inner();
        let d = self.daemon.clone();
        let (ipc_handle, slot_bytes, bytes) =
            tokio::task::spawn_blocking(move || d.comm_scratch(&s, r.comm, &r.device_uuid))
                .await
                .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(pb::CommScratchReply {
            ipc_handle,
            slot_bytes,
            bytes,
        }))
    }

    async fn topology(
        &self,
        _req: Request<pb::Empty>,
    ) -> Result<Response<pb::TopologyReply>, Status> {
        Ok(Response::new(crate::cuda::topology_reply()))
    }

    async fn deregister_memory(
        &self,
        req: Request<pb::MemRef>,
    ) -> Result<Response<pb::Empty>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let (d, mem_id) = (self.daemon.clone(), req.get_ref().mem_id);
        // munmap of a large registration: off the async runtime.
        tokio::task::spawn_blocking(move || d.deregister(&s, mem_id))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        Ok(Response::new(pb::Empty {}))
    }

    async fn get_op_error(
        &self,
        req: Request<pb::OpRef>,
    ) -> Result<Response<pb::OpErrorReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let (status, message) = s.take_error(req.get_ref().user_data).ok_or_else(|| {
            Status::not_found(format!(
                "no error recorded for op {}",
                req.get_ref().user_data
            ))
        })?;
        Ok(Response::new(pb::OpErrorReply { status, message }))
    }

    async fn get_graph_op_error(
        &self,
        req: Request<pb::GraphOpRef>,
    ) -> Result<Response<pb::OpErrorReply>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let (status, message) = s
            .take_graph_error(req.get_ref().slot)
            .unwrap_or((0, String::new()));
        Ok(Response::new(pb::OpErrorReply { status, message }))
    }

    async fn release_graph_ops(
        &self,
        req: Request<pb::GraphOpsRelease>,
    ) -> Result<Response<pb::GraphOpsReleased>, Status> {
        let s = self.session(&req, req.get_ref().session_id)?;
        let slots = req.into_inner().slots;
        if let Some(bad) = slots
            .iter()
            .find(|&&x| x >= commd_proto::desc::graph_doorbell::SLOTS)
        {
            return Err(Status::invalid_argument(format!(
                "graph doorbell slot {bad} is out of range (below {})",
                commd_proto::desc::graph_doorbell::SLOTS
            )));
        }
        let unknown = match crate::cuda::get() {
            Ok(c) => tokio::task::spawn_blocking(move || c.release_graph_ops(s.id, slots))
                .await
                .map_err(|e| Status::internal(e.to_string()))?,
            Err(_) => Vec::new(),
        };
        Ok(Response::new(pb::GraphOpsReleased { unknown }))
    }

    async fn status(&self, req: Request<pb::Empty>) -> Result<Response<pb::StatusReply>, Status> {
        let (uid, _) = caller(&req)?;
        Ok(Response::new(self.status_for(Viewer::of(uid))))
    }
}

/// Who asks for status: root and the daemon's own uid see every session; any other user sees
/// only the sessions (pids, job names, counters) of its own uid, plus the daemon-wide totals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Viewer {
    All,
    Uid(u32),
}

impl Viewer {
    pub fn of(uid: u32) -> Self {
        if uid == 0 || uid == rustix::process::geteuid().as_raw() {
            Viewer::All
        } else {
            Viewer::Uid(uid)
        }
    }

    /// Whether this viewer may see a session of `uid`.
    pub fn sees(self, uid: u32) -> bool {
        match self {
            Viewer::All => true,
            Viewer::Uid(u) => u == uid,
        }
    }
}

impl LocalService {
    /// The status reply as `viewer` may see it.
    pub fn status_for(&self, viewer: Viewer) -> pb::StatusReply {
        use std::sync::atomic::Ordering::Relaxed;
        let d = &self.daemon;
        let c = d.counts();
        let mut done = d.closed_ops.0.load(Relaxed);
        let mut failed = d.closed_ops.1.load(Relaxed);
        let mut list = Vec::new();
        for s in d.sessions() {
            let t = s.tables();
            let (sc, sf) = (s.ops_completed.load(Relaxed), s.ops_failed.load(Relaxed));
            done += sc;
            failed += sf;
            if !viewer.sees(s.uid) {
                continue;
            }
            list.push(pb::SessionInfo {
                session_id: s.id,
                uid: s.uid,
                pid: s.pid,
                name: s.name.clone(),
                communicators: u32::try_from(t.comms.len()).unwrap_or(u32::MAX),
                registrations: u32::try_from(t.mems.len() + t.cuda_mems.len()).unwrap_or(u32::MAX),
                mapped_bytes: t.registered_bytes,
                ops_completed: sc,
                ops_failed: sf,
                cuda_registrations: u32::try_from(t.cuda_mems.len()).unwrap_or(u32::MAX),
                ipc_opens: s.ipc_opens.load(Relaxed),
                ipc_cache_hits: s.ipc_hits.load(Relaxed),
            });
        }
        list.sort_by_key(|s| s.session_id);
        let cuda = crate::cuda::get();
        let stat =
            |f: fn(&crate::cuda::IpcStats) -> u64| cuda.as_ref().map(|c| f(&c.stats)).unwrap_or(0);
        pb::StatusReply {
            daemon_version: commd_proto::VERSION.to_string(),
            // std::process::id is getpid's pid_t as a u32: back to the pid_t.
            pid: std::process::id().cast_signed(),
            uptime_ms: u64::try_from(d.started.elapsed().as_millis()).unwrap_or(u64::MAX),
            sessions: c.sessions,
            communicators: c.communicators,
            registrations: c.registrations,
            mapped_bytes: c.mapped_bytes,
            ops_completed: done,
            ops_failed: failed,
            session_list: list,
            workers: u32::try_from(d.cfg.workers).unwrap_or(u32::MAX),
            pending_joins: c.pending_joins,
            cuda_available: cuda.is_ok(),
            cuda_reason: cuda.as_ref().err().cloned().unwrap_or_default(),
            gpus: cuda
                .as_ref()
                .map(|c| u32::try_from(c.gpus.len()).unwrap_or(u32::MAX))
                .unwrap_or(0),
            ipc_opens: stat(|s| s.opens.load(Relaxed)),
            ipc_cache_hits: stat(|s| s.hits.load(Relaxed)),
            ipc_open_us: stat(|s| s.open_us.load(Relaxed)),
            ipc_open_now: cuda.as_ref().map_or(0, |c| c.stats.open_now.load(Relaxed)),
            gpu_ops: stat(|s| s.gpu_ops.load(Relaxed)),
        }
    }
}

/// A communicator's name from its caller: at most 128 bytes, no control characters (it goes
/// into log lines and errors as it is).
impl LocalService {
    /// The reply to a rank that joined a communicator (created or shrunk): names it with
    /// `name` if no rank did yet, and says how its data moves.
    fn created(
        &self,
        (comm, comm_id, doorbell_slot, nodes): (u32, u64, u32, u32),
        name: &str,
        rank: u32,
    ) -> pb::CreateCommunicatorReply {
        let c = self.daemon.comm_by_id(comm_id);
        if let Some(c) = c.as_ref().filter(|c| c.name_once(name)) {
            tracing::info!(comm = comm_id, name = %name, "{}: named by rank {rank}", c.label());
        }
        let paths = c
            .as_ref()
            .map(|c| crate::comm::comm_paths(c))
            .unwrap_or_default();
        let ranks_share_a_process = c
            .as_ref()
            .is_some_and(|c| crate::comm::ranks_share_a_process(c));
        pb::CreateCommunicatorReply {
            comm,
            comm_id,
            doorbell_slot,
            nodes,
            paths,
            ranks_share_a_process,
        }
    }
}

fn check_comm_name(name: &str) -> Result<(), Status> {
    if name.len() > 128 || name.chars().any(char::is_control) {
        return Err(Status::invalid_argument(format!(
            "communicator name {:?} is not allowed: at most 128 bytes of printable text",
            name.chars().take(40).collect::<String>()
        )));
    }
    Ok(())
}
