//! Setting up a communicator's direct windows: allocation, the IPC handle exchange through host
//! all-gathers, opening the peers' windows, and the record page.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::sync::Arc;

use commd_proto::desc::{DType, doorbell};
use commd_proto::num::usize_of;

use super::config::{Config, bcast_forward_min, ll_area_off, ll_max, split_max, window_bytes};
use super::record::RecordWatch;
use super::window::{alloc_window, open_peer};
use super::{OFFER_BYTES, State, Windows};
use crate::gpu::cu::sys;
use crate::gpu::kernels::{self, direct as k};
use crate::gpu::map_host;
use crate::{Client, Communicator, Error, Result, lock};

impl Communicator {
    /// Sets up the windows (module doc): the same outcome on every rank. `eager`: the windows
    /// of eager direct ops (rule 8), apart from the captured ops' ones. An error is of the
    /// exchange itself (a peer that did not take part), the same on every rank that saw it; the
    /// others fail their all-gather the same way.
    pub(super) fn setup(&self, cfg: &Config, dev: i32, eager: bool) -> Result<State> {
        let n = self.nranks;
        let i = &self.client;
        let lim = cfg.limits(n);
        let slot = lim.slot();
        let sms = lock(&i.gpu)
            .kernels
            .get_or_insert_with(kernels::Kernels::new)
            .sm_count()?;
        // Tickets per op: a small op's blocks (at most half the SMs) twice (`launch_grid`).
        let grid = 2 * cfg.blocks.min(sms / 2).max(1);
        let wbytes = window_bytes(n, slot);
        let mut offer = vec![0u8; usize_of(OFFER_BYTES)];
        // My window: allocated, its header zeroed, exported.
        let mut local_err = None;
        let mut win: sys::CUdeviceptr = 0;
        let ll_off = ll_area_off(n, slot);
        let zero = [(0, k::DATA_OFF), (ll_off, wbytes - ll_off)];
        let alloc = alloc_window(wbytes, &zero).map(|(p, h)| {
            win = p;
            offer[..64].copy_from_slice(&h);
        });
        if let Err(e) = alloc {
            local_err = Some(format!("rank {}: {e}", self.rank));
        }
        let uuid = crate::gpu::device_uuid(dev)?;
        offer[64..80].copy_from_slice(&uuid);
        offer[80..88].copy_from_slice(&slot.to_le_bytes());
        offer[88..92].copy_from_slice(&grid.to_le_bytes());
        offer[92] = u8::from(local_err.is_none());
        // (Read by every op before it gets here: `direct_op`.)
        offer[96..104].copy_from_slice(&split_max()?.to_le_bytes());
        let ll = ll_max()?;
        offer[104..112].copy_from_slice(&ll.to_le_bytes());
        // The limit of a whole op too: two ranks with one slot size may still differ there.
        offer[112..120].copy_from_slice(&lim.whole.to_le_bytes());
        let fwd = bcast_forward_min()?;
        offer[120..128].copy_from_slice(&fwd.to_le_bytes());
        let all = self.host_all_gather(&offer)?;
        let part = |r: usize| offer_of(all.as_slice(), r);
        // Decisions every rank makes alike from the same offers.
        let mut why = self.offer_refusal(&all, &offer, cfg, eager);
        // Open the peers' windows (only when every offer was acceptable).
        let mut wins = [0u64; 8];
        wins[self.rank as usize] = win;
        let mut opened = Vec::new();
        let mut mine_ok = why.is_none() && local_err.is_none();
        let mut my_why = String::new();
        if mine_ok {
            for r in (0..n as usize).filter(|&r| r != self.rank as usize) {
                match open_peer(dev, part(r)) {
                    Ok(p) => {
                        wins[r] = p;
                        opened.push(p);
                    }
                    Err(e) => {
                        my_why = format!("rank {} cannot map rank {r}'s window: {e}", self.rank);
                        mine_ok = false;
                        break;
                    }
                }
            }
        }
        // The failure record (one leaked page, mapped for the device) and the hint word: made
        // before the verdict, so that a rank that cannot make them says so there instead of
        // leaving the others waiting for its flags.
        let mut rec = None;
        if mine_ok {
            match self.record_page() {
                Ok(r) => rec = Some(r),
                Err(e) => {
                    my_why = format!("rank {}: {e}", self.rank);
                    mine_ok = false;
                }
            }
        }
        // Every rank says whether it could; all or none take the path.
        let mut verdict = vec![0u8; 8];
        verdict[0] = u8::from(mine_ok);
        let verdicts = self.host_all_gather(&verdict)?;
        let failed: Vec<u32> = (0..n).filter(|&r| verdicts[r as usize * 8] != 1).collect();
        if why.is_none() && !failed.is_empty() {
            why = Some(if my_why.is_empty() {
                format!(
                    "rank(s) {failed:?} could not map their peers' windows (peer access between the GPUs, or GPUs not visible to those processes) or their failure record"
                )
            } else {
                my_why
            });
        }
        if let Some(why) = why {
            return Ok(self.refuse_windows(why, &opened, win, eager));
        }
        let Some((page, rec_dev, hint_dev)) = rec else {
            return Err(Error::InvalidArgument(
                "direct path: the verdict was taken without a record (internal error)".into(),
            ));
        };
        if eager {
            lock(&i.gpu).records.push(RecordWatch {
                page: page as usize,
                handle: self.handle,
                rank: self.rank,
                told: false,
                p2p: false,
            });
        }
        Ok(State::On(Box::new(Windows {
            win: wins,
            slot,
            grid,
            device: dev,
            rec_host: page as usize,
            rec_dev,
            hint_dev,
            next_k: 0,
            epoch: 0,
            daemon_ops: 0,
            ll_max: ll,
            fwd_min: fwd,
            // SAFETY: `record_page` leaks the page: it lives for the process.
            status: eager
                .then(|| Arc::new(unsafe { super::eager::StatusPool::new(page as usize) })),
        })))
    }

