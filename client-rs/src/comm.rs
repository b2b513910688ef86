//! [`Communicator`]: joining one, and posting host ops on it.

use std::marker::PhantomData;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::{At, Client, CommOptions, Error, Inner, Pending, Request, Result, gpu};
use commd_proto::desc::{DType, OpKind, RedOp, SubmitDesc};
use commd_proto::pb;

/// A communicator handle in this session. Destroyed on drop (other ranks' later ops then fail
/// with "peer lost").
pub struct Communicator {
    pub(crate) client: Arc<Inner>,
    pub(crate) handle: u32,
    pub(crate) comm_id: u64,
    pub(crate) rank: u32,
    pub(crate) nranks: u32,
    pub(crate) doorbell_slot: u32,
    /// Nodes the communicator spans (its GPU ops are host-staged above 1).
    pub(crate) nodes: u32,
    /// How its data moves, as the daemon described it at init.
    pub(crate) paths: Vec<String>,
    /// Two of its ranks on this node are one process (the daemon's word at init): eager ops
    /// never take the direct path, whose setup blocks a rank until every rank takes part.
    pub(crate) ranks_share_a_process: bool,
    /// The op timeout asked for at creation (the daemon's default when `None`): how long a
    /// direct captured op waits for a peer (docs/design-gpu.md, direct collectives rule 4).
    pub(crate) op_timeout: Option<Duration>,
    pub(crate) gpu: Mutex<gpu::CommGpu>,
    /// Memory windows and one-sided ops (`gpu::rma`).
    pub(crate) rma: Mutex<gpu::rma::Rma>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator(comm {}, rank {}/{})",
            self.comm_id, self.rank, self.nranks
        )
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        // No stream waits for a signal of this communicator after it is gone.
        self.release_windows();
        let i = &self.client;
        if i.owned_here() && i.ring.session_error().load(Ordering::Acquire) == 0 {
            // A direct op of it that a peer's daemon mark failed, not yet told: the peer
            // waiting on the daemon's path gets that reason, not only "destroyed".
            i.report_direct_failures(None);
            let _ = i.watched(i.rpc.clone().destroy_communicator(pb::CommRef {
                session_id: i.session_id,
                comm: self.handle,
            }));
        }
    }
}

/// The `peer` of a host receive that takes whichever rank's message comes first
/// ([`Request::source`] then names the sender; communicators on one node only).
pub const ANY_SOURCE: u32 = u32::MAX;

/// Arguments of one op, for [`Communicator::post`].
#[derive(Clone, Copy, Debug)]
pub struct OpArgs<'b> {
    pub kind: OpKind,
    pub dtype: DType,
    pub redop: Option<RedOp>,
    pub count: u64,
    /// Root (broadcast, reduce) or peer (send, recv; [`ANY_SOURCE`] for a host recv from any rank).
    pub peer: u32,
    pub send: Option<At<'b>>,
    pub recv: Option<At<'b>>,
}

#[allow(unsafe_code)] // the ring and doorbell pages are shared memory mapped from the daemon
impl Communicator {
    pub fn rank(&self) -> u32 {
        self.rank
    }
    pub fn nranks(&self) -> u32 {
        self.nranks
    }
    /// Nodes (daemons) this communicator spans: above 1, its GPU ops go through host staging
    /// in the daemons (see `commd_proto::desc::flags::HOST_STAGED`).
    pub fn nodes(&self) -> u32 {
        self.nodes
    }
    pub fn id(&self) -> u64 {
        self.comm_id
    }
    /// How the communicator's data moves on this node, one line per path, as the daemon
    /// described it at init ("0-3 (every local pair) via SHM: ..."); empty for one rank.
    pub fn paths(&self) -> &[String] {
        &self.paths
    }
    pub fn handle(&self) -> u32 {
        self.handle
    }
    /// Whether two of this communicator's ranks on this node are one process (threads of it,
    /// or one thread driving several GPUs), as the daemon said at init.
    pub fn ranks_share_a_process(&self) -> bool {
        self.ranks_share_a_process
    }

