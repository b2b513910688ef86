//! The switch's per-session aggregation state: the exact per-slot, per-set semantics of the
//! SwitchML data plane (bitmaps, counters, write-then-add, shadow sets), free of I/O so it is
//! tested on its own. `commd switch` feeds it packets and sends what it returns.

use super::packet::{HEADER_BYTES, Header, SLOTS};

/// What to do with a packet.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A new contribution that did not complete the slot: no reply.
    Absorbed,
    /// The last contribution: send the result to every worker of the session.
    Complete,
    /// A retransmission to a completed slot: send the result back to this worker only.
    Resend,
    /// A retransmission to a slot still waiting for others: drop it.
    DupDropped,
    /// A packet of an earlier round that arrived after its worker moved on (possible only when
    /// the network duplicates or reorders): dropped. The reference switch would add it.
    Stale,
}

#[derive(Clone, Default)]
struct SetState {
    bitmap: u32,
    count: u32,
    e0: i8,
    e1: i8,
    tsi: u32,
    /// tsi of the last round completed on this set.
    done_tsi: Option<u32>,
    vals: Vec<i32>,
}

/// Counters per slot (as metrics: contributions, completions, duplicates).
#[derive(Clone, Copy, Debug, Default)]
pub struct SlotCounters {
    pub packets: u64,
    pub completions: u64,
    pub duplicates: u64,
    pub stale: u64,
}

/// One session's slot pool.
pub struct Pool {
    workers: u32,
    values: usize,
    sets: Vec<[SetState; 2]>,
    pub slot_counters: Vec<SlotCounters>,
}

impl Pool {
    /// A pool for `workers` workers (1..=32) and `values` int32 per packet; `slots` aggregators.
    pub fn new(workers: u32, values: usize, slots: usize) -> Self {
        let slots = slots.clamp(1, SLOTS);
        Self {
            workers,
            values,
            sets: (0..slots)
                .map(|_| {
                    [
                        SetState {
                            vals: vec![0; values],
                            ..Default::default()
                        },
                        SetState {
                            vals: vec![0; values],
                            ..Default::default()
                        },
                    ]
                })
                .collect(),
            slot_counters: vec![SlotCounters::default(); slots],
        }
    }

    pub fn workers(&self) -> u32 {
        self.workers
    }

    pub fn values(&self) -> usize {
        self.values
    }

    pub fn slots(&self) -> usize {
        self.sets.len()
    }

    /// Whether a parsed packet fits this pool (its payload size, and a slot the pool has):
    /// [`Pool::on_packet`]'s precondition, checked by the server for every packet.
    pub fn fits(&self, h: &Header) -> bool {
        h.size.values() == self.values && usize::from(h.slot) < self.sets.len()
    }

    /// Applies packet `pkt` (header `h`, already parsed, [`Pool::fits`]) from worker `w`.
    pub fn on_packet(&mut self, w: u32, h: &Header, pkt: &[u8]) -> Verdict {
        let slot = usize::from(h.slot);
        let set = usize::from(h.set & 1);
        let bit = 1u32 << w;
        let c = &mut self.slot_counters[slot];
        c.packets += 1;
        let [s0, s1] = &mut self.sets[slot];
        let (cur, other) = if set == 0 { (s0, s1) } else { (s1, s0) };
        if cur.bitmap & bit != 0 {
            c.duplicates += 1;
            return if cur.count >= self.workers {
                Verdict::Resend
            } else {
                Verdict::DupDropped
            };
        }
        let first = cur.bitmap == 0;
        // A new round on a set always finds it empty (every worker left it for the other set
        // before anyone can come back), and all packets of one round carry the same tsi: a
        // packet that finds a completed set, or another round's tsi, is a late copy.
        // A late copy can also find the set empty again, once every worker left it: then it
        // carries the tsi of the round last completed here.
        if (!first && (cur.count >= self.workers || cur.tsi != h.tsi))
            || (first && cur.done_tsi == Some(h.tsi))
        {
            c.stale += 1;
            return Verdict::Stale;
        }
        cur.bitmap |= bit;
        other.bitmap &= !bit;
        let vals = &pkt[HEADER_BYTES..];
        if first {
            cur.count = 1;
            cur.tsi = h.tsi;
            cur.e0 = h.e0;
            cur.e1 = h.e1;
            for (v, b) in cur.vals.iter_mut().zip(vals.chunks_exact(4)) {
                *v = i32::from_be_bytes([b[0], b[1], b[2], b[3]]);
            }
        } else {
            cur.count += 1;
            cur.e0 = cur.e0.max(h.e0);
            cur.e1 = cur.e1.max(h.e1);
            for (v, b) in cur.vals.iter_mut().zip(vals.chunks_exact(4)) {
                *v = v.wrapping_add(i32::from_be_bytes([b[0], b[1], b[2], b[3]]));
            }
        }
        if cur.count == self.workers {
            cur.done_tsi = Some(cur.tsi);
            c.completions += 1;
            Verdict::Complete
        } else {
            Verdict::Absorbed
        }
    }

