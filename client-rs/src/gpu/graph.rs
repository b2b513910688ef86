//! Persistent GPU ops: ops issued while their stream is captured into a CUDA graph
//! (docs/contracts.md #6). The client side: which capture an op joins, the graph doorbell slots
//! (one per captured op, in the ring's graph area, `desc::graph_doorbell`), their release when
//! the graph is destroyed (a CUDA user object retained by the graph), and failed replays
//! reported back.
//!
//! What a captured op puts in the graph is pure stream work with constant values
//! (`commd_proto::graph`): per phase a `ready` write and a wait for `done`, the reduction
//! kernels between them, and a final `done = 0`. No CPU work per replay: the daemon notices
//! each replay from the ready words alone.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use commd_proto::desc::graph_doorbell;

use super::cu::{ck, sys};
use crate::{Error, Inner, Result, lock};

/// The capture an op joins.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Capture {
    pub id: u64,
    pub graph: sys::CUgraph,
}

/// `None` when `stream` is not being captured; an error for states no op can run correctly in
/// (an invalidated capture, the legacy stream during a global capture).
///
/// # Safety
/// `stream` must be a live stream (or null, the legacy stream).
pub(crate) unsafe fn capture_of(stream: sys::CUstream, what: &str) -> Result<Option<Capture>> {
    use sys::CUstreamCaptureStatus as S;
    let mut st = S::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id: sys::cuuint64_t = 0;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the caller's contract; valid out pointers; the optional outputs may be null.
    let r = unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            stream,
            &mut st,
            &mut id,
            &mut graph,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    let why = match (r, st) {
        (sys::CUresult::CUDA_SUCCESS, S::CU_STREAM_CAPTURE_STATUS_NONE) => return Ok(None),
        (sys::CUresult::CUDA_SUCCESS, S::CU_STREAM_CAPTURE_STATUS_ACTIVE) => {
            return Ok(Some(Capture { id, graph }));
        }
        (sys::CUresult::CUDA_SUCCESS, S::CU_STREAM_CAPTURE_STATUS_INVALIDATED) => {
            "its stream's CUDA graph capture was already invalidated by an earlier error"
        }
        (sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, _) => {
            "it uses the legacy default stream while another stream is being captured into a CUDA graph"
        }
        (r, st) => {
            ck(r, "cuStreamGetCaptureInfo")?;
            // A successful call with a capture status this build does not know.
            return Err(Error::Unsupported(format!(
                "{what}: unknown CUDA graph capture status {st:?}. The op was refused (nothing was enqueued or posted)"
            )));
        }
    };
    Err(Error::Unsupported(format!(
        "{what}: {why}. The op was refused (nothing was enqueued or posted; docs/design-gpu.md, persistent ops rule 7)"
    )))
}

/// The capture an op on `stream` ordered after `after` joins: `stream`'s, or `after`'s when
/// `stream` joins it through the ordering (torch's communication stream after a capturing
/// current stream). Combinations that would mix captured and eager work are refused.
///
/// # Safety
/// Both streams must be live.
pub(crate) unsafe fn capture_for(
    stream: sys::CUstream,
    after: Option<sys::CUstream>,
    what: &str,
) -> Result<Option<Capture>> {
    // SAFETY: the caller's contract.
    let s = unsafe { capture_of(stream, what)? };
    let a = match after {
        // SAFETY: as above.
        Some(x) if x != stream => unsafe { capture_of(x, what)? },
        _ => return Ok(s),
    };
    match (s, a) {
        (None, None) => Ok(None),
        (Some(s), Some(a)) if s.id == a.id => Ok(Some(s)),
        (Some(_), Some(_)) => Err(Error::Unsupported(format!(
            "{what}: its stream and the stream it is ordered after are being captured into two different CUDA graphs. The op was refused (nothing was enqueued or posted)"
        ))),
        (Some(_), None) => Err(Error::Unsupported(format!(
            "{what}: its stream is being captured into a CUDA graph but the stream it is ordered after is not (work outside the capture cannot be ordered into a graph). The op was refused (nothing was enqueued or posted)"
        ))),
        (None, Some(a)) => Ok(Some(a)),
    }
}

/// Makes this thread's stream capture mode relaxed while it lives, so the first captured op
/// may do its one-time setup (registering host memory with the driver, loading kernels,
/// opening the daemon's scratch) inside a global-mode capture, as NCCL does for its own setup.
/// (The NCCL library uses it too, for the staging of a captured PreMulSum op.)
pub struct Relaxed(sys::CUstreamCaptureMode);

