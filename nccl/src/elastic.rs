//! `ncclCommRevoke` and `ncclCommShrink` (NCCL 2.27+), on the daemon's revoke and shrink
//! (client-rs `Communicator::revoke`/`shrink`): the child is made from the parent's
//! membership, with no new unique id, and the parent may be broken (a rank lost, revoked).

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::ffi::c_int;

use crate::comm::{self, Comm};
use crate::ffi::{Failure, guard, invalid, ncclResult_t};
use crate::lifecycle::blocking;
use crate::{ConfigHead, ncclComm_t, ok};

/// `NCCL_SHRINK_DEFAULT`, `NCCL_SHRINK_ABORT`, `NCCL_REVOKE_DEFAULT`.
const SHRINK_DEFAULT: c_int = 0;
const SHRINK_ABORT: c_int = 1;
const REVOKE_DEFAULT: c_int = 0;

/// Stops every in-flight and later op of the communicator on every rank (they fail with
/// `ncclRemoteError`, the message naming the revoking rank); the communicator stays valid as
/// the parent of `ncclCommShrink`, and can be destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommRevoke(c: ncclComm_t, revoke_flags: c_int) -> ncclResult_t {
    guard("ncclCommRevoke", || {
        if revoke_flags != REVOKE_DEFAULT {
            return Err(invalid(format!(
                "revokeFlags {revoke_flags} must be NCCL_REVOKE_DEFAULT (0)"
            )));
        }
        let comm = comm::get(c)?;
        let r = comm.usable()?;
        r.c.revoke(&format!("ncclCommRevoke by rank {}", comm.rank))
            .map_err(Failure::from)?;
        ok()
    })
}

/// The child's size and this rank's place in it, or why the list is wrong (the daemon checks
/// it too; here so that the answer is `ncclInvalidArgument` before any join).
fn place(rank: u32, nranks: u32, exclude: &[c_int]) -> Result<(Vec<u32>, u32, u32), Failure> {
    let mut ex = Vec::with_capacity(exclude.len());
    for &r in exclude {
        match u32::try_from(r).ok().filter(|&r| r < nranks) {
            Some(r) if !ex.contains(&r) => ex.push(r),
            Some(r) => {
                return Err(invalid(format!(
                    "rank {r} is listed twice in excludeRanksList"
                )));
            }
            None => {
                return Err(invalid(format!(
                    "excludeRanksList names rank {r}, but the communicator has {nranks} ranks"
                )));
            }
        }
    }
    if ex.contains(&rank) {
        return Err(invalid(format!(
            "rank {rank} is in its own excludeRanksList; an excluded rank does not call ncclCommShrink"
        )));
    }
    let below = (0..rank).filter(|r| !ex.contains(r)).count();
    let left = nranks as usize - ex.len();
    let as_u32 = |v: usize| u32::try_from(v).expect("at most nranks, a u32");
    Ok((ex, as_u32(below), as_u32(left)))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommShrink(
    c: ncclComm_t,
    exclude_ranks: *mut c_int,
    exclude_count: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ConfigHead,
    shrink_flags: c_int,
) -> ncclResult_t {
    guard("ncclCommShrink", || {
        if newcomm.is_null() {
            return Err(invalid("newcomm is a null pointer"));
        }
        // NCCL_COMM_NULL until a communicator is made.
        // SAFETY: checked non-null; NCCL's contract.
        unsafe { newcomm.write(std::ptr::null_mut()) };
        let abort = match shrink_flags {
            SHRINK_DEFAULT => false,
            SHRINK_ABORT => true,
            f => {
                return Err(invalid(format!(
                    "shrinkFlags {f} is not NCCL_SHRINK_DEFAULT (0) or NCCL_SHRINK_ABORT (1)"
                )));
            }
        };
        let count = usize::try_from(exclude_count)
            .map_err(|_| invalid(format!("excludeRanksCount {exclude_count} is negative")))?;
        if count > 0 && exclude_ranks.is_null() {
            return Err(invalid("excludeRanksList is a null pointer"));
        }
        let list = if count == 0 {
            &[][..]
        } else {
            // SAFETY: NCCL's contract: the list holds excludeRanksCount ranks.
            unsafe { std::slice::from_raw_parts(exclude_ranks, count) }
        };
        let parent = comm::get(c)?;
        let (ex, rank, nranks) = place(parent.rank, parent.nranks, list)?;
        // SAFETY: NCCL's contract on config.
        let b = unsafe { blocking(config) }?;
        let b = if config.is_null() { parent.blocking } else { b };
        // The parent may be broken (that is why it is shrunk): only its join must be done.
        let r = parent.usable()?;
        if abort {
            parent.abort();
        }
        let child = Comm::create_with(
            c_int::try_from(rank).unwrap_or(c_int::MAX),
            c_int::try_from(nranks).unwrap_or(c_int::MAX),
            parent.device,
            b,
            move |_, _, _| {
                r.c.shrink(
                    &ex,
                    commd_client::ShrinkOptions {
                        abort,
                        ..Default::default()
                    },
                )
            },
        )?;
        let res = if !child.blocking && child.joining() {
            crate::ffi::IN_PROGRESS
        } else {
            crate::ffi::SUCCESS
        };
        // SAFETY: checked non-null; NCCL's contract.
        unsafe { newcomm.write(comm::handle(child)) };
        Ok(res)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_follow_ncclcommshrink_and_bad_lists_are_named() {
        assert_eq!(place(2, 4, &[0]).unwrap(), (vec![0], 1, 3));
        assert_eq!(place(3, 4, &[1, 2]).unwrap(), (vec![1, 2], 1, 2));
        assert_eq!(place(0, 4, &[]).unwrap(), (vec![], 0, 4));
        assert!(place(1, 4, &[1]).unwrap_err().message.contains("own"));
        assert!(place(1, 4, &[4]).unwrap_err().message.contains("4 ranks"));
        assert!(place(1, 4, &[-1]).unwrap_err().message.contains("rank -1"));
        assert!(place(1, 4, &[2, 2]).unwrap_err().message.contains("twice"));
    }
}