    /// Caps the bandwidth of the daemon's GPU copies for this communicator at `bytes_per_sec`
    /// (`None` or `Some(0)`: uncapped; else at least 1 MB/s). Applies to every rank of the
    /// communicator on this node, from its next copy phase on; any rank may call it.
    pub fn set_pacing(&self, bytes_per_sec: Option<u64>) -> Result<()> {
        let i = &self.client;
        i.check_owner()?;
        i.watched(i.rpc.clone().set_comm_pacing(pb::SetCommPacingRequest {
            session_id: i.session_id,
            comm: self.handle,
            bytes_per_sec: bytes_per_sec.unwrap_or(0),
        }))?
        .map_err(|s| Error::rpc("set_comm_pacing", s))?;
        Ok(())
    }

    /// Fails the communicator for every rank (`status`, a failure code of
    /// `commd_proto::desc::status`; `message`, why): every queued and later op of every rank
    /// fails at once with them, and the local ranks' direct ops stop. For a failure the other
    /// ranks cannot see where they wait (a direct op of this rank whose peer sent the same op
    /// to the daemon: docs/design-gpu.md, direct collectives rule 8). Any rank may call it.
    pub fn fail(&self, status: u32, message: &str) -> Result<()> {
        self.client.fail_comm(self.handle, status, message)
    }

    /// Why the daemon holds this communicator broken for good (a rank's process lost, an op
    /// timed out, a rank failed it: [`Communicator::fail`]): the status its ops fail with and
    /// the reason, or `None` while it works. One round trip to the daemon; the cheap check is
    /// [`Communicator::is_broken`].
    pub fn failure(&self) -> Result<Option<(u32, String)>> {
        self.client.comm_failure(self.handle)
    }

