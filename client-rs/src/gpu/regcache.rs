//! The client's registration cache: device allocations registered with the daemon, keyed by
//! their base address, so the per-op lookup of a tensor pointer is one ordered-map search (no
//! driver query of the allocation's range, no hashing of a buffer id found by such a query).
//!
//! An entry also keeps the allocation's `CU_POINTER_ATTRIBUTE_BUFFER_ID` (unique per allocation
//! for the process lifetime): the caller validates a hit by reading that one attribute, so a
//! range that was freed and re-allocated is never taken for the old registration. This module
//! owns only the maps; it makes no driver calls.
//!
//! cuMem memory (PyTorch's expandable segments) is registered as its whole reserved address
//! range (`Reg::vmm`), plus the physical pieces mapped in it, which the daemon maps at the same
//! offsets of its mirror. [`missing_pieces`] finds the pieces a buffer needs that the daemon
//! does not have yet (or has stale: the client unmapped and remapped that part).

use std::collections::BTreeMap;

/// One registered allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reg {
    pub base: u64,
    pub size: u64,
    pub buffer_id: u64,
    pub mem_id: u32,
    pub device: i32,
    /// A cuMem reserved range (no buffer id of its own: its pieces are checked instead).
    pub vmm: bool,
}

/// A piece of a cuMem range as last registered: its size and the driver's buffer id of its
/// mapping (a remapped piece gets a new one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub bytes: u64,
    pub buffer_id: u64,
}

/// What the driver reports of the mapping holding an address: (mapping base, size, buffer id).
pub type Mapping = (u64, u64, u64);

/// The pieces (offset in the range `(base, size)`, piece) that `[ptr, ptr + bytes)`
/// needs and `cached` lacks or holds stale. `current_id(addr)` is the buffer id the driver
/// reports at `addr` now (`None`: nothing mapped); `mapping(addr)` describes the mapping
/// holding `addr`. At most `max` pieces; more is an error, as is a mapping that does not hold
/// `addr` or lies outside the range.
pub fn missing_pieces(
    cached: &BTreeMap<u64, Piece>,
    (base, size): (u64, u64),
    ptr: u64,
    bytes: u64,
    mut current_id: impl FnMut(u64) -> Option<u64>,
    mut mapping: impl FnMut(u64) -> Result<Mapping, String>,
    max: usize,
) -> Result<Vec<(u64, Piece)>, String> {
    let end = ptr
        .checked_add(bytes)
        .filter(|e| ptr >= base && *e <= base.saturating_add(size))
        .ok_or_else(|| {
            format!(
                "[{ptr:#x}, +{bytes}) is not inside the cuMem range at {base:#x} of {size} bytes"
            )
        })?;
    let mut out = Vec::new();
    let mut at = ptr;
    while at < end {
        if let Some((off, p)) = cached.range(..=at - base).next_back()
            && at - base < off.saturating_add(p.bytes)
            && current_id(base + off) == Some(p.buffer_id)
        {
            at = base + off + p.bytes;
            continue;
        }
        let (mb, ms, id) = mapping(at)?;
        if ms == 0 || mb > at || at >= mb.saturating_add(ms) {
            return Err(format!(
                "the driver's mapping for {at:#x} ({ms} bytes at {mb:#x}) does not hold it"
            ));
        }
        if mb < base || mb.saturating_add(ms) > base.saturating_add(size) {
            return Err(format!(
                "the mapping of {ms} bytes at {mb:#x} lies outside its cuMem range at {base:#x} of {size} bytes"
            ));
        }
        if out.len() == max {
            return Err(format!(
                "the buffer spans more than {max} cuMem pieces not yet registered"
            ));
        }
        out.push((
            mb - base,
            Piece {
                bytes: ms,
                buffer_id: id,
            },
        ));
        at = mb + ms;
    }
    Ok(out)
}

