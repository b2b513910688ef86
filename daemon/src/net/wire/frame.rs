//! The wire's frame: a 64-byte header (little endian) then `len` payload bytes.
//! `magic u32 | kind u8 | class u8 | op u8 | dtype u8 | a u64 | b u64 | count u64 | offset u64 |
//!  total u64 | len u32 | root u32 | redop u8 | 7 reserved`. Its kinds and classes, the message
//! key and signature it carries, and their encoding.

pub const HDR: usize = 64;
pub(super) const MAGIC: u32 = u32::from_le_bytes(*b"cmNT");
pub const KIND_DATA: u8 = 1;
pub const KIND_HEARTBEAT: u8 = 2;
pub const KIND_ABORT: u8 = 3;
pub const KIND_END: u8 = 4;
/// Message classes (tag spaces).
pub const CLASS_COLL: u8 = 0;
pub const CLASS_P2P: u8 = 1;

/// What a collective message claims to be part of; receivers compare it with their own op, so
/// nodes that disagree fail with an error instead of corrupting data.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sig {
    pub op: u8,
    pub dtype: u8,
    pub redop: u8,
    pub root: u32,
    pub count: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Key {
    pub peer: usize,
    pub class: u8,
    pub a: u64,
    pub b: u64,
}

pub(super) fn put_hdr(
    kind: u8,
    key: &Key,
    sig: &Sig,
    offset: u64,
    total: u64,
    len: u32,
) -> [u8; HDR] {
    let mut h = [0u8; HDR];
    h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    h[4] = kind;
    h[5] = key.class;
    h[6] = sig.op;
    h[7] = sig.dtype;
    h[8..16].copy_from_slice(&key.a.to_le_bytes());
    h[16..24].copy_from_slice(&key.b.to_le_bytes());
    h[24..32].copy_from_slice(&sig.count.to_le_bytes());
    h[32..40].copy_from_slice(&offset.to_le_bytes());
    h[40..48].copy_from_slice(&total.to_le_bytes());
    h[48..52].copy_from_slice(&len.to_le_bytes());
    h[52..56].copy_from_slice(&sig.root.to_le_bytes());
    h[56] = sig.redop;
    h
}

pub(super) fn u64_at(h: &[u8; HDR], i: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&h[i..i + 8]);
    u64::from_le_bytes(b)
}

pub(super) fn u32_at(h: &[u8; HDR], i: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&h[i..i + 4]);
    u32::from_le_bytes(b)
}

pub(super) fn sig_of(h: &[u8; HDR]) -> Sig {
    Sig {
        op: h[6],
        dtype: h[7],
        redop: h[56],
        root: u32_at(h, 52),
        count: u64_at(h, 24),
    }
}