    /// Why the offers of all ranks (`all`, one [`OFFER_BYTES`] part per rank) cannot take the
    /// direct path, compared with this rank's `offer`: the first rank whose offer differs.
    fn offer_refusal(&self, all: &[u8], offer: &[u8], cfg: &Config, eager: bool) -> Option<String> {
        let part = |r: usize| offer_of(all, r);
        for r in 0..self.nranks as usize {
            let o = part(r);
            let why = if o[92] != 1 {
                format!("rank {r} could not allocate its window")
            } else if o[80..88] != offer[80..88]
                || o[88..92] != offer[88..92]
                || o[112..120] != offer[112..120]
            {
                format!(
                    "rank {r} has another {} or COMMD_GRAPH_DIRECT_BLOCKS (or GPU size) than rank {}",
                    if eager {
                        "COMMD_EAGER_DIRECT_MAX_BYTES"
                    } else {
                        "COMMD_GRAPH_DIRECT_MAX_BYTES"
                    },
                    self.rank
                )
            } else if o[104..112] != offer[104..112] {
                format!(
                    "rank {r} has another COMMD_DIRECT_LL_MAX_BYTES than rank {}",
                    self.rank
                )
            } else if o[120..128] != offer[120..128] {
                format!(
                    "rank {r} has another COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES than rank {}",
                    self.rank
                )
            } else if o[96..104] != offer[96..104] {
                format!(
                    "rank {r} has another COMMD_DIRECT_SPLIT_MAX_BYTES than rank {}",
                    self.rank
                )
            } else if let Some(q) = (0..r)
                .find(|&q| part(q)[64..80] == o[64..80])
                .filter(|_| !cfg.shared_gpus)
            {
                format!(
                    "ranks {q} and {r} share a GPU (a kernel that waits for a peer on the same GPU would be time-sliced against it)"
                )
            } else {
                continue;
            };
            return Some(why);
        }
        None
    }

