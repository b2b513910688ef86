//! Ring descriptors: plain integers only (no enums, no pointers), so any bit pattern is a valid
//! value and the daemon can decode hostile input without undefined behaviour.
//!
//! Memory is always named by `(mem_id, offset)` of a registration that belongs to the posting
//! session (docs/contracts.md #3). Count semantics follow NCCL: `count` is the per-rank
//! element count of the *smaller* buffer (send for all_gather, recv for reduce_scatter,
//! per-peer block for all_to_all).

use thiserror::Error;

/// Submission queue entry, client -> daemon. 64 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubmitDesc {
    /// Opaque to the daemon; echoed in the completion.
    pub user_data: u64,
    /// One of [`opcode`].
    pub opcode: u16,
    /// One of [`dtype`].
    pub dtype: u8,
    /// One of [`redop`] (ops that reduce), else 0.
    pub redop: u8,
    /// Bit set of [`flags`].
    pub flags: u32,
    /// Session-local communicator handle from `CreateCommunicator`.
    pub comm: u32,
    /// Root rank (broadcast, reduce) or peer rank (send, recv), else 0.
    pub peer: u32,
    /// Element count (see module docs).
    pub count: u64,
    pub send_mem: u32,
    pub recv_mem: u32,
    pub send_off: u64,
    pub recv_off: u64,
    /// With [`flags::CUDA`]: the first doorbell ticket of the op (see [`cuda_phases`]); else 0.
    pub ticket: u64,
}

/// Completion queue entry, daemon -> client. 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompletionDesc {
    pub user_data: u64,
    /// One of [`status`].
    pub status: u32,
    pub comm: u32,
    /// Sequence number of the op on its communicator (collectives), or per-peer index (p2p).
    pub seq: u64,
    /// A receive from any source ([`flags::ANY_SOURCE`]) that succeeded: 1 + the rank whose
    /// send it received. Else 0 (the field was reserved and always 0 before).
    pub source: u64,
}

const _: () = assert!(std::mem::size_of::<SubmitDesc>() == 64);
const _: () = assert!(std::mem::size_of::<CompletionDesc>() == 32);

pub mod opcode {
    pub const ALL_REDUCE: u16 = 1;
    pub const ALL_GATHER: u16 = 2;
    pub const REDUCE_SCATTER: u16 = 3;
    pub const BROADCAST: u16 = 4;
    pub const REDUCE: u16 = 5;
    pub const ALL_TO_ALL: u16 = 6;
    pub const SEND: u16 = 7;
    pub const RECV: u16 = 8;
    pub const BARRIER: u16 = 9;
}

pub mod dtype {
    pub const F32: u8 = 1;
    pub const F64: u8 = 2;
    pub const F16: u8 = 3;
    pub const BF16: u8 = 4;
    pub const I8: u8 = 5;
    pub const U8: u8 = 6;
    pub const I32: u8 = 7;
    pub const I64: u8 = 8;
    pub const U32: u8 = 9;
    pub const U64: u8 = 10;
    /// OCP fp8 E4M3 ("fn": finite, one NaN encoding per sign), NCCL's `ncclFloat8e4m3`.
    pub const F8E4M3: u8 = 11;
    /// OCP fp8 E5M2 (IEEE-like: infinities and NaNs), NCCL's `ncclFloat8e5m2`.
    pub const F8E5M2: u8 = 12;
}

pub mod redop {
    pub const SUM: u8 = 1;
    pub const PROD: u8 = 2;
    pub const MIN: u8 = 3;
    pub const MAX: u8 = 4;
    pub const AVG: u8 = 5;
    /// Bitwise and, or, xor: integer dtypes only (see [`RedOp::check_dtype`](super::RedOp::check_dtype)).
    pub const BAND: u8 = 6;
    pub const BOR: u8 = 7;
    pub const BXOR: u8 = 8;
}

