//! Direct captured collectives (docs/contracts.md #7): the host side.
//!
//! A persistent op (docs/contracts.md #6) takes every replay through the daemon's executor: ready
//! seen, copies issued, events seen, done written, each a CPU round trip, which makes it slower per
//! op than NCCL under graphs. An all-reduce, all-gather, reduce-scatter, broadcast or reduce
//! captured on a communicator whose ranks each have their own GPU, all visible to each other with
//! peer access, runs instead as one kernel of the graph (`kernels::direct`): it pushes the input
//! into the peers' windows and reduces (or copies) its own window into the output, with flags that
//! advance on the GPU. The daemon sees nothing per replay; it only marks a communicator broken
//! (`HINT_BROKEN`) when a rank's process is lost, which stops a kernel that waits for that rank.
//!
//! The windows are set up with the first such capture on a communicator: every rank allocates
//! its window on its GPU and the ranks exchange IPC handles through a host all-gather on the
//! communicator itself (so a rank that does not take this path fails that all-gather as a
//! mismatch instead of hanging); then each opens its peers' windows and a second all-gather
//! agrees on the outcome: every rank takes the path, or none does (and says why, once).
//! Windows stay mapped for the life of the process: a graph may outlive its communicator.

use std::sync::Arc;

use crate::gpu::cu::sys;
use crate::gpu::kernels::direct as k;
use record::read_record;
use signature::Record;

mod config;
mod op;
mod plan;
mod record;
pub(crate) use record::RecordWatch;
mod setup;
mod signature;
#[cfg(test)]
mod tests;
mod window;
pub(crate) use window::{alloc_window, open_ipc};

/// Bytes each rank sends in the first all-gather.
const OFFER_BYTES: u64 = 128;

/// How long a direct op waits for a peer's flag when the communicator has no op timeout.
const DEFAULT_TIMEOUT_S: u64 = 300;

/// A communicator's direct path: not tried yet, refused (why), or its windows.
#[derive(Default)]
pub(crate) enum State {
    #[default]
    Unknown,
    Off(String),
    On(Box<Windows>),
}

pub(crate) struct Windows {
    win: [sys::CUdeviceptr; 8],
    slot: u64,
    /// Tickets per op (`launch_grid`): twice the blocks of a small op.
    grid: u32,
    device: i32,
    /// The failure record: host address (read by the client) and device address.
    rec_host: usize,
    rec_dev: sys::CUdeviceptr,
    hint_dev: sys::CUdeviceptr,
    /// Direct ops so far (captured ones, or eager ones for eager windows): the next op's index
    /// (part of its flag, so ranks that replay different captured ops never pair).
    next_k: u32,
    /// The largest op moved by LL lines ([`ll_max`], the same on every rank).
    ll_max: u64,
    /// The smallest forwarded broadcast ([`bcast_forward_min`], the same on every rank).
    fwd_min: u64,
    /// Eager windows: the epoch of the last op launched (the host numbers eager ops, which run
    /// in issue order: `DirectArgs::epoch`); captured ops count tickets on the GPU instead.
    epoch: u64,
    /// Eager windows: their ops' status words (in the record page).
    status: Option<Arc<eager::StatusPool>>,
    /// Eager windows: the communicator's collectives sent to the daemon's path since they
    /// were set up (`kernels::direct::MARK_OFF`; [`Communicator::mark_daemon_op`]).
    daemon_ops: u32,
}

impl Windows {
    /// Rank `me`'s scratch slot: parity 0's slot of `me` in its own window, which no rank
    /// pushes into (a rank pushes only into its peers' windows), `slot` bytes.
    fn scratch(&self, me: u32) -> sys::CUdeviceptr {
        self.win[me as usize] + k::DATA_OFF + u64::from(me) * self.slot
    }

    /// Takes the failure record, if the kernel wrote one since the last look.
    fn take(&self) -> Option<Record> {
        read_record(self.rec_host, true)
    }
}

mod eager;

pub(crate) use eager::LocalDone;

mod p2p;

pub use p2p::P2pConfig;

pub(crate) use p2p::{P2pShared, Pair};

#[cfg(test)]
mod model;

#[cfg(test)]
mod p2p_model;