impl Relaxed {
    pub fn enter() -> Result<Self> {
        let mut m = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        ck(
            // SAFETY: valid in/out pointer.
            unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) },
            "cuThreadExchangeStreamCaptureMode",
        )?;
        Ok(Self(m))
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        let mut m = self.0;
        // SAFETY: valid in/out pointer; restores the mode saved by `enter`.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut m) };
    }
}

/// Slots whose graphs were destroyed, filled by the user objects' destructors (a driver thread,
/// which must not call CUDA) and drained by the next commd call or the watchdog.
pub(crate) type Released = Arc<Mutex<Vec<u32>>>;

/// The session's graph doorbell slots.
#[derive(Default)]
pub(crate) struct GraphSlots {
    /// The graph area's device address (registered once with the driver).
    pub dev: Option<sys::CUdeviceptr>,
    free: Vec<u32>,
    next: u32,
    /// Live slot -> its communicator handle.
    pub live: HashMap<u32, u32>,
    pub released: Released,
}

impl GraphSlots {
    /// A free slot for an op of communicator handle `comm` (its words reset to zero).
    pub fn alloc(&mut self, inner: &Inner, comm: u32) -> Result<u32> {
        let slot = match self.free.pop() {
            Some(s) => s,
            None if self.next < graph_doorbell::SLOTS => {
                self.next += 1;
                self.next - 1
            }
            None => {
                return Err(Error::Unsupported(format!(
                    "more than {} GPU ops captured into CUDA graphs are alive in this process (each captured op holds a graph doorbell until its graph is destroyed); destroy unused graphs",
                    graph_doorbell::SLOTS
                )));
            }
        };
        if let Some((r, d, e)) = inner.ring.graph_doorbell(slot) {
            use std::sync::atomic::Ordering::Release;
            r.store(0, Release);
            d.store(0, Release);
            e.store(0, Release);
        }
        self.live.insert(slot, comm);
        Ok(slot)
    }

    /// Every slot is in use.
    pub fn exhausted(&self) -> bool {
        self.free.is_empty() && self.next >= graph_doorbell::SLOTS
    }

    /// A slot whose op was never posted goes straight back.
    pub fn unalloc(&mut self, slot: u32) {
        self.live.remove(&slot);
        self.free.push(slot);
    }
}

/// The destructor's argument: where to report, and which slot.
struct Dtor {
    released: Released,
    slot: u32,
}

unsafe extern "C" fn graph_destroyed(p: *mut std::ffi::c_void) {
    // SAFETY: `p` is the `Box<Dtor>` leaked by `retain_slot`; the driver calls this once.
    let d = unsafe { Box::from_raw(p.cast::<Dtor>()) };
    if d.slot != u32::MAX {
        lock(&d.released).push(d.slot);
    }
}

