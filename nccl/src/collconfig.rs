//! The per-collective config of the `nccl*Config` calls (`ncclCollConfig_t`, NCCL 2.31/2.32):
//! read as NCCL reads it (the defaults, then the caller's first `size` bytes over them, then the
//! magic), and each field either done, or refused where commd cannot do what it asks. No field
//! is accepted and then dropped (nccl/README.md, "Per-collective config"):
//! - `launchCompletionEvent`: recorded on the op's stream right before the op is posted (what
//!   NCCL does where launch-completion events are not available); one per communicator in a
//!   group, as NCCL's;
//! - `algSelection`: parsed in NCCL's grammar; commd runs none of NCCL's algorithms, so a forced
//!   selection fails as NCCL's unsatisfiable one does, and an unforced one falls back to the
//!   automatic choice, as NCCL's;
//! - `minCTAs`/`maxCTAs` in NCCL's range and a `CTAPolicy` other than the default: refused
//!   (commd does not size its GPU work per call); out-of-range values NCCL itself ignores;
//! - `nvlsCTAs` (commd has no NVLS kernels) and `cgaClusterSize` (its kernels launch without
//!   clusters) bound nothing commd runs; `userProfilerTag` goes into the op's COLL log line;
//!   `ext`, the vendor list, NCCL reads none of either.

#![allow(unsafe_code)] // reading the caller's config struct; recording the caller's event

use std::ffi::{CStr, c_char, c_int, c_void};

use commd_cuda::{self as cu, sys};

use crate::comm::{self, group};
use crate::ffi::{Failure, Outcome, invalid, usage};
use crate::{cudaStream_t, ncclComm_t};

const MAGIC: u32 = 0xcafe_beef;
const UNDEF_INT: c_int = c_int::MIN;
/// NCCL's channel limit (MAXCHANNELS): CTA counts outside [1, 64] are ignored by NCCL.
const MAX_CTAS: c_int = 64;
const CTA_POLICY_MAX: c_int = 3;

/// `ncclCollConfig_t` as NCCL 2.32 lays it out (72 bytes; 2.31's ends before the event).
#[repr(C)]
#[derive(Clone, Copy)]
struct Raw {
    size: usize,
    magic: u32,
    version: u32,
    ext: *mut c_void,
    min_ctas: c_int,
    max_ctas: c_int,
    nvls_ctas: c_int,
    cga_cluster_size: c_int,
    alg_selection: *const c_char,
    force_alg_selection: c_int,
    cta_policy: c_int,
    user_profiler_tag: u64,
    launch_completion_event: *mut c_void,
}

impl Raw {
    /// NCCL_COLLCONFIG_INITIALIZER.
    const DEFAULT: Raw = Raw {
        size: std::mem::size_of::<Raw>(),
        magic: MAGIC,
        version: 23200,
        ext: std::ptr::null_mut(),
        min_ctas: UNDEF_INT,
        max_ctas: UNDEF_INT,
        nvls_ctas: UNDEF_INT,
        cga_cluster_size: UNDEF_INT,
        alg_selection: std::ptr::null(),
        force_alg_selection: 1,
        cta_policy: UNDEF_INT,
        user_profiler_tag: 0,
        launch_completion_event: std::ptr::null_mut(),
    };
}

/// What a call's config asks of commd, once checked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CollConfig {
    /// The caller's CUDA event to record when the op is launched.
    pub event: Option<usize>,
    pub tag: u64,
}

/// Reads and checks the config at `p` (NULL: the plain call) for the collective `func`.
///
/// # Safety
/// `p` is NULL or points at a readable config of at least the `size` it states (NCCL's
/// contract), and its `algSelection` is NULL or a C string.
pub unsafe fn read(p: *const c_void, func: &str) -> Outcome<CollConfig> {
    if p.is_null() {
        return Ok(CollConfig::default());
    }
    let mut raw = Raw::DEFAULT;
    // SAFETY: the caller's config is readable for its first word (the size).
    let size = unsafe { p.cast::<usize>().read_unaligned() };
    let n = size.min(std::mem::size_of::<Raw>());
    // SAFETY: `n` bytes of the caller's struct (at most the size it states) over our copy,
    // which is `size_of::<Raw>() >= n` bytes; every bit pattern is a valid Raw.
    unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), (&raw mut raw).cast::<u8>(), n) };
    if n < 12 || raw.magic != MAGIC {
        return Err(invalid(format!(
            "{func}: the config is not initialized (size {size}, magic {:#x}): start it from \
             NCCL_COLLCONFIG_INITIALIZER",
            if n < 12 { 0 } else { raw.magic }
        )));
    }
    check(&raw, func)?;
    if !raw.alg_selection.is_null() {
        // SAFETY: the caller's C string (NCCL's contract for algSelection).
        let sel = unsafe { CStr::from_ptr(raw.alg_selection) }.to_string_lossy();
        alg_selection(&sel, raw.force_alg_selection == 1, func)?;
    }
    let event = (!raw.launch_completion_event.is_null()).then_some(raw.launch_completion_event);
    Ok(CollConfig {
        event: event.map(|e| e as usize),
        tag: raw.user_profiler_tag,
    })
}

