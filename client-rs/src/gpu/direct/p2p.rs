//! Eager send/recv of the NCCL library as direct ops (`COMMD_P2P_DIRECT`, on by default;
//! docs/design.md, "Send/recv as direct ops"): a channel per ordered pair, the protocol of
//! `p2p_model.rs`, the kernels of `kernels::p2p`.
//!
//! A pair's channel is set up at the first eligible send or receive between the two ranks, by
//! those two alone: each allocates its inbox from the other (a 4 KiB header, two slots), and a
//! host send + receive through the daemon exchanges the IPC handles, device UUIDs and slot
//! sizes, then each side's verdict (both take the path or neither does, for the pair's life).
//! Both sides reach that exchange at the same point of the pair's op sequence because the
//! choice depends only on what both see alike (the setting, the op's bytes). Sequence numbers
//! are counted per direction on the host; ops of a communicator run in issue order (the order
//! point of eager ops, `CommGpu::last`).

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::sync::{Arc, OnceLock};

use commd_proto::desc::{DType, OpKind};

use super::super::cu::sys;
use super::super::kernels::{self, P2pArgs, p2p as kp};
use super::super::{CudaOpArgs, CudaPosted, ensure_context, pointer_span};
use super::DEFAULT_TIMEOUT_S;
use super::config::env_int;
use super::eager::StatusPool;
use super::signature::p2p_signature;
use super::window::{alloc_window, open_peer};
use crate::{Client, Communicator, Error, Result, lock};

/// `COMMD_P2P_DIRECT` (unset or `auto`: on, a pair that cannot take the path keeps the
/// daemon's quietly; `1`/`on`: on, such a pair says why on stderr; `shared`: as `1`, and ranks
/// that share a GPU take the path too, for tests on one GPU (their kernels are time-sliced:
/// slow); `0`/`off`: every send/recv takes the daemon's path),
/// `COMMD_P2P_DIRECT_MAX_BYTES` (the largest send, default 4 MiB: the slot size) and
/// `COMMD_P2P_LL_MAX_BYTES` (the largest send of the LL protocol, 0 to 256 KiB, default 256 KiB;
/// 0 sends every message the simple way).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct P2pConfig {
    pub enabled: bool,
    /// Asked for by name (`1`/`on`): a pair left on the daemon's path says why on stderr.
    pub explicit: bool,
    /// `shared`: ranks that share a GPU take the path too (tests).
    pub shared_gpus: bool,
    pub max_bytes: u64,
    pub ll_max: u64,
}

const DEFAULT_MAX_BYTES: u64 = 4 << 20;
/// Bytes each side sends in the handle exchange (the first 97 used) and in the verdict (the
/// first used): odd sizes, so that a peer whose `COMMD_P2P_DIRECT` differs, posting its own
/// first send/recv there instead, fails as a mismatched send/recv (the daemon checks count and
/// dtype) rather than taking these bytes for its data.
const OFFER: usize = 1021;
const VERDICT: usize = 1019;

impl P2pConfig {
    pub fn parse(
        mode: Option<&str>,
        max: Option<&str>,
        ll: Option<&str>,
    ) -> std::result::Result<Self, String> {
        let (enabled, explicit, shared_gpus) = match mode.map(str::trim) {
            None | Some("") | Some("auto") => (true, false, false),
            Some("1") | Some("on") => (true, true, false),
            Some("shared") => (true, true, true),
            Some("0") | Some("off") => (false, false, false),
            Some(v) => {
                return Err(format!(
                    "COMMD_P2P_DIRECT={v:?}: expected auto (the default), 1/on, shared (tests: ranks sharing a GPU too) or 0/off"
                ));
            }
        };
        let max_bytes =
            env_int("COMMD_P2P_DIRECT_MAX_BYTES", max, 1, 1 << 30)?.unwrap_or(DEFAULT_MAX_BYTES);
        let ll_max = env_int("COMMD_P2P_LL_MAX_BYTES", ll, 0, kp::LL_CAP)?.unwrap_or(kp::LL_CAP);
        Ok(Self {
            enabled,
            explicit,
            shared_gpus,
            max_bytes,
            ll_max,
        })
    }

    /// The process's setting, read once; a bad one fails every GPU send/recv with its name.
    pub fn cached() -> Result<Self> {
        static C: OnceLock<std::result::Result<P2pConfig, String>> = OnceLock::new();
        C.get_or_init(|| {
            Self::parse(
                commd_settings::get(&commd_settings::keys::P2P_DIRECT).as_deref(),
                commd_settings::get(&commd_settings::keys::P2P_DIRECT_MAX_BYTES).as_deref(),
                commd_settings::get(&commd_settings::keys::P2P_LL_MAX_BYTES).as_deref(),
            )
        })
        .clone()
        .map_err(Error::InvalidArgument)
    }
}

/// One ordered pair's state on this rank: refused (why), or the channel.
pub(crate) enum Pair {
    Off(String),
    On(Box<Channel>),
}

pub(crate) struct Channel {
    /// This rank's inbox from the peer, and the peer's inbox from this rank (opened).
    local: sys::CUdeviceptr,
    remote: sys::CUdeviceptr,
    slot: u64,
    device: i32,
    /// The last sequence sent to / received from the peer.
    sent: u64,
    received: u64,
    /// Eager sends to / receives from the peer that took the daemon's path since the channel
    /// was set up (past the direct limit): carried in each direct op's signature
    /// ([`p2p_signature`]), so that a receive whose peer issued another number of them before
    /// its send (the two ranks' messages differ in size across the limit, or in order) fails
    /// as a mismatch rather than taking another message's data.
    pub(crate) daemon_sent: u64,
    pub(crate) daemon_received: u64,
}

/// What every channel of a communicator shares: the status words and failure record, and the
/// doorbell hint word.
pub(crate) struct P2pShared {
    /// Host address of the record page.
    pub(crate) page: usize,
    pool: Arc<StatusPool>,
    rec_dev: sys::CUdeviceptr,
    hint_dev: sys::CUdeviceptr,
}

impl P2pShared {
    /// A failure the kernels recorded since the last look (the communicator's next call
    /// raises it, as for the other direct ops).
    pub(crate) fn take_record(&self) -> Option<super::signature::Record> {
        super::record::read_record(self.page, true)
    }
}

