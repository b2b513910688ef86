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
            // NCCL's definition: the wrapped sum, divided truncating toward zero (an unsigned
            // dtype's wrapped value is non-negative, so it divides unsigned).
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
                        .map(|r| from_bytes(dtype, &to_bytes(dtype, &[value(dtype, op, r, i)]))[0])
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
fn integer_avg_divides_the_wrapped_sum_as_nccl_does() {
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
    // (100 + 39) wraps to -117 in i8; -117 / 2 = -58 (the exact mean would be 69).
    assert_eq!(run(DType::I8, &[100i8, 39]), -58);
    // -383 wraps to -127; / 3 = -42.
    assert_eq!(run(DType::I8, &[-128i8, -128, -127]), -42);
    // 764 wraps to 252; / 3 = 84.
    assert_eq!(run(DType::U8, &[255u8, 255, 254]), 84);
    // 2^32 - 4 wraps to -4; / 2 = -2.
    assert_eq!(run(DType::I32, &[i32::MAX, i32::MAX - 2]), -2);
    // -2^64 + 1 wraps to 1; / 2 = 0.
    assert_eq!(run(DType::I64, &[i64::MIN, i64::MIN + 1]), 0);
    // Unsigned divides unsigned: u64::MAX / 2, not -1 / 2.
    assert_eq!(run(DType::U64, &[u64::MAX, 0]), u64::MAX / 2);
    assert_eq!(run(DType::U32, &[u32::MAX, 1]), 0);
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
