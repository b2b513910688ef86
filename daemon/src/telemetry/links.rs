//! Per-link traffic counters: the API data-path code (transports) calls.
//!
//! A *link* is one path that data takes into or out of this daemon: host shared memory to the
//! local clients (`shm`), one GPU's copy-engine path to another GPU, and (from the network
//! transports) a connection to a peer daemon or an RDMA NIC port. Every link has cumulative rx/tx
//! byte and packet counters. `commd stat -l` shows every registered link with rates; `/metrics`
//! exports them as `commd_link_bytes_total` / `commd_link_packets_total` with the labels `link`,
//! `kind`, `peer`, `nic` and `direction`.
//!
//! ```
//! use commd_daemon::telemetry::{register_link, LinkDesc};
//! // Once, when the path is set up (peer connected, NIC port opened):
//! let link = register_link(LinkDesc { name: "tcp:10.0.0.2:7400", kind: "tcp", peer: "node-b", nic: "eth0" });
//! // On the data path, per send/receive: two relaxed atomic adds, no lock, no allocation.
//! link.tx(65536, 1);
//! link.rx(4096, 1);
//! ```
//!
//! Registering a name again returns the same counters (a reconnect continues the totals), so the
//! counters stay monotonic as Prometheus expects. Links live as long as the daemon; register one
//! per peer (or per NIC port and peer), not per connection attempt. "Packets" are whatever unit
//! the transport sends (a TCP write, an RDMA work request, a copy); say which in its docs.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock, RwLock};

/// What a link is, for display and labels.
#[derive(Clone, Copy, Debug)]
pub struct LinkDesc<'a> {
    /// Unique name, e.g. `shm`, `gpu0-gpu1`, `tcp:10.0.0.2:7400`.
    pub name: &'a str,
    /// The transport: `shm`, `cuda_p2p`, `cuda_staged`, `cuda_local`, `tcp`, `rdma`, ...
    pub kind: &'a str,
    /// Who is at the other end: `local`, `gpu1`, a node name or address.
    pub peer: &'a str,
    /// The local device the link uses (`eth0`, `erdma_0/1`, `gpu0`), or `-`.
    pub nic: &'a str,
}

#[derive(Debug)]
struct Counters {
    name: String,
    kind: String,
    peer: String,
    nic: String,
    rx_bytes: AtomicU64,
    tx_bytes: AtomicU64,
    rx_packets: AtomicU64,
    tx_packets: AtomicU64,
}

/// A handle to one link's counters; cheap to clone, and safe to use from any thread.
#[derive(Clone, Debug)]
pub struct Link(Arc<Counters>);

/// Which way data went, seen from this daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Rx,
    Tx,
}

impl Link {
    /// Counts data sent on this link.
    #[inline]
    pub fn tx(&self, bytes: u64, packets: u64) {
        self.0.tx_bytes.fetch_add(bytes, Relaxed);
        self.0.tx_packets.fetch_add(packets, Relaxed);
    }

    /// Counts data received on this link.
    #[inline]
    pub fn rx(&self, bytes: u64, packets: u64) {
        self.0.rx_bytes.fetch_add(bytes, Relaxed);
        self.0.rx_packets.fetch_add(packets, Relaxed);
    }

    #[inline]
    pub fn add(&self, dir: Direction, bytes: u64, packets: u64) {
        match dir {
            Direction::Rx => self.rx(bytes, packets),
            Direction::Tx => self.tx(bytes, packets),
        }
    }

    pub fn name(&self) -> &str {
        &self.0.name
    }

    pub fn snapshot(&self) -> LinkSnapshot {
        let c = &self.0;
        LinkSnapshot {
            name: c.name.clone(),
            kind: c.kind.clone(),
            peer: c.peer.clone(),
            nic: c.nic.clone(),
            rx_bytes: c.rx_bytes.load(Relaxed),
            tx_bytes: c.tx_bytes.load(Relaxed),
            rx_packets: c.rx_packets.load(Relaxed),
            tx_packets: c.tx_packets.load(Relaxed),
        }
    }
}

/// One link's counters at one moment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkSnapshot {
    pub name: String,
    pub kind: String,
    pub peer: String,
    pub nic: String,
    pub rx_bytes: u64,
    pub tx_bytes: u64,
    pub rx_packets: u64,
    pub tx_packets: u64,
}

/// Every registered link, in registration order.
#[derive(Debug, Default)]
pub struct LinkRegistry {
    links: RwLock<Vec<Link>>,
}

impl LinkRegistry {
    /// Registers a link, or returns the one registered under the same name.
    pub fn register(&self, d: LinkDesc<'_>) -> Link {
        if let Some(l) = self.get(d.name) {
            return l;
        }
        let mut links = self.links.write().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = links.iter().find(|l| l.0.name == d.name) {
            return l.clone();
        }
        let l = Link(Arc::new(Counters {
            name: d.name.to_string(),
            kind: d.kind.to_string(),
            peer: d.peer.to_string(),
            nic: d.nic.to_string(),
            rx_bytes: AtomicU64::new(0),
            tx_bytes: AtomicU64::new(0),
            rx_packets: AtomicU64::new(0),
            tx_packets: AtomicU64::new(0),
        }));
        tracing::debug!(target: "commd::telemetry", link = d.name, kind = d.kind, peer = d.peer, nic = d.nic, "link registered");
        links.push(l.clone());
        l
    }

