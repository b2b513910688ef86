//! `ncclRedOpCreatePreMulSum`: reduction ops that scale each rank's input by that rank's scalar
//! before summing (FSDP2's gradient divide uses one; `nccl-tests -o mulsum` gives each rank its
//! own scalar). commd computes them exactly as defined: this rank's input is scaled into
//! staging memory (a kernel on the op's stream, or the CPU for host memory) and the staged data
//! is summed. Multiplying the sum afterwards would be wrong when the ranks' scalars differ.
//!
//! The scalar is kept by value (`ncclScalarHostImmediate`: NCCL programs destroy the op right
//! after enqueuing the collective) or as a device address read when the op runs
//! (`ncclScalarDevice`).

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::collections::HashMap;
use std::sync::OnceLock;

use commd_client::desc::DType;
use commd_cuda::kernels::Kernels;
use commd_cuda::sys;
use commd_proto::fp8::{E4M3, E5M2};
use half::{bf16, f16};

use crate::ffi::{self, Failure, Outcome, invalid, usage};
use crate::staging::Staging;

/// NCCL's `ncclNumOps`: the first value a created op gets.
pub const FIRST_OP: i32 = 5;
/// `ncclScalarDevice`.
pub const SCALAR_DEVICE: i32 = 0;
/// `ncclScalarHostImmediate`.
pub const SCALAR_HOST_IMMEDIATE: i32 = 1;

/// Where a created op's scalar is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scalar {
    /// Its bits (little-endian, `dtype.size()` bytes).
    Immediate(u64),
    /// A device address, read when the op runs.
    Device(u64),
}

/// A created op: the NCCL datatype it was made for, and its scalar.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreMul {
    pub nccl_dtype: i32,
    pub dtype: DType,
    pub scalar: Scalar,
}

/// A communicator's created ops.
#[derive(Default, Debug)]
pub struct Ops {
    next: i32,
    live: HashMap<i32, PreMul>,
}

impl Ops {
    /// Creates an op for `nccl_dtype` with the scalar at `scalar` (a host pointer for
    /// `ncclScalarHostImmediate`, read now; a device pointer for `ncclScalarDevice`).
    ///
    /// # Safety
    /// For `ncclScalarHostImmediate`, `scalar` must be readable for one element of the type.
    pub unsafe fn create(
        &mut self,
        scalar: *const u8,
        nccl_dtype: i32,
        residence: i32,
    ) -> Outcome<i32> {
        // The types a sum reduces.
        let (dtype, _) = ffi::reduce_types(nccl_dtype, ffi::op::SUM)?;
        if scalar.is_null() {
            return Err(invalid("scalar is NULL"));
        }
        let scalar = match residence {
            SCALAR_HOST_IMMEDIATE => {
                let mut bits = [0u8; 8];
                let n = usize::try_from(dtype.size())
                    .ok()
                    .filter(|&n| n <= bits.len())
                    .ok_or_else(|| Failure {
                        code: ffi::INTERNAL_ERROR,
                        message: format!("{} elements do not fit a scalar's 8 bytes", dtype.name()),
                    })?;
                // SAFETY: the caller's contract: one element of the type at `scalar`.
                unsafe { std::ptr::copy_nonoverlapping(scalar, bits.as_mut_ptr(), n) };
                Scalar::Immediate(u64::from_le_bytes(bits))
            }
            SCALAR_DEVICE => Scalar::Device(scalar as u64),
            r => {
                return Err(invalid(format!(
                    "scalar residence {r} is invalid (ncclScalarDevice 0 or ncclScalarHostImmediate 1)"
                )));
            }
        };
        let mut op = FIRST_OP.max(self.next);
        while self.live.contains_key(&op) {
            op = op.checked_add(1).unwrap_or(FIRST_OP);
        }
        self.next = op.checked_add(1).unwrap_or(FIRST_OP);
        self.live.insert(
            op,
            PreMul {
                nccl_dtype,
                dtype,
                scalar,
            },
        );
        Ok(op)
    }

    pub fn destroy(&mut self, op: i32) -> Outcome {
        self.live.remove(&op).map(|_| ()).ok_or_else(|| {
            invalid(format!(
                "reduction op {op} was not created by ncclRedOpCreatePreMulSum on this communicator (or was already destroyed; built-in ops cannot be destroyed)"
            ))
        })
    }

