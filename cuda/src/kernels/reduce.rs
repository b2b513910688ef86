//! The reduction kernel's part of a `(dtype, op)` module's source: how the `(dtype, op)` loads,
//! combines and stores ([`Shape`]), the fixed-width types and the f16/bf16 conversions every
//! module starts with, `commd_reduce_body` (which the direct and rounds kernels run too), the
//! reduction kernel itself and the scale kernel of the sum modules. `kernels::source` puts a
//! module together from these and the other kernels' parts.

use std::fmt::Write as _;

use commd_proto::desc::{DType, RedOp};

use super::{KernelError, MAX_INPUTS, THREADS};

/// Elements per thread and loop step (independent loads in flight; no alignment assumed).
const UNROLL: u32 = 4;

/// How one (dtype, op) kernel loads, combines and stores, as C expressions over `x` (an element),
/// `a`, `b` (accumulators) and `divisor`.
pub(super) struct Shape {
    pub(super) elem: &'static str,
    acc: &'static str,
    load: String,
    combine: String,
    finish: String,
    store: String,
    /// `a * b` in the accumulator type, wrapping for integers (the scale kernel, PreMulSum).
    mul: String,
}

pub(super) fn shape(dtype: DType, op: RedOp) -> Result<Shape, KernelError> {
    op.check_dtype(dtype)?;
    let float = |elem: &'static str, acc: &'static str, from: &str, to: &str| {
        let conv = |f: &str, v: &str| {
            if f.is_empty() {
                v.to_string()
            } else {
                format!("{f}({v})")
            }
        };
        Shape {
            elem,
            acc,
            load: conv(from, "x"),
            combine: match op {
                RedOp::Sum | RedOp::Avg => "a + b".into(),
                RedOp::Prod => "a * b".into(),
                // Not fminf/fmaxf: those drop NaNs; the host loop keeps `a` unless `b < a`.
                RedOp::Min => "(b < a) ? b : a".into(),
                RedOp::Max => "(b > a) ? b : a".into(),
                // check_dtype refused bitwise ops on floats above.
                RedOp::Band | RedOp::Bor | RedOp::Bxor => String::new(),
            },
            finish: if op == RedOp::Avg {
                format!("a / ({acc})divisor")
            } else {
                "a".into()
            },
            store: conv(to, "r"),
            mul: "a * b".into(),
        }
    };
    let int = |elem: &'static str, unsigned: &'static str, wide: &'static str| Shape {
        elem,
        acc: elem,
        load: "x".into(),
        // Wrapping arithmetic in the unsigned twin (signed overflow is undefined in C).
        combine: match op {
            RedOp::Sum | RedOp::Avg => format!("({elem})(({unsigned})a + ({unsigned})b)"),
            RedOp::Prod => format!("({elem})(({unsigned})a * ({unsigned})b)"),
            RedOp::Min => "(b < a) ? b : a".into(),
            RedOp::Max => "(b > a) ? b : a".into(),
            RedOp::Band => format!("({elem})(a & b)"),
            RedOp::Bor => format!("({elem})(a | b)"),
            RedOp::Bxor => format!("({elem})(a ^ b)"),
        },
        // AVG: NCCL's definition, the wrapped sum divided, in a type as wide as 64 bits of the
        // element's signedness (C division truncates toward zero, like reduce.rs's).
        finish: if op == RedOp::Avg {
            format!("({elem})(({wide})a / ({wide})divisor)")
        } else {
            "a".into()
        },
        store: format!("({elem})r"),
        mul: format!("({elem})(({unsigned})a * ({unsigned})b)"),
    };
    Ok(match dtype {
        DType::F32 => float("float", "float", "", ""),
        DType::F64 => float("double", "double", "", ""),
        DType::F16 => float("u16", "float", "commd_f16_to_f32", "commd_f32_to_f16"),
        DType::BF16 => float("u16", "float", "commd_bf16_to_f32", "commd_f32_to_bf16"),
        DType::I8 => int("i8", "u8", "i64"),
        DType::U8 => int("u8", "u8", "u64"),
        DType::I32 => int("i32", "u32", "i64"),
        DType::I64 => int("i64", "u64", "i64"),
        DType::U32 => int("u32", "u32", "u64"),
        DType::U64 => int("u64", "u64", "u64"),
        DType::F8E4M3 => float("u8", "float", "commd_e4m3_to_f32", "commd_f32_to_e4m3"),
        DType::F8E5M2 => float("u8", "float", "commd_e5m2_to_f32", "commd_f32_to_e5m2"),
    })
}

