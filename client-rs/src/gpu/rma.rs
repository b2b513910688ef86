//! Memory windows and one-sided ops: NCCL 2.29's `ncclCommWindowRegister`, `ncclPutSignal`,
//! `ncclSignal` and `ncclWaitSignal`, for every face.
//!
//! A window is a buffer every rank registers together (one host all-gather of offers through
//! the daemon). Device memory is exported by CUDA IPC handle, and each rank maps the windows of
//! the peers it can reach (same node, GPU visible, peer access); a peer of the same process is
//! used by address. Host memory can be registered too (windows for collectives), but one-sided
//! ops need device memory on both sides.
//!
//! The one-sided ops are copy-engine work and stream memory operations on the caller's stream,
//! no kernels and no SMs, no daemon round trip (as NCCL 2.29 runs them on copy engines):
//! - a put is one copy into the peer's mapped window, then its signal;
//! - a signal raises this rank's slot in the peer's signal area: the sender's count of signals
//!   to that peer is written to a staging word of its own on the stream, then copied into the
//!   slot (a copy, so that it is ordered after the data copy on the same engine path, as
//!   NCCL's);
//! - a wait is a `cuStreamWaitValue64` (greater or equal) on this rank's own slot of each peer,
//!   for the count of signals it has waited for from that peer so far.
//!
//! A communicator's one-sided ops run in the order they were issued, whatever their streams
//! (NCCL orders a communicator's work the same way): an event is recorded after each, and an
//! op on another stream than the last one's waits for it first. That keeps each slot's count
//! rising (two signals to one peer on two streams cannot land out of order) and makes the
//! staging words safe to reuse in turn.
//!
//! The signal area (one u64 per rank, then the staging words) is allocated with the
//! communicator's first device window and kept until the process exits, like the direct ops'
//! windows; when the communicator is dropped (NCCL's destroy and abort), every slot is raised
//! to the largest value, so that no stream waits forever for a peer that is gone
//! (docs/contracts.md #5). Not yet: one-sided ops captured into CUDA graphs (refused: a replay
//! would write the captured counts again), signal indices and contexts other than 0.

#![allow(unsafe_code)] // CUDA driver calls on device memory and the caller's stream

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use commd_proto::num::usize_of;

use super::CudaEvent;
use super::cu::{self, sys};
use super::direct::{alloc_window, open_ipc};
use crate::{Communicator, Error, Result, lock};

/// Bytes of one rank's offer in a window registration.
const OFFER: usize = 512;
/// Where the offer's failure text starts (the rest of the offer).
const WHY_AT: usize = 232;
/// Staging words for signal values, reused in turn: signal `k + STAGE_WORDS` writes the word
/// of signal `k`, which has run by then (the ops run in issue order).
const STAGE_WORDS: u64 = 1024;

const KIND_FAILED: u8 = 0;
const KIND_HOST: u8 = 1;
const KIND_DEVICE: u8 = 2;

/// A peer's window (or signal area) as this process reaches it.
#[derive(Clone, Debug)]
struct Seg {
    addr: u64,
    bytes: u64,
    /// The IPC handle it was opened from (closed with the last use), or `None`: the peer's
    /// own address (same process) or this rank's memory.
    opened: Option<[u8; 64]>,
}

/// Why a peer cannot be reached, or how.
type Reach = std::result::Result<Seg, String>;

struct Window {
    ptr: u64,
    bytes: u64,
    /// The GPU of device memory; `None` for host memory.
    device: Option<i32>,
    peers: Vec<Reach>,
}

struct Signals {
    device: i32,
    /// This rank's area: slot `r` (a u64) is written by rank `r`; then the staging words.
    local: u64,
    next_stage: u64,
    /// Recorded after each one-sided op, on its stream; the stream of the last one (as an
    /// address; `None` before the first).
    order: CudaEvent,
    last_stream: Option<usize>,
    /// Each rank's area as this process reaches it; `None` until that rank has one.
    peers: Vec<Option<Reach>>,
}

impl Signals {
    /// Makes `stream` wait for the communicator's last one-sided op when that ran on another
    /// stream (the per-thread default stream is one handle for many streams: it always waits).
    ///
    /// # Safety
    /// `stream` is a live stream (or null) of the signal area's device's context, current.
    unsafe fn after_last(&self, stream: sys::CUstream) -> Result<()> {
        let per_thread = stream as usize == 2; // CU_STREAM_PER_THREAD
        match self.last_stream {
            Some(last) if last != stream as usize || per_thread => {
                // SAFETY: the caller's contract on `stream`.
                unsafe { self.order.wait_on(stream) }
            }
            _ => Ok(()),
        }
    }