    /// Writes the result of `h`'s slot and set into `out` (a packet of `h.wire_len()` bytes):
    /// `job` and `tsi` from `h` (the completing or retransmitted packet), the exponent maxima,
    /// the sums.
    pub fn write_result(&self, h: &Header, out: &mut [u8]) {
        let s = &self.sets[usize::from(h.slot)][usize::from(h.set & 1)];
        let mut r = *h;
        r.e0 = s.e0;
        r.e1 = s.e1;
        r.write(out);
        super::packet::put_values(
            &mut out[HEADER_BYTES..HEADER_BYTES + self.values * 4],
            &s.vals,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::super::packet::{PacketSize, get_values, put_values};
    use super::*;

    fn pkt(slot: u16, set: u8, e0: i8, vals: &[i32]) -> (Header, Vec<u8>) {
        let h = Header {
            size: PacketSize::Mtu256,
            job: 1,
            tsi: u32::from(slot),
            slot,
            set,
            e0,
            e1: -e0,
        };
        let mut b = vec![0u8; h.wire_len()];
        h.write(&mut b);
        let mut v = vals.to_vec();
        v.resize(64, 0);
        put_values(&mut b[HEADER_BYTES..], &v);
        (h, b)
    }

    fn result(p: &Pool, h: &Header) -> (Header, Vec<i32>) {
        let mut b = vec![0u8; h.wire_len()];
        p.write_result(h, &mut b);
        let mut v = vec![0i32; 64];
        get_values(&b[HEADER_BYTES..], &mut v);
        (Header::parse(&b).unwrap(), v)
    }

    #[test]
    fn write_then_add_completes_on_the_last_worker_with_exponent_maxima() {
        let mut p = Pool::new(3, 64, 16);
        let (h0, b0) = pkt(2, 0, -5, &[1, i32::MAX]);
        let (h1, b1) = pkt(2, 0, 3, &[10, 1]);
        let (h2, b2) = pkt(2, 0, 1, &[100, 0]);
        assert_eq!(p.on_packet(0, &h0, &b0), Verdict::Absorbed);
        assert_eq!(p.on_packet(1, &h1, &b1), Verdict::Absorbed);
        assert_eq!(p.on_packet(2, &h2, &b2), Verdict::Complete);
        let (rh, v) = result(&p, &h2);
        assert_eq!((rh.e0, rh.e1), (3, 5));
        assert_eq!(&v[..2], &[111, i32::MIN]); // wrapping
    }

    #[test]
    fn duplicates_are_dropped_before_completion_and_answered_after() {
        let mut p = Pool::new(2, 64, 4);
        let (h0, b0) = pkt(1, 1, 0, &[5]);
        let (h1, b1) = pkt(1, 1, 0, &[7]);
        assert_eq!(p.on_packet(0, &h0, &b0), Verdict::Absorbed);
        assert_eq!(p.on_packet(0, &h0, &b0), Verdict::DupDropped);
        assert_eq!(p.on_packet(1, &h1, &b1), Verdict::Complete);
        assert_eq!(p.on_packet(0, &h0, &b0), Verdict::Resend);
        assert_eq!(result(&p, &h0).1[0], 12, "a duplicate changes nothing");
        assert_eq!(p.slot_counters[1].duplicates, 2);
    }

    #[test]
    fn the_next_round_on_the_other_set_starts_fresh_and_keeps_the_shadow_result() {
        let mut p = Pool::new(2, 64, 4);
        for (w, v) in [(0, 1), (1, 2)] {
            let (h, b) = pkt(0, 0, 0, &[v]);
            p.on_packet(w, &h, &b);
        }
        // Worker 0 got round 0's result and moves on to set 1; worker 1 lost the result and
        // retransmits round 0, which must still be answered from set 0.
        let (h, b) = pkt(0, 1, 0, &[40]);
        assert_eq!(p.on_packet(0, &h, &b), Verdict::Absorbed);
        let (h0, b0) = pkt(0, 0, 0, &[2]);
        assert_eq!(p.on_packet(1, &h0, &b0), Verdict::Resend);
        assert_eq!(result(&p, &h0).1[0], 3);
        let (h, b) = pkt(0, 1, 0, &[2]);
        assert_eq!(p.on_packet(1, &h, &b), Verdict::Complete);
        assert_eq!(result(&p, &h).1[0], 42);
        // Round 2 on set 0 again (a new packet id): bitmap 0 was cleared bit by bit, so the
        // first packet writes.
        let round2 = |v: i32| {
            let (mut h, mut b) = pkt(0, 0, 0, &[v]);
            h.tsi = 2;
            h.write(&mut b);
            (h, b)
        };
        let (h, b) = round2(1000);
        assert_eq!(p.on_packet(1, &h, &b), Verdict::Absorbed);
        let (h, b) = round2(1);
        assert_eq!(p.on_packet(0, &h, &b), Verdict::Complete);
        assert_eq!(result(&p, &h).1[0], 1001);
    }

    #[test]
    fn a_late_copy_of_an_earlier_round_does_not_change_a_completed_result() {
        let mut p = Pool::new(3, 64, 4);
        let (h, b) = pkt(0, 0, 0, &[1]);
        for w in 0..3 {
            p.on_packet(w, &h, &b);
        }
        // Worker 0 moved on to set 1 (clearing its bit in set 0); then a delayed duplicate of
        // its round-0 packet arrives: it must not be added to the round-0 result that workers
        // 1 and 2 may still ask for.
        let (h1, b1) = pkt(0, 1, 0, &[9]);
        assert_eq!(p.on_packet(0, &h1, &b1), Verdict::Absorbed);
        assert_eq!(p.on_packet(0, &h, &b), Verdict::Stale);
        assert_eq!(p.on_packet(1, &h, &b), Verdict::Resend);
        assert_eq!(result(&p, &h).1[0], 3);
        // Another round's tsi on a partially filled set is refused too.
        let (mut h2, mut b2) = pkt(0, 1, 0, &[5]);
        h2.tsi = 77;
        h2.write(&mut b2);
        assert_eq!(p.on_packet(1, &h2, &b2), Verdict::Stale);
        assert_eq!(p.slot_counters[0].stale, 2);
        // Once everyone left set 0, a late copy of its round finds it empty: still stale, and
        // the next round on set 0 (another tsi) starts fresh.
        let (h2, b2) = pkt(0, 1, 0, &[1]);
        for w in 1..3 {
            p.on_packet(w, &h2, &b2);
        }
        assert_eq!(p.on_packet(2, &h, &b), Verdict::Stale);
        let (mut h3, mut b3) = pkt(0, 0, 0, &[4]);
        h3.tsi = 1000;
        h3.write(&mut b3);
        assert_eq!(p.on_packet(2, &h3, &b3), Verdict::Absorbed);
        assert_eq!(result(&p, &h3).1[0], 4);
    }
}
