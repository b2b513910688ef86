//! The client's CUDA path: device-memory registration (IPC handles, cached per allocation), the
//! doorbell protocol on the caller's stream (DESIGN.md contract 4), and reduction kernels
//! launched in the caller's context between doorbells.

#![allow(unsafe_code)] // CUDA driver calls and device memory

pub mod algo;
pub(crate) use commd_cuda as cu;
pub(crate) mod direct;
pub use direct::P2pConfig;
pub(crate) mod graph;
pub mod prof;
pub(crate) use commd_cuda::kernels;
pub use graph::Relaxed;
pub mod regcache;
pub mod wait;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use commd_proto::desc::{DType, OpKind, RedOp, SubmitDesc, doorbell, flags, graph_doorbell};
use commd_proto::pb;

use crate::{Communicator, Error, Inner, Request, Result, lock};
use cu::{CuError, ck, sys};

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

use regcache::{Piece, RangeCache, Reg};

/// At most this many cuMem pieces are registered by one call (the daemon holds at most 256
/// staged fds per session).
const PIECES_PER_CALL: usize = 64;

/// The most cuMem pieces one buffer may need registered at once (PyTorch's pieces are 2 or
/// 20 MiB: 16384 covers a 320 GiB tensor).
const MAX_NEW_PIECES: usize = 16384;

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

/// Free CUDA events (created with timing disabled) per device ordinal. Events are created in
/// the device's primary context, the one torch's streams live in.
#[derive(Default)]
pub(crate) struct EventPool {
    free: Mutex<HashMap<i32, Vec<usize>>>,
}

impl EventPool {
    fn get(self: &Arc<Self>, device: i32) -> Result<CudaEvent> {
        let reused = lock(&self.free).get_mut(&device).and_then(|v| v.pop());
        let ev = match reused {
            Some(e) => e as sys::CUevent,
            None => cu::context::event_on(device)?,
        };
        Ok(CudaEvent {
            ev,
            device,
            pool: self.clone(),
        })
    }
}

/// A CUDA event of the session's pool: recorded on a stream after an op, so another stream can
/// wait for the op with no CPU involvement. Goes back to the pool when dropped (an event may be
/// recorded again while streams still wait on an earlier record: each wait keeps the record it
/// saw).
pub struct CudaEvent {
    ev: sys::CUevent,
    device: i32,
    pool: Arc<EventPool>,
}

// SAFETY: an event handle is a driver object usable from any thread.
unsafe impl Send for CudaEvent {}
// SAFETY: as above; the methods only pass the handle to the driver.
unsafe impl Sync for CudaEvent {}

impl std::fmt::Debug for CudaEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaEvent(device {})", self.device)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        lock(&self.pool.free)
            .entry(self.device)
            .or_default()
            .push(self.ev as usize);
    }
}

impl CudaEvent {
    /// Records the event on `stream`.
    ///
    /// # Safety
    /// `stream` must be a live stream of the event's device.
    pub unsafe fn record(&self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller passes a live stream of this event's device.
        let r = unsafe { sys::cuEventRecord(self.ev, stream) };
        ck(r, "cuEventRecord")?;
        Ok(())
    }

    /// Makes `stream` wait (on the GPU) for the work recorded before the event.
    ///
    /// # Safety
    /// `stream` must be a live stream.
    pub unsafe fn wait_on(&self, stream: sys::CUstream) -> Result<()> {
        ck(
            // SAFETY: live stream (caller) and event (owned here).
            unsafe { sys::cuStreamWaitEvent(stream, self.ev, 0) },
            "cuStreamWaitEvent",
        )?;
        Ok(())
    }

    /// [`CudaEvent::done`] from any thread at any time: with the event's device's primary
    /// context made current if the thread has none, and in relaxed capture mode (a query
    /// while another thread captures in global mode would invalidate that capture).
    pub fn query(&self) -> Result<bool> {
        ensure_context(self.device)?;
        let _relaxed = graph::Relaxed::enter()?;
        self.done()
    }

