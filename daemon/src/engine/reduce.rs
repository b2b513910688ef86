//! Element-wise reductions over host memory for every dtype and reduction op.
//!
//! f16, bf16 and fp8 (E4M3, E5M2) accumulate in f32 (fp8 stored rounded to nearest even and
//! saturated to the largest finite value, as NCCL stores it); integer sum/prod wrap on overflow (as NCCL does); `avg` is the
//! sum divided by the rank count, and for integers the exact mean truncated toward zero (summed in
//! i128, so it never wraps; NCCL would divide a wrapped sum). `min`/`max` of floats compare
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
            fn div_n(self, n: u32) -> Self {
                // n <= MAX_RANKS (2^16); for 8-bit types a quotient by n > 255 is 0 (or -1/0).
                match <$t>::try_from(n) {
                    Ok(d) => self.wrapping_div(d),
                    Err(_) => 0,
                }
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

// Integer average accumulates here: the exact sum of up to 2^16 ranks of any integer dtype
// fits, so AVG is the true mean truncated toward zero (always representable), never a wrapped
// sum divided afterwards.
int_acc!(i128);

/// An integer element read into an `i128` accumulator (same layout as `T`).
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
struct Wide<T>(T);

macro_rules! wide_elem {
    ($t:ty) => {
        impl Elem for Wide<$t> {
            type A = i128;
            #[inline(always)]
            fn load(self) -> i128 {
                i128::from(self.0)
            }
            #[inline(always)]
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            fn store(a: i128) -> Self {
                // A mean of values of $t lies within $t's range, so the cast is exact.
                Wide(a as $t)
            }
        }
    };
}
wide_elem!(i8);
wide_elem!(u8);
wide_elem!(i32);
wide_elem!(i64);
wide_elem!(u32);
wide_elem!(u64);

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

/// An fp8 element, accumulated in f32.
macro_rules! fp8_elem {
    ($name:ident, $format:expr) => {
        #[derive(Clone, Copy, Default)]
        #[repr(transparent)]
        struct $name(u8);

        impl Elem for $name {
            type A = f32;
            #[inline(always)]
            fn load(self) -> f32 {
                $format.decode(self.0)
            }
            #[inline(always)]
            fn store(a: f32) -> Self {
                $name($format.encode(a))
            }
        }
    };
}
fp8_elem!(F8e4m3, fp8::E4M3);
fp8_elem!(F8e5m2, fp8::E5M2);

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

/// Every op, for integer dtypes (accumulated in the element type itself, but AVG in `i128`).
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
) where
    Wide<T>: Elem<A = i128>,
{
    // SAFETY: forwarded caller guarantees.
    unsafe {
        match op {
            RedOp::Band => reduce_t::<T, _>(BitAcc::band, None, inputs, outputs, n, stream, ch),
            RedOp::Bor => reduce_t::<T, _>(BitAcc::bor, None, inputs, outputs, n, stream, ch),
            RedOp::Bxor => reduce_t::<T, _>(BitAcc::bxor, None, inputs, outputs, n, stream, ch),
            RedOp::Avg => {
                reduce_t::<Wide<T>, _>(Acc::sum, Some(nranks), inputs, outputs, n, stream, ch)
            }
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
    /// Bytes of one accumulator element: f32 for f16/bf16/fp8, i128 for integer averages, else the
    /// element itself.
    pub fn acc_size(self) -> usize {
        match (self.dtype, self.op) {
            (DType::F16 | DType::BF16 | DType::F8E4M3 | DType::F8E5M2, _) => 4,
            (d, RedOp::Avg) if !d.is_float() => 16,
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
mod tests {
    use super::*;
    use commd_proto::desc::{ALL_DTYPES, ALL_REDOPS};

    /// Reference: reduce in f64 (or i128) one element at a time, with the same rounding points.
    // An f64 reference of a reduction: `a as f32` rounds like an f32 accumulator; the integer
    // dtypes' values are whole f64s within i128, wrapped to the dtype by `wrap`.
    #[allow(clippy::cast_possible_truncation)]
    fn reference(dtype: DType, op: RedOp, vals: &[f64]) -> f64 {
        let n = vals.len() as f64;
        if dtype.is_float() {
            // Accumulate like the kernel: in f32 for f16/bf16/f32, f64 for f64.
            let mut a = vals[0];
            for &v in &vals[1..] {
                a = match op {
                    RedOp::Sum | RedOp::Avg => a + v,
                    RedOp::Prod => a * v,
                    RedOp::Min => a.min(v),
                    RedOp::Max => a.max(v),
                    RedOp::Band | RedOp::Bor | RedOp::Bxor => {
                        panic!("no float reference for {op:?}: the kernels refuse it")
                    }
                };
                if dtype != DType::F64 {
                    a = a as f32 as f64;
                }
            }
            if op == RedOp::Avg {
                a /= n;
            }
            a
        } else {
            let bits = dtype.size() * 8;
            let signed = !dtype.is_unsigned();
            let wrap = |x: i128| -> i128 {
                let m = 1i128 << bits;
                let mut y = x.rem_euclid(m);
                if signed && y >= m / 2 {
                    y -= m;
                }
                y
            };
            if op == RedOp::Avg {
                // The exact mean, truncated toward zero.
                return (vals.iter().map(|&v| v as i128).sum::<i128>() / vals.len() as i128) as f64;
            }
            let mut a = vals[0] as i128;
            for &v in &vals[1..] {
                let v = v as i128;
                a = wrap(match op {
                    RedOp::Sum | RedOp::Avg => a + v,
                    RedOp::Prod => a * v,
                    RedOp::Min => Ord::min(a, v),
                    RedOp::Max => Ord::max(a, v),
                    // On sign-extended i128 values, as wide as any dtype: the low bits are the
                    // narrow result and `wrap` restores the sign.
                    RedOp::Band => a & v,
                    RedOp::Bor => a | v,
                    RedOp::Bxor => a ^ v,
                });
            }
            if op == RedOp::Avg {
                // Truncating division like Rust's integer `/`.
                a /= vals.len() as i128;
            }
            a as f64
        }
    }

    // An f64 reference value stored as the dtype: `as` rounds (floats) or truncates (integers,
    // whose values are exact in f64 and within the dtype's range), as the kernels' results do.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    fn to_bytes(dtype: DType, v: &[f64]) -> Vec<u8> {
        let mut out = Vec::new();
        for &x in v {
            match dtype {
                DType::F32 => out.extend((x as f32).to_ne_bytes()),
                DType::F64 => out.extend(x.to_ne_bytes()),
                DType::F16 => out.extend(f16::from_f64(x).to_ne_bytes()),
                DType::BF16 => out.extend(bf16::from_f64(x).to_ne_bytes()),
                DType::I8 => out.extend((x as i8).to_ne_bytes()),
                DType::U8 => out.extend((x as u8).to_ne_bytes()),
                DType::I32 => out.extend((x as i32).to_ne_bytes()),
                DType::I64 => out.extend((x as i64).to_ne_bytes()),
                DType::U32 => out.extend((x as u32).to_ne_bytes()),
                DType::U64 => out.extend((x as u64).to_ne_bytes()),
                DType::F8E4M3 => out.push(fp8::E4M3.encode(x as f32)),
                DType::F8E5M2 => out.push(fp8::E5M2.encode(x as f32)),
            }
        }
        out
    }

    fn from_bytes(dtype: DType, b: &[u8]) -> Vec<f64> {
        let s = usize_of(dtype.size());
        b.chunks(s)
            .map(|c| match dtype {
                DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()),
                DType::F16 => f16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
                DType::BF16 => bf16::from_ne_bytes(c.try_into().unwrap()).to_f64(),
                DType::I8 => i8::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::U8 => u8::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::I32 => i32::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::I64 => i64::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::U32 => u32::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::U64 => u64::from_ne_bytes(c.try_into().unwrap()) as f64,
                DType::F8E4M3 => f64::from(fp8::E4M3.decode(c[0])),
                DType::F8E5M2 => f64::from(fp8::E5M2.decode(c[0])),
            })
            .collect()
    }

    // The low bits of a hash as each dtype's full-width bit pattern: truncation is the point.
    #[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
    fn value(dtype: DType, op: RedOp, r: usize, i: usize) -> f64 {
        if op.is_bitwise() {
            // Full-width bit patterns, sign bit included; i64 keeps 53 bits so f64 holds it exactly
            // (bits 52..63 then all equal the sign, which still tests them).
            let h = (r as u64 + 1)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15)
                .rotate_left(u32::try_from(i % 64).unwrap())
                ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            return match dtype {
                DType::I8 => f64::from(h as i8),
                DType::U8 => f64::from(h as u8),
                DType::I32 => f64::from(h as i32),
                DType::U32 => f64::from(h as u32),
                DType::U64 => (h >> 11) as f64,
                _ => (h.cast_signed() >> 11) as f64,
            };
        }
        let h = (r * 7919 + i * 104_729) % 23;
        match dtype {
            DType::U8 => (h * 11) as f64,         // 0..=242, sums wrap
            DType::I8 => h as f64 * 11.0 - 120.0, // -120..=122, sums and products wrap
            // Products of small values; other ops on values across the whole unsigned range
            // (above the signed maximum: compared unsigned), whose sums wrap.
            DType::U32 | DType::U64 if op == RedOp::Prod => h as f64,
            DType::U32 => (h * 190_000_000) as f64,
            // 8e17 * h is exact in f64 (45 significant bits).
            DType::U64 => h as f64 * 8e17,
            _ => h as f64 - 11.0, // -11..=11
        }
    }

    #[test]
    fn every_dtype_and_op_matches_reference() {
        // Odd n crosses the chunk boundary; 3 ranks exercise avg rounding.
        let n = CHUNK * 2 + 37;
        let (mut checked, mut refused) = (0, 0);
        for dtype in ALL_DTYPES {
            for op in ALL_REDOPS {
                if op.is_bitwise() && dtype.is_float() {
                    assert_eq!(
                        Kernel::new(dtype, op),
                        Err(DescError::BitwiseOnFloat(op.name(), dtype.name()))
                    );
                    refused += 1;
                    continue;
                }
                let kernel = Kernel::new(dtype, op).unwrap();
                checked += 1;
                for nranks in [1usize, 3, 4] {
                    let inputs: Vec<Vec<u8>> = (0..nranks)
                        .map(|r| {
                            to_bytes(
                                dtype,
                                &(0..n).map(|i| value(dtype, op, r, i)).collect::<Vec<_>>(),
                            )
                        })
                        .collect();
                    // Out-of-place to two outputs, and in-place into input 0.
                    let mut out1 = vec![0u8; n * usize_of(dtype.size())];
                    let mut out2 = vec![0u8; n * usize_of(dtype.size())];
                    let mut inplace = inputs.clone();
                    let ins: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr()).collect();
                    // SAFETY: all buffers hold n elements; Vec<u8> of a multiple of the element size
                    // allocated by the global allocator is aligned enough on x86-64 (checked below).
                    unsafe {
                        reduce(
                            kernel,
                            u32::try_from(nranks).unwrap(),
                            &ins,
                            &[out1.as_mut_ptr()],
                            n,
                            false,
                        )
                    };
                    // SAFETY: as above; the streaming path must give the same bytes.
                    unsafe {
                        reduce(
                            kernel,
                            u32::try_from(nranks).unwrap(),
                            &ins,
                            &[out2.as_mut_ptr()],
                            n,
                            true,
                        )
                    };
                    let ip_ins: Vec<*const u8> = inplace.iter().map(|v| v.as_ptr()).collect();
                    let dst = inplace[0].as_mut_ptr();
                    // SAFETY: as above; the output is identical to input 0.
                    unsafe {
                        reduce(
                            kernel,
                            u32::try_from(nranks).unwrap(),
                            &ip_ins,
                            &[dst],
                            n,
                            nranks == 3,
                        )
                    };
                    assert_eq!(out1.as_ptr() as usize % 8, 0);
                    let got = from_bytes(dtype, &out1);
                    let got_ip = from_bytes(dtype, &inplace[0]);
                    assert_eq!(out1, out2);
                    for i in 0..n {
                        let vals: Vec<f64> = (0..nranks)
                            .map(|r| {
                                from_bytes(dtype, &to_bytes(dtype, &[value(dtype, op, r, i)]))[0]
                            })
                            .collect();
                        let want =
                            from_bytes(dtype, &to_bytes(dtype, &[reference(dtype, op, &vals)]))[0];
                        assert_eq!(
                            got[i], want,
                            "{dtype:?} {op:?} n={nranks} i={i} vals={vals:?}"
                        );
                        assert_eq!(got_ip[i], want, "in-place {dtype:?} {op:?} i={i}");
                    }
                }
            }
        }
        // 12 dtypes x 5 arithmetic ops + 6 integer dtypes x 3 bitwise ops; 6 floats x 3 refused.
        assert_eq!((checked, refused), (78, 18));
    }

    /// Buffers of `n` elements of `dtype` with random bits, backed by u64 so every dtype is aligned.
    fn random_words(n: usize, dtype: DType, seed: u64) -> Vec<u64> {
        let mut x = seed | 1;
        (0..(n * usize_of(dtype.size())).div_ceil(8))
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            })
            .collect()
    }

    fn bytes_of(w: &[u64], len: usize) -> Vec<u8> {
        w.iter().flat_map(|x| x.to_ne_bytes()).take(len).collect()
    }

    #[test]
    fn bitwise_ops_match_bytewise_reference() {
        // Independent of integer widths and signs: and/or/xor of integers is and/or/xor of their
        // bytes. All 64 bits random (also i64 bits that `value` cannot reach through f64).
        let n = CHUNK + 13;
        for dtype in [DType::I8, DType::U8, DType::I32, DType::I64] {
            let len = n * usize_of(dtype.size());
            for op in [RedOp::Band, RedOp::Bor, RedOp::Bxor] {
                let kernel = Kernel::new(dtype, op).unwrap();
                for nranks in [1usize, 2, 3, 5] {
                    let seed = dtype.code() as u64 * 1000 + op.code() as u64 * 10 + nranks as u64;
                    let inputs: Vec<Vec<u64>> = (0..nranks)
                        .map(|r| random_words(n, dtype, seed * 31 + r as u64))
                        .collect();
                    let in_bytes: Vec<Vec<u8>> = inputs.iter().map(|w| bytes_of(w, len)).collect();
                    let want: Vec<u8> = (0..len)
                        .map(|b| {
                            let mut it = in_bytes.iter().map(|v| v[b]);
                            let first = it.next().unwrap();
                            it.fold(first, |a, v| match op {
                                RedOp::Band => a & v,
                                RedOp::Bor => a | v,
                                _ => a ^ v,
                            })
                        })
                        .collect();
                    let ins: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr().cast()).collect();
                    for stream in [false, true] {
                        let mut out = vec![0u64; len.div_ceil(8)];
                        // SAFETY: every buffer holds n elements and is 8-byte aligned.
                        unsafe {
                            reduce(
                                kernel,
                                u32::try_from(nranks).unwrap(),
                                &ins,
                                &[out.as_mut_ptr().cast()],
                                n,
                                stream,
                            )
                        };
                        assert_eq!(
                            bytes_of(&out, len),
                            want,
                            "{dtype:?} {op:?} nranks={nranks} stream={stream}"
                        );
                    }
                    // In place into the last input.
                    let mut inplace = inputs.clone();
                    let ip: Vec<*const u8> = inplace.iter().map(|v| v.as_ptr().cast()).collect();
                    let dst = inplace[nranks - 1].as_mut_ptr().cast::<u8>();
                    // SAFETY: as above; the output is identical to an input.
                    unsafe {
                        reduce(
                            kernel,
                            u32::try_from(nranks).unwrap(),
                            &ip,
                            &[dst],
                            n,
                            false,
                        )
                    };
                    assert_eq!(bytes_of(&inplace[nranks - 1], len), want, "in-place");
                }
            }
        }
    }

    #[test]
    fn bitwise_ops_known_answers() {
        fn run<T: Copy + Default>(dtype: DType, op: RedOp, vals: &[T]) -> T {
            let ptrs: Vec<*const u8> = vals.iter().map(|v| (v as *const T).cast()).collect();
            let mut out = T::default();
            // SAFETY: one aligned element in each input and in the output.
            unsafe {
                reduce(
                    Kernel::new(dtype, op).unwrap(),
                    u32::try_from(vals.len()).unwrap(),
                    &ptrs,
                    &[(&mut out as *mut T).cast()],
                    1,
                    false,
                )
            };
            out
        }
        assert_eq!(run(DType::I8, RedOp::Band, &[-1i8, 0x0f, 0x3c]), 0x0c);
        assert_eq!(run(DType::I8, RedOp::Bor, &[i8::MIN, 1]), -127);
        assert_eq!(run(DType::U8, RedOp::Bor, &[0x81u8, 0x42]), 0xc3);
        assert_eq!(run(DType::U8, RedOp::Bxor, &[0xffu8, 0x0f, 0x01]), 0xf1);
        assert_eq!(run(DType::I32, RedOp::Bxor, &[7i32, 7, 7]), 7);
        assert_eq!(run(DType::I32, RedOp::Band, &[-2i32, 3]), 2);
        assert_eq!(run(DType::I64, RedOp::Bxor, &[i64::MIN, -1]), i64::MAX);
        assert_eq!(
            run(DType::I64, RedOp::Bor, &[1i64 << 62, 1 << 33, 5]),
            (1 << 62) | (1 << 33) | 5
        );
    }

    #[test]
    fn integer_avg_is_the_exact_mean() {
        fn run<T: Copy + Default>(dtype: DType, vals: &[T]) -> T {
            let ptrs: Vec<*const u8> = vals.iter().map(|v| (v as *const T).cast()).collect();
            let mut out = T::default();
            // SAFETY: one aligned element in each input and in the output.
            unsafe {
                reduce(
                    Kernel::new(dtype, RedOp::Avg).unwrap(),
                    u32::try_from(vals.len()).unwrap(),
                    &ptrs,
                    &[(&mut out as *mut T).cast()],
                    1,
                    false,
                )
            };
            out
        }
        // A wrapping sum would give (100 + 39) as i8 = -117, / 2 = -58.
        assert_eq!(run(DType::I8, &[100i8, 39]), 69);
        assert_eq!(run(DType::I8, &[-128i8, -128, -127]), -127);
        assert_eq!(run(DType::U8, &[255u8, 255, 254]), 254);
        assert_eq!(run(DType::I32, &[i32::MAX, i32::MAX - 2]), i32::MAX - 1);
        assert_eq!(run(DType::I64, &[i64::MIN, i64::MIN + 1]), i64::MIN + 1); // -(2^63 - 0.5) truncates toward zero
        // Truncation toward zero, like C and torch's rounding_mode="trunc".
        assert_eq!(run(DType::I32, &[-3i32, 0]), -1);
    }

    #[test]
    fn bitwise_ops_are_refused_for_float_dtypes() {
        for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            for op in [RedOp::Band, RedOp::Bor, RedOp::Bxor] {
                let e = Kernel::new(dtype, op).unwrap_err();
                assert_eq!(
                    e.to_string(),
                    format!(
                        "bitwise reduction {} is defined for integer dtypes only (got {})",
                        op.name(),
                        dtype.name()
                    )
                );
            }
            assert!(Kernel::new(dtype, RedOp::Sum).is_ok());
        }
    }

    #[test]
    fn half_precision_accumulates_in_f32() {
        // 2048 + 1 + 1 + ... in f16 would stall at 2048; accumulating in f32 gives 2052.
        let vals = [2048.0f64, 1.0, 1.0, 1.0, 1.0];
        let ins: Vec<Vec<u8>> = vals.iter().map(|v| to_bytes(DType::F16, &[*v])).collect();
        let ptrs: Vec<*const u8> = ins.iter().map(|v| v.as_ptr()).collect();
        let mut out = vec![0u8; 2];
        // SAFETY: one element in each buffer.
        unsafe {
            reduce(
                Kernel::new(DType::F16, RedOp::Sum).unwrap(),
                5,
                &ptrs,
                &[out.as_mut_ptr()],
                1,
                false,
            )
        };
        assert_eq!(from_bytes(DType::F16, &out)[0], 2052.0);
    }

    /// A reduction split into chained steps (as across nodes: ranks 0..2, then 2..3, then 3..5)
    /// produces exactly the bytes of the single-step reduction, for every dtype and op, on data
    /// where the order of rounding matters.
    #[test]
    fn chained_steps_are_bitwise_identical_to_one_reduction() {
        let n = CHUNK + 77;
        let ranks = 5usize;
        let mut state = 0x1234_5678_9abc_def0u64;
        let mut rnd = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for &dtype in ALL_DTYPES.iter() {
            for &op in ALL_REDOPS.iter() {
                let Ok(k) = Kernel::new(dtype, op) else {
                    continue;
                };
                let es = usize_of(dtype.size());
                let inputs: Vec<Vec<u8>> = (0..ranks)
                    .map(|_| {
                        let vals: Vec<f64> = (0..n)
                            .map(|_| {
                                let r = rnd();
                                if dtype.is_float() {
                                    (r % 100_000) as f64 / 7.3 - 6000.0
                                } else {
                                    (r % 200) as f64 - 100.0
                                }
                            })
                            .collect();
                        to_bytes(dtype, &vals)
                    })
                    .collect();
                let ptrs: Vec<*const u8> = inputs.iter().map(|v| v.as_ptr()).collect();
                let mut want = vec![0u8; n * es];
                // SAFETY: every buffer holds n elements; outputs are distinct from the inputs.
                unsafe {
                    reduce(
                        k,
                        u32::try_from(ranks).unwrap(),
                        &ptrs,
                        &[want.as_mut_ptr()],
                        n,
                        false,
                    )
                };
                let acc = k.acc_size();
                let mut a1 = vec![0u8; n * acc];
                let mut a2 = vec![0u8; n * acc];
                let mut got = vec![0u8; n * es];
                let start = Chain {
                    acc_in: std::ptr::null(),
                    acc_out: a1.as_mut_ptr(),
                };
                let mid = Chain {
                    acc_in: a1.as_ptr(),
                    acc_out: a2.as_mut_ptr(),
                };
                let end = Chain {
                    acc_in: a2.as_ptr(),
                    acc_out: std::ptr::null_mut(),
                };
                // SAFETY: as above; accumulator buffers hold n accumulators each.
                unsafe {
                    reduce_chain(
                        k,
                        u32::try_from(ranks).unwrap(),
                        start,
                        &ptrs[0..2],
                        &[],
                        n,
                        false,
                    );
                    reduce_chain(
                        k,
                        u32::try_from(ranks).unwrap(),
                        mid,
                        &ptrs[2..3],
                        &[],
                        n,
                        false,
                    );
                    reduce_chain(
                        k,
                        u32::try_from(ranks).unwrap(),
                        end,
                        &ptrs[3..5],
                        &[got.as_mut_ptr()],
                        n,
                        true,
                    );
                }
                assert!(got == want, "{dtype:?} {op:?}: chained result differs");
            }
        }
    }
}
