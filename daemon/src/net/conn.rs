//! Data connections between daemons: the data listener, the BIND handshake that attaches an
//! incoming connection to a communicator stream, and the pool that keeps connections to each
//! peer across communicators (a job that creates many communicators connects once).
//!
//! Connections are one-way: the dialing daemon sends, the accepting one receives. A BIND
//! (`magic | token | stream index | node id`) names the communicator by its token; a connection
//! whose token no forming communicator claims within a minute is dropped and logged.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

const BIND_MAGIC: u32 = u32::from_le_bytes(*b"cmBD");
const BIND_BYTES: usize = 256;
const MAX_NODE_ID: usize = BIND_BYTES - 26;
const MAX_UNCLAIMED: usize = 4096;

use super::binds::{BindKey, Binds};

pub struct DataPlane {
    /// The advertised address peers dial.
    pub addr: SocketAddr,
    binds: Binds<TcpStream>,
    idle: Mutex<HashMap<String, Vec<TcpStream>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl std::fmt::Debug for DataPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DataPlane({})", self.addr)
    }
}

fn encode_bind(token: &[u8; 16], node: &str, stream: u32) -> [u8; BIND_BYTES] {
    let mut b = [0u8; BIND_BYTES];
    b[0..4].copy_from_slice(&BIND_MAGIC.to_le_bytes());
    b[4..20].copy_from_slice(token);
    b[20..24].copy_from_slice(&stream.to_le_bytes());
    let id = &node.as_bytes()[..node.len().min(MAX_NODE_ID)];
    b[24..26].copy_from_slice(
        &u16::try_from(id.len())
            .expect("a node id is cut to MAX_NODE_ID bytes")
            .to_le_bytes(),
    );
    b[26..26 + id.len()].copy_from_slice(id);
    b
}

fn decode_bind(b: &[u8; BIND_BYTES]) -> Option<BindKey> {
    if b[0..4] != BIND_MAGIC.to_le_bytes() {
        return None;
    }
    let mut token = [0u8; 16];
    token.copy_from_slice(&b[4..20]);
    let stream = u32::from_le_bytes([b[20], b[21], b[22], b[23]]);
    let n = u16::from_le_bytes([b[24], b[25]]) as usize;
    if n > MAX_NODE_ID {
        return None;
    }
    let node = String::from_utf8(b[26..26 + n].to_vec()).ok()?;
    Some((token, node, stream))
}

impl DataPlane {
    /// Binds the data listener on `ip:port` and starts accepting; peers are told to dial
    /// `advertise` at the bound port.
    pub fn start(
        ip: std::net::IpAddr,
        port: u16,
        advertise: std::net::IpAddr,
    ) -> std::io::Result<Arc<Self>> {
        let l = TcpListener::bind(SocketAddr::new(ip, port))?;
        let addr = SocketAddr::new(advertise, l.local_addr()?.port());
        let dp = Arc::new(Self {
            addr,
            binds: Binds::new("data connection", MAX_UNCLAIMED),
            idle: Mutex::new(HashMap::new()),
        });
        let d = dp.clone();
        std::thread::Builder::new()
            .name("commd-net-accept".into())
            .spawn(move || {
                for s in l.incoming() {
                    match s {
                        Ok(s) => d.clone().await_bind(s),
                        Err(e) => {
                            // Out of fds (EMFILE) fails every accept at once: back off
                            // rather than spin.
                            crate::telemetry::ratelimit::warn_limited!(target: "commd::net", "data listener accept: {e}");
                            std::thread::sleep(std::time::Duration::from_millis(50));
                        }
                    }
                }
            })?;
        Ok(dp)
    }