/// GPU memory of the inboxes of `pairs` (this rank's, one per peer with a channel): kept until
/// the process exits (the peer may still map it).
pub(crate) fn inbox_bytes(pairs: &std::collections::HashMap<u32, Pair>) -> u64 {
    pairs
        .values()
        .map(|p| match p {
            Pair::On(ch) => kp::DATA_OFF + 2 * ch.slot,
            Pair::Off(_) => 0,
        })
        .sum()
}

/// The device of the current context (the library's communicator device: `Comm::run` makes
/// it current).
fn current_device() -> Result<i32> {
    let mut dev = 0;
    // SAFETY: valid out pointer; fails when no context is current.
    super::super::cu::ck(unsafe { sys::cuCtxGetDevice(&mut dev) }, "cuCtxGetDevice")?;
    Ok(dev)
}

/// Blocks for a send or receive of `bytes`: one per 8 KiB (1024 lines) of an LL message, one
/// per 16 KiB of the others, up to 32.
fn grid_for(bytes: u64, ll: bool) -> u32 {
    let per = if ll { 8 << 10 } else { 16 << 10 };
    (bytes.div_ceil(per)).clamp(1, 32) as u32
}

impl crate::gpu::CommGpu {
    /// Before an eager send (`send`) to or receive from `peer` is posted to the daemon's path
    /// on `stream` (device `dev`): where the pair has a channel, counts it (the signature of
    /// the direction's later direct ops carries the count) and writes this rank's daemon mark
    /// for the direction into its own inbox (`kernels::p2p::SEND_MARK_OFF`, `RECV_MARK_OFF`)
    /// on the stream, where the peer's waiting direct op reads it. One memory op on the
    /// stream.
    ///
    /// # Safety
    /// `stream` is live and of device `dev`, whose context is current.
    pub(crate) unsafe fn p2p_daemon_op(
        &mut self,
        peer: u32,
        send: bool,
        stream: sys::CUstream,
        dev: Option<i32>,
    ) -> Result<()> {
        let Some(Pair::On(ch)) = self.p2p.get_mut(&peer) else {
            return Ok(());
        };
        let (at, seq, count) = if send {
            (kp::SEND_MARK_OFF, ch.sent + 1, &mut ch.daemon_sent)
        } else {
            (kp::RECV_MARK_OFF, ch.received + 1, &mut ch.daemon_received)
        };
        // (An op on another device than the channel's: counted, no mark; its direct ops
        // would be refused.)
        if dev == Some(ch.device) {
            let mark = kp::mark(seq, *count + 1);
            super::super::cu::ck(
                // SAFETY: the inbox is this rank's own (device `dev`, live for the process);
                // the caller vouches for the stream.
                unsafe { sys::cuStreamWriteValue64_v2(stream, ch.local + at, mark, 0) },
                "cuStreamWriteValue64(send/recv daemon mark)",
            )?;
        }
        // Counted once the mark is on the stream (a failure leaves both as they were: the op
        // is not posted).
        *count += 1;
        Ok(())
    }
}

impl Communicator {
    /// Which path this rank's GPU send/recv with `peer` take and why: `direct`, `daemon: why`,
    /// or `undecided` before the pair's first eligible op.
    pub fn cuda_p2p_path(&self, peer: u32) -> String {
        match P2pConfig::cached() {
            Err(e) => return format!("daemon: {e}"),
            Ok(c) if !c.enabled => return "daemon: COMMD_P2P_DIRECT is off".into(),
            Ok(_) => {}
        }
        match lock(&self.gpu).p2p.get(&peer) {
            None => "undecided".into(),
            Some(Pair::Off(why)) => format!("daemon: {why}"),
            Some(Pair::On(_)) => "direct".into(),
        }
    }

    /// Runs an eager send or receive as a direct op if this communicator and the op can
    /// (`COMMD_P2P_DIRECT`); `Ok(None)`: it takes the daemon's path.
    ///
    /// # Safety
    /// As `post_cuda_ordered`: a live stream, a device buffer valid for the op.
    pub(crate) unsafe fn try_direct_p2p(&self, a: &CudaOpArgs) -> Result<Option<CudaPosted>> {
        let cfg = P2pConfig::cached()?;
        let Some(one) = self.p2p_plan(a, &cfg, true)? else {
            return Ok(None);
        };
        // SAFETY: the caller's contract.
        let mut posted = unsafe { self.p2p_launch(&[(a, one)])? };
        Ok(posted.pop().flatten())
    }

    /// Whether the eager send/recv `a` runs as a direct op if posted now: direct send/recv on,
    /// its pair's channel set up and on, its bytes within the limit, its buffer checked, the
    /// communicator not broken. The NCCL library posts a group's such ops before its others
    /// (those of the daemon's path), so that both ranks of a pair issue each direction's
    /// messages of a group in the same order across the two paths, whichever of them runs its
    /// direct ops as one kernel (`post_cuda_p2p_group`): the daemon-path counts in the
    /// signatures and the daemon marks rely on it.
    pub fn cuda_p2p_direct_eligible(&self, a: &CudaOpArgs) -> bool {
        let Ok(cfg) = P2pConfig::cached() else {
            return false;
        };
        !self.is_broken()
            && matches!(self.p2p_plan(a, &cfg, false), Ok(Some(_)))
            && matches!(lock(&self.gpu).p2p.get(&a.peer), Some(Pair::On(_)))
    }