    /// The created op `op` used on data of `nccl_dtype`, or why it cannot be.
    pub fn get(&self, op: i32, nccl_dtype: i32) -> Outcome<PreMul> {
        // NCCL's ArgsCheck: ncclInvalidArgument.
        let p = *self.live.get(&op).ok_or_else(|| {
            invalid(format!(
                "reduction op {op} is not one ncclRedOpCreatePreMulSum created on this communicator (or it was destroyed)"
            ))
        })?;
        if p.nccl_dtype != nccl_dtype {
            return Err(invalid(format!(
                "reduction op {op} was created for {} but the data is {}",
                ffi::dtype_name(p.nccl_dtype),
                ffi::dtype_name(nccl_dtype)
            )));
        }
        Ok(p)
    }
}

/// Scales `n` elements at `data` (host memory) in place by an immediate scalar, with the
/// kernel's semantics: f16/bf16/fp8 multiply in f32 and round once to nearest even (fp8
/// saturated), integers wrap.
pub fn scale_host(data: &mut [u8], dtype: DType, scalar: Scalar) -> Outcome {
    let Scalar::Immediate(bits) = scalar else {
        return Err(usage(
            "a PreMulSum op with an ncclScalarDevice scalar on host memory: the scalar is in device memory, the data is not (use ncclScalarHostImmediate)",
        ));
    };
    let b = bits.to_le_bytes();
    macro_rules! each {
        ($t:ty, $f:expr) => {{
            const N: usize = std::mem::size_of::<$t>();
            let s = <$t>::from_le_bytes(b[..N].try_into().unwrap_or([0; N]));
            for c in data.chunks_exact_mut(N) {
                let x = <$t>::from_le_bytes(c.try_into().unwrap_or([0; N]));
                c.copy_from_slice(&$f(x, s).to_le_bytes());
            }
        }};
    }
    match dtype {
        DType::F32 => each!(f32, |x: f32, s: f32| x * s),
        DType::F64 => each!(f64, |x: f64, s: f64| x * s),
        // f32 products rounded once to nearest even, NaNs as the half crate (and the kernels)
        // convert them.
        DType::F16 => each!(u16, |x: u16, s: u16| f16::from_f32(
            f16::from_bits(x).to_f32() * f16::from_bits(s).to_f32()
        )
        .to_bits()),
        DType::BF16 => each!(u16, |x: u16, s: u16| bf16::from_f32(
            bf16::from_bits(x).to_f32() * bf16::from_bits(s).to_f32()
        )
        .to_bits()),
        DType::I8 | DType::U8 => each!(i8, |x: i8, s: i8| x.wrapping_mul(s)),
        DType::I32 | DType::U32 => each!(i32, |x: i32, s: i32| x.wrapping_mul(s)),
        DType::I64 | DType::U64 => each!(i64, |x: i64, s: i64| x.wrapping_mul(s)),
        DType::F8E4M3 => each!(u8, |x: u8, s: u8| E4M3
            .encode(E4M3.decode(x) * E4M3.decode(s))),
        DType::F8E5M2 => each!(u8, |x: u8, s: u8| E5M2
            .encode(E5M2.decode(x) * E5M2.decode(s))),
    }
    Ok(())
}

fn kernels() -> &'static Kernels {
    static K: OnceLock<Kernels> = OnceLock::new();
    K.get_or_init(Kernels::new)
}