    /// Whether the recorded work completed (never blocks).
    pub fn done(&self) -> Result<bool> {
        // SAFETY: the event is owned here and live.
        let r = unsafe { sys::cuEventQuery(self.ev) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        ck(r, "cuEventQuery")?;
        Ok(true)
    }
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
    /// Captured collectives as direct ops (contract 7): not tried yet, refused, or the windows.
    pub(crate) direct: direct::State,
    /// Eager collectives as direct ops (contract 7 rule 8, `COMMD_EAGER_DIRECT`): windows of
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

/// What the driver knows of a device pointer.
struct PtrInfo {
    /// The allocation (or, for cuMem memory, the reserved address range) holding it.
    base: sys::CUdeviceptr,
    size: u64,
    buffer_id: u64,
    ordinal: i32,
    /// cuIpcGetMemHandle works on it (cudaMalloc memory).
    legacy_ipc: bool,
    /// cuMem memory: the handle types its allocation may be exported as.
    handle_types: u32,
}

fn pointer_info(ptr: sys::CUdeviceptr) -> Result<PtrInfo> {
    let a = cu::mem::pointer_attrs(ptr)?;
    device_memory(ptr, a.memory_type, a.ordinal, a.base)?;
    Ok(PtrInfo {
        base: a.base,
        size: a.size,
        buffer_id: a.buffer_id,
        ordinal: a.ordinal,
        legacy_ipc: a.legacy_ipc,
        handle_types: a.handle_types,
    })
}

fn device_memory(ptr: sys::CUdeviceptr, mtype: u32, ordinal: i32, base: u64) -> Result<()> {
    if mtype != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 || ordinal < 0 || base == 0 {
        return Err(Error::InvalidArgument(format!(
            "address {ptr:#x} is not CUDA device memory of this process (memory type {mtype}); GPU ops need tensors allocated on a CUDA device"
        )));
    }
    Ok(())
}

/// The allocation holding device pointer `ptr` and its device: (base, size, ordinal), or why
/// it is not CUDA device memory of this process. The four attributes a direct op needs, in one
/// driver call (fewer than [`pointer_info`]'s: the per-op host cost of small eager ops); a
/// caller that must tell device from host memory anyway (the NCCL library) asks it once and
/// passes it on in [`CudaOpArgs::span`].
pub fn pointer_span(ptr: sys::CUdeviceptr) -> Result<(u64, u64, i32)> {
    let (base, size, ordinal, mtype) = cu::mem::pointer_span(ptr)?;
    device_memory(ptr, mtype, ordinal, base)?;
    Ok((base, size, ordinal))
}

/// The cuMem mapping holding `ptr`: (mapping base, size, buffer id).
fn mapping_info(ptr: sys::CUdeviceptr) -> std::result::Result<regcache::Mapping, String> {
    cu::mem::mapping_info(ptr).map_err(|e| format!("{ptr:#x}: {e}"))
}

fn device_uuid(ordinal: i32) -> Result<[u8; 16]> {
    Ok(cu::context::ordinal_uuid(ordinal)?)
}

/// Registers `len` bytes of host memory at `host` with the driver for device access (already
/// registered is fine) and returns its device address.
///
/// # Safety
/// `[host, host + len)` must be page-aligned memory mapped for the session's life.
pub(crate) unsafe fn map_host(host: *mut u8, len: u64, what: &str) -> Result<sys::CUdeviceptr> {
    // SAFETY: the caller's contract.
    Ok(unsafe { cu::mem::map_host(host, len, what) }?)
}

impl Inner {
    /// Registers the doorbell page with the driver once (host memory mapped for the GPU).
    fn doorbell_dev(&self, g: &mut SessionGpu) -> Result<sys::CUdeviceptr> {
        if let Some(d) = g.doorbell_dev {
            return Ok(d);
        }
        // SAFETY: the page is page-aligned, one page long, and mapped for the session's life
        // (the registration is dropped with the mapping at process exit).
        let d = unsafe { map_host(self.ring.doorbell_page(), 4096, "doorbell page")? };
        g.doorbell_dev = Some(d);
        Ok(d)
    }

    /// `(mem_id, offset, device)` of `[ptr, ptr + bytes)`, registering its allocation with the
    /// daemon on first use (one IPC export and one daemon-side open per allocation).
    pub(crate) fn cuda_resolve(
        &self,
        g: &mut SessionGpu,
        ptr: sys::CUdeviceptr,
        bytes: u64,
    ) -> Result<(u32, u64, i32)> {
        // Fast path: a cached allocation holds the range and the driver still reports the same
        // allocation there (one attribute query, no allocation, no RPC). A cuMem range checks
        // the pieces the range spans instead (one query each), registering any it lacks.
        if let Some(r) = g.regs.lookup(ptr, bytes) {
            if r.vmm {
                match self.vmm_pieces(g, r, ptr, bytes) {
                    Ok(()) => {
                        g.cache_hits += 1;
                        return Ok((r.mem_id, ptr - r.base, r.device));
                    }
                    // The range may have been released and reserved anew: start over below.
                    Err(Error::InvalidArgument(_)) => self.drop_regs(g, r.base, r.size),
                    Err(e) => return Err(e),
                }
            } else if cu::mem::buffer_id(ptr) == Some(r.buffer_id) {
                g.cache_hits += 1;
                return Ok((r.mem_id, ptr - r.base, r.device));
            }
        }
        let info = pointer_info(ptr)?;
        let (base, size, ordinal) = (info.base, info.size, info.ordinal);
        let off = ptr - base;
        if off + bytes > size {
            return Err(Error::InvalidArgument(format!(
                "GPU buffer at {ptr:#x} ({bytes} bytes) runs past the end of its allocation ({size} bytes at {base:#x})"
            )));
        }
        // A new allocation overlapping a cached one means the old one was freed: drop it so the
        // daemon closes its mapping (and the memory can really be released).
        self.drop_regs(g, base, size);
        ensure_context(ordinal)?;
        let posix_fd = sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR.0;
        let vmm = !info.legacy_ipc && info.handle_types & posix_fd != 0;
        let ipc_handle = if vmm {
            Vec::new()
        } else {
            let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
            // SAFETY: valid out struct; `base` is the start of a device allocation of this
            // process.
            let r = unsafe { sys::cuIpcGetMemHandle(&mut h, base) };
            if r != sys::CUresult::CUDA_SUCCESS {
                let (name, _) = cu::describe(r);
                return Err(Error::InvalidArgument(format!(
                    "cannot export the allocation at {base:#x} for the daemon (cuIpcGetMemHandle: {name}; exportable handle types {:#x}): cuMem memory must allow POSIX-fd export (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, as PyTorch's expandable segments do), and managed memory cannot be shared",
                    info.handle_types
                )));
            }
            h.reserved.iter().map(|c| *c as u8).collect()
        };
        let req = pb::RegisterCudaMemoryRequest {
            session_id: self.session_id,
            ipc_handle,
            device_uuid: device_uuid(ordinal)?.to_vec(),
            bytes: size,
            buffer_id: info.buffer_id,
            vmm,
        };
        let rep = self
            .rt
            .block_on(self.rpc.clone().register_cuda_memory(req))
            .map_err(|s| Error::rpc("register_cuda_memory", s))?
            .into_inner();
        let r = Reg {
            base,
            size,
            buffer_id: if vmm { 0 } else { info.buffer_id },
            mem_id: rep.mem_id,
            device: ordinal,
            vmm,
        };
        g.regs.insert(r);
        if vmm {
            g.vmm.insert(r.mem_id, BTreeMap::new());
            self.vmm_pieces(g, r, ptr, bytes)?;
        } else {
            g.registrations += 1;
        }
        Ok((rep.mem_id, off, ordinal))
    }

    /// Drops the cached registrations overlapping `[base, base + size)` (their memory was freed)
    /// and tells the daemon, so it closes its mappings.
    fn drop_regs(&self, g: &mut SessionGpu, base: u64, size: u64) {
        for r in g.regs.remove_overlapping(base, size) {
            g.vmm.remove(&r.mem_id);
            let _ = self
                .rt
                .block_on(self.rpc.clone().deregister_memory(pb::MemRef {
                    session_id: self.session_id,
                    mem_id: r.mem_id,
                }));
        }
    }

    /// Makes sure the daemon has every piece of the cuMem range `r` that `[ptr, ptr + bytes)`
    /// spans, as mapped now: exports the missing or remapped ones as POSIX fds and maps them
    /// into the daemon's mirror (one call per [`PIECES_PER_CALL`] pieces).
    fn vmm_pieces(&self, g: &mut SessionGpu, r: Reg, ptr: u64, bytes: u64) -> Result<()> {
        let cached = g.vmm.entry(r.mem_id).or_default();
        let need = regcache::missing_pieces(
            cached,
            (r.base, r.size),
            ptr,
            bytes,
            cu::mem::buffer_id,
            mapping_info,
            MAX_NEW_PIECES,
        )
        .map_err(|e| Error::InvalidArgument(format!("registering cuMem memory: {e}")))?;
        for batch in need.chunks(PIECES_PER_CALL) {
            let mut pieces = Vec::with_capacity(batch.len());
            for (off, p) in batch {
                let fd = cu::mem::export_piece(r.base + off)?;
                let fd_token = self.stage_fd(fd.as_fd())?;
                pieces.push(pb::CudaPiece {
                    offset: *off,
                    bytes: p.bytes,
                    fd_token,
                });
            }
            self.rt
                .block_on(self.rpc.clone().map_cuda_pieces(pb::MapCudaPiecesRequest {
                    session_id: self.session_id,
                    mem_id: r.mem_id,
                    pieces,
                }))
                .map_err(|s| Error::rpc("map_cuda_pieces", s))?;
            let cached = g.vmm.entry(r.mem_id).or_default();
            for (off, p) in batch {
                regcache::insert_piece(cached, *off, *p);
            }
            g.registrations += batch.len() as u64;
        }
        Ok(())
    }
}

/// (client registrations made, client cache hits) of a session.
pub(crate) fn stats(i: &Inner) -> (u64, u64) {
    let g = lock(&i.gpu);
    (g.registrations, g.cache_hits)
}

impl Communicator {
    fn scratch(&self, c: &mut CommGpu, g: &mut SessionGpu, device: i32) -> Result<Scratch> {
        if let Some(s) = c.scratch {
            if s.device != device {
                return Err(Error::InvalidArgument(format!(
                    "communicator {} already runs GPU reductions on device {}; this tensor is on device {device} (use one device per rank and communicator)",
                    self.comm_id, s.device
                )));
            }
            return Ok(s);
        }
        let i = &self.client;
        let rep = i
            .watched(i.rpc.clone().get_comm_scratch(pb::CommScratchRequest {
                session_id: i.session_id,
                comm: self.handle,
                device_uuid: device_uuid(device)?.to_vec(),
            }))?
            .map_err(|s| Error::rpc("get_comm_scratch", s))?
            .into_inner();
        let need = commd_proto::desc::cuda_scratch_bytes(self.nranks, rep.slot_bytes);
        if !rep.ipc_handle.is_empty() && rep.bytes < need {
            return Err(Error::InvalidArgument(format!(
                "the daemon's GPU scratch for communicator {} has {} bytes, this client needs {need} (two buffers of {} peer slots of {} bytes): client and daemon versions differ",
                self.comm_id,
                rep.bytes,
                self.nranks.saturating_sub(1),
                rep.slot_bytes
            )));
        }
        let ptr = if rep.ipc_handle.is_empty() {
            0
        } else {
            match g.scratch_maps.get(&rep.ipc_handle) {
                Some(&p) => p,
                None => {
                    let p = cu::ipc_open(&rep.ipc_handle, "cuIpcOpenMemHandle(daemon scratch)")?;
                    g.scratch_maps.insert(rep.ipc_handle.clone(), p);
                    p
                }
            }
        };
        let s = Scratch {
            ptr,
            slot_bytes: rep.slot_bytes,
            device,
        };
        c.scratch = Some(s);
        Ok(s)
    }

    /// The communicator's doorbell error word: a failed GPU op's status, 0 while none failed.
    fn error_word(&self) -> Option<&std::sync::atomic::AtomicU32> {
        self.client
            .ring
            .doorbell(self.doorbell_slot)
            .map(|(_, _, e)| e)
    }

    /// The doorbell error word of this communicator (a failed GPU op's status), cleared on read.
    pub fn cuda_take_error(&self) -> Option<u32> {
        match self
            .error_word()?
            .swap(0, std::sync::atomic::Ordering::AcqRel)
        {
            0 => None,
            s => {
                // A later failure sets the word anew: `post_cuda_ordered` checks again.
                lock(&self.gpu).error_word_survived = false;
                Some(s)
            }
        }
    }

    /// Enqueues on `stream` the wait for every deferred p2p op of this communicator (end of a
    /// send/recv group). A no-op when nothing is deferred.
    ///
    /// # Safety
    /// `stream` must be a live stream of the current context.
    pub unsafe fn cuda_flush(&self, stream: sys::CUstream) -> Result<()> {
        let mut c = lock(&self.gpu);
        // SAFETY: the caller's contract.
        if unsafe { self.flush_captured(&mut c, stream)? } || c.deferred.is_none() {
            return Ok(());
        }
        // The deferred ops were posted outside any capture: a captured wait for them would be
        // a no-op on replay. Refused with the deferred wait kept for a later flush.
        // SAFETY: the caller's contract.
        unsafe { refuse_capture(stream, "the wait for a send/recv group")? };
        let Some((t, bytes)) = c.deferred.take() else {
            return Ok(());
        };
        let db = self.client.doorbell_dev(&mut lock(&self.client.gpu))?;
        let done = db + doorbell::DONE_OFF + 4 * u64::from(self.doorbell_slot);
        // SAFETY: `done` is a device-mapped address of the registered doorbell page.
        unsafe { wait::wait_geq(stream, done, t, bytes)? };
        Ok(())
    }

    /// Posts a stream-ordered GPU op (DESIGN.md contract 4): the op starts once `stream` reaches
    /// it, and work enqueued on `stream` afterwards runs once it is done; the CPU never blocks.
    /// The returned [`Request`] completes (or fails) when the daemon is done; a failure also
    /// releases the stream and sets the communicator's error word.
    ///
    /// # Safety
    /// Pointers must be device memory of this process holding the op's element counts, stay
    /// allocated until the request completes, and `stream` must be a live stream of the device's
    /// context (current on this thread, or the device's primary context is made current).
    pub unsafe fn post_cuda(&self, a: CudaOpArgs) -> Result<Request> {
        // SAFETY: same contract as ours.
        unsafe { self.post_cuda_ordered(a) }.map(|p| p.request)
    }

    /// Enqueues on `stream` a wait for this communicator's done counter to reach `ticket` (the
    /// `last_ticket` of a posted op): the stream then waits for that op and every op posted
    /// before it on this communicator (done counters advance contiguously). This is how a
    /// deferred send/recv is waited for on whatever stream is current at `wait()` time, with
    /// no event and no communication stream. `bytes` is the op's [`CudaPosted::bytes`].
    ///
    /// # Safety
    /// `stream` must be a live stream.
    pub unsafe fn cuda_wait_ticket(
        &self,
        stream: sys::CUstream,
        ticket: u32,
        bytes: u64,
    ) -> Result<()> {
        driver()?;
        // SAFETY: the caller's contract.
        if unsafe { self.flush_captured(&mut lock(&self.gpu), stream)? } {
            return Ok(());
        }
        // SAFETY: the caller's contract.
        unsafe { refuse_capture(stream, "the wait for a GPU op")? };
        let db = self.client.doorbell_dev(&mut lock(&self.client.gpu))?;
        let done = db + doorbell::DONE_OFF + 4 * u64::from(self.doorbell_slot);
        // SAFETY: `done` is a device-mapped address of the registered doorbell page.
        unsafe { wait::wait_geq(stream, done, ticket, bytes)? };
        // Done counters advance contiguously: deferred p2p ops up to `ticket` are waited for.
        let mut c = lock(&self.gpu);
        if c.deferred
            .is_some_and(|(t, _)| ticket.wrapping_sub(t) as i32 >= 0)
        {
            c.deferred = None;
        }
        Ok(())
    }

    /// Records an event of the session's pool on `stream` (a stream of `device`), e.g. after
    /// [`Communicator::cuda_flush`] for deferred p2p ops.
    ///
    /// # Safety
    /// `stream` must be a live stream of `device`.
    pub unsafe fn cuda_record(&self, stream: sys::CUstream, device: i32) -> Result<CudaEvent> {
        let pool = lock(&self.client.gpu).events.clone();
        let ev = pool.get(device)?;
        // SAFETY: the caller's contract.
        unsafe { ev.record(stream)? };
        Ok(ev)
    }

    /// [`Communicator::post_cuda`], also ordered after `a.after` and returning the event
    /// recorded after the op when `a.record` is set: everything one op needs from the stream
    /// in one call (the per-op path of the torch backend).
    ///
    /// # Safety
    /// As [`Communicator::post_cuda`]; `a.after`, if any, must be a live stream.
    pub unsafe fn post_cuda_ordered(&self, a: CudaOpArgs) -> Result<CudaPosted> {
        // Contract 5: a failed GPU op releases its stream and sets the communicator's error word,
        // and the communicator's next call raises. Its completion reaches this process
        // asynchronously, so one rank may already raise (at `wait()`) while another posts its
        // next op. The daemon breaks a communicator whose eager GPU op failed (every later op
        // fails at once, naming the first error, on every rank: no rank waits for a peer that
        // stopped), and here a call made after the word was set waits for that answer, so it
        // raises the error itself rather than leaving it to a later look.
        // One load per op while nothing failed; the lock only once the word is set.
        let check = self
            .error_word()
            .is_some_and(|e| e.load(std::sync::atomic::Ordering::Acquire) != 0)
            && !lock(&self.gpu).error_word_survived;
        // SAFETY: same contract as ours.
        let p = unsafe { self.post_cuda_once(a)? };
        prof::mark(prof::DAEMON);
        if check && p.request.local.is_none() && !p.captured {
            match p.request.wait_for(Some(Duration::from_millis(500))) {
                Err(e) => return Err(e),
                // Completed: the communicator still works (the word was a failed replay's).
                Ok(true) => lock(&self.gpu).error_word_survived = true,
                Ok(false) => {}
            }
        }
        Ok(p)
    }

    /// [`Communicator::post_cuda_ordered`] without the check of an earlier failure.
    ///
    /// # Safety
    /// As [`Communicator::post_cuda_ordered`].
    unsafe fn post_cuda_once(&self, a: CudaOpArgs) -> Result<CudaPosted> {
        prof::mark(prof::CALLER);
        let i = &self.client;
        i.check_owner()?;
        driver()?;
        i.start_watchdog();
        // A failed replay of a captured op on this communicator is raised by its next call.
        self.cuda_graph_check()?;
        // Before any other stream call: a query of a capturing stream would invalidate the
        // caller's capture. An op whose stream is being captured (or joins a capture through
        // `after`) becomes a persistent op (contract 6).
        // SAFETY: the caller's contract (live streams); the driver only reads the handles.
        let cap = unsafe { graph::capture_for(a.stream, a.after, a.kind.name())? };
        // One-time setup below (host registration, kernel loading, scratch) is allowed in a
        // global-mode capture from this thread.
        let _relaxed = match cap {
            Some(_) => Some(graph::Relaxed::enter()?),
            None => None,
        };
        if cap.is_some() && lock(&i.gpu).graphs.exhausted() {
            // Destroyed graphs' slots come back now rather than at the watchdog's next look.
            i.release_destroyed_graphs();
        }
        if self.doorbell_slot == doorbell::NO_SLOT {
            return Err(Error::InvalidArgument(format!(
                "communicator {} has no doorbell slot (more than {} communicators in this process): GPU ops are unavailable on it",
                self.comm_id,
                doorbell::SLOTS
            )));
        }
        if let Some(r) = a.redop {
            r.check_dtype(a.dtype)
                .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        }
        prof::mark(prof::CHECKS);
        // A communicator the daemon broke for good (a lost rank, an op that timed out: its
        // `HINT_BROKEN`) runs nothing more: its ops take the daemon's path, which fails them at
        // once with the first failure's reason (`post_cuda_ordered` waits for that answer),
        // rather than a direct op that would stop with "broken" and no reason.
        let direct_ok = self.nodes <= 1 && !self.is_broken();
        // A captured collective (all-reduce, all-gather, reduce-scatter, broadcast, reduce) on
        // ranks with a GPU each runs as one kernel of the graph (contract 7), with no daemon
        // work per replay.
        if cap.is_some() && direct_ok {
            // SAFETY: the caller's contract.
            if let Some(p) = unsafe { self.try_direct(&a, false)? } {
                return Ok(p);
            }
        }
        // An eager one too, with COMMD_EAGER_DIRECT (rule 8): its request completes from the
        // event after its kernel, not from the daemon.
        if cap.is_none() && direct_ok && !a.kind.is_p2p() {
            // SAFETY: the caller's contract.
            if let Some(p) = unsafe { self.try_direct(&a, true)? } {
                return Ok(p);
            }
        }
        // An eager send/recv too, with COMMD_P2P_DIRECT (on by default in the NCCL library).
        if cap.is_none() && direct_ok && a.kind.is_p2p() {
            // SAFETY: the caller's contract.
            if let Some(p) = unsafe { self.try_direct_p2p(&a)? } {
                return Ok(p);
            }
        }
        let n = u64::from(self.nranks);
        let es = a.dtype.size();
        let me_root = a.peer == self.rank;
        let bytes = |e: Option<u64>| {
            e.and_then(|e| e.checked_mul(es))
                .ok_or_else(|| Error::InvalidArgument(format!("count {} overflows", a.count)))
        };
        let mut c = lock(&self.gpu);
        let mut g = lock(&i.gpu);
        let mut device = None;
        let mut send = (0, 0);
        let mut recv = (0, 0);
        // One pointer query per buffer (cuda_resolve): allocation, registration and device.
        let mut resolve = |what: &str, p: Option<u64>, elems: Option<u64>| -> Result<(u32, u64)> {
            let p = p.ok_or_else(|| {
                Error::InvalidArgument(format!("{} needs a {what} buffer", a.kind.name()))
            })?;
            let (m, o, d) = i.cuda_resolve(&mut g, p, bytes(elems)?)?;
            device.get_or_insert(d);
            Ok((m, o))
        };
        if a.kind.uses_send(me_root) {
            send = resolve("send", a.send, a.kind.send_elems(a.count, n))?;
        }
        if a.kind.uses_recv(me_root) {
            recv = resolve("recv", a.recv, a.kind.recv_elems(a.count, n))?;
        }
        if let Some(d) = device {
            ensure_context(d)?;
        }
        let db = i.doorbell_dev(&mut g)?;
        let slot = u64::from(self.doorbell_slot);
        let ready = db + doorbell::READY_OFF + 4 * slot;
        let done = db + doorbell::DONE_OFF + 4 * slot;
        // Across nodes the daemons reduce in host memory: one phase, no scratch, no kernel.
        let staged = self.nodes > 1;
        if staged && cap.is_some() {
            return Err(Error::Unsupported(format!(
                "{}: capturing GPU ops into CUDA graphs is not supported yet on a communicator that spans nodes (its ops are staged through the daemons' host memory). The op was refused (nothing was enqueued or posted)",
                a.kind.name()
            )));
        }
        let kernel_reduces = a.kind.reduces() && !staged;
        let scratch = if kernel_reduces {
            Some(self.scratch(&mut c, &mut g, device.unwrap_or(0))?)
        } else {
            None
        };
        if kernel_reduces && self.nranks > 8 {
            return Err(Error::InvalidArgument(format!(
                "GPU reductions support up to 8 ranks per communicator (this one has {})",
                self.nranks
            )));
        }
        let slot_bytes = scratch.map(|s| s.slot_bytes).unwrap_or(1 << 20);
        let one_shot = !staged && algo::one_shot(a.kind, a.count, es, self.nranks, slot_bytes)?;
        let shape = if staged {
            commd_proto::desc::CudaShape {
                rounds: 1,
                round_elems: a.count,
                phases: 1,
            }
        } else {
            commd_proto::desc::cuda_shape(a.kind, a.count, es, self.nranks, slot_bytes, one_shot)
        };
        let phases = shape.phases;
        let gdev = match cap {
            Some(_) => Some(i.graph_dev(&mut g)?),
            None => None,
        };
        // Build the stream work first, so a failure here leaves nothing posted.
        let gs: &mut SessionGpu = &mut g;
        let kernels = if kernel_reduces {
            if gs.kernels.is_none() {
                gs.kernels = Some(kernels::Kernels::new());
            }
            gs.kernels.as_ref()
        } else {
            None
        };
        if let (Some(k), Some(op)) = (kernels, a.redop) {
            // Compiles (NVRTC, cached) and loads the kernel in this context before anything is
            // posted, so a compile error fails the call cleanly.
            k.prepare(a.dtype, op)?;
        }
        // An invalid stream fails here, before the op is posted (checked once per stream: a
        // communicator's ops normally all use one communication stream).
        if cap.is_none() && c.checked_stream != Some(a.stream as usize) {
            // SAFETY: cuStreamQuery only reads the handle; the driver validates it.
            let q = unsafe { sys::cuStreamQuery(a.stream) };
            if q != sys::CUresult::CUDA_SUCCESS && q != sys::CUresult::CUDA_ERROR_NOT_READY {
                ck(q, "cuStreamQuery(stream of the op)")?;
            }
            c.checked_stream = Some(a.stream as usize);
        }
        let dev = match device {
            Some(d) => d,
            None if a.after.is_some() || a.record => {
                return Err(Error::InvalidArgument(format!(
                    "{} on this rank has no GPU buffer, so no device to order its stream on",
                    a.kind.name()
                )));
            }
            None => 0,
        };
        let pool = gs.events.clone();
        // The op's stream waits for the work queued on `after` (GPU-side; the event goes back
        // to the pool at once: the wait keeps the record it saw).
        if let Some(after) = a.after
            && after != a.stream
        {
            let ev = pool.get(dev)?;
            // SAFETY: `after` is live (caller) and of the op's device.
            unsafe { ev.record(after)? };
            // SAFETY: `a.stream` was validated above.
            unsafe { ev.wait_on(a.stream)? };
        }
        // A communicator's eager ops share one ready counter (contract 4), which only works if
        // the ops' ready writes land in ticket order. Ops of one communicator on several
        // streams (FSDP's all-gathers on its unshard stream and reduce-scatters on its
        // post-backward stream, blocking collectives on the current stream beside async ones
        // on the communication stream) would race: a later op's write could land first and an
        // earlier op's then lower the counter, so the daemon would see an op ready before its
        // stream reached it, and the next op never. So an op on another stream than the
        // previous op's waits (on the GPU) for the previous op's stream work, in issue order
        // across streams as NCCL orders a communicator's ops.
        if cap.is_none()
            && let Some((ls, ev)) = &c.last
            && *ls != a.stream as usize
        {
            // SAFETY: `a.stream` was validated above; the event is live (owned by `c`).
            unsafe { ev.wait_on(a.stream)? };
        }
        let order_ev = if cap.is_none() && device.is_some() {
            Some(pool.get(dev)?)
        } else {
            None
        };
        let done_ev = if a.record && !(a.defer_wait && a.kind.is_p2p()) {
            Some(pool.get(dev)?)
        } else {
            None
        };
        // Eager: tickets of the communicator's doorbell. Captured: the op's own graph doorbell
        // with constant values from 1 (`commd_proto::graph`), tied to the graph's life.
        let graph_slot = match (cap, gdev) {
            (Some(cp), Some(gd)) => {
                let slot = gs.graphs.alloc(i, self.handle)?;
                // SAFETY: `cp.graph` is the graph being captured.
                if let Err(e) = unsafe { graph::retain_slot(cp.graph, &gs.graphs.released, slot) } {
                    gs.graphs.unalloc(slot);
                    return Err(e);
                }
                Some((slot, gd, cp.id))
            }
            _ => None,
        };
        let (ticket, ready, done) = match graph_slot {
            Some((slot, gd, _)) => (
                commd_proto::graph::phase_value(0),
                gd + commd_proto::desc::graph_doorbell::READY_OFF + 4 * u64::from(slot),
                gd + commd_proto::desc::graph_doorbell::DONE_OFF + 4 * u64::from(slot),
            ),
            None => (c.next_ticket, ready, done),
        };
        let d = SubmitDesc {
            user_data: 0,
            opcode: a.kind.code(),
            dtype: a.dtype.code(),
            redop: a.redop.map(|r| r.code()).unwrap_or(0),
            flags: flags::CUDA
                | if one_shot { flags::ONE_SHOT } else { 0 }
                | if staged { flags::HOST_STAGED } else { 0 }
                | if graph_slot.is_some() {
                    flags::PERSISTENT
                } else {
                    0
                },
            comm: self.handle,
            peer: a.peer,
            count: a.count,
            send_mem: send.0,
            recv_mem: recv.0,
            send_off: send.1,
            recv_off: recv.1,
            // A captured op: its slot, and its capture as the tag (`flags::PERSISTENT`).
            ticket: match graph_slot {
                Some((slot, _, id)) => u64::from(slot) | (u64::from((id as u32).max(1)) << 32),
                None => u64::from(ticket),
            },
        };
        let s = a.stream;
        let write = |v: u32| {
            ck(
                // SAFETY: `ready` is a device-mapped address of the registered doorbell page.
                unsafe { sys::cuStreamWriteValue32_v2(s, ready, v, 0) },
                "cuStreamWriteValue32",
            )
        };
        // The size that picks how the stream waits (`wait::auto_bytes`), not the data moved.
        // Ranks sharing this GPU (the daemon's hint, set once every rank bound its scratch):
        // 0, the memory op under `auto`, since a polling kernel would be time-sliced against
        // the daemon's same-GPU copy kernels.
        let hint = i
            .ring
            .doorbell_hint(self.doorbell_slot)
            .map_or(0, |h| h.load(std::sync::atomic::Ordering::Acquire));
        let shared_gpu = hint & doorbell::HINT_SHARED_GPU != 0;
        let own_gpu = hint & doorbell::HINT_OWN_GPU != 0 && !shared_gpu;
        let op_bytes = if shared_gpu {
            0
        } else {
            wait::auto_bytes(a.kind, a.count.saturating_mul(es))
        };
        // An eager reduction of several rounds, where this rank reduces every round: one launch
        // of the rounds kernel for all of them (`kernels::rounds`), so a GEMM holding the SMs
        // delays the op once, not once per round. Only once the daemon has said that this
        // rank's GPU is its own (`HINT_OWN_GPU`): ranks sharing a GPU would time-slice against
        // a kernel that waits inside, or under MPS keep each other's kernels from starting.
        let fused = match (kernels, scratch) {
            (Some(_), Some(_))
                if graph_slot.is_none()
                    && shape.rounds >= 2
                    && own_gpu
                    && (me_root || a.kind != OpKind::Reduce) =>
            {
                let f = algo::fused()?;
                if f.on {
                    let bar = match c.rounds_bar {
                        Some(b) => b,
                        None => {
                            let mut b: sys::CUdeviceptr = 0;
                            ck(
                                // SAFETY: the op's context is current (ensure_context above);
                                // `b` is a valid out pointer.
                                unsafe { sys::cuMemAlloc_v2(&mut b, 16) },
                                "cuMemAlloc(rounds barrier)",
                            )?;
                            ck(
                                // SAFETY: `b` was just allocated with 16 bytes; `s` is the op's
                                // stream, validated above, so the kernel runs after the memset.
                                unsafe { sys::cuMemsetD32Async(b, 0, 4, s) },
                                "cuMemsetD32Async(rounds barrier)",
                            )?;
                            c.rounds_bar = Some(b);
                            b
                        }
                    };
                    Some((bar, f.max_blocks, f.cooperative))
                } else {
                    None
                }
            }
            _ => None,
        };
        // Resolved once for the op's waits (a reduction waits rounds + 1 times).
        // SAFETY: `s` was validated above.
        let waiter = unsafe { wait::Waiter::new(s, op_bytes)? };
        // SAFETY: as above for `done`; `waiter` was made for `s`.
        let wait = |v: u32| unsafe { waiter.enqueue(s, done, v) };
        // An eager collective on the daemon's path where the communicator has eager direct
        // windows: its daemon mark first (`Communicator::mark_daemon_op`), so that a peer that
        // runs this op as a direct op is told at once.
        if cap.is_none() && !staged && !a.kind.is_p2p() && device.is_some() {
            // SAFETY: `s` was validated above and is of device `dev`, current.
            unsafe { self.mark_daemon_op(&mut c.eager, a.kind, s, dev)? };
        }
        // An eager send/recv: counted for its pair's later direct ops (their signature carries
        // it: a receive whose peer put another number of messages there first fails as a
        // mismatch), and its daemon mark, so that the peer's direct op waiting for this one's
        // counterpart fails at once.
        if cap.is_none() && a.kind.is_p2p() {
            // SAFETY: as above.
            unsafe { c.p2p_daemon_op(a.peer, a.kind == OpKind::Send, s, device)? };
        }
        // A captured op's slot, once posted, is released only with its graph (the daemon may
        // hold it); posting can only fail before the daemon sees it.
        let user_data = i.post(d)?;
        if graph_slot.is_none() {
            c.next_ticket = ticket.wrapping_add(phases as u32);
        }
        let req = Request::new(i.clone(), user_data, None, None);
        // From here on the op is posted: a failure to enqueue must not leave the daemon waiting
        // for ready counters that never come, so later phases are signalled anyway (the error
        // is returned, and the daemon's timeout would catch a stream that never runs).
        // A replay ends with the stream resetting its done word (`commd_proto::graph`).
        let reset = || match graph_slot {
            Some(_) => ck(
                // SAFETY: `done` is a device-mapped address of the registered graph area.
                unsafe { sys::cuStreamWriteValue32_v2(s, done, commd_proto::graph::DONE_RESET, 0) },
                "cuStreamWriteValue32",
            ),
            None => Ok(()),
        };
        // The op's stream work is queued: the event the communicator's next op on another
        // stream waits for.
        let mut order_ev = order_ev;
        let mut mark = |last: &mut Option<(usize, Arc<CudaEvent>)>| -> Result<()> {
            if let Some(ev) = order_ev.take() {
                // SAFETY: `s` was validated above and is of the event's device.
                unsafe { ev.record(s)? };
                *last = Some((s as usize, Arc::new(ev)));
            }
            Ok(())
        };
        let enq = (|| -> Result<()> {
            if !kernel_reduces {
                write(ticket)?;
                if a.defer_wait && a.kind.is_p2p() {
                    match graph_slot {
                        Some((slot, _, id)) => {
                            c.captured_deferred
                                .push((id, slot, phases as u32, op_bytes))
                        }
                        None => {
                            let most = c.deferred.map_or(0, |(_, b)| b).max(op_bytes);
                            c.deferred = Some((ticket, most));
                        }
                    }
                } else {
                    wait(ticket)?;
                    reset()?;
                }
                mark(&mut c.last)?;
                if let Some(e) = &done_ev {
                    // SAFETY: `s` was validated above and is of the event's device.
                    unsafe { e.record(s)? };
                }
                return Ok(());
            }
            let sc = scratch.unwrap_or(Scratch {
                ptr: 0,
                slot_bytes,
                device: 0,
            });
            let k = kernels.ok_or_else(|| Error::InvalidArgument("kernels".into()))?;
            let op = a
                .redop
                .ok_or_else(|| Error::InvalidArgument("reduction op missing".into()))?;
            // Every round in one launch: round 0's phase waited for here, the later ones
            // inside the kernel; the same pieces, slots and order as the loop below.
            let mut from = 0;
            if let Some((bar, max_blocks, coop)) = fused {
                write(ticket)?;
                wait(ticket)?;
                let (src, piecewise) = match a.kind {
                    OpKind::AllReduce => (a.send.unwrap_or(0), 1),
                    OpKind::Reduce => (a.send.unwrap_or(0), 0),
                    _ => (a.send.unwrap_or(0) + u64::from(self.rank) * a.count * es, 0),
                };
                let ra = kernels::RoundsArgs {
                    dst: a.recv.unwrap_or(0),
                    src,
                    scratch: sc.ptr,
                    slot_bytes: sc.slot_bytes,
                    round_elems: shape.round_elems,
                    count: a.count,
                    ready,
                    done,
                    bar,
                    n: self.nranks,
                    rank: self.rank,
                    piecewise,
                    rounds: shape.rounds as u32,
                    ticket,
                    divisor: self.nranks,
                };
                // SAFETY: the pieces of every round lie inside the op's buffers and this
                // rank's scratch (as for the per-round launches); `ready`/`done` are the
                // doorbell's device-mapped words; the barrier is this communicator's, whose
                // GPU work is ordered (one stream, or events across streams).
                match unsafe { k.launch_rounds(s, a.dtype, op, max_blocks, coop, &ra) } {
                    Ok(_) => from = shape.rounds,
                    // A launch refused (e.g. too few SMs free for a cooperative grid on this
                    // GPU): the op goes on with one launch per round, which writes round 0's
                    // ready again (the same value) and finds its wait satisfied.
                    Err(e) => warn_once_rounds(&e),
                }
            }
            // Phase j: round j's inputs are in the scratch (for all-reduce, round j - 1's pieces
            // are being pushed out); then this rank's kernel reduces round j. The last phase
            // follows the last kernel (see `commd_proto::desc::CudaShape`).
            for j in from..shape.rounds {
                let t = ticket.wrapping_add(j as u32);
                write(t)?;
                wait(t)?;
                let s0 = j * shape.round_elems;
                let len = shape.round_elems.min(a.count - s0.min(a.count));
                // This rank's piece of the round and where its inputs sit.
                let (start, plen, src_base, dst_base, reduces_here) = match a.kind {
                    OpKind::AllReduce if one_shot => {
                        (s0, len, a.send.unwrap_or(0), a.recv.unwrap_or(0), true)
                    }
                    OpKind::AllReduce => {
                        let (ps, pl) = cu::piece(s0, len, n, u64::from(self.rank));
                        (ps, pl, a.send.unwrap_or(0), a.recv.unwrap_or(0), true)
                    }
                    OpKind::Reduce => (s0, len, a.send.unwrap_or(0), a.recv.unwrap_or(0), me_root),
                    _ => {
                        let off = u64::from(self.rank) * a.count * es;
                        (
                            s0,
                            len,
                            a.send.unwrap_or(0) + off,
                            a.recv.unwrap_or(0),
                            true,
                        )
                    }
                };
                if reduces_here && plen > 0 {
                    let mut ins = vec![src_base + start * es];
                    let dst = dst_base + start * es;
                    for k in 0..u64::from(self.nranks.saturating_sub(1)) {
                        ins.push(
                            sc.ptr
                                + commd_proto::desc::cuda_scratch_off(
                                    j,
                                    k,
                                    self.nranks,
                                    sc.slot_bytes,
                                ),
                        );
                    }
                    // SAFETY: every pointer addresses `plen` elements inside the op's buffers
                    // or this rank's scratch (checked above / sized by the daemon).
                    unsafe { k.launch(s, a.dtype, op, dst, &ins, plen, self.nranks)? };
                }
            }
            let last = ticket.wrapping_add(shape.rounds as u32);
            write(last)?;
            wait(last)?;
            reset()?;
            mark(&mut c.last)?;
            if let Some(e) = &done_ev {
                // SAFETY: `s` was validated above and is of the event's device.
                unsafe { e.record(s)? };
            }
            Ok(())
        })();
        enq.map(|()| CudaPosted {
            request: req,
            done: done_ev.map(Arc::new),
            device: dev,
            last_ticket: ticket.wrapping_add(phases as u32).wrapping_sub(1),
            bytes: op_bytes,
            captured: graph_slot.is_some(),
        })
    }
}

/// Logs, once per process, that the rounds kernel could not be launched (the op used one launch
/// per round instead).
fn warn_once_rounds(e: &kernels::KernelError) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        eprintln!(
            "commd: the rounds kernel could not be launched ({e}); multi-round GPU reductions \
             use one launch per round"
        )
    });
}

