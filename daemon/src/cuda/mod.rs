//! CUDA in the daemon: the node's GPUs and their peer matrix, the IPC handle cache (each client
//! allocation is opened once per session), per-rank device scratch for GPU reductions, and the
//! copy-engine executor (`commd-gpu`) that runs the daemon's side of the doorbell protocol
//! (docs/contracts.md #3 to #5).
//!
//! Loaded at run time: on a host without libcuda or without GPUs, [`init`] returns the reason,
//! the daemon logs it once and serves host memory only. cudarc panics when libcuda is missing,
//! so nothing here calls the driver before `cu::driver()` succeeded.
//!
//! Who does what: the daemon only moves data, with copy-engine *pushes* (the copy is issued on
//! a stream of the source GPU); reductions run in the client's context, between doorbells.
//!
//! The pieces, each with its own `//!`: `topology` (probing the GPUs and the peer matrix,
//! the `Topology` reply), `mem` (device memory: IPC handles opened once, cuMem mirrors,
//! scratch), `plan` (the copies of a matched op, phase by phase), `doorbell` (ready and done
//! words, done published contiguously), `executor` (the `commd-gpu` thread). This file: the
//! `Cuda` state, initialization, events and the host-pinned copies.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use commd_cuda::{self as cu, CuError, ck, sys};
use commd_proto::desc::{DType, OpKind, RedOp, status};

mod doorbell;
mod executor;
mod exporter;
mod graphs;
mod mem;
mod plan;
mod topology;

pub use doorbell::*;
pub use executor::*;
pub use exporter::holds_gpu;
pub use mem::*;
pub use plan::*;
pub use topology::*;

/// One GPU as the daemon sees it.
pub struct Gpu {
    pub ordinal: i32,
    pub dev: sys::CUdevice,
    pub ctx: sys::CUcontext,
    pub uuid: [u8; 16],
    pub name: String,
    pub pci_bus_id: String,
    pub memory_bytes: u64,
    pub copy_engines: i32,
    pub sm_count: i32,
    pub compute_capability: (i32, i32),
    /// Streams of this GPU, one per GPU index: `streams[self]` carries local copies, and
    /// `streams[(self + 1) % n]` every push to other GPUs (see `push_stream`).
    streams: Vec<sys::CUstream>,
    events: Mutex<Vec<sys::CUevent>>,
}

/// How data moves between two GPUs, and why.
#[derive(Clone, Debug)]
pub struct Link {
    pub from: usize,
    pub to: usize,
    pub p2p: bool,
    pub performance_rank: i32,
    pub native_atomics: bool,
    pub path: String,
}

/// IPC handle cache counters (daemon-wide).
#[derive(Default)]
pub struct IpcStats {
    pub opens: AtomicU64,
    pub hits: AtomicU64,
    pub open_us: AtomicU64,
    pub open_now: AtomicU32,
    pub gpu_ops: AtomicU64,
}

pub struct Cuda {
    pub gpus: Vec<Gpu>,
    pub links: Vec<Link>,
    pub driver_version: i32,
    pub stats: IpcStats,
    pub slot_bytes: u64,
    exec: Executor,
    /// Issues each source GPU's copies of a phase from its own thread (see `issue`).
    issuers: Option<crate::fanout::Fanout>,
}

// SAFETY: the raw handles inside (contexts, streams, events) are driver objects that the CUDA
// driver API allows any thread to use; the mutable parts are behind mutexes.
unsafe impl Send for Cuda {}
// SAFETY: as above.
unsafe impl Sync for Cuda {}

static CUDA: OnceLock<Result<&'static Cuda, String>> = OnceLock::new();

/// Initializes CUDA once (`enabled` false: never touch the driver). Returns why it is
/// unavailable otherwise; the caller logs that once.
pub fn init(enabled: bool, slot_bytes: u64) -> Result<&'static Cuda, String> {
    CUDA.get_or_init(|| {
        if !enabled {
            return Err("disabled by configuration (cuda = 0)".into());
        }
        cu::driver()?;
        let c = Cuda::probe(slot_bytes).map_err(|e| e.to_string())?;
        let c: &'static Cuda = Box::leak(Box::new(c));
        let exec = &c.exec;
        std::thread::Builder::new()
            .name("commd-gpu".into())
            .spawn(move || exec.run(c))
            .map_err(|e| format!("cannot start the GPU executor thread: {e}"))?;
        Ok(c)
    })
    .clone()
}

/// The initialized CUDA state, or why there is none.
pub fn get() -> Result<&'static Cuda, String> {
    CUDA.get()
        .cloned()
        .unwrap_or_else(|| Err("CUDA was not initialized by this daemon".into()))
}

