//! CUDA in the daemon: the node's GPUs and their peer matrix, the IPC handle cache (each client
//! allocation is opened once per session), per-rank device scratch for GPU reductions, and the
//! copy-engine executor (`commd-gpu`) that runs the daemon's side of the doorbell protocol
//! (DESIGN.md contracts 3-5).
//!
//! Loaded at run time: on a host without libcuda or without GPUs, [`init`] returns the reason,
//! the daemon logs it once and serves host memory only. cudarc panics when libcuda is missing,
//! so nothing here calls the driver before `cu::driver()` succeeded.
//!
//! Who does what (measured on our H200s, see shared/baselines.md): the daemon only moves data,
//! with copy-engine *pushes* (the copy is issued on a stream of the source GPU); reductions run
//! in the client's context, between doorbells.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use commd_client::gpu::cu::{self, CuError, ck, sys};
use commd_proto::desc::{DType, OpKind, RedOp, status};

use crate::comm::Posted;
use crate::session::Session;

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
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

impl Cuda {
    fn probe(slot_bytes: u64) -> Result<Self, CuError> {
        use sys::CUdevice_attribute as A;
        let n = cu::device_count()?;
        let mut driver_version = 0;
        ck(
            // SAFETY: valid out pointer; the driver is initialized.
            unsafe { sys::cuDriverGetVersion(&mut driver_version) },
            "cuDriverGetVersion",
        )?;
        let mut gpus = Vec::new();
        for i in 0..n {
            let mut dev = 0;
            // SAFETY: valid out pointer, ordinal < count.
            ck(unsafe { sys::cuDeviceGet(&mut dev, i) }, "cuDeviceGet")?;
            let mut name = [0 as std::ffi::c_char; 256];
            ck(
                // SAFETY: the buffer holds 256 bytes as we say.
                unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev) },
                "cuDeviceGetName",
            )?;
            let mut pci = [0 as std::ffi::c_char; 64];
            ck(
                // SAFETY: the buffer holds 64 bytes as we say.
                unsafe { sys::cuDeviceGetPCIBusId(pci.as_mut_ptr(), 64, dev) },
                "cuDeviceGetPCIBusId",
            )?;
            let mut mem = 0usize;
            ck(
                // SAFETY: valid out pointer.
                unsafe { sys::cuDeviceTotalMem_v2(&mut mem, dev) },
                "cuDeviceTotalMem",
            )?;
            let ctx = cu::primary_ctx(dev)?;
            gpus.push(Gpu {
                ordinal: i,
                dev,
                ctx,
                uuid: cu::device_uuid(dev)?,
                name: cstr(&name),
                pci_bus_id: cstr(&pci),
                memory_bytes: mem as u64,
                copy_engines: cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)?,
                sm_count: cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                compute_capability: (
                    cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                    cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                ),
                streams: Vec::new(),
                events: Mutex::new(Vec::new()),
            });
        }
        let mut links = Vec::new();
        for a in 0..gpus.len() {
            for b in 0..gpus.len() {
                if a == b {
                    continue;
                }
                let mut can = 0;
                ck(
                    // SAFETY: valid out pointer and devices.
                    unsafe { sys::cuDeviceCanAccessPeer(&mut can, gpus[a].dev, gpus[b].dev) },
                    "cuDeviceCanAccessPeer",
                )?;
                let attr = |x: sys::CUdevice_P2PAttribute| -> i32 {
                    let mut v = 0;
                    // SAFETY: valid out pointer and devices.
                    let r = unsafe {
                        sys::cuDeviceGetP2PAttribute(&mut v, x, gpus[a].dev, gpus[b].dev)
                    };
                    if r == sys::CUresult::CUDA_SUCCESS {
                        v
                    } else {
                        0
                    }
                };
                let rank =
                    attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK);
                let atomics = attr(
                    sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED,
                ) != 0;
                let mut p2p = can != 0;
                let mut path = if p2p {
                    "P2P copy-engine push (issued on the source GPU)".to_string()
                } else {
                    "host staging by the driver: cuDeviceCanAccessPeer says no P2P (check IOMMU/ACS settings or the VM/container's GPU isolation)".to_string()
                };
                if p2p {
                    cu::set_current(gpus[a].ctx)?;
                    // SAFETY: both contexts are retained primary contexts.
                    let r = unsafe { sys::cuCtxEnablePeerAccess(gpus[b].ctx, 0) };
                    if r != sys::CUresult::CUDA_SUCCESS
                        && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                    {
                        let (name, _) = cu::describe(r);
                        p2p = false;
                        path = format!(
                            "host staging by the driver: enabling peer access failed ({name})"
                        );
                    }
                }
                links.push(Link {
                    from: a,
                    to: b,
                    p2p,
                    performance_rank: rank,
                    native_atomics: atomics,
                    path,
                });
            }
        }
        let ng = gpus.len();
        for g in &mut gpus {
            cu::set_current(g.ctx)?;
            for _ in 0..ng {
                let mut s = std::ptr::null_mut();
                ck(
                    // SAFETY: valid out pointer; the device's context is current.
                    unsafe {
                        sys::cuStreamCreate(
                            &mut s,
                            sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                        )
                    },
                    "cuStreamCreate",
                )?;
                g.streams.push(s);
            }
        }
        // COMMD_GPU_ISSUE_THREADS=0: the executor issues every copy itself (for measurements).
        let threads = std::env::var("COMMD_GPU_ISSUE_THREADS").map_or(true, |v| v != "0");
        let issuers = if gpus.len() > 1 && threads {
            match crate::fanout::Fanout::new(gpus.len() - 1, "commd-gpu-issue") {
                Ok(f) => Some(f),
                Err(e) => {
                    tracing::warn!(target: "commd::cuda", "no copy-issuing threads ({e}): the executor issues every copy itself");
                    None
                }
            }
        } else {
            None
        };
        Ok(Self {
            gpus,
            links,
            driver_version,
            stats: IpcStats::default(),
            slot_bytes,
            exec: Executor::default(),
            issuers,
        })
    }

    /// Logs what was found and, for each GPU pair, the path copies take and why.
    pub fn log_topology(&self) {
        for g in &self.gpus {
            tracing::info!(target: "commd::init", "GPU {} {} {} ({}), {} GiB, sm_{}{}, {} copy engines, {} SMs", g.ordinal, g.name, cu::uuid_string(&g.uuid), g.pci_bus_id, g.memory_bytes >> 30, g.compute_capability.0, g.compute_capability.1, g.copy_engines, g.sm_count);
        }
        for l in &self.links {
            tracing::info!(target: "commd::init", "GPU {} -> GPU {}: {} (perf rank {}, native atomics {})", l.from, l.to, l.path, l.performance_rank, l.native_atomics);
        }
    }

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

    /// Opens a client's allocation (cuIpcOpenMemHandle in the owning GPU's context).
    pub fn open_ipc(
        &'static self,
        uuid: &[u8],
        handle: &[u8],
        bytes: u64,
    ) -> Result<DevMem, String> {
        let gpu = self.gpu_for(uuid)?;
        cu::set_current(self.gpus[gpu].ctx).map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        let ptr = cu::ipc_open(handle, "cuIpcOpenMemHandle").map_err(|e| e.to_string())?;
        let us = t0.elapsed().as_micros() as u64;
        self.stats.opens.fetch_add(1, Ordering::Relaxed);
        self.stats.open_us.fetch_add(us, Ordering::Relaxed);
        crate::telemetry::metrics().ipc_open(t0.elapsed());
        self.stats.open_now.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(target: "commd::cuda", gpu, bytes, us, "opened IPC handle");
        let mut m = self.dev_mem(gpu, ptr, bytes);
        m.open_us = us;
        m.handle = Some(handle.to_vec());
        Ok(m)
    }

    /// Allocates daemon-owned device memory on the GPU with `uuid`.
    pub fn alloc(&'static self, uuid: &[u8], bytes: u64) -> Result<DevMem, String> {
        let gpu = self.gpu_for(uuid)?;
        cu::set_current(self.gpus[gpu].ctx).map_err(|e| e.to_string())?;
        let mut ptr: sys::CUdeviceptr = 0;
        ck(
            // SAFETY: valid out pointer; the GPU's context is current.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(256) as usize) },
            "cuMemAlloc",
        )
        .map_err(|e| e.to_string())?;
        let mut m = self.dev_mem(gpu, ptr, bytes);
        m.owned = true;
        Ok(m)
    }

    /// Device memory at `ptr` on GPU `gpu`, not owned, with no IPC handle, views or pieces
    /// (the constructors set what differs).
    fn dev_mem(&'static self, gpu: usize, ptr: sys::CUdeviceptr, len: u64) -> DevMem {
        DevMem {
            cuda: self,
            gpu,
            ptr,
            len,
            owned: false,
            open_us: 0,
            handle: None,
            views: Mutex::new(Vec::new()),
            vmm: None,
        }
    }

    /// Reserves the daemon's mirror of a client's cuMem address range of `bytes` on the GPU
    /// with `uuid`; its pieces are mapped later ([`Cuda::map_pieces`]).
    pub fn reserve_vmm(&'static self, uuid: &[u8], bytes: u64) -> Result<DevMem, String> {
        if bytes > MAX_VMM_RANGE {
            return Err(format!(
                "a cuMem address range of {bytes} bytes is larger than the {MAX_VMM_RANGE} bytes the daemon mirrors"
            ));
        }
        let gpu = self.gpu_for(uuid)?;
        cu::set_current(self.gpus[gpu].ctx).map_err(|e| e.to_string())?;
        let mut ptr: sys::CUdeviceptr = 0;
        ck(
            // SAFETY: valid out pointer; default alignment, no fixed address, no flags.
            unsafe { sys::cuMemAddressReserve(&mut ptr, bytes as usize, 0, 0, 0) },
            "cuMemAddressReserve",
        )
        .map_err(|e| e.to_string())?;
        let mut m = self.dev_mem(gpu, ptr, bytes);
        m.vmm = Some(Mutex::new(BTreeMap::new()));
        Ok(m)
    }

    /// Maps `pieces` (offset, bytes, exported POSIX fd) into the mirror `mem`, replacing the
    /// pieces they overlap (the client remapped that part of its range). A replacement waits
    /// until no op in flight holds `mem` (at most [`REMAP_WAIT`]): unmapping memory a copy
    /// engine still writes would fault the daemon's context. Returns the microseconds spent.
    pub fn map_pieces(
        &self,
        mem: &Arc<DevMem>,
        pieces: Vec<(u64, u64, OwnedFd)>,
    ) -> Result<u64, String> {
        let Some(table) = &mem.vmm else {
            return Err("MapCudaPieces on a registration that is not a cuMem range".into());
        };
        let t0 = Instant::now();
        for (off, bytes, _) in &pieces {
            if *bytes == 0 || !commd_proto::desc::range_in_bounds(*off, *bytes, mem.len) {
                return Err(format!(
                    "piece at offset {off} of {bytes} bytes lies outside the registered range of {} bytes",
                    mem.len
                ));
            }
        }
        cu::set_current(self.gpus[mem.gpu].ctx).map_err(|e| e.to_string())?;
        // Pieces to replace must have no op in flight on them (their pins): wait for that.
        let deadline = Instant::now() + REMAP_WAIT;
        let mut t = loop {
            let t = table.lock().unwrap_or_else(|e| e.into_inner());
            let busy = pieces.iter().any(|(o, b, _)| {
                overlapping_pieces(&t, *o, *b)
                    .iter()
                    .any(|(_, s)| s.pins > 0)
            });
            if !busy {
                break t;
            }
            drop(t);
            if Instant::now() > deadline {
                return Err(format!(
                    "cannot replace a piece of a cuMem range while ops still use it after {REMAP_WAIT:?}: the client unmapped memory an op in flight was using"
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        for (off, bytes, fd) in pieces {
            for (o, old) in overlapping_pieces(&t, off, bytes) {
                // SAFETY: [o, o + len) of the mirror was mapped by this function; no op holds
                // it (no pins, checked under this lock).
                let r = unsafe { sys::cuMemUnmap(mem.ptr + o, old.bytes as usize) };
                ck(r, "cuMemUnmap").map_err(|e| e.to_string())?;
                t.remove(&o);
            }
            let mut h: sys::CUmemGenericAllocationHandle = 0;
            let r = ck(
                // SAFETY: valid out pointer; for POSIX fds the driver takes the fd's value as
                // the "pointer" argument (it does not take ownership: `fd` is closed on drop).
                unsafe {
                    sys::cuMemImportFromShareableHandle(
                        &mut h,
                        fd.as_raw_fd() as usize as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                },
                "cuMemImportFromShareableHandle",
            );
            r.map_err(|e| e.to_string())?;
            // SAFETY: the range lies inside the reservation (checked above) and is unmapped.
            let r = unsafe { sys::cuMemMap(mem.ptr + off, bytes as usize, 0, h, 0) };
            let mapped = ck(r, "cuMemMap");
            // SAFETY: `h` came from the import above; a mapping keeps the memory alive.
            unsafe { sys::cuMemRelease(h) };
            mapped.map_err(|e| {
                format!("{e} (piece at offset {off}, {bytes} bytes: it must be a whole allocation, mapped from its offset 0)")
            })?;
            t.insert(off, Slot { bytes, pins: 0 });
            if let Err(e) = self.grant_access(mem.gpu, mem.ptr + off, bytes) {
                // SAFETY: mapped just above; nothing uses it yet.
                unsafe { sys::cuMemUnmap(mem.ptr + off, bytes as usize) };
                t.remove(&off);
                return Err(e);
            }
            self.stats.opens.fetch_add(1, Ordering::Relaxed);
        }
        let us = t0.elapsed().as_micros() as u64;
        self.stats.open_us.fetch_add(us, Ordering::Relaxed);
        crate::telemetry::metrics().ipc_open(t0.elapsed());
        tracing::debug!(target: "commd::cuda", gpu = mem.gpu, us, "mapped cuMem pieces");
        Ok(us)
    }

    /// Read-write access to `[ptr, ptr + bytes)` for the owner GPU (required) and every GPU
    /// with peer access to it (the pushes run on the source GPU's context).
    fn grant_access(&self, owner: usize, ptr: sys::CUdeviceptr, bytes: u64) -> Result<(), String> {
        for (i, g) in self.gpus.iter().enumerate() {
            let peer = i != owner
                && self
                    .links
                    .iter()
                    .any(|l| l.from == i && l.to == owner && l.p2p);
            if i != owner && !peer {
                continue;
            }
            let desc = sys::CUmemAccessDesc {
                location: sys::CUmemLocation {
                    type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                    id: g.ordinal,
                },
                flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
            };
            // SAFETY: the range is mapped; one descriptor.
            let r = unsafe { sys::cuMemSetAccess(ptr, bytes as usize, &desc, 1) };
            ck(r, "cuMemSetAccess").map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// The IPC handle of daemon-owned memory (the same bytes for every call on one allocation).
    pub fn export(&self, mem: &DevMem) -> Result<Vec<u8>, String> {
        cu::set_current(self.gpus[mem.gpu].ctx).map_err(|e| e.to_string())?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        ck(
            // SAFETY: valid out struct; `ptr` is the base of an allocation of this context.
            unsafe { sys::cuIpcGetMemHandle(&mut h, mem.ptr) },
            "cuIpcGetMemHandle",
        )
        .map_err(|e| e.to_string())?;
        Ok(h.reserved.iter().map(|c| *c as u8).collect())
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
        let mut e = std::ptr::null_mut();
        ck(
            // SAFETY: valid out pointer; the GPU's context is current.
            unsafe {
                sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
            },
            "cuEventCreate",
        )?;
        Ok(e)
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
                    bytes as usize,
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
            unsafe { sys::cuMemcpyAsync(dst, src, span.bytes as usize, stream) },
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

/// `Topology` RPC: GPUs, pairs, and the path each pair's copies take (or why CUDA is off).
pub fn topology_reply() -> commd_proto::pb::TopologyReply {
    use commd_proto::pb;
    match get() {
        Err(why) => pb::TopologyReply {
            cuda_available: false,
            cuda_reason: why,
            ..Default::default()
        },
        Ok(c) => pb::TopologyReply {
            cuda_available: true,
            cuda_reason: String::new(),
            driver_version: format!(
                "{}.{}",
                c.driver_version / 1000,
                c.driver_version % 1000 / 10
            ),
            gpus: c
                .gpus
                .iter()
                .map(|g| pb::GpuInfo {
                    ordinal: g.ordinal as u32,
                    name: g.name.clone(),
                    uuid: g.uuid.to_vec(),
                    pci_bus_id: g.pci_bus_id.clone(),
                    memory_bytes: g.memory_bytes,
                    copy_engines: g.copy_engines as u32,
                    sm_count: g.sm_count as u32,
                    compute_capability: format!(
                        "{}.{}",
                        g.compute_capability.0, g.compute_capability.1
                    ),
                })
                .collect(),
            links: c
                .links
                .iter()
                .map(|l| pb::GpuLink {
                    from: l.from as u32,
                    to: l.to as u32,
                    p2p: l.p2p,
                    path: l.path.clone(),
                    performance_rank: l.performance_rank,
                    native_atomics: l.native_atomics,
                })
                .collect(),
        },
    }
}

/// Device memory mapped in the daemon: a client allocation opened by IPC handle, or
/// daemon-owned scratch. Closed or freed when the last reference (session table, in-flight job)
/// goes.
pub struct DevMem {
    cuda: &'static Cuda,
    pub gpu: usize,
    pub ptr: sys::CUdeviceptr,
    pub len: u64,
    owned: bool,
    pub open_us: u64,
    /// IPC memory: the handle, and its mappings in the other GPUs' contexts (opened on first
    /// push from that GPU). A mapping opened in the owner's context only is not reachable by
    /// peer copies from another GPU: measured on our H200s, such copies were staged through
    /// host memory at 37.7 GB/s instead of ~390 GB/s over NVLink.
    handle: Option<Vec<u8>>,
    views: Mutex<Vec<Option<sys::CUdeviceptr>>>,
    /// A mirror of a client's cuMem range (`ptr` is the daemon's reservation): the pieces
    /// mapped in it, offset -> bytes. Reachable from every GPU granted access, so no views.
    vmm: Option<Mutex<BTreeMap<u64, Slot>>>,
}

/// A piece mapped in a cuMem mirror: its size, and how many resolved buffers of ops in flight
/// lie (partly) in it ([`PiecePin`]); a piece is only replaced while it has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub bytes: u64,
    pub pins: u32,
}

/// Keeps the pieces under an op's buffer mapped: taken when the daemon resolves the buffer,
/// released when the op's last copy of the span is dropped.
#[derive(Debug)]
pub struct PiecePin {
    mem: Arc<DevMem>,
    offs: Vec<u64>,
}

impl Drop for PiecePin {
    fn drop(&mut self) {
        if let Some(t) = &self.mem.vmm {
            let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
            for o in &self.offs {
                if let Some(s) = t.get_mut(o) {
                    s.pins = s.pins.saturating_sub(1);
                }
            }
        }
    }
}

/// The largest cuMem range the daemon mirrors (address space only, nothing is allocated).
pub const MAX_VMM_RANGE: u64 = 1 << 40;

/// How long replacing a piece of a cuMem range waits for the ops still using the range.
pub const REMAP_WAIT: Duration = Duration::from_secs(10);

/// The pieces of `t` (by offset, disjoint) overlapping `[off, off + bytes)`.
pub fn overlapping_pieces(t: &BTreeMap<u64, Slot>, off: u64, bytes: u64) -> Vec<(u64, Slot)> {
    let end = off.saturating_add(bytes);
    // Walking down from `end`: once a piece ends at or before `off`, every earlier one does.
    t.range(..end)
        .rev()
        .take_while(|(o, s)| o.saturating_add(s.bytes) > off)
        .map(|(o, s)| (*o, *s))
        .collect()
}

/// The offsets of the pieces of `t` that together cover all of `[off, off + bytes)`; `None`
/// if part of it is not mapped.
pub fn covering_pieces(t: &BTreeMap<u64, Slot>, off: u64, bytes: u64) -> Option<Vec<u64>> {
    let end = off.checked_add(bytes)?;
    let mut at = off;
    let mut out = Vec::new();
    while at < end {
        match t.range(..=at).next_back() {
            Some((o, s)) if at < o.saturating_add(s.bytes) => {
                out.push(*o);
                at = o.saturating_add(s.bytes);
            }
            _ => return None,
        }
    }
    Some(out)
}

impl std::fmt::Debug for DevMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DevMem(gpu {}, {} bytes)", self.gpu, self.len)
    }
}

impl Drop for DevMem {
    fn drop(&mut self) {
        let g = &self.cuda.gpus[self.gpu];
        if let Some(table) = self.vmm.take() {
            let table = table.into_inner().unwrap_or_else(|e| e.into_inner());
            let r = cu::set_current(g.ctx).and_then(|()| {
                for (o, slot) in table {
                    // SAFETY: mapped by `map_pieces`; the last reference is gone.
                    let r = unsafe { sys::cuMemUnmap(self.ptr + o, slot.bytes as usize) };
                    ck(r, "cuMemUnmap")?;
                }
                // SAFETY: reserved by `reserve_vmm`, freed once, here.
                ck(
                    unsafe { sys::cuMemAddressFree(self.ptr, self.len as usize) },
                    "cuMemAddressFree",
                )
            });
            if let Err(e) = r {
                tracing::warn!(target: "commd::cuda", "releasing a cuMem mirror: {e}");
            }
            return;
        }
        let r = cu::set_current(g.ctx).and_then(|()| {
            if self.owned {
                // SAFETY: `ptr` came from cuMemAlloc in this context and is freed once, here.
                ck(unsafe { sys::cuMemFree_v2(self.ptr) }, "cuMemFree")
            } else {
                ck(
                    // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context, closed once, here.
                    unsafe { sys::cuIpcCloseMemHandle(self.ptr) },
                    "cuIpcCloseMemHandle",
                )
            }
        });
        if !self.owned {
            self.cuda.stats.open_now.fetch_sub(1, Ordering::Relaxed);
        }
        if let Err(e) = r {
            tracing::warn!(target: "commd::cuda", "releasing device memory: {e}");
        }
        let views = std::mem::take(self.views.get_mut().unwrap_or_else(|e| e.into_inner()));
        for (gpu, v) in views.into_iter().enumerate() {
            let Some(p) = v else { continue };
            let r = cu::set_current(self.cuda.gpus[gpu].ctx).and_then(|()| {
                ck(
                    // SAFETY: `p` came from cuIpcOpenMemHandle in that GPU's context, closed once.
                    unsafe { sys::cuIpcCloseMemHandle(p) },
                    "cuIpcCloseMemHandle",
                )
            });
            if let Err(e) = r {
                tracing::warn!(target: "commd::cuda", "closing a peer mapping: {e}");
            }
        }
    }
}

impl DevMem {
    /// Checks that `[off, off + bytes)` is backed by memory in the daemon and keeps it so:
    /// always for IPC and daemon memory (`None`); for a cuMem mirror, when its mapped pieces
    /// cover the range, which then stay mapped while the returned pin lives. `Err` when part
    /// of the range is not mapped.
    pub fn pin(self: &Arc<Self>, off: u64, bytes: u64) -> Result<Option<Arc<PiecePin>>, String> {
        let Some(t) = &self.vmm else {
            return Ok(None);
        };
        let mut t = t.lock().unwrap_or_else(|e| e.into_inner());
        let offs = covering_pieces(&t, off, bytes).ok_or_else(|| {
            "it is not all mapped in the daemon's mirror of its cuMem range (map its pieces first)"
                .to_string()
        })?;
        for o in &offs {
            if let Some(s) = t.get_mut(o) {
                s.pins += 1;
            }
        }
        Ok(Some(Arc::new(PiecePin {
            mem: self.clone(),
            offs,
        })))
    }

    pub fn is_vmm(&self) -> bool {
        self.vmm.is_some()
    }

    /// This memory's address as seen from GPU `gpu`'s context: the owner's mapping, daemon
    /// memory (reachable through peer access), or a mapping of the IPC handle opened in that
    /// context on first use.
    fn ptr_on(&self, gpu: usize) -> Result<sys::CUdeviceptr, CuError> {
        if gpu == self.gpu || self.owned {
            return Ok(self.ptr);
        }
        let Some(h) = &self.handle else {
            return Ok(self.ptr);
        };
        let mut views = self.views.lock().unwrap_or_else(|e| e.into_inner());
        if views.len() <= gpu {
            views.resize(gpu + 1, None);
        }
        if let Some(p) = views[gpu] {
            return Ok(p);
        }
        cu::set_current(self.cuda.gpus[gpu].ctx)?;
        let t0 = Instant::now();
        let p = cu::ipc_open(h, "cuIpcOpenMemHandle(peer view)")?;
        let us = t0.elapsed().as_micros() as u64;
        self.cuda.stats.opens.fetch_add(1, Ordering::Relaxed);
        self.cuda.stats.open_us.fetch_add(us, Ordering::Relaxed);
        tracing::debug!(target: "commd::cuda", owner = self.gpu, gpu, us, "opened a peer view");
        views[gpu] = Some(p);
        Ok(p)
    }
}

/// A bounds-checked byte range of device memory.
#[derive(Clone, Debug)]
pub struct GpuSpan {
    pub mem: Arc<DevMem>,
    pub off: u64,
    pub bytes: u64,
    /// A client's cuMem memory: keeps the pieces under the span mapped (see [`DevMem::pin`]).
    pub pin: Option<Arc<PiecePin>>,
}

impl GpuSpan {
    pub fn new(mem: Arc<DevMem>, off: u64, bytes: u64) -> Option<Self> {
        commd_proto::desc::range_in_bounds(off, bytes, mem.len).then_some(Self {
            mem,
            off,
            bytes,
            pin: None,
        })
    }

    pub fn sub(&self, at: u64, bytes: u64) -> Option<Self> {
        commd_proto::desc::range_in_bounds(at, bytes, self.bytes).then(|| Self {
            mem: self.mem.clone(),
            off: self.off + at,
            bytes,
            pin: self.pin.clone(),
        })
    }

    pub fn same_range(&self, o: &GpuSpan) -> bool {
        Arc::ptr_eq(&self.mem, &o.mem) && self.off == o.off && self.bytes == o.bytes
    }

    fn overlaps(&self, o: &GpuSpan) -> bool {
        Arc::ptr_eq(&self.mem, &o.mem)
            && self.off < o.off + o.bytes
            && o.off < self.off + self.bytes
    }
}

/// One copy of a phase, issued on the source GPU's stream towards the destination (a push).
#[derive(Clone, Debug)]
pub struct CopyOp {
    pub src: GpuSpan,
    pub dst: GpuSpan,
}

/// One rank's GPU buffers for a matched op.
#[derive(Clone, Debug, Default)]
pub struct GpuBufs {
    pub send: Option<GpuSpan>,
    pub recv: Option<GpuSpan>,
}

/// The copies of one doorbell phase. `main` copies start once every rank's stream has reached
/// the phase (its ready counter); `early` copies only fill the scratch buffer that the previous
/// round's kernel does not read, so the executor issues them one phase ahead, when the previous
/// phase starts (the copy engines then keep moving data while the clients' kernels run). The
/// phase is done when both are.
#[derive(Clone, Debug, Default)]
pub struct Phase {
    pub early: Vec<CopyOp>,
    pub main: Vec<CopyOp>,
}

impl Phase {
    pub fn copies(&self) -> impl Iterator<Item = &CopyOp> {
        self.early.iter().chain(self.main.iter())
    }
}

/// Builds the copies of every phase of a matched GPU op (see `commd_proto::desc::CudaShape` for
/// the round and phase structure the client mirrors on its stream). `scratch[r]` is rank r's
/// scratch of `cuda_scratch_bytes(nranks, slot_bytes)` bytes (reductions only). Errors are
/// messages for every rank.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    kind: OpKind,
    dtype: DType,
    redop: Option<RedOp>,
    count: u64,
    root: u32,
    bufs: &[GpuBufs],
    scratch: &[Option<GpuSpan>],
    slot_bytes: u64,
    one_shot: bool,
) -> Result<Vec<Phase>, String> {
    let n = bufs.len();
    let es = dtype.size();
    let blk = count * es;
    let missing = |what: &str, r: usize| format!("rank {r} has no {what} buffer (internal error)");
    let send = |r: usize| bufs[r].send.clone().ok_or_else(|| missing("send", r));
    let recv = |r: usize| bufs[r].recv.clone().ok_or_else(|| missing("recv", r));
    let sub = |s: &GpuSpan, at: u64, len: u64| {
        s.sub(at, len)
            .ok_or_else(|| "buffer range out of bounds (internal error)".to_string())
    };
    let push = |v: &mut Vec<CopyOp>, src: GpuSpan, dst: GpuSpan| {
        if src.bytes > 0 && !src.same_range(&dst) {
            v.push(CopyOp { src, dst });
        }
    };
    if kind.reduces() {
        let _ = redop.ok_or("reduction op missing (internal error)")?;
        if one_shot && !commd_proto::desc::cuda_one_shot_fits(kind, count, es, slot_bytes) {
            return Err(format!(
                "one-shot {} of {} bytes does not fit the {slot_bytes}-byte scratch slot",
                kind.name(),
                blk
            ));
        }
        let scratch_of = |r: usize| -> Result<GpuSpan, String> {
            if n == 1 {
                return Err("no scratch needed".into());
            }
            scratch[r].clone().ok_or_else(|| {
                format!("rank {r} has no GPU scratch for this communicator: the client must call GetCommScratch before posting a GPU reduction")
            })
        };
        // Slot of peer k in rank r's scratch, in round j's buffer.
        let slot = |j: u64, k: usize, r: usize| {
            let i = if k < r { k } else { k - 1 } as u64;
            commd_proto::desc::cuda_scratch_off(j, i, n as u32, slot_bytes)
        };
        let shape = commd_proto::desc::cuda_shape(kind, count, es, n as u32, slot_bytes, one_shot);
        let mut phases = vec![Phase::default(); shape.phases as usize];
        for j in 0..shape.rounds {
            let s0 = j * shape.round_elems;
            let len = shape.round_elems.min(count - s0.min(count));
            let (head, tail) = phases.split_at_mut(j as usize + 1);
            let a = &mut head[j as usize].early;
            let b = &mut tail[0].main;
            match kind {
                OpKind::AllReduce if one_shot => {
                    for r in 0..n {
                        for k in (0..n).filter(|&k| k != r) {
                            push(
                                a,
                                sub(&send(k)?, s0 * es, len * es)?,
                                sub(&scratch_of(r)?, slot(j, k, r), len * es)?,
                            );
                        }
                    }
                }
                OpKind::AllReduce => {
                    for r in 0..n {
                        let (ps, pl) = piece(s0, len, n as u64, r as u64);
                        for k in (0..n).filter(|&k| k != r) {
                            push(
                                a,
                                sub(&send(k)?, ps * es, pl * es)?,
                                sub(&scratch_of(r)?, slot(j, k, r), pl * es)?,
                            );
                            push(
                                b,
                                sub(&recv(r)?, ps * es, pl * es)?,
                                sub(&recv(k)?, ps * es, pl * es)?,
                            );
                        }
                    }
                }
                OpKind::Reduce => {
                    let t = root as usize;
                    for k in (0..n).filter(|&k| k != t) {
                        push(
                            a,
                            sub(&send(k)?, s0 * es, len * es)?,
                            sub(&scratch_of(t)?, slot(j, k, t), len * es)?,
                        );
                    }
                }
                OpKind::ReduceScatter => {
                    for r in 0..n {
                        for k in (0..n).filter(|&k| k != r) {
                            push(
                                a,
                                sub(&send(k)?, r as u64 * blk + s0 * es, len * es)?,
                                sub(&scratch_of(r)?, slot(j, k, r), len * es)?,
                            );
                        }
                    }
                }
                _ => unreachable_kind(kind)?,
            }
        }
        return Ok(phases);
    }
    let mut a = Vec::new();
    match kind {
        OpKind::AllGather => {
            for k in 0..n {
                for r in 0..n {
                    push(&mut a, send(k)?, sub(&recv(r)?, k as u64 * blk, blk)?);
                }
            }
        }
        OpKind::Broadcast => {
            let src = send(root as usize)?;
            for r in 0..n {
                push(&mut a, src.clone(), recv(r)?);
            }
        }
        OpKind::AllToAll => {
            for k in 0..n {
                for r in 0..n {
                    push(
                        &mut a,
                        sub(&send(k)?, r as u64 * blk, blk)?,
                        sub(&recv(r)?, k as u64 * blk, blk)?,
                    );
                }
            }
        }
        OpKind::Barrier => {}
        _ => unreachable_kind(kind)?,
    }
    // Copies of one phase run concurrently: a destination that overlaps any other copy's range
    // would make the result depend on timing (in-place all-to-all, or aliased buffers).
    for (i, c) in a.iter().enumerate() {
        if a.iter()
            .enumerate()
            .any(|(j, o)| (i != j && c.dst.overlaps(&o.dst)) || c.dst.overlaps(&o.src))
        {
            return Err(format!(
                "{}: GPU buffers overlap (in-place {} is not supported on GPU memory; use separate send and recv tensors)",
                kind.name(),
                kind.name()
            ));
        }
    }
    Ok(vec![Phase {
        early: Vec::new(),
        main: a,
    }])
}

fn unreachable_kind(kind: OpKind) -> Result<(), String> {
    Err(format!("{} has no GPU plan (internal error)", kind.name()))
}

/// Pieces of an all-reduce round: the client's split, shared so both sides agree.
pub use commd_client::gpu::piece;

/// A rank's doorbell: its session, slot, and the op's first ticket. For a persistent op
/// (`graph`), the slot is a graph doorbell and the ticket 1 (`commd_proto::graph`).
#[derive(Clone)]
pub struct Bell {
    pub session: Arc<Session>,
    pub rank: u32,
    pub slot: u32,
    pub ticket: u32,
    pub graph: bool,
    /// The communicator's doorbell slot in the session (hints, for a persistent op's failure).
    pub comm_slot: u32,
}

impl Bell {
    /// The doorbell of a posted GPU op (`None` for host ops).
    pub fn of(p: &Posted) -> Option<Self> {
        p.cuda.map(|c| Self {
            session: p.session.clone(),
            rank: p.rank,
            slot: c.slot,
            ticket: c.ticket,
            graph: c.graph,
            comm_slot: c.comm_slot,
        })
    }

    fn words(&self) -> Option<(&AtomicU32, &AtomicU32, &AtomicU32)> {
        if self.graph {
            self.session.ring.graph_doorbell(self.slot)
        } else {
            self.session.ring.doorbell(self.slot)
        }
    }

    /// A persistent op's words for the replay protocol (`None` for eager ops).
    pub fn graph_words(&self) -> Option<commd_proto::graph::Words<'_>> {
        if !self.graph {
            return None;
        }
        let (ready, done, error) = self.session.ring.graph_doorbell(self.slot)?;
        Some(commd_proto::graph::Words { ready, done, error })
    }

    /// Whether the rank's stream has reached phase `phase` of the op (its ready counter).
    pub fn ready(&self, phase: u32) -> bool {
        match self.words() {
            Some((ready, _, _)) => {
                let want = self.ticket.wrapping_add(phase);
                ready.load(Ordering::Acquire).wrapping_sub(want) as i32 >= 0
            }
            None => false,
        }
    }

    pub fn ready_value(&self) -> u32 {
        self.words()
            .map(|(r, _, _)| r.load(Ordering::Acquire))
            .unwrap_or(0)
    }
}

/// The ranks of `bells` whose streams have not reached phase `phase`, with their counters, for
/// a timeout message.
pub fn late_streams(bells: &[Bell], phase: u32) -> Vec<String> {
    bells
        .iter()
        .filter(|b| !b.ready(phase))
        .map(|b| {
            format!(
                "rank {} (pid {}: its stream signalled {}, the op needs {})",
                b.rank,
                b.session.pid,
                b.ready_value(),
                b.ticket.wrapping_add(phase)
            )
        })
        .collect()
}

/// Done counters advance contiguously: a p2p group's ops may match in another order than the
/// client posted them (their tickets), and the client's stream waits once for the group's last
/// ticket, so ticket `t` is published only once every ticket before it is done. One tracker for
/// the daemon: a group's ops can finish on the GPU executor (within the node) and on a net
/// thread (host-staged, across nodes).
#[derive(Default)]
struct Slots {
    pending: HashMap<(u64, u32), Vec<u32>>,
}

static SLOTS: OnceLock<Mutex<Slots>> = OnceLock::new();

/// Publishes ticket `t` of `b`'s doorbell as done once every earlier ticket is (see `Slots`).
pub fn signal_done(b: &Bell, t: u32) {
    SLOTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .signal(b, t);
}

impl Slots {
    fn signal(&mut self, b: &Bell, t: u32) {
        let Some((_, done, _)) = b.session.ring.doorbell(b.slot) else {
            return;
        };
        let key = (b.session.id, b.slot);
        let mut cur = done.load(Ordering::Acquire);
        if t.wrapping_sub(cur) as i32 <= 0 {
            return; // already released (a failure advanced past it)
        }
        let pending = self.pending.entry(key).or_default();
        pending.push(t);
        while let Some(i) = pending.iter().position(|&x| x == cur.wrapping_add(1)) {
            pending.swap_remove(i);
            cur = cur.wrapping_add(1);
        }
        pending.retain(|&x| x.wrapping_sub(cur) as i32 > 0);
        if pending.is_empty() {
            self.pending.remove(&key);
        }
        advance_done(&b.session, b.slot, cur);
    }
}

/// Raises a doorbell slot's done counter to `value` (never lowers it, wrap-aware).
pub fn advance_done(s: &Session, slot: u32, value: u32) {
    if let Some((_, done, _)) = s.ring.doorbell(slot) {
        let _ = done.fetch_update(Ordering::AcqRel, Ordering::Acquire, |d| {
            (value.wrapping_sub(d) as i32 > 0).then_some(value)
        });
    }
}

/// Fails a CUDA op's doorbell: sets the error word (first error wins) and releases every phase
/// so the client's stream never hangs (DESIGN.md contract 5).
pub fn fail_doorbell(s: &Session, slot: u32, last_ticket: u32, st: u32) {
    if let Some((_, _, err)) = s.ring.doorbell(slot) {
        let _ = err.compare_exchange(0, st.max(1), Ordering::AcqRel, Ordering::Acquire);
    }
    advance_done(s, slot, last_ticket);
}

/// A matched GPU op, ready for the executor.
pub struct GpuJob {
    /// The op's trace span (`telemetry::op_span`); it ends when the job is dropped.
    pub span: tracing::Span,
    pub comm_id: u64,
    pub label: String,
    pub bells: Vec<Bell>,
    pub phases: Vec<Phase>,
    pub ops: Vec<Posted>,
    pub timeout: Duration,
    /// The communicator's GPU copy pacing: ask `admit` before issuing each phase's copies.
    pub pacer: std::sync::Arc<crate::pacing::Pacer>,
    /// Captured into CUDA graphs: registered, then run on every replay (`crate::graphs`).
    pub persistent: bool,
    /// The capture's tag (`flags::PERSISTENT`), as rank 0 of the op named it.
    pub graph_tag: u32,
    /// The scratch allocations its reductions use (`DevMem` addresses): a job starts only when
    /// no other job holds one of them, and holds them until it finishes, since a session's
    /// communicators on one GPU share their scratch (`session::Tables::scratch_pool`).
    pub scratch: Vec<usize>,
}

enum State {
    Waiting {
        since: Instant,
    },
    InFlight {
        events: Vec<(usize, sys::CUevent)>,
        /// When the phase's turn came, when every ready was seen, when its copies were issued.
        turn: Instant,
        ready: Instant,
        issued: Instant,
    },
}

/// Where the executor's time per phase goes, by phase shape (number of copies, bytes), logged
/// (target `commd::cuda`, level INFO) when the executor goes idle: from the phase's turn (the
/// previous phase of its communicator done, or the job reaching the front of its queue) until
/// every rank's ready counter is seen (in a steady stream of ops: the clients' streams passing
/// the previous op's done counter and signalling the next one), the time spent issuing its
/// copies (driver calls), and from then until the copies' events are seen complete.
#[derive(Default)]
struct PhaseTimes {
    by_shape: HashMap<(usize, u64), PhaseAcc>,
}

#[derive(Default, Clone, Copy)]
struct PhaseAcc {
    phases: u64,
    wait_ns: u64,
    issue_ns: u64,
    copy_ns: u64,
}

impl PhaseTimes {
    fn add(&mut self, copies: usize, bytes: u64, wait: Duration, issue: Duration, copy: Duration) {
        let a = self.by_shape.entry((copies, bytes)).or_default();
        a.phases += 1;
        a.wait_ns += wait.as_nanos() as u64;
        a.issue_ns += issue.as_nanos() as u64;
        a.copy_ns += copy.as_nanos() as u64;
    }

    /// Logs and clears the shapes with enough phases to mean something.
    fn report(&mut self) {
        let mut shapes: Vec<_> = self.by_shape.drain().collect();
        shapes.sort_by_key(|((c, b), _)| (*b, *c));
        for ((copies, bytes), a) in shapes {
            if a.phases < 20 {
                continue;
            }
            let n = a.phases as f64;
            tracing::info!(
                target: "commd::cuda",
                "executor: {} phases of {} copies, {} KiB: mean us per phase: until every ready counter was seen {:.1}, issuing the copies {:.1}, copies until their events were seen complete {:.1}",
                a.phases,
                copies,
                bytes / 1024,
                a.wait_ns as f64 / n / 1e3,
                a.issue_ns as f64 / n / 1e3,
                a.copy_ns as f64 / n / 1e3,
            );
        }
    }
}

struct Active {
    job: GpuJob,
    phase: usize,
    state: State,
    /// Events of the current phase's `early` copies, issued when the previous phase started.
    ahead: Vec<(usize, sys::CUevent)>,
    /// A failed replay's status and message (persistent jobs only; set by `finish`).
    failure: Option<(u32, String)>,
    /// It holds its scratch (`GpuJob::scratch`), from its first phase's start to its end.
    holds: bool,
}

impl Active {
    /// A job at its first phase, waiting for the ranks' streams from now on.
    fn new(job: GpuJob) -> Self {
        Self {
            job,
            phase: 0,
            state: State::Waiting {
                since: Instant::now(),
            },
            ahead: Vec::new(),
            failure: None,
            holds: false,
        }
    }
}

/// Work for the executor thread.
enum Cmd {
    Job(GpuJob),
    /// A persistent op, matched at capture (`crate::graphs`).
    Register(GpuJob),
    Poison {
        bells: Vec<Bell>,
        phases: u32,
        st: u32,
        msg: String,
    },
    Release {
        session: u64,
        slots: Vec<u32>,
        reply: std::sync::mpsc::Sender<Vec<u32>>,
    },
}

#[derive(Default)]
struct Executor {
    incoming: Mutex<VecDeque<Cmd>>,
    cv: Condvar,
    /// Scratch allocations held by a running job (`GpuJob::scratch`); the executor thread
    /// alone uses it (a mutex only for `Sync`).
    busy: Mutex<std::collections::HashSet<usize>>,
}

impl Executor {
    fn push(&self, cmd: Cmd) {
        self.incoming
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(cmd);
        self.cv.notify_one();
    }

    /// The `commd-gpu` loop: polls ready counters (CPU polling: 3.7 us round trips on our H200s
    /// versus 12.4 us for a daemon stream waiting on the client's counter), issues the pushes,
    /// polls their events, writes done counters, and completes the ops. Jobs of one
    /// communicator run in order; different communicators progress independently. With
    /// nothing queued it keeps looking for `IDLE_SPIN` before sleeping on its condition
    /// variable, so a stream of ops (the next one is usually matched within microseconds) does
    /// not pay a thread wake-up per op.
    fn run(&self, cuda: &'static Cuda) {
        const IDLE_SPIN: Duration = Duration::from_millis(1);
        let mut queues: HashMap<u64, VecDeque<Active>> = HashMap::new();
        // Persistent ops (captured into CUDA graphs) and, per communicator, the replay running
        // now (at most one: it uses the communicator's scratch, as the eager jobs do).
        let mut graphs = crate::graphs::Registry::default();
        let mut replaying: HashMap<u64, (u64, Active)> = HashMap::new();
        let mut times = PhaseTimes::default();
        let mut idle_since = Instant::now();
        loop {
            {
                let mut inc = self.incoming.lock().unwrap_or_else(|e| e.into_inner());
                if queues.is_empty() && inc.is_empty() && graphs.is_empty() {
                    if idle_since.elapsed() < IDLE_SPIN {
                        drop(inc);
                        std::thread::yield_now();
                        continue;
                    }
                    if !times.by_shape.is_empty() {
                        drop(inc);
                        times.report();
                        continue;
                    }
                    inc = self
                        .cv
                        .wait_timeout(inc, Duration::from_millis(100))
                        .map(|(g, _)| g)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                for cmd in inc.drain(..) {
                    match cmd {
                        Cmd::Job(job) => queues
                            .entry(job.comm_id)
                            .or_default()
                            .push_back(Active::new(job)),
                        Cmd::Register(job) => graphs.register(job),
                        Cmd::Poison {
                            bells,
                            phases,
                            st,
                            msg,
                        } => graphs.poison_new(bells, phases, st, msg),
                        Cmd::Release {
                            session,
                            slots,
                            reply,
                        } => {
                            let _ = reply.send(graphs.release(session, &slots));
                        }
                    }
                }
            }
            let mut progressed = false;
            // Replays first: a replay that every rank fired runs before the communicator's
            // next eager job unless that job already started (its streams are then past the
            // replay, or on other streams). Eager jobs wait while a replay runs.
            for comm in graphs.comms() {
                if let Some((id, a)) = replaying.get_mut(&comm) {
                    let (moved, finished) = step(cuda, &mut times, a);
                    progressed |= moved;
                    if finished {
                        let id = *id;
                        if let Some((_, a)) = replaying.remove(&comm) {
                            graphs.finished(comm, id, a.job, a.failure);
                        }
                        if let Some(Active {
                            phase: 0,
                            state: State::Waiting { since },
                            ..
                        }) = queues.get_mut(&comm).and_then(|q| q.front_mut())
                        {
                            *since = Instant::now();
                        }
                    }
                    continue;
                }
                let eager_started = queues.get(&comm).is_some_and(|q| {
                    q.iter()
                        .any(|a| a.phase > 0 || matches!(a.state, State::InFlight { .. }))
                });
                let (moved, start) = graphs.poll(comm, !eager_started);
                progressed |= moved;
                if let Some((id, job)) = start {
                    progressed = true;
                    replaying.insert(comm, (id, Active::new(job)));
                }
            }
            for (comm, q) in queues.iter_mut() {
                if replaying.contains_key(comm) {
                    continue;
                }
                // The front job, then each later one that may run beside every job before it
                // (`beside`) and whose streams have all reached it: a p2p group's sends and
                // receives are separate jobs, and both directions of a link move at once.
                let mut i = 0;
                while i < q.len() {
                    let s = q.make_contiguous();
                    let (before, rest) = s.split_at_mut(i);
                    let a = &mut rest[0];
                    if i > 0
                        && !(before.iter().all(|b| beside(&b.job, &a.job))
                            && a.phase == 0
                            && (matches!(a.state, State::InFlight { .. })
                                || a.job.bells.iter().all(|b| b.ready(0))))
                    {
                        break;
                    }
                    let (moved, finished) = step(cuda, &mut times, a);
                    progressed |= moved;
                    if !finished {
                        i += 1;
                        continue;
                    }
                    q.remove(i);
                    // The next job's turn starts now (its timeout and phase times count from
                    // here, not from when it was queued).
                    if i == 0
                        && let Some(Active {
                            phase: 0,
                            state: State::Waiting { since },
                            ..
                        }) = q.front_mut()
                    {
                        *since = Instant::now();
                    }
                }
            }
            queues.retain(|_, q| !q.is_empty());
            if progressed {
                idle_since = Instant::now();
            } else if idle_since.elapsed() > Duration::from_millis(200) && queues.is_empty() {
                // Only armed graphs, no replay for a while: look every half millisecond (a
                // replay's first phase may wait that long; a steady stream of replays keeps
                // the loop in the faster modes below).
                std::thread::sleep(Duration::from_micros(500));
            } else if idle_since.elapsed() > Duration::from_millis(2) {
                // Nothing moved for a while (a stream still computing): poll gently.
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Whether job `b`, queued after `a` on the same communicator, may run at the same time as
/// `a`: both are one-phase jobs without scratch (send/recv, broadcast, gathers, all-to-all:
/// their copies go straight between the ranks' buffers), and no copy of one writes where a copy
/// of the other reads or writes. Everything else keeps the communicator's order.
fn beside(a: &GpuJob, b: &GpuJob) -> bool {
    let simple = |j: &GpuJob| j.phases.len() == 1 && j.scratch.is_empty() && !j.persistent;
    if !simple(a) || !simple(b) {
        return false;
    }
    a.phases[0].copies().all(|x| {
        b.phases[0]
            .copies()
            .all(|y| !y.dst.overlaps(&x.src) && !y.dst.overlaps(&x.dst) && !y.src.overlaps(&x.dst))
    })
}

/// Advances one job; returns (made progress, finished).
fn step(cuda: &'static Cuda, times: &mut PhaseTimes, a: &mut Active) -> (bool, bool) {
    match &mut a.state {
        State::Waiting { since } => {
            let phase = a.phase as u32;
            if let Some(lost) = a.job.bells.iter().find(|b| b.session.is_closed()) {
                let msg = format!(
                    "{}: rank {} (pid {}) was lost during the op",
                    a.job.label, lost.rank, lost.session.pid
                );
                finish(cuda, a, status::PEER_LOST, Some(msg));
                return (true, true);
            }
            if !a.job.bells.iter().all(|b| b.ready(phase)) {
                if since.elapsed() > a.job.timeout {
                    let late = late_streams(&a.job.bells, phase);
                    let msg = format!(
                        "{}: timed out after {:.1} s waiting for the GPU streams of {} to reach the op (phase {phase}); is that rank's stream blocked behind other work?",
                        a.job.label,
                        since.elapsed().as_secs_f64(),
                        late.join(", ")
                    );
                    tracing::warn!(target: "commd::cuda", "{msg}");
                    finish(cuda, a, status::TIMEOUT, Some(msg));
                    return (true, true);
                }
                return (false, false);
            }
            // A scratch shared with another communicator's running job: wait for it (only
            // reductions have scratch; jobs of one communicator already run in order).
            if !a.holds && !a.job.scratch.is_empty() {
                let mut busy = cuda.exec.busy.lock().unwrap_or_else(|e| e.into_inner());
                if a.job.scratch.iter().any(|k| busy.contains(k)) {
                    return (false, false);
                }
                busy.extend(a.job.scratch.iter().copied());
                a.holds = true;
            }
            // Pacing: the phase starts once the communicator's cap allows its bytes (the
            // busiest source GPU's, which is what competes with that GPU's compute).
            let p = a.phase;
            let bytes = paced_bytes(&a.job.phases, p, cuda.gpus.len());
            if bytes > 0 && a.job.pacer.admit(bytes, Instant::now()).is_err() {
                return (false, false);
            }
            let turn = *since;
            let ready = Instant::now();
            // This phase's copies (its early ones too on the first phase), then the next
            // phase's early ones: per source GPU one push stream, so they run in that order.
            let mut events = std::mem::take(&mut a.ahead);
            let issued = (|| -> Result<Vec<(usize, sys::CUevent)>, CuError> {
                if p == 0 {
                    events.extend(issue(cuda, &a.job.phases[0].early)?);
                }
                events.extend(issue(cuda, &a.job.phases[p].main)?);
                match a.job.phases.get(p + 1) {
                    Some(next) => issue(cuda, &next.early),
                    None => Ok(Vec::new()),
                }
            })();
            match issued {
                Ok(ahead) => {
                    a.ahead = ahead;
                    if events.is_empty() {
                        return phase_done(cuda, a);
                    }
                    a.state = State::InFlight {
                        events,
                        turn,
                        ready,
                        issued: Instant::now(),
                    };
                    (true, false)
                }
                Err(e) => {
                    a.ahead.extend(events);
                    let msg = format!("{}: issuing copies failed: {e}", a.job.label);
                    finish(cuda, a, status::INTERNAL, Some(msg));
                    (true, true)
                }
            }
        }
        State::InFlight {
            events,
            turn,
            ready,
            issued,
        } => {
            let mut pending = false;
            let mut failed = None;
            for (_, e) in events.iter() {
                // SAFETY: the event was recorded by us and is not destroyed while in a job.
                let r = unsafe { sys::cuEventQuery(*e) };
                if r == sys::CUresult::CUDA_ERROR_NOT_READY {
                    pending = true;
                } else if r != sys::CUresult::CUDA_SUCCESS {
                    failed = Some(cu::describe(r).0);
                }
            }
            if pending && failed.is_none() {
                return (false, false);
            }
            let ph = &a.job.phases[a.phase];
            times.add(
                ph.early.len() + ph.main.len(),
                ph.copies().map(|c| c.src.bytes).sum(),
                *ready - *turn,
                *issued - *ready,
                issued.elapsed(),
            );
            for (g, e) in events.drain(..) {
                cuda.recycle(g, e);
            }
            if let Some(why) = failed {
                let msg = format!("{}: a copy failed on the GPU: {why}", a.job.label);
                finish(cuda, a, status::INTERNAL, Some(msg));
                return (true, true);
            }
            phase_done(cuda, a)
        }
    }
}

/// Bytes that starting phase `p` issues (its copies, its early ones on the first phase, and the
/// next phase's early ones), counted on the source GPU that pushes the most of them.
fn paced_bytes(phases: &[Phase], p: usize, ngpus: usize) -> u64 {
    let mut per = vec![0u64; ngpus.max(1)];
    let mut add = |cs: &[CopyOp]| {
        for c in cs {
            if let Some(b) = per.get_mut(c.src.mem.gpu) {
                *b += c.src.bytes;
            }
        }
    };
    if p == 0 {
        add(&phases[0].early);
    }
    add(&phases[p].main);
    if let Some(next) = phases.get(p + 1) {
        add(&next.early);
    }
    per.into_iter().max().unwrap_or(0)
}

fn phase_done(cuda: &Cuda, a: &mut Active) -> (bool, bool) {
    let last = a.phase + 1 == a.job.phases.len();
    for b in &a.job.bells {
        match b.graph_words() {
            // A replay: constant values, re-armed after the last phase (contract 6).
            Some(w) => w.phase_done(a.phase as u32, last),
            None => signal_done(b, b.ticket.wrapping_add(a.phase as u32)),
        }
    }
    a.phase += 1;
    if a.phase == a.job.phases.len() {
        finish(cuda, a, status::OK, None);
        return (true, true);
    }
    a.state = State::Waiting {
        since: Instant::now(),
    };
    (true, false)
}

/// Completes every op of the job (a failure also releases the streams through the doorbells,
/// in `Posted::complete`). Copies issued ahead are waited for first: they read the clients'
/// buffers, which must stay valid until they are done.
fn finish(cuda: &Cuda, a: &mut Active, st: u32, msg: Option<String>) {
    for (g, e) in a.ahead.drain(..) {
        // SAFETY: the event was recorded by us and is not destroyed while in a job.
        let _ = unsafe { sys::cuEventSynchronize(e) };
        cuda.recycle(g, e);
    }
    // Every copy into the scratch is done (a phase ends with its copies' events): free it.
    if a.holds {
        let mut busy = cuda.exec.busy.lock().unwrap_or_else(|e| e.into_inner());
        for k in &a.job.scratch {
            busy.remove(k);
        }
        a.holds = false;
    }
    crate::telemetry::op_status(&a.job.span, st);
    if a.job.persistent && st != status::OK {
        // A failed replay releases every rank's stream and sets its error words (contract 5).
        let msg = msg.clone().unwrap_or_default();
        let phases = a.job.phases.len() as u32;
        for b in &a.job.bells {
            crate::graphs::fail_bell(b, phases, st, &msg);
        }
        a.failure = Some((st, msg));
    }
    for p in a.job.ops.drain(..) {
        let c = p.op.comm;
        p.complete(c, st, msg.clone());
    }
}

/// The stream a copy from GPU `from` to GPU `to` goes on: copies within a GPU on its own stream,
/// and every push to other GPUs on one stream per source GPU, so they run one after the other.
/// Measured on 4x H200 (NVSwitch): three concurrent pushes from one GPU to three peers gave
/// 190 GB/s of egress in all, one push at a time ~380 GB/s; NCCL's all-gather reaches 334.
fn push_stream(from: usize, to: usize, ngpus: usize) -> usize {
    if from == to || ngpus < 2 {
        to
    } else {
        (from + 1) % ngpus
    }
}

/// Issues one phase's copies as pushes and records one event per stream used. Pushes are issued
/// in rounds, each GPU first to its next GPU, then to the one after, ...: a permutation per
/// round, so no GPU receives from several at once while another idles. With copies from several
/// source GPUs, each GPU's copies are issued from its own thread (`Cuda::issuers`): each driver
/// call costs 2-4 us, so one thread issuing the 12 copies of a 4-GPU phase delayed the last
/// GPU's first push by 30-40 us.
fn issue(cuda: &Cuda, copies: &[CopyOp]) -> Result<Vec<(usize, sys::CUevent)>, CuError> {
    let ng = cuda.gpus.len();
    // Round r holds the pushes from each GPU to the GPU r after it; local copies (round 0, a
    // stream of their own, fast) go last.
    let mut order: Vec<&CopyOp> = copies.iter().collect();
    order.sort_by_key(|c| {
        let r = (c.dst.mem.gpu + ng - c.src.mem.gpu) % ng.max(1);
        if r == 0 { ng } else { r }
    });
    let sources = (0..ng)
        .filter(|&g| order.iter().any(|c| c.src.mem.gpu == g))
        .count();
    let Some(pool) = cuda
        .issuers
        .as_ref()
        .filter(|_| sources > 1 && order.len() >= 4)
    else {
        return issue_from(cuda, &order);
    };
    let lists: Vec<Vec<&CopyOp>> = (0..ng)
        .map(|g| {
            order
                .iter()
                .copied()
                .filter(|c| c.src.mem.gpu == g)
                .collect()
        })
        .collect();
    // Events cross threads as addresses: CUevent is a raw pointer, and the driver lets any
    // thread use it.
    type Issued = Result<Vec<(usize, usize)>, CuError>;
    let results: Vec<Mutex<Option<Issued>>> = (0..ng).map(|_| Mutex::new(None)).collect();
    let ran = pool.run(ng, &|g| {
        if !lists[g].is_empty() {
            let r = issue_from(cuda, &lists[g])
                .map(|v| v.into_iter().map(|(g, e)| (g, e as usize)).collect());
            *results[g].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        }
    });
    let mut events = Vec::new();
    let mut err = ran.err().map(|why| CuError {
        what: "issuing copies".into(),
        code: 0,
        name: "COMMD_INTERNAL".into(),
        text: why,
    });
    for r in results {
        match r.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(ev)) => events.extend(ev.into_iter().map(|(g, e)| (g, e as sys::CUevent))),
            Some(Err(e)) => err = err.or(Some(e)),
            None => {}
        }
    }
    if let Some(e) = err {
        // The copies that were issued must be done before the caller fails the op.
        for (g, ev) in events {
            // SAFETY: recorded by `issue_from` above and not yet handed to anyone.
            let _ = unsafe { sys::cuEventSynchronize(ev) };
            cuda.recycle(g, ev);
        }
        return Err(e);
    }
    Ok(events)
}

/// Issues `copies` in this order from the calling thread, then records one event per stream used.
fn issue_from(cuda: &Cuda, copies: &[&CopyOp]) -> Result<Vec<(usize, sys::CUevent)>, CuError> {
    let ng = cuda.gpus.len();
    let mut used: Vec<(usize, usize)> = Vec::new();
    for c in copies {
        let (from, to) = (c.src.mem.gpu, c.dst.mem.gpu);
        let si = push_stream(from, to, ng);
        let g = &cuda.gpus[from];
        let src = c.src.mem.ptr_on(from)? + c.src.off;
        let dst = c.dst.mem.ptr_on(from)? + c.dst.off;
        cu::set_current(g.ctx)?;
        ck(
            // SAFETY: both spans were bounds-checked against live mappings (valid in the source
            // GPU's context, see `ptr_on`) that the job keeps alive until its events complete; the
            // stream belongs to the source GPU's context.
            unsafe { sys::cuMemcpyAsync(dst, src, c.src.bytes as usize, g.streams[si]) },
            "cuMemcpyAsync",
        )?;
        if !used.contains(&(from, si)) {
            used.push((from, si));
        }
        crate::telemetry::links::gpu_copy(from, to, c.src.bytes);
    }
    let mut events = Vec::with_capacity(used.len());
    for (from, si) in used {
        let e = cuda.event(from)?;
        cu::set_current(cuda.gpus[from].ctx)?;
        ck(
            // SAFETY: event and stream belong to the source GPU's context.
            unsafe { sys::cuEventRecord(e, cuda.gpus[from].streams[si]) },
            "cuEventRecord",
        )?;
        events.push((from, e));
    }
    Ok(events)
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