    /// Posts an op; every buffer it names must belong to this client.
    pub fn post<'b>(&self, a: OpArgs<'b>) -> Result<Pending<'b>> {
        let user_data = self.submit(a)?;
        Ok(Pending {
            client: self.client.clone(),
            user_data,
            done: false,
            _bufs: PhantomData,
        })
    }

    fn submit(&self, a: OpArgs<'_>) -> Result<u64> {
        for b in [a.send, a.recv].into_iter().flatten() {
            if !Arc::ptr_eq(&b.0.client, &self.client) {
                return Err(Error::InvalidArgument(format!(
                    "{:?} belongs to another client session",
                    b.0
                )));
            }
        }
        let any = a.kind == OpKind::Recv && a.peer == ANY_SOURCE;
        let d = SubmitDesc {
            user_data: 0,
            opcode: a.kind.code(),
            dtype: a.dtype.code(),
            redop: a.redop.map(|r| r.code()).unwrap_or(0),
            flags: if any {
                commd_proto::desc::flags::ANY_SOURCE
            } else {
                0
            },
            comm: self.handle,
            peer: if any { 0 } else { a.peer },
            count: a.count,
            send_mem: a.send.map(|b| b.0.mem_id).unwrap_or(0),
            recv_mem: a.recv.map(|b| b.0.mem_id).unwrap_or(0),
            send_off: a.send.map(|b| b.1).unwrap_or(0),
            recv_off: a.recv.map(|b| b.1).unwrap_or(0),
            ticket: 0,
        };
        self.client.post(d)
    }

    /// Posts an op and returns a [`Request`] that borrows nothing.
    ///
    /// # Safety
    /// Until the request completes, the caller must not read bytes the op writes nor write bytes
    /// it reads (the daemon accesses them concurrently), and must keep each named buffer's
    /// registration alive if it wants the data (a dropped buffer only loses the data).
    pub unsafe fn post_detached(&self, a: OpArgs<'_>) -> Result<Request> {
        Ok(Request::new(
            self.client.clone(),
            self.submit(a)?,
            None,
            None,
        ))
    }

    /// Posts a raw descriptor (its `comm` is set to this communicator, `user_data` assigned).
    /// Returns the op's `user_data` for [`Client::wait`].
    ///
    /// # Safety
    /// The daemon may write any memory this session registered that the descriptor names until
    /// the op completes; the caller must not access those bytes meanwhile.
    pub unsafe fn post_raw(&self, mut d: SubmitDesc) -> Result<u64> {
        d.comm = self.handle;
        self.client.post(d)
    }

    pub fn all_reduce<'b>(
        &self,
        send: At<'b>,
        recv: At<'b>,
        count: u64,
        dtype: DType,
        op: RedOp,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::AllReduce,
            dtype,
            redop: Some(op),
            count,
            peer: 0,
            send: Some(send),
            recv: Some(recv),
        })
    }
    pub fn reduce<'b>(
        &self,
        send: At<'b>,
        recv: Option<At<'b>>,
        count: u64,
        dtype: DType,
        op: RedOp,
        root: u32,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::Reduce,
            dtype,
            redop: Some(op),
            count,
            peer: root,
            send: Some(send),
            recv,
        })
    }
    pub fn reduce_scatter<'b>(
        &self,
        send: At<'b>,
        recv: At<'b>,
        recv_count: u64,
        dtype: DType,
        op: RedOp,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::ReduceScatter,
            dtype,
            redop: Some(op),
            count: recv_count,
            peer: 0,
            send: Some(send),
            recv: Some(recv),
        })
    }
    pub fn all_gather<'b>(
        &self,
        send: At<'b>,
        recv: At<'b>,
        send_count: u64,
        dtype: DType,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::AllGather,
            dtype,
            redop: None,
            count: send_count,
            peer: 0,
            send: Some(send),
            recv: Some(recv),
        })
    }
    pub fn broadcast<'b>(
        &self,
        send: Option<At<'b>>,
        recv: At<'b>,
        count: u64,
        dtype: DType,
        root: u32,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::Broadcast,
            dtype,
            redop: None,
            count,
            peer: root,
            send,
            recv: Some(recv),
        })
    }
    pub fn all_to_all<'b>(
        &self,
        send: At<'b>,
        recv: At<'b>,
        count_per_peer: u64,
        dtype: DType,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::AllToAll,
            dtype,
            redop: None,
            count: count_per_peer,
            peer: 0,
            send: Some(send),
            recv: Some(recv),
        })
    }
    pub fn send<'b>(
        &self,
        buf: At<'b>,
        count: u64,
        dtype: DType,
        peer: u32,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::Send,
            dtype,
            redop: None,
            count,
            peer,
            send: Some(buf),
            recv: None,
        })
    }
    pub fn recv<'b>(
        &self,
        buf: At<'b>,
        count: u64,
        dtype: DType,
        peer: u32,
    ) -> Result<Pending<'b>> {
        self.post(OpArgs {
            kind: OpKind::Recv,
            dtype,
            redop: None,
            count,
            peer,
            send: None,
            recv: Some(buf),
        })
    }
    pub fn barrier(&self) -> Result<Pending<'static>> {
        self.post(OpArgs {
            kind: OpKind::Barrier,
            dtype: DType::U8,
            redop: None,
            count: 0,
            peer: 0,
            send: None,
            recv: None,
        })
    }
}

/// A timeout as the request carries it: milliseconds, at least 1 (0 means the daemon's default),
/// saturated at u64::MAX (a timeout that long is forever all the same).
fn timeout_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis().max(1)).unwrap_or(u64::MAX)
}

impl Client {
    /// Joins the communicator `unique_id` as `rank` of `nranks`; returns when all ranks joined.
    pub fn communicator(&self, unique_id: &[u8], rank: u32, nranks: u32) -> Result<Communicator> {
        self.communicator_with(unique_id, rank, nranks, CommOptions::default())
    }