    /// Records that the op just enqueued on `stream` is the communicator's last.
    ///
    /// # Safety
    /// As [`Signals::after_last`].
    unsafe fn done_on(&mut self, stream: sys::CUstream) -> Result<()> {
        // SAFETY: the caller's contract on `stream`.
        unsafe { self.order.record(stream)? };
        self.last_stream = Some(stream as usize);
        Ok(())
    }
}

/// A communicator's windows and signals.
#[derive(Default)]
pub(crate) struct Rma {
    next_id: u64,
    windows: HashMap<u64, Window>,
    signals: Option<Signals>,
    /// Signals sent to each rank, and waited for from each rank, so far.
    sent: Vec<u64>,
    waited: Vec<u64>,
}

/// IPC handles opened in this process, with their address and number of users: a handle can
/// be opened once per context, and two windows may lie in one allocation.
type Opened = Mutex<HashMap<[u8; 64], (u64, u32)>>;

fn opened() -> &'static Opened {
    static O: OnceLock<Opened> = OnceLock::new();
    O.get_or_init(Default::default)
}

fn open_shared(dev: i32, handle: [u8; 64], uuid: [u8; 16]) -> std::result::Result<u64, String> {
    let mut o = lock(opened());
    if let Some((p, n)) = o.get_mut(&handle) {
        *n += 1;
        return Ok(*p);
    }
    let p = open_ipc(dev, &handle, uuid)?;
    o.insert(handle, (p, 1));
    Ok(p)
}

fn close_shared(handle: &[u8; 64]) {
    let mut o = lock(opened());
    if let Some((p, n)) = o.get_mut(handle) {
        *n -= 1;
        if *n == 0 {
            let p = *p;
            o.remove(handle);
            // SAFETY: opened by `open_shared` with cuIpcOpenMemHandle; its last user is gone.
            unsafe { sys::cuIpcCloseMemHandle(p) };
        }
    }
}

/// This process, told apart from every other one (pids repeat across containers).
fn process_token() -> u64 {
    static T: OnceLock<u64> = OnceLock::new();
    *T.get_or_init(|| {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.finish() | 1
    })
}

/// This machine's boot: ranks with another one are on another node.
fn boot_id() -> [u8; 40] {
    let mut b = [0u8; 40];
    if let Ok(s) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") {
        for (d, c) in b.iter_mut().zip(s.trim().bytes()) {
            *d = c;
        }
    }
    b
}

fn get_u64(o: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&o[at..at + 8]);
    u64::from_le_bytes(b)
}