pub mod flags {
    /// Stream-ordered GPU op: both buffers are CUDA registrations. The daemon starts phase `p` of
    /// the op once the client's stream has written `ticket + p` into the communicator's ready
    /// counter, and writes `ticket + p` into its done counter when the phase's copies are done
    /// (docs/contracts.md #4). The number of phases is [`cuda_phases`](super::cuda_phases).
    pub const CUDA: u32 = 1;
    /// With [`CUDA`], all-reduce only: the one-shot algorithm (every rank's whole input goes to
    /// every other rank's scratch, each rank reduces everything itself: one copy phase instead
    /// of reduce-scatter + all-gather). The client picks the algorithm (see
    /// [`cuda_one_shot_fits`](super::cuda_one_shot_fits)); every rank of the op must pick the
    /// same, else the op fails as a mismatch.
    pub const ONE_SHOT: u32 = 2;
    /// With [`CUDA`]: the op runs on a communicator that spans nodes, through host staging in
    /// the daemon (GPU -> pinned host memory -> the inter-node transport -> GPU). Such an op has
    /// one doorbell phase: the daemon starts once the stream has written `ticket`, and writes
    /// `ticket` into the done counter when the results are in the GPU buffers; reductions run
    /// in the daemon, so the client launches no kernel. The client sets it on every GPU op of a
    /// communicator whose `CreateCommunicatorReply.nodes` is above 1; the daemon fails an op
    /// whose flag disagrees with the communicator.
    pub const HOST_STAGED: u32 = 4;
    /// With [`CUDA`]: a persistent op, captured into a CUDA graph (docs/contracts.md #6).
    /// `ticket` is not a ticket: its low 32 bits are the index of the op's own graph doorbell
    /// slot ([`graph_doorbell`](super::graph_doorbell)), its high 32 bits a tag of the capture
    /// (the same for every op of one graph; the executor expects a graph's ops to fire in
    /// capture order, and the first again after the last). Posting it registers the op: the daemon matches it across ranks like any op
    /// and completes the descriptor at once; the op then runs on every replay of the graph, each
    /// time every rank's stream writes `1 + p` into the slot's ready word for phase `p`. Not
    /// with [`HOST_STAGED`].
    pub const PERSISTENT: u32 = 8;
    /// Host RECV only, `peer` 0: receive from whichever rank of the communicator sends to this
    /// rank first (torch's `recv(src=None)`, gloo's recv-from-any). The completion's `source`
    /// names the sender. The receive takes that sender's next message in per-pair order, as a
    /// receive naming it would; named receives posted after it from the same sender shift to
    /// the following messages. Communicators on one node only (the daemon fails the op with a
    /// clear error on a communicator that spans nodes). An older daemon rejects the bit.
    pub const ANY_SOURCE: u32 = 16;
    /// Every flag bit this ABI version knows; the daemon rejects others.
    pub const KNOWN: u32 = CUDA | ONE_SHOT | HOST_STAGED | PERSISTENT | ANY_SOURCE;
}

