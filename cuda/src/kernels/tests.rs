//! Tests of the reduction kernels: NVRTC compilation of every kernel (no GPU needed), argument
//! checks, and on a GPU every kernel against the host reference, bit for bit.

#![allow(unsafe_code)] // tests launch kernels on raw device memory

use super::nvrtc::nvrtc_present;
use super::*;
use commd_proto::check;
use commd_proto::desc::{ALL_DTYPES, ALL_REDOPS};
use commd_proto::fp8;
use commd_proto::num::usize_of;
use half::{bf16, f16};
use std::fmt::Write as _;

fn env_is_1(name: &str) -> bool {
    commd_settings::by_name(name).as_deref() == Some("1")
}

fn valid_pairs() -> Vec<(DType, RedOp)> {
    ALL_DTYPES
        .iter()
        .flat_map(|&d| ALL_REDOPS.iter().map(move |&op| (d, op)))
        .filter(|&(d, op)| op.check_dtype(d).is_ok())
        .collect()
}

/// Whether the PTX has a 16-byte `ld` or `st` (4 x 32 or 2 x 64 bits) to global memory.
fn moves_16_bytes(ptx: &str, what: &str) -> bool {
    let v4 = format!("{what}.global.v4.");
    let v2 = format!("{what}.global.v2.");
    ptx.lines().any(|l| {
        l.contains(&v4) || (l.contains(&v2) && ["64 ", "64\t"].iter().any(|t| l.contains(t)))
    })
}

#[test]
fn every_kernel_compiles_with_nvrtc() {
    if !nvrtc_present() {
        assert!(
            !env_is_1("COMMD_REQUIRE_NVRTC"),
            "COMMD_REQUIRE_NVRTC=1: {}",
            KernelError::NvrtcMissing
        );
        eprintln!(
            "skip every_kernel_compiles_with_nvrtc: {}",
            KernelError::NvrtcMissing
        );
        return;
    }
    let version = nvrtc_version().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("NVRTC {}.{}", version.0, version.1);
    let pairs = valid_pairs();
    assert_eq!(pairs.len(), 12 * 5 + 6 * 3);
    for (d, op) in pairs {
        for arch in [(9, 0), (8, 0)] {
            let ptx = compile_ptx(d, op, arch).unwrap_or_else(|e| panic!("{e}"));
            assert!(
                ptx.contains(&format!(".entry {}(", kernel_name(d, op))),
                "{d:?} {op:?}: no entry point in the PTX"
            );
            assert!(ptx.contains(&format!(".target sm_{}{}", arch.0, arch.1)));
            for name in [super::P2P_SEND, super::P2P_RECV] {
                assert_eq!(
                    ptx.contains(&format!(".entry {name}(")),
                    op == RedOp::Sum,
                    "{d:?} {op:?}: {name}"
                );
            }
            // The aligned path moves 16 bytes per load and store.
            assert!(
                moves_16_bytes(&ptx, "ld"),
                "{d:?} {op:?}: no 16-byte loads in the PTX"
            );
            assert!(
                moves_16_bytes(&ptx, "st"),
                "{d:?} {op:?}: no 16-byte stores in the PTX"
            );
        }
        // The direct all-reduce kernel (docs/contracts.md #7) is in the same module, with its
        // acquire/release flag accesses at system scope.
        let ptx = compile_ptx(d, op, (9, 0)).unwrap_or_else(|e| panic!("{e}"));
        assert!(
            ptx.contains(&format!(".entry {}(", direct_kernel_name(d, op))),
            "{d:?} {op:?}: no direct kernel in the PTX"
        );
        assert!(ptx.contains("ld.acquire.sys") && ptx.contains("st.release.sys"));
        // Its parameter (`struct commd_direct`) is as large as the host's `DirectArgs`: the
        // two layouts agree in size (their fields are in the same order).
        let param = format!(
            "{}_param_0[{}]",
            direct_kernel_name(d, op),
            std::mem::size_of::<DirectArgs>()
        );
        assert!(ptx.contains(&param), "{d:?} {op:?}: no {param} in the PTX");
        // Sum modules carry the scale kernel (NCCL's PreMulSum in the NCCL library).
        assert_eq!(
            ptx.contains(&format!(".entry {}(", scale_kernel_name(d))),
            op == RedOp::Sum,
            "{d:?} {op:?}: scale kernel"
        );
        // The run-time path: SASS for the device's exact architecture.
        let cubin = compile_cubin(d, op, (9, 0)).unwrap_or_else(|e| panic!("{e}"));
        assert!(cubin.starts_with(b"\x7fELF"), "{d:?} {op:?}: not a CUBIN");
    }
}

