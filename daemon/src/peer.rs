//! The peer service between daemons (gRPC over TCP, `proto/commd/v1/peer.proto`): the root
//! daemon of a communicator collects every rank's join (authorized by the communicator token)
//! and answers all of them with the membership; and the choice of the address this node
//! advertises. The client side (joins, RDMA endpoint exchange) is `net::peer_client`.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use commd_proto::pb;
use tonic::{Request, Response, Status};

use crate::daemon::Daemon;
use crate::net::peer_client::{endpoint_from_pb, endpoint_to_pb};

pub struct PeerService {
    pub daemon: Arc<Daemon>,
}

#[tonic::async_trait]
impl pb::peer_server::Peer for PeerService {
    async fn join(
        &self,
        req: Request<pb::PeerJoinRequest>,
    ) -> Result<Response<pb::PeerJoinReply>, Status> {
        let remote = req.remote_addr();
        let from = remote.map(|a| a.to_string()).unwrap_or_default();
        let r = req.into_inner();
        tracing::debug!(target: "commd::net", "peer join: rank {} of {} from node {} ({from})", r.rank, r.nranks, r.node);
        if self.daemon.cfg.peer_addr_check
            && let Err(why) = announced_from(&r, remote)
        {
            crate::telemetry::ratelimit::warn_limited!(target: "commd::net", "refused a join of rank {} from {from}: {why}", r.rank);
            return Err(Status::permission_denied(format!(
                "{why}; the root daemon refuses announced addresses other than the join's own IP \
                 (set peer_addr_check=off on the root daemon behind NAT or on multi-homed nodes)"
            )));
        }
        let rx = self.daemon.peer_join(&r)?;
        let wait = Duration::from_millis(r.timeout_ms.max(1));
        let t0 = Instant::now();
        match tokio::time::timeout(wait, rx).await {
            Ok(Ok(Ok(reply))) => Ok(Response::new(reply)),
            Ok(Ok(Err(e))) => Err(e.into()),
            Ok(Err(_)) => Err(Status::unavailable("root daemon is shutting down")),
            Err(_) => Err(Status::deadline_exceeded(self.daemon.peer_join_timed_out(
                &r.token,
                r.rank,
                t0.elapsed(),
            ))),
        }
    }

    async fn rdma_connect(
        &self,
        req: Request<pb::PeerRdmaConnect>,
    ) -> Result<Response<pb::PeerRdmaEndpoint>, Status> {
        let r = req.into_inner();
        let Some(net) = self.daemon.net() else {
            return Err(Status::failed_precondition(
                "this daemon has no peer service",
            ));
        };
        let rdma = match &net.rdma {
            Ok(x) => x.clone(),
            Err(why) => {
                return Err(Status::failed_precondition(format!(
                    "this daemon has no RDMA transport: {why}"
                )));
            }
        };
        let token: [u8; 16] = r
            .token
            .as_slice()
            .try_into()
            .map_err(|_| Status::permission_denied("malformed communicator token"))?;
        let remote =
            endpoint_from_pb(&r.endpoint.unwrap_or_default()).map_err(Status::invalid_argument)?;
        // Verbs calls are short but blocking: keep them off the async workers.
        let node = r.node.clone();
        let ep = tokio::task::spawn_blocking(move || rdma.accept(token, &node, r.stream, &remote))
            .await
            .map_err(|e| Status::internal(e.to_string()))?
            .map_err(|e| {
                tracing::warn!(target: "commd::net", "RDMA connect from node {}: {e}", r.node);
                Status::internal(e)
            })?;
        Ok(Response::new(endpoint_to_pb(&ep)))
    }

    async fn ping(&self, _req: Request<pb::PeerPing>) -> Result<Response<pb::PeerPing>, Status> {
        Ok(Response::new(pb::PeerPing {
            node: self.daemon.node_id().unwrap_or_default(),
        }))
    }
}

/// Checks that the addresses a join announces (its node's peer service, its data listener),
/// which the root hands to every member to dial, are on the IP the join came from: a holder of
/// a valid token must not make the other daemons connect to an address of its choosing.
pub fn announced_from(r: &pb::PeerJoinRequest, remote: Option<SocketAddr>) -> Result<(), String> {
    let Some(remote) = remote else {
        return Err("the join's source address is unknown".into());
    };
    let src = remote.ip().to_canonical();
    for (what, addr) in [("node address", &r.node), ("data address", &r.data_addr)] {
        let ip = addr
            .parse::<SocketAddr>()
            .map(|a| a.ip().to_canonical())
            .map_err(|_| format!("the announced {what} {addr:?} is not IP:PORT"))?;
        if ip != src {
            return Err(format!(
                "the announced {what} {addr} is not on the IP the join came from ({src})"
            ));
        }
    }
    Ok(())
}

/// The IP this node advertises: the configured one, else the listen IP, else the IP of the
/// interface holding the default route (no packet is sent), else loopback (with a warning).
pub fn advertise_ip(configured: &str, listen: IpAddr) -> (IpAddr, Option<u16>) {
    if let Ok(sa) = configured.parse::<SocketAddr>() {
        return (sa.ip(), Some(sa.port()));
    }
    if let Ok(ip) = configured.parse::<IpAddr>() {
        return (ip, None);
    }
    if !listen.is_unspecified() {
        return (listen, None);
    }
    let probe = std::net::UdpSocket::bind("0.0.0.0:0").and_then(|s| {
        s.connect("192.0.2.1:9")?;
        s.local_addr()
    });
    match probe {
        Ok(a) if !a.ip().is_unspecified() => (a.ip(), None),
        _ => {
            tracing::warn!(target: "commd::init", "no default route to pick an address to advertise; advertising 127.0.0.1 (set advertise / COMMD_ADVERTISE for multi-node use)");
            (IpAddr::from([127, 0, 0, 1]), None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join(node: &str, data: &str) -> pb::PeerJoinRequest {
        pb::PeerJoinRequest {
            node: node.into(),
            data_addr: data.into(),
            ..Default::default()
        }
    }

    #[test]
    fn announced_addresses_must_be_on_the_joins_own_ip() {
        let from = Some("10.0.0.2:51234".parse().unwrap());
        assert!(announced_from(&join("10.0.0.2:7400", "10.0.0.2:40000"), from).is_ok());
        let e = announced_from(&join("10.0.0.2:7400", "10.9.9.9:22"), from).unwrap_err();
        assert!(
            e.contains("data address 10.9.9.9:22") && e.contains("10.0.0.2"),
            "{e}"
        );
        let e = announced_from(&join("169.254.169.254:80", "10.0.0.2:1"), from).unwrap_err();
        assert!(e.contains("node address"), "{e}");
        assert!(announced_from(&join("host:7400", "10.0.0.2:1"), from).is_err());
        assert!(announced_from(&join("10.0.0.2:7400", "10.0.0.2:1"), None).is_err());
        // An IPv4 peer seen on a dual-stack socket as ::ffff:10.0.0.2.
        let mapped = Some("[::ffff:10.0.0.2]:5".parse().unwrap());
        assert!(announced_from(&join("10.0.0.2:7400", "10.0.0.2:1"), mapped).is_ok());
    }
}