/// Ties `slot` to the captured graph's life: when the graph (and every executable made from
/// it) is destroyed, the slot is queued for release. On error the slot is the caller's again.
///
/// # Safety
/// `graph` is the graph being captured (from `cuStreamGetCaptureInfo`).
pub(crate) unsafe fn retain_slot(
    graph: sys::CUgraph,
    released: &Released,
    slot: u32,
) -> Result<()> {
    let arg = Box::into_raw(Box::new(Dtor {
        released: released.clone(),
        slot,
    }));
    let mut obj: sys::CUuserObject = std::ptr::null_mut();
    // SAFETY: valid out pointer; `arg` stays valid until the destructor runs (it owns it).
    let r = unsafe {
        sys::cuUserObjectCreate(
            &mut obj,
            arg.cast(),
            Some(graph_destroyed),
            1,
            sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the driver did not take `arg`.
        drop(unsafe { Box::from_raw(arg) });
        ck(r, "cuUserObjectCreate")?;
    }
    // SAFETY: `graph` is live (caller); our one reference moves to it.
    let r = unsafe {
        sys::cuGraphRetainUserObject(
            graph,
            obj,
            1,
            sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        // SAFETY: the destructor has not run (we hold the only reference): `arg` is valid.
        // The slot stays the caller's, so the destructor must not queue it.
        unsafe { (*arg).slot = u32::MAX };
        // SAFETY: our reference; releasing it runs the destructor, which frees `arg`.
        unsafe { sys::cuUserObjectRelease(obj, 1) };
        ck(r, "cuGraphRetainUserObject")?;
    }
    Ok(())
}

impl Inner {
    /// The graph area's device address, registering it with the driver once (host memory
    /// mapped for the GPU, as the doorbell page).
    pub(crate) fn graph_dev(&self, g: &mut super::SessionGpu) -> Result<sys::CUdeviceptr> {
        if let Some(d) = g.graphs.dev {
            return Ok(d);
        }
        let (host, len) = self.ring.graph_area();
        // SAFETY: the area is page-aligned, `len` bytes, and mapped for the session's life.
        let d = unsafe { super::map_host(host, len, "graph doorbells")? };
        g.graphs.dev = Some(d);
        self.graphs_used
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(d)
    }

    /// Tells the daemon which captured ops' graphs were destroyed (it drops what they held)
    /// and frees their slots; slots the daemon holds no op for yet (a capture not yet matched
    /// across ranks) stay queued for the next call. Called by the watchdog every 100 ms, and
    /// when the slots run out. Cheap when there are none.
    pub(crate) fn release_destroyed_graphs(&self) {
        let released = lock(&self.gpu).graphs.released.clone();
        let slots: Vec<u32> = std::mem::take(&mut *lock(&released));
        if slots.is_empty() {
            return;
        }
        let r = self.watched(self.rpc.clone().release_graph_ops(
            commd_proto::pb::GraphOpsRelease {
                session_id: self.session_id,
                slots: slots.clone(),
            },
        ));
        let mut g = lock(&self.gpu);
        match r {
            Ok(Ok(rep)) => {
                let unknown = rep.into_inner().unknown;
                for s in slots {
                    if unknown.contains(&s) {
                        lock(&released).push(s);
                    } else {
                        g.graphs.unalloc(s);
                    }
                }
            }
            // The daemon is gone or refused: the slots stay out of use (their ops may still
            // be held by it), which costs only slots.
            _ => {
                for s in slots {
                    g.graphs.live.remove(&s);
                }
            }
        }
    }

    /// Contract 5 (docs/contracts.md) for captured ops once the daemon is gone (the watchdog,
    /// session abandoned): every graph doorbell is released with the error word set. A replay's
    /// stream resets its done word at the end, so the watchdog repeats this while the process
    /// lives.
    pub(crate) fn release_graph_streams(&self) {
        use std::sync::atomic::Ordering;
        if !self.graphs_used.load(Ordering::Acquire) {
            return;
        }
        for slot in 0..graph_doorbell::SLOTS {
            if let Some((_, done, err)) = self.ring.graph_doorbell(slot) {
                let _ = err.compare_exchange(
                    0,
                    commd_proto::desc::status::PEER_LOST,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                );
                done.store(commd_proto::graph::RELEASED, Ordering::Release);
            }
        }
    }
}

impl crate::Communicator {
    /// Raises the failure of a replay of one of this communicator's captured ops, if one
    /// failed since the last check (the daemon's hint bit says so; the graph doorbells' error
    /// words say which ops, the daemon why). Cheap otherwise: one load.
    pub fn cuda_graph_check(&self) -> Result<()> {
        use commd_proto::desc::doorbell::HINT_GRAPH_FAILED;
        use std::sync::atomic::Ordering;
        let i = &self.client;
        self.direct_check()?;
        let Some(h) = i.ring.doorbell_hint(self.doorbell_slot) else {
            return Ok(());
        };
        if h.load(Ordering::Acquire) & HINT_GRAPH_FAILED == 0 {
            return Ok(());
        }
        h.fetch_and(!HINT_GRAPH_FAILED, Ordering::AcqRel);
        let mut slots: Vec<u32> = lock(&i.gpu)
            .graphs
            .live
            .iter()
            .filter(|(_, c)| **c == self.handle)
            .map(|(s, _)| *s)
            .collect();
        slots.sort_unstable();
        let mut first: Option<(u32, String)> = None;
        let mut failed = 0usize;
        for slot in slots {
            let Some((_, _, err)) = i.ring.graph_doorbell(slot) else {
                continue;
            };
            let st = err.swap(0, Ordering::AcqRel);
            if st == 0 {
                continue;
            }
            failed += 1;
            if first.is_none() {
                let why = i
                    .watched(
                        i.rpc
                            .clone()
                            .get_graph_op_error(commd_proto::pb::GraphOpRef {
                                session_id: i.session_id,
                                slot,
                            }),
                    )
                    .ok()
                    .and_then(|r| r.ok())
                    .map(|r| r.into_inner())
                    .filter(|r| r.status != 0)
                    .map(|r| r.message)
                    .unwrap_or_else(|| "the daemon kept no reason (see its log)".into());
                first = Some((st, why));
            }
        }
        match first {
            None => Ok(()),
            Some((st, why)) => Err(Error::Op {
                kind: crate::OpErrorKind::from_status(st),
                message: format!(
                    "a replay of {failed} GPU op(s) captured into a CUDA graph on communicator {} failed (the replay's streams were released; the results of that replay are not valid): {why}",
                    self.comm_id
                ),
            }),
        }
    }
}
