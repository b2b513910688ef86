//! Session bring-up through the SwitchML controller API, exactly in the spec's order, with every
//! response checked (the reference controller answers errors with zeroed responses):
//! 1. rank 0 picks the session id; all ranks agree on it with `Broadcast(root = 0)`;
//! 2. rank 0 registers (`UdpSession`, which clears the session on the switch), then `Barrier`;
//!    the others `Barrier`, then register;
//! 3. everyone `Barrier`s again; then data flows.
//!
//! The session id also carries the UDP port the workers send from (its low 16 bits; the id is
//! opaque to the switch), because all workers must use the same port. Calls carry commd
//! metadata (`commd-scope`, `commd-worker-port`, `commd-worker-threads`) that `commd switch`
//! uses to keep concurrent sessions apart; a real controller ignores it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use commd_proto::switchml_pb as pb;
use tonic::Request;

use super::worker::{Params, Worker};
use commd_switch::packet::{PacketSize, SWITCH_UDP_PORT};

/// What this node asks for.
#[derive(Clone, Debug)]
pub struct Want {
    /// Controller address, host:port.
    pub controller: String,
    pub bind: Ipv4Addr,
    pub threads: usize,
    pub window: usize,
    pub size: PacketSize,
    pub timeout: Duration,
    pub stall: Duration,
    pub pin: bool,
}

/// Brings up the session as worker `rank` of `n` and starts this node's worker threads.
pub fn bring_up(
    w: &Want,
    rank: u32,
    n: u32,
    scope: &str,
    label: &str,
    wake: Option<Arc<OwnedFd>>,
    rpc_timeout: Duration,
) -> Result<Worker, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let ctl = &w.controller;
    let (sid, data) = rt.block_on(async {
        tokio::time::timeout(rpc_timeout, exchange(w, rank, n, scope))
            .await
            .map_err(|_| {
                format!(
                    "the switch controller at {ctl} did not complete session bring-up within {} ms (another node may have failed to reach it)",
                    rpc_timeout.as_millis()
                )
            })?
    })?;
    let port = (sid & 0xffff) as u16;
    let p = Params {
        switch: data,
        bind: IpAddr::V4(w.bind),
        port,
        threads: w.threads,
        window: w.window,
        size: w.size,
        workers: n,
        timeout: w.timeout,
        stall: w.stall,
        pin: w.pin,
        label: format!("{label} switch session {sid:#x}"),
    };
    Worker::start(p, wake)
}

