//! The RDMA transport (RoCE v2, InfiniBand, eRDMA; tested on Soft-RoCE): device selection at
//! start, reliable-connected queue pairs between daemons set up through the peer gRPC service
//! (`Peer.RdmaConnect` exchanges QPN, PSN, GID, MTU and the receive ring's address and rkey),
//! and byte streams over them ([`stream::RdmaStream`]) that the communicator's wire drives
//! exactly like its TCP streams.
//!
//! What stays daemon-wide (made once, reused by every communicator): the opened devices, their
//! protection domains, the registered staging rings (pooled), and one completion-polling thread
//! per device. Per communicator: `rdma_qps_per_peer` QPs per peer node and direction, striped
//! over the selected devices.
//!
//! libibverbs is loaded at run time: a host without rdma-core or without devices runs with TCP
//! and says why once ([`RdmaCtx::open`] returns the reason).

#![allow(unsafe_code)] // verbs calls and memory registered with the NIC

pub mod affinity;
pub mod device;
pub mod stream;

use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::DeviceContext;
use sideway::ibverbs::protection_domain::ProtectionDomain;

pub use device::GidChoice;
use stream::{Endpoint, Pending, RdmaStream, Role, Shared, Staging};

use super::binds::Binds;

/// Unclaimed incoming queue pairs (each holds a registered ring): bounds what an unauthenticated
/// caller of `Peer.RdmaConnect` can pin (use `peer_tls_*` to authenticate peers).
const MAX_UNCLAIMED: usize = 64;
/// Idle staging rings kept per device.
const MAX_POOLED: usize = 64;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One opened device port with its protection domain, ring pool and poller.
pub struct Nic {
    pub name: String,
    pub port: u8,
    pub gid_index: u32,
    pub gid: [u8; 16],
    pub lid: u16,
    pub ib: bool,
    /// Active MTU in bytes.
    pub mtu: u32,
    pub ctx: Arc<DeviceContext>,
    pub pd: Arc<ProtectionDomain>,
    ring_bytes: usize,
    pool: Mutex<Vec<Staging>>,
    watched: Mutex<Vec<Arc<Shared>>>,
    /// Rings registered so far (for status and the "no per-op registration" check).
    pub registered: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for Nic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Nic({}:{})", self.name, self.port)
    }
}

impl Nic {
    fn take_ring(&self) -> std::io::Result<Staging> {
        if let Some(r) = lock(&self.pool).pop() {
            return Ok(r);
        }
        self.registered
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Staging::new(self, self.ring_bytes)
    }

    /// Whether the provider registers dma-bufs (GPUDirect RDMA): `Ok`, or why not.
    pub fn dmabuf_probe(&self) -> Result<(), String> {
        // SAFETY: fd -1 is never a dma-buf: the call registers nothing and only tells whether
        // the provider implements dma-buf registration (the kernel then rejects the fd with
        // EBADF) or not (EOPNOTSUPP from rdma-core or the driver).
        let r = unsafe {
            self.pd
                .reg_dmabuf_mr(0, 4096, 0, -1, sideway::ibverbs::AccessFlags::LocalWrite)
        };
        match r {
            Ok(_) => Ok(()),
            Err(e) => {
                let text = format!("{e} {e:?}");
                if text.contains("Bad file descriptor") || text.contains("EBADF") {
                    Ok(())
                } else {
                    Err(text)
                }
            }
        }
    }

    fn give_back(&self, r: Staging) {
        let mut p = lock(&self.pool);
        if p.len() < MAX_POOLED && r.len() == self.ring_bytes {
            p.push(r);
        }
    }

    fn watch(&self, s: Arc<Shared>) {
        lock(&self.watched).push(s);
    }

    fn unwatch(&self, s: &Shared) {
        lock(&self.watched).retain(|x| !std::ptr::eq(Arc::as_ptr(x), s));
    }

