//! Element-wise reductions over host memory for every dtype and reduction op.
//!
//! f16, bf16 and fp8 (E4M3, E5M2) accumulate in f32 (fp8 stored rounded to nearest even and
//! saturated to the largest finite value, as NCCL stores it); integer sum/prod wrap on overflow
//! (as NCCL does); `avg` is the sum divided by the rank count, for integers NCCL's definition:
//! the sum wrapped in the element type, then divided (truncated toward zero; unsigned types
//! divide unsigned). `min`/`max` of floats compare
//! with `<`/`>`, so a NaN input propagates only from the first operand, as in a sequential loop.
//! The bitwise ops (`band`, `bor`, `bxor`) exist for integer dtypes only: a [`Kernel`], the only
//! way to call [`reduce`], cannot be made for a bitwise op on a float dtype.
//!
//! Inputs are read chunk by chunk into a small accumulator that stays in L1, then the chunk is
//! written to every output: each input is read once and each output written once, and an output
//! that is exactly one of the inputs (in-place ops) is safe.

#![allow(unsafe_code)] // reductions over registered memory that clients also map

use commd_proto::desc::{DType, DescError, RedOp};
use commd_proto::fp8;
use commd_proto::num::usize_of;
use half::{bf16, f16};

const CHUNK: usize = 2048;

trait Acc: Copy + Default {
    fn sum(self, o: Self) -> Self;
    fn prod(self, o: Self) -> Self;
    fn min(self, o: Self) -> Self;
    fn max(self, o: Self) -> Self;
    fn div_n(self, n: u32) -> Self;
}

macro_rules! float_acc {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn sum(self, o: Self) -> Self {
                self + o
            }
            #[inline(always)]
            fn prod(self, o: Self) -> Self {
                self * o
            }
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                if o < self { o } else { self }
            }
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                if o > self { o } else { self }
            }
            #[inline(always)]
            fn div_n(self, n: u32) -> Self {
                self / (n as $t)
            }
        }
    };
}
float_acc!(f32);
float_acc!(f64);

macro_rules! int_acc {
    ($t:ty) => {
        impl Acc for $t {
            #[inline(always)]
            fn sum(self, o: Self) -> Self {
                self.wrapping_add(o)
            }
            #[inline(always)]
            fn prod(self, o: Self) -> Self {
                self.wrapping_mul(o)
            }
            #[inline(always)]
            fn min(self, o: Self) -> Self {
                Ord::min(self, o)
            }
            #[inline(always)]
            fn max(self, o: Self) -> Self {
                Ord::max(self, o)
            }
            #[inline(always)]
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            fn div_n(self, n: u32) -> Self {
                // As C divides after promoting both to int: a quotient of a value of the type
                // by a positive n lies within the type's range, so the cast is exact.
                (i128::from(self) / i128::from(Ord::max(n, 1))) as $t
            }
        }
    };
}
int_acc!(i8);
int_acc!(u8);
int_acc!(i32);
int_acc!(i64);
int_acc!(u32);
int_acc!(u64);

/// Bitwise ops, implemented for the integer accumulators only (so a float can never reach them).
trait BitAcc: Acc {
    fn band(self, o: Self) -> Self;
    fn bor(self, o: Self) -> Self;
    fn bxor(self, o: Self) -> Self;
}

macro_rules! bit_acc {
    ($t:ty) => {
        impl BitAcc for $t {
            #[inline(always)]
            fn band(self, o: Self) -> Self {
                self & o
            }
            #[inline(always)]
            fn bor(self, o: Self) -> Self {
                self | o
            }
            #[inline(always)]
            fn bxor(self, o: Self) -> Self {
                self ^ o
            }
        }
    };
}
bit_acc!(i8);
bit_acc!(u8);
bit_acc!(i32);
bit_acc!(i64);
bit_acc!(u32);
bit_acc!(u64);

trait Elem: Copy + Default {
    type A: Acc;
    fn load(self) -> Self::A;
    fn store(a: Self::A) -> Self;
}

macro_rules! same_elem {
    ($t:ty) => {
        impl Elem for $t {
            type A = $t;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(a: $t) -> $t {
                a
            }
        }
    };
}
same_elem!(f32);
same_elem!(f64);
same_elem!(i8);
same_elem!(u8);
same_elem!(i32);
same_elem!(i64);
same_elem!(u32);
same_elem!(u64);

