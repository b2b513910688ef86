//! Device memory as the driver describes it: pointer attributes, the cuMem (VMM) pieces of an
//! allocation exported as fds, and host memory mapped for the GPU.

#![allow(unsafe_code)] // pointer-attribute queries and exports through the driver

use std::os::fd::{FromRawFd, OwnedFd};

use commd_proto::num::usize_of;

use crate::{CuError, ck, sys};

/// The attributes of a device pointer that registration needs, in one driver call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PointerAttrs {
    /// The allocation (for cuMem memory: the reserved address range) holding the pointer.
    pub base: sys::CUdeviceptr,
    pub size: u64,
    /// Unique per allocation for the process lifetime.
    pub buffer_id: u64,
    pub ordinal: i32,
    /// `CUmemorytype` as the driver reports it.
    pub memory_type: u32,
    /// `cuIpcGetMemHandle` works on it (cudaMalloc memory).
    pub legacy_ipc: bool,
    /// cuMem memory: the handle types its allocation may be exported as.
    pub handle_types: u32,
}

impl PointerAttrs {
    /// Device memory of this process: the only kind GPU ops can use.
    pub fn is_device_memory(&self) -> bool {
        self.memory_type == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32
            && self.ordinal >= 0
            && self.base != 0
    }
}

/// Every [`PointerAttrs`] field of `ptr`.
pub fn pointer_attrs(ptr: sys::CUdeviceptr) -> Result<PointerAttrs, CuError> {
    use sys::CUpointer_attribute as P;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    let mut id: u64 = 0;
    let mut ordinal: i32 = -1;
    let mut mtype: u32 = 0;
    // Zeroed 64-bit slots: the driver writes one of these two attributes as 8 bytes (with
    // 4-byte variables the allocation base read back with its low 32 bits zeroed, driver 580).
    let mut legacy: u64 = 0;
    let mut types: u64 = 0;
    let mut attrs = [
        P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        P::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        P::CU_POINTER_ATTRIBUTE_BUFFER_ID,
        P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        P::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
        P::CU_POINTER_ATTRIBUTE_ALLOWED_HANDLE_TYPES,
    ];
    let mut data: [*mut std::ffi::c_void; 7] = [
        (&mut base as *mut sys::CUdeviceptr).cast(),
        (&mut size as *mut usize).cast(),
        (&mut id as *mut u64).cast(),
        (&mut ordinal as *mut i32).cast(),
        (&mut mtype as *mut u32).cast(),
        (&mut legacy as *mut u64).cast(),
        (&mut types as *mut u64).cast(),
    ];
    ck(
        // SAFETY: each data pointer points to a variable of the type its attribute writes.
        unsafe { sys::cuPointerGetAttributes(7, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) },
        "cuPointerGetAttributes",
    )?;
    // A handle-type mask is a few low bits: anything wider is not one (never truncated).
    let handle_types = u32::try_from(types).map_err(|_| CuError {
        what: "cuPointerGetAttributes".into(),
        code: 0,
        name: "malformed attribute".into(),
        text: format!("allowed handle types {types:#x} of {ptr:#x} do not fit 32 bits"),
    })?;
    Ok(PointerAttrs {
        base,
        size: size as u64,
        buffer_id: id,
        ordinal,
        memory_type: mtype,
        legacy_ipc: legacy & 0xffff_ffff != 0,
        handle_types,
    })
}

/// The four attributes a direct op needs (fewer than [`pointer_attrs`]: the per-op host cost
/// of small eager ops): `(base, size, ordinal, memory type)` of the allocation holding `ptr`.
pub fn pointer_span(ptr: sys::CUdeviceptr) -> Result<(u64, u64, i32, u32), CuError> {
    use sys::CUpointer_attribute as P;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    let mut ordinal: i32 = -1;
    let mut mtype: u32 = 0;
    let mut attrs = [
        P::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
        P::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
    ];
    let mut data: [*mut std::ffi::c_void; 4] = [
        (&mut base as *mut sys::CUdeviceptr).cast(),
        (&mut size as *mut usize).cast(),
        (&mut ordinal as *mut i32).cast(),
        (&mut mtype as *mut u32).cast(),
    ];
    ck(
        // SAFETY: each data pointer points to a variable of the type its attribute writes.
        unsafe { sys::cuPointerGetAttributes(4, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) },
        "cuPointerGetAttributes",
    )?;
    Ok((base, size as u64, ordinal, mtype))
}

