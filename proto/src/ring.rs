//! The per-session shared-memory ring (docs/contracts.md #2).
//!
//! Layout (offsets from the start of the memfd; every index and offset below is computed from
//! `(sq_entries, cq_entries)` by [`RingLayout`], never read back from shared memory by the daemon):
//!
//! | offset | what |
//! |---|---|
//! | 0 | [`RingHeader`] (magic, ABI version, sizes, offsets), one page |
//! | 4096 | control page: one 128-byte line per word, see `CTRL_*` |
//! | 8192 | doorbell page: per-communicator GPU ready/done/error counters (`desc::doorbell`) |
//! | 12288 | SQ: `sq_entries` x [`SubmitDesc`] |
//! | page-aligned | CQ: `cq_entries` x [`CompletionDesc`] |
//! | page-aligned | graph doorbells: per captured GPU op ready/done/error words (`desc::graph_doorbell`) |
//!
//! Indices are free-running `u32`s masked by `entries - 1`. The SQ tail and the CQ head are written
//! by the client and therefore untrusted: the daemon checks `tail - head <= entries` and reads each
//! descriptor into a private copy before validating it.
//!
//! Wake-up protocol (both directions alike): the producer publishes its tail (release), issues a
//! SeqCst fence, bumps the futex word and calls `FUTEX_WAKE` only if the consumer announced that
//! it sleeps. The consumer announces, re-checks the tail, then waits on the futex word's value
//! read before the re-check, so a wake-up can never be lost.

#![allow(unsafe_code)] // the ring is raw shared memory mapped by two processes

use std::fs::File;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use memmap2::{MmapOptions, MmapRaw};
use thiserror::Error;

use crate::desc::{CompletionDesc, SubmitDesc};
use crate::num::usize_of;

pub const RING_MAGIC: u64 = u64::from_le_bytes(*b"commdRNG");
/// 2: the graph doorbell area after the CQ (`RingHeader::graph_off`, persistent GPU ops).
pub const RING_ABI_VERSION: u32 = 2;
pub const PAGE: u64 = 4096;
pub const MAX_ENTRIES: u32 = 1 << 16;
pub const DEFAULT_ENTRIES: u32 = 1024;

const CTRL_OFF: u64 = PAGE;
const DOORBELL_OFF: u64 = 2 * PAGE;
const SQ_OFF: u64 = 3 * PAGE;

/// Byte offsets of the control words inside the control page (one 128-byte line each, so the
/// words written by different sides never share a cache line or an adjacent-line prefetch pair).
pub const CTRL_SQ_TAIL: u64 = 0;
pub const CTRL_SQ_HEAD: u64 = 128;
pub const CTRL_SQ_BELL: u64 = 256;
pub const CTRL_SQ_SLEEPING: u64 = 260;
pub const CTRL_CQ_TAIL: u64 = 384;
pub const CTRL_CQ_HEAD: u64 = 512;
pub const CTRL_CQ_BELL: u64 = 640;
pub const CTRL_CQ_SLEEPERS: u64 = 644;
/// Non-zero once the daemon closed the session (value: a `desc::status` code).
pub const CTRL_SESSION_ERROR: u64 = 768;
/// Heartbeat bumped by the daemon's poller; lets a client tell a live daemon from a stuck one.
pub const CTRL_DAEMON_BEAT: u64 = 896;

/// The header page, as written by the daemon. Clients check it on attach.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingHeader {
    pub magic: u64,
    pub version: u32,
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub sq_desc_bytes: u32,
    pub cq_desc_bytes: u32,
    pub daemon_pid: u32,
    pub session_id: u64,
    pub ctrl_off: u64,
    pub doorbell_off: u64,
    pub sq_off: u64,
    pub cq_off: u64,
    pub total_bytes: u64,
    pub graph_off: u64,
}

#[derive(Debug, Error)]
pub enum RingError {
    #[error("ring entries must be a power of two in 1..={MAX_ENTRIES}, got sq={0} cq={1}")]
    Entries(u32, u32),
    #[error("ring memory is {have} bytes, layout needs {need}")]
    TooSmall { have: u64, need: u64 },
    #[error("ring magic {0:#x} is not commd's: is this a commd ring?")]
    Magic(u64),
    #[error(
        "ring ABI version {0} is not supported by this client (supports {RING_ABI_VERSION}); upgrade the older side"
    )]
    Version(u32),
    #[error("ring header describes an inconsistent layout")]
    Layout,
    #[error("mapping ring memory: {0}")]
    Map(#[from] std::io::Error),
}

