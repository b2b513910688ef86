//! Rank lists in messages: ranges, bounded in length.
//!
//! A join timeout of a 65,536-rank communicator once listed every missing rank, which broke
//! the gRPC transport (grpcio from ~3,000 ranks, "h2 protocol error" in the Python client).
//! Every message that names ranks goes through here: sorted ranges (`0-3,5,9-4095`), at most
//! [`MAX_RANGES`] of them, then how many ranks were left out. Owns no state; names nothing of
//! the daemon.

/// Ranges shown before the rest is summarized.
pub const MAX_RANGES: usize = 16;

/// A rank (a member index), or a count of a communicator's ranks, as the `u32` ranks are named
/// with. Exact: both are at most the communicator's `nranks`, a `u32`.
#[must_use]
pub fn of(r: usize) -> u32 {
    u32::try_from(r).expect("a rank is below nranks, a u32")
}

/// `rs` as sorted ranges: "0-3,5,9-4095"; "none" when empty; past [`MAX_RANGES`] ranges,
/// "... and N more ranks". Order and duplicates in `rs` do not matter.
pub fn list(rs: &[u32]) -> String {
    let mut v = rs.to_vec();
    v.sort_unstable();
    v.dedup();
    if v.is_empty() {
        return "none".into();
    }
    let mut ranges: Vec<(u32, u32)> = Vec::new();
    for r in v {
        match ranges.last_mut() {
            Some((_, hi)) if r == *hi + 1 => *hi = r,
            _ => ranges.push((r, r)),
        }
    }
    let shown: Vec<String> = ranges
        .iter()
        .take(MAX_RANGES)
        .map(|&(lo, hi)| match hi - lo {
            0 => lo.to_string(),
            1 => format!("{lo},{hi}"),
            _ => format!("{lo}-{hi}"),
        })
        .collect();
    let mut s = shown.join(",");
    if ranges.len() > MAX_RANGES {
        let rest: u64 = ranges[MAX_RANGES..]
            .iter()
            .map(|&(lo, hi)| u64::from(hi - lo) + 1)
            .sum();
        s.push_str(&format!(" ... and {rest} more rank(s)"));
    }
    s
}

/// "no rank", "rank 3", "ranks 0-3,5" (see [`list`]).
pub fn text(rs: &[u32]) -> String {
    match rs {
        [] => "no rank".into(),
        [r] => format!("rank {r}"),
        _ => format!("ranks {}", list(rs)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_compact_and_sorted() {
        assert_eq!(list(&[]), "none");
        assert_eq!(list(&[7]), "7");
        assert_eq!(list(&[3, 0, 1, 2, 5, 9, 8]), "0-3,5,8,9");
        assert_eq!(list(&[4, 4, 5]), "4,5");
        assert_eq!(text(&[]), "no rank");
        assert_eq!(text(&[2]), "rank 2");
        assert_eq!(text(&[2, 0, 1]), "ranks 0-2");
    }

    #[test]
    fn a_huge_list_stays_short_and_counts_the_rest() {
        // Every other rank of 65,536 missing: 32,768 ranges.
        let rs: Vec<u32> = (0..65_536).step_by(2).collect();
        let s = list(&rs);
        assert!(s.len() < 200, "{} chars: {s}", s.len());
        assert!(s.starts_with("0,2,4,"), "{s}");
        assert!(
            s.ends_with(&format!(" ... and {} more rank(s)", 32_768 - MAX_RANGES)),
            "{s}"
        );
        // One range of 65,535 ranks is one range.
        let all: Vec<u32> = (1..65_536).collect();
        assert_eq!(list(&all), "1-65535");
    }

    proptest::proptest! {
        #[test]
        fn every_listed_rank_is_in_the_input(rs in proptest::collection::vec(0u32..200, 0..60)) {
            let s = list(&rs);
            if s == "none" {
                proptest::prop_assert!(rs.is_empty());
                return Ok(());
            }
            let head = s.split(" ...").next().unwrap_or("");
            let mut shown = Vec::new();
            for part in head.split(',') {
                match part.split_once('-') {
                    Some((a, b)) => shown.extend(a.parse::<u32>().unwrap()..=b.parse::<u32>().unwrap()),
                    None => shown.push(part.parse::<u32>().unwrap()),
                }
            }
            let mut want = rs.clone();
            want.sort_unstable();
            want.dedup();
            let rest: u64 = s.split_once(" ... and ").and_then(|(_, t)| t.split(' ').next())
                .and_then(|n| n.parse().ok()).unwrap_or(0);
            proptest::prop_assert!(shown.iter().all(|r| want.contains(r)));
            proptest::prop_assert_eq!(shown.len() as u64 + rest, want.len() as u64);
        }
    }
}