/// Doorbell page layout (at `RingHeader::doorbell_off`, one 4 KiB page): per communicator slot
/// `i`, the client's stream writes `ready[i]`, the daemon writes `done[i]` and, when an op fails,
/// `error[i]` (a [`status`] code; sticky until the client reads and clears it).
pub mod doorbell {
    pub const SLOTS: u32 = 256;
    pub const READY_OFF: u64 = 0;
    pub const DONE_OFF: u64 = 1024;
    pub const ERROR_OFF: u64 = 2048;
    /// Hints from the daemon per slot (bits below); zero until the daemon learns something.
    /// This area of the page is zero unless a daemon writes hints there, so a client that does
    /// not read it and a daemon that does not write it both keep working (no ABI version
    /// change).
    pub const HINT_OFF: u64 = 3072;
    /// Hint bit: another local rank of this communicator uses the same GPU as this rank. The
    /// client's `COMMD_GPU_WAIT=auto` then waits with `cuStreamWaitValue32`: a polling kernel
    /// would be time-sliced against the daemon's same-GPU copy kernels, many times slower than
    /// the memory op (docs/benchmarks.md row `onegpu-shared-allreduce-64K`).
    pub const HINT_SHARED_GPU: u32 = 1;
    /// Hint bit: a replay of an op captured into a CUDA graph on this communicator failed; the
    /// graph doorbells' error words say which (`graph_doorbell`), `GetGraphOpError` why. The
    /// client clears the bit once it has looked.
    pub const HINT_GRAPH_FAILED: u32 = 2;
    /// Hint bit: the communicator is broken for good (a rank's process was lost, an op of it
    /// timed out in the daemon, or the client's watchdog lost the daemon). Direct ops
    /// (docs/contracts.md #7) poll it while they wait for a peer, so they stop instead of
    /// waiting for a rank that will never come.
    pub const HINT_BROKEN: u32 = 4;
    /// Hint bit: every local rank of this communicator has bound its GPU scratch and none
    /// shares this rank's GPU. The client's rounds kernel (one launch spinning between rounds)
    /// needs it: on a GPU shared under MPS, a rank's kernel holding every SM could keep the
    /// other rank's kernel, whose ready ticket it waits for, from starting. Without the bit
    /// (a rank not bound yet, or an older daemon) reductions use one launch per round.
    pub const HINT_OWN_GPU: u32 = 8;
    /// Slot value of a communicator that has no doorbell slot (more than `SLOTS` in a session).
    pub const NO_SLOT: u32 = u32::MAX;
}

/// Graph doorbell area (at `RingLayout::graph_off`): one slot of (ready, done, error) words per
/// persistent GPU op, i.e. per op captured into a CUDA graph ([`flags::PERSISTENT`]), allocated
/// by the client and named by the op's `ticket` field. Values are constant per replay
/// (docs/contracts.md #6): for phase `p` the stream writes `ready = 1 + p` and waits for
/// `done >= 1 + p`; after the last phase the daemon sets `ready = 0` and then `done = phases`,
/// and the stream, once past its last wait, writes `done = 0`, so the next replay starts from
/// zero. A failed replay sets `error` (sticky) and `done = phases`.
pub mod graph_doorbell {
    pub const SLOTS: u32 = 16384;
    pub const READY_OFF: u64 = 0;
    pub const DONE_OFF: u64 = 4 * SLOTS as u64;
    pub const ERROR_OFF: u64 = 8 * SLOTS as u64;
    pub const AREA_BYTES: u64 = 12 * SLOTS as u64;
}

/// How a GPU reduction moves through the daemon's scratch (all-reduce, reduce, reduce-scatter;
/// other ops have one phase and no rounds). Client and daemon both derive it from the op, so they
/// agree on tickets and scratch offsets.
///
/// The op runs in `rounds` rounds of at most `round_elems` elements. Round `j` uses scratch
/// buffer `j % 2` (see [`cuda_scratch_off`]): while the client's kernel reduces round `j`, the
/// daemon already fills the other buffer with round `j + 1`. There are `rounds + 1` doorbell
/// phases: phase `p` ends when round `p`'s inputs are in the scratch (the client then runs the
/// kernel of round `p`); for all-reduce with reduce-scatter + all-gather, phase `p` also starts
/// pushing out round `p - 1`'s reduced pieces, which no kernel reads, so they need not be done
/// for the phase to end; the last phase pushes out the last round (or, for the others, signals
/// that the last kernel has run) and ends when every copy of the op is done, so the op's
/// completion follows them all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaShape {
    pub rounds: u64,
    pub round_elems: u64,
    pub phases: u64,
}

/// Whether the one-shot all-reduce fits the scratch: the whole input in one slot.
pub fn cuda_one_shot_fits(kind: OpKind, count: u64, esize: u64, slot_bytes: u64) -> bool {
    kind == OpKind::AllReduce && count.saturating_mul(esize) <= slot_bytes
}