fn put_u64(o: &mut [u8], at: usize, v: u64) {
    o[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

fn handle_at(o: &[u8], at: usize) -> [u8; 64] {
    let mut h = [0u8; 64];
    h.copy_from_slice(&o[at..at + 64]);
    h
}

// Offer layout: [0..64) the window allocation's IPC handle, [64..72) the window's offset in it,
// [72..80) its bytes, [80..88) its address, [88..96) the process token, [96] its kind, [97]
// whether the rank has a signal area, [104..120) the GPU's uuid, [120..184) the signal area's
// IPC handle, [184..192) its address, [192..232) the boot id, then the failure text.
const AT_OFF: usize = 64;
const AT_BYTES: usize = 72;
const AT_PTR: usize = 80;
const AT_TOKEN: usize = 88;
const AT_KIND: usize = 96;
const AT_HAS_SIG: usize = 97;
const AT_UUID: usize = 104;
const AT_SIG: usize = 120;
const AT_SIG_PTR: usize = 184;
const AT_BOOT: usize = 192;

/// What this rank registers: its offer, and a signal area allocated for it (freed if the
/// registration fails).
struct Local {
    offer: Vec<u8>,
    device: Option<i32>,
    new_signals: Option<u64>,
}

impl Communicator {
    /// Registers `[ptr, ptr + bytes)` as a window of this communicator, with every rank
    /// (collective: each rank registers its own buffer, sizes may differ). Returns the window's
    /// id in this process. Fails on every rank alike when one rank's buffer cannot be
    /// registered (the message names it); a peer that cannot be reached (another node, a GPU
    /// not visible here, no peer access) does not fail the registration: a put to it does,
    /// saying why.
    pub fn register_window(&self, ptr: u64, bytes: u64) -> Result<u64> {
        if ptr == 0 || bytes == 0 {
            return Err(Error::InvalidArgument(format!(
                "a window needs a buffer and a size (got {ptr:#x}, {bytes} bytes)"
            )));
        }
        let pool = lock(&self.client.gpu).events.clone();
        let mut g = lock(&self.rma);
        let n = self.nranks as usize;
        if g.sent.len() != n {
            g.sent = vec![0; n];
            g.waited = vec![0; n];
        }
        let local = self.window_offer(&g, ptr, bytes);
        let free_new = || {
            if let Some(p) = local.new_signals {
                // SAFETY: allocated by `window_offer` for this registration; nothing uses it.
                unsafe { sys::cuMemFree_v2(p) };
            }
        };
        let all = self
            .host_all_gather(&local.offer)
            .inspect_err(|_| free_new())?;
        let part = |r: usize| &all[r * OFFER..(r + 1) * OFFER];
        if let Some(r) = (0..n).find(|&r| part(r)[AT_KIND] == KIND_FAILED) {
            free_new();
            let why = String::from_utf8_lossy(&part(r)[WHY_AT..]);
            return Err(Error::InvalidArgument(format!(
                "window registration failed on rank {r}: {}",
                why.trim_end_matches('\0')
            )));
        }
        if let (Some(p), Some(dev)) = (local.new_signals, local.device) {
            let order = pool.get(dev).inspect_err(|_| free_new())?;
            g.signals = Some(Signals {
                device: dev,
                local: p,
                next_stage: 0,
                order,
                last_stream: None,
                peers: vec![None; n],
            });
        }
        let me = self.rank as usize;
        let peers = (0..n)
            .map(|r| {
                if r == me {
                    return Ok(Seg {
                        addr: ptr,
                        bytes,
                        opened: None,
                    });
                }
                reach(&local, part(r), r, AT_HANDLE_WIN)
            })
            .collect();
        if let Some(s) = g.signals.as_mut() {
            for r in 0..n {
                if s.peers[r].is_none() && part(r)[AT_HAS_SIG] == 1 {
                    s.peers[r] = Some(if r == me {
                        Ok(Seg {
                            addr: s.local,
                            bytes: 8 * n as u64,
                            opened: None,
                        })
                    } else {
                        reach(&local, part(r), r, AT_SIG)
                    });
                }
            }
        }
        g.next_id += 1;
        let id = g.next_id;
        g.windows.insert(
            id,
            Window {
                ptr,
                bytes,
                device: local.device,
                peers,
            },
        );
        Ok(id)
    }

    /// This rank's offer for a window at `ptr` (its failure, if any, inside it).
    fn window_offer(&self, g: &Rma, ptr: u64, bytes: u64) -> Local {
        let mut offer = vec![0u8; OFFER];
        put_u64(&mut offer, AT_BYTES, bytes);
        put_u64(&mut offer, AT_PTR, ptr);
        put_u64(&mut offer, AT_TOKEN, process_token());
        offer[AT_BOOT..AT_BOOT + 40].copy_from_slice(&boot_id());
        let mut local = Local {
            offer,
            device: None,
            new_signals: None,
        };
        match self.export_window(g, ptr, bytes, &mut local) {
            Ok(()) => {}
            Err(why) => {
                local.offer[AT_KIND] = KIND_FAILED;
                let why = format!("{why}");
                let b = why.as_bytes();
                let len = b.len().min(OFFER - WHY_AT);
                local.offer[WHY_AT..WHY_AT + len].copy_from_slice(&b[..len]);
            }
        }
        local
    }

    fn export_window(&self, g: &Rma, ptr: u64, bytes: u64, local: &mut Local) -> Result<()> {
        let attrs = cu::driver()
            .ok()
            .and_then(|()| cu::mem::pointer_attrs(ptr).ok())
            .filter(cu::mem::PointerAttrs::is_device_memory);
        let o = &mut local.offer;
        let Some(a) = attrs else {
            o[AT_KIND] = KIND_HOST;
            o[AT_HAS_SIG] = u8::from(g.signals.is_some());
            return Ok(());
        };
        if ptr + bytes > a.base + a.size {
            return Err(Error::InvalidArgument(format!(
                "the window at {ptr:#x} ({bytes} bytes) runs past the end of its allocation ({} bytes at {:#x})",
                a.size, a.base
            )));
        }
        if !a.legacy_ipc {
            return Err(Error::Unsupported(format!(
                "the window at {ptr:#x} is cuMem (VMM) or managed memory, which commd cannot share with peers yet: allocate it with ncclMemAlloc or cudaMalloc (in PyTorch: without expandable segments)"
            )));
        }
        if let Some(s) = &g.signals
            && s.device != a.ordinal
        {
            return Err(Error::InvalidArgument(format!(
                "the window is on GPU {}, the communicator's earlier windows on GPU {}: all of a communicator's windows are on its GPU",
                a.ordinal, s.device
            )));
        }
        super::ensure_context(a.ordinal)?;
        o[..64].copy_from_slice(&cu::mem::ipc_handle(a.base)?);
        put_u64(o, AT_OFF, ptr - a.base);
        o[AT_UUID..AT_UUID + 16].copy_from_slice(&super::device_uuid(a.ordinal)?);
        let sig = match &g.signals {
            Some(s) => s.local,
            None => {
                let n = u64::from(self.nranks);
                let (p, _) = alloc_window(8 * (n + STAGE_WORDS), &[(0, 8 * (n + STAGE_WORDS))])?;
                local.new_signals = Some(p);
                p
            }
        };
        o[AT_SIG..AT_SIG + 64].copy_from_slice(&cu::mem::ipc_handle(sig)?);
        put_u64(o, AT_SIG_PTR, sig);
        o[AT_HAS_SIG] = 1;
        o[AT_KIND] = KIND_DEVICE;
        local.device = Some(a.ordinal);
        Ok(())
    }

    /// Deregisters window `id` of this rank (local, as NCCL's: the caller makes sure no op
    /// still uses it): the peers' windows mapped for it are closed.
    pub fn deregister_window(&self, id: u64) -> Result<()> {
        let w = lock(&self.rma).windows.remove(&id).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "window {id} is not a live window of this communicator"
            ))
        })?;
        if let Some(dev) = w.device {
            cu::context::with_primary_ctx(dev, || {
                for s in w.peers.iter().flatten() {
                    if let Some(h) = &s.opened {
                        close_shared(h);
                    }
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The buffer window `id` was registered with, and its size.
    pub fn window_buffer(&self, id: u64) -> Result<(u64, u64)> {
        lock(&self.rma)
            .windows
            .get(&id)
            .map(|w| (w.ptr, w.bytes))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "window {id} is not a live window of this communicator"
                ))
            })
    }

    /// Writes `bytes` from device memory `src` into rank `peer`'s part of window `win` at
    /// `offset`, then signals `peer`; with `win` `None` (and no bytes), only the signal. On
    /// `stream`: the data copy and the signal run after the work queued before, and the
    /// signal lands after the data.
    ///
    /// # Safety
    /// `src` is device memory of this process holding `bytes` until the stream passes the
    /// put; `stream` is a live stream (or null) of the communicator's GPU's context, which is
    /// current.
    pub unsafe fn put_signal(
        &self,
        src: u64,
        bytes: u64,
        peer: u32,
        win: Option<(u64, u64)>,
        stream: sys::CUstream,
    ) -> Result<()> {
        let what = if win.is_some() { "put" } else { "signal" };
        self.rma_checks(what, &[peer], stream)?;
        let mut g = lock(&self.rma);
        let me = self.rank as usize;
        let p = peer as usize;
        let slot = signal_slot(&g, p, what)?;
        let s = g.signals.as_ref().ok_or_else(no_signals)?;
        // SAFETY: the caller's contract on `stream`.
        unsafe { s.after_last(stream)? };
        if let Some((id, offset)) = win {
            let w = g.windows.get(&id).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "window {id} is not a live window of this communicator"
                ))
            })?;
            let seg = match (&w.device, &w.peers[p]) {
                (None, _) => {
                    return Err(Error::Unsupported(
                        "put: this rank's window is host memory; one-sided ops need device memory windows".into(),
                    ));
                }
                (_, Err(why)) => {
                    return Err(Error::Unsupported(format!(
                        "put: rank {peer}'s window cannot be reached from rank {me}: {why}"
                    )));
                }
                (_, Ok(s)) => s.clone(),
            };
            if offset.checked_add(bytes).is_none_or(|e| e > seg.bytes) {
                return Err(Error::InvalidArgument(format!(
                    "put: {bytes} bytes at offset {offset} run past the end of rank {peer}'s window ({} bytes)",
                    seg.bytes
                )));
            }
            if bytes > 0 {
                let (base, size, _) = super::pointer_span(src)?;
                if src + bytes > base + size {
                    return Err(Error::InvalidArgument(format!(
                        "put: the source at {src:#x} ({bytes} bytes) runs past the end of its allocation ({size} bytes at {base:#x})"
                    )));
                }
                cu::ck(
                    // SAFETY: the caller's contract for `src` and `stream`; the destination
                    // lies within the peer's window, mapped in this process.
                    unsafe {
                        sys::cuMemcpyDtoDAsync_v2(seg.addr + offset, src, usize_of(bytes), stream)
                    },
                    "cuMemcpyDtoDAsync(put)",
                )?;
            }
        }
        let seq = g.sent[p] + 1;
        let s = g.signals.as_mut().ok_or_else(no_signals)?;
        let stage = s.local + 8 * (u64::from(self.nranks) + s.next_stage % STAGE_WORDS);
        cu::ck(
            // SAFETY: `stage` is a word of this rank's signal area; the caller's stream.
            unsafe { sys::cuStreamWriteValue64_v2(stream, stage, seq, 0) },
            "cuStreamWriteValue64(signal)",
        )?;
        cu::ck(
            // SAFETY: `slot` is this rank's word in the peer's signal area, mapped here.
            unsafe { sys::cuMemcpyDtoDAsync_v2(slot + 8 * me as u64, stage, 8, stream) },
            "cuMemcpyDtoDAsync(signal)",
        )?;
        s.next_stage += 1;
        // SAFETY: the caller's contract on `stream`.
        unsafe { s.done_on(stream)? };
        g.sent[p] = seq;
        Ok(())
    }

    /// Makes `stream` wait until `count` more signals came from each `(peer, count)` than it
    /// waited for before; the data of the puts they signal is then visible to the stream's
    /// later work.
    ///
    /// # Safety
    /// `stream` is a live stream (or null) of the communicator's GPU's context, which is
    /// current.
    pub unsafe fn wait_signals(&self, waits: &[(u32, u64)], stream: sys::CUstream) -> Result<()> {
        let peers: Vec<u32> = waits.iter().map(|w| w.0).collect();
        self.rma_checks("wait", &peers, stream)?;
        if let Some((p, _)) = waits.iter().find(|w| w.1 == 0) {
            return Err(Error::InvalidArgument(format!(
                "wait: the count of signals from rank {p} is 0"
            )));
        }
        let mut g = lock(&self.rma);
        let local = g.signals.as_ref().ok_or_else(no_signals)?.local;
        // A peer this rank cannot reach cannot reach it either (another node, a GPU not
        // visible, no peer access, or no device window): its signals would never come.
        for &(p, _) in waits {
            signal_slot(&g, p as usize, "wait")?;
        }
        let s = g.signals.as_ref().ok_or_else(no_signals)?;
        // SAFETY: the caller's contract on `stream`.
        unsafe { s.after_last(stream)? };
        for &(p, c) in waits {
            let want = g.waited[p as usize] + c;
            cu::ck(
                // SAFETY: slot `p` of this rank's signal area; the caller's stream.
                unsafe {
                    sys::cuStreamWaitValue64_v2(
                        stream,
                        local + 8 * u64::from(p),
                        want,
                        sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                    )
                },
                "cuStreamWaitValue64(signal)",
            )?;
            g.waited[p as usize] = want;
        }
        let s = g.signals.as_mut().ok_or_else(no_signals)?;
        // SAFETY: the caller's contract on `stream`.
        unsafe { s.done_on(stream) }
    }

    /// What every one-sided op checks: the peers, CUDA, and the stream not being captured.
    fn rma_checks(&self, what: &str, peers: &[u32], stream: sys::CUstream) -> Result<()> {
        if let Some(p) = peers.iter().find(|&&p| p >= self.nranks) {
            return Err(Error::InvalidArgument(format!(
                "{what}: peer {p} is not a rank of this communicator of {}",
                self.nranks
            )));
        }
        super::driver()?;
        // SAFETY: the caller's contract on `stream`.
        match unsafe { cu::context::capture_status(stream) }? {
            cu::context::Capture::None => Ok(()),
            _ => Err(Error::Unsupported(format!(
                "{what}: one-sided ops cannot be captured into CUDA graphs yet (their signal counts would repeat at every replay); issue them outside the capture"
            ))),
        }
    }

    /// Raises every slot of this rank's signal area to the largest value, so that no stream
    /// waits for a signal that will not come, and closes the peers' windows mapped for this
    /// communicator (its drop: NCCL's destroy and abort).
    pub(crate) fn release_windows(&self) {
        let mut g = lock(&self.rma);
        let Some(s) = g.signals.as_ref() else {
            return;
        };
        let (dev, local) = (s.device, s.local);
        let n = usize_of(8 * u64::from(self.nranks));
        let _ = cu::context::with_primary_ctx(dev, || {
            let st = cu::context::stream_nonblocking()?;
            // SAFETY: the first `n` bytes of the signal area, which is never freed; `st` is a
            // stream of its own (the caller's may be the ones waiting).
            let r = unsafe { sys::cuMemsetD8Async(local, 0xff, n, st) };
            // SAFETY: `st` was created above.
            let r2 = unsafe { sys::cuStreamSynchronize(st) };
            // SAFETY: as above.
            unsafe { sys::cuStreamDestroy_v2(st) };
            cu::ck(r, "cuMemsetD8Async").and_then(|()| cu::ck(r2, "cuStreamSynchronize"))
        });
        let windows: Vec<Window> = g.windows.drain().map(|(_, w)| w).collect();
        let sigs: Vec<Reach> = g
            .signals
            .as_mut()
            .map(|s| s.peers.iter_mut().filter_map(Option::take).collect())
            .unwrap_or_default();
        drop(g);
        let _ = cu::context::with_primary_ctx(dev, || {
            for s in windows.iter().flat_map(|w| w.peers.iter()).chain(&sigs) {
                if let Ok(Seg {
                    opened: Some(h), ..
                }) = s
                {
                    close_shared(h);
                }
            }
            Ok(())
        });
    }

    /// GPU memory of the signal area, in bytes (0 before the first device window).
    pub(crate) fn rma_bytes(&self) -> u64 {
        lock(&self.rma)
            .signals
            .as_ref()
            .map_or(0, |_| 8 * (u64::from(self.nranks) + STAGE_WORDS))
    }
}

