//! The NVRTC build of a `(dtype, op)` module (`kernels::source`): whether the library is there,
//! its version, and the compilation to PTX or to CUBIN, with the options that pin IEEE
//! semantics.

#![allow(unsafe_code)] // NVRTC calls through cudarc's raw bindings

use std::ffi::{CString, c_char};
use std::sync::OnceLock;

use commd_proto::desc::{DType, RedOp};
use cudarc::nvrtc::{result as nvrtc_result, sys as nvrtc_sys};

use super::{KernelError, kernel_name, source};

/// Whether libnvrtc can be loaded (checked once: cudarc panics on its first call without it).
pub(super) fn nvrtc_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: is_culib_present only tries to dlopen the candidate library names.
    *PRESENT.get_or_init(|| unsafe { nvrtc_sys::is_culib_present() })
}

/// The version of the NVRTC library that [`compile_ptx`] uses.
pub fn nvrtc_version() -> Result<(i32, i32), KernelError> {
    if !nvrtc_present() {
        return Err(KernelError::NvrtcMissing);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; both out pointers are valid.
    let r = unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) };
    r.result().map_err(|e| KernelError::Nvrtc {
        call: "nvrtcVersion",
        kernel: String::new(),
        status: format!("{:?}", e.0),
    })?;
    Ok((major, minor))
}

/// Destroys an NVRTC program on every path out of [`nvrtc_compile`].
struct Program(nvrtc_sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by nvrtcCreateProgram and is destroyed only here.
        let _ = unsafe { nvrtc_result::destroy_program(self.0) };
    }
}

enum Output {
    Ptx,
    Cubin,
}
fn nvrtc_compile(
    dtype: DType,
    op: RedOp,
    arch: String,
    out: Output,
) -> Result<Vec<u8>, KernelError> {
    let src = source(dtype, op)?;
    if !nvrtc_present() {
        return Err(KernelError::NvrtcMissing);
    }
    let kernel = kernel_name(dtype, op);
    let fail = |call: &'static str, e: nvrtc_result::NvrtcError| KernelError::Nvrtc {
        call,
        kernel: kernel.clone(),
        status: format!("{:?}", e.0),
    };
    let c_src = CString::new(src).map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
    let c_name = CString::new(format!("{kernel}.cu"))
        .map_err(|e| KernelError::InvalidArgument(e.to_string()))?;
    let prog = Program(
        nvrtc_result::create_program(&c_src, Some(&c_name))
            .map_err(|e| fail("nvrtcCreateProgram", e))?,
    );
    // Pin IEEE semantics (these are NVRTC's defaults): denormals kept, exact division, no
    // contraction of a*b+c into fma.
    let options = vec![
        format!("--gpu-architecture={arch}"),
        "--ftz=false".to_string(),
        "--prec-div=true".to_string(),
        "--fmad=false".to_string(),
    ];
    // SAFETY: `prog` is a live program; the options are NUL-free ASCII.
    if let Err(e) = unsafe { nvrtc_result::compile_program(prog.0, &options) } {
        // SAFETY: as above.
        let log = match unsafe { nvrtc_result::get_program_log(prog.0) } {
            Ok(raw) => c_chars_to_string(&raw),
            Err(le) => format!("(no log: {:?})", le.0),
        };
        return Err(KernelError::Compile {
            kernel,
            options,
            status: format!("{:?}", e.0),
            log,
        });
    }
    match out {
        Output::Ptx => {
            // SAFETY: `prog` compiled successfully.
            let raw =
                unsafe { nvrtc_result::get_ptx(prog.0) }.map_err(|e| fail("nvrtcGetPTX", e))?;
            Ok(raw
                .iter()
                .map(|&c| u8::from_ne_bytes(c.to_ne_bytes()))
                .take_while(|&b| b != 0)
                .collect())
        }
        Output::Cubin => {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; `size` is a valid out pointer.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| fail("nvrtcGetCUBINSize", e))?;
            let mut image = vec![0u8; size];
            // SAFETY: `image` has the `size` bytes NVRTC asked for.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog.0, image.as_mut_ptr().cast::<c_char>()) }
                .result()
                .map_err(|e| fail("nvrtcGetCUBIN", e))?;
            Ok(image)
        }
    }
}

fn c_chars_to_string(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&c| u8::from_ne_bytes(c.to_ne_bytes()))
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// PTX of the kernel for `(dtype, op)`, for virtual architecture `compute_{major}{minor}`.
pub fn compile_ptx(dtype: DType, op: RedOp, arch: (u32, u32)) -> Result<String, KernelError> {
    let ptx = nvrtc_compile(
        dtype,
        op,
        format!("compute_{}{}", arch.0, arch.1),
        Output::Ptx,
    )?;
    String::from_utf8(ptx).map_err(|e| KernelError::Nvrtc {
        call: "nvrtcGetPTX",
        kernel: kernel_name(dtype, op),
        status: format!("PTX is not UTF-8: {e}"),
    })
}

/// CUBIN (SASS) of the kernel for `(dtype, op)`, for real architecture `sm_{major}{minor}`.
pub fn compile_cubin(dtype: DType, op: RedOp, arch: (u32, u32)) -> Result<Vec<u8>, KernelError> {
    nvrtc_compile(dtype, op, format!("sm_{}{}", arch.0, arch.1), Output::Cubin)
}
