//! The client's GPU data plane: every stream-ordered GPU op of every face (torch, the NCCL
//! library, vLLM, the C ABI) goes through here. The client runs direct collectives itself, as
//! kernels in the caller's CUDA context; the daemon runs the rest with copy engines.
//!
//! An op's way through, by part:
//! - [`post`]: the entry (`Communicator::post_cuda_ordered`): the checks, the capture, and the
//!   choice of the path;
//! - [`direct`]: the direct path: the op is one kernel on the caller's stream that pushes into
//!   the peers' windows, with no daemon round trip (collectives, captured or eager, and
//!   send/recv);
//! - [`daemon_path`]: the daemon's path: buffers bound to registrations, the plan (scratch,
//!   rounds, the reduction kernel), the descriptor posted, then the stream's ready writes,
//!   waits for done and the reduction kernels between them;
//! - [`register`]: device memory registered with the daemon (IPC handles and cuMem pieces,
//!   cached per allocation) and the doorbell page mapped for the GPU;
//! - [`order`] and [`wait`]: how the caller's stream waits for done (docs/contracts.md #4);
//!   [`event`]: the session's event pool;
//! - [`graph`]: persistent ops captured into CUDA graphs; [`algo`]: algorithm choices;
//!   [`regcache`]: the registration cache; [`prof`]: per-op host-time profiling.

#![allow(unsafe_code)] // CUDA driver calls and device memory

pub mod algo;
mod daemon_path;
mod event;
pub(crate) mod order;
mod post;
mod register;
pub(crate) mod rma;
pub(crate) use commd_cuda as cu;
pub(crate) mod direct;
pub use direct::P2pConfig;
pub(crate) mod graph;
pub use event::CudaEvent;
pub(crate) use event::EventPool;
pub use order::refuse_capture;
pub use register::pointer_span;
pub(crate) use register::{device_uuid, map_host, stats};
pub mod prof;
pub(crate) use commd_cuda::kernels;
pub use graph::Relaxed;
pub mod regcache;
pub mod wait;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use commd_proto::desc::{DType, OpKind, RedOp};

use crate::{Error, Request, Result};
use cu::{CuError, sys};

impl From<CuError> for Error {
    fn from(e: CuError) -> Self {
        Error::InvalidArgument(format!("CUDA: {e}"))
    }
}

impl From<kernels::KernelError> for Error {
    fn from(e: kernels::KernelError) -> Self {
        Error::InvalidArgument(format!("reduction kernel: {e}"))
    }
}

use regcache::{Piece, RangeCache};

/// Per-session CUDA state: the doorbell page's device address, the registration cache (by
/// address range, each hit validated by the allocation's `CU_POINTER_ATTRIBUTE_BUFFER_ID`,
/// unique per allocation for the process lifetime, so a freed and re-allocated range is never
/// mistaken for the old one), the event pool, and the reduction kernels.
#[derive(Default)]
pub(crate) struct SessionGpu {
    doorbell_dev: Option<sys::CUdeviceptr>,
    regs: RangeCache,
    /// The pieces registered in each cuMem range registration (by its mem id), by offset.
    vmm: HashMap<u32, BTreeMap<u64, Piece>>,
    kernels: Option<kernels::Kernels>,
    events: Arc<EventPool>,
    /// Graph doorbell slots of captured ops (`graph`).
    graphs: graph::GraphSlots,
    /// The daemon's scratch allocations opened in this process, by IPC handle: the daemon
    /// gives every communicator of a session on one GPU the same scratch (it runs their
    /// reductions one at a time), and a handle can be opened once per context.
    scratch_maps: HashMap<Vec<u8>, sys::CUdeviceptr>,
    /// The failure records of this session's eager direct windows, which the watchdog looks
    /// at (`direct::RecordWatch`).
    pub(crate) records: Vec<direct::RecordWatch>,
    pub(crate) registrations: u64,
    pub(crate) cache_hits: u64,
}

// SAFETY: the raw pointers inside are driver handles / device addresses, usable from any thread.
unsafe impl Send for SessionGpu {}

/// The daemon-owned scratch of this rank, opened in this process.
#[derive(Clone, Copy, Debug)]
struct Scratch {
    ptr: sys::CUdeviceptr,
    slot_bytes: u64,
    device: i32,
}