/// The round structure of a GPU op (see [`CudaShape`]); `one_shot` as [`flags::ONE_SHOT`].
pub fn cuda_shape(
    kind: OpKind,
    count: u64,
    esize: u64,
    nranks: u32,
    slot_bytes: u64,
    one_shot: bool,
) -> CudaShape {
    if !kind.reduces() {
        return CudaShape {
            rounds: 1,
            round_elems: count,
            phases: 1,
        };
    }
    let per_slot = (slot_bytes / esize.max(1)).max(1);
    let round_elems = match kind {
        OpKind::AllReduce if one_shot => count.max(1),
        // Each rank reduces its piece of the round: a slot holds one peer's piece.
        OpKind::AllReduce => per_slot.saturating_mul(u64::from(nranks.max(1))),
        _ => per_slot,
    };
    let rounds = count.div_ceil(round_elems).max(1);
    CudaShape {
        rounds,
        round_elems,
        phases: rounds + 1,
    }
}

/// Doorbell phases of a GPU op (tickets `ticket .. ticket + phases`): [`CudaShape::phases`].
pub fn cuda_phases(
    kind: OpKind,
    count: u64,
    esize: u64,
    nranks: u32,
    slot_bytes: u64,
    one_shot: bool,
) -> u64 {
    cuda_shape(kind, count, esize, nranks, slot_bytes, one_shot).phases
}

/// Bytes of a rank's GPU scratch for a communicator of `nranks`: two buffers (rounds alternate)
/// of one `slot_bytes` slot per peer.
pub fn cuda_scratch_bytes(nranks: u32, slot_bytes: u64) -> u64 {
    2 * u64::from(nranks.saturating_sub(1)) * slot_bytes
}

/// Offset in a rank's scratch of peer slot `slot` (0 ..= nranks - 2) of round `round`'s buffer.
pub fn cuda_scratch_off(round: u64, slot: u64, nranks: u32, slot_bytes: u64) -> u64 {
    ((round % 2) * u64::from(nranks.saturating_sub(1)) + slot) * slot_bytes
}

/// Completion status codes. A failed op still completes (docs/contracts.md #5); its message is
/// fetched with the `GetOpError` RPC.
pub mod status {
    pub const OK: u32 = 0;
    /// The descriptor failed validation (bad code, bounds, unknown handle).
    pub const INVALID: u32 = 1;
    /// Ranks posted different op/dtype/count/root/reduction for the same sequence number.
    pub const MISMATCH: u32 = 2;
    /// A rank of the communicator died or left.
    pub const PEER_LOST: u32 = 3;
    /// Some ranks never posted this sequence number within the op timeout.
    pub const TIMEOUT: u32 = 4;
    /// The daemon is shutting down.
    pub const SHUTDOWN: u32 = 5;
    /// The communicator was aborted by an earlier error or destroyed.
    pub const ABORTED: u32 = 6;
    pub const INTERNAL: u32 = 7;
    /// A rank revoked the communicator (`FailCommunicator` with this status, or a shrink with
    /// abort): its ops fail, and it stays valid as the parent of a shrink.
    pub const REVOKED: u32 = 8;

    pub fn name(s: u32) -> &'static str {
        match s {
            OK => "ok",
            INVALID => "invalid",
            MISMATCH => "mismatch",
            PEER_LOST => "peer_lost",
            TIMEOUT => "timeout",
            SHUTDOWN => "shutdown",
            ABORTED => "aborted",
            INTERNAL => "internal",
            REVOKED => "revoked",
            _ => "unknown",
        }
    }
}

/// Decoded operation kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpKind {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AllToAll,
    Send,
    Recv,
    Barrier,
}