#[test]
fn direct_launch_refuses_bad_rank_counts_before_cuda() {
    let k = Kernels::new();
    // (0, 2) with a unit of 0: blocks that take no ticket would never advance the epoch.
    // (0, 2, 1, 9): a mode past the last one.
    for (me, n, unit, mode) in [
        (0, 1, 1, 0),
        (0, 9, 1, 0),
        (2, 2, 1, 0),
        (0, 2, 0, 0),
        (0, 2, 1, 9),
    ] {
        let a = DirectArgs {
            me,
            n,
            unit,
            mode,
            ..DirectArgs::default()
        };
        // SAFETY: refused before any pointer is used or CUDA is called.
        let r = unsafe { k.launch_direct(std::ptr::null_mut(), DType::F32, RedOp::Sum, 1, &a) };
        assert!(
            matches!(r, Err(KernelError::InvalidArgument(_))),
            "{me} of {n}"
        );
    }
}

#[test]
fn invalid_combinations_are_errors_not_panics() {
    for d in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for op in [RedOp::Band, RedOp::Bor, RedOp::Bxor] {
            let e = source(d, op).unwrap_err();
            assert!(matches!(e, KernelError::Unsupported(_)), "{e}");
            assert!(e.to_string().contains("integer dtypes only"), "{e}");
            assert!(compile_ptx(d, op, (9, 0)).is_err());
            let k = Kernels::new();
            assert!(k.prepare(d, op).is_err());
            // SAFETY: the op is refused before any pointer is used or CUDA is called.
            let r = unsafe { k.launch(std::ptr::null_mut(), d, op, 0, &[0], 1, 1) };
            assert!(matches!(r, Err(KernelError::Unsupported(_))));
        }
    }
    let k = Kernels::new();
    let (d, op) = (DType::F32, RedOp::Sum);
    // SAFETY: each call is refused (or launches nothing) before any pointer is used.
    unsafe {
        assert!(matches!(
            k.launch(std::ptr::null_mut(), d, op, 0, &[], 1, 1),
            Err(KernelError::InvalidArgument(_))
        ));
        assert!(matches!(
            k.launch(std::ptr::null_mut(), d, op, 0, &[0; 9], 1, 1),
            Err(KernelError::InvalidArgument(_))
        ));
        assert!(matches!(
            k.launch(std::ptr::null_mut(), d, RedOp::Avg, 0, &[0], 1, 0),
            Err(KernelError::InvalidArgument(_))
        ));
        k.launch(std::ptr::null_mut(), d, op, 0, &[0, 0], 0, 2)
            .expect("count 0 launches nothing");
    }
}

#[test]
fn source_is_self_contained_and_named_stably() {
    assert_eq!(
        kernel_name(DType::BF16, RedOp::Sum),
        "commd_reduce_bf16_sum"
    );
    for (d, op) in valid_pairs() {
        let src = source(d, op).unwrap();
        assert!(!src.contains("#include"), "{d:?} {op:?} includes a header");
        assert!(src.contains(&format!(
            "extern \"C\" __global__ void __launch_bounds__(256) {}(",
            kernel_name(d, op)
        )));
        assert!(
            !src.contains("__int128"),
            "{d:?} {op:?} needs no 128-bit integers"
        );
        assert!(src.contains(&format!(
            "extern \"C\" __global__ void __launch_bounds__(256) {}(struct commd_rounds a)",
            rounds_kernel_name(d, op)
        )));
    }
    assert_eq!(
        rounds_kernel_name(DType::F16, RedOp::Max),
        "commd_rounds_f16_max"
    );
}

