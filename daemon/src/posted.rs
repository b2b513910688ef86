//! A posted op: what one rank asked a communicator for, validated against its session, with
//! its resolved buffers (host and GPU), its doorbell for GPU ops, and where its completion
//! goes (`Origin`). Communicators (`comm`) queue and match posted ops; the host engine, the
//! GPU executor and the network threads run and complete them, so this sits below all of them.
//!
//! May use: `cuda` (doorbells), `engine` (buffers), `telemetry`, `commd_proto`.

use std::sync::Arc;
use std::time::Instant;

use commd_proto::desc::{Op, OpKind, status};

use crate::cuda::{self, GpuBufs};
use crate::engine::RankBufs;

/// A stream-ordered GPU op's doorbell: its session slot and tickets `ticket .. ticket + phases`.
/// A persistent op (`graph`): its graph doorbell slot, with `ticket` 1 (`commd_proto::graph`).
#[derive(Clone, Copy, Debug)]
pub struct CudaTicket {
    pub slot: u32,
    pub ticket: u32,
    pub phases: u32,
    /// `slot` is a graph doorbell (`desc::graph_doorbell`) of an op captured into a CUDA graph.
    pub graph: bool,
    /// The communicator's own doorbell slot in the session (where a failed replay's status is
    /// also written, so the communicator's error check sees it).
    pub comm_slot: u32,
}

/// The client session an op came from, as communicators see it (implemented by
/// `session::Session`, which posts the ops): where an op's completion goes, and, for GPU ops,
/// its doorbells (`cuda::Client`).
pub trait Origin: cuda::Client {
    /// `source`: the completion's `source` field (1 + the sender's rank for a receive from any
    /// source that succeeded, else 0).
    fn complete(
        &self,
        user_data: u64,
        comm: u32,
        seq: u64,
        st: u32,
        msg: Option<String>,
        source: u64,
    );
}

/// The `seq` of a receive from any source until it is matched (then its sender's number).
pub const ANY_UNMATCHED: u64 = u64::MAX;

/// One posted op, validated against its session and the communicator.
pub struct Posted {
    pub op: Op,
    pub rank: u32,
    pub session: Arc<dyn Origin>,
    pub bufs: RankBufs,
    pub posted_at: Instant,
    /// Collective sequence number, or per-pair p2p index; set on enqueue.
    pub seq: u64,
    /// Set when validation failed: the op still takes its sequence number so every rank learns
    /// of the error instead of hanging.
    pub invalid: Option<String>,
    /// GPU ops: the doorbell, and the resolved device buffers.
    pub cuda: Option<CudaTicket>,
    pub gbufs: GpuBufs,
    /// How its data moves, for metrics (`telemetry::transport`; GPU ops are `cuda_ce`).
    pub transport: &'static str,
}

/// The GPU executor completes matched ops through this (it never names `Posted`).
impl cuda::Done for Posted {
    fn complete(self: Box<Self>, st: u32, msg: Option<String>) {
        let c = self.op.comm;
        Posted::complete(&self, c, st, msg);
    }
    fn report(self: Box<Self>, st: u32, msg: Option<String>) {
        self.session
            .complete(self.op.user_data, self.op.comm, self.seq, st, msg, 0);
    }
}

impl Posted {
    pub(crate) fn describe(&self) -> String {
        match self.op.kind {
            OpKind::Send => format!(
                "send to rank {} (#{}, {} x {})",
                self.op.peer,
                self.seq,
                self.op.count,
                self.op.dtype.name()
            ),
            OpKind::Recv if self.op.any_source && self.seq == ANY_UNMATCHED => format!(
                "recv from any rank ({} x {})",
                self.op.count,
                self.op.dtype.name()
            ),
            OpKind::Recv => format!(
                "recv from rank {} (#{}, {} x {})",
                self.op.peer,
                self.seq,
                self.op.count,
                self.op.dtype.name()
            ),
            k => format!("{} seq {}", k.name(), self.seq),
        }
    }

    pub(crate) fn signature(&self) -> String {
        let o = &self.op;
        let mut s = format!(
            "{}(dtype={}, count={}",
            o.kind.name(),
            o.dtype.name(),
            o.count
        );
        if let Some(r) = o.redop {
            s.push_str(&format!(", op={}", r.name()));
        }
        if o.kind.has_root() {
            s.push_str(&format!(", root={}", o.peer));
        }
        if o.cuda_ticket.is_some() {
            s.push_str(", memory=cuda");
        }
        if o.persistent {
            s.push_str(", captured");
        }
        if o.one_shot {
            s.push_str(", algo=one-shot");
        }
        if o.staged {
            s.push_str(", host-staged");
        }
        s.push(')');
        s
    }

    /// The doorbell of a posted GPU op (`None` for host ops).
    pub fn bell(&self) -> Option<cuda::Bell> {
        self.cuda.map(|c| cuda::Bell {
            session: self.session.clone() as Arc<dyn cuda::Client>,
            rank: self.rank,
            slot: c.slot,
            ticket: c.ticket,
            graph: c.graph,
            comm_slot: c.comm_slot,
        })
    }

    /// Completes the op. A failed GPU op also releases its stream: the doorbell's error word is
    /// set and its done counter advanced past every phase (docs/contracts.md #5).
    pub(crate) fn complete(&self, comm: u32, st: u32, msg: Option<String>) {
        if st != status::OK
            && let Some(c) = self.cuda
            && c.graph
        {
            // A captured op that cannot be registered: every replay of it fails with this
            // status and message (its graph doorbell is released at each firing).
            if let Ok(cu) = cuda::get() {
                cu.poison_graph_op(
                    self.bell().into_iter().collect(),
                    c.phases,
                    st,
                    msg.clone().unwrap_or_default(),
                );
            }
        } else if st != status::OK
            && let Some(c) = self.cuda
        {
            cuda::fail_doorbell(
                &*self.session,
                c.slot,
                c.ticket.wrapping_add(c.phases.max(1) - 1),
                st,
            );
        }
        let transport = if self.cuda.is_some() {
            crate::telemetry::transport::CUDA
        } else {
            self.transport
        };
        crate::telemetry::op_done(&self.op, transport, st, self.posted_at.elapsed());
        let source = if self.op.any_source && st == status::OK {
            u64::from(self.op.peer) + 1
        } else {
            0
        };
        self.session
            .complete(self.op.user_data, comm, self.seq, st, msg, source);
    }
}
