//! The entry points of NCCL's API that commd does not implement (growing, suspending, the
//! device API and its host-side queries): each is exported so that a preloaded library answers
//! for all of NCCL, and each fails with a message saying what to do instead
//! (calls that return no `ncclResult_t` return an empty answer with the reason in
//! `ncclGetLastError`; `ncclTeamWorld`, which commd can answer, answers).

#![allow(unsafe_code)] // exported by name: the C ABI

use std::ffi::c_int;

use crate::ffi::{guard, ncclResult_t, set_last_error, unsupported};
use crate::ncclComm_t;

/// Entry points of NCCL's API that commd does not implement: each returns
/// `ncclInvalidUsage` with `ncclGetLastError` naming it and why. Their arguments are not read
/// (all return `ncclResult_t`, so ignoring the arguments is ABI-safe on the caller's side).
macro_rules! unsupported {
    ($($name:ident: $why:expr;)*) => {
        $(
            #[unsafe(no_mangle)]
            pub extern "C" fn $name() -> ncclResult_t {
                guard(stringify!($name), || Err(unsupported(stringify!($name), $why)))
            }
        )*
    };
}

const NO_GROW: &str = "commd does not grow communicators yet; shrink without the lost ranks (ncclCommShrink), or create a new one over every rank (ncclGetUniqueId + ncclCommInitRank)";
const NO_DEVICE_API: &str = "commd has no NCCL device API (its collectives run in the daemon and on copy engines, not in user kernels)";

unsupported! {
    ncclCommGrow: NO_GROW;
    ncclCommGetUniqueId: NO_GROW;
    ncclCommSuspend: "the library holds no GPU memory to release (the daemon owns its scratch)";
    ncclCommResume: "the library holds no GPU memory to release (the daemon owns its scratch)";
    ncclDevCommCreate: NO_DEVICE_API;
    ncclDevCommDestroy: NO_DEVICE_API;
    ncclCommQueryProperties: NO_DEVICE_API;
    ncclGetLsaMultimemDevicePointer: NO_DEVICE_API;
    ncclGetMultimemDevicePointer: NO_DEVICE_API;
    ncclGetLsaDevicePointer: NO_DEVICE_API;
    ncclGetPeerDevicePointer: NO_DEVICE_API;
    ncclGroupSimulateEnd: "commd has no cost model to simulate a group with";
    ncclSetEncryption: "commd's data between nodes is protected by its own transport settings, see docs/multinode.md";
    ncclGetMultimemDeviceLeInfo: NO_DEVICE_API;
    ncclGetCftDeviceLeInfo: NO_DEVICE_API;
    ncclGetPeerDeviceLeInfo: NO_DEVICE_API;
    ncclLsaBarrierCreateRequirement: NO_DEVICE_API;
    ncclGinBarrierCreateRequirement: NO_DEVICE_API;
    ncclLLA2ACreateRequirement: NO_DEVICE_API;
    ncclGinOutboxCreateRequirement: NO_DEVICE_API;
    ncclGinInboxA2ACreateRequirement: NO_DEVICE_API;
}

/// The device API's slot count for an LL all-to-all: -1 (no device API), with the reason in
/// `ncclGetLastError`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclLLA2ACalcSlots(_max_elts: c_int, _max_elt_size: c_int) -> c_int {
    set_last_error(&unsupported("ncclLLA2ACalcSlots", NO_DEVICE_API).message);
    -1
}

/// NCCL's `ncclTeam_t`: `nRanks` ranks, this rank's place `rank` among them, and the world
/// stride between consecutive members.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ncclTeam_t {
    pub nRanks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

/// The empty team a query without an answer returns (its reason in `ncclGetLastError`).
const NO_TEAM: ncclTeam_t = ncclTeam_t {
    nRanks: 0,
    rank: -1,
    stride: 0,
};

fn no_team(func: &str, why: &str) -> ncclTeam_t {
    set_last_error(&unsupported(func, why).message);
    NO_TEAM
}

const NO_TEAMS: &str = "commd has no load/store-accessible, rail or CFT teams (no device API: its collectives run in the daemon and on copy engines); ncclTeamWorld is every rank";

/// Every rank of `comm`, stride 1 (an empty team for a handle that is not live).
#[unsafe(no_mangle)]
pub extern "C" fn ncclTeamWorld(comm: ncclComm_t) -> ncclTeam_t {
    match crate::comm::get(comm).and_then(|c| Ok((c.c_nranks()?, c.c_rank()?))) {
        Ok((n, r)) => ncclTeam_t {
            nRanks: n,
            rank: r,
            stride: 1,
        },
        Err(f) => {
            set_last_error(&format!("ncclTeamWorld: {}", f.message));
            NO_TEAM
        }
    }
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclTeamLsa(_comm: ncclComm_t) -> ncclTeam_t {
    no_team("ncclTeamLsa", NO_TEAMS)
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclTeamRail(_comm: ncclComm_t) -> ncclTeam_t {
    no_team("ncclTeamRail", NO_TEAMS)
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclTeamCft(_comm: ncclComm_t, _mode: c_int) -> ncclTeam_t {
    no_team("ncclTeamCft", NO_TEAMS)
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclTeamCftMultimem(_comm: ncclComm_t) -> ncclTeam_t {
    no_team("ncclTeamCftMultimem", NO_TEAMS)
}

/// The world rank of member `rank` of `team` (a team of constant stride that holds this rank):
/// this rank's world rank plus the distance in the team times the stride; -1 where that is not a
/// rank of `comm`.
#[unsafe(no_mangle)]
pub extern "C" fn ncclTeamRankToWorld(comm: ncclComm_t, team: ncclTeam_t, rank: c_int) -> c_int {
    let world = crate::comm::get(comm).and_then(|c| Ok((c.c_nranks()?, c.c_rank()?)));
    let Ok((n, me)) = world else {
        set_last_error("ncclTeamRankToWorld: comm is not a live communicator");
        return -1;
    };
    let w = i64::from(me) + (i64::from(rank) - i64::from(team.rank)) * i64::from(team.stride);
    if !(0..team.nRanks).contains(&rank) || !(0..i64::from(n)).contains(&w) {
        set_last_error(&format!(
            "ncclTeamRankToWorld: rank {rank} of a team of {} (this rank {}, stride {}) is not              a rank of this communicator of {n}",
            team.nRanks, team.rank, team.stride
        ));
        return -1;
    }
    c_int::try_from(w).unwrap_or(-1)
}

#[unsafe(no_mangle)]
pub extern "C" fn ncclTeamRankToLsa(_comm: ncclComm_t, _team: ncclTeam_t, _rank: c_int) -> c_int {
    set_last_error(&unsupported("ncclTeamRankToLsa", NO_TEAMS).message);
    -1
}

/// NCCL's internal reset of its debug settings: `NCCL_DEBUG` and `NCCL_DEBUG_SUBSYS` are read
/// again at the next log line.
#[unsafe(no_mangle)]
pub extern "C" fn ncclResetDebugInitInternal() {
    crate::log::reset();
}
