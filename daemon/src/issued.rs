//! The unique ids this daemon issued and that no communicator used yet.
//!
//! An id is single-use: it is taken when the first rank joins its communicator here. Ids never
//! used expire after [`TTL`]. Bounded per uid: a uid that holds its maximum of unused ids loses
//! its oldest one to each new one, so one user can neither grow the table without limit nor
//! touch other users' ids. Every operation costs O(1) amortized: no call scans the table, so
//! many calls grow neither the daemon's memory nor the time of each call. Owns no daemon state
//! beyond the table.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Unused ids are forgotten after a day.
pub const TTL: Duration = Duration::from_secs(86_400);

#[derive(Debug, Default)]
pub struct Issued {
    /// token -> (issued at, uid): the live ids.
    live: HashMap<[u8; 16], (Instant, u32)>,
    /// Per uid, its ids in issue order (entries of ids already taken are skipped lazily).
    order: HashMap<u32, VecDeque<([u8; 16], Instant)>>,
    /// Live ids per uid.
    count: HashMap<u32, usize>,
}

impl Issued {
    /// Records `token` for `uid`; returns how many of `uid`'s oldest ids were dropped to stay
    /// within `cap` (at least 1) or because they expired.
    pub fn insert(&mut self, uid: u32, token: [u8; 16], now: Instant, cap: usize) -> usize {
        let cap = cap.max(1);
        let mut dropped = 0;
        let q = self.order.entry(uid).or_default();
        while let Some(&(t, at)) = q.front() {
            let live = self.live.get(&t).is_some_and(|&(a, _)| a == at);
            let n = self.count.get(&uid).copied().unwrap_or(0);
            if !live {
                q.pop_front(); // taken already
            } else if now.duration_since(at) >= TTL || n >= cap {
                q.pop_front();
                self.live.remove(&t);
                if let Some(c) = self.count.get_mut(&uid) {
                    *c = c.saturating_sub(1);
                }
                dropped += 1;
            } else {
                break;
            }
        }
        q.push_back((token, now));
        self.live.insert(token, (now, uid));
        *self.count.entry(uid).or_default() += 1;
        dropped
    }

    /// Takes `token` (single use): `true` if it was issued here, unused and not expired.
    pub fn take(&mut self, token: &[u8; 16], now: Instant) -> bool {
        let Some((at, uid)) = self.live.remove(token) else {
            return false;
        };
        if let Some(c) = self.count.get_mut(&uid) {
            *c = c.saturating_sub(1);
        }
        now.duration_since(at) < TTL
    }

    /// Unused ids held by `uid`.
    pub fn held_by(&self, uid: u32) -> usize {
        self.count.get(&uid).copied().unwrap_or(0)
    }

    /// Entries kept in all (live ids plus not yet skipped entries of taken ones).
    pub fn footprint(&self) -> usize {
        self.live.len() + self.order.values().map(VecDeque::len).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(i: u32) -> [u8; 16] {
        let mut t = [0u8; 16];
        t[..4].copy_from_slice(&i.to_le_bytes());
        t
    }

    #[test]
    fn ids_are_single_use_and_expire() {
        let mut s = Issued::default();
        let t0 = Instant::now();
        s.insert(7, tok(1), t0, 10);
        assert!(s.take(&tok(1), t0));
        assert!(!s.take(&tok(1), t0), "single use");
        s.insert(7, tok(2), t0, 10);
        assert!(!s.take(&tok(2), t0 + TTL), "expired");
        assert!(!s.take(&tok(3), t0), "never issued");
    }

    #[test]
    fn one_uid_is_capped_and_never_touches_another_uids_ids() {
        let mut s = Issued::default();
        let t0 = Instant::now();
        s.insert(1, tok(1_000_000), t0, 4);
        for i in 0..100_000u32 {
            s.insert(2, tok(i), t0, 4);
        }
        assert_eq!(s.held_by(2), 4);
        assert!(s.footprint() <= 2 * (4 + 1), "footprint {}", s.footprint());
        assert!(s.take(&tok(99_999), t0), "the newest ids survive");
        assert!(!s.take(&tok(0), t0), "the oldest were dropped");
        assert!(s.take(&tok(1_000_000), t0), "uid 1's id untouched");
    }

    #[test]
    fn normal_use_keeps_the_table_small() {
        // Issue an id, use it, many times over: the lazily skipped entries do not pile up.
        let mut s = Issued::default();
        let t0 = Instant::now();
        for i in 0..10_000u32 {
            s.insert(5, tok(i), t0, 4096);
            assert!(s.take(&tok(i), t0));
        }
        assert!(s.footprint() <= 2, "footprint {}", s.footprint());
    }
}