impl Communicator {
    /// Captured send/recv ops whose waits were deferred (end of their group): when `stream` is
    /// being captured, enqueues each op's wait and done reset on it and returns true. Ops
    /// deferred in another capture (one that ended without waiting for them) are an error:
    /// that graph signals ops it never waits for, so its results would not be ordered.
    ///
    /// # Safety
    /// `stream` must be a live stream.
    unsafe fn flush_captured(&self, c: &mut CommGpu, stream: sys::CUstream) -> Result<bool> {
        if c.captured_deferred.is_empty() {
            return Ok(false);
        }
        // SAFETY: the caller's contract.
        let cap = unsafe { graph::capture_of(stream, "the wait for captured send/recv ops")? };
        let Some(cap) = cap else {
            return Err(Error::Unsupported(format!(
                "{} send/recv op(s) were captured into a CUDA graph but their wait was not: call wait() on their Work objects (or end the send/recv group) before the capture ends. Destroy that graph: its replays would not wait for those transfers",
                c.captured_deferred.len()
            )));
        };
        if let Some(other) = c.captured_deferred.iter().find(|d| d.0 != cap.id) {
            let n = c.captured_deferred.len();
            let _ = other;
            c.captured_deferred.clear();
            return Err(Error::Unsupported(format!(
                "{n} send/recv op(s) captured into another CUDA graph were never waited for in that capture; destroy that graph: its replays would not wait for those transfers"
            )));
        }
        let gdev = self.client.graph_dev(&mut lock(&self.client.gpu))?;
        let most = c.captured_deferred.iter().map(|d| d.3).max().unwrap_or(0);
        // SAFETY: the caller's contract.
        let waiter = unsafe { wait::Waiter::new(stream, most)? };
        for (_, slot, phases, _) in c.captured_deferred.drain(..) {
            let done = gdev + graph_doorbell::DONE_OFF + 4 * u64::from(slot);
            let last = commd_proto::graph::phase_value(phases.max(1) - 1);
            // SAFETY: `done` is a device-mapped address of the registered graph area.
            unsafe { waiter.enqueue(stream, done, last)? };
            ck(
                // SAFETY: as above.
                unsafe {
                    sys::cuStreamWriteValue32_v2(stream, done, commd_proto::graph::DONE_RESET, 0)
                },
                "cuStreamWriteValue32",
            )?;
        }
        Ok(true)
    }
}