    /// The completion poller: drains every watched QP's CQ; spins while busy, then backs off
    /// (yield, then sleeps doubling from 5 us to 1 ms) when idle.
    fn poll_loop(me: Weak<Nic>) {
        let mut idle = 0u32;
        let mut batch: Vec<Arc<Shared>> = Vec::new();
        loop {
            let Some(nic) = me.upgrade() else { return };
            batch.clear();
            batch.extend(lock(&nic.watched).iter().cloned());
            drop(nic);
            let mut got = 0;
            for s in &batch {
                got += s.poll();
            }
            batch.clear();
            if got > 0 {
                idle = 0;
                continue;
            }
            idle = idle.saturating_add(1);
            if idle < 200 {
                std::hint::spin_loop();
            } else if idle < 400 {
                std::thread::yield_now();
            } else {
                let k = (idle - 400).min(8);
                std::thread::sleep(Duration::from_micros(5u64 << k).min(Duration::from_millis(1)));
            }
        }
    }
}

/// The daemon's RDMA state: usable device ports and the queue pairs peers opened to us that no
/// communicator has claimed yet.
pub struct RdmaCtx {
    pub nics: Vec<Arc<Nic>>,
    pub qps_per_peer: usize,
    binds: Binds<RdmaStream>,
    /// One line for logs and the join request: devices, GIDs, MTUs.
    pub desc: String,
    gpu_text: std::sync::OnceLock<String>,
}

impl std::fmt::Debug for RdmaCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RdmaCtx({})", self.desc)
    }
}

/// Settings for [`RdmaCtx::open`] (from the config).
pub struct Settings<'a> {
    pub devices: &'a str,
    pub gid: &'a str,
    pub qps_per_peer: usize,
    pub ring_bytes: u64,
    pub advertise: IpAddr,
}

impl RdmaCtx {
    /// Opens the configured (or every active) device port; `Err` says why RDMA is unusable here.
    pub fn open(s: &Settings<'_>) -> Result<Arc<Self>, String> {
        let choice = GidChoice::parse(s.gid)?;
        let ports = device::probe()?;
        let wanted = device::parse_device_list(s.devices);
        let mut picked = Vec::new();
        let mut skipped = Vec::new();
        for p in &ports {
            let listed = wanted.is_empty()
                || wanted
                    .iter()
                    .any(|(d, port)| *d == p.device && port.is_none_or(|x| x == p.port));
            if !listed {
                continue;
            }
            if !p.active {
                skipped.push(format!("{}:{} port {}", p.device, p.port, p.state));
                continue;
            }
            match device::pick_gid(p, &choice, s.advertise) {
                Ok((idx, note)) => picked.push((p.clone(), idx, note)),
                Err(e) => skipped.push(e),
            }
        }
        for (d, _) in &wanted {
            if !ports.iter().any(|p| p.device == *d) {
                skipped.push(format!("rdma_device {d}: no such device"));
            }
        }
        if picked.is_empty() {
            let found: Vec<String> = ports
                .iter()
                .map(|p| format!("{}:{}", p.device, p.port))
                .collect();
            return Err(format!(
                "no usable RDMA port (found {}; {})",
                found.join(", "),
                skipped.join("; ")
            ));
        }
        for s in &skipped {
            tracing::info!(target: "commd::init", "RDMA: skipped {s}");
        }
        let list = DeviceList::new().map_err(|e| e.to_string())?;
        let mut nics = Vec::new();
        let mut descs = Vec::new();
        for (p, idx, note) in picked {
            for w in device::port_warnings(&p, idx) {
                tracing::warn!(target: "commd::init", "RDMA: {w}");
            }
            let Some(dev) = list.iter().find(|d| d.name() == p.device) else {
                continue;
            };
            let ctx = dev
                .open()
                .map_err(|e| format!("opening {}: {e}", p.device))?;
            let pd = ctx
                .alloc_pd()
                .map_err(|e| format!("protection domain on {}: {e}", p.device))?;
            let gid = ctx
                .query_gid(p.port, idx)
                .map_err(|e| format!("GID {idx} of {}:{}: {e}", p.device, p.port))?;
            let nic = Arc::new(Nic {
                name: p.device.clone(),
                port: p.port,
                gid_index: idx,
                gid: gid.raw,
                lid: p.lid,
                ib: p.is_ib(),
                mtu: p.active_mtu,
                ctx,
                pd,
                ring_bytes: commd_proto::num::usize_of(s.ring_bytes),
                pool: Mutex::new(Vec::new()),
                watched: Mutex::new(Vec::new()),
                registered: std::sync::atomic::AtomicU64::new(0),
            });
            let w = Arc::downgrade(&nic);
            std::thread::Builder::new()
                .name(format!("commd-rdma-poll-{}", p.device))
                .spawn(move || Nic::poll_loop(w))
                .map_err(|e| format!("cannot start the RDMA poller: {e}"))?;
            descs.push(format!(
                "{}:{} {} GID[{idx}] {note}, MTU {}",
                p.device, p.port, p.link, p.active_mtu
            ));
            nics.push(nic);
        }
        if nics.is_empty() {
            return Err("no RDMA device could be opened".into());
        }
        Ok(Arc::new(Self {
            nics,
            qps_per_peer: s.qps_per_peer.max(1),
            binds: Binds::new("RDMA stream", MAX_UNCLAIMED),
            desc: descs.join("; "),
            gpu_text: std::sync::OnceLock::new(),
        }))
    }