    /// Posts a group's send/recv ops (`ops`, as the NCCL library holds them at `ncclGroupEnd`:
    /// every send before any receive) that can be direct ops as one kernel: one launch, one
    /// event, a status word and a request each. One entry per op: its posted op, or `None` for
    /// one the caller posts the usual way (after these). Groups of fewer than two such ops,
    /// more than `kernels::p2p::GROUP_MAX`, more blocks than the GPU has SMs, two in one
    /// direction of a pair, or such ops on two streams are left to the usual way whole. The
    /// pairs must be set up already ([`Self::cuda_p2p_prepare`]): an op of a pair without a
    /// channel is left out.
    ///
    /// # Safety
    /// As `post_cuda_ordered`, for every op: live streams, device buffers valid for the ops.
    pub unsafe fn post_cuda_p2p_group(
        &self,
        ops: &[CudaOpArgs],
    ) -> Result<Vec<Option<CudaPosted>>> {
        let mut out: Vec<Option<CudaPosted>> = ops.iter().map(|_| None).collect();
        let cfg = P2pConfig::cached()?;
        // A communicator the daemon broke for good: the usual way, which sends each op to the
        // daemon for the reason (`post_cuda_once`).
        if !cfg.enabled || ops.len() < 2 || self.is_broken() {
            return Ok(out);
        }
        let mut pick = Vec::new();
        let mut at = Vec::new();
        let mut blocks = 0u32;
        let c = lock(&self.gpu);
        for (i, a) in ops.iter().enumerate() {
            // An op this path cannot take, or whose checks fail, goes the usual way (which
            // reports the same failure for that op alone).
            let Ok(Some(one)) = self.p2p_plan(a, &cfg, false) else {
                continue;
            };
            if !matches!(c.p2p.get(&a.peer), Some(Pair::On(_))) {
                continue;
            }
            if pick
                .first()
                .is_some_and(|(f, _): &(&CudaOpArgs, Plan)| f.stream != a.stream)
            {
                // Direct ops on two streams: one op at a time, sends first, as without the
                // group kernel (a kernel holding receives must not hold back a send on another
                // stream, which would wait for it through the communicator's order).
                return Ok(out);
            }
            if pick
                .iter()
                .any(|(f, p): &(&CudaOpArgs, Plan)| f.peer == a.peer && p.send == one.send)
            {
                // Two ops of one direction of a pair: one at a time. In one kernel the later
                // receive could finish first and its ack would free the earlier one's slot
                // while that one is still being read.
                return Ok(out);
            }
            blocks += grid_for(one.bytes, one.ll);
            pick.push((a, one));
            at.push(i);
        }
        drop(c);
        // A captured group goes the usual way, op by op (captured send/recv are persistent
        // ops of the daemon, docs/design-gpu.md, persistent ops rules): host-counted sequences baked into a graph would
        // repeat at every replay.
        if let Some((f, _)) = pick.first() {
            // SAFETY: the caller's live stream.
            match unsafe { super::super::graph::capture_of(f.stream, "a send/recv group") } {
                Ok(None) => {}
                _ => return Ok(out),
            }
        }
        let sms = {
            let mut g = lock(&self.client.gpu);
            g.kernels
                .get_or_insert_with(kernels::Kernels::new)
                .sm_count()?
        };
        if pick.len() < 2 || pick.len() > kp::GROUP_MAX || blocks > sms {
            return Ok(out);
        }
        // SAFETY: the caller's contract.
        let posted = unsafe { self.p2p_launch(&pick)? };
        for (i, p) in at.into_iter().zip(posted) {
            out[i] = p;
        }
        Ok(out)
    }

    /// Whether `a` can be a direct op now, and its buffer, bytes and device; sets its pair up
    /// first if `setup` and it has no channel yet (the pair's first op of any size, on both
    /// sides: the exchange is then the first message each way between the two ranks,
    /// wherever each side starts; a group's end prepares all its pairs at once).
    fn p2p_plan(&self, a: &CudaOpArgs, cfg: &P2pConfig, setup: bool) -> Result<Option<Plan>> {
        let send = match a.kind {
            OpKind::Send => true,
            OpKind::Recv => false,
            _ => return Ok(None),
        };
        let peer = a.peer;
        let bytes = a.count.saturating_mul(a.dtype.size());
        if !cfg.enabled
            || !a.p2p_direct
            || self.ranks_share_a_process
            || self.nodes > 1
            || peer >= self.nranks
            || peer == self.rank
        {
            return Ok(None);
        }
        if setup && !lock(&self.gpu).p2p.contains_key(&peer) {
            self.cuda_p2p_prepare(&[peer], current_device()?)?;
        }
        if bytes == 0 || bytes > cfg.max_bytes {
            return Ok(None);
        }
        let (what, buf) = if send {
            ("send", a.send)
        } else {
            ("recv", a.recv)
        };
        let buf = buf.ok_or_else(|| {
            Error::InvalidArgument(format!("{} needs a {what} buffer", a.kind.name()))
        })?;
        let (base, size, dev) = match a.span {
            Some(s) => s,
            None => pointer_span(buf)?,
        };
        if buf.checked_add(bytes).is_none_or(|end| end > base + size) {
            return Err(Error::InvalidArgument(format!(
                "{} {what} buffer {buf:#x}: {bytes} bytes run past its allocation ({base:#x}, {size} bytes)",
                a.kind.name(),
            )));
        }
        Ok(Some(Plan {
            send,
            buf,
            bytes,
            dev,
            ll: bytes <= cfg.ll_max,
        }))
    }