/// Records `p` at `off` in `cached`, dropping the cached pieces it overlaps.
pub fn insert_piece(cached: &mut BTreeMap<u64, Piece>, off: u64, p: Piece) {
    let end = off.saturating_add(p.bytes);
    let stale: Vec<u64> = cached
        .range(..end)
        .rev()
        .take_while(|(o, q)| o.saturating_add(q.bytes) > off)
        .map(|(o, _)| *o)
        .collect();
    for o in stale {
        cached.remove(&o);
    }
    cached.insert(off, p);
}

impl Reg {
    fn end(&self) -> u64 {
        self.base.saturating_add(self.size)
    }

    fn overlaps(&self, base: u64, size: u64) -> bool {
        self.base < base.saturating_add(size) && base < self.end()
    }
}

/// Registered allocations by base address. Entries never overlap: inserting one drops (and
/// returns) every entry it overlaps, which the caller deregisters.
#[derive(Default, Debug)]
pub struct RangeCache {
    by_base: BTreeMap<u64, Reg>,
}

impl RangeCache {
    /// The registration whose allocation holds all of `[ptr, ptr + bytes)`, if any. `None` also
    /// when `ptr` lies in a cached allocation but the range runs past its end (the caller then
    /// asks the driver, which gives the precise error).
    pub fn lookup(&self, ptr: u64, bytes: u64) -> Option<Reg> {
        let (_, r) = self.by_base.range(..=ptr).next_back()?;
        let end = ptr.checked_add(bytes)?;
        (ptr < r.end() && end <= r.end()).then_some(*r)
    }

    /// Caches `r`; returns the entries it replaces (overlapping ranges: their allocations were
    /// freed, since live allocations never overlap).
    pub fn insert(&mut self, r: Reg) -> Vec<Reg> {
        let stale = self.overlapping(r.base, r.size);
        for s in &stale {
            self.by_base.remove(&s.base);
        }
        self.by_base.insert(r.base, r);
        stale
    }

    /// Drops every entry overlapping `[base, base + size)` and returns them.
    pub fn remove_overlapping(&mut self, base: u64, size: u64) -> Vec<Reg> {
        let stale = self.overlapping(base, size);
        for s in &stale {
            self.by_base.remove(&s.base);
        }
        stale
    }

    fn overlapping(&self, base: u64, size: u64) -> Vec<Reg> {
        let end = base.saturating_add(size.max(1));
        // Entries starting before `end`, walked backwards until one ends at or before `base`
        // (entries do not overlap each other, so no earlier one can reach `base`).
        let mut out = Vec::new();
        for (_, r) in self.by_base.range(..end).rev() {
            if r.overlaps(base, size.max(1)) {
                out.push(*r);
            } else if r.end() <= base {
                break;
            }
        }
        out
    }