/// Enqueues on `stream` this rank's input scaled by `p`'s scalar into a buffer of `st` and
/// returns its address. `st.done` must then be called with the same stream after the op that
/// reads it was enqueued.
///
/// # Safety
/// `send` is device memory holding `count` elements of `p.dtype` until the stream passes
/// the op; the stream is live, of the current context.
pub unsafe fn scale(
    st: &mut Staging,
    p: &PreMul,
    send: u64,
    count: u64,
    stream: usize,
) -> Outcome<u64> {
    let bytes = count
        .checked_mul(p.dtype.size())
        .ok_or_else(|| invalid(format!("count {count} overflows")))?;
    let dst = st.buffer(bytes, stream, "PreMulSum staging")?;
    let (sp, imm) = match p.scalar {
        Scalar::Immediate(b) => (0, b),
        Scalar::Device(a) => (a, 0),
    };
    // SAFETY: the caller's contract for `send` and the stream; `dst` holds `count` elements.
    unsafe {
        kernels()
            .launch_scale(stream as sys::CUstream, p.dtype, dst, send, count, sp, imm)
            .map_err(|e| Failure {
                code: ffi::UNHANDLED_CUDA_ERROR,
                message: format!("PreMulSum scale kernel: {e}"),
            })?;
    }
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_are_created_looked_up_and_destroyed() {
        let mut ops = Ops::default();
        let two = 2.0f32;
        // SAFETY: one f32 at the pointer.
        let a = unsafe {
            ops.create(
                (&raw const two).cast(),
                ffi::dt::FLOAT32,
                SCALAR_HOST_IMMEDIATE,
            )
        }
        .unwrap();
        assert_eq!(a, FIRST_OP);
        let p = ops.get(a, ffi::dt::FLOAT32).unwrap();
        assert_eq!(p.scalar, Scalar::Immediate(u64::from(2.0f32.to_bits())));
        let e = ops.get(a, ffi::dt::FLOAT64).unwrap_err();
        assert!(e.message.contains("created for"), "{}", e.message);
        // SAFETY: as above.
        let b = unsafe { ops.create((&raw const two).cast(), ffi::dt::FLOAT32, SCALAR_DEVICE) }
            .unwrap();
        assert_ne!(a, b);
        ops.destroy(a).unwrap();
        assert!(ops.get(a, ffi::dt::FLOAT32).is_err());
        assert!(
            ops.destroy(a)
                .unwrap_err()
                .message
                .contains("already destroyed")
        );
        // SAFETY: as above.
        let bad = unsafe { ops.create((&raw const two).cast(), ffi::dt::FLOAT32, 7) }.unwrap_err();
        assert!(bad.message.contains("residence 7"), "{}", bad.message);
        // fp8 ops take a one-byte scalar (0x30 is E4M3's 0.5).
        let half = 0x30u8;
        // SAFETY: one fp8 element.
        let fp8 = unsafe {
            ops.create(
                (&raw const half).cast(),
                ffi::dt::FP8_E4M3,
                SCALAR_HOST_IMMEDIATE,
            )
        }
        .unwrap();
        let p = ops.get(fp8, ffi::dt::FP8_E4M3).unwrap();
        assert_eq!(
            (p.dtype, p.scalar),
            (DType::F8E4M3, Scalar::Immediate(0x30))
        );
    }

    #[test]
    fn fp8_scaling_rounds_once_and_saturates() {
        // E4M3 3.0, 448 (the largest), -1.0 times 2.0: 6.0, saturated 448, -2.0.
        let mut d = vec![0x44u8, 0x7E, 0xB8];
        scale_host(&mut d, DType::F8E4M3, Scalar::Immediate(0x40)).unwrap();
        assert_eq!(d, [0x4C, 0x7E, 0xC0]);
        // E5M2 1.0 times 1.25 (0x3D): 1.25.
        let mut d = vec![0x3Cu8];
        scale_host(&mut d, DType::F8E5M2, Scalar::Immediate(0x3D)).unwrap();
        assert_eq!(d, [0x3D]);
    }

    #[test]
    fn host_scaling_follows_the_kernel() {
        let mut f: Vec<u8> = [1.5f32, -2.0, 3.25]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        scale_host(
            &mut f,
            DType::F32,
            Scalar::Immediate(u64::from(0.5f32.to_bits())),
        )
        .unwrap();
        let got: Vec<f32> = f
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, vec![0.75, -1.0, 1.625]);
        let mut i: Vec<u8> = [i32::MAX, -3]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        scale_host(&mut i, DType::I32, Scalar::Immediate(2)).unwrap();
        let got: Vec<i32> = i
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(got, vec![i32::MAX.wrapping_mul(2), -6]);
        // f16: 1.5 * 3 = 4.5; bf16: 1.5 * 3 = 4.5
        let mut h = 0x3e00u16.to_le_bytes().to_vec();
        scale_host(&mut h, DType::F16, Scalar::Immediate(0x4200)).unwrap();
        assert_eq!(u16::from_le_bytes([h[0], h[1]]), 0x4480);
        let mut b = 0x3fc0u16.to_le_bytes().to_vec();
        scale_host(&mut b, DType::BF16, Scalar::Immediate(0x4040)).unwrap();
        assert_eq!(u16::from_le_bytes([b[0], b[1]]), 0x4090);
        assert!(scale_host(&mut f, DType::F32, Scalar::Device(64)).is_err());
    }
}