    fn nic_for(&self, stream: u32) -> &Arc<Nic> {
        &self.nics[stream as usize % self.nics.len()]
    }

    /// Sending side, step 1: a QP for stream `i` to a peer, and its endpoint to send over.
    pub fn prepare(&self, i: u32, peer: &str) -> Result<Pending, String> {
        Pending::new(self.nic_for(i), Role::Send, format!("to {peer} #{i}"))
    }

    /// Receiving side (the peer service): a peer asks to connect its stream `i` of communicator
    /// `token`; the stream waits for the communicator to claim it. Returns our endpoint.
    pub fn accept(
        &self,
        token: [u8; 16],
        node: &str,
        i: u32,
        remote: &Endpoint,
    ) -> Result<Endpoint, String> {
        let p = Pending::new(self.nic_for(i), Role::Recv, format!("from {node} #{i}"))?;
        let local = p.local.clone();
        let s = p.connect(remote)?;
        self.binds
            .offer((token, node.to_string(), i), s)
            .map_err(|_| "too many unclaimed RDMA connections".to_string())?;
        Ok(local)
    }

    /// Takes the `n` incoming streams of `node` for the communicator `token`.
    pub fn take_incoming(
        &self,
        token: &[u8; 16],
        node: &str,
        n: usize,
        deadline: Instant,
    ) -> Result<Vec<RdmaStream>, String> {
        self.binds.take(token, node, n, deadline).map_err(|got| {
            format!("node {node} connected {got} of {n} RDMA queue pairs to this node in time")
        })
    }

    /// The GPU memory path of this node's RDMA links and why (computed once, logged with every
    /// communicator's paths), plus the NIC-GPU affinity from the PCI topology.
    pub fn gpu_path_text(&self) -> String {
        self.gpu_text
            .get_or_init(|| {
                let cuda = crate::cuda::get();
                let probe = affinity::GpuProbe {
                    cuda: cuda.is_ok(),
                    // Not queried from the driver yet: the engine check below decides first.
                    cuda_dmabuf: cuda.is_ok(),
                    nic_dmabuf: self.nics[0].dmabuf_probe(),
                    engine_gpu: false,
                };
                let (_, why) = affinity::gpu_path(&probe);
                let Ok(c) = cuda else {
                    return format!("GPU memory: {why}");
                };
                let root = std::path::Path::new("/sys");
                let nics: Vec<_> = self
                    .nics
                    .iter()
                    .map(|n| affinity::pci_chain(&affinity::sysfs_links(root, &n.name, "x").0))
                    .collect();
                let gpus: Vec<_> = c
                    .gpus
                    .iter()
                    .map(|g| {
                        affinity::pci_chain(&affinity::sysfs_links(root, "x", &g.pci_bus_id).1)
                    })
                    .collect();
                let aff: Vec<String> = affinity::nics_for_gpus(&gpus, &nics)
                    .iter()
                    .enumerate()
                    .map(|(g, ns)| {
                        let names: Vec<&str> =
                            ns.iter().map(|&i| self.nics[i].name.as_str()).collect();
                        format!("GPU{g}->{}", names.join("+"))
                    })
                    .collect();
                format!("GPU memory: {why}; NIC affinity {}", aff.join(" "))
            })
            .clone()
    }