    /// Launches `ops` (all on the first one's stream and device) as one kernel: the op's own
    /// kernel for one, the group kernel for more. One entry per op: `None` where its pair has
    /// no channel (or another device's), if there is only one op; with more, any such op
    /// leaves them all to the usual way.
    ///
    /// # Safety
    /// As `post_cuda_ordered`, for every op.
    unsafe fn p2p_launch(&self, ops: &[(&CudaOpArgs, Plan)]) -> Result<Vec<Option<CudaPosted>>> {
        let none = || ops.iter().map(|_| None).collect();
        let Some(&(first, Plan { dev, .. })) = ops.first() else {
            return Ok(Vec::new());
        };
        let stream = first.stream;
        super::super::prof::mark(super::super::prof::BUFFERS);
        ensure_context(dev)?;
        let mut c = lock(&self.gpu);
        let super::super::CommGpu {
            p2p,
            p2p_shared,
            last,
            ..
        } = &mut *c;
        let Some(shared) = p2p_shared.as_ref() else {
            return Ok(none());
        };
        // Every op's channel, as it stands (sequences counted here, kept on success).
        let Some((mut seqs, chans)) = op_channels(p2p, ops, dev)? else {
            return Ok(none());
        };
        let i = &self.client;
        let mut g = lock(&i.gpu);
        let pool = g.events.clone();
        let kern = g.kernels.get_or_insert_with(kernels::Kernels::new);
        kern.prepare(first.dtype, commd_proto::desc::RedOp::Sum)?;
        // In issue order with the communicator's other eager ops (the pair's sequences).
        if let Some((ls, ev)) = last.as_ref()
            && *ls != stream as usize
        {
            // SAFETY: `stream` is live (caller); the event is owned by the communicator.
            unsafe { ev.wait_on(stream)? };
        }
        let timeout_ns = self
            .op_timeout
            .unwrap_or(std::time::Duration::from_secs(DEFAULT_TIMEOUT_S))
            .as_nanos()
            .try_into()
            .unwrap_or(u64::MAX);
        let mut group = kernels::P2pGroupArgs::default();
        let mut words = Vec::with_capacity(ops.len());
        let mut blocks = 0u32;
        for (k, ((a, pl), &(local, remote, slot, daemon))) in ops.iter().zip(&chans).enumerate() {
            // Every op's peer is in `seqs` (pushed above).
            let Some(s) = seqs.iter_mut().find(|(p, _, _)| *p == a.peer) else {
                words.iter().for_each(|w| shared.pool.give_back(*w));
                return Ok(none());
            };
            let word = match shared.pool.take() {
                Ok(w) => w,
                Err(e) => {
                    words.iter().for_each(|w| shared.pool.give_back(*w));
                    return Err(e);
                }
            };
            words.push(word);
            let seq = if pl.send {
                s.1 += 1;
                s.1
            } else {
                s.2 += 1;
                s.2
            };
            group.ops[k] = P2pArgs {
                local,
                remote,
                buf: pl.buf,
                bytes: pl.bytes,
                slot,
                rec: shared.rec_dev,
                hint: shared.hint_dev,
                timeout_ns,
                seq,
                sig: p2p_signature(a.dtype, daemon),
                status: word,
                ll: u32::from(pl.ll),
                pad: 0,
            };
            group.first[k] = blocks;
            blocks += grid_for(pl.bytes, pl.ll);
            if pl.send {
                group.sends |= 1 << k;
            }
        }
        group.n = u32::try_from(ops.len()).expect("a group holds at most GROUP_MAX ops");
        group.first[ops.len()] = blocks;
        super::super::prof::mark(super::super::prof::PREPARE);
        // SAFETY: the inboxes, record and hint word live for the process (`p2p_setup`); the
        // buffers were checked (`p2p_plan`); the caller vouches for the stream.
        let launched =
            unsafe { launch_group(kern, stream, first.dtype, ops[0].1.send, blocks, &group) };
        super::super::prof::mark(super::super::prof::LAUNCH);
        if let Err(e) = launched {
            words.iter().for_each(|w| shared.pool.give_back(*w));
            return Err(e.into());
        }
        for (peer, sent, received) in seqs {
            if let Some(Pair::On(ch)) = p2p.get_mut(&peer) {
                ch.sent = sent;
                ch.received = received;
            }
        }
        let ev = Arc::new(pool.get(dev)?);
        // SAFETY: `stream` is live and of the event's device.
        unsafe { ev.record(stream)? };
        *last = Some((stream as usize, ev.clone()));
        super::super::prof::mark(super::super::prof::EVENT);
        let out = ops
            .iter()
            .zip(words)
            .map(|((a, pl), word)| {
                let op = shared.pool.launched(word, ev.clone(), true);
                Some(self.eager_posted(a, shared.pool.clone(), op, ev.clone(), dev, pl.bytes))
            })
            .collect();
        super::super::prof::mark(super::super::prof::REQUESTS);
        Ok(out)
    }

    /// Sets up the direct send/recv channels with `peers` (those without one yet) on `device`,
    /// whose context must be current: the NCCL library calls it at a group's end with every
    /// peer of the group's send/recv ops before it posts them, so that a group whose pairs
    /// form a cycle does not wait on itself. With `COMMD_P2P_DIRECT` off it does nothing. A
    /// pair whose setup fails keeps the daemon's path (said once on stderr, and by
    /// [`Self::cuda_p2p_path`]).
    pub fn cuda_p2p_prepare(&self, peers: &[u32], device: i32) -> Result<()> {
        let cfg = P2pConfig::cached()?;
        if !cfg.enabled || self.ranks_share_a_process || self.nodes > 1 {
            return Ok(());
        }
        let mut c = lock(&self.gpu);
        self.p2p_setup(peers, device, &cfg, &mut c);
        Ok(())
    }

    /// Sets up the channels of this rank with every rank of `peers` that has none yet (both
    /// directions of each pair), each of those ranks doing the same for this one (through
    /// [`Self::cuda_p2p_prepare`] at the end of its group, or at its first send/recv with this
    /// rank). Every exchange message of a round is posted before any is waited for, so a group
    /// whose pairs form a cycle (a ring's sends and receives) sets up without a deadlock.
    fn p2p_setup(&self, peers: &[u32], dev: i32, cfg: &P2pConfig, c: &mut super::super::CommGpu) {
        // A group's end may come inside a CUDA graph capture (its ops then go the daemon's
        // way): the inboxes are allocated in relaxed capture mode, which allows it (torch and
        // NCCL programs capture in global or thread-local mode, which refuse it).
        let _relaxed = super::super::Relaxed::enter().ok();
        let slot = cfg.max_bytes.div_ceil(4096) * 4096;
        let mut todo: Vec<Setup> = Vec::new();
        for &peer in peers {
            if peer < self.nranks
                && peer != self.rank
                && !c.p2p.contains_key(&peer)
                && !todo.iter().any(|t| t.peer == peer)
            {
                todo.push(Setup {
                    peer,
                    local: 0,
                    remote: 0,
                    offer: vec![0u8; OFFER],
                    why: None,
                });
            }
        }
        if todo.is_empty() {
            return;
        }
        self.p2p_offers(&mut todo, dev, cfg, slot);
        // Round 1: the offers (inbox handle, device, slot size).
        let offers: Vec<&[u8]> = todo.iter().map(|t| t.offer.as_slice()).collect();
        let peers: Vec<u32> = todo.iter().map(|t| t.peer).collect();
        let theirs = self.host_exchange(&peers, &offers);
        for (t, theirs) in todo.iter_mut().zip(theirs) {
            self.p2p_check_offer(t, theirs, dev, cfg);
        }
        if c.p2p_shared.is_none() && todo.iter().any(|t| t.why.is_none()) {
            self.p2p_record(c, &mut todo);
        }
        // Round 2: the verdicts (both sides take the direct path, or neither does).
        let verdicts: Vec<Vec<u8>> = todo
            .iter()
            .map(|t| vec![u8::from(t.why.is_none()); VERDICT])
            .collect();
        let refs: Vec<&[u8]> = verdicts.iter().map(|v| v.as_slice()).collect();
        let theirs = self.host_exchange(&peers, &refs);
        for (t, theirs) in todo.into_iter().zip(theirs) {
            let mut t = t;
            match theirs {
                Err(e) => {
                    t.why
                        .get_or_insert(format!("the exchange with rank {} failed: {e}", t.peer));
                }
                Ok(v) if t.why.is_none() && v[0] != 1 => {
                    t.why = Some(format!(
                        "rank {} could not map this rank's inbox or make its record",
                        t.peer
                    ));
                }
                Ok(_) => {}
            }
            let peer = t.peer;
            c.p2p.insert(peer, self.p2p_pair(t, slot, dev, cfg));
        }
    }

