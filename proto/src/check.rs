//! Deterministic test data and reference results for `commd bench` and the test client.
//!
//! Values are small integers (exact in every dtype, bf16 included) generated from
//! `(seed, rank, index)`, except for the bitwise ops, which get full-width bit patterns (i64 within
//! 53 bits, so f64 holds them exactly); the reference reduces them independently of the daemon's
//! kernels (f64 / wrapping i128 arithmetic, one element at a time) so a check can fail.

use crate::desc::{DType, OpKind, RedOp};
use crate::fp8;
use crate::num::usize_of;
use half::{bf16, f16};

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The input value of `rank` at element `i`.
pub fn value(dtype: DType, redop: Option<RedOp>, seed: u64, rank: u32, i: u64) -> f64 {
    let h = mix(seed ^ (u64::from(rank) << 44) ^ i);
    let unsigned = dtype.is_unsigned();
    match redop {
        Some(r) if r.is_bitwise() => bit_pattern(dtype, h),
        Some(RedOp::Prod) => {
            [1.0f64, 2.0, 1.0, -1.0][usize_of(h % 4)].max(if unsigned { 1.0 } else { -1.0 })
        }
        Some(RedOp::Min | RedOp::Max) if !unsigned => (h % 17) as f64 - 8.0,
        _ if unsigned => (h % 9) as f64,
        _ => (h % 9) as f64 - 4.0,
    }
}

/// A full-width value of `dtype` taken from the hash `h`, for the bitwise ops.
// Truncation and wrap are the point: the low bits of the hash, reinterpreted in the dtype's
// width; i64 keeps 53 bits (an arithmetic shift) so that f64 holds it exactly.
#[allow(clippy::cast_possible_truncation, clippy::cast_possible_wrap)]
fn bit_pattern(dtype: DType, h: u64) -> f64 {
    match dtype {
        DType::I8 => f64::from(h as i8),
        DType::U8 => f64::from(h as u8),
        DType::I32 => f64::from(h as i32),
        DType::I64 => ((h as i64) >> 11) as f64,
        DType::U32 => f64::from(h as u32),
        DType::U64 => (h >> 11) as f64,
        // The daemon refuses bitwise ops on floats; any exact small value will do.
        _ => (h % 9) as f64 - 4.0,
    }
}

/// Writes `v` as element `i` of `buf` in `dtype`. `v` is a value of [`value`] or
/// [`reduce_ref`]: an integer exact in the dtype, or for floats one it rounds exactly.
// The `as` from f64 is exact for those values (saturating outside the dtype's range).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
pub fn write_elem(dtype: DType, buf: &mut [u8], i: usize, v: f64) {
    let s = usize_of(dtype.size());
    let b = &mut buf[i * s..(i + 1) * s];
    match dtype {
        DType::F32 => b.copy_from_slice(&(v as f32).to_ne_bytes()),
        DType::F64 => b.copy_from_slice(&v.to_ne_bytes()),
        DType::F16 => b.copy_from_slice(&f16::from_f64(v).to_ne_bytes()),
        DType::BF16 => b.copy_from_slice(&bf16::from_f64(v).to_ne_bytes()),
        DType::I8 => b.copy_from_slice(&(v as i8).to_ne_bytes()),
        DType::U8 => b.copy_from_slice(&(v as u8).to_ne_bytes()),
        DType::I32 => b.copy_from_slice(&(v as i32).to_ne_bytes()),
        DType::I64 => b.copy_from_slice(&(v as i64).to_ne_bytes()),
        DType::U32 => b.copy_from_slice(&(v as u32).to_ne_bytes()),
        DType::U64 => b.copy_from_slice(&(v as u64).to_ne_bytes()),
        DType::F8E4M3 => b[0] = fp8::E4M3.encode(v as f32),
        DType::F8E5M2 => b[0] = fp8::E5M2.encode(v as f32),
    }
}

pub fn read_elem(dtype: DType, buf: &[u8], i: usize) -> f64 {
    let s = usize_of(dtype.size());
    let b = &buf[i * s..(i + 1) * s];
    match dtype {
        DType::F32 => f32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::F64 => f64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
        DType::F16 => f16::from_ne_bytes([b[0], b[1]]).to_f64(),
        DType::BF16 => bf16::from_ne_bytes([b[0], b[1]]).to_f64(),
        DType::I8 => i8::from_ne_bytes([b[0]]) as f64,
        DType::U8 => b[0] as f64,
        DType::I32 => i32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as f64,
        DType::I64 => i64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f64,
        DType::U32 => f64::from(u32::from_ne_bytes([b[0], b[1], b[2], b[3]])),
        DType::U64 => u64::from_ne_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f64,
        DType::F8E4M3 => f64::from(fp8::E4M3.decode(b[0])),
        DType::F8E5M2 => f64::from(fp8::E5M2.decode(b[0])),
    }
}

