//! The peer service between daemons (gRPC over TCP, `proto/commd/v1/peer.proto`): the root
//! daemon of a communicator collects every rank's join (authorized by the communicator token)
//! and answers all of them with the membership. Also the client side used by non-root daemons,
//! and the choice of the address this node advertises.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use commd_proto::pb;
use commd_proto::pb::peer_client::PeerClient;
use tonic::{Request, Response, Status};

use crate::daemon::{Daemon, DaemonError};

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
            tracing::warn!(target: "commd::net", "refused a join of rank {} from {from}: {why}", r.rank);
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
        let remote = endpoint_from_pb(&r.endpoint.unwrap_or_default());
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

fn from_status(root: &str, s: Status) -> DaemonError {
    use tonic::Code;
    let m = s.message().to_string();
    match s.code() {
        Code::InvalidArgument => DaemonError::InvalidArgument(m),
        Code::NotFound => DaemonError::NotFound(m),
        Code::PermissionDenied => {
            DaemonError::PermissionDenied(format!("root daemon {root} refused the join: {m}"))
        }
        Code::AlreadyExists => DaemonError::AlreadyExists(m),
        Code::ResourceExhausted => DaemonError::ResourceExhausted(m),
        Code::DeadlineExceeded => DaemonError::DeadlineExceeded(m),
        Code::Unavailable => DaemonError::Unavailable(format!("root daemon {root}: {m}")),
        _ => DaemonError::Internal(format!("root daemon {root}: {m}")),
    }
}

pub fn endpoint_to_pb(e: &crate::net::rdma::stream::Endpoint) -> pb::PeerRdmaEndpoint {
    pb::PeerRdmaEndpoint {
        qpn: e.qpn,
        psn: e.psn,
        gid: e.gid.to_vec(),
        lid: u32::from(e.lid),
        mtu: e.mtu,
        addr: e.addr,
        rkey: e.rkey,
        len: e.len,
        device: e.device.clone(),
    }
}

pub fn endpoint_from_pb(e: &pb::PeerRdmaEndpoint) -> crate::net::rdma::stream::Endpoint {
    let mut gid = [0u8; 16];
    if e.gid.len() == 16 {
        gid.copy_from_slice(&e.gid);
    }
    crate::net::rdma::stream::Endpoint {
        qpn: e.qpn,
        psn: e.psn,
        gid,
        lid: e.lid as u16,
        mtu: e.mtu,
        addr: e.addr,
        rkey: e.rkey,
        len: e.len,
        device: e.device.clone(),
    }
}

/// Connects this node's RDMA streams to `peer` (its peer-service address): for each pending QP,
/// `Peer.RdmaConnect` returns the peer's endpoint. Runs on the calling (net) thread.
pub fn rdma_connect_blocking(
    peer: &str,
    token: &[u8; 16],
    me: &str,
    locals: &[crate::net::rdma::stream::Endpoint],
    tls: Option<&crate::net::PeerTls>,
) -> Result<Vec<crate::net::rdma::stream::Endpoint>, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let ch = channel(peer, Duration::from_secs(10), tls)
            .await
            .map_err(|e| format!("cannot reach its peer service {peer}: {e}"))?;
        let mut c = PeerClient::new(ch);
        let mut out = Vec::with_capacity(locals.len());
        for (i, l) in locals.iter().enumerate() {
            let r = c
                .rdma_connect(pb::PeerRdmaConnect {
                    token: token.to_vec(),
                    node: me.to_string(),
                    stream: i as u32,
                    endpoint: Some(endpoint_to_pb(l)),
                })
                .await
                .map_err(|s| format!("RdmaConnect refused: {}", s.message()))?;
            out.push(endpoint_from_pb(&r.into_inner()));
        }
        Ok(out)
    })
}

/// A gRPC channel to a peer daemon's service (`host:port`), with mutual TLS when configured.
async fn channel(
    addr: &str,
    wait: Duration,
    tls: Option<&crate::net::PeerTls>,
) -> Result<tonic::transport::Channel, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut ep = tonic::transport::Endpoint::from_shared(format!("{scheme}://{addr}"))
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .timeout(wait + Duration::from_secs(1));
    if let Some(t) = tls {
        use tonic::transport::{Certificate, ClientTlsConfig, Identity};
        let c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&t.ca))
            .identity(Identity::from_pem(&t.cert, &t.key));
        ep = ep
            .tls_config(c)
            .map_err(|e| format!("TLS configuration: {e}"))?;
    }
    ep.connect().await.map_err(|e| format!("{e} ({e:?})"))
}

/// Joins a rank at the root daemon `root` (`host:port`); resolves with the membership.
pub async fn join(
    root: &str,
    req: pb::PeerJoinRequest,
    wait: Duration,
    tls: Option<&crate::net::PeerTls>,
) -> Result<pb::PeerJoinReply, DaemonError> {
    let unreachable = |e: String| {
        DaemonError::Unavailable(format!(
            "cannot reach the root daemon {root} of this communicator (the address in the unique id): {e}"
        ))
    };
    let ch = channel(root, wait, tls).await.map_err(unreachable)?;
    let mut c = PeerClient::new(ch);
    match c.join(req).await {
        Ok(r) => Ok(r.into_inner()),
        Err(s) => Err(from_status(root, s)),
    }
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