/// Descriptor sizes as the header records them.
const SQ_DESC_BYTES: u32 = 64;
const CQ_DESC_BYTES: u32 = 32;
const _: () = assert!(std::mem::size_of::<SubmitDesc>() == SQ_DESC_BYTES as usize);
const _: () = assert!(std::mem::size_of::<CompletionDesc>() == CQ_DESC_BYTES as usize);

/// Ring geometry derived from the two entry counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingLayout {
    pub sq_entries: u32,
    pub cq_entries: u32,
    pub cq_off: u64,
    pub total_bytes: u64,
    /// Start of the graph doorbell area (`desc::graph_doorbell::AREA_BYTES`, page-aligned).
    pub graph_off: u64,
}

impl RingLayout {
    pub fn new(sq_entries: u32, cq_entries: u32) -> Result<Self, RingError> {
        let ok = |n: u32| n.is_power_of_two() && n <= MAX_ENTRIES;
        if !ok(sq_entries) || !ok(cq_entries) {
            return Err(RingError::Entries(sq_entries, cq_entries));
        }
        let sq_bytes = u64::from(sq_entries) * std::mem::size_of::<SubmitDesc>() as u64;
        let cq_off = (SQ_OFF + sq_bytes).div_ceil(PAGE) * PAGE;
        let cq_bytes = u64::from(cq_entries) * std::mem::size_of::<CompletionDesc>() as u64;
        let graph_off = (cq_off + cq_bytes).div_ceil(PAGE) * PAGE;
        let total_bytes = graph_off + crate::desc::graph_doorbell::AREA_BYTES;
        Ok(Self {
            sq_entries,
            cq_entries,
            cq_off,
            total_bytes,
            graph_off,
        })
    }

    pub fn header(&self, session_id: u64, daemon_pid: u32) -> RingHeader {
        RingHeader {
            magic: RING_MAGIC,
            version: RING_ABI_VERSION,
            sq_entries: self.sq_entries,
            cq_entries: self.cq_entries,
            sq_desc_bytes: SQ_DESC_BYTES,
            cq_desc_bytes: CQ_DESC_BYTES,
            daemon_pid,
            session_id,
            ctrl_off: CTRL_OFF,
            doorbell_off: DOORBELL_OFF,
            sq_off: SQ_OFF,
            cq_off: self.cq_off,
            total_bytes: self.total_bytes,
            graph_off: self.graph_off,
        }
    }
}

/// A mapped ring. Both sides use it; which words each side writes is documented above.
pub struct Ring {
    map: MmapRaw,
    layout: RingLayout,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring")
            .field("layout", &self.layout)
            .finish()
    }
}

impl Ring {
    /// Daemon side: maps `file` (already sized to `layout.total_bytes`) and writes the header.
    pub fn create(
        file: &File,
        layout: RingLayout,
        session_id: u64,
        daemon_pid: u32,
    ) -> Result<Self, RingError> {
        let have = file.metadata()?.len();
        if have < layout.total_bytes {
            return Err(RingError::TooSmall {
                have,
                need: layout.total_bytes,
            });
        }
        let map = MmapOptions::new()
            .len(usize_of(layout.total_bytes))
            .map_raw(file)?;
        let ring = Self { map, layout };
        let hdr = layout.header(session_id, daemon_pid);
        // SAFETY: the mapping is at least one page long (checked above), page-aligned, and
        // RingHeader is repr(C) plain integers smaller than a page.
        unsafe { std::ptr::write_volatile(ring.map.as_mut_ptr().cast::<RingHeader>(), hdr) };
        Ok(ring)
    }

    /// Client side: maps `file` and checks the header (magic, version, layout) against the size.
    pub fn attach(file: &File) -> Result<Self, RingError> {
        let have = file.metadata()?.len();
        if have < PAGE {
            return Err(RingError::TooSmall { have, need: PAGE });
        }
        let map = MmapOptions::new().len(usize_of(have)).map_raw(file)?;
        // SAFETY: the mapping is at least one page, page-aligned; RingHeader is plain integers.
        let hdr = unsafe { std::ptr::read_volatile(map.as_ptr().cast::<RingHeader>()) };
        if hdr.magic != RING_MAGIC {
            return Err(RingError::Magic(hdr.magic));
        }
        if hdr.version != RING_ABI_VERSION {
            return Err(RingError::Version(hdr.version));
        }
        let layout = RingLayout::new(hdr.sq_entries, hdr.cq_entries)?;
        if layout.header(hdr.session_id, hdr.daemon_pid) != hdr {
            return Err(RingError::Layout);
        }
        if have < layout.total_bytes {
            return Err(RingError::TooSmall {
                have,
                need: layout.total_bytes,
            });
        }
        Ok(Self { map, layout })
    }