impl OpKind {
    pub fn from_code(c: u16) -> Option<Self> {
        Some(match c {
            opcode::ALL_REDUCE => Self::AllReduce,
            opcode::ALL_GATHER => Self::AllGather,
            opcode::REDUCE_SCATTER => Self::ReduceScatter,
            opcode::BROADCAST => Self::Broadcast,
            opcode::REDUCE => Self::Reduce,
            opcode::ALL_TO_ALL => Self::AllToAll,
            opcode::SEND => Self::Send,
            opcode::RECV => Self::Recv,
            opcode::BARRIER => Self::Barrier,
            _ => return None,
        })
    }
    pub fn code(self) -> u16 {
        match self {
            Self::AllReduce => opcode::ALL_REDUCE,
            Self::AllGather => opcode::ALL_GATHER,
            Self::ReduceScatter => opcode::REDUCE_SCATTER,
            Self::Broadcast => opcode::BROADCAST,
            Self::Reduce => opcode::REDUCE,
            Self::AllToAll => opcode::ALL_TO_ALL,
            Self::Send => opcode::SEND,
            Self::Recv => opcode::RECV,
            Self::Barrier => opcode::BARRIER,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::AllReduce => "all_reduce",
            Self::AllGather => "all_gather",
            Self::ReduceScatter => "reduce_scatter",
            Self::Broadcast => "broadcast",
            Self::Reduce => "reduce",
            Self::AllToAll => "all_to_all",
            Self::Send => "send",
            Self::Recv => "recv",
            Self::Barrier => "barrier",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        ALL_OPS.iter().copied().find(|o| o.name() == s)
    }
    pub fn reduces(self) -> bool {
        matches!(self, Self::AllReduce | Self::ReduceScatter | Self::Reduce)
    }
    pub fn has_root(self) -> bool {
        matches!(self, Self::Broadcast | Self::Reduce)
    }
    pub fn is_p2p(self) -> bool {
        matches!(self, Self::Send | Self::Recv)
    }
    /// Whether the op reads a send buffer on this rank (`root_is_me` for rooted ops).
    pub fn uses_send(self, root_is_me: bool) -> bool {
        match self {
            Self::Broadcast => root_is_me,
            Self::Recv | Self::Barrier => false,
            _ => true,
        }
    }
    /// Whether the op writes a receive buffer on this rank.
    pub fn uses_recv(self, root_is_me: bool) -> bool {
        match self {
            Self::Reduce => root_is_me,
            Self::Send | Self::Barrier => false,
            _ => true,
        }
    }
    /// Elements in the send buffer of one rank, for `count` and `nranks`.
    pub fn send_elems(self, count: u64, nranks: u64) -> Option<u64> {
        match self {
            Self::ReduceScatter | Self::AllToAll => count.checked_mul(nranks),
            Self::Recv | Self::Barrier => Some(0),
            _ => Some(count),
        }
    }
    /// Elements in the receive buffer of one rank.
    pub fn recv_elems(self, count: u64, nranks: u64) -> Option<u64> {
        match self {
            Self::AllGather | Self::AllToAll => count.checked_mul(nranks),
            Self::Send | Self::Barrier => Some(0),
            _ => Some(count),
        }
    }
}

pub const ALL_OPS: [OpKind; 9] = [
    OpKind::AllReduce,
    OpKind::AllGather,
    OpKind::ReduceScatter,
    OpKind::Broadcast,
    OpKind::Reduce,
    OpKind::AllToAll,
    OpKind::Send,
    OpKind::Recv,
    OpKind::Barrier,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I8,
    U8,
    I32,
    I64,
    U32,
    U64,
    /// fp8 E4M3 (see [`dtype::F8E4M3`]): reduced in f32, stored round-to-nearest-even and
    /// saturated to the largest finite value, as NCCL does.
    F8E4M3,
    /// fp8 E5M2 (see [`dtype::F8E5M2`]): reduced in f32 as [`DType::F8E4M3`].
    F8E5M2,
}

pub const ALL_DTYPES: [DType; 12] = [
    DType::F32,
    DType::F64,
    DType::F16,
    DType::BF16,
    DType::I8,
    DType::U8,
    DType::I32,
    DType::I64,
    DType::U32,
    DType::U64,
    DType::F8E4M3,
    DType::F8E5M2,
];

impl DType {
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            dtype::F32 => Self::F32,
            dtype::F64 => Self::F64,
            dtype::F16 => Self::F16,
            dtype::BF16 => Self::BF16,
            dtype::I8 => Self::I8,
            dtype::U8 => Self::U8,
            dtype::I32 => Self::I32,
            dtype::I64 => Self::I64,
            dtype::U32 => Self::U32,
            dtype::U64 => Self::U64,
            dtype::F8E4M3 => Self::F8E4M3,
            dtype::F8E5M2 => Self::F8E5M2,
            _ => return None,
        })
    }
    pub fn code(self) -> u8 {
        match self {
            Self::F32 => dtype::F32,
            Self::F64 => dtype::F64,
            Self::F16 => dtype::F16,
            Self::BF16 => dtype::BF16,
            Self::I8 => dtype::I8,
            Self::U8 => dtype::U8,
            Self::I32 => dtype::I32,
            Self::I64 => dtype::I64,
            Self::U32 => dtype::U32,
            Self::U64 => dtype::U64,
            Self::F8E4M3 => dtype::F8E4M3,
            Self::F8E5M2 => dtype::F8E5M2,
        }
    }
    pub fn size(self) -> u64 {
        match self {
            Self::I8 | Self::U8 | Self::F8E4M3 | Self::F8E5M2 => 1,
            Self::F16 | Self::BF16 => 2,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F64 | Self::I64 | Self::U64 => 8,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F64 => "f64",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::I8 => "i8",
            Self::U8 => "u8",
            Self::I32 => "i32",
            Self::I64 => "i64",
            Self::U32 => "u32",
            Self::U64 => "u64",
            Self::F8E4M3 => "f8e4m3",
            Self::F8E5M2 => "f8e5m2",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        let s = match s {
            "float" | "float32" => "f32",
            "double" | "float64" => "f64",
            "half" | "float16" => "f16",
            "bfloat16" => "bf16",
            "int8" => "i8",
            "uint8" => "u8",
            "int" | "int32" => "i32",
            "int64" => "i64",
            "uint32" => "u32",
            "uint64" => "u64",
            "float8_e4m3fn" | "fp8e4m3" | "e4m3" => "f8e4m3",
            "float8_e5m2" | "fp8e5m2" | "e5m2" => "f8e5m2",
            s => s,
        };
        ALL_DTYPES.iter().copied().find(|d| d.name() == s)
    }
    pub fn is_float(self) -> bool {
        matches!(
            self,
            Self::F32 | Self::F64 | Self::F16 | Self::BF16 | Self::F8E4M3 | Self::F8E5M2
        )
    }
    /// Whether the dtype is an unsigned integer (min, max and avg compare and divide unsigned).
    pub fn is_unsigned(self) -> bool {
        matches!(self, Self::U8 | Self::U32 | Self::U64)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RedOp {
    Sum,
    Prod,
    Min,
    Max,
    Avg,
    /// Bitwise and (integer dtypes only).
    Band,
    /// Bitwise or (integer dtypes only).
    Bor,
    /// Bitwise exclusive or (integer dtypes only).
    Bxor,
}

/// Every reduction op. Not every op is defined for every dtype: see [`RedOp::check_dtype`].
pub const ALL_REDOPS: [RedOp; 8] = [
    RedOp::Sum,
    RedOp::Prod,
    RedOp::Min,
    RedOp::Max,
    RedOp::Avg,
    RedOp::Band,
    RedOp::Bor,
    RedOp::Bxor,
];

impl RedOp {
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            redop::SUM => Self::Sum,
            redop::PROD => Self::Prod,
            redop::MIN => Self::Min,
            redop::MAX => Self::Max,
            redop::AVG => Self::Avg,
            redop::BAND => Self::Band,
            redop::BOR => Self::Bor,
            redop::BXOR => Self::Bxor,
            _ => return None,
        })
    }
    pub fn code(self) -> u8 {
        match self {
            Self::Sum => redop::SUM,
            Self::Prod => redop::PROD,
            Self::Min => redop::MIN,
            Self::Max => redop::MAX,
            Self::Avg => redop::AVG,
            Self::Band => redop::BAND,
            Self::Bor => redop::BOR,
            Self::Bxor => redop::BXOR,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Self::Sum => "sum",
            Self::Prod => "prod",
            Self::Min => "min",
            Self::Max => "max",
            Self::Avg => "avg",
            Self::Band => "band",
            Self::Bor => "bor",
            Self::Bxor => "bxor",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        ALL_REDOPS.iter().copied().find(|d| d.name() == s)
    }
    /// Whether the op works on the bits of integers (and so has no meaning for floats).
    pub fn is_bitwise(self) -> bool {
        matches!(self, Self::Band | Self::Bor | Self::Bxor)
    }
    /// Checks that this op is defined for `dtype`: the arithmetic ops are defined for every dtype,
    /// the bitwise ops for integer dtypes only.
    pub fn check_dtype(self, dtype: DType) -> Result<(), DescError> {
        if self.is_bitwise() && dtype.is_float() {
            return Err(DescError::BitwiseOnFloat(self.name(), dtype.name()));
        }
        Ok(())
    }
}

