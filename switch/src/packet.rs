//! The SwitchML UDP packet (see `../shared/specs/switchml.md`): a 10-byte header after the UDP
//! header, then 64 or 256 big-endian int32 values.
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 1 | `msg_type:4` (=1), `unused:1`, `size:3` ([`PacketSize`]) |
//! | 1 | 1 | `job_number` (echoed) |
//! | 2 | 4 | `tsi`, packet id, opaque to the switch (little-endian, as the reference client) |
//! | 6 | 2 | `pool_index`: bit 15 = set, bits 13..0 = slot, bit 14 ignored |
//! | 8 | 1 | `e0` (signed; the switch returns the max over workers) |
//! | 9 | 1 | `e1` (signed; max) |
//! | 10 | 256 or 1024 | values, big-endian int32 |

use thiserror::Error;

/// The switch's first UDP data port; a real switch accepts `0xBEE0..=0xBEEF`.
pub const SWITCH_UDP_PORT: u16 = 0xBEE0;
/// Header bytes after the UDP header.
pub const HEADER_BYTES: usize = 10;
/// `msg_type` of a SwitchML data packet.
pub const MSG_TYPE: u8 = 1;
/// Aggregator slots in a switch (each with two sets).
pub const SLOTS: usize = 8192;
/// Workers per session (one bit each in the switch's bitmaps).
pub const MAX_WORKERS: usize = 32;
/// Ethernet (14) + IPv4 (20) + UDP (8) header bytes, for frame sizes and goodput.
pub const L2_L4_BYTES: usize = 42;

/// `PacketSize`: the value payload of a packet. Only 256 and 1024 bytes are processed by the
/// switch (64 values with the standard pipe, 256 with the folded pipe).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PacketSize {
    Mtu128 = 0,
    Mtu256 = 1,
    Mtu512 = 2,
    Mtu1024 = 3,
}

impl PacketSize {
    pub fn from_code(c: u8) -> Option<Self> {
        Some(match c {
            0 => Self::Mtu128,
            1 => Self::Mtu256,
            2 => Self::Mtu512,
            3 => Self::Mtu1024,
            _ => return None,
        })
    }

    pub fn code(self) -> u8 {
        self as u8
    }

    /// Value payload bytes.
    pub fn bytes(self) -> usize {
        128 << (self as usize)
    }

    /// int32 values per packet.
    pub fn values(self) -> usize {
        self.bytes() / 4
    }

    /// Whether a switch aggregates packets of this size.
    pub fn processed(self) -> bool {
        matches!(self, Self::Mtu256 | Self::Mtu1024)
    }

    /// From the value payload in bytes (256 or 1024).
    pub fn from_bytes(b: usize) -> Option<Self> {
        [Self::Mtu128, Self::Mtu256, Self::Mtu512, Self::Mtu1024]
            .into_iter()
            .find(|s| s.bytes() == b)
    }
}

/// A packet header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub size: PacketSize,
    pub job: u8,
    pub tsi: u32,
    pub slot: u16,
    pub set: u8,
    pub e0: i8,
    pub e1: i8,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PacketError {
    #[error("packet of {0} bytes is shorter than the {HEADER_BYTES}-byte header")]
    Short(usize),
    #[error("msg_type {0} is not a SwitchML data packet (1)")]
    MsgType(u8),
    #[error("packet size code {0} is not aggregated (only 256- and 1024-byte payloads are)")]
    Size(u8),
    #[error("slot {0} is out of range (the switch has {SLOTS} slots)")]
    Slot(u16),
    #[error("packet of {got} bytes, but its size code says {want}")]
    Length { got: usize, want: usize },
}

impl Header {
    /// Bytes of the whole UDP payload (header and values).
    pub fn wire_len(&self) -> usize {
        HEADER_BYTES + self.size.bytes()
    }

    pub fn pool_index(&self) -> u16 {
        (u16::from(self.set & 1) << 15) | (self.slot & 0x3fff)
    }

    /// Writes the header into `out[..HEADER_BYTES]`.
    pub fn write(&self, out: &mut [u8]) {
        out[0] = (MSG_TYPE << 4) | (self.size.code() & 0x7);
        out[1] = self.job;
        out[2..6].copy_from_slice(&self.tsi.to_le_bytes());
        out[6..8].copy_from_slice(&self.pool_index().to_be_bytes());
        // The exponents travel as their two's-complement bytes.
        out[8] = self.e0.cast_unsigned();
        out[9] = self.e1.cast_unsigned();
    }