    /// Fills each setup's offer: this GPU's UUID, the slot size, the LL limit, and a fresh
    /// inbox's IPC handle (or why there is none).
    fn p2p_offers(&self, todo: &mut [Setup], dev: i32, cfg: &P2pConfig, slot: u64) {
        let uuid = super::super::device_uuid(dev);
        for t in todo {
            match &uuid {
                Ok(u) => t.offer[64..80].copy_from_slice(u),
                Err(e) => t.why = Some(format!("rank {}: {e}", self.rank)),
            }
            t.offer[80..88].copy_from_slice(&slot.to_le_bytes());
            t.offer[89..97].copy_from_slice(&cfg.ll_max.to_le_bytes());
            if t.why.is_none() {
                match alloc_window(kp::DATA_OFF + 2 * slot, &[(0, kp::DATA_OFF)]) {
                    Ok((p, h)) => {
                        t.local = p;
                        t.offer[..64].copy_from_slice(&h);
                        t.offer[88] = 1;
                    }
                    Err(e) => t.why = Some(format!("rank {}: {e}", self.rank)),
                }
            }
        }
    }

    /// Checks the peer's offer against this rank's and maps the peer's inbox, or says why
    /// the pair cannot take the direct path.
    fn p2p_check_offer(&self, t: &mut Setup, theirs: Result<Vec<u8>>, dev: i32, cfg: &P2pConfig) {
        let theirs = match theirs {
            Ok(v) => v,
            Err(e) => {
                t.why
                    .get_or_insert(format!("the exchange with rank {} failed: {e}", t.peer));
                return;
            }
        };
        if t.why.is_some() {
            return;
        }
        let peer = t.peer;
        if theirs[88] != 1 {
            t.why = Some(format!("rank {peer} could not allocate its inbox"));
        } else if theirs[80..88] != t.offer[80..88] {
            t.why = Some(format!(
                "rank {peer} has another COMMD_P2P_DIRECT_MAX_BYTES than rank {}",
                self.rank
            ));
        } else if theirs[89..97] != t.offer[89..97] {
            t.why = Some(format!(
                "rank {peer} has another COMMD_P2P_LL_MAX_BYTES than rank {}",
                self.rank
            ));
        } else if theirs[64..80] == t.offer[64..80] && !cfg.shared_gpus {
            t.why = Some(format!("ranks {} and {peer} share a GPU", self.rank));
        } else {
            match open_peer(dev, &theirs) {
                Ok(p) => t.remote = p,
                Err(e) => {
                    t.why = Some(format!(
                        "rank {} cannot map rank {peer}'s inbox: {e}",
                        self.rank
                    ))
                }
            }
        }
    }

    /// The communicator's send/recv record page and status words, made at its first direct
    /// pair (each pending setup fails with the reason when it cannot be made).
    fn p2p_record(&self, c: &mut super::super::CommGpu, todo: &mut [Setup]) {
        match self.record_page() {
            Ok((page, rec_dev, hint_dev)) => {
                // The watchdog reads its record too: a send's mark failure leaves the
                // peer waiting on the daemon's path (`report_direct_failures`).
                lock(&self.client.gpu)
                    .records
                    .push(super::record::RecordWatch {
                        page: page as usize,
                        handle: self.handle,
                        rank: self.rank,
                        told: false,
                        p2p: true,
                    });
                c.p2p_shared = Some(P2pShared {
                    page: page as usize,
                    // SAFETY: `record_page` leaks the page: it lives for the process.
                    pool: Arc::new(unsafe { StatusPool::new(page as usize) }),
                    rec_dev,
                    hint_dev,
                })
            }
            Err(e) => {
                for t in todo.iter_mut().filter(|t| t.why.is_none()) {
                    t.why = Some(format!("rank {}: {e}", self.rank));
                }
            }
        }
    }

    /// The pair's outcome once both sides gave their verdict: its channel, or why it takes
    /// the daemon's path (what was set up for it freed).
    fn p2p_pair(&self, t: Setup, slot: u64, dev: i32, cfg: &P2pConfig) -> Pair {
        match t.why {
            None => Pair::On(Box::new(Channel {
                local: t.local,
                remote: t.remote,
                slot,
                device: dev,
                sent: 0,
                received: 0,
                daemon_sent: 0,
                daemon_received: 0,
            })),
            Some(why) => {
                if t.remote != 0 {
                    // SAFETY: opened with cuIpcOpenMemHandle by `p2p_check_offer`; no work
                    // uses it.
                    unsafe { sys::cuIpcCloseMemHandle(t.remote) };
                }
                if t.local != 0 {
                    // SAFETY: allocated by `p2p_offers`; no work uses it.
                    unsafe { sys::cuMemFree_v2(t.local) };
                }
                // By default quietly (two ranks sharing a GPU is a normal setup); the
                // reason stays in `cuda_p2p_path`.
                if cfg.explicit {
                    eprintln!(
                        "commd: communicator {}: send/recv between ranks {} and {} take the daemon's path, not the direct one: {why}",
                        self.comm_id, self.rank, t.peer
                    );
                }
                Pair::Off(why)
            }
        }
    }

    /// Sends `mine[i]` to `peers[i]` and receives as many bytes from it, through the daemon
    /// (host memory): every send and receive posted before any is waited for. One result per
    /// peer.
    fn host_exchange(&self, peers: &[u32], mine: &[&[u8]]) -> Vec<Result<Vec<u8>>> {
        let client = Client {
            inner: self.client.clone(),
        };
        let mut bufs = Vec::with_capacity(peers.len());
        for m in mine {
            let len = m.len() as u64;
            bufs.push(client.alloc(len).and_then(|mut s| {
                s.as_mut_slice().copy_from_slice(m);
                Ok((s, client.alloc(len)?))
            }));
        }
        let posted: Vec<_> = bufs
            .iter()
            .zip(peers)
            .map(|(b, &peer)| {
                let (s, r) = b.as_ref().map_err(|e| Error::Unsupported(e.to_string()))?;
                let ps = self.send((s, 0), s.len(), DType::U8, peer)?;
                let pr = self.recv((r, 0), r.len(), DType::U8, peer)?;
                Ok((ps, pr, r))
            })
            .collect();
        posted
            .into_iter()
            .map(|p: Result<_>| {
                let (ps, pr, r) = p?;
                ps.wait()?;
                pr.wait()?;
                Ok(r.as_slice().to_vec())
            })
            .collect()
    }
}