#[test]
fn rounds_launch_refuses_bad_arguments_before_cuda() {
    let k = Kernels::new();
    let ok = RoundsArgs {
        n: 2,
        rank: 1,
        rounds: 2,
        divisor: 2,
        ready: 8,
        done: 16,
        bar: 24,
        ..RoundsArgs::default()
    };
    let cases = [
        (
            "no ranks",
            RoundsArgs {
                n: 0,
                rank: 0,
                ..ok
            },
        ),
        ("9 ranks", RoundsArgs { n: 9, ..ok }),
        ("rank out of range", RoundsArgs { rank: 2, ..ok }),
        ("no barrier", RoundsArgs { bar: 0, ..ok }),
        ("no done word", RoundsArgs { done: 0, ..ok }),
    ];
    for (what, a) in cases {
        // SAFETY: refused before any pointer is used or CUDA is called.
        let r =
            unsafe { k.launch_rounds(std::ptr::null_mut(), DType::F32, RedOp::Sum, 0, true, &a) };
        assert!(matches!(r, Err(KernelError::InvalidArgument(_))), "{what}");
    }
    let avg0 = RoundsArgs { divisor: 0, ..ok };
    // SAFETY: as above.
    let r =
        unsafe { k.launch_rounds(std::ptr::null_mut(), DType::F32, RedOp::Avg, 0, true, &avg0) };
    assert!(matches!(r, Err(KernelError::InvalidArgument(_))));
}

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn kernels_are_shareable_across_threads() {
    assert_send_sync::<Kernels>();
}

// ---- host reference with the daemon's semantics (daemon/src/engine/reduce.rs) ----

fn float_red<T>(op: RedOp, vals: impl Iterator<Item = T>, div: T) -> T
where
    T: Copy
        + PartialOrd
        + std::ops::Add<Output = T>
        + std::ops::Mul<Output = T>
        + std::ops::Div<Output = T>,
{
    let mut it = vals;
    let Some(mut a) = it.next() else {
        unreachable!("at least one input")
    };
    for b in it {
        a = match op {
            RedOp::Sum | RedOp::Avg => a + b,
            RedOp::Prod => a * b,
            RedOp::Min => {
                if b < a {
                    b
                } else {
                    a
                }
            }
            RedOp::Max => {
                if b > a {
                    b
                } else {
                    a
                }
            }
            RedOp::Band | RedOp::Bor | RedOp::Bxor => unreachable!("bitwise on a float"),
        };
    }
    if op == RedOp::Avg { a / div } else { a }
}

/// `x` wrapped to the range of `d`, as the GPU's integer arithmetic wraps.
// Truncation and wrap are the point: the low bits of `x`, reinterpreted in the dtype.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn wrap(d: DType, x: i128) -> i128 {
    match d {
        DType::I8 => i128::from(x as i8),
        DType::U8 => i128::from(x as u8),
        DType::I32 => i128::from(x as i32),
        DType::U32 => i128::from(x as u32),
        DType::U64 => i128::from(x as u64),
        _ => i128::from(x as i64),
    }
}

fn int_red(d: DType, op: RedOp, vals: impl Iterator<Item = i128>, div: u32) -> i128 {
    let mut it = vals;
    let Some(mut a) = it.next() else {
        unreachable!("at least one input")
    };
    for b in it {
        a = match op {
            // AVG divides the wrapped sum (NCCL's definition).
            RedOp::Sum | RedOp::Avg => wrap(d, a + b),
            RedOp::Prod => wrap(d, a * b),
            RedOp::Min => a.min(b),
            RedOp::Max => a.max(b),
            RedOp::Band => wrap(d, a & b),
            RedOp::Bor => wrap(d, a | b),
            RedOp::Bxor => wrap(d, a ^ b),
        };
    }
    // i128 division truncates toward zero, of a wrapped (for unsigned dtypes non-negative)
    // value; the store truncates to the dtype (`as`).
    if op == RedOp::Avg {
        wrap(d, a / i128::from(div))
    } else {
        a
    }
}