/// Largest element count accepted in one descriptor (2^40): far above the 2^31 the API promises,
/// small enough that `count * 8 * nranks` cannot overflow u64 for any `nranks <= 2^16`.
pub const MAX_COUNT: u64 = 1 << 40;
/// Largest communicator size accepted.
pub const MAX_RANKS: u32 = 1 << 16;

/// Why a descriptor was rejected. The message names the field and value.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum DescError {
    #[error("unknown opcode {0}")]
    Opcode(u16),
    #[error("unknown dtype code {0}")]
    Dtype(u8),
    #[error("unknown reduction op code {0} for {1}")]
    Redop(u8, &'static str),
    #[error("reduction op code {0} given for {1}, which does not reduce (must be 0)")]
    UnexpectedRedop(u8, &'static str),
    #[error("unknown flag bits {0:#x}")]
    Flags(u32),
    #[error("the one-shot flag is for GPU all-reduce only (got {0})")]
    OneShot(&'static str),
    #[error("the host-staged flag is for GPU ops only, and not with the one-shot flag")]
    Staged,
    #[error(
        "the persistent flag is for GPU ops only, not host-staged, with a graph doorbell slot below {}",
        graph_doorbell::SLOTS
    )]
    Persistent,
    #[error("ticket field is {0:#x}, must be 0 for host ops and below 2^32 for CUDA ops")]
    Ticket(u64),
    #[error(
        "the any-source flag is for host recv ops with peer 0 only (got {0}, or a GPU op, or a peer)"
    )]
    AnySource(&'static str),
    #[error("count {0} exceeds the maximum {MAX_COUNT}")]
    Count(u64),
    #[error("bitwise reduction {0} is defined for integer dtypes only (got {1})")]
    BitwiseOnFloat(&'static str, &'static str),
}

