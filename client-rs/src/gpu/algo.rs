//! Which algorithm a GPU all-reduce uses. The client decides and tells the daemon with
//! [`flags::ONE_SHOT`](commd_proto::desc::flags::ONE_SHOT); every rank must decide the same
//! (the daemon fails the op as a mismatch otherwise), so the choice depends only on the op and
//! the communicator, and on two environment variables that a job sets the same on every rank:
//!
//! - `COMMD_ALLREDUCE_ALGO`: `auto` (default), `oneshot` or `rsag`, for benchmarking. `oneshot`
//!   falls back to `rsag` when the input does not fit one scratch slot
//!   (`gpu_scratch_slot_bytes` of the daemon, 16 MiB by default).
//! - `COMMD_ONESHOT_MAX_BYTES`: with `auto`, the largest input (bytes per rank) that goes
//!   one-shot (default 2 MiB).
//!
//! One-shot: every rank pushes its whole input into every other rank's scratch and each rank
//! reduces everything itself: one copy phase, (n - 1) x S bytes out of each GPU. Reduce-scatter +
//! all-gather (rsag): each rank reduces 1/n of every round and pushes it out again: two copy
//! phases per round but 2 (n - 1) / n x S bytes out of each GPU, pipelined over rounds. Small
//! messages are bound by the phases' fixed costs (a doorbell turnaround and the driver calls,
//! ~10-20 us each), large ones by the copy engines' bandwidth. Both variables are read once per
//! process.

use std::sync::OnceLock;

use commd_proto::desc::OpKind;

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    Auto,
    OneShot,
    Rsag,
}

/// Default `COMMD_ONESHOT_MAX_BYTES`.
pub const ONESHOT_MAX_BYTES: u64 = 2 << 20;

fn parse_algo(v: Option<&str>) -> std::result::Result<Algo, String> {
    match v.map(str::trim) {
        None | Some("") | Some("auto") => Ok(Algo::Auto),
        Some("oneshot") | Some("one-shot") | Some("one_shot") => Ok(Algo::OneShot),
        Some("rsag") => Ok(Algo::Rsag),
        Some(x) => Err(format!(
            "COMMD_ALLREDUCE_ALGO={x}: expected auto, oneshot or rsag"
        )),
    }
}

fn parse_max(v: Option<&str>) -> std::result::Result<u64, String> {
    match v.map(str::trim) {
        None | Some("") => Ok(ONESHOT_MAX_BYTES),
        Some(x) => x
            .parse::<u64>()
            .map_err(|_| format!("COMMD_ONESHOT_MAX_BYTES={x}: expected a number of bytes")),
    }
}

fn settings() -> &'static std::result::Result<(Algo, u64), String> {
    static S: OnceLock<std::result::Result<(Algo, u64), String>> = OnceLock::new();
    S.get_or_init(|| {
        let algo =
            parse_algo(commd_settings::get(&commd_settings::keys::ALLREDUCE_ALGO).as_deref())?;
        let max =
            parse_max(commd_settings::get(&commd_settings::keys::ONESHOT_MAX_BYTES).as_deref())?;
        Ok((algo, max))
    })
}

/// The choice for given settings (pure, for tests).
pub fn choose(algo: Algo, max: u64, kind: OpKind, count: u64, es: u64, slot_bytes: u64) -> bool {
    if !commd_proto::desc::cuda_one_shot_fits(kind, count, es, slot_bytes) {
        return false;
    }
    match algo {
        Algo::OneShot => true,
        Algo::Rsag => false,
        Algo::Auto => count.saturating_mul(es) <= max,
    }
}

/// Whether this op goes one-shot (see the module docs). `nranks` is kept for a choice that
/// depends on the GPU count once measurements say it should.
pub fn one_shot(kind: OpKind, count: u64, es: u64, _nranks: u32, slot_bytes: u64) -> Result<bool> {
    if kind != OpKind::AllReduce {
        return Ok(false);
    }
    let (algo, max) = settings()
        .as_ref()
        .map_err(|e| Error::InvalidArgument(e.clone()))?;
    Ok(choose(*algo, *max, kind, count, es, slot_bytes))
}