impl Elem for f16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(a: f32) -> f16 {
        f16::from_f32(a)
    }
}

impl Elem for bf16 {
    type A = f32;
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(a: f32) -> bf16 {
        bf16::from_f32(a)
    }
}

/// Every fp8 code's value, per format: a load is one table read, not a decode per element.
fn fp8_table(f: fp8::Format) -> [f32; 256] {
    std::array::from_fn(|c| f.decode(u8::try_from(c).unwrap_or(0)))
}
static E4M3_VALUES: std::sync::LazyLock<[f32; 256]> =
    std::sync::LazyLock::new(|| fp8_table(fp8::E4M3));
static E5M2_VALUES: std::sync::LazyLock<[f32; 256]> =
    std::sync::LazyLock::new(|| fp8_table(fp8::E5M2));

/// An fp8 element, accumulated in f32.
macro_rules! fp8_elem {
    ($name:ident, $format:expr, $values:ident) => {
        #[derive(Clone, Copy, Default)]
        #[repr(transparent)]
        struct $name(u8);

        impl Elem for $name {
            type A = f32;
            #[inline(always)]
            fn load(self) -> f32 {
                $values[usize::from(self.0)]
            }
            #[inline(always)]
            fn store(a: f32) -> Self {
                $name($format.encode(a))
            }
        }
    };
}
fp8_elem!(F8e4m3, fp8::E4M3, E4M3_VALUES);
fp8_elem!(F8e5m2, fp8::E5M2, E5M2_VALUES);

#[inline(always)]
unsafe fn fold<T: Elem>(acc: &mut [T::A], p: *const T, f: impl Fn(T::A, T::A) -> T::A) {
    for (j, a) in acc.iter_mut().enumerate() {
        // SAFETY: the caller guarantees `p` is valid for `acc.len()` aligned reads.
        *a = f(*a, unsafe { p.add(j).read() }.load());
    }
}

/// # Safety
/// Every input must be valid for `n` aligned reads of `T` and every output for `n` aligned writes;
/// an output may be identical to an input but must not partially overlap any input.
///
/// `combine` folds one input into the accumulator; `avg_over` divides the result by that count.
/// Generic over `F` so each op is its own monomorphized loop (no call per element).
unsafe fn reduce_t<T: Elem, F: Fn(T::A, T::A) -> T::A + Copy>(
    combine: F,
    avg_over: Option<u32>,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    n: usize,
    stream: bool,
    ch: Chain,
) {
    let mut buf = [T::A::default(); CHUNK];
    let mut out_buf = [T::default(); CHUNK];
    let mut i = 0;
    while i < n {
        let m = CHUNK.min(n - i);
        let acc = &mut buf[..m];
        let rest = if ch.acc_in.is_null() {
            let first = inputs[0].cast::<T>();
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: i + j < n, within the caller's guarantee for inputs[0].
                *a = unsafe { first.add(i + j).read() }.load();
            }
            &inputs[1..]
        } else {
            let src = ch.acc_in.cast::<T::A>();
            for (j, a) in acc.iter_mut().enumerate() {
                // SAFETY: the caller guarantees acc_in holds n accumulators (Chain).
                *a = unsafe { src.add(i + j).read_unaligned() };
            }
            inputs
        };
        for inp in rest {
            // SAFETY: i + m <= n, within the caller's guarantee for this input.
            let p = unsafe { inp.cast::<T>().add(i) };
            // SAFETY: p is valid for m reads (above).
            unsafe { fold::<T>(acc, p, combine) };
        }
        if !ch.acc_out.is_null() {
            let dst = ch.acc_out.cast::<T::A>();
            for (j, a) in acc.iter().enumerate() {
                // SAFETY: the caller guarantees acc_out has room for n accumulators (Chain).
                unsafe { dst.add(i + j).write_unaligned(*a) };
            }
            i += m;
            continue;
        }
        if let Some(nranks) = avg_over {
            for a in acc.iter_mut() {
                *a = a.div_n(nranks);
            }
        }
        if stream {
            // Convert once, then write every output with non-temporal stores: no read-for-ownership
            // of output lines that are not in cache, and no eviction of the inputs still to read.
            for (o, a) in out_buf[..m].iter_mut().zip(acc.iter()) {
                *o = T::store(*a);
            }
            let bytes = m * std::mem::size_of::<T>();
            for out in outputs {
                // SAFETY: i + m <= n, within the caller's guarantee for this output; out_buf holds m elements.
                let q = unsafe { out.cast::<T>().add(i).cast::<u8>() };
                if inputs.contains(&out.cast_const()) {
                    // In place: the lines were just read and are in cache; a plain store is cheaper.
                    // SAFETY: as above.
                    unsafe {
                        std::ptr::copy_nonoverlapping(out_buf.as_ptr().cast::<u8>(), q, bytes)
                    };
                } else {
                    // SAFETY: as above.
                    unsafe { stream_copy(q, out_buf.as_ptr().cast::<u8>(), bytes) };
                }
            }
        } else {
            for out in outputs {
                // SAFETY: i + m <= n, within the caller's guarantee for this output.
                let q = unsafe { out.cast::<T>().add(i) };
                for (j, a) in acc.iter().enumerate() {
                    // SAFETY: q is valid for m writes.
                    unsafe { q.add(j).write(T::store(*a)) };
                }
            }
        }
        i += m;
    }
}

