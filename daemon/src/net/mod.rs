//! Across nodes: the daemon-wide network context (node id, data listener and connection pool),
//! and one thread per multi-node communicator that owns its [`wire::Wire`] and runs everything of
//! that communicator in posting order: collectives through the hierarchical algorithms of
//! [`algo`], cross-node sends and receives, and intra-node steps that must stay ordered with them.
//!
//! Failure model: any error on the wire (peer closed, silent for `peer_timeout`, mismatched
//! collective, op timeout) fails the op with a message naming the node and its ranks, tells every
//! peer (ABORT with the message), and breaks the communicator on this node; the peers do the same
//! when they receive the ABORT, so every rank learns within the peer timeout. Other communicators
//! have their own threads and streams and keep running.
//!
//! The thread is `thread` (connecting, the command loop, failures), `p2p` (cross-node sends and
//! receives, host-staged GPU ones) and `coll` (collectives over the wire or the switch).

pub mod algo;
mod binds;
pub mod conn;
pub mod link;
pub mod peer_client;
pub mod rdma;
pub mod staging;
pub mod switchpath;
pub mod wire;

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use commd_proto::desc::{OpKind, status};

use crate::posted::Posted;
use algo::{Coll, Scratch, Topo, Tuning};
use conn::DataPlane;
use link::Link;
use rdma::{Offer, RdmaCtx, Transport};
use wire::{CLASS_P2P, NetError, PeerLinks, RecvId, SendId, Sig, Tag, Wire};

/// Daemon-wide network state (absent when the peer service is off).
#[derive(Debug)]
pub struct NetCtx {
    /// This node's id: its advertised peer-service address.
    pub node: String,
    pub data: Arc<DataPlane>,
    pub streams: usize,
    pub peer_timeout: Duration,
    pub tuning: Tuning,
    /// Mutual TLS for the peer service (PEM contents), when configured.
    pub tls: Option<PeerTls>,
    /// Switch sessions (config `switch*`), and the advertised IPv4 workers send from by default.
    pub switch: crate::switch::Settings,
    pub switch_ip: Option<std::net::Ipv4Addr>,
    /// `transport`: auto, tcp or rdma.
    pub transport: String,
    /// This daemon's RDMA transport, or why it has none.
    pub rdma: Result<Arc<RdmaCtx>, String>,
}

impl NetCtx {
    /// What this node tells the others about RDMA at rendezvous.
    pub fn offer(&self) -> Offer {
        match (&self.rdma, self.transport.as_str()) {
            (_, "tcp") => Offer {
                desc: String::new(),
                off: "transport=tcp on that node".into(),
            },
            (Ok(r), _) => Offer {
                desc: r.desc.clone(),
                off: String::new(),
            },
            (Err(why), _) => Offer {
                desc: String::new(),
                off: why.clone(),
            },
        }
    }
}

/// PEM contents of this daemon's certificate, key and the CA all daemons trust.
#[derive(Clone)]
pub struct PeerTls {
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
    pub ca: Vec<u8>,
}

impl std::fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerTls(..)")
    }
}

/// Work for a communicator's net thread, run in the order submitted.
pub enum Cmd {
    /// A matched collective: this node's ops (ascending rank) and the plan input.
    Coll { coll: Coll, ops: Vec<Posted> },
    /// A send to, or receive from, a rank on another node.
    P2p(Box<Posted>),
    /// An intra-node step that must stay ordered with the network work.
    Run(Box<dyn FnOnce() + Send>),
    /// This node gives up on the communicator (a local rank died, shutdown): tell the peers.
    /// The communicator failed with this status and message: tell the other nodes.
    Abort(u32, String),
    /// Every local rank left: end cleanly (peers see END, connections go back to the pool).
    End,
}

/// The communicator's handle on its net thread.
pub struct NetHandle {
    tx: Mutex<mpsc::Sender<Cmd>>,
    wake: Arc<OwnedFd>,
    pub topo: Topo,
    ended: AtomicBool,
    /// The communicator's switch session, for `commd status`.
    pub switch: Arc<Mutex<switchpath::SwitchInfo>>,
}

impl std::fmt::Debug for NetHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NetHandle(node {} of {})",
            self.topo.me,
            self.topo.nodes.len()
        )
    }
}

impl NetHandle {
    /// Queues `c`; gives it back if the thread is gone (the caller fails its ops).
    #[allow(clippy::result_large_err)] // the command itself is the error: its ops must complete
    pub fn submit(&self, c: Cmd) -> Result<(), Cmd> {
        let r = self
            .tx
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(c)
            .map_err(|e| e.0);
        let _ = rustix::io::write(&*self.wake, &1u64.to_ne_bytes());
        r
    }

    pub fn end(&self) {
        if !self.ended.swap(true, Ordering::AcqRel) {
            let _ = self.submit(Cmd::End);
        }
    }
}

/// Per-communicator parameters for [`start`].
pub struct Setup {
    pub token: [u8; 16],
    pub topo: Topo,
    /// Peer data addresses by node.
    pub data_addrs: Vec<String>,
    /// What each node said about its RDMA transport.
    pub offers: Vec<Offer>,
    pub label: String,
    pub comm_id: u64,
    pub op_timeout: Duration,
    /// The communicator's `switch` option (None: the daemon's `switch` setting).
    pub switch: Option<String>,
    /// Breaks the communicator on this node (fails queued and later ops).
    pub on_fail: Box<dyn Fn(u32, String) + Send>,
}

/// Starts the communicator's net thread; it connects to the peers first (queued work waits).
pub fn start(ctx: &Arc<NetCtx>, s: Setup) -> std::io::Result<NetHandle> {
    let (tx, rx) = mpsc::channel();
    let wake = Arc::new(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )?);
    let h = NetHandle {
        tx: Mutex::new(tx),
        wake: wake.clone(),
        topo: s.topo.clone(),
        ended: AtomicBool::new(false),
        switch: Arc::new(Mutex::new(switchpath::SwitchInfo::default())),
    };
    let ctx = ctx.clone();
    let info = h.switch.clone();
    std::thread::Builder::new()
        .name(format!("commd-net-{}", s.comm_id))
        .spawn(move || Thread::run(ctx, s, rx, wake, info))?;
    Ok(h)
}

mod coll;
mod p2p;
mod thread;

use p2p::{Inflight, StagedP2p};
use thread::Thread;