/// How an eager reduction of several rounds runs its kernels (`kernels::rounds`):
/// `COMMD_GPU_FUSED_ROUNDS` `1` (default): one cooperative launch for every round; `plain`: the
/// same kernel by an ordinary launch (for measurement: nothing then guarantees that every block
/// is resident at once); `0`: one launch per round (the way before; for comparison). `COMMD_GPU_FUSED_BLOCKS`: the launch's
/// most blocks (default 0: the reduction kernels' cap, 4 per SM). Read once per process. The
/// choice is the rank's own: the daemon sees the same phases either way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fused {
    pub on: bool,
    pub cooperative: bool,
    pub max_blocks: u32,
}

fn parse_fused(on: Option<&str>, blocks: Option<&str>) -> std::result::Result<Fused, String> {
    let (on, cooperative) = match on.map(str::trim) {
        None | Some("") | Some("1") | Some("on") | Some("auto") => (true, true),
        Some("plain") => (true, false),
        Some("0") | Some("off") => (false, true),
        Some(x) => {
            return Err(format!(
                "COMMD_GPU_FUSED_ROUNDS={x}: expected 1 (the default), plain or 0"
            ));
        }
    };
    let max_blocks = match blocks.map(str::trim) {
        None | Some("") => 0,
        Some(x) => x.parse::<u32>().map_err(|_| {
            format!("COMMD_GPU_FUSED_BLOCKS={x}: expected a number of blocks (0: the default)")
        })?,
    };
    Ok(Fused {
        on,
        cooperative,
        max_blocks,
    })
}

/// The process's [`Fused`] setting; an invalid value is an error on every multi-round op.
pub fn fused() -> Result<Fused> {
    static S: OnceLock<std::result::Result<Fused, String>> = OnceLock::new();
    S.get_or_init(|| {
        parse_fused(
            commd_settings::get(&commd_settings::keys::GPU_FUSED_ROUNDS).as_deref(),
            commd_settings::get(&commd_settings::keys::GPU_FUSED_BLOCKS).as_deref(),
        )
    })
    .clone()
    .map_err(Error::InvalidArgument)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_settings_parse_and_refuse_garbage() {
        let on = |b| {
            Ok(Fused {
                on: true,
                cooperative: true,
                max_blocks: b,
            })
        };
        assert_eq!(parse_fused(None, None), on(0));
        assert_eq!(parse_fused(Some(" 1 "), Some("132")), on(132));
        assert!(!parse_fused(Some("0"), None).unwrap().on);
        let plain = parse_fused(Some("plain"), None).unwrap();
        assert!(plain.on && !plain.cooperative);
        let e = parse_fused(Some("yes"), None).unwrap_err();
        assert!(e.contains("COMMD_GPU_FUSED_ROUNDS=yes"), "{e}");
        let e = parse_fused(None, Some("-3")).unwrap_err();
        assert!(e.contains("COMMD_GPU_FUSED_BLOCKS=-3"), "{e}");
    }

    #[test]
    fn settings_parse_and_refuse_garbage() {
        assert_eq!(parse_algo(None), Ok(Algo::Auto));
        assert_eq!(parse_algo(Some("oneshot")), Ok(Algo::OneShot));
        assert_eq!(parse_algo(Some(" rsag ")), Ok(Algo::Rsag));
        assert!(
            parse_algo(Some("ring"))
                .unwrap_err()
                .contains("expected auto")
        );
        assert_eq!(parse_max(None), Ok(ONESHOT_MAX_BYTES));
        assert_eq!(parse_max(Some("4096")), Ok(4096));
        assert!(parse_max(Some("4k")).is_err());
    }

    #[test]
    fn choice_by_size_override_and_fit() {
        let slot = 16 << 20;
        let ar = OpKind::AllReduce;
        // auto: up to the threshold
        assert!(choose(Algo::Auto, 2 << 20, ar, (2 << 20) / 4, 4, slot));
        assert!(!choose(Algo::Auto, 2 << 20, ar, (2 << 20) / 4 + 1, 4, slot));
        // forced one-shot falls back when the input exceeds one slot
        assert!(choose(Algo::OneShot, 0, ar, (16 << 20) / 4, 4, slot));
        assert!(!choose(Algo::OneShot, 0, ar, (16 << 20) / 4 + 1, 4, slot));
        assert!(!choose(Algo::Rsag, u64::MAX, ar, 1, 4, slot));
        // only all-reduce has a one-shot form
        assert!(!choose(
            Algo::OneShot,
            u64::MAX,
            OpKind::ReduceScatter,
            1,
            4,
            slot
        ));
    }
}