    /// Waits (on a thread of its own) for the BIND that attaches `s` to a communicator; used for
    /// fresh connections and for pooled ones between communicators.
    pub fn await_bind(self: Arc<Self>, s: TcpStream) {
        let spawned = std::thread::Builder::new()
            .name("commd-net-bind".into())
            .spawn(move || {
                let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_default();
                let mut s = s;
                let _ = s.set_nonblocking(false);
                let _ = s.set_read_timeout(None);
                let mut b = [0u8; BIND_BYTES];
                if let Err(e) = s.read_exact(&mut b) {
                    if e.kind() != ErrorKind::UnexpectedEof {
                        tracing::debug!(target: "commd::net", "data connection from {peer} closed before binding: {e}");
                    }
                    return;
                }
                let Some(key) = decode_bind(&b) else {
                    crate::telemetry::ratelimit::warn_limited!(target: "commd::net", "data connection from {peer} rejected: not a commd BIND");
                    return;
                };
                if self.binds.offer(key, s).is_err() {
                    crate::telemetry::ratelimit::warn_limited!(target: "commd::net", "data connection from {peer} rejected: too many unclaimed connections");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(target: "commd::net", "cannot start a bind thread: {e}");
        }
    }

    /// Takes the `streams` incoming connections of `node` for the communicator `token`.
    pub fn take_incoming(
        &self,
        token: &[u8; 16],
        node: &str,
        streams: usize,
        deadline: Instant,
    ) -> Result<Vec<TcpStream>, String> {
        self.binds.take(token, node, streams, deadline).map_err(|got| {
            format!(
                "node {node} opened {got} of {streams} data connections to this node in time (firewall on the data port, or a wrong advertise address on that node?)"
            )
        })
    }

    /// Opens (or reuses) `streams` connections to `data_addr` and binds them to `token`.
    pub fn dial(
        &self,
        data_addr: &str,
        token: &[u8; 16],
        me: &str,
        streams: usize,
    ) -> Result<Vec<TcpStream>, String> {
        let addr: SocketAddr = data_addr
            .parse()
            .map_err(|_| format!("bad data address {data_addr}"))?;
        let mut out = Vec::with_capacity(streams);
        for i in 0..streams {
            let mut s = match self.pooled(data_addr) {
                Some(s) => s,
                None => TcpStream::connect_timeout(&addr, Duration::from_secs(5))
                    .map_err(|e| format!("connecting to {data_addr}: {e}"))?,
            };
            s.set_nonblocking(false).map_err(|e| e.to_string())?;
            s.set_nodelay(true).map_err(|e| e.to_string())?;
            let stream =
                u32::try_from(i).map_err(|_| format!("data stream {i} does not fit u32"))?;
            s.write_all(&encode_bind(token, me, stream))
                .map_err(|e| format!("binding a data connection to {data_addr}: {e}"))?;
            out.push(s);
        }
        Ok(out)
    }

    /// A pooled connection to `addr` that still looks open.
    fn pooled(&self, addr: &str) -> Option<TcpStream> {
        let mut idle = lock(&self.idle);
        let v = idle.get_mut(addr)?;
        while let Some(s) = v.pop() {
            let _ = s.set_nonblocking(true);
            let mut b = [0u8; 1];
            // A closed peer reads as EOF; an open idle one would block.
            match s.peek(&mut b) {
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Some(s),
                _ => continue,
            }
        }
        None
    }

    /// Keeps sending connections for the next communicator with the same peer.
    pub fn give_back(&self, addr: &str, streams: Vec<TcpStream>) {
        let mut idle = lock(&self.idle);
        let v = idle.entry(addr.to_string()).or_default();
        v.extend(streams);
        // Bound the pool: a peer rarely needs more than a few communicators' worth at once.
        let excess = v.len().saturating_sub(64);
        v.drain(..excess);
    }

    /// Pooled connections, for status.
    pub fn pooled_count(&self) -> usize {
        lock(&self.idle).values().map(Vec::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_round_trip_and_rejects() {
        let t = [7u8; 16];
        let b = encode_bind(&t, "10.0.0.1:7400", 3);
        assert_eq!(decode_bind(&b), Some((t, "10.0.0.1:7400".to_string(), 3)));
        let mut bad = b;
        bad[0] = 0;
        assert_eq!(decode_bind(&bad), None);
        let mut long = b;
        long[24..26].copy_from_slice(&999u16.to_le_bytes());
        assert_eq!(decode_bind(&long), None);
    }

    #[test]
    fn dial_take_and_pool_reuse() {
        let lo = "127.0.0.1".parse().unwrap();
        let dp = DataPlane::start(lo, 0, lo).unwrap();
        let token = [1u8; 16];
        let tx = dp.dial(&dp.addr.to_string(), &token, "me:1", 2).unwrap();
        let rx = dp
            .take_incoming(&token, "me:1", 2, Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!(rx.len(), 2);
        // A connection handed back is reused for the next communicator (no new accept).
        dp.give_back(&dp.addr.to_string(), tx);
        for s in rx {
            dp.clone().await_bind(s);
        }
        let token2 = [2u8; 16];
        let tx2 = dp.dial(&dp.addr.to_string(), &token2, "me:1", 2).unwrap();
        assert_eq!(dp.pooled_count(), 0);
        let rx2 = dp
            .take_incoming(&token2, "me:1", 2, Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert_eq!((tx2.len(), rx2.len()), (2, 2));
        // Unknown token: nothing arrives, the wait ends with a message naming the node.
        let e = dp
            .take_incoming(
                &[9u8; 16],
                "other:1",
                1,
                Instant::now() + Duration::from_millis(50),
            )
            .unwrap_err();
        assert!(e.contains("other:1"), "{e}");
    }
}