/// Fixed-width types and the argument block; no CUDA headers.
const TYPES: &str = r#"typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef int i32;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

struct commd_ins {
    const void *p[8];
    u32 m;
};

static __device__ __forceinline__ float commd_bits_f32(u32 u) {
    float f;
    asm("mov.b32 %0, %1;" : "=f"(f) : "r"(u));
    return f;
}

static __device__ __forceinline__ u32 commd_f32_bits(float f) {
    u32 u;
    asm("mov.b32 %0, %1;" : "=r"(u) : "f"(f));
    return u;
}
"#;

/// f16 <-> f32: PTX `cvt` (round to nearest even); NaNs as the half crate converts them (quiet
/// bit set, payload kept) rather than PTX's canonical NaN.
const F16: &str = r#"
static __device__ __forceinline__ float commd_f16_to_f32(u16 h) {
    if ((h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0u) {
        return commd_bits_f32(((u32)(h & 0x8000u) << 16) | 0x7FC00000u | ((u32)(h & 0x03FFu) << 13));
    }
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

static __device__ __forceinline__ u16 commd_f32_to_f16(float f) {
    u32 x = commd_f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (u16)(((x >> 16) & 0x8000u) | 0x7E00u | ((x & 0x007FFFFFu) >> 13));
    }
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
"#;

/// bf16 <-> f32 by bits: round to nearest even; a NaN stays NaN (quiet bit set), as in the half
/// crate.
const BF16: &str = r#"
static __device__ __forceinline__ float commd_bf16_to_f32(u16 h) {
    return commd_bits_f32((u32)h << 16);
}

static __device__ __forceinline__ u16 commd_f32_to_bf16(float f) {
    u32 x = commd_f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) {
        return (u16)((x >> 16) | 0x0040u);
    }
    u32 r = x >> 16;
    if ((x & 0x8000u) != 0u && (x & 0x17FFFu) != 0u) {
        r += 1u;
    }
    return (u16)r;
}
"#;

/// fp8 <-> f32 by bits, as `commd_proto::fp8` converts (the kernel tests compare the two):
/// decoding is exact; encoding rounds to nearest even and saturates to the largest finite value
/// (CUDA's `__NV_SATFINITE`, which NCCL's fp8 reductions use); a NaN stays NaN.
const FP8: &str = r#"
static __device__ __forceinline__ float commd_e4m3_to_f32(u8 h) {
    u32 s = ((u32)h & 0x80u) << 24;
    u32 mag = (u32)h & 0x7Fu;
    if (mag == 0x7Fu) {
        return commd_bits_f32(s | 0x7FC00000u);
    }
    u32 e = mag >> 3;
    u32 m = mag & 7u;
    if (e == 0u) {
        return commd_bits_f32(s | commd_f32_bits((float)m * 0.001953125f));
    }
    return commd_bits_f32(s | ((e + 120u) << 23) | (m << 20));
}

static __device__ __forceinline__ float commd_e5m2_to_f32(u8 h) {
    u32 s = ((u32)h & 0x80u) << 24;
    u32 mag = (u32)h & 0x7Fu;
    u32 e = mag >> 2;
    u32 m = mag & 3u;
    if (e == 31u) {
        return commd_bits_f32(s | 0x7F800000u | (m != 0u ? (0x400000u | (m << 21)) : 0u));
    }
    if (e == 0u) {
        return commd_bits_f32(s | commd_f32_bits((float)m * 1.52587890625e-05f));
    }
    return commd_bits_f32(s | ((e + 112u) << 23) | (m << 21));
}

static __device__ __forceinline__ u8 commd_f32_to_f8(float f, u32 mbits, int bias, u32 max_code, u32 max_bits) {
    u32 x = commd_f32_bits(f);
    u32 sign = (x >> 24) & 0x80u;
    u32 ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) {
        return (u8)(sign | 0x7Fu);
    }
    if (ax >= max_bits) {
        return (u8)(sign | max_code);
    }
    int e = (int)(ax >> 23) - 127;
    u32 mant = (ax & 0x7FFFFFu) | (ax >= 0x800000u ? 0x800000u : 0u);
    int emin = 1 - bias;
    int drop = 23 - (int)mbits + (e < emin ? emin - e : 0);
    if (drop >= 25) {
        return (u8)sign;
    }
    u32 q = mant >> drop;
    u32 rem = mant & ((1u << drop) - 1u);
    u32 half = 1u << (drop - 1);
    if (rem > half || (rem == half && (q & 1u) != 0u)) {
        q += 1u;
    }
    u32 code = e >= emin ? ((((u32)(e + bias)) << mbits) + q - (1u << mbits)) : q;
    return (u8)(sign | (code < max_code ? code : max_code));
}