/// Fills `buf` (the send buffer of `rank`, `elems` elements) with its deterministic values.
pub fn fill(dtype: DType, redop: Option<RedOp>, seed: u64, rank: u32, buf: &mut [u8], elems: u64) {
    for i in 0..elems {
        write_elem(dtype, buf, usize_of(i), value(dtype, redop, seed, rank, i));
    }
}

fn wrap_int(dtype: DType, x: i128) -> i128 {
    let bits = dtype.size() * 8;
    let m = 1i128 << bits;
    let mut y = x.rem_euclid(m);
    if !dtype.is_unsigned() && y >= m / 2 {
        y -= m;
    }
    y
}

/// Reference reduction of `vals` as the daemon defines it. A bitwise op on a float dtype has no
/// result (the daemon refuses it): NaN, which no received value is [`close`] to.
// The integer values (from `value` or read back from a buffer) are integers exact in f64 within
// the dtype's range, so the `as i128` casts are exact.
#[allow(clippy::cast_possible_truncation)]
pub fn reduce_ref(dtype: DType, op: RedOp, vals: impl Iterator<Item = f64>, n: u32) -> f64 {
    if dtype.is_float() && op.is_bitwise() {
        return f64::NAN;
    }
    if dtype.is_float() {
        let mut acc: Option<f64> = None;
        for v in vals {
            acc = Some(match (acc, op) {
                (None, _) => v,
                (Some(a), RedOp::Sum | RedOp::Avg) => a + v,
                (Some(a), RedOp::Prod) => a * v,
                (Some(a), RedOp::Min) => a.min(v),
                (Some(a), RedOp::Max) => a.max(v),
                (Some(_), RedOp::Band | RedOp::Bor | RedOp::Bxor) => f64::NAN,
            });
        }
        let a = acc.unwrap_or(0.0);
        let a = if op == RedOp::Avg {
            a / f64::from(n)
        } else {
            a
        };
        // fp8 results are the exact result rounded once (the daemon accumulates in f32, exact
        // for these small values) and saturated, as the dtype stores it.
        let mut b = [0u8; 1];
        match dtype {
            DType::F8E4M3 | DType::F8E5M2 => {
                write_elem(dtype, &mut b, 0, a);
                read_elem(dtype, &b, 0)
            }
            _ => a,
        }
    } else {
        let mut acc: Option<i128> = None;
        for v in vals {
            let v = v as i128;
            acc = Some(wrap_int(
                dtype,
                match (acc, op) {
                    (None, _) => v,
                    (Some(a), RedOp::Sum | RedOp::Avg) => a + v,
                    (Some(a), RedOp::Prod) => a * v,
                    (Some(a), RedOp::Min) => a.min(v),
                    (Some(a), RedOp::Max) => a.max(v),
                    // Sign-extended in i128, the low bits are the narrow result; wrap_int
                    // restores the sign (and the range of u8).
                    (Some(a), RedOp::Band) => a & v,
                    (Some(a), RedOp::Bor) => a | v,
                    (Some(a), RedOp::Bxor) => a ^ v,
                },
            ));
        }
        let a = acc.unwrap_or(0);
        // Integer AVG: NCCL's definition, the sum wrapped in the dtype, then divided toward zero.
        (if op == RedOp::Avg {
            a / i128::from(n.max(1))
        } else {
            a
        }) as f64
    }
}

/// Whether `got` matches `want` within the dtype's tolerance (exact for integers).
pub fn close(dtype: DType, got: f64, want: f64) -> bool {
    let tol = match dtype {
        DType::F16 | DType::BF16 => 1e-2,
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        _ => 0.0,
    };
    got == want || (got - want).abs() <= tol * want.abs().max(1.0)
}