/// The expected output bytes for element-wise inputs `ins` (each `count` elements).
// The integer stores truncate to the dtype as the kernels' stores do (int_red has wrapped the
// value already).
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn reference(d: DType, op: RedOp, ins: &[Vec<u8>], count: usize, div: u32) -> Vec<u8> {
    let s = usize_of(d.size());
    let mut out = vec![0u8; count * s];
    for i in 0..count {
        let e = |k: usize| &ins[k][i * s..(i + 1) * s];
        let o = &mut out[i * s..(i + 1) * s];
        let m = 0..ins.len();
        match d {
            DType::F32 => {
                let v = m.map(|k| f32::from_ne_bytes(e(k).try_into().unwrap()));
                o.copy_from_slice(&float_red(op, v, div as f32).to_ne_bytes());
            }
            DType::F64 => {
                let v = m.map(|k| f64::from_ne_bytes(e(k).try_into().unwrap()));
                o.copy_from_slice(&float_red(op, v, f64::from(div)).to_ne_bytes());
            }
            DType::F16 => {
                let v = m.map(|k| f16::from_ne_bytes(e(k).try_into().unwrap()).to_f32());
                let r = f16::from_f32(float_red(op, v, div as f32));
                o.copy_from_slice(&r.to_ne_bytes());
            }
            DType::BF16 => {
                let v = m.map(|k| bf16::from_ne_bytes(e(k).try_into().unwrap()).to_f32());
                let r = bf16::from_f32(float_red(op, v, div as f32));
                o.copy_from_slice(&r.to_ne_bytes());
            }
            DType::I8 => {
                let v = m.map(|k| i128::from(i8::from_ne_bytes([e(k)[0]])));
                o.copy_from_slice(&(int_red(d, op, v, div) as i8).to_ne_bytes());
            }
            DType::U8 => {
                let v = m.map(|k| i128::from(e(k)[0]));
                o.copy_from_slice(&(int_red(d, op, v, div) as u8).to_ne_bytes());
            }
            DType::I32 => {
                let v = m.map(|k| i128::from(i32::from_ne_bytes(e(k).try_into().unwrap())));
                o.copy_from_slice(&(int_red(d, op, v, div) as i32).to_ne_bytes());
            }
            DType::I64 => {
                let v = m.map(|k| i128::from(i64::from_ne_bytes(e(k).try_into().unwrap())));
                o.copy_from_slice(&(int_red(d, op, v, div) as i64).to_ne_bytes());
            }
            DType::U32 => {
                let v = m.map(|k| i128::from(u32::from_ne_bytes(e(k).try_into().unwrap())));
                o.copy_from_slice(&(int_red(d, op, v, div) as u32).to_ne_bytes());
            }
            DType::U64 => {
                let v = m.map(|k| i128::from(u64::from_ne_bytes(e(k).try_into().unwrap())));
                o.copy_from_slice(&(int_red(d, op, v, div) as u64).to_ne_bytes());
            }
            DType::F8E4M3 | DType::F8E5M2 => {
                let f = if d == DType::F8E4M3 {
                    fp8::E4M3
                } else {
                    fp8::E5M2
                };
                let v = m.map(|k| f.decode(e(k)[0]));
                o[0] = f.encode(float_red(op, v, div as f32));
            }
        }
    }
    out
}

/// Inputs from `check::fill` (small exact values) and the result `check::reduce_ref` wants.
fn check_case(d: DType, op: RedOp, m: usize, count: usize, div: u32) -> (Vec<Vec<u8>>, Vec<u8>) {
    let s = usize_of(d.size());
    let seed = 0xC0FFEE ^ (u64::from(d.code()) << 8) ^ u64::from(op.code());
    let ins: Vec<Vec<u8>> = (0..m)
        .map(|k| {
            let mut b = vec![0u8; count * s];
            check::fill(
                d,
                Some(op),
                seed,
                u32::try_from(k).unwrap(),
                &mut b,
                count as u64,
            );
            b
        })
        .collect();
    let mut want = vec![0u8; count * s];
    for i in 0..count {
        let vals = ins.iter().map(|b| check::read_elem(d, b, i));
        check::write_elem(d, &mut want, i, check::reduce_ref(d, op, vals, div));
    }
    (ins, want)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
}

