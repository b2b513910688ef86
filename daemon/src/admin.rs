//! The `Admin` gRPC service (proto/commd/v1/admin.proto), on the daemon's Unix socket beside
//! `Local`. Read-only views for operators: communicators with their members and stuck ops, and
//! link counters. Every call is authorized by SO_PEERCRED: the daemon's own uid or root, nobody
//! else (a root daemon's socket is open to every local user for the job API; this is not).

use std::sync::Arc;
use std::time::Instant;

use commd_proto::pb::{self, admin_server::Admin};
use tonic::transport::server::UdsConnectInfo;
use tonic::{Request, Response, Status};

use crate::comm::Comm;
use crate::daemon::Daemon;

pub struct AdminService {
    pub daemon: Arc<Daemon>,
    /// The uid allowed besides root: the daemon's effective uid.
    pub daemon_uid: u32,
}

impl AdminService {
    pub fn new(daemon: Arc<Daemon>) -> Self {
        Self {
            daemon,
            daemon_uid: rustix::process::geteuid().as_raw(),
        }
    }

    fn check<T>(&self, req: &Request<T>) -> Result<(), Status> {
        let uid = req
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|i| i.peer_cred)
            .map(|c| c.uid());
        authorize(uid, self.daemon_uid)
    }
}

/// The admin rule: root, or the daemon's own uid. `None`: no peer credentials (not a Unix socket).
pub fn authorize(peer_uid: Option<u32>, daemon_uid: u32) -> Result<(), Status> {
    match peer_uid {
        None => Err(Status::unauthenticated(
            "no peer credentials on this connection; the admin service is served on the daemon's Unix socket only",
        )),
        Some(0) => Ok(()),
        Some(u) if u == daemon_uid => Ok(()),
        Some(u) => Err(Status::permission_denied(format!(
            "permission denied: node-wide link counters (`commd stat`) are served only to uid {daemon_uid} (the daemon's) and root, and the caller has uid {u}; run it as that user or with sudo (jobs and `commd health` need no such rights)"
        ))),
    }
}