fn cstr(buf: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| c.cast_unsigned())
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl Cuda {
    pub fn gpu_by_uuid(&self, uuid: &[u8]) -> Option<usize> {
        self.gpus.iter().position(|g| g.uuid[..] == *uuid)
    }

    fn gpu_for(&self, uuid: &[u8]) -> Result<usize, String> {
        self.gpu_by_uuid(uuid).ok_or_else(|| {
            format!(
                "device {} is not visible to the daemon (it sees {}); run the daemon with access to every GPU of the node",
                cu::uuid_string(uuid),
                self.gpus
                    .iter()
                    .map(|g| cu::uuid_string(&g.uuid))
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
    }

    /// Hands a job to the executor; its ops complete when it finishes or fails. A persistent
    /// job is registered (its ops complete at once) and runs on every replay of its graphs.
    pub fn submit(&'static self, job: GpuJob) {
        self.stats.gpu_ops.fetch_add(1, Ordering::Relaxed);
        self.exec.push(if job.persistent {
            Cmd::Register(job)
        } else {
            Cmd::Job(job)
        });
    }

    /// A persistent op that could not be registered (`bells` of the ranks that captured it):
    /// every replay fails with `st` and `msg`.
    pub fn poison_graph_op(&self, bells: Vec<Bell>, phases: u32, st: u32, msg: String) {
        self.exec.push(Cmd::Poison {
            bells,
            phases,
            st,
            msg,
        });
    }

    /// The graphs holding these persistent ops of session `session` were destroyed. Returns
    /// the slots that hold no registered op yet (see `graphs::Registry::release`); blocks
    /// until the executor thread answered (microseconds), 5 s at most (then: all unknown).
    pub fn release_graph_ops(&self, session: u64, slots: Vec<u32>) -> Vec<u32> {
        let (tx, rx) = std::sync::mpsc::channel();
        self.exec.push(Cmd::Release {
            session,
            slots: slots.clone(),
            reply: tx,
        });
        rx.recv_timeout(Duration::from_secs(5)).unwrap_or(slots)
    }

    fn event(&self, gpu: usize) -> Result<sys::CUevent, CuError> {
        if let Some(e) = self.gpus[gpu]
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop()
        {
            return Ok(e);
        }
        cu::set_current(self.gpus[gpu].ctx)?;
        cu::context::event()
    }

    /// Pins `bytes` of host memory at `ptr` for copy-engine DMA from every GPU's context
    /// (`cuMemHostRegister`, portable). Undo with [`Cuda::host_unregister`].
    ///
    /// # Safety
    /// `ptr .. ptr + bytes` must be a live, page-aligned mapping of this process that stays
    /// mapped until it is unregistered.
    pub unsafe fn host_register(&self, ptr: *mut u8, bytes: u64) -> Result<(), CuError> {
        let Some(g) = self.gpus.first() else {
            return ck(sys::CUresult::CUDA_ERROR_NO_DEVICE, "host staging");
        };
        cu::set_current(g.ctx)?;
        ck(
            // SAFETY: the caller's contract; PORTABLE makes it usable from every context.
            unsafe {
                sys::cuMemHostRegister_v2(
                    ptr.cast(),
                    commd_proto::num::usize_of(bytes),
                    sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
                )
            },
            "cuMemHostRegister",
        )
    }

    /// Unpins memory pinned by [`Cuda::host_register`].
    ///
    /// # Safety
    /// `ptr` was registered with `host_register` and no copy still uses it.
    pub unsafe fn host_unregister(&self, ptr: *mut u8) -> Result<(), CuError> {
        let Some(g) = self.gpus.first() else {
            return ck(sys::CUresult::CUDA_ERROR_NO_DEVICE, "host staging");
        };
        cu::set_current(g.ctx)?;
        // SAFETY: the caller's contract.
        ck(
            unsafe { sys::cuMemHostUnregister(ptr.cast()) },
            "cuMemHostUnregister",
        )
    }

    /// Copies between `span` and host memory at `host` (`to_gpu`: host -> GPU) on the span's
    /// GPU's stream for local copies, and records an event after it: poll it with
    /// [`Cuda::event_done`], then give it back with [`Cuda::release_event`].
    ///
    /// # Safety
    /// `host .. host + span.bytes` must stay valid (and, to overlap, pinned) until the event
    /// completes; nothing else may write the destination meanwhile.
    pub unsafe fn copy_host(
        &self,
        span: &GpuSpan,
        host: *mut u8,
        to_gpu: bool,
    ) -> Result<(usize, sys::CUevent), CuError> {
        let gi = span.mem.gpu;
        let g = &self.gpus[gi];
        let dev = span.mem.ptr_on(gi)? + span.off;
        let stream = g.streams[push_stream(gi, gi, self.gpus.len())];
        cu::set_current(g.ctx)?;
        let (dst, src) = if to_gpu {
            (dev, host as sys::CUdeviceptr)
        } else {
            (host as sys::CUdeviceptr, dev)
        };
        ck(
            // SAFETY: `span` was bounds-checked against a live mapping of this GPU's context that
            // the caller's op keeps alive; `host` as the caller promises (unified addressing).
            unsafe { sys::cuMemcpyAsync(dst, src, commd_proto::num::usize_of(span.bytes), stream) },
            "cuMemcpyAsync (host staging)",
        )?;
        let e = self.event(gi)?;
        cu::set_current(g.ctx)?;
        // SAFETY: event and stream belong to this GPU's context.
        if let Err(err) = ck(unsafe { sys::cuEventRecord(e, stream) }, "cuEventRecord") {
            self.recycle(gi, e);
            return Err(err);
        }
        Ok((gi, e))
    }

    /// Whether an event from [`Cuda::copy_host`] has completed (an error if its work failed).
    pub fn event_done(&self, e: &(usize, sys::CUevent)) -> Result<bool, CuError> {
        // SAFETY: the event was created by us and is live until released.
        let r = unsafe { sys::cuEventQuery(e.1) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        ck(r, "cuEventQuery").map(|()| true)
    }

    /// Waits for an event from [`Cuda::copy_host`] and gives it back.
    pub fn wait_event(&self, e: (usize, sys::CUevent)) -> Result<(), CuError> {
        // SAFETY: as in `event_done`.
        let r = ck(
            unsafe { sys::cuEventSynchronize(e.1) },
            "cuEventSynchronize",
        );
        self.recycle(e.0, e.1);
        r
    }

    /// Gives back an event of [`Cuda::copy_host`] (after `event_done` said so, or to abandon
    /// it once its work is known to be over).
    pub fn release_event(&self, e: (usize, sys::CUevent)) {
        self.recycle(e.0, e.1);
    }

    fn recycle(&self, gpu: usize, e: sys::CUevent) {
        self.gpus[gpu]
            .events
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(p: &[(u64, u64)]) -> BTreeMap<u64, Slot> {
        p.iter()
            .map(|(o, b)| (*o, Slot { bytes: *b, pins: 0 }))
            .collect()
    }

    fn pieces_cover(t: &BTreeMap<u64, Slot>, off: u64, bytes: u64) -> bool {
        covering_pieces(t, off, bytes).is_some()
    }

    fn overlaps(t: &BTreeMap<u64, Slot>, off: u64, bytes: u64) -> Vec<(u64, u64)> {
        let mut v: Vec<_> = overlapping_pieces(t, off, bytes)
            .into_iter()
            .map(|(o, s)| (o, s.bytes))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn vmm_pieces_cover_only_mapped_ranges() {
        let t = table(&[(0, 10), (10, 10), (30, 10)]);
        assert!(pieces_cover(&t, 0, 20));
        assert!(pieces_cover(&t, 5, 10), "across two adjacent pieces");
        assert!(pieces_cover(&t, 35, 5));
        assert!(pieces_cover(&t, 25, 0), "an empty range needs nothing");
        assert!(!pieces_cover(&t, 15, 10), "runs into the hole at 20..30");
        assert!(!pieces_cover(&t, 20, 1));
        assert!(!pieces_cover(&t, 35, 6), "past the last piece");
        assert!(!pieces_cover(&t, 5, u64::MAX), "overflow");
        assert!(!pieces_cover(&BTreeMap::new(), 0, 1));
    }

    #[test]
    fn vmm_overlapping_pieces_are_found_exactly() {
        let t = table(&[(0, 10), (10, 10), (30, 10), (50, 10)]);
        assert_eq!(overlaps(&t, 5, 30), vec![(0, 10), (10, 10), (30, 10)]);
        assert_eq!(overlaps(&t, 20, 10), vec![], "exactly the hole");
        assert_eq!(overlaps(&t, 40, 10), vec![], "between pieces");
        assert_eq!(overlaps(&t, 59, 1), vec![(50, 10)]);
        assert_eq!(overlaps(&t, 10, 10), vec![(10, 10)], "the same piece");
        assert_eq!(covering_pieces(&t, 5, 10), Some(vec![0, 10]));
        // Against a linear model.
        let mut s: u64 = 12345;
        let mut next = |m: u64| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1);
            (s >> 33) % m
        };
        let t = table(&[(0, 4), (4, 2), (9, 3), (20, 8), (28, 1), (40, 5)]);
        for _ in 0..2000 {
            let (off, bytes) = (next(50), next(20) + 1);
            let got = overlaps(&t, off, bytes);
            let want: Vec<_> = t
                .iter()
                .filter(|(o, s)| **o < off + bytes && off < **o + s.bytes)
                .map(|(o, s)| (*o, s.bytes))
                .collect();
            assert_eq!(got, want, "({off}, {bytes})");
            let covered =
                (off..off + bytes).all(|x| t.iter().any(|(o, s)| x >= *o && x < o + s.bytes));
            assert_eq!(pieces_cover(&t, off, bytes), covered, "({off}, {bytes})");
        }
    }

    #[test]
    fn pieces_tile_the_segment() {
        for len in [0u64, 1, 5, 8, 1001] {
            for n in 1..=8u64 {
                let mut at = 10;
                for r in 0..n {
                    let (s, l) = piece(10, len, n, r);
                    assert_eq!(s, at);
                    at += l;
                }
                assert_eq!(at, 10 + len);
            }
        }
    }

    #[test]
    fn init_without_cuda_gives_a_reason() {
        // On CI there is no libcuda: init must return the reason, not panic.
        match init(true, 1 << 20) {
            Ok(c) => assert!(!c.gpus.is_empty()),
            Err(why) => assert!(!why.is_empty()),
        }
    }
}