/// The checks of the integer fields.
fn check(raw: &Raw, func: &str) -> Outcome {
    if !(0..=1).contains(&raw.force_alg_selection) {
        return Err(invalid(format!(
            "{func}: forceAlgSelection is {}; it must be 0 or 1",
            raw.force_alg_selection
        )));
    }
    if raw.cta_policy != UNDEF_INT && !(0..=CTA_POLICY_MAX).contains(&raw.cta_policy) {
        return Err(invalid(format!(
            "{func}: CTAPolicy {} is not a combination of NCCL_CTA_POLICY_* flags",
            raw.cta_policy
        )));
    }
    if raw.cta_policy != UNDEF_INT && raw.cta_policy != 0 {
        return Err(usage(format!(
            "{func}: CTAPolicy {:#x} (EFFICIENCY/ZERO) is not supported by commd: its ops are \
             sized by the daemon, not per call (leave CTAPolicy unset or NCCL_CTA_POLICY_DEFAULT)",
            raw.cta_policy
        )));
    }
    for (name, v) in [("minCTAs", raw.min_ctas), ("maxCTAs", raw.max_ctas)] {
        // NCCL ignores values outside [1, MAXCHANNELS] (an INFO line), and so does commd.
        if (1..=MAX_CTAS).contains(&v) {
            return Err(usage(format!(
                "{func}: {name}={v} is not supported by commd: it does not bound the CTAs of its \
                 ops per call (leave {name} at NCCL_CONFIG_UNDEF_INT)"
            )));
        }
    }
    Ok(())
}

/// NCCL's algorithm registry (names matched by case-insensitive prefix); the symmetric kernels
/// are the `SYMK_*` family.
const ALGOS: &[&str] = &[
    "TREE_LL",
    "TREE_LL128",
    "TREE_SIMPLE",
    "RING_LL",
    "RING_LL128",
    "RING_SIMPLE",
    "COLLNET_DIRECT_SIMPLE",
    "COLLNET_CHAIN_SIMPLE",
    "NVLS_SIMPLE",
    "NVLSTREE_SIMPLE",
    "PAT_SIMPLE",
    "SYMK_",
];

/// Bit set of the registry entries a factor names (`^` negates it).
fn factor_mask(f: &str) -> Option<u32> {
    let (neg, tag) = match f.strip_prefix('^') {
        Some(t) => (true, t),
        None => (false, f),
    };
    if tag.is_empty() {
        return None;
    }
    let up = tag.to_ascii_uppercase();
    let mut m = 0u32;
    for (i, name) in ALGOS.iter().enumerate() {
        if name.starts_with(&up) || (name.ends_with('_') && up.starts_with(name)) {
            m |= 1 << i;
        }
    }
    if m == 0 {
        return None;
    }
    let all = (1u32 << ALGOS.len()) - 1;
    Some(if neg { all & !m } else { m })
}

/// Checks `sel` in NCCL's grammar (terms joined by `,`, factors of a term by `+`, `^` negating
/// a factor). commd runs none of these algorithms: forced, the call fails as NCCL's does when no
/// selected algorithm can run; unforced, the automatic choice runs (as NCCL falls back).
fn alg_selection(sel: &str, forced: bool, func: &str) -> Outcome {
    let s: String = sel.chars().filter(|c| !c.is_whitespace()).collect();
    if s.is_empty() {
        return Ok(());
    }
    let bad = |why: &str| -> Failure {
        invalid(format!(
            "{func}: algSelection \"{sel}\" is not valid: {why}"
        ))
    };
    for term in s.split(',') {
        let mut m = u32::MAX;
        for f in term.split('+') {
            m &= factor_mask(f).ok_or_else(|| bad(&format!("\"{f}\" names no algorithm")))?;
        }
        if m == 0 {
            return Err(bad(&format!("\"{term}\" matches no algorithm")));
        }
    }
    if forced {
        return Err(invalid(format!(
            "{func}: algSelection \"{sel}\" cannot be honored: commd runs its own algorithms \
             (the daemon's plans and direct ops), none of NCCL's; set forceAlgSelection=0 to \
             let it choose"
        )));
    }
    crate::log::info(crate::log::COLL, -1, || {
        format!("{func}: algSelection \"{sel}\" not forced: commd chooses the algorithm")
    });
    Ok(())
}

