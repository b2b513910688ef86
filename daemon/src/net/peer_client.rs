//! The client side of the peer service (`peer.proto`): a channel to a peer daemon (mutual TLS
//! when configured), a rank's join at the root daemon, and the RDMA endpoint exchange that
//! connects this node's queue pairs. The server side is `crate::peer`.
//!
//! May use: `net` (RDMA endpoints, TLS material), `commd_proto`.

use std::time::Duration;

use commd_proto::pb;
use commd_proto::pb::peer_client::PeerClient;
use tonic::Status;

/// Why a join at the root daemon failed.
#[derive(Debug)]
pub enum JoinError {
    /// Its peer service could not be reached.
    Unreachable(String),
    /// It answered with an error.
    Refused(Status),
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

pub fn endpoint_from_pb(
    e: &pb::PeerRdmaEndpoint,
) -> Result<crate::net::rdma::stream::Endpoint, String> {
    let mut gid = [0u8; 16];
    if e.gid.len() == 16 {
        gid.copy_from_slice(&e.gid);
    }
    Ok(crate::net::rdma::stream::Endpoint {
        qpn: e.qpn,
        psn: e.psn,
        gid,
        lid: u16::try_from(e.lid)
            .map_err(|_| format!("RDMA endpoint LID {} does not fit 16 bits", e.lid))?,
        mtu: e.mtu,
        addr: e.addr,
        rkey: e.rkey,
        len: e.len,
        device: e.device.clone(),
    })
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
                    stream: u32::try_from(i)
                        .map_err(|_| format!("RDMA stream {i} does not fit u32"))?,
                    endpoint: Some(endpoint_to_pb(l)),
                })
                .await
                .map_err(|s| format!("RdmaConnect refused: {}", s.message()))?;
            out.push(endpoint_from_pb(&r.into_inner())?);
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
) -> Result<pb::PeerJoinReply, JoinError> {
    let ch = channel(root, wait, tls)
        .await
        .map_err(JoinError::Unreachable)?;
    let mut c = PeerClient::new(ch);
    c.join(req)
        .await
        .map(|r| r.into_inner())
        .map_err(JoinError::Refused)
}