/// Copies `n` bytes with non-temporal stores where the CPU has them (plain copy elsewhere).
/// The caller issues [`store_fence`] before publishing the result.
///
/// # Safety
/// `src` valid for `n` reads, `dst` for `n` writes, not overlapping.
unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.align_offset(16).min(n);
        // SAFETY: head <= n, within both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut i = head;
        while i + 16 <= n {
            // SAFETY: i + 16 <= n; dst + i is 16-byte aligned (head aligned it); SSE2 is part of the
            // x86-64 baseline.
            unsafe {
                _mm_stream_si128(
                    dst.add(i).cast::<__m128i>(),
                    _mm_loadu_si128(src.add(i).cast::<__m128i>()),
                )
            };
            i += 16;
        }
        // SAFETY: the tail lies within both ranges.
        unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: forwarded from the caller.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    };
}

/// Orders this thread's non-temporal stores before its later stores (the completion).
pub fn store_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: sfence has no preconditions; SSE is part of the x86-64 baseline.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// A reduction the kernels implement: a dtype and an op that is defined for it. Made only by
/// [`Kernel::new`], which refuses bitwise ops on float dtypes, so [`reduce`] never sees one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Kernel {
    dtype: DType,
    op: RedOp,
}

impl Kernel {
    pub fn new(dtype: DType, op: RedOp) -> Result<Self, DescError> {
        op.check_dtype(dtype)?;
        Ok(Self { dtype, op })
    }

    pub fn dtype(self) -> DType {
        self.dtype
    }

    pub fn op(self) -> RedOp {
        self.op
    }
}

/// The ops defined for every dtype.
///
/// # Safety
/// As for [`reduce_t`]; `op` is not bitwise unless `T` is an integer (then [`int_ops`] took it).
unsafe fn arith_ops<T: Elem>(
    op: RedOp,
    nranks: u32,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    n: usize,
    stream: bool,
    ch: Chain,
) {
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match op {
            RedOp::Sum => reduce_t::<T, _>(Acc::sum, None, inputs, outputs, n, stream, ch),
            RedOp::Avg => reduce_t::<T, _>(Acc::sum, Some(nranks), inputs, outputs, n, stream, ch),
            RedOp::Prod => reduce_t::<T, _>(Acc::prod, None, inputs, outputs, n, stream, ch),
            RedOp::Min => reduce_t::<T, _>(Acc::min, None, inputs, outputs, n, stream, ch),
            RedOp::Max => reduce_t::<T, _>(Acc::max, None, inputs, outputs, n, stream, ch),
            // Impossible: `Kernel::new` refuses bitwise ops for float dtypes, and `int_ops`
            // handles them itself for integer dtypes before delegating here.
            RedOp::Band | RedOp::Bor | RedOp::Bxor => {
                unreachable!("bitwise reduction {op:?} reached the arithmetic kernels")
            }
        }
    }
}

/// Every op, for integer dtypes (accumulated in the element type itself).
///
/// # Safety
/// As for [`reduce_t`].
unsafe fn int_ops<T: Elem<A = T> + BitAcc>(
    op: RedOp,
    nranks: u32,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    n: usize,
    stream: bool,
    ch: Chain,
) {
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match op {
            RedOp::Band => reduce_t::<T, _>(BitAcc::band, None, inputs, outputs, n, stream, ch),
            RedOp::Bor => reduce_t::<T, _>(BitAcc::bor, None, inputs, outputs, n, stream, ch),
            RedOp::Bxor => reduce_t::<T, _>(BitAcc::bxor, None, inputs, outputs, n, stream, ch),
            _ => arith_ops::<T>(op, nranks, inputs, outputs, n, stream, ch),
        }
    }
}

