//! The CUDA driver, loaded at run time through cudarc (`dynamic-loading`). cudarc panics when
//! libcuda is missing, so every user goes through [`driver`] first, which checks
//! `is_culib_present()` once and initializes the driver.

#![allow(unsafe_code)] // the driver wrapper: every call here is FFI

use std::ffi::CStr;
use std::sync::OnceLock;

pub use cudarc::driver::sys;
use sys::CUresult;

/// A failed driver call: which call, and the driver's error name and text.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{what}: {name} ({text})")]
pub struct CuError {
    pub what: String,
    pub code: u32,
    pub name: String,
    pub text: String,
}

/// `Ok` if `r` is `CUDA_SUCCESS`, else an error naming `what`.
pub fn ck(r: CUresult, what: &str) -> Result<(), CuError> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let (name, text) = describe(r);
    Err(CuError {
        what: what.to_string(),
        code: r as u32,
        name,
        text,
    })
}

/// [`ck`] with the call's name made only on failure (per-op paths: no allocation when the
/// call succeeds).
pub fn ck_with(r: CUresult, what: impl FnOnce() -> String) -> Result<(), CuError> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    ck(r, &what())
}

/// The driver's name and description of an error code.
pub fn describe(r: CUresult) -> (String, String) {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: only called after `driver()` succeeded (errors come from driver calls); both calls
    // write a pointer to a static string or leave ours null on an unknown code.
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            format!("{r:?}")
        } else {
            // SAFETY: the driver returns NUL-terminated static strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    (s(name), s(text))
}

/// Loads and initializes the driver once. `Err` says why CUDA is unavailable (no libcuda, no
/// device, init failure); callers degrade to host memory with that reason.
pub fn driver() -> Result<(), String> {
    static STATE: OnceLock<Result<(), String>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            if commd_settings::get_os(&commd_settings::keys::DISABLE_CUDA)
                .is_some_and(|v| v != "0" && !v.is_empty())
            {
                return Err("disabled by COMMD_DISABLE_CUDA".into());
            }
            // SAFETY: is_culib_present only tries to dlopen the library names.
            if !unsafe { sys::is_culib_present() } {
                return Err("libcuda.so not found (no NVIDIA driver on this host)".into());
            }
            // SAFETY: the library is present; cuInit is safe to call from any thread.
            ck(unsafe { sys::cuInit(0) }, "cuInit").map_err(|e| e.to_string())?;
            let mut n = 0;
            // SAFETY: the driver is initialized; `n` is a valid out pointer.
            ck(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")
                .map_err(|e| e.to_string())?;
            if n <= 0 {
                return Err("the NVIDIA driver sees no GPU".into());
            }
            Ok(())
        })
        .clone()
}

/// Device ordinals visible to this process.
pub fn device_count() -> Result<i32, CuError> {
    let mut n = 0;
    // SAFETY: callers ran `driver()` successfully first.
    ck(unsafe { sys::cuDeviceGetCount(&mut n) }, "cuDeviceGetCount")?;
    Ok(n)
}

/// The 16-byte UUID of device `dev`: device ordinals differ between processes
/// (CUDA_VISIBLE_DEVICES), UUIDs do not.
pub fn device_uuid(dev: sys::CUdevice) -> Result<[u8; 16], CuError> {
    let mut u = sys::CUuuid { bytes: [0; 16] };
    ck(
        // SAFETY: `u` is a valid out struct; callers ran `driver()` first.
        unsafe { sys::cuDeviceGetUuid_v2(&mut u, dev) },
        "cuDeviceGetUuid",
    )?;
    // The UUID's bytes, whatever the sign of c_char.
    Ok(u.bytes.map(|b| u8::from_ne_bytes(b.to_ne_bytes())))
}

/// An integer attribute of device `dev`.
pub fn device_attr(dev: sys::CUdevice, a: sys::CUdevice_attribute) -> Result<i32, CuError> {
    let mut v = 0;
    ck(
        // SAFETY: `v` is a valid out pointer; callers ran `driver()` first.
        unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) },
        "cuDeviceGetAttribute",
    )?;
    Ok(v)
}

/// Retains the primary context of `dev` (the one the CUDA runtime and PyTorch use).
pub fn primary_ctx(dev: sys::CUdevice) -> Result<sys::CUcontext, CuError> {
    let mut ctx = std::ptr::null_mut();
    ck(
        // SAFETY: `ctx` is a valid out pointer; callers ran `driver()` first.
        unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
        "cuDevicePrimaryCtxRetain",
    )?;
    Ok(ctx)
}

/// Makes `ctx` current on the calling thread. The driver validates the handle (an invalid one
/// is an error, not undefined behaviour), so this is safe to call with any value.
#[allow(clippy::not_unsafe_ptr_arg_deref)]
pub fn set_current(ctx: sys::CUcontext) -> Result<(), CuError> {
    // SAFETY: the driver only records the handle; callers pass contexts they retained.
    let r = unsafe { sys::cuCtxSetCurrent(ctx) };
    ck(r, "cuCtxSetCurrent")
}

/// Opens an IPC handle (64 bytes from `cuIpcGetMemHandle`, possibly of another process) in the
/// current context, peer access enabled lazily; `what` names the call in errors.
pub fn ipc_open(handle: &[u8], what: &str) -> Result<sys::CUdeviceptr, CuError> {
    if handle.len() != sys::CU_IPC_HANDLE_SIZE as usize {
        return Err(CuError {
            what: what.to_string(),
            code: 0,
            name: "malformed IPC handle".into(),
            text: format!(
                "{} bytes, expected {}",
                handle.len(),
                sys::CU_IPC_HANDLE_SIZE
            ),
        });
    }
    let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
    for (d, s) in h.reserved.iter_mut().zip(handle) {
        *d = std::ffi::c_char::from_ne_bytes([*s]);
    }
    let mut ptr: sys::CUdeviceptr = 0;
    ck(
        // SAFETY: valid out pointer; the handle is plain bytes that the driver validates.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        },
        what,
    )?;
    Ok(ptr)
}

/// Formats a UUID like nvidia-smi: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
pub fn uuid_string(u: &[u8]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    if h.len() != 32 {
        return format!("GPU-{h}");
    }
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_reports_a_reason_instead_of_panicking() {
        match driver() {
            Ok(()) => assert!(device_count().unwrap() > 0),
            Err(why) => assert!(!why.is_empty()),
        }
    }

    #[test]
    fn uuid_formats_like_nvidia_smi() {
        let u: Vec<u8> = (0..16).collect();
        assert_eq!(uuid_string(&u), "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f");
    }
}