/// Random inputs: full-width integers; floats mostly in a narrow exponent range (so sums
/// round), one in eight raw bit patterns (NaN, inf, subnormals, signed zeros).
// Truncation is the point: the float bit patterns are cut from random u64s.
#[allow(clippy::cast_possible_truncation)]
fn random_case(d: DType, m: usize, count: usize, seed: u64) -> Vec<Vec<u8>> {
    let s = usize_of(d.size());
    let mut rng = Rng(seed | 1);
    (0..m)
        .map(|_| {
            let mut b = vec![0u8; count * s];
            for e in b.chunks_exact_mut(s) {
                let r = rng.next();
                let raw = r.is_multiple_of(8);
                let sign = (r >> 3) & 1;
                let x = rng.next();
                match d {
                    DType::F32 => {
                        let bits = if raw {
                            x as u32
                        } else {
                            ((sign as u32) << 31)
                                | ((123 + (x >> 40) % 9) as u32) << 23
                                | (x as u32 & 0x7F_FFFF)
                        };
                        e.copy_from_slice(&bits.to_ne_bytes());
                    }
                    DType::F64 => {
                        let bits = if raw {
                            x
                        } else {
                            (sign << 63) | ((1019 + (r >> 8) % 9) << 52) | (x & ((1 << 52) - 1))
                        };
                        e.copy_from_slice(&bits.to_ne_bytes());
                    }
                    DType::F16 => {
                        let bits = if raw {
                            x as u16
                        } else {
                            ((sign as u16) << 15)
                                | (((11 + (x >> 40) % 9) as u16) << 10)
                                | (x as u16 & 0x3FF)
                        };
                        e.copy_from_slice(&bits.to_ne_bytes());
                    }
                    DType::BF16 => {
                        let bits = if raw {
                            x as u16
                        } else {
                            ((sign as u16) << 15)
                                | (((123 + (x >> 40) % 9) as u16) << 7)
                                | (x as u16 & 0x7F)
                        };
                        e.copy_from_slice(&bits.to_ne_bytes());
                    }
                    DType::F8E4M3 | DType::F8E5M2 => {
                        // Raw codes: every value, NaN, inf (E5M2), subnormals and overflowing
                        // sums and products (saturated).
                        e[0] = x as u8;
                    }
                    DType::I8 | DType::U8 | DType::I32 | DType::I64 | DType::U32 | DType::U64 => {
                        e.copy_from_slice(&x.to_ne_bytes()[..s]);
                    }
                }
            }
            b
        })
        .collect()
}

/// Index of the first element where `got` differs from `want`. Arithmetic on NaNs yields the
/// GPU's canonical NaN, not the CPU's propagated payload: any NaN matches a NaN there.
fn first_mismatch(d: DType, op: RedOp, got: &[u8], want: &[u8]) -> Option<usize> {
    let s = usize_of(d.size());
    let nan_any = matches!(op, RedOp::Sum | RedOp::Prod | RedOp::Avg);
    let is_nan = |b: &[u8]| match d {
        DType::F32 => f32::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DType::F64 => f64::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DType::F16 => f16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DType::BF16 => bf16::from_ne_bytes(b.try_into().unwrap()).is_nan(),
        DType::F8E4M3 => fp8::E4M3.is_nan(b[0]),
        DType::F8E5M2 => fp8::E5M2.is_nan(b[0]),
        _ => false,
    };
    got.chunks_exact(s)
        .zip(want.chunks_exact(s))
        .position(|(g, w)| g != w && !(nan_any && is_nan(g) && is_nan(w)))
}