/// A send or receive that can be a direct op: its direction, buffer, bytes and device.
#[derive(Clone, Copy)]
struct Plan {
    send: bool,
    buf: sys::CUdeviceptr,
    bytes: u64,
    dev: i32,
    /// The LL protocol (at most `COMMD_P2P_LL_MAX_BYTES`, which both sides share).
    ll: bool,
}

/// One pair's setup in progress on this rank.
struct Setup {
    peer: u32,
    local: sys::CUdeviceptr,
    remote: sys::CUdeviceptr,
    offer: Vec<u8>,
    why: Option<String>,
}

/// A peer's `(rank, sent, received)` sequences.
type PeerSeqs = (u32, u64, u64);
/// An op's channel: `(local inbox, remote inbox, slot, the daemon's ops on the pair)`.
type OpChannel = (u64, u64, u64, u64);

/// Each op's channel as it stands, `(local, remote, slot, daemon ops)`, and each peer's
/// `(peer, sent, received)` sequences. `None` where a pair has no channel (or another device's)
/// among several ops; an error for the one op whose pair's channel is on another device.
fn op_channels(
    p2p: &std::collections::HashMap<u32, Pair>,
    ops: &[(&CudaOpArgs, Plan)],
    dev: i32,
) -> Result<Option<(Vec<PeerSeqs>, Vec<OpChannel>)>> {
    let mut seqs: Vec<PeerSeqs> = Vec::new();
    let mut chans = Vec::with_capacity(ops.len());
    for (a, pl) in ops {
        match p2p.get(&a.peer) {
            Some(Pair::On(ch)) if ch.device == pl.dev && pl.dev == dev => {
                if !seqs.iter().any(|(p, _, _)| *p == a.peer) {
                    seqs.push((a.peer, ch.sent, ch.received));
                }
                let daemon = if pl.send {
                    ch.daemon_sent
                } else {
                    ch.daemon_received
                };
                chans.push((ch.local, ch.remote, ch.slot, daemon));
            }
            Some(Pair::On(ch)) if ops.len() == 1 => {
                return Err(Error::InvalidArgument(format!(
                    "{} on device {}, but this rank's earlier direct send/recv with rank {} used device {}",
                    a.kind.name(),
                    pl.dev,
                    a.peer,
                    ch.device
                )));
            }
            _ => return Ok(None),
        }
    }
    Ok(Some((seqs, chans)))
}