static __device__ __forceinline__ u8 commd_f32_to_e4m3(float f) {
    return commd_f32_to_f8(f, 3u, 7, 0x7Eu, 0x43E00000u);
}

static __device__ __forceinline__ u8 commd_f32_to_e5m2(float f) {
    return commd_f32_to_f8(f, 2u, 15, 0x7Bu, 0x47600000u);
}
"#;

// Every `write!` below is to a String: it cannot fail. Each text starts with a newline; one that
// stops inside a C function ends without its last newline, which the next text starts with.

/// What every module starts with: [`TYPES`], and the conversions of `dtype` if it is f16, bf16
/// or fp8.
pub(super) fn push_prelude(src: &mut String, dtype: DType) {
    src.push_str(TYPES);
    match dtype {
        DType::F16 => src.push_str(F16),
        DType::BF16 => src.push_str(BF16),
        DType::F8E4M3 | DType::F8E5M2 => src.push_str(FP8),
        _ => {}
    }
}

/// The `(dtype, op)` helpers, `commd_reduce_body` and the reduction kernel `name`, for elements
/// of `es` bytes.
pub(super) fn push_reduce(src: &mut String, s: &Shape, name: &str, es: u64) {
    let vec = 16 / es;
    push_elementwise(src, s, vec);
    push_reduce_vectors(src, s, vec);
    push_reduce_elements(src, s, name);
}

/// The (dtype, op) helpers `commd_load`, `commd_combine` and `commd_finish` (the [`Shape`]'s
/// expressions), and the 16-byte vector types.
fn push_elementwise(src: &mut String, s: &Shape, vec: u64) {
    let elem = s.elem;
    let acc = s.acc;
    let load = &s.load;
    let combine = &s.combine;
    let finish = &s.finish;
    let store = &s.store;
    let _ = write!(
        src,
        r#"
static __device__ __forceinline__ {acc} commd_load({elem} x) {{ return {load}; }}
static __device__ __forceinline__ {acc} commd_combine({acc} a, {acc} b) {{ return {combine}; }}
static __device__ __forceinline__ {elem} commd_finish({acc} a, u32 divisor) {{
    (void)divisor;
    {acc} r = {finish};
    return {store};
}}

struct alignas(16) commd_v16 {{ u32 w[4]; }};
union commd_vec {{ commd_v16 q; {elem} e[{vec}]; }};
"#
    );
}