/// Runs the plain collective `body` on `c` under the checked config `cfg`: the launch event is
/// recorded on `stream` first (one per communicator in a group).
pub fn run(
    func: &str,
    c: ncclComm_t,
    stream: cudaStream_t,
    cfg: CollConfig,
    body: impl FnOnce() -> crate::ffi::ncclResult_t,
) -> crate::ffi::ncclResult_t {
    if let Some(ev) = cfg.event {
        let r = crate::ffi::guard(func, || {
            let comm = comm::get(c)?;
            if !comm::cuda() {
                return Err(invalid(format!(
                    "{func}: a launchCompletionEvent needs CUDA, which this process does not have"
                )));
            }
            group::claim_launch_event(&comm, func)?;
            // SAFETY: NCCL's contract: the caller's live event (made without timing or
            // interprocess flags) and live stream.
            let e = unsafe { sys::cuEventRecord(ev as sys::CUevent, stream as sys::CUstream) };
            cu::ck(e, "cuEventRecord").map_err(|e| Failure {
                code: crate::ffi::UNHANDLED_CUDA_ERROR,
                message: format!("{func}: recording the launchCompletionEvent: {e}"),
            })?;
            crate::ok()
        });
        if r != crate::ffi::SUCCESS {
            return r;
        }
    }
    if cfg.tag != 0 {
        crate::log::info(crate::log::COLL, -1, || {
            format!("{func}: userProfilerTag {:#x}", cfg.tag)
        });
    }
    body()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_is_ncclcollconfig_v23200() {
        assert_eq!(std::mem::size_of::<Raw>(), 72);
        assert_eq!(std::mem::offset_of!(Raw, min_ctas), 24);
        assert_eq!(std::mem::offset_of!(Raw, alg_selection), 40);
        assert_eq!(std::mem::offset_of!(Raw, user_profiler_tag), 56);
        assert_eq!(std::mem::offset_of!(Raw, launch_completion_event), 64);
    }

    #[test]
    fn selection_grammar_as_nccl() {
        for ok in [
            "ring",
            "Ring,Tree",
            "tree_ll+^tree_ll128",
            "NVLS",
            " ring_simple ",
            "symk_x",
        ] {
            assert!(alg_selection(ok, false, "t").is_ok(), "{ok}");
            let e = alg_selection(ok, true, "t").unwrap_err();
            assert!(
                e.message.contains("cannot be honored"),
                "{ok}: {}",
                e.message
            );
        }
        for bad in ["^", "ll", "simple", "ring+tree", "warp", "ring,"] {
            let e = alg_selection(bad, false, "t").unwrap_err();
            assert_eq!(e.code, crate::ffi::INVALID_ARGUMENT, "{bad}");
            assert!(e.message.contains("not valid"), "{bad}: {}", e.message);
        }
        assert!(alg_selection("", true, "t").is_ok());
    }

    #[test]
    fn fields_checked_as_nccl_and_refused_where_commd_cannot() {
        let mut r = Raw::DEFAULT;
        assert!(check(&r, "t").is_ok());
        r.force_alg_selection = 2;
        assert_eq!(
            check(&r, "t").unwrap_err().code,
            crate::ffi::INVALID_ARGUMENT
        );
        r = Raw::DEFAULT;
        r.cta_policy = 4;
        assert_eq!(
            check(&r, "t").unwrap_err().code,
            crate::ffi::INVALID_ARGUMENT
        );
        r.cta_policy = 2;
        assert_eq!(check(&r, "t").unwrap_err().code, crate::ffi::INVALID_USAGE);
        r.cta_policy = 0;
        assert!(check(&r, "t").is_ok());
        r.max_ctas = 8;
        let e = check(&r, "t").unwrap_err();
        assert!(e.code == crate::ffi::INVALID_USAGE && e.message.contains("maxCTAs"));
        r.max_ctas = 0; // out of NCCL's range: NCCL ignores it
        r.min_ctas = 65;
        r.nvls_ctas = 4;
        r.cga_cluster_size = 2;
        assert!(check(&r, "t").is_ok());
    }
}