#[test]
fn host_reference_agrees_with_check_rs() {
    // The GPU test checks random data against `reference`; here `reference` is checked
    // against check.rs on check.rs's data, for every op, input count and divisor.
    for (d, op) in valid_pairs() {
        for m in 1..=MAX_INPUTS {
            for div in [u32::try_from(m).unwrap(), u32::try_from(m).unwrap() + 3] {
                let (ins, want) = check_case(d, op, m, 3000, div);
                let got = reference(d, op, &ins, 3000, div);
                assert_eq!(
                    first_mismatch(d, op, &got, &want),
                    None,
                    "{d:?} {op:?} m={m} divisor={div}"
                );
            }
        }
    }
    // Integer semantics the GPU kernels must reproduce.
    let one =
        |d: DType, op: RedOp, vals: &[i128], div: u32| int_red(d, op, vals.iter().copied(), div);
    assert_eq!(one(DType::I8, RedOp::Sum, &[100, 100], 2), -56);
    // AVG divides the wrapped sum (NCCL's definition): 300 wraps to 44 in i8, / 3 = 14.
    assert_eq!(one(DType::I8, RedOp::Avg, &[100, 100, 100], 3), 14);
    assert_eq!(one(DType::I32, RedOp::Avg, &[-7, 0], 2), -3);
    // 8 x i64::MAX = 2^66 - 8 wraps to -8; / 8 = -1.
    assert_eq!(
        one(DType::I64, RedOp::Avg, &[i128::from(i64::MAX); 8], 8),
        -1
    );
    // Unsigned divides unsigned: (u64::MAX + 0) / 2.
    assert_eq!(
        one(DType::U64, RedOp::Avg, &[i128::from(u64::MAX), 0], 2),
        i128::from(u64::MAX / 2)
    );
    // NaN propagates from the running result only.
    let nan = f32::NAN;
    assert!(float_red(RedOp::Min, [nan, 1.0].into_iter(), 1.0).is_nan());
    assert_eq!(float_red(RedOp::Min, [1.0, nan].into_iter(), 1.0), 1.0);
}

// ---- GPU ----

fn ck(r: cu_sys::CUresult, what: &str) {
    cu::ck(r, what).unwrap_or_else(|e| panic!("{e}"));
}

struct DevBuf(CUdeviceptr);
impl DevBuf {
    fn new(bytes: usize) -> Self {
        let mut p = 0;
        // SAFETY: a context is current (set up by the test); `p` is a valid out pointer.
        ck(
            unsafe { cu_sys::cuMemAlloc_v2(&mut p, bytes) },
            "cuMemAlloc",
        );
        Self(p)
    }
}
impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc in the still-current context; freed once.
        let _ = unsafe { cu_sys::cuMemFree_v2(self.0) };
    }
}

fn upload(dst: CUdeviceptr, src: &[u8]) {
    // SAFETY: `dst` lies in an allocation of at least `src.len()` bytes past it (the caller's
    // offsets stay within MAX_COUNT + 8 elements).
    ck(
        unsafe { cu_sys::cuMemcpyHtoD_v2(dst, src.as_ptr().cast(), src.len()) },
        "cuMemcpyHtoD",
    );
}

fn download(src: CUdeviceptr, bytes: usize) -> Vec<u8> {
    let mut v = vec![0u8; bytes];
    // SAFETY: as in `upload`; `v` has `bytes` bytes.
    ck(
        unsafe { cu_sys::cuMemcpyDtoH_v2(v.as_mut_ptr().cast(), src, bytes) },
        "cuMemcpyDtoH",
    );
    v
}