/// A descriptor whose codes decoded; memory and rank checks need the session and communicator
/// and happen in the daemon.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub user_data: u64,
    pub kind: OpKind,
    pub dtype: DType,
    pub redop: Option<RedOp>,
    pub comm: u32,
    pub peer: u32,
    pub count: u64,
    pub send_mem: u32,
    pub recv_mem: u32,
    pub send_off: u64,
    pub recv_off: u64,
    /// `Some(first ticket)` for a stream-ordered GPU op ([`flags::CUDA`]).
    pub cuda_ticket: Option<u32>,
    /// [`flags::ONE_SHOT`].
    pub one_shot: bool,
    /// [`flags::HOST_STAGED`].
    pub staged: bool,
    /// [`flags::PERSISTENT`]: `cuda_ticket` is the op's graph doorbell slot.
    pub persistent: bool,
    /// [`flags::PERSISTENT`]: the capture's tag (0 for other ops).
    pub graph_tag: u32,
    /// [`flags::ANY_SOURCE`]: a host receive from any rank (`peer` is set to the sender once
    /// the daemon matched it).
    pub any_source: bool,
}

impl Op {
    /// Checks that the decoded fields make sense together (a bitwise reduction needs an integer
    /// dtype). Separate from [`SubmitDesc::decode`] on purpose: an op that decodes names its kind,
    /// so the daemon can still give it its sequence number and report the error on every rank
    /// (docs/contracts.md #5), whereas an undecodable descriptor can only fail alone.
    pub fn check(&self) -> Result<(), DescError> {
        match self.redop {
            Some(r) => r.check_dtype(self.dtype),
            None => Ok(()),
        }
    }
}