/// What one rank's op looks like, for checking its receive buffer.
#[derive(Clone, Copy, Debug)]
pub struct OpSpec {
    pub kind: OpKind,
    pub dtype: DType,
    pub redop: Option<RedOp>,
    pub count: u64,
    /// Root (broadcast, reduce) or peer (send, recv).
    pub peer: u32,
    pub nranks: u32,
    pub rank: u32,
    pub seed: u64,
}

impl OpSpec {
    /// Elements this rank's receive buffer holds after the op (0 if it receives nothing).
    pub fn recv_elems(&self) -> u64 {
        if !self.kind.uses_recv(self.peer == self.rank) {
            return 0;
        }
        self.kind
            .recv_elems(self.count, u64::from(self.nranks))
            .unwrap_or(0)
    }

    pub fn send_elems(&self) -> u64 {
        if !self.kind.uses_send(self.peer == self.rank) {
            return 0;
        }
        self.kind
            .send_elems(self.count, u64::from(self.nranks))
            .unwrap_or(0)
    }

    /// Expected value at element `j` of this rank's receive buffer (`j < recv_elems()`).
    pub fn expected(&self, j: u64) -> f64 {
        let (d, r, s, n, c) = (self.dtype, self.redop, self.seed, self.nranks, self.count);
        let v = |rank: u32, i: u64| value(d, r, s, rank, i);
        let red = |i: u64| reduce_ref(d, r.unwrap_or(RedOp::Sum), (0..n).map(|k| v(k, i)), n);
        // The source rank's value for element `j` of a gathered buffer: `j / count` is below
        // nranks for `j < recv_elems()`; beyond a u32 it is no rank (NaN, never `close`).
        let from = |j: u64, i: u64| u32::try_from(j / c).map_or(f64::NAN, |k| v(k, i));
        match self.kind {
            OpKind::AllReduce | OpKind::Reduce => red(j),
            OpKind::ReduceScatter => red(u64::from(self.rank) * c + j),
            OpKind::AllGather => from(j, j % c),
            OpKind::Broadcast => v(self.peer, j),
            OpKind::AllToAll => from(j, u64::from(self.rank) * c + j % c),
            OpKind::Recv => v(self.peer, j),
            OpKind::Send | OpKind::Barrier => 0.0,
        }
    }

    /// Number of wrong elements in `recv` (the first `recv_elems()` elements are checked).
    pub fn count_wrong(&self, recv: &[u8]) -> u64 {
        self.count_wrong_strided(recv, 1)
    }