    /// Parses and checks a UDP payload; returns the header (values follow at [`HEADER_BYTES`]).
    pub fn parse(buf: &[u8]) -> Result<Header, PacketError> {
        if buf.len() < HEADER_BYTES {
            return Err(PacketError::Short(buf.len()));
        }
        let mt = buf[0] >> 4;
        if mt != MSG_TYPE {
            return Err(PacketError::MsgType(mt));
        }
        let code = buf[0] & 0x7;
        let size = PacketSize::from_code(code)
            .filter(|s| s.processed())
            .ok_or(PacketError::Size(code))?;
        let pool = u16::from_be_bytes([buf[6], buf[7]]);
        let slot = pool & 0x3fff;
        if usize::from(slot) >= SLOTS {
            return Err(PacketError::Slot(slot));
        }
        let h = Header {
            size,
            job: buf[1],
            tsi: u32::from_le_bytes([buf[2], buf[3], buf[4], buf[5]]),
            slot,
            set: (pool >> 15) as u8,
            e0: buf[8].cast_signed(),
            e1: buf[9].cast_signed(),
        };
        if buf.len() != h.wire_len() {
            return Err(PacketError::Length {
                got: buf.len(),
                want: h.wire_len(),
            });
        }
        Ok(h)
    }
}

/// Writes `vals` big-endian into `out` (which holds exactly `vals.len() * 4` bytes).
pub fn put_values(out: &mut [u8], vals: &[i32]) {
    for (o, v) in out.chunks_exact_mut(4).zip(vals) {
        o.copy_from_slice(&v.to_be_bytes());
    }
}