    /// The direct path refused on every rank: frees this rank's window and the peers' opened
    /// ones, and says why once (rank 0).
    fn refuse_windows(&self, why: String, opened: &[u64], win: u64, eager: bool) -> State {
        for &p in opened {
            // SAFETY: opened by `setup` with cuIpcOpenMemHandle; no work uses it.
            unsafe { sys::cuIpcCloseMemHandle(p) };
        }
        if win != 0 {
            // SAFETY: allocated by `setup`; no work uses it.
            unsafe { sys::cuMemFree_v2(win) };
        }
        if self.rank == 0 {
            let which = if eager {
                "eager GPU collectives (COMMD_EAGER_DIRECT)"
            } else {
                "collectives captured into CUDA graphs"
            };
            eprintln!(
                "commd: communicator {}: {which} take the daemon's path, not the direct one: {why}",
                self.comm_id
            );
        }
        State::Off(why)
    }

    /// GPU memory this process allocated for the communicator's direct ops, in bytes: the
    /// windows of captured and eager collectives, the rounds kernel's barrier and the
    /// send/recv inboxes, the signal area of one-sided ops (`gpu::rma`). All of it is kept until the process exits (peers and graphs may
    /// still use it), so it only grows; the NCCL library reports it as `ncclCommMemStats`.
    pub fn cuda_memory_bytes(&self) -> u64 {
        let c = lock(&self.gpu);
        let win = |s: &State| match s {
            State::On(w) => window_bytes(self.nranks, w.slot),
            _ => 0,
        };
        win(&c.direct)
            + win(&c.eager)
            + c.rounds_bar.map_or(0, |_| 16)
            + super::p2p::inbox_bytes(&c.p2p)
            + self.rma_bytes()
    }

    /// A zeroed page for the failure record (and eager status words), leaked (a graph may
    /// outlive the communicator) and mapped for the device; and the device address of this
    /// communicator's doorbell hint word.
    pub(super) fn record_page(&self) -> Result<(*mut u8, sys::CUdeviceptr, sys::CUdeviceptr)> {
        let i = &self.client;
        if self.doorbell_slot == doorbell::NO_SLOT {
            return Err(Error::InvalidArgument(
                "the communicator has no doorbell slot".into(),
            ));
        }
        let layout = std::alloc::Layout::from_size_align(4096, 4096)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        // SAFETY: non-zero size; zeroed; never freed.
        let page = unsafe { std::alloc::alloc_zeroed(layout) };
        if page.is_null() {
            return Err(Error::InvalidArgument(
                "out of memory for the direct-op record".into(),
            ));
        }
        // SAFETY: `page` is page-aligned, one page, mapped for the process's life.
        let rec_dev = unsafe { map_host(page, 4096, "direct-op record")? };
        let hint_dev = {
            let mut g = lock(&i.gpu);
            i.doorbell_dev(&mut g)?
        } + doorbell::HINT_OFF
            + 4 * u64::from(self.doorbell_slot);
        Ok((page, rec_dev, hint_dev))
    }

    /// All-gathers `mine` (the same length on every rank) through the daemon (host memory).
    pub(crate) fn host_all_gather(&self, mine: &[u8]) -> Result<Vec<u8>> {
        let client = Client {
            inner: self.client.clone(),
        };
        let len = mine.len() as u64;
        let mut send = client.alloc(len)?;
        send.as_mut_slice().copy_from_slice(mine);
        let recv = client.alloc(len * u64::from(self.nranks))?;
        self.all_gather((&send, 0), (&recv, 0), len, DType::U8)?
            .wait()?;
        Ok(recv.as_slice().to_vec())
    }
}

/// Rank `r`'s offer among all ranks' (`all`, one [`OFFER_BYTES`] part per rank).
fn offer_of(all: &[u8], r: usize) -> &[u8] {
    &all[r * usize_of(OFFER_BYTES)..(r + 1) * usize_of(OFFER_BYTES)]
}