fn with_meta<T>(msg: T, kv: &[(&'static str, String)]) -> Request<T> {
    let mut r = Request::new(msg);
    for (k, v) in kv {
        if let Ok(v) = v.parse() {
            r.metadata_mut().insert(*k, v);
        }
    }
    r
}

/// A free UDP port range `[p, p + threads)` on `ip`.
fn pick_port(ip: Ipv4Addr, threads: usize) -> Result<u16, String> {
    for _ in 0..64 {
        let p: u16 = rand::random_range(20000..60000u16);
        let ok = (0..threads).all(|t| {
            u16::try_from(t)
                .ok()
                .and_then(|t| p.checked_add(t))
                .is_some_and(|port| UdpSocket::bind((ip, port)).is_ok())
        });
        if ok {
            return Ok(p);
        }
    }
    Err(format!("no free range of {threads} UDP port(s) on {ip}"))
}

async fn exchange(w: &Want, rank: u32, n: u32, scope: &str) -> Result<(u64, SocketAddr), String> {
    let ctl = &w.controller;
    let uri = if ctl.contains("://") {
        ctl.clone()
    } else {
        format!("http://{ctl}")
    };
    let ep = tonic::transport::Endpoint::from_shared(uri)
        .map_err(|e| format!("switch controller address {ctl}: {e}"))?
        .connect_timeout(Duration::from_secs(3));
    let ch = ep
        .connect()
        .await
        .map_err(|e| format!("cannot reach the switch controller at {ctl}: {e}"))?;
    let mut session = pb::session_client::SessionClient::new(ch.clone());
    let mut sync = pb::sync_client::SyncClient::new(ch);
    let scope_md = [("commd-scope", scope.to_string())];
    let rpc = |what: &str, e: tonic::Status| {
        format!(
            "switch controller at {ctl}: {what} failed: {} ({:?})",
            e.message(),
            e.code()
        )
    };
    // 1. Agree on the session id (and with it the workers' UDP port).
    let proposal = if rank == 0 {
        let port = pick_port(w.bind, w.threads)?;
        let hi: u64 = rand::random::<u64>() << 16;
        (hi | u64::from(port)).max(1 << 16)
    } else {
        0
    };
    let sid = sync
        .broadcast(with_meta(
            pb::BroadcastRequest {
                value: proposal,
                rank,
                num_workers: n,
                root: 0,
            },
            &scope_md,
        ))
        .await
        .map_err(|e| rpc("Broadcast", e))?
        .into_inner()
        .value;
    if sid == 0 || (rank == 0 && sid != proposal) {
        return Err(format!(
            "switch controller at {ctl}: Broadcast answered session id {sid:#x} (zeroed or not rank 0's {proposal:#x})"
        ));
    }
    let port = (sid & 0xffff) as u16;
    let reg = pb::UdpSessionRequest {
        session_id: sid,
        rank,
        num_workers: n,
        mac: 0x0200_0000_0000 | u64::from(u32::from(w.bind)),
        ipv4: u32::from(w.bind),
        packet_size: i32::from(w.size.code()),
    };
    let reg_md = [
        ("commd-scope", scope.to_string()),
        ("commd-worker-port", port.to_string()),
        ("commd-worker-threads", w.threads.to_string()),
    ];
    let barrier = |sync: &mut pb::sync_client::SyncClient<tonic::transport::Channel>| {
        let mut s = sync.clone();
        let r = with_meta(pb::BarrierRequest { num_workers: n }, &scope_md);
        async move { s.barrier(r).await }
    };
    // 2. Rank 0 registers first (that clears the session), the others after a barrier.
    let resp = if rank == 0 {
        let r = session
            .udp_session(with_meta(reg, &reg_md))
            .await
            .map_err(|e| rpc("UdpSession", e))?;
        barrier(&mut sync).await.map_err(|e| rpc("Barrier", e))?;
        r
    } else {
        barrier(&mut sync).await.map_err(|e| rpc("Barrier", e))?;
        session
            .udp_session(with_meta(reg, &reg_md))
            .await
            .map_err(|e| rpc("UdpSession", e))?
    };
    let data_port = resp
        .metadata()
        .get("commd-data-port")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u16>().ok())
        .unwrap_or(SWITCH_UDP_PORT);
    let resp = resp.into_inner();
    check_response(ctl, sid, &resp)?;
    // 3. Everyone registered.
    barrier(&mut sync).await.map_err(|e| rpc("Barrier", e))?;
    let data = SocketAddr::new(IpAddr::V4(Ipv4Addr::from(resp.ipv4)), data_port);
    Ok((sid, data))
}

/// A response must name our session and a switch address; the reference controller signals
/// errors with zeroed responses.
pub fn check_response(ctl: &str, sid: u64, r: &pb::UdpSessionResponse) -> Result<(), String> {
    if r.session_id == 0 && r.mac == 0 && r.ipv4 == 0 {
        return Err(format!(
            "switch controller at {ctl} answered UdpSession with a zeroed response: it refused the session (too many workers, a packet size it does not support, or another session holds the switch)"
        ));
    }
    if r.session_id != sid {
        return Err(format!(
            "switch controller at {ctl} answered for session {:#x}, not {sid:#x}",
            r.session_id
        ));
    }
    if r.ipv4 == 0 || r.mac == 0 {
        return Err(format!(
            "switch controller at {ctl} answered without a switch address (ipv4 {:#x}, mac {:#x})",
            r.ipv4, r.mac
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_and_foreign_responses_are_errors() {
        let z = pb::UdpSessionResponse::default();
        assert!(check_response("c", 5, &z).unwrap_err().contains("zeroed"));
        let other = pb::UdpSessionResponse {
            session_id: 6,
            mac: 1,
            ipv4: 1,
        };
        assert!(
            check_response("c", 5, &other)
                .unwrap_err()
                .contains("not 0x5")
        );
        let noaddr = pb::UdpSessionResponse {
            session_id: 5,
            mac: 0,
            ipv4: 0x7f000001,
        };
        assert!(check_response("c", 5, &noaddr).is_err());
        let ok = pb::UdpSessionResponse {
            session_id: 5,
            mac: 2,
            ipv4: 0x7f000001,
        };
        assert!(check_response("c", 5, &ok).is_ok());
    }
}