    /// Registered rings (all devices), for status.
    pub fn registered_rings(&self) -> u64 {
        self.nics
            .iter()
            .map(|n| n.registered.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }
}

static SUMMARY: std::sync::OnceLock<(&'static str, String)> = std::sync::OnceLock::new();

/// Records this daemon's inter-node transport for the communicator-init log (set once at start).
pub fn set_summary(kind: &'static str, why: String) {
    let _ = SUMMARY.set((kind, why));
}

/// `(transport, reason)` for the communicator-init log: `TCP` (why no RDMA) or `RDMA/TCP`
/// (chosen per node pair when the network thread connects; its "path to" line says which).
pub fn summary() -> (&'static str, String) {
    SUMMARY
        .get()
        .cloned()
        .unwrap_or(("TCP", "pooled TCP streams between the daemons".to_string()))
}

/// The transport for one node pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    Rdma,
}

/// What a node says about its RDMA transport at rendezvous: a description when usable, else
/// the reason (empty from daemons that predate RDMA).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offer {
    pub desc: String,
    pub off: String,
}

/// Chooses the transport to `peer_label` from this node's config (`auto`, `tcp`, `rdma`), this
/// node's offer and the peer's. Both ends compute the same answer from the same offers (a node
/// with `transport=tcp` offers no RDMA). `Ok((transport, reason))`, or the error for a forced
/// `rdma` that cannot be had.
pub fn choose(
    mode: &str,
    mine: &Offer,
    theirs: &Offer,
    peer_label: &str,
) -> Result<(Transport, String), String> {
    if mode == "tcp" {
        return Ok((Transport::Tcp, "transport=tcp on this node".into()));
    }
    let why_not = if mine.desc.is_empty() {
        Some(format!("this node has no RDMA transport ({})", mine.off))
    } else if theirs.desc.is_empty() {
        Some(format!(
            "{peer_label} has no RDMA transport ({})",
            if theirs.off.is_empty() {
                "a daemon without RDMA support"
            } else {
                &theirs.off
            }
        ))
    } else {
        None
    };
    match (why_not, mode) {
        (None, _) => Ok((
            Transport::Rdma,
            format!("both nodes have RDMA ({} <-> {})", mine.desc, theirs.desc),
        )),
        (Some(w), "rdma") => Err(format!("transport=rdma but {w}")),
        (Some(w), _) => Ok((Transport::Tcp, format!("{w}; using TCP"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_choice_is_symmetric_and_explained() {
        let yes = Offer {
            desc: "rxe0:1".into(),
            off: String::new(),
        };
        let no = Offer {
            desc: String::new(),
            off: "no RDMA devices".into(),
        };
        let old = Offer::default();
        let c = |m, a: &Offer, b: &Offer| choose(m, a, b, "node 1 (10.0.0.2:7400, ranks 2,3)");
        assert_eq!(c("auto", &yes, &yes).unwrap().0, Transport::Rdma);
        assert_eq!(c("rdma", &yes, &yes).unwrap().0, Transport::Rdma);
        let (t, why) = c("auto", &yes, &no).unwrap();
        assert_eq!(t, Transport::Tcp);
        assert!(
            why.contains("node 1") && why.contains("no RDMA devices"),
            "{why}"
        );
        let (t, why) = c("auto", &no, &yes).unwrap();
        assert_eq!(t, Transport::Tcp);
        assert!(why.contains("this node"), "{why}");
        assert!(
            c("auto", &yes, &old)
                .unwrap()
                .1
                .contains("without RDMA support")
        );
        let e = c("rdma", &yes, &no).unwrap_err();
        assert!(e.starts_with("transport=rdma but node 1"), "{e}");
        assert_eq!(c("tcp", &yes, &yes).unwrap().0, Transport::Tcp);
    }
}