    pub fn len(&self) -> usize {
        self.by_base.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_base.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(base: u64, size: u64, id: u64) -> Reg {
        Reg {
            base,
            size,
            buffer_id: id,
            mem_id: u32::try_from(id).unwrap(),
            device: 0,
            vmm: false,
        }
    }

    /// A fake driver: mappings by base -> (size, buffer id).
    struct FakeVmm(BTreeMap<u64, (u64, u64)>);

    impl FakeVmm {
        fn at(&self, a: u64) -> Option<(u64, u64, u64)> {
            let (b, (s, id)) = self.0.range(..=a).next_back()?;
            (a < b + s).then_some((*b, *s, *id))
        }
        fn walk(
            &self,
            cached: &BTreeMap<u64, Piece>,
            ptr: u64,
            bytes: u64,
            max: usize,
        ) -> Result<Vec<(u64, Piece)>, String> {
            missing_pieces(
                cached,
                (0x1000, 0x1000),
                ptr,
                bytes,
                |a| self.at(a).filter(|m| m.0 == a).map(|m| m.2),
                |a| self.at(a).ok_or_else(|| format!("{a:#x} not mapped")),
                max,
            )
        }
    }

    fn piece(bytes: u64, buffer_id: u64) -> Piece {
        Piece { bytes, buffer_id }
    }

    #[test]
    fn vmm_walk_registers_each_piece_once() {
        // The range is [0x1000, 0x2000), pieces of 0x100 at 0x1000, 0x1100, 0x1200.
        let drv = FakeVmm(
            [
                (0x1000, (0x100, 1)),
                (0x1100, (0x100, 2)),
                (0x1200, (0x100, 3)),
            ]
            .into(),
        );
        let mut cached = BTreeMap::new();
        let need = drv.walk(&cached, 0x1080, 0x100, 8).unwrap();
        assert_eq!(need, vec![(0, piece(0x100, 1)), (0x100, piece(0x100, 2))]);
        for (o, p) in need {
            insert_piece(&mut cached, o, p);
        }
        assert_eq!(
            drv.walk(&cached, 0x1000, 0x200, 8).unwrap(),
            vec![],
            "all cached"
        );
        assert_eq!(
            drv.walk(&cached, 0x1100, 0x180, 8).unwrap(),
            vec![(0x200, piece(0x100, 3))],
            "only the new piece"
        );
        assert_eq!(
            drv.walk(&cached, 0x1050, 0, 8).unwrap(),
            vec![],
            "empty range"
        );
    }

    #[test]
    fn vmm_walk_replaces_remapped_pieces_and_rejects_bad_ranges() {
        let mut drv = FakeVmm([(0x1000, (0x100, 1)), (0x1100, (0x100, 2))].into());
        let mut cached = BTreeMap::new();
        for (o, p) in drv.walk(&cached, 0x1000, 0x200, 8).unwrap() {
            insert_piece(&mut cached, o, p);
        }
        // The client unmapped both pieces and mapped one of 0x200 (a new buffer id).
        drv.0 = [(0x1000, (0x200, 9))].into();
        let need = drv.walk(&cached, 0x1100, 0x10, 8).unwrap();
        assert_eq!(need, vec![(0, piece(0x200, 9))]);
        insert_piece(&mut cached, 0, need[0].1);
        assert_eq!(cached.len(), 1, "both old pieces dropped");
        assert_eq!(drv.walk(&cached, 0x1000, 0x200, 8).unwrap(), vec![]);
        // Nothing mapped at 0x1300.
        assert!(
            drv.walk(&cached, 0x1180, 0x200, 8)
                .unwrap_err()
                .contains("not mapped")
        );
        // Outside the range, or overflowing.
        assert!(drv.walk(&cached, 0xfff, 2, 8).is_err());
        assert!(drv.walk(&cached, 0x1f00, 0x200, 8).is_err());
        assert!(drv.walk(&cached, 0x1000, u64::MAX, 8).is_err());
        // Too many new pieces.
        drv.0 = (0..16)
            .map(|i| (0x1000 + i * 0x10, (0x10, 100 + i)))
            .collect();
        assert!(
            drv.walk(&BTreeMap::new(), 0x1000, 0x100, 4)
                .unwrap_err()
                .contains("more than 4")
        );
        assert_eq!(
            drv.walk(&BTreeMap::new(), 0x1000, 0x100, 16).unwrap().len(),
            16
        );
    }

    #[test]
    fn vmm_walk_rejects_a_mapping_outside_the_range() {
        // A driver that reports a mapping straddling the range's end, or one that does not
        // hold the address asked about.
        for (m, why) in [
            ((0x1f00, 0x200, 5), "outside"),
            ((0x1000, 0x10, 5), "does not hold"),
        ] {
            let r = missing_pieces(
                &BTreeMap::new(),
                (0x1000, 0x1000),
                0x1f80,
                0x10,
                |_| None,
                |_| Ok(m),
                8,
            );
            assert!(r.unwrap_err().contains(why), "{why}");
        }
    }

    #[test]
    fn lookup_finds_the_allocation_holding_the_range() {
        let mut c = RangeCache::default();
        assert!(c.insert(reg(0x1000, 0x1000, 1)).is_empty());
        assert!(c.insert(reg(0x4000, 0x100, 2)).is_empty());
        assert_eq!(c.lookup(0x1000, 0x1000).map(|r| r.buffer_id), Some(1));
        assert_eq!(c.lookup(0x1800, 0x10).map(|r| r.buffer_id), Some(1));
        assert_eq!(c.lookup(0x1fff, 1).map(|r| r.buffer_id), Some(1));
        assert_eq!(c.lookup(0x40ff, 1).map(|r| r.buffer_id), Some(2));
        assert_eq!(c.lookup(0x4000, 0).map(|r| r.buffer_id), Some(2));
    }

    #[test]
    fn lookup_misses_outside_and_past_the_end() {
        let mut c = RangeCache::default();
        c.insert(reg(0x1000, 0x1000, 1));
        assert_eq!(c.lookup(0xfff, 1), None);
        assert_eq!(c.lookup(0x2000, 1), None, "one past the end");
        assert_eq!(c.lookup(0x1f00, 0x101), None, "runs past the end");
        assert_eq!(c.lookup(0x1f00, u64::MAX), None, "overflow");
        assert_eq!(c.lookup(0x3000, 1), None, "in a gap");
        assert!(RangeCache::default().lookup(0, 0).is_none());
    }

    #[test]
    fn insert_replaces_overlapping_entries() {
        let mut c = RangeCache::default();
        c.insert(reg(0x1000, 0x1000, 1));
        c.insert(reg(0x2000, 0x1000, 2));
        c.insert(reg(0x3000, 0x1000, 3));
        c.insert(reg(0x9000, 0x1000, 9));
        // A new allocation spanning the end of 1, all of 2, the start of 3.
        let mut stale: Vec<u64> = c
            .insert(reg(0x1800, 0x2000, 4))
            .iter()
            .map(|r| r.buffer_id)
            .collect();
        stale.sort();
        assert_eq!(stale, vec![1, 2, 3]);
        assert_eq!(c.len(), 2);
        assert_eq!(c.lookup(0x1800, 0x2000).map(|r| r.buffer_id), Some(4));
        assert_eq!(c.lookup(0x9000, 1).map(|r| r.buffer_id), Some(9));
        // Adjacent ranges do not overlap.
        assert!(c.insert(reg(0x3800, 0x800, 5)).is_empty());
        assert!(c.insert(reg(0x1000, 0x800, 6)).is_empty());
        assert_eq!(c.len(), 4);
    }

    #[test]
    fn same_base_new_buffer_replaces_the_old_one() {
        let mut c = RangeCache::default();
        c.insert(reg(0x1000, 0x1000, 1));
        let stale = c.insert(reg(0x1000, 0x2000, 7));
        assert_eq!(stale.len(), 1);
        assert_eq!(stale[0].buffer_id, 1);
        assert_eq!(c.lookup(0x2800, 8).map(|r| r.buffer_id), Some(7));
        assert_eq!(c.remove_overlapping(0x2fff, 1).len(), 1);
        assert!(c.is_empty());
    }

    #[test]
    fn random_operations_match_a_linear_model() {
        // A small deterministic LCG: no dev-dependency needed.
        let mut s: u64 = 0x9e3779b97f4a7c15;
        let mut next = |m: u64| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (s >> 33) % m
        };
        let mut c = RangeCache::default();
        let mut model: Vec<Reg> = Vec::new();
        for id in 0..2000u64 {
            let base = next(64) * 0x100;
            let size = (next(8) + 1) * 0x80;
            let r = reg(base, size, id);
            let mut stale: Vec<u64> = c.insert(r).iter().map(|x| x.buffer_id).collect();
            let mut want: Vec<u64> = model
                .iter()
                .filter(|m| m.overlaps(base, size))
                .map(|m| m.buffer_id)
                .collect();
            model.retain(|m| !m.overlaps(base, size));
            model.push(r);
            stale.sort();
            want.sort();
            assert_eq!(stale, want);
            let p = next(64 * 0x100 + 0x400);
            let b = next(0x200);
            let want = model
                .iter()
                .find(|m| p >= m.base && p < m.end() && p + b <= m.end())
                .map(|m| m.buffer_id);
            assert_eq!(
                c.lookup(p, b).map(|r| r.buffer_id),
                want,
                "lookup({p:#x}, {b})"
            );
        }
        assert_eq!(c.len(), model.len());
    }
}