/// Where the window's IPC handle starts in an offer (the signal area's is at [`AT_SIG`]).
const AT_HANDLE_WIN: usize = 0;

/// How this rank reaches rank `r`'s window (`at` = [`AT_HANDLE_WIN`]) or signal area
/// ([`AT_SIG`]) from its offer `o`.
fn reach(local: &Local, o: &[u8], r: usize, at: usize) -> Reach {
    let mine = &local.offer;
    let Some(dev) = local.device else {
        return Err("this rank's window is host memory".into());
    };
    if o[AT_KIND] != KIND_DEVICE {
        return Err(format!("rank {r}'s window is host memory"));
    }
    if o[AT_BOOT..AT_BOOT + 40] != mine[AT_BOOT..AT_BOOT + 40] {
        return Err(format!(
            "rank {r} is on another node (one-sided ops reach this node's ranks only)"
        ));
    }
    let (addr_at, bytes) = if at == AT_SIG {
        (AT_SIG_PTR, 0)
    } else {
        (AT_PTR, get_u64(o, AT_BYTES))
    };
    if get_u64(o, AT_TOKEN) == get_u64(mine, AT_TOKEN) {
        // The same process: its address is valid here.
        return Ok(Seg {
            addr: get_u64(o, addr_at),
            bytes,
            opened: None,
        });
    }
    let mut uuid = [0u8; 16];
    uuid.copy_from_slice(&o[AT_UUID..AT_UUID + 16]);
    let h = handle_at(o, at);
    let base =
        open_shared(dev, h, uuid).map_err(|e| format!("cannot map rank {r}'s memory: {e}"))?;
    let off = if at == AT_SIG { 0 } else { get_u64(o, AT_OFF) };
    Ok(Seg {
        addr: base + off,
        bytes,
        opened: Some(h),
    })
}

/// The peer's signal area as this process reaches it.
fn signal_slot(g: &Rma, p: usize, what: &str) -> Result<u64> {
    let s = g.signals.as_ref().ok_or_else(no_signals)?;
    match &s.peers[p] {
        Some(Ok(seg)) => Ok(seg.addr),
        Some(Err(why)) => Err(Error::Unsupported(format!(
            "{what}: rank {p} and this rank cannot signal each other: {why}"
        ))),
        None => Err(Error::Unsupported(format!(
            "{what}: rank {p} has registered no device memory window yet (commd sets up a rank's signals with its first one)"
        ))),
    }
}

fn no_signals() -> Error {
    Error::Unsupported(
        "one-sided ops need a device memory window registered on the communicator first (ncclCommWindowRegister): commd sets up the communicator's signals with it".into(),
    )
}