/// Per-communicator CUDA state: the next doorbell ticket, the scratch, the last ticket of
/// p2p ops whose wait is deferred to the end of their group, and the last stream the driver
/// accepted (so the per-op stream check is skipped while ops keep using that stream).
pub(crate) struct CommGpu {
    next_ticket: u32,
    scratch: Option<Scratch>,
    /// The last deferred p2p op's ticket, and the largest of those ops' bytes (how the stream
    /// waits for them, `wait::wait_geq`).
    deferred: Option<(u32, u64)>,
    /// Captured p2p ops whose waits are deferred to the end of their group (as `deferred`):
    /// (capture id, graph doorbell slot, phases, bytes).
    captured_deferred: Vec<(u64, u32, u32, u64)>,
    checked_stream: Option<usize>,
    /// The stream of the communicator's last eager op and an event recorded on it after that
    /// op's stream work (after its ready write for a send/recv whose wait is deferred): the
    /// next op on another stream waits for it first (see `post_cuda`).
    last: Option<(usize, Arc<CudaEvent>)>,
    /// Captured collectives as direct ops (docs/design-gpu.md, direct collectives): not tried yet, refused, or the windows.
    pub(crate) direct: direct::State,
    /// Eager collectives as direct ops (direct collectives rule 8, `COMMD_EAGER_DIRECT`): windows of
    /// their own.
    pub(crate) eager: direct::State,
    /// The grid barrier of the rounds kernel (`kernels::rounds`): four u32 of device memory on
    /// the communicator's GPU, allocated at its first multi-round eager reduction and kept
    /// until the process exits (16 bytes per communicator, as the direct windows).
    rounds_bar: Option<sys::CUdeviceptr>,
    /// The communicator's error word was set and an op posted since completed without error:
    /// the failure did not break the communicator (a failed replay), so later ops are posted as
    /// usual until the word is cleared (`cuda_take_error`; see `post_cuda_ordered`).
    error_word_survived: bool,
    /// Eager send/recv as direct ops (`COMMD_P2P_DIRECT`): each peer's channel, set up at the
    /// pair's first eligible op, and what the channels share.
    pub(crate) p2p: std::collections::HashMap<u32, direct::Pair>,
    pub(crate) p2p_shared: Option<direct::P2pShared>,
}

impl Default for CommGpu {
    fn default() -> Self {
        // The daemon zeroes the slot's counters when it hands the slot out.
        Self {
            next_ticket: 1,
            scratch: None,
            deferred: None,
            captured_deferred: Vec::new(),
            checked_stream: None,
            last: None,
            direct: direct::State::Unknown,
            eager: direct::State::Unknown,
            rounds_bar: None,
            error_word_survived: false,
            p2p: std::collections::HashMap::new(),
            p2p_shared: None,
        }
    }
}

/// Arguments of a stream-ordered GPU op. Pointers are device addresses of this process.
#[derive(Clone, Copy, Debug)]
pub struct CudaOpArgs {
    pub kind: OpKind,
    pub dtype: DType,
    pub redop: Option<RedOp>,
    pub count: u64,
    /// Root (broadcast, reduce) or peer (send, recv).
    pub peer: u32,
    pub send: Option<sys::CUdeviceptr>,
    pub recv: Option<sys::CUdeviceptr>,
    /// The stream the op is ordered on (the caller's; 0 is the legacy default stream).
    pub stream: sys::CUstream,
    /// p2p only: enqueue only the "ready" signal now; the wait for completion is enqueued by
    /// [`Communicator::cuda_flush`] at the end of the group (so a group's sends and recvs can
    /// match in any order without the stream blocking on the first).
    pub defer_wait: bool,
    /// Order the op after the work already queued on this stream (e.g. the caller's current
    /// stream, when `stream` is a communication stream): an event recorded there, waited on by
    /// `stream`, all on the GPU.
    pub after: Option<sys::CUstream>,
    /// Record an event on `stream` after the op (not for deferred p2p ops: their event belongs
    /// after the group's wait, see [`Communicator::cuda_record`]).
    pub record: bool,
    /// send/recv only: may run as a direct op (`COMMD_P2P_DIRECT`). Set by the NCCL library,
    /// whose callers follow NCCL's rules (a group's send/recv in one `ncclGroupStart/End`); the
    /// torch backend's single sends and receives, which may come in any order across ranks,
    /// keep the daemon's path.
    pub p2p_direct: bool,
    /// send/recv only: the buffer's allocation (base, size, device ordinal) as
    /// [`pointer_span`] gave it when the caller already asked; `None`: asked here.
    pub span: Option<(u64, u64, i32)>,
}

impl CudaOpArgs {
    /// An op on `stream` with no buffers, no ordering stream and no event.
    pub fn new(kind: OpKind, dtype: DType, count: u64, stream: sys::CUstream) -> Self {
        Self {
            kind,
            dtype,
            redop: None,
            count,
            peer: 0,
            send: None,
            recv: None,
            stream,
            defer_wait: false,
            after: None,
            record: false,
            p2p_direct: false,
            span: None,
        }
    }
}

/// A posted stream-ordered op: its request, the event recorded after it (if asked for), the
/// device ordinal of its buffers, its last doorbell ticket (a stream that waits for the
/// done counter to reach it waits for the op: see [`Communicator::cuda_wait_ticket`]), and its
/// bytes per rank (count x element size: how a stream waits for it, `wait::wait_geq`).
#[derive(Debug)]
pub struct CudaPosted {
    pub request: Request,
    pub done: Option<Arc<CudaEvent>>,
    pub device: i32,
    pub last_ticket: u32,
    pub bytes: u64,
    /// Captured into a CUDA graph (a persistent op): `last_ticket` means nothing; a deferred
    /// wait is [`Communicator::cuda_flush`] on a stream of the same capture.
    pub captured: bool,
}

// SAFETY: the stream handle is a driver object that any thread may use.
unsafe impl Send for CudaOpArgs {}

/// Makes the primary context of `device` current if the thread has no context.
fn ensure_context(device: i32) -> Result<()> {
    Ok(cu::context::ensure_context(device)?)
}

fn driver() -> Result<()> {
    cu::driver().map_err(|why| {
        Error::InvalidArgument(format!("CUDA is not available in this process: {why}"))
    })
}