/// The cuMem mapping holding `ptr`: (mapping base, size, buffer id).
pub fn mapping_info(ptr: sys::CUdeviceptr) -> Result<(u64, u64, u64), CuError> {
    use sys::CUpointer_attribute as P;
    let mut base: sys::CUdeviceptr = 0;
    let mut size: usize = 0;
    let mut id: u64 = 0;
    let mut attrs = [
        P::CU_POINTER_ATTRIBUTE_MAPPING_BASE_ADDR,
        P::CU_POINTER_ATTRIBUTE_MAPPING_SIZE,
        P::CU_POINTER_ATTRIBUTE_BUFFER_ID,
    ];
    let mut data: [*mut std::ffi::c_void; 3] = [
        (&mut base as *mut sys::CUdeviceptr).cast(),
        (&mut size as *mut usize).cast(),
        (&mut id as *mut u64).cast(),
    ];
    // SAFETY: each data pointer points to a variable of the type its attribute writes.
    let r = unsafe { sys::cuPointerGetAttributes(3, attrs.as_mut_ptr(), data.as_mut_ptr(), ptr) };
    ck(r, "cuPointerGetAttributes(mapping)")?;
    Ok((base, size as u64, id))
}

/// The driver's buffer id of the allocation holding `ptr` (one attribute: the cheap check that
/// a cached registration still describes the allocation at that address).
pub fn buffer_id(ptr: sys::CUdeviceptr) -> Option<u64> {
    let mut id: u64 = 0;
    // SAFETY: BUFFER_ID writes one u64 to the valid out pointer.
    let r = unsafe {
        sys::cuPointerGetAttribute(
            (&mut id as *mut u64).cast(),
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            ptr,
        )
    };
    (r == sys::CUresult::CUDA_SUCCESS).then_some(id)
}

/// The CUDA IPC handle of the cudaMalloc allocation that starts at `base`, as 64 plain bytes
/// (whatever the sign of `c_char`).
pub fn ipc_handle(base: sys::CUdeviceptr) -> Result<[u8; 64], CuError> {
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    ck(
        // SAFETY: valid out struct; the driver checks that `base` starts an exportable
        // allocation.
        unsafe { sys::cuIpcGetMemHandle(&mut h, base) },
        "cuIpcGetMemHandle",
    )?;
    let mut out = [0u8; 64];
    for (d, s) in out.iter_mut().zip(h.reserved.iter()) {
        *d = u8::from_ne_bytes(s.to_ne_bytes());
    }
    Ok(out)
}

/// Exports the cuMem allocation mapped at `addr` as a POSIX fd.
pub fn export_piece(addr: sys::CUdeviceptr) -> Result<OwnedFd, CuError> {
    let mut h: sys::CUmemGenericAllocationHandle = 0;
    // SAFETY: valid out pointer; `addr` lies in a mapping of this process (the driver checks).
    let r = unsafe { sys::cuMemRetainAllocationHandle(&mut h, usize_of(addr) as *mut _) };
    ck(r, "cuMemRetainAllocationHandle")?;
    let mut fd: std::ffi::c_int = -1;
    // SAFETY: for POSIX fds the out parameter is an int; `h` is the handle retained above.
    let r = unsafe {
        sys::cuMemExportToShareableHandle(
            (&mut fd as *mut std::ffi::c_int).cast(),
            h,
            sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            0,
        )
    };
    // SAFETY: releases the retain above (the mapping keeps the allocation alive).
    unsafe { sys::cuMemRelease(h) };
    ck(r, "cuMemExportToShareableHandle")?;
    if fd < 0 {
        return Err(CuError {
            what: "cuMemExportToShareableHandle".into(),
            code: 0,
            name: "no fd".into(),
            text: format!("the driver gave no fd for {addr:#x}"),
        });
    }
    // SAFETY: the driver returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Registers `len` bytes of host memory at `host` with the driver for device access (already
/// registered is fine) and returns its device address.
///
/// # Safety
/// `[host, host + len)` must be page-aligned memory that stays mapped while the GPU may use it.
pub unsafe fn map_host(host: *mut u8, len: u64, what: &str) -> Result<sys::CUdeviceptr, CuError> {
    // SAFETY: the caller's contract.
    let r = unsafe {
        sys::cuMemHostRegister_v2(
            host.cast(),
            usize_of(len),
            sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    };
    if r != sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
        ck(r, &format!("cuMemHostRegister({what})"))?;
    }
    let mut d: sys::CUdeviceptr = 0;
    ck(
        // SAFETY: registered with DEVICEMAP above.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut d, host.cast(), 0) },
        "cuMemHostGetDevicePointer",
    )?;
    Ok(d)
}