/// DESIGN.md contract 6: a wait for *eager* GPU ops (their tickets) enqueued on a stream that
/// is being captured is refused before anything is enqueued: the wait would bake the eager
/// ticket into the graph, so every replay after the first would pass it at once (stale data,
/// no error). Ops issued during capture are persistent ops instead (`graph`).
///
/// # Safety
/// `stream` must be a stream handle of this process (null: the legacy default stream); the
/// driver validates it and only reads it.
pub unsafe fn refuse_capture(stream: sys::CUstream, what: &str) -> Result<()> {
    use cu::context::Capture;
    // SAFETY: the caller's contract.
    let why = match unsafe { cu::context::capture_status(stream) }? {
        Capture::None => return Ok(()),
        Capture::Active => "its stream is being captured into a CUDA graph",
        Capture::Invalidated => {
            "its stream's CUDA graph capture was already invalidated by an earlier error"
        }
        Capture::ImplicitLegacy => {
            "it uses the legacy default stream while another stream is being captured into a CUDA graph"
        }
    };
    Err(Error::Unsupported(format!(
        "{what}: {why}. It waits for GPU ops issued outside the capture, whose doorbell values \
         were fixed when they were issued, so a replay would pass the wait at once and leave \
         stale data. Refused (nothing was enqueued); wait for those ops before the capture \
         begins (DESIGN.md contract 6)"
    )))
}