    pub fn layout(&self) -> RingLayout {
        self.layout
    }

    pub fn header(&self) -> RingHeader {
        // SAFETY: the mapping holds at least the header page (checked at construction).
        unsafe { std::ptr::read_volatile(self.map.as_ptr().cast::<RingHeader>()) }
    }

    fn word32(&self, off: u64) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off < PAGE);
        // SAFETY: CTRL_OFF + off lies in the control page inside the mapping, is 4-byte aligned,
        // and the mapping lives as long as `self`. AtomicU32 has the layout of u32 and is the
        // intended way to share a word with another process.
        unsafe {
            &*self
                .map
                .as_ptr()
                .add(usize_of(CTRL_OFF + off))
                .cast::<AtomicU32>()
        }
    }

    fn word64(&self, off: u64) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off < PAGE);
        // SAFETY: as for `word32`, with 8-byte alignment.
        unsafe {
            &*self
                .map
                .as_ptr()
                .add(usize_of(CTRL_OFF + off))
                .cast::<AtomicU64>()
        }
    }

    pub fn sq_tail(&self) -> &AtomicU32 {
        self.word32(CTRL_SQ_TAIL)
    }
    pub fn sq_head(&self) -> &AtomicU32 {
        self.word32(CTRL_SQ_HEAD)
    }
    pub fn sq_bell(&self) -> &AtomicU32 {
        self.word32(CTRL_SQ_BELL)
    }
    pub fn sq_sleeping(&self) -> &AtomicU32 {
        self.word32(CTRL_SQ_SLEEPING)
    }
    pub fn cq_tail(&self) -> &AtomicU32 {
        self.word32(CTRL_CQ_TAIL)
    }
    pub fn cq_head(&self) -> &AtomicU32 {
        self.word32(CTRL_CQ_HEAD)
    }
    pub fn cq_bell(&self) -> &AtomicU32 {
        self.word32(CTRL_CQ_BELL)
    }
    pub fn cq_sleepers(&self) -> &AtomicU32 {
        self.word32(CTRL_CQ_SLEEPERS)
    }
    pub fn session_error(&self) -> &AtomicU32 {
        self.word32(CTRL_SESSION_ERROR)
    }
    pub fn daemon_beat(&self) -> &AtomicU64 {
        self.word64(CTRL_DAEMON_BEAT)
    }

    /// Doorbell counters of communicator slot `slot` (`desc::doorbell`): `(ready, done, error)`.
    /// `None` for a slot out of range.
    pub fn doorbell(&self, slot: u32) -> Option<(&AtomicU32, &AtomicU32, &AtomicU32)> {
        use crate::desc::doorbell::{DONE_OFF, ERROR_OFF, READY_OFF, SLOTS};
        if slot >= SLOTS {
            return None;
        }
        let at = |area: u64| {
            let off = DOORBELL_OFF + area + 4 * u64::from(slot);
            // SAFETY: DOORBELL_OFF + area + 4 * slot < DOORBELL_OFF + PAGE (slot < SLOTS = 256,
            // areas end at 3072), inside the mapping; 4-byte aligned; lives as long as `self`.
            unsafe { &*self.map.as_ptr().add(usize_of(off)).cast::<AtomicU32>() }
        };
        Some((at(READY_OFF), at(DONE_OFF), at(ERROR_OFF)))
    }

    /// Words of graph doorbell `slot` (`desc::graph_doorbell`): `(ready, done, error)` of one
    /// captured GPU op. `None` for a slot out of range.
    pub fn graph_doorbell(&self, slot: u32) -> Option<(&AtomicU32, &AtomicU32, &AtomicU32)> {
        use crate::desc::graph_doorbell::{DONE_OFF, ERROR_OFF, READY_OFF, SLOTS};
        if slot >= SLOTS {
            return None;
        }
        let at = |area: u64| {
            let off = self.layout.graph_off + area + 4 * u64::from(slot);
            // SAFETY: graph_off + area + 4 * slot < graph_off + AREA_BYTES <= total_bytes (slot
            // < SLOTS, areas of 4 * SLOTS bytes), inside the mapping; 4-byte aligned (graph_off
            // is page-aligned); lives as long as `self`.
            unsafe { &*self.map.as_ptr().add(usize_of(off)).cast::<AtomicU32>() }
        };
        Some((at(READY_OFF), at(DONE_OFF), at(ERROR_OFF)))
    }

    /// Address and length of the graph doorbell area in this process (page-aligned), for
    /// registering it with the GPU driver.
    pub fn graph_area(&self) -> (*mut u8, u64) {
        // SAFETY: graph_off + AREA_BYTES == total_bytes (see `RingLayout::new`).
        let p = unsafe { self.map.as_mut_ptr().add(usize_of(self.layout.graph_off)) };
        (p, crate::desc::graph_doorbell::AREA_BYTES)
    }

    /// The daemon's hint word of doorbell `slot` (`desc::doorbell::HINT_*` bits).
    pub fn doorbell_hint(&self, slot: u32) -> Option<&AtomicU32> {
        use crate::desc::doorbell::{HINT_OFF, SLOTS};
        if slot >= SLOTS {
            return None;
        }
        let off = DOORBELL_OFF + HINT_OFF + 4 * u64::from(slot);
        // SAFETY: HINT_OFF + 4 * slot < 4096 (slot < SLOTS = 256), inside the doorbell page,
        // which is inside the mapping; 4-byte aligned; lives as long as `self`.
        Some(unsafe { &*self.map.as_ptr().add(usize_of(off)).cast::<AtomicU32>() })
    }

    /// Address of the doorbell page in this process (page-aligned, one page), for registering it
    /// with the GPU driver.
    pub fn doorbell_page(&self) -> *mut u8 {
        // SAFETY: DOORBELL_OFF + PAGE <= SQ_OFF <= total_bytes (see the layout table).
        unsafe { self.map.as_mut_ptr().add(usize_of(DOORBELL_OFF)) }
    }

    /// Copies SQ slot `idx & mask` out of shared memory.
    pub fn read_sq(&self, idx: u32) -> SubmitDesc {
        let slot = u64::from(idx & (self.layout.sq_entries - 1));
        let off = SQ_OFF + slot * std::mem::size_of::<SubmitDesc>() as u64;
        // SAFETY: slot < sq_entries, so the 64-byte descriptor lies inside the SQ array, which
        // lies inside the mapping (layout checked at construction); the offset is 64-aligned.
        // Any bit pattern is a valid SubmitDesc (plain integers). A concurrent writer can only
        // make the copy inconsistent, which validation of the copy handles.
        unsafe {
            std::ptr::read_volatile(self.map.as_ptr().add(usize_of(off)).cast::<SubmitDesc>())
        }
    }

    pub fn write_sq(&self, idx: u32, d: &SubmitDesc) {
        let slot = u64::from(idx & (self.layout.sq_entries - 1));
        let off = SQ_OFF + slot * std::mem::size_of::<SubmitDesc>() as u64;
        // SAFETY: as in `read_sq`.
        unsafe {
            std::ptr::write_volatile(
                self.map
                    .as_mut_ptr()
                    .add(usize_of(off))
                    .cast::<SubmitDesc>(),
                *d,
            )
        }
    }

    pub fn read_cq(&self, idx: u32) -> CompletionDesc {
        let slot = u64::from(idx & (self.layout.cq_entries - 1));
        let off = self.layout.cq_off + slot * std::mem::size_of::<CompletionDesc>() as u64;
        // SAFETY: slot < cq_entries, the CQ array lies inside the mapping, offset 32-aligned.
        unsafe {
            std::ptr::read_volatile(
                self.map
                    .as_ptr()
                    .add(usize_of(off))
                    .cast::<CompletionDesc>(),
            )
        }
    }

    pub fn write_cq(&self, idx: u32, c: &CompletionDesc) {
        let slot = u64::from(idx & (self.layout.cq_entries - 1));
        let off = self.layout.cq_off + slot * std::mem::size_of::<CompletionDesc>() as u64;
        // SAFETY: as in `read_cq`.
        unsafe {
            std::ptr::write_volatile(
                self.map
                    .as_mut_ptr()
                    .add(usize_of(off))
                    .cast::<CompletionDesc>(),
                *c,
            )
        }
    }

    /// Rings a doorbell: bump the futex word and wake only if the other side sleeps.
    pub fn ring_bell(bell: &AtomicU32, sleeping: &AtomicU32) {
        std::sync::atomic::fence(Ordering::SeqCst);
        bell.fetch_add(1, Ordering::SeqCst);
        if sleeping.load(Ordering::SeqCst) != 0 {
            crate::futex::wake_all(bell);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd(len: u64) -> File {
        let fd = rustix::fs::memfd_create("ring-test", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let f = File::from(fd);
        f.set_len(len).unwrap();
        f
    }

    #[test]
    fn layout_is_page_aligned_and_disjoint() {
        for (s, c) in [(1, 1), (2, 64), (1024, 1024), (MAX_ENTRIES, MAX_ENTRIES)] {
            let l = RingLayout::new(s, c).unwrap();
            assert_eq!(l.cq_off % PAGE, 0);
            assert!(l.cq_off >= SQ_OFF + u64::from(s) * 64);
            assert!(l.total_bytes >= l.cq_off + u64::from(c) * 32);
            assert_eq!(l.total_bytes % PAGE, 0);
        }
        assert!(RingLayout::new(3, 4).is_err());
        assert!(RingLayout::new(0, 4).is_err());
        assert!(RingLayout::new(4, MAX_ENTRIES * 2).is_err());
    }

    #[test]
    fn create_attach_round_trip() {
        let l = RingLayout::new(8, 16).unwrap();
        let f = memfd(l.total_bytes);
        let d = Ring::create(&f, l, 42, 7).unwrap();
        let c = Ring::attach(&f).unwrap();
        assert_eq!(c.header().session_id, 42);
        assert_eq!(c.layout(), l);
        for i in 0..20u32 {
            let desc = SubmitDesc {
                user_data: u64::from(i),
                count: 3,
                ..Default::default()
            };
            c.write_sq(i, &desc);
            assert_eq!(d.read_sq(i), desc);
            let comp = CompletionDesc {
                user_data: u64::from(i),
                status: 1,
                ..Default::default()
            };
            d.write_cq(i, &comp);
            assert_eq!(c.read_cq(i), comp);
        }
        c.sq_tail().store(5, Ordering::Release);
        assert_eq!(d.sq_tail().load(Ordering::Acquire), 5);
        // Graph doorbells: the last slot's words are shared, distinct, and out-of-range slots
        // are refused.
        use crate::desc::graph_doorbell::SLOTS;
        let (r, dn, e) = c.graph_doorbell(SLOTS - 1).unwrap();
        r.store(1, Ordering::Release);
        dn.store(2, Ordering::Release);
        e.store(3, Ordering::Release);
        let (r2, d2, e2) = d.graph_doorbell(SLOTS - 1).unwrap();
        assert_eq!(
            (
                r2.load(Ordering::Acquire),
                d2.load(Ordering::Acquire),
                e2.load(Ordering::Acquire)
            ),
            (1, 2, 3)
        );
        assert!(d.graph_doorbell(SLOTS).is_none());
        let (p, len) = c.graph_area();
        assert_eq!(p as usize % usize_of(PAGE), 0);
        assert_eq!(l.graph_off + len, l.total_bytes);
    }

    #[test]
    fn attach_rejects_bad_header() {
        let l = RingLayout::new(8, 8).unwrap();
        let f = memfd(l.total_bytes);
        assert!(matches!(Ring::attach(&f), Err(RingError::Magic(0))));
        let d = Ring::create(&f, l, 1, 1).unwrap();
        let mut h = d.header();
        h.version = 99;
        // SAFETY: test writes a header into its own mapping.
        unsafe { std::ptr::write_volatile(d.map.as_mut_ptr().cast::<RingHeader>(), h) };
        assert!(matches!(Ring::attach(&f), Err(RingError::Version(99))));
        h.version = RING_ABI_VERSION;
        h.sq_entries = 1 << 20;
        // SAFETY: as above.
        unsafe { std::ptr::write_volatile(d.map.as_mut_ptr().cast::<RingHeader>(), h) };
        assert!(matches!(Ring::attach(&f), Err(RingError::Entries(..))));
        let small = memfd(100);
        assert!(matches!(
            Ring::attach(&small),
            Err(RingError::TooSmall { .. })
        ));
    }
}