fn comm_status(c: &Comm, now: Instant) -> pb::CommStatus {
    let w = c.waiting(now);
    let gpus: Vec<i32> = {
        let sc = c.scratch.lock().unwrap_or_else(|e| e.into_inner());
        (0..c.nranks as usize)
            .map(|r| {
                sc.get(r)
                    .and_then(|s| s.as_ref())
                    // A CUDA device ordinal (a C int), so it fits; -1: not known.
                    .and_then(|s| i32::try_from(s.mem.gpu).ok())
                    .unwrap_or(-1)
            })
            .collect()
    };
    let ranks = c
        .members
        .iter()
        .enumerate()
        .map(|(r, m)| {
            let rw = w.ranks.get(r).cloned().unwrap_or_default();
            pb::CommRank {
                rank: u32::try_from(r).expect("a member's rank is below nranks, a u32"),
                pid: m.pid,
                session_id: m.session_id,
                collectives_posted: rw.posted,
                queued: u32::try_from(rw.queued).unwrap_or(u32::MAX),
                gpu: gpus.get(r).copied().unwrap_or(-1),
                oldest_pending: rw.oldest.unwrap_or_default(),
            }
        })
        .collect();
    let parent = c.lineage.get().and_then(|l| l.parent.as_ref());
    pb::CommStatus {
        comm_id: c.id,
        unique_id: c.uid_short.clone(),
        label: c.label(),
        nranks: c.nranks,
        local_ranks: u32::try_from(c.local.len()).expect("local ranks are at most nranks, a u32"),
        nodes: u32::try_from(crate::comm::comm_nodes(c)).expect("nodes are at most nranks, a u32"),
        op_timeout_ms: u64::try_from(c.op_timeout.as_millis()).unwrap_or(u64::MAX),
        ranks,
        pending_ops: w.queued as u64,
        oldest: w.oldest.map(|s| pb::StuckOp {
            op: s.op.to_string(),
            seq: s.seq,
            p2p: s.p2p,
            what: s.what,
            age_ms: u64::try_from(s.age.as_millis()).unwrap_or(u64::MAX),
            posted: s.posted,
            missing: s.missing,
            rank: s.rank,
        }),
        broken: w.broken.unwrap_or_default(),
        switch: c
            .net
            .get()
            .map(|h| h.switch.lock().unwrap_or_else(|e| e.into_inner()).text())
            .unwrap_or_default(),
        pacing_bytes_per_sec: c.pacer.rate().unwrap_or(0),
        name: c.name().to_string(),
        pacing_delayed_us: u64::try_from(c.pacer.delayed().as_micros()).unwrap_or(u64::MAX),
        parent_comm_id: parent.map_or(0, |p| p.0),
        excluded: parent.map(|p| p.1.clone()).unwrap_or_default(),
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn get_status(
        &self,
        req: Request<pb::AdminStatusRequest>,
    ) -> Result<Response<pb::AdminStatusReply>, Status> {
        // Root and the daemon's uid see everything; any other caller its own uid's sessions and
        // the communicators they are in (as `Local.Status` does), and no host-wide details.
        let uid = req
            .extensions()
            .get::<UdsConnectInfo>()
            .and_then(|i| i.peer_cred)
            .map(|c| c.uid());
        let viewer = match uid {
            None => {
                return Err(authorize(None, self.daemon_uid)
                    .expect_err("authorize refuses a caller without peer credentials"));
            }
            Some(u) if authorize(Some(u), self.daemon_uid).is_ok() => crate::control::Viewer::All,
            Some(u) => crate::control::Viewer::Uid(u),
        };
        let local = crate::control::LocalService {
            daemon: self.daemon.clone(),
        };
        let daemon = local.status_for(viewer);
        let now = Instant::now();
        let owns = |c: &Comm| match viewer {
            crate::control::Viewer::All => true,
            crate::control::Viewer::Uid(u) => c.members.iter().any(|m| {
                m.local
                    && self
                        .daemon
                        .session(m.session_id)
                        .is_some_and(|s| s.uid == u)
            }),
        };
        let admin = matches!(viewer, crate::control::Viewer::All);
        let mut comms: Vec<pb::CommStatus> = self
            .daemon
            .comms()
            .iter()
            .filter(|c| owns(c))
            .map(|c| comm_status(c, now))
            .collect();
        comms.sort_by_key(|c| c.comm_id);
        let t = &self.daemon.cfg.telemetry;
        Ok(Response::new(pb::AdminStatusReply {
            daemon: Some(daemon),
            daemon_uid: self.daemon_uid,
            metrics_listen: crate::telemetry::metrics_addr()
                .map(|a| a.to_string())
                .unwrap_or_default(),
            otlp_endpoint: t.otlp_endpoint.clone().unwrap_or_default(),
            communicators: comms,
            cpu_claims: if admin {
                commd_host::cores::host_claims()
                    .into_iter()
                    .map(|(c, p, t, l)| format!("core {c}: pid {p} tid {t} {l}"))
                    .collect()
            } else {
                Vec::new()
            },
        }))
    }

    async fn get_link_stats(
        &self,
        req: Request<pb::LinkStatsRequest>,
    ) -> Result<Response<pb::LinkStatsReply>, Status> {
        self.check(&req)?;
        let uptime_ns = u64::try_from(self.daemon.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let links = crate::telemetry::links::registry()
            .snapshot()
            .into_iter()
            .map(|l| pb::LinkStat {
                name: l.name,
                kind: l.kind,
                peer: l.peer,
                nic: l.nic,
                rx_bytes: l.rx_bytes,
                tx_bytes: l.tx_bytes,
                rx_packets: l.rx_packets,
                tx_packets: l.tx_packets,
            })
            .collect();
        Ok(Response::new(pb::LinkStatsReply { uptime_ns, links }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_root_and_the_daemons_uid_are_admitted() {
        assert!(authorize(Some(0), 1000).is_ok());
        assert!(authorize(Some(1000), 1000).is_ok());
        assert!(authorize(Some(0), 0).is_ok());
        let e = authorize(Some(65534), 1000).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(
            e.message().contains("uid 65534") && e.message().contains("uid 1000"),
            "{}",
            e.message()
        );
        let e = authorize(Some(1000), 0).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            authorize(None, 0).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
    }
}
