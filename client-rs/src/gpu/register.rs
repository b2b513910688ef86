//! Registering the caller's device memory with the daemon: what the driver knows of a pointer,
//! the registration cache (by address range, each hit validated by the allocation's buffer id),
//! cuMem (VMM) pieces exported as fds, and the doorbell page mapped for the GPU
//! (docs/contracts.md #3).

#![allow(unsafe_code)] // pointer queries, exports and host registration through the driver

use std::collections::BTreeMap;
use std::os::fd::AsFd;

use commd_proto::pb;

use super::cu::{self, sys};
use super::regcache::{self, Reg};
use super::{SessionGpu, ensure_context};
use crate::{Error, Inner, Result, lock};

/// At most this many cuMem pieces are registered by one call (the daemon holds at most 256
/// staged fds per session).
const PIECES_PER_CALL: usize = 64;

/// The most cuMem pieces one buffer may need registered at once (PyTorch's pieces are 2 or
/// 20 MiB: 16384 covers a 320 GiB tensor).
const MAX_NEW_PIECES: usize = 16384;

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

pub(crate) fn device_uuid(ordinal: i32) -> Result<[u8; 16]> {
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
    pub(crate) fn doorbell_dev(&self, g: &mut SessionGpu) -> Result<sys::CUdeviceptr> {
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
            // The handle's bytes, whatever the sign of c_char.
            h.reserved
                .iter()
                .map(|c| u8::from_ne_bytes(c.to_ne_bytes()))
                .collect()
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