/// The low 32 bits of a descriptor's `ticket` field: a CUDA op's first ticket (the field is
/// refused above 2^32 for any other op) or a persistent op's graph doorbell slot.
// Truncation is the point: a persistent op packs its capture tag into the high half.
#[allow(clippy::cast_possible_truncation)]
const fn low_half(ticket: u64) -> u32 {
    ticket as u32
}

impl SubmitDesc {
    /// Decodes and checks every single field that needs no context. Never panics, for any bit
    /// pattern. Combinations of fields are checked by [`Op::check`].
    pub fn decode(&self) -> Result<Op, DescError> {
        let kind = OpKind::from_code(self.opcode).ok_or(DescError::Opcode(self.opcode))?;
        let dtype = DType::from_code(self.dtype).ok_or(DescError::Dtype(self.dtype))?;
        let redop = if kind.reduces() {
            Some(RedOp::from_code(self.redop).ok_or(DescError::Redop(self.redop, kind.name()))?)
        } else if self.redop != 0 {
            return Err(DescError::UnexpectedRedop(self.redop, kind.name()));
        } else {
            None
        };
        if self.flags & !flags::KNOWN != 0 {
            return Err(DescError::Flags(self.flags & !flags::KNOWN));
        }
        let cuda = self.flags & flags::CUDA != 0;
        let one_shot = self.flags & flags::ONE_SHOT != 0;
        if one_shot && (!cuda || kind != OpKind::AllReduce) {
            return Err(DescError::OneShot(kind.name()));
        }
        let staged = self.flags & flags::HOST_STAGED != 0;
        if staged && (!cuda || one_shot) {
            return Err(DescError::Staged);
        }
        let persistent = self.flags & flags::PERSISTENT != 0;
        if persistent && (!cuda || staged || low_half(self.ticket) >= graph_doorbell::SLOTS) {
            return Err(DescError::Persistent);
        }
        if (!cuda && self.ticket != 0) || (!persistent && self.ticket > u64::from(u32::MAX)) {
            return Err(DescError::Ticket(self.ticket));
        }
        let any_source = self.flags & flags::ANY_SOURCE != 0;
        if any_source && (kind != OpKind::Recv || cuda || self.peer != 0) {
            return Err(DescError::AnySource(kind.name()));
        }
        if self.count > MAX_COUNT {
            return Err(DescError::Count(self.count));
        }
        Ok(Op {
            user_data: self.user_data,
            kind,
            dtype,
            redop,
            comm: self.comm,
            peer: self.peer,
            count: if kind == OpKind::Barrier {
                0
            } else {
                self.count
            },
            send_mem: self.send_mem,
            recv_mem: self.recv_mem,
            send_off: self.send_off,
            recv_off: self.recv_off,
            cuda_ticket: cuda.then_some(low_half(self.ticket)),
            one_shot,
            staged,
            persistent,
            graph_tag: if persistent {
                (self.ticket >> 32) as u32
            } else {
                0
            },
            any_source,
        })
    }
}

/// Checks that `[off, off + bytes)` lies within a region of `len` bytes, without overflow.
pub fn range_in_bounds(off: u64, bytes: u64, len: u64) -> bool {
    off.checked_add(bytes).is_some_and(|end| end <= len)
}

#[cfg(test)]
#[allow(unsafe_code)] // tests set the environment and touch raw memory
mod tests;