/// The first part of `commd_reduce_body`: its 16-byte loads and stores where every pointer is
/// 16-byte aligned.
fn push_reduce_vectors(src: &mut String, s: &Shape, vec: u64) {
    let elem = s.elem;
    let acc = s.acc;
    let _ = write!(
        src,
        r#"
/* out[i] = op(ins[0][i], ..., ins[m-1][i]) for i < count, grid-stride from thread `tid`. */
static __device__ __forceinline__ void commd_reduce_body({elem} *out, const struct commd_ins &ins, u64 count, u32 divisor, u64 tid, u64 stride) {{
    const u32 m = ins.m;
    u64 i = tid;
    /* 16-byte loads and stores ({vec} elements) where every pointer is 16-byte aligned; the
       rest (a tail, or unaligned pointers) element by element below. */
    bool aligned = (((u64)out) & 15u) == 0u;
#pragma unroll
    for (u32 k = 0; k < {MAX_INPUTS}; ++k) {{
        if (k < m) {{
            aligned = aligned && ((((u64)ins.p[k]) & 15u) == 0u);
        }}
    }}
    if (aligned) {{
        const u64 nv = count / {vec};
        for (u64 j = tid; j < nv; j += stride) {{
            union commd_vec v[{MAX_INPUTS}];
#pragma unroll
            for (u32 k = 0; k < {MAX_INPUTS}; ++k) {{
                if (k < m) {{
                    v[k].q = ((const commd_v16 *)ins.p[k])[j];
                }}
            }}
            union commd_vec o;
#pragma unroll
            for (u32 u = 0; u < {vec}; ++u) {{
                {acc} a = commd_load(v[0].e[u]);
#pragma unroll
                for (u32 k = 1; k < {MAX_INPUTS}; ++k) {{
                    if (k < m) {{
                        a = commd_combine(a, commd_load(v[k].e[u]));
                    }}
                }}
                o.e[u] = commd_finish(a, divisor);
            }}
            ((commd_v16 *)out)[j] = o.q;
        }}
        i = nv * {vec} + tid;
    }}"#
    );
}

/// The rest of `commd_reduce_body` (element by element, [`UNROLL`] per thread and step, then the
/// tail) and the reduction kernel `name`.
fn push_reduce_elements(src: &mut String, s: &Shape, name: &str) {
    let elem = s.elem;
    let acc = s.acc;
    let unroll_m1 = UNROLL - 1;
    let _ = write!(
        src,
        r#"
    /* {UNROLL} elements per thread and step, every load issued before any value is used. */
    for (; i + {unroll_m1} * stride < count; i += {UNROLL} * stride) {{
        {elem} v[{MAX_INPUTS}][{UNROLL}];
#pragma unroll
        for (u32 k = 0; k < {MAX_INPUTS}; ++k) {{
            if (k < m) {{
                const {elem} *p = (const {elem} *)ins.p[k];
#pragma unroll
                for (u32 u = 0; u < {UNROLL}; ++u) {{
                    v[k][u] = p[i + u * stride];
                }}
            }}
        }}
#pragma unroll
        for (u32 u = 0; u < {UNROLL}; ++u) {{
            {acc} a = commd_load(v[0][u]);
#pragma unroll
            for (u32 k = 1; k < {MAX_INPUTS}; ++k) {{
                if (k < m) {{
                    a = commd_combine(a, commd_load(v[k][u]));
                }}
            }}
            out[i + u * stride] = commd_finish(a, divisor);
        }}
    }}
    for (; i < count; i += stride) {{
        {acc} a = commd_load(((const {elem} *)ins.p[0])[i]);
#pragma unroll
        for (u32 k = 1; k < {MAX_INPUTS}; ++k) {{
            if (k < m) {{
                a = commd_combine(a, commd_load(((const {elem} *)ins.p[k])[i]));
            }}
        }}
        out[i] = commd_finish(a, divisor);
    }}
}}

extern "C" __global__ void __launch_bounds__({THREADS}) {name}({elem} *out, struct commd_ins ins, u64 count, u32 divisor) {{
    commd_reduce_body(out, ins, count, divisor,
                      (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x,
                      (u64)gridDim.x * (u64)blockDim.x);
}}
"#
    );
}

/// The scale kernel `scale` of a sum module: `out[i] = in[i] * s`, `s` read from `sp` when it
/// is not null, else the low bytes of `imm` (NCCL's PreMulSum: each rank scales its own input
/// before a sum).
pub(super) fn push_scale(src: &mut String, s: &Shape, scale: &str) {
    let elem = s.elem;
    let acc = s.acc;
    let mul = &s.mul;
    let _ = write!(
        src,
        r#"
static __device__ __forceinline__ {acc} commd_mul({acc} a, {acc} b) {{ return {mul}; }}

extern "C" __global__ void __launch_bounds__({THREADS}) {scale}({elem} *out, const {elem} *in, u64 count, const {elem} *sp, u64 imm) {{
    union {{ u64 u; {elem} e; }} b;
    b.u = imm;
    const {acc} s = commd_load(sp != 0 ? *sp : b.e);
    const u64 stride = (u64)gridDim.x * (u64)blockDim.x;
    for (u64 i = (u64)blockIdx.x * (u64)blockDim.x + (u64)threadIdx.x; i < count; i += stride) {{
        out[i] = commd_finish(commd_mul(commd_load(in[i]), s), 1u);
    }}
}}
"#
    );
}