#[test]
fn gpu_kernels_match_host_reference() {
    let require = env_is_1("COMMD_REQUIRE_GPU");
    if let Err(why) = cu::driver() {
        assert!(
            !require,
            "COMMD_REQUIRE_GPU=1 but CUDA is unavailable: {why}"
        );
        eprintln!("skip gpu_kernels_match_host_reference: {why}");
        return;
    }
    if !nvrtc_present() {
        assert!(
            !require && !env_is_1("COMMD_REQUIRE_NVRTC"),
            "{}",
            KernelError::NvrtcMissing
        );
        eprintln!(
            "skip gpu_kernels_match_host_reference: {}",
            KernelError::NvrtcMissing
        );
        return;
    }
    let stream = gpu0_stream();

    const MAX_COUNT: usize = 1_000_003;
    const PAD: usize = 8; // elements of slack on each side of every range
    const GUARD: u8 = 0xA5;
    let bytes = (MAX_COUNT + 2 * PAD) * 8;
    let bufs: Vec<DevBuf> = (0..=MAX_INPUTS).map(|_| DevBuf::new(bytes)).collect();
    let kernels = Kernels::new();
    let mut cases = 0;
    let t0 = std::time::Instant::now();
    for (d, op) in valid_pairs() {
        kernels.prepare(d, op).unwrap_or_else(|e| panic!("{e}"));
        let s = usize_of(d.size());
        for m in [1usize, 2, 3, 4, 8] {
            // (count, element offset of every pointer, divisor - m): odd counts, unaligned
            // offsets, and a divisor that differs from the number of inputs.
            for (count, off, extra) in [(1usize, 3usize, 0u32), (7, 1, 3), (MAX_COUNT, 0, 0)] {
                let div = u32::try_from(m).unwrap() + extra;
                let seed = (u64::from(d.code()) << 32) ^ (u64::from(op.code()) << 16) ^ (m as u64);
                let (cins, cwant) = check_case(d, op, m, count, div);
                let rins = random_case(d, m, count, seed ^ count as u64);
                let rwant = reference(d, op, &rins, count, div);
                for (what, ins, want) in [
                    ("check.rs data", &cins, &cwant),
                    ("random data", &rins, &rwant),
                ] {
                    for in_place in [false, true] {
                        let at = |b: &DevBuf| b.0 + (off * s) as u64;
                        for (k, h) in ins.iter().enumerate() {
                            upload(at(&bufs[k]), h);
                        }
                        let out_buf = if in_place {
                            &bufs[0]
                        } else {
                            &bufs[MAX_INPUTS]
                        };
                        if !in_place {
                            // SAFETY: the range lies within the allocation.
                            ck(
                                unsafe { cu_sys::cuMemsetD8_v2(out_buf.0, GUARD, bytes) },
                                "cuMemsetD8",
                            );
                        }
                        // SAFETY: a context is current.
                        ck(unsafe { cu_sys::cuCtxSynchronize() }, "cuCtxSynchronize");
                        let ptrs: Vec<CUdeviceptr> = bufs[..m].iter().map(at).collect();
                        // SAFETY: every pointer has `count` elements (plus PAD) of `d` behind
                        // it; `out` is either ins[0] or a separate buffer; the stream belongs
                        // to the current context and is synchronized before the buffers are
                        // reused.
                        unsafe {
                            kernels.launch(stream, d, op, at(out_buf), &ptrs, count as u64, div)
                        }
                        .unwrap_or_else(|e| panic!("{e}"));
                        // SAFETY: `stream` is live.
                        ck(
                            unsafe { cu_sys::cuStreamSynchronize(stream) },
                            "cuStreamSynchronize",
                        );
                        let got = download(at(out_buf), count * s);
                        if let Some(i) = first_mismatch(d, op, &got, want) {
                            let ins_i: Vec<&[u8]> =
                                ins.iter().map(|b| &b[i * s..(i + 1) * s]).collect();
                            panic!(
                                "{d:?} {op:?} m={m} count={count} divisor={div} in_place={in_place} ({what}): \
                                 element {i}: got {:?}, want {:?}, inputs {ins_i:?}",
                                &got[i * s..(i + 1) * s],
                                &want[i * s..(i + 1) * s],
                            );
                        }
                        if !in_place {
                            // Nothing outside [off, off + count) was written.
                            let around = download(out_buf.0, (off + count + PAD) * s);
                            assert!(
                                around[..off * s]
                                    .iter()
                                    .chain(&around[(off + count) * s..])
                                    .all(|&b| b == GUARD),
                                "{d:?} {op:?} m={m} count={count}: wrote outside the output range"
                            );
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    // SAFETY: the stream is idle (synchronized above) and destroyed once.
    ck(
        unsafe { cu_sys::cuStreamDestroy_v2(stream) },
        "cuStreamDestroy",
    );
    drop(bufs);
    eprintln!(
        "{cases} GPU reductions matched the host reference in {:?}",
        t0.elapsed()
    );
}

/// Bandwidth of a few kernels for several grid caps (run by hand on a GPU:
/// `cargo test --release -p commd-client gpu::kernels -- --ignored --nocapture`).
#[test]
#[ignore = "a measurement, not a test; needs a GPU"]
fn gpu_kernel_bandwidth() {
    if let Err(why) = cu::driver() {
        eprintln!("skip gpu_kernel_bandwidth: {why}");
        return;
    }
    let stream = gpu0_stream();
    let mut ev = [std::ptr::null_mut(); 2];
    for e in &mut ev {
        // SAFETY: a context is current; `e` is a valid out pointer.
        ck(unsafe { cu_sys::cuEventCreate(e, 0) }, "cuEventCreate");
    }
    const BYTES: usize = 256 << 20;
    let bufs: Vec<DevBuf> = (0..=MAX_INPUTS).map(|_| DevBuf::new(BYTES)).collect();
    for (d, op, m) in [
        (DType::F32, RedOp::Sum, 2),
        (DType::BF16, RedOp::Sum, 2),
        (DType::BF16, RedOp::Sum, 8),
        (DType::F32, RedOp::Sum, 8),
        (DType::I64, RedOp::Avg, 4),
    ] {
        let count = BYTES as u64 / d.size();
        let ins: Vec<CUdeviceptr> = bufs[..m].iter().map(|b| b.0).collect();
        let mut row = format!("{:>4} {:>4} m={m}:", d.name(), op.name());
        for per_sm in [1, 2, 4, 8] {
            let k = Kernels::with_blocks_per_sm(per_sm);
            let run = |n: usize| {
                for _ in 0..n {
                    // SAFETY: every buffer holds BYTES bytes = `count` elements; out is separate.
                    unsafe {
                        k.launch(
                            stream,
                            d,
                            op,
                            bufs[MAX_INPUTS].0,
                            &ins,
                            count,
                            u32::try_from(m).unwrap(),
                        )
                    }
                    .unwrap_or_else(|e| panic!("{e}"));
                }
            };
            run(3);
            const ITERS: usize = 20;
            // SAFETY: the events and the stream belong to the current context.
            ck(
                unsafe { cu_sys::cuEventRecord(ev[0], stream) },
                "cuEventRecord",
            );
            run(ITERS);
            // SAFETY: as above.
            ck(
                unsafe { cu_sys::cuEventRecord(ev[1], stream) },
                "cuEventRecord",
            );
            // SAFETY: the event was recorded.
            ck(
                unsafe { cu_sys::cuEventSynchronize(ev[1]) },
                "cuEventSynchronize",
            );
            let mut ms = 0f32;
            // SAFETY: both events completed.
            ck(
                unsafe { cu_sys::cuEventElapsedTime_v2(&mut ms, ev[0], ev[1]) },
                "cuEventElapsedTime",
            );
            let moved = (m + 1) as f64 * BYTES as f64 * ITERS as f64;
            let _ = write!(
                row,
                "  {per_sm}/SM {:6.0} GB/s",
                moved / (f64::from(ms) * 1e-3) / 1e9
            );
        }
        eprintln!("{row}");
    }
    for e in ev {
        // SAFETY: created above, idle, destroyed once.
        let _ = unsafe { cu_sys::cuEventDestroy_v2(e) };
    }
    // SAFETY: the stream is idle and destroyed once.
    ck(
        unsafe { cu_sys::cuStreamDestroy_v2(stream) },
        "cuStreamDestroy",
    );
}

/// Makes GPU 0's primary context current and returns a new blocking stream on it (it orders
/// after the synchronous copies on the legacy stream). Needs `cu::driver()` to have succeeded.
fn gpu0_stream() -> CUstream {
    let mut dev = 0;
    // SAFETY: the driver is initialized; `dev` is a valid out pointer.
    ck(unsafe { cu_sys::cuDeviceGet(&mut dev, 0) }, "cuDeviceGet");
    let ctx = cu::primary_ctx(dev).unwrap_or_else(|e| panic!("{e}"));
    cu::set_current(ctx).unwrap_or_else(|e| panic!("{e}"));
    let mut stream: CUstream = std::ptr::null_mut();
    // SAFETY: a context is current; `stream` is a valid out pointer.
    ck(
        unsafe { cu_sys::cuStreamCreate(&mut stream, 0) },
        "cuStreamCreate",
    );
    stream
}
