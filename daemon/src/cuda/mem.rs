//! Device memory the daemon copies from and to: client allocations opened by IPC handle (once
//! per session, counted in `IpcStats`), mirrors of clients' cuMem ranges (pieces mapped and
//! pinned while ops use them), and daemon-owned scratch; `GpuSpan`, a checked range of one.
//!
//! May use: the driver (`cu`), `Cuda`'s GPUs.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use super::*;

impl Cuda {
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
        let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
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
            unsafe { sys::cuMemAlloc_v2(&mut ptr, commd_proto::num::usize_of(bytes.max(256))) },
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
            unsafe {
                sys::cuMemAddressReserve(&mut ptr, commd_proto::num::usize_of(bytes), 0, 0, 0)
            },
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
                let r =
                    unsafe { sys::cuMemUnmap(mem.ptr + o, commd_proto::num::usize_of(old.bytes)) };
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
                        usize::try_from(fd.as_raw_fd()).expect("an open fd is non-negative")
                            as *mut std::ffi::c_void,
                        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                    )
                },
                "cuMemImportFromShareableHandle",
            );
            r.map_err(|e| e.to_string())?;
            // SAFETY: the range lies inside the reservation (checked above) and is unmapped.
            let r =
                unsafe { sys::cuMemMap(mem.ptr + off, commd_proto::num::usize_of(bytes), 0, h, 0) };
            let mapped = ck(r, "cuMemMap");
            // SAFETY: `h` came from the import above; a mapping keeps the memory alive.
            unsafe { sys::cuMemRelease(h) };
            mapped.map_err(|e| {
                format!("{e} (piece at offset {off}, {bytes} bytes: it must be a whole allocation, mapped from its offset 0)")
            })?;
            t.insert(off, Slot { bytes, pins: 0 });
            if let Err(e) = self.grant_access(mem.gpu, mem.ptr + off, bytes) {
                // SAFETY: mapped just above; nothing uses it yet.
                unsafe { sys::cuMemUnmap(mem.ptr + off, commd_proto::num::usize_of(bytes)) };
                t.remove(&off);
                return Err(e);
            }
            self.stats.opens.fetch_add(1, Ordering::Relaxed);
        }
        let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
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
            let r =
                unsafe { sys::cuMemSetAccess(ptr, commd_proto::num::usize_of(bytes), &desc, 1) };
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
        Ok(h.reserved.iter().map(|c| c.cast_unsigned()).collect())
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
                    let r = unsafe {
                        sys::cuMemUnmap(self.ptr + o, commd_proto::num::usize_of(slot.bytes))
                    };
                    ck(r, "cuMemUnmap")?;
                }
                // SAFETY: reserved by `reserve_vmm`, freed once, here.
                ck(
                    unsafe {
                        sys::cuMemAddressFree(self.ptr, commd_proto::num::usize_of(self.len))
                    },
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
    pub(super) fn ptr_on(&self, gpu: usize) -> Result<sys::CUdeviceptr, CuError> {
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
        let us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX);
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

    pub(super) fn overlaps(&self, o: &GpuSpan) -> bool {
        Arc::ptr_eq(&self.mem, &o.mem)
            && self.off < o.off + o.bytes
            && o.off < self.off + self.bytes
    }
}
