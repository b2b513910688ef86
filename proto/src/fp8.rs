//! fp8 (OCP E4M3 and E5M2) to and from f32, as NCCL and CUDA's `__nv_fp8_*` types convert them:
//! decoding is exact; encoding rounds to nearest, ties to even, and saturates to the largest
//! finite value (`__NV_SATFINITE`: an infinity or an overflow becomes +-max, a NaN stays NaN).
//!
//! The GPU kernels carry the same algorithm in C (`commd-cuda`'s reduction prelude); the unit
//! tests here check every code and the rounding boundaries, and the kernel tests check the GPU
//! against this module.

/// One of the two fp8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Format {
    /// Mantissa bits.
    pub mbits: u32,
    /// Exponent bias.
    pub bias: i32,
    /// The code (sign bit clear) of the largest finite value.
    pub max_code: u8,
    /// Whether the format has infinities (E5M2) or not (E4M3: every all-ones pattern is NaN).
    pub has_inf: bool,
}

/// E4M3 ("fn"): bias 7, largest finite 448 (0x7E), NaN 0x7F, no infinities.
pub const E4M3: Format = Format {
    mbits: 3,
    bias: 7,
    max_code: 0x7E,
    has_inf: false,
};

/// E5M2: bias 15, largest finite 57344 (0x7B), infinity 0x7C, NaNs 0x7D-0x7F.
pub const E5M2: Format = Format {
    mbits: 2,
    bias: 15,
    max_code: 0x7B,
    has_inf: true,
};

/// The NaN code written for a NaN input (with the input's sign), as CUDA writes it.
pub const NAN_CODE: u8 = 0x7F;

impl Format {
    /// Whether the code is a NaN.
    pub fn is_nan(self, code: u8) -> bool {
        let mag = code & 0x7F;
        if self.has_inf {
            mag > self.max_code + 1
        } else {
            mag == NAN_CODE
        }
    }

    /// The value of `code` (exact).
    pub fn decode(self, code: u8) -> f32 {
        let negative = code & 0x80 != 0;
        let mag = code & 0x7F;
        let v = if self.is_nan(code) {
            f32::NAN
        } else if self.has_inf && mag == self.max_code + 1 {
            f32::INFINITY
        } else {
            let e = i32::from(mag >> self.mbits);
            let m = f32::from(mag & ((1u8 << self.mbits) - 1));
            let one = f32::from(1u8 << self.mbits);
            if e == 0 {
                // Subnormal: m * 2^(1 - bias - mbits).
                m * pow2(1 - self.bias - mbits_i32(self.mbits))
            } else {
                (one + m) * pow2(e - self.bias - mbits_i32(self.mbits))
            }
        };
        if negative { -v } else { v }
    }

    /// `x` rounded to nearest (ties to even) and saturated to the largest finite value.
    // Every cast is of a value bounded above: an exponent field, a mantissa of at most 24 bits,
    // a code of at most 0x7F.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_possible_wrap
    )]
    pub fn encode(self, x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let ax = bits & 0x7FFF_FFFF;
        if ax > 0x7F80_0000 {
            return sign | NAN_CODE;
        }
        if ax >= self.decode(self.max_code).to_bits() {
            return sign | self.max_code;
        }
        let e = (ax >> 23) as i32 - 127;
        let mant = (ax & 0x7F_FFFF) | if ax >= 0x80_0000 { 0x80_0000 } else { 0 };
        let emin = 1 - self.bias;
        let drop = 23 - mbits_i32(self.mbits) + if e < emin { emin - e } else { 0 };
        if drop >= 25 {
            // Below half the smallest subnormal: zero.
            return sign;
        }
        let drop = drop as u32;
        let mut q = mant >> drop;
        let rem = mant & ((1u32 << drop) - 1);
        let half = 1u32 << (drop - 1);
        if rem > half || (rem == half && q & 1 == 1) {
            q += 1;
        }
        // A carry out of the mantissa moves into the exponent field by itself, and a subnormal
        // that rounds up to 2^mbits is the smallest normal's code.
        let code = if e >= emin {
            (((e + self.bias) as u32) << self.mbits) + q - (1u32 << self.mbits)
        } else {
            q
        };
        sign | code.min(u32::from(self.max_code)) as u8
    }
}

fn mbits_i32(m: u32) -> i32 {
    // At most 3.
    i32::try_from(m).unwrap_or(0)
}

fn pow2(e: i32) -> f32 {
    // The exponents here are within -17..16: exact in f32.
    2f32.powi(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every finite code decodes and encodes back to itself (the signed zeros included).
    #[test]
    fn every_code_round_trips() {
        for f in [E4M3, E5M2] {
            for c in 0..=255u8 {
                let v = f.decode(c);
                if f.is_nan(c) {
                    assert!(v.is_nan(), "{f:?} {c:#x}");
                    assert_eq!(f.encode(v) & 0x7F, NAN_CODE);
                } else if v.is_infinite() {
                    assert_eq!(f.encode(v), (c & 0x80) | f.max_code, "inf saturates");
                } else {
                    assert_eq!(f.encode(v), c, "{f:?} {c:#x} = {v}");
                }
            }
        }
    }

    #[test]
    fn known_values() {
        assert_eq!(E4M3.decode(0x7E), 448.0);
        assert_eq!(E4M3.decode(0x01), 2f32.powi(-9));
        assert_eq!(E4M3.decode(0x08), 2f32.powi(-6));
        assert_eq!(E4M3.decode(0x38), 1.0);
        assert_eq!(E5M2.decode(0x7B), 57344.0);
        assert_eq!(E5M2.decode(0x01), 2f32.powi(-16));
        assert_eq!(E5M2.decode(0x3C), 1.0);
        assert!(E5M2.decode(0x7C).is_infinite());
        assert!(E5M2.decode(0xFC).is_infinite() && E5M2.decode(0xFC) < 0.0);
    }

    /// Every midpoint between two neighbouring codes rounds to the even one, and a hair either
    /// side rounds to the near one; beyond the largest value saturates.
    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        for f in [E4M3, E5M2] {
            for c in 0..f.max_code {
                let (lo, hi) = (f.decode(c), f.decode(c + 1));
                let mid = (f64::from(lo) + f64::from(hi)) / 2.0;
                #[allow(clippy::cast_possible_truncation)]
                let mid = mid as f32; // exact: fp8 midpoints have at most 5 significant bits
                let even = if c % 2 == 0 { c } else { c + 1 };
                assert_eq!(f.encode(mid), even, "{f:?} midpoint of {c:#x}");
                assert_eq!(f.encode(-mid), 0x80 | even);
                assert_eq!(f.encode(f32::from_bits(mid.to_bits() - 1)), c);
                assert_eq!(f.encode(f32::from_bits(mid.to_bits() + 1)), c + 1);
            }
            let max = f.decode(f.max_code);
            for x in [max * 1.01, max * 4.0, f32::MAX, f32::INFINITY] {
                assert_eq!(f.encode(x), f.max_code);
                assert_eq!(f.encode(-x), 0x80 | f.max_code);
            }
            assert_eq!(f.encode(f32::NAN) & 0x7F, NAN_CODE);
            assert_eq!(f.encode(1e-30), 0);
            assert_eq!(f.encode(-1e-30), 0x80);
            assert_eq!(f.encode(f32::from_bits(1)), 0);
        }
    }
}