/// Reads big-endian values from `buf` into `out`.
pub fn get_values(buf: &[u8], out: &mut [i32]) {
    for (o, b) in out.iter_mut().zip(buf.chunks_exact(4)) {
        *o = i32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// The block-floating-point exponent of a block: `((bits(max|x|) >> 23) & 0xff) - 126`, so that
/// every `|x| < 2^e`. Non-finite values and values too large for the switch's int8 exponent
/// (|x| >= 2^126) give [`EXP_UNREPRESENTABLE`], which every worker then sees as the maximum.
pub fn block_exponent(xs: &[f32]) -> i8 {
    let mut m = 0u32;
    for x in xs {
        let b = x.to_bits() & 0x7fff_ffff;
        m = m.max(b);
    }
    let biased = i16::from(u8::try_from((m >> 23) & 0xff).expect("masked to 8 bits"));
    if biased >= 253 {
        return EXP_UNREPRESENTABLE;
    }
    i8::try_from(biased - 126).expect("a biased exponent below 253 gives -126..=126")
}

/// The exponent that marks a block holding NaN, infinity, or |x| >= 2^126.
pub const EXP_UNREPRESENTABLE: i8 = i8::MAX;

/// Scale applied to values of a block whose agreed exponent is `e` among `n` workers:
/// `INT32_MAX / (n * 2^e)`, so that the sum over `n` workers of `|x| < 2^e` stays in int32.
pub fn bfp_scale(e: i8, n: u32) -> f64 {
    f64::from(i32::MAX) / (f64::from(n) * (f64::from(e)).exp2())
}

/// Quantizes `xs` with exponent `e` for `n` workers (round to nearest).
// Exact: `e` is the agreed (largest) block exponent, so every |x| < 2^e and |x * scale| stays
// within INT32_MAX / n; the rounded f64 is an integer in i32's range.
#[allow(clippy::cast_possible_truncation)]
pub fn quantize(xs: &[f32], e: i8, n: u32, out: &mut [i32]) {
    let s = bfp_scale(e, n);
    for (o, &x) in out.iter_mut().zip(xs) {
        *o = (f64::from(x) * s).round() as i32;
    }
}

/// Turns aggregated values back into floats.
// Rounding the f64 product to the nearest f32 is the point (the block's values are f32).
#[allow(clippy::cast_possible_truncation)]
pub fn dequantize(vals: &[i32], e: i8, n: u32, out: &mut [f32]) {
    let s = 1.0 / bfp_scale(e, n);
    for (o, &v) in out.iter_mut().zip(vals) {
        *o = (f64::from(v) * s) as f32;
    }
}

/// The worst-case absolute error of a quantized sum over `n` workers for a block with agreed
/// exponent `e`: each worker rounds by at most half a unit of `n * 2^e / INT32_MAX`.
pub fn quantization_bound(e: i8, n: u32) -> f64 {
    f64::from(n) * 0.5 / bfp_scale(e, n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// A frame written out by hand from the spec's table: msg_type 1, size 1 (256 B), job 0x2a,
    /// tsi 0x01020304 little-endian, set 1 slot 5 (pool index 0x8005), e0 = -3, e1 = 7, then
    /// 64 big-endian values 1, -1, 0x12345678, then zeros.
    #[test]
    fn hand_written_frame_parses_and_round_trips() {
        let mut frame = hex("11 2a 04030201 8005 fd 07");
        frame.extend(hex("00000001 ffffffff 12345678"));
        frame.resize(HEADER_BYTES + 256, 0);
        let h = Header::parse(&frame).unwrap();
        assert_eq!(
            h,
            Header {
                size: PacketSize::Mtu256,
                job: 0x2a,
                tsi: 0x0102_0304,
                slot: 5,
                set: 1,
                e0: -3,
                e1: 7
            }
        );
        let mut vals = vec![0i32; 64];
        get_values(&frame[HEADER_BYTES..], &mut vals);
        assert_eq!(&vals[..4], &[1, -1, 0x1234_5678, 0]);
        let mut out = vec![0u8; h.wire_len()];
        h.write(&mut out);
        put_values(&mut out[HEADER_BYTES..], &vals);
        assert_eq!(out, frame);
        // 308-byte frame without FCS for 64 values.
        assert_eq!(L2_L4_BYTES + h.wire_len(), 308);
    }

    #[test]
    fn bit_14_of_the_pool_index_is_ignored_and_bad_frames_are_refused() {
        let mut f = hex("13 00 00000000 4003 00 00");
        f.resize(HEADER_BYTES + 1024, 0);
        let h = Header::parse(&f).unwrap();
        assert_eq!((h.slot, h.set, h.size), (3, 0, PacketSize::Mtu1024));
        assert_eq!(Header::parse(&f[..5]), Err(PacketError::Short(5)));
        let mut g = f.clone();
        g[0] = 0x23;
        assert_eq!(Header::parse(&g), Err(PacketError::MsgType(2)));
        g[0] = 0x10;
        assert_eq!(Header::parse(&g), Err(PacketError::Size(0)));
        assert!(matches!(
            Header::parse(&f[..HEADER_BYTES + 256]),
            Err(PacketError::Length { .. })
        ));
        let mut s = f.clone();
        s[6..8].copy_from_slice(&0x3fffu16.to_be_bytes());
        assert_eq!(Header::parse(&s), Err(PacketError::Slot(0x3fff)));
    }

    #[test]
    fn block_exponent_bounds_every_value() {
        assert_eq!(block_exponent(&[1.0]), 1);
        assert_eq!(block_exponent(&[0.75, -1.5]), 1);
        assert_eq!(block_exponent(&[0.0, -0.0]), -126);
        assert_eq!(block_exponent(&[2.0]), 2);
        assert_eq!(block_exponent(&[f32::NAN]), EXP_UNREPRESENTABLE);
        assert_eq!(block_exponent(&[f32::INFINITY]), EXP_UNREPRESENTABLE);
        assert_eq!(block_exponent(&[f32::MAX]), EXP_UNREPRESENTABLE);
        for x in [1e-30f32, 3.7, -1e20, 123456.0] {
            let e = block_exponent(&[x]);
            assert!(f64::from(x.abs()) < f64::from(e).exp2(), "{x} {e}");
        }
    }

    #[test]
    fn quantized_sum_of_n_workers_stays_in_range_and_within_bound() {
        let n = 4u32;
        let xs: Vec<Vec<f32>> = (0..n)
            .map(|w| {
                (0..64)
                    .map(|i| ((i * 7 + w as usize * 13) as f32 - 200.0) * 0.37)
                    .collect()
            })
            .collect();
        let e = xs.iter().map(|b| block_exponent(b)).max().unwrap();
        let mut sum = vec![0i32; 64];
        for b in &xs {
            let mut q = vec![0i32; 64];
            quantize(b, e, n, &mut q);
            for (s, v) in sum.iter_mut().zip(&q) {
                *s = s.checked_add(*v).expect("no overflow within n workers");
            }
        }
        let mut got = vec![0f32; 64];
        dequantize(&sum, e, n, &mut got);
        let bound = quantization_bound(e, n);
        for i in 0..64 {
            let want: f64 = xs.iter().map(|b| f64::from(b[i])).sum();
            assert!((f64::from(got[i]) - want).abs() <= bound + want.abs() * 1e-7);
        }
    }
}
