//! The client's registration cache: device allocations registered with the daemon, keyed by
//! their base address, so the per-op lookup of a tensor pointer is one ordered-map search (no
//! driver query of the allocation's range, no hashing of a buffer id found by such a query).
//!
//! An entry also keeps the allocation's `CU_POINTER_ATTRIBUTE_BUFFER_ID` (unique per allocation
//! for the process lifetime): the caller validates a hit by reading that one attribute, so a
//! range that was freed and re-allocated is never taken for the old registration. This module
//! owns only the map; it makes no driver calls.

use std::collections::BTreeMap;

/// One registered allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reg {
    pub base: u64,
    pub size: u64,
    pub buffer_id: u64,
    pub mem_id: u32,
    pub device: i32,
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
            mem_id: id as u32,
            device: 0,
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