/// Launches a group's kernel: the op's own for one, the two-op kernel for two, the group
/// kernel for more.
///
/// # Safety
/// As `p2p_launch`: every op's buffers, inboxes and record are live, `stream` too.
unsafe fn launch_group(
    kern: &mut kernels::Kernels,
    stream: sys::CUstream,
    dtype: DType,
    first_send: bool,
    blocks: u32,
    group: &kernels::P2pGroupArgs,
) -> std::result::Result<(), kernels::KernelError> {
    // SAFETY: the caller's contract.
    unsafe {
        match group.n {
            1 => kern.launch_p2p(stream, dtype, first_send, blocks, &group.ops[0]),
            2 => {
                let two = kernels::P2pTwoArgs {
                    split: group.first[1],
                    sends: group.sends,
                    ops: [group.ops[0], group.ops[1]],
                };
                kern.launch_p2p_two(stream, dtype, blocks, &two)
            }
            _ => kern.launch_p2p_group(stream, dtype, group),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::signature::sig_fields;
    use super::*;

    #[test]
    fn config_is_on_by_default_and_refuses_bad_values() {
        let c = P2pConfig::parse(None, None, None).unwrap();
        assert!(c.enabled && !c.explicit);
        assert_eq!(P2pConfig::parse(Some("auto"), None, None).unwrap(), c);
        let on = P2pConfig::parse(Some(" on "), None, None).unwrap();
        assert!(on.enabled && on.explicit);
        assert!(!P2pConfig::parse(Some("0"), None, None).unwrap().enabled);
        assert!(!P2pConfig::parse(Some("off"), None, None).unwrap().enabled);
        assert_eq!(c.max_bytes, DEFAULT_MAX_BYTES);
        assert_eq!(c.ll_max, kp::LL_CAP);
        assert!(
            P2pConfig::parse(Some("1"), Some("65536"), None)
                .unwrap()
                .enabled
        );
        let sh = P2pConfig::parse(Some("shared"), None, None).unwrap();
        assert!(sh.enabled && sh.explicit && sh.shared_gpus && !on.shared_gpus && !c.shared_gpus);
        let e = P2pConfig::parse(Some("maybe"), None, None).unwrap_err();
        assert!(e.contains("COMMD_P2P_DIRECT=\"maybe\""), "{e}");
        let e = P2pConfig::parse(Some("1"), Some("0"), None).unwrap_err();
        assert!(e.contains("COMMD_P2P_DIRECT_MAX_BYTES"), "{e}");
        assert_eq!(
            P2pConfig::parse(Some("1"), None, Some("0")).unwrap().ll_max,
            0
        );
        let e = P2pConfig::parse(Some("1"), None, Some("262145")).unwrap_err();
        assert!(e.contains("COMMD_P2P_LL_MAX_BYTES=\"262145\""), "{e}");
    }

    /// How two ranks' messages between them pair (sizes, in issue order, the sender's and the
    /// receiver's): each side sends a message past `LIMIT` on the daemon's path, the others as
    /// direct ops; each path pairs its messages in order; a direct receive fails if the send's
    /// bytes or daemon-path count (`counts`; without them, as before) differ, the daemon's path
    /// if the bytes differ. `Some(pairs)` (position of the sender's message for each of the
    /// receiver's) when every message paired and nothing failed.
    fn pairing(sends: &[u64], recvs: &[u64], counts: bool) -> Option<Vec<usize>> {
        const LIMIT: u64 = 100;
        // Per side: (direct ops: (position, bytes, daemon ops before)), (daemon ops: position).
        type Side = (Vec<(usize, u64, u64)>, Vec<usize>);
        let split = |msgs: &[u64]| -> Side {
            let (mut direct, mut daemon) = (Vec::new(), Vec::new());
            for (i, &b) in msgs.iter().enumerate() {
                if b > LIMIT {
                    daemon.push(i);
                } else {
                    direct.push((i, b, daemon.len() as u64));
                }
            }
            (direct, daemon)
        };
        let (sd, sn) = split(sends);
        let (rd, rn) = split(recvs);
        if sd.len() != rd.len() || sn.len() != rn.len() {
            return None;
        }
        let mut pairs = vec![usize::MAX; recvs.len()];
        for (s, r) in sd.iter().zip(&rd) {
            let sig = |d: u64| p2p_signature(DType::F32, if counts { d } else { 0 });
            if s.1 != r.1 || sig(s.2) != sig(r.2) {
                return None;
            }
            pairs[r.0] = s.0;
        }
        for (&s, &r) in sn.iter().zip(&rn) {
            if sends[s] != recvs[r] {
                return None;
            }
            pairs[r] = s;
        }
        Some(pairs)
    }

    #[test]
    fn equal_daemon_counts_pair_every_message_in_order() {
        // Every pair of lists of up to 5 messages of 2 direct and 2 daemon-path sizes: where
        // nothing fails, the k-th receive took the k-th message (as NCCL pairs them), so a
        // message never lands in another receive unnoticed.
        let sizes = [8u64, 64, 200, 4000];
        let lists = |n: usize| -> Vec<Vec<u64>> {
            (0..sizes.len().pow(u32::try_from(n).unwrap()))
                .map(|mut x| {
                    (0..n)
                        .map(|_| {
                            let s = sizes[x % sizes.len()];
                            x /= sizes.len();
                            s
                        })
                        .collect()
                })
                .collect()
        };
        let all: Vec<Vec<u64>> = (0..=5).flat_map(lists).collect();
        let (mut ok, mut misplaced_without) = (0, 0);
        for a in &all {
            for b in all.iter().filter(|b| b.len() == a.len()) {
                if let Some(p) = pairing(a, b, true) {
                    assert!(
                        p.iter().enumerate().all(|(i, &j)| i == j),
                        "{a:?} -> {b:?}: {p:?}"
                    );
                    ok += 1;
                }
                if pairing(a, b, false).is_some_and(|p| p.iter().enumerate().any(|(i, &j)| i != j))
                {
                    misplaced_without += 1;
                }
            }
        }
        // Matching lists pair (1 + 4 + ... + 4^5 of them), and without the counts some lists
        // that differ in order across the limit pair with messages in the wrong receives.
        assert_eq!(ok, (0..=5).map(|n| 4usize.pow(n)).sum::<usize>());
        assert!(misplaced_without > 0);
    }

    /// The end of a simulated run of two ranks' messages between them (`run_pair`).
    #[derive(Debug, PartialEq)]
    enum End {
        /// Every op done: the receiver's k-th receive took the sender's message `pairs[k]`.
        Done(Vec<usize>),
        /// An op failed: a signature or size mismatch, or a daemon mark (`by_mark`).
        Failed { by_mark: bool },
        /// Nothing can move; `one_side_done`: one rank ran its whole list (the other waits for
        /// an op never issued, until the op timeout, as NCCL would).
        Stuck { one_side_done: bool },
    }

    /// One rank's place in a simulated run (`run_pair`).
    #[derive(Default)]
    struct Rank {
        /// The next op of its list.
        at: usize,
        /// Direct sequences issued and daemon-path ops so far.
        seq: u64,
        daemon: u64,
        /// Its daemon mark for the direction (0: none yet).
        mark: u64,
    }

    /// What one step of a rank did.
    #[derive(PartialEq)]
    enum Step {
        Moved,
        Blocked,
        Failed { by_mark: bool },
    }

    /// The sender's (`sender`) or the receiver's step at an op past `SIM_LIMIT`: its mark, written
    /// as the stream reaches the op (a new one is a step), and the pairing of both ranks' k-th
    /// daemon-path ops once both are there (the daemon checks the sizes).
    fn daemon_step(
        s: &mut Rank,
        r: &mut Rank,
        sender: bool,
        sends: &[u64],
        recvs: &[u64],
        pairs: &mut [usize],
    ) -> Step {
        let me = if sender { &mut *s } else { &mut *r };
        let m = kp::mark(me.seq + 1, me.daemon + 1);
        let wrote = me.mark != m;
        me.mark = m;
        let (Some(&a), Some(&b)) = (sends.get(s.at), recvs.get(r.at)) else {
            return Step::Blocked;
        };
        if a > SIM_LIMIT && b > SIM_LIMIT && s.daemon == r.daemon {
            if a != b {
                return Step::Failed { by_mark: false };
            }
            pairs[r.at] = s.at;
            (s.daemon, r.daemon, s.at, r.at) = (s.daemon + 1, r.daemon + 1, s.at + 1, r.at + 1);
            return Step::Moved;
        }
        if wrote { Step::Moved } else { Step::Blocked }
    }

    /// The simulated direct limit (`run_pair`).
    const SIM_LIMIT: u64 = 100;

    /// Runs a sender's and a receiver's messages (sizes), each rank on one stream, as the
    /// kernels and the daemon do: a message past `LIMIT` takes the daemon's path (both sides'
    /// k-th ones pair; its mark written when the stream reaches it), the others are direct (a
    /// send of q waits for the ack of q - 2, a receive for flag q, then checks the bytes and
    /// signature); a waiting direct op reads the peer's mark (with `marks`). `greedy`: which
    /// rank runs as far as it can before the other takes a step (0: they alternate, 1: the
    /// sender, 2: the receiver).
    fn run_pair(sends: &[u64], recvs: &[u64], marks: bool, greedy: u8) -> End {
        const LIMIT: u64 = SIM_LIMIT;
        let (mut s, mut r) = (Rank::default(), Rank::default());
        // flags[q]: (sender's message index, its bytes, its daemon count) of direct send q.
        let mut flags: Vec<(usize, u64, u64)> = vec![(0, 0, 0)];
        let mut ack = 0u64;
        let mut pairs = vec![usize::MAX; recvs.len()];
        let step_sender =
            |s: &mut Rank, r: &mut Rank, flags: &mut Vec<_>, ack: u64, pairs: &mut Vec<usize>| {
                let Some(&b) = sends.get(s.at) else {
                    return Step::Blocked;
                };
                if b > LIMIT {
                    return daemon_step(s, r, true, sends, recvs, pairs);
                }
                let q = s.seq + 1;
                if ack + 2 >= q {
                    flags.push((s.at, b, s.daemon));
                    (s.seq, s.at) = (q, s.at + 1);
                    return Step::Moved;
                }
                if marks && kp::mark_proves_mismatch(r.mark, q - 2, s.daemon) {
                    return Step::Failed { by_mark: true };
                }
                Step::Blocked
            };
        let step_receiver = |s: &mut Rank,
                             r: &mut Rank,
                             flags: &Vec<(usize, u64, u64)>,
                             ack: &mut u64,
                             pairs: &mut Vec<usize>| {
            let Some(&b) = recvs.get(r.at) else {
                return Step::Blocked;
            };
            if b > LIMIT {
                return daemon_step(s, r, false, sends, recvs, pairs);
            }
            let q = r.seq + 1;
            if let Some(&(from, sb, sdn)) = flags.get(usize::try_from(q).unwrap()) {
                if sb != b || p2p_signature(DType::F32, sdn) != p2p_signature(DType::F32, r.daemon)
                {
                    return Step::Failed { by_mark: false };
                }
                pairs[r.at] = from;
                (r.seq, *ack, r.at) = (q, q, r.at + 1);
                return Step::Moved;
            }
            if marks && kp::mark_proves_mismatch(s.mark, q, r.daemon) {
                return Step::Failed { by_mark: true };
            }
            Step::Blocked
        };
        loop {
            let mut moved = false;
            for who in [1u8, 2] {
                loop {
                    let st = if who == 1 {
                        step_sender(&mut s, &mut r, &mut flags, ack, &mut pairs)
                    } else {
                        step_receiver(&mut s, &mut r, &flags, &mut ack, &mut pairs)
                    };
                    match st {
                        Step::Failed { by_mark } => return End::Failed { by_mark },
                        Step::Moved => moved = true,
                        Step::Blocked => break,
                    }
                    // The greedy rank goes on; the other takes one step at most.
                    if greedy != who {
                        break;
                    }
                }
            }
            if s.at == sends.len() && r.at == recvs.len() {
                return End::Done(pairs);
            }
            if !moved {
                return End::Stuck {
                    one_side_done: s.at == sends.len() || r.at == recvs.len(),
                };
            }
        }
    }

    #[test]
    fn daemon_marks_turn_every_wait_of_both_ranks_into_an_error() {
        // Every pair of lists of up to 4 messages of 2 direct and 2 daemon-path sizes, each
        // rank on one stream: where both lists are the same, every message arrives in order
        // and no mark fires; where they differ, the run never ends stuck with both ranks
        // waiting mid-list (without the marks some do: the orders across the limit).
        let sizes = [8u64, 64, 200, 4000];
        let all: Vec<Vec<u64>> = (0..=4u32)
            .flat_map(|n| {
                (0..sizes.len().pow(n)).map(move |mut x| {
                    (0..n)
                        .map(|_| {
                            let s = sizes[x % sizes.len()];
                            x /= sizes.len();
                            s
                        })
                        .collect::<Vec<u64>>()
                })
            })
            .collect();
        let (mut by_mark, mut stuck_without) = (0, 0);
        for a in &all {
            for b in &all {
                for greedy in 0..3 {
                    let end = run_pair(a, b, true, greedy);
                    if a == b {
                        assert_eq!(end, End::Done((0..a.len()).collect()), "{a:?} ({greedy})");
                        continue;
                    }
                    match end {
                        // Only where the sender has direct messages that no receive took
                        // and no later direct receive came after (more sends than receives:
                        // they complete unreceived, as NCCL's eager sends do); every receive
                        // took a message of its size, in order.
                        End::Done(p) => {
                            let last_direct = p.iter().filter(|&&j| a[j] <= 100).max();
                            let unseen =
                                |u: usize| a[u] <= 100 && last_direct.is_none_or(|&l| l < u);
                            assert!(
                                p.windows(2).all(|w| w[0] < w[1])
                                    && p.iter().zip(b).all(|(&j, &x)| a[j] == x)
                                    && (0..a.len()).filter(|i| !p.contains(i)).all(unseen),
                                "{a:?} -> {b:?}: done as {p:?}"
                            );
                        }
                        End::Stuck { one_side_done } => {
                            assert!(one_side_done, "{a:?} -> {b:?}: both ranks stuck")
                        }
                        End::Failed { by_mark: m } => by_mark += usize::from(m),
                    }
                    if run_pair(a, b, false, greedy)
                        == (End::Stuck {
                            one_side_done: false,
                        })
                    {
                        stuck_without += 1;
                    }
                }
            }
        }
        assert!(
            by_mark > 0 && stuck_without > 0,
            "{by_mark} {stuck_without}"
        );
    }

    #[test]
    fn a_mark_proves_a_mismatch_only_past_this_sides_count_at_or_before_its_sequence() {
        // The peer's mark: its direct op #5 comes after 3 daemon-path ops.
        let m = kp::mark(5, 3);
        assert!(kp::mark_proves_mismatch(m, 5, 2));
        assert!(kp::mark_proves_mismatch(m, 9, 2));
        assert!(!kp::mark_proves_mismatch(m, 5, 3));
        assert!(!kp::mark_proves_mismatch(m, 4, 2));
        assert!(!kp::mark_proves_mismatch(0, 5, 0));
        // Counts wrap at 2^20: one past the wrap is still past.
        assert!(kp::mark_proves_mismatch(
            kp::mark(5, 1 << 20),
            5,
            (1 << 20) - 1
        ));
    }

    #[test]
    fn a_signature_keeps_the_dtype_and_the_daemon_count_apart_from_any_ll_byte_count() {
        let s = p2p_signature(DType::BF16, 5);
        assert_eq!(sig_fields(s), Some((DType::BF16.code(), 5)));
        // Counts wrap at 2^20; a byte count of an LL header (at most 256 KiB) is no signature.
        assert_eq!(
            sig_fields(p2p_signature(DType::F32, (1 << 20) + 3)).map(|f| f.1),
            Some(3)
        );
        assert_eq!(sig_fields(u32::try_from(kp::LL_CAP).unwrap()), None);
        assert_ne!(p2p_signature(DType::F32, 0), p2p_signature(DType::F32, 1));
        assert_ne!(p2p_signature(DType::F32, 0), p2p_signature(DType::I32, 0));
    }

    #[test]
    fn grids_grow_with_the_bytes_up_to_32_blocks() {
        assert_eq!(grid_for(8, false), 1);
        assert_eq!(grid_for(16 << 10, false), 1);
        assert_eq!(grid_for((16 << 10) + 1, false), 2);
        assert_eq!(grid_for(4 << 20, false), 32);
        assert_eq!(grid_for(8, true), 1);
        assert_eq!(grid_for(8 << 10, true), 1);
        assert_eq!(grid_for((8 << 10) + 1, true), 2);
        assert_eq!(grid_for(kp::LL_CAP, true), 32);
    }
}