    /// Like [`count_wrong`](Self::count_wrong), checking every `stride`-th element and the last
    /// 1000 (for huge buffers).
    pub fn count_wrong_strided(&self, recv: &[u8], stride: u64) -> u64 {
        let n = self.recv_elems();
        let stride = stride.max(1);
        let tail_from = if stride == 1 {
            n
        } else {
            n.saturating_sub(1000)
        };
        let idx = (0..n)
            .step_by(usize_of(stride))
            .chain((tail_from..n).filter(|j| j % stride != 0));
        idx.filter(|&j| {
            !close(
                self.dtype,
                read_elem(self.dtype, recv, usize_of(j)),
                self.expected(j),
            )
        })
        .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_wraps_integers_and_checks_fail_on_wrong_data() {
        assert_eq!(
            reduce_ref(DType::I8, RedOp::Sum, [100.0, 100.0].into_iter(), 2),
            -56.0
        );
        assert_eq!(
            reduce_ref(DType::U8, RedOp::Prod, [16.0, 32.0].into_iter(), 2),
            0.0
        );
        assert_eq!(
            reduce_ref(DType::I32, RedOp::Avg, [3.0, 4.0].into_iter(), 2),
            3.0
        );
        // The sum wraps in the dtype before it is divided (NCCL's definition).
        assert_eq!(
            reduce_ref(DType::I8, RedOp::Avg, [100.0, 39.0].into_iter(), 2),
            -58.0
        );
        assert_eq!(
            reduce_ref(DType::F32, RedOp::Avg, [3.0, 4.0].into_iter(), 2),
            3.5
        );
        assert_eq!(
            reduce_ref(DType::I8, RedOp::Band, [-1.0, 12.0, -4.0].into_iter(), 3),
            12.0 // 0xff & 0x0c & 0xfc
        );
        assert_eq!(
            reduce_ref(DType::I8, RedOp::Bor, [-128.0, 1.0].into_iter(), 2),
            -127.0
        );
        assert_eq!(
            reduce_ref(DType::U8, RedOp::Bxor, [255.0, 15.0, 1.0].into_iter(), 3),
            241.0
        );
        assert_eq!(
            reduce_ref(
                DType::I64,
                RedOp::Bxor,
                [(1u64 << 52) as f64, -1.0].into_iter(),
                2
            ),
            -(1i64 << 52) as f64 - 1.0 // 2^52 ^ -1 = !(2^52)
        );
        assert!(reduce_ref(DType::F32, RedOp::Bxor, [1.0, 2.0].into_iter(), 2).is_nan());
        assert!(!close(DType::F32, 3.0, f64::NAN));
        let spec = OpSpec {
            kind: OpKind::Broadcast,
            dtype: DType::F32,
            redop: None,
            count: 10,
            peer: 0,
            nranks: 2,
            rank: 1,
            seed: 5,
        };
        let mut buf = vec![0u8; 40];
        fill(DType::F32, None, 5, 0, &mut buf, 10);
        assert_eq!(spec.count_wrong(&buf), 0);
        write_elem(DType::F32, &mut buf, 3, 1000.0);
        assert_eq!(spec.count_wrong(&buf), 1);
    }

    #[test]
    // The I32 values are integers in i32's range: the `as i32` from f64 is exact.
    #[allow(clippy::cast_possible_truncation)]
    fn bitwise_ops_get_full_width_values_and_checks_fail_on_wrong_bits() {
        for (dtype, lo, hi) in [
            (DType::I8, -128.0, 127.0),
            (DType::U8, 0.0, 255.0),
            (DType::I32, i32::MIN as f64, i32::MAX as f64),
            (DType::I64, -(2f64.powi(52)), 2f64.powi(52) - 1.0),
        ] {
            let vals: Vec<f64> = (0..4000)
                .map(|i| value(dtype, Some(RedOp::Bxor), 3, 1, i))
                .collect();
            assert!(
                vals.iter()
                    .all(|v| (lo..=hi).contains(v) && v.fract() == 0.0)
            );
            // Both signs and the top of the range are reached: the high bits are exercised.
            assert!(vals.iter().any(|v| *v < (lo + hi) / 2.0 - (hi - lo) / 4.0));
            assert!(vals.iter().any(|v| *v > (lo + hi) / 2.0 + (hi - lo) / 4.0));
        }
        let spec = OpSpec {
            kind: OpKind::AllReduce,
            dtype: DType::I32,
            redop: Some(RedOp::Bor),
            count: 50,
            peer: 0,
            nranks: 3,
            rank: 0,
            seed: 11,
        };
        let mut buf = vec![0u8; 200];
        for j in 0..50 {
            let want = (0..3)
                .map(|r| value(DType::I32, Some(RedOp::Bor), 11, r, j) as i32)
                .fold(0, |a, v| a | v);
            write_elem(DType::I32, &mut buf, usize_of(j), f64::from(want));
        }
        assert_eq!(spec.count_wrong(&buf), 0);
        let e = read_elem(DType::I32, &buf, 7) as i32;
        write_elem(DType::I32, &mut buf, 7, f64::from(e ^ (1 << 30)));
        assert_eq!(spec.count_wrong(&buf), 1);
        // A float "result" of a bitwise op never checks out.
        let fspec = OpSpec {
            dtype: DType::F32,
            ..spec
        };
        assert_eq!(fspec.count_wrong(&[0u8; 200]), 50);
    }

    #[test]
    fn strided_check_covers_stride_and_tail() {
        let spec = OpSpec {
            kind: OpKind::Broadcast,
            dtype: DType::I32,
            redop: None,
            count: 3000,
            peer: 0,
            nranks: 2,
            rank: 1,
            seed: 9,
        };
        let mut buf = vec![0u8; 3000 * 4];
        fill(DType::I32, None, 9, 0, &mut buf, 3000);
        write_elem(DType::I32, &mut buf, 1001, 1e6); // skipped by stride 2, outside the tail
        assert_eq!(spec.count_wrong_strided(&buf, 2), 0);
        assert_eq!(spec.count_wrong(&buf), 1);
        write_elem(DType::I32, &mut buf, 1002, 1e6); // on the stride
        write_elem(DType::I32, &mut buf, 2501, 1e6); // in the tail
        assert_eq!(spec.count_wrong_strided(&buf, 2), 2);
        assert_eq!(spec.count_wrong(&buf), 3);
    }
}