    pub fn get(&self, name: &str) -> Option<Link> {
        let links = self.links.read().unwrap_or_else(|e| e.into_inner());
        links.iter().find(|l| l.0.name == name).cloned()
    }

    pub fn snapshot(&self) -> Vec<LinkSnapshot> {
        let links = self.links.read().unwrap_or_else(|e| e.into_inner());
        links.iter().map(Link::snapshot).collect()
    }
}

/// The daemon's link registry.
pub fn registry() -> &'static LinkRegistry {
    static R: OnceLock<LinkRegistry> = OnceLock::new();
    R.get_or_init(LinkRegistry::default)
}

/// Registers a link in the daemon's registry (see the module docs).
pub fn register_link(d: LinkDesc<'_>) -> Link {
    registry().register(d)
}

/// Cold-path convenience: counts on the link registered as `name` (a read lock and a scan; keep
/// the [`Link`] on hot paths). Returns false when no such link is registered.
pub fn link_bytes(name: &str, dir: Direction, bytes: u64, packets: u64) -> bool {
    match registry().get(name) {
        Some(l) => {
            l.add(dir, bytes, packets);
            true
        }
        None => false,
    }
}

/// The host shared-memory link: rx = bytes the daemon read from clients' registered buffers,
/// tx = bytes it wrote into them; one packet per buffer range read or written.
pub fn shm() -> &'static Link {
    static SHM: OnceLock<Link> = OnceLock::new();
    SHM.get_or_init(|| {
        register_link(LinkDesc {
            name: "shm",
            kind: "shm",
            peer: "local",
            nic: "-",
        })
    })
}

/// GPU copy-engine links: `[from][to]` is GPU `from`'s link towards GPU `to`.
static GPU_LINKS: OnceLock<Vec<Vec<Link>>> = OnceLock::new();

/// Registers one link per ordered GPU pair (and one per GPU for device-local copies). `kind(a, b)`
/// names the path between two GPUs (`cuda_p2p`, `cuda_staged`).
pub fn register_gpus(n: usize, kind: impl Fn(usize, usize) -> &'static str) {
    let _ = GPU_LINKS.set(
        (0..n)
            .map(|a| {
                (0..n)
                    .map(|b| {
                        let (name, k, peer) = if a == b {
                            (format!("gpu{a}-local"), "cuda_local", format!("gpu{a}"))
                        } else {
                            (format!("gpu{a}-gpu{b}"), kind(a, b), format!("gpu{b}"))
                        };
                        register_link(LinkDesc {
                            name: &name,
                            kind: k,
                            peer: &peer,
                            nic: &format!("gpu{a}"),
                        })
                    })
                    .collect()
            })
            .collect(),
    );
}

/// Counts one copy-engine copy of `bytes` from GPU `from` to GPU `to`: tx on `from`'s link to
/// `to`, rx on `to`'s link from `from`.
#[inline]
pub fn gpu_copy(from: usize, to: usize, bytes: u64) {
    let Some(t) = GPU_LINKS.get() else { return };
    if let Some(l) = t.get(from).and_then(|r| r.get(to)) {
        l.tx(bytes, 1);
    }
    if let Some(l) = t.get(to).and_then(|r| r.get(from)) {
        l.rx(bytes, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_name_shares_counters_and_snapshots_add_up() {
        let r = LinkRegistry::default();
        let d = LinkDesc {
            name: "tcp:a",
            kind: "tcp",
            peer: "a",
            nic: "eth0",
        };
        let a = r.register(d);
        let b = r.register(d);
        a.tx(100, 1);
        b.tx(50, 2);
        b.rx(7, 1);
        assert!(r.get("tcp:b").is_none());
        let s = r.snapshot();
        assert_eq!(s.len(), 1);
        assert_eq!(
            (
                s[0].tx_bytes,
                s[0].tx_packets,
                s[0].rx_bytes,
                s[0].rx_packets
            ),
            (150, 3, 7, 1)
        );
        assert_eq!((s[0].kind.as_str(), s[0].nic.as_str()), ("tcp", "eth0"));
    }

    #[test]
    fn counters_are_exact_under_concurrent_updates() {
        let r = Arc::new(LinkRegistry::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let r = r.clone();
                std::thread::spawn(move || {
                    let l = r.register(LinkDesc {
                        name: "x",
                        kind: "shm",
                        peer: "local",
                        nic: "-",
                    });
                    for _ in 0..10_000 {
                        l.rx(3, 1);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let s = &r.snapshot()[0];
        assert_eq!((s.rx_bytes, s.rx_packets), (120_000, 40_000));
    }
}