/// Reduces `n` elements of every input into every output.
///
/// # Safety
/// Each pointer must be aligned for the kernel's dtype; inputs valid for `n` element reads and
/// outputs for `n` element writes for the duration of the call; an output may be identical to an
/// input but must not partially overlap one. `inputs` must not be empty. With `stream`, outputs
/// are written with non-temporal stores (for outputs larger than the caches) and fenced before
/// returning.
pub unsafe fn reduce(
    kernel: Kernel,
    nranks: u32,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    n: usize,
    stream: bool,
) {
    // SAFETY: forwarded; a plain reduction (no chain accumulators).
    unsafe { reduce_chain(kernel, nranks, Chain::NONE, inputs, outputs, n, stream) }
}

/// Accumulator state carried between the nodes of a chained reduction (inter-node: the partial
/// result of ranks `0..k` travels to the node of rank `k`), so a reduction split across nodes
/// performs exactly the operations, in exactly the order, of the single-node [`reduce`].
/// Null pointers mean "none".
#[derive(Clone, Copy, Debug)]
pub struct Chain {
    /// Partial accumulators to continue from (instead of loading the first input).
    pub acc_in: *const u8,
    /// Where to write the accumulators (instead of finishing into `outputs`).
    pub acc_out: *mut u8,
}

impl Chain {
    pub const NONE: Chain = Chain {
        acc_in: std::ptr::null(),
        acc_out: std::ptr::null_mut(),
    };
}

impl Kernel {
    /// Bytes of one accumulator element: f32 for f16/bf16/fp8, else the element itself.
    pub fn acc_size(self) -> usize {
        match (self.dtype, self.op) {
            (DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2, _) => 4,
            (d, _) => usize_of(d.size()),
        }
    }
}

/// [`reduce`], optionally continuing from and/or stopping at accumulators ([`Chain`]).
///
/// # Safety
/// As for [`reduce`]; in addition a non-null `acc_in` must be valid for `n * acc_size` reads and
/// a non-null `acc_out` for `n * acc_size` writes (no alignment needed), not overlapping the
/// other buffers. `inputs` must not be empty unless `acc_in` is set. With `acc_out`, `outputs`
/// is ignored.
pub unsafe fn reduce_chain(
    kernel: Kernel,
    nranks: u32,
    ch: Chain,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    n: usize,
    stream: bool,
) {
    debug_assert!(!inputs.is_empty() || !ch.acc_in.is_null());
    let (op, ins, outs) = (kernel.op, inputs, outputs);
    // SAFETY: forwarded caller guarantees; T matches the dtype; `Kernel::new` admitted the pair.
    unsafe {
        match kernel.dtype {
            DType::F32 => arith_ops::<f32>(op, nranks, ins, outs, n, stream, ch),
            DType::F64 => arith_ops::<f64>(op, nranks, ins, outs, n, stream, ch),
            DType::F16 => arith_ops::<f16>(op, nranks, ins, outs, n, stream, ch),
            DType::BF16 => arith_ops::<bf16>(op, nranks, ins, outs, n, stream, ch),
            DType::I8 => int_ops::<i8>(op, nranks, ins, outs, n, stream, ch),
            DType::U8 => int_ops::<u8>(op, nranks, ins, outs, n, stream, ch),
            DType::I32 => int_ops::<i32>(op, nranks, ins, outs, n, stream, ch),
            DType::I64 => int_ops::<i64>(op, nranks, ins, outs, n, stream, ch),
            DType::U32 => int_ops::<u32>(op, nranks, ins, outs, n, stream, ch),
            DType::U64 => int_ops::<u64>(op, nranks, ins, outs, n, stream, ch),
            DType::F8E4M3 => arith_ops::<F8e4m3>(op, nranks, ins, outs, n, stream, ch),
            DType::F8E5M2 => arith_ops::<F8e5m2>(op, nranks, ins, outs, n, stream, ch),
        }
    }
    if stream {
        store_fence();
    }
}

#[cfg(test)]
mod tests;