    pub fn communicator_with(
        &self,
        unique_id: &[u8],
        rank: u32,
        nranks: u32,
        o: CommOptions,
    ) -> Result<Communicator> {
        let i = &self.inner;
        i.check_owner()?;
        let req = pb::CreateCommunicatorRequest {
            session_id: i.session_id,
            unique_id: unique_id.to_vec(),
            rank,
            nranks,
            op_timeout_ms: o.op_timeout.map_or(0, timeout_ms),
            join_timeout_ms: o.join_timeout.map_or(0, timeout_ms),
            switch: o.switch.clone().unwrap_or_default(),
            pacing_bytes_per_sec: o.pacing_bytes_per_sec,
            name: o.name.clone().unwrap_or_default(),
        };
        let r = i
            .watched(i.rpc.clone().create_communicator(req))?
            .map_err(|s| Error::rpc("create_communicator", s))?;
        Ok(Communicator::joined(
            &self.inner,
            r.into_inner(),
            (rank, nranks),
            o.op_timeout,
        ))
    }
}

/// How [`Communicator::shrink`] treats the parent's ops.
#[derive(Clone, Debug, Default)]
pub struct ShrinkOptions {
    /// Revoke the parent first, failing its queued ops on every rank (NCCL's
    /// `NCCL_SHRINK_ABORT`, torch's `SHRINK_ABORT`); else this rank's ops on it finish first.
    pub abort: bool,
    /// The child's options: `op_timeout` (the parent's when `None`), `join_timeout`, `name`
    /// (the parent's when `None`). Switch and pacing are the parent's.
    pub comm: CommOptions,
}

impl Communicator {
    fn joined(
        client: &Arc<Inner>,
        r: pb::CreateCommunicatorReply,
        (rank, nranks): (u32, u32),
        op_timeout: Option<Duration>,
    ) -> Self {
        Communicator {
            client: client.clone(),
            handle: r.comm,
            comm_id: r.comm_id,
            rank,
            nranks,
            doorbell_slot: r.doorbell_slot,
            nodes: r.nodes.max(1),
            paths: r.paths,
            ranks_share_a_process: r.ranks_share_a_process,
            op_timeout,
            gpu: Mutex::new(gpu::CommGpu::default()),
            rma: Mutex::new(gpu::rma::Rma::default()),
        }
    }

    /// Revokes the communicator for every rank: every queued and later op of every rank fails
    /// with [`crate::OpErrorKind::Revoked`] and a message naming this rank and `reason`. It
    /// stays valid as the parent of [`Communicator::shrink`]. Any rank may call it.
    pub fn revoke(&self, reason: &str) -> Result<()> {
        self.client
            .fail_comm(self.handle, commd_proto::desc::status::REVOKED, reason)
    }

    /// A child without the ranks in `exclude` (dead, or leaving), ranks renumbered in order
    /// (NCCL's `ncclCommShrink`): made by the daemons from this communicator's membership,
    /// with no new unique id. Every surviving rank calls it with the same list (else it fails
    /// on every rank, naming the lists); an excluded rank must not call it. This communicator
    /// may be broken (a rank lost, revoked): it stays usable as a parent until dropped.
    pub fn shrink(&self, exclude: &[u32], o: ShrinkOptions) -> Result<Communicator> {
        let i = &self.client;
        i.check_owner()?;
        let req = pb::ShrinkCommunicatorRequest {
            session_id: i.session_id,
            comm: self.handle,
            exclude: exclude.to_vec(),
            abort: o.abort,
            op_timeout_ms: o.comm.op_timeout.map_or(0, timeout_ms),
            join_timeout_ms: o.comm.join_timeout.map_or(0, timeout_ms),
            name: o.comm.name.clone().unwrap_or_default(),
        };
        let r = i
            .watched(i.rpc.clone().shrink_communicator(req))?
            .map_err(|s| match s.code() {
                // An exclude list the daemon refused, or one other survivors disagree with.
                tonic::Code::InvalidArgument => Error::InvalidArgument(s.message().to_string()),
                _ => Error::rpc("shrink_communicator", s),
            })?
            .into_inner();
        let Some(c) = r.comm else {
            return Err(Error::Rpc {
                op: "shrink_communicator",
                code: tonic::Code::Internal,
                message: "the daemon's reply names no communicator".into(),
            });
        };
        Ok(Communicator::joined(
            i,
            c,
            (r.rank, r.nranks),
            o.comm.op_timeout.or(self.op_timeout),
        ))
    }
}
