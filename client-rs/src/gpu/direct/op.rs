//! A communicator's direct ops: whether an op takes the direct path, its launch, split ops
//! past the limit, the daemon marks left for peers, and the eager op's completion.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::sync::Arc;
use std::sync::atomic::Ordering;

use commd_proto::desc::{OpKind, RedOp, doorbell};

use super::config::{Config, defer_wait, forwarded, launch_grid, ll_op, one_block_max, split_max};
use super::plan::{Split, split_how, split_plan};
use super::signature::{Part, explain, part_signature};
use super::{DEFAULT_TIMEOUT_S, State, Windows};
use crate::gpu::cu::{ck, sys};
use crate::gpu::event::EventPool;
use crate::gpu::kernels::{self, DirectArgs, direct as k};
use crate::gpu::{CudaEvent, CudaOpArgs, CudaPosted, ensure_context, pointer_span};
use crate::{Communicator, Error, Request, Result, lock};

impl Communicator {
    /// Whether the daemon marked this communicator broken for good: a rank's process was lost,
    /// an op of it timed out in the daemon (or this process lost the daemon). One memory load; direct captured ops poll the same
    /// word on the GPU (`HINT_BROKEN`).
    pub fn is_broken(&self) -> bool {
        self.client
            .ring
            .doorbell_hint(self.doorbell_slot)
            .is_some_and(|h| h.load(Ordering::Acquire) & doorbell::HINT_BROKEN != 0)
    }

    /// How this communicator's captured collectives run: `"direct"` (docs/design-gpu.md, direct collectives),
    /// `"daemon: <why>"` (persistent ops, and why not direct), or `"undecided"` before the first
    /// one was captured.
    pub fn cuda_graph_path(&self) -> String {
        match &lock(&self.gpu).direct {
            State::Unknown => "undecided".into(),
            State::Off(why) => format!("daemon: {why}"),
            State::On(_) => "direct".into(),
        }
    }

    /// How this communicator's small eager collectives run: `"direct"` (rule 8,
    /// `COMMD_EAGER_DIRECT`), `"daemon: <why>"`, or `"undecided"` before the first one that
    /// could.
    pub fn cuda_eager_path(&self) -> String {
        let e = match super::eager::EagerConfig::cached_text() {
            Ok(e) => e,
            Err(e) => return format!("daemon: {e}"),
        };
        if !e.enabled {
            return "daemon: COMMD_EAGER_DIRECT is off".into();
        }
        if self.ranks_share_a_process {
            return "daemon: two ranks of the communicator are one process".into();
        }
        match &lock(&self.gpu).eager {
            State::Unknown => "undecided".into(),
            State::Off(why) => format!("daemon: {why}"),
            State::On(_) => "direct".into(),
        }
    }

    /// The failure of a direct op (a replay, or an eager op) on this communicator since the last
    /// look, as the error to raise (`cuda_graph_check`).
    pub(crate) fn direct_check(&self) -> Result<()> {
        let (code, message) = match self.direct_failure() {
            Some(f) => f,
            None => return Ok(()),
        };
        Err(self.client.direct_error(self.handle, code, message))
    }

    /// [`Communicator::direct_check`]'s failure, if any: its code and what failed, and why.
    pub(super) fn direct_failure(&self) -> Option<(u32, String)> {
        let c = lock(&self.gpu);
        // A replay's failure, then an eager direct op's (rule 8: its request fails too, and
        // the communicator's next call raises, as for a failed op of the daemon's path).
        for (state, eager) in [(&c.direct, false), (&c.eager, true)] {
            let State::On(w) = state else {
                continue;
            };
            let Some(r) = w.take() else {
                continue;
            };
            if eager {
                // The peer on the daemon's path waits there for this op: told now, if the
                // watchdog has not yet told it.
                self.client.report_direct_failures(Some((w.rec_host, &r)));
            }
            let what = if eager {
                "an eager GPU collective run as a direct op"
            } else {
                "a replay of a GPU collective captured into a CUDA graph"
            };
            return Some((
                r.code,
                format!(
                    "{what} on communicator {} failed (its results are not valid): {}",
                    self.comm_id,
                    explain(&r, self.rank, eager)
                ),
            ));
        }
        let s = c.p2p_shared.as_ref()?;
        let r = s.take_record()?;
        // As for an eager op: the peer waiting on the daemon's path is told now.
        self.client.report_direct_failures(Some((s.page, &r)));
        Some((
            r.code,
            format!(
                "an eager GPU send/recv run as a direct op on communicator {} failed (its results are not valid): {}",
                self.comm_id,
                super::signature::explain_p2p(&r)
            ),
        ))
    }

    /// Before an eager collective that takes the daemon's path on `stream` (device `dev`) is
    /// posted: where the communicator has eager windows and the op's kind has a direct mode,
    /// counts it and writes this rank's daemon mark (`kernels::direct::MARK_OFF`) on the
    /// stream, so that a peer that ran the same op as a direct op (another count, across the
    /// limit) or issued its ops in another order fails at once, naming this rank, instead of
    /// waiting for a flag that never comes. One memory op on the stream; nothing elsewhere.
    ///
    /// # Safety
    /// `stream` is live and of device `dev`, whose context is current.
    pub(crate) unsafe fn mark_daemon_op(
        &self,
        eager: &mut State,
        kind: OpKind,
        stream: sys::CUstream,
        dev: i32,
    ) -> Result<()> {
        let State::On(w) = eager else {
            return Ok(());
        };
        if Part::Whole.mode(kind).is_none() || w.device != dev {
            return Ok(());
        }
        let d = w.daemon_ops.wrapping_add(1);
        let mark = ((w.epoch + 1) << 32) | u64::from(d);
        ck(
            // SAFETY: the window is this rank's own (device `dev`, live for the process); the
            // caller vouches for the stream.
            unsafe {
                sys::cuStreamWriteValue64_v2(
                    stream,
                    w.win[self.rank as usize] + k::MARK_OFF,
                    mark,
                    0,
                )
            },
            "cuStreamWriteValue64(daemon mark)",
        )?;
        w.daemon_ops = d;
        Ok(())
    }

    /// Runs `a` as a direct op if this communicator can: a captured collective (direct collectives rule 1),
    /// or with `eager` an eager one (rule 8). `Ok(None)`: it takes the daemon's path instead.
    ///
    /// # Safety
    /// As `post_cuda_ordered`: live streams, device buffers valid for the op.
    pub(crate) unsafe fn try_direct(
        &self,
        a: &CudaOpArgs,
        eager: bool,
    ) -> Result<Option<CudaPosted>> {
        // SAFETY: the caller's contract.
        unsafe { self.direct_op(a, eager, Part::Whole) }
    }

    /// [`Self::try_direct`]; `part`: what the op is, by itself or one part of a split op (its
    /// signature marked [`PART`], never split again).
    ///
    /// # Safety
    /// As `try_direct`.
    pub(super) unsafe fn direct_op(
        &self,
        a: &CudaOpArgs,
        eager: bool,
        part: Part,
    ) -> Result<Option<CudaPosted>> {
        let Some(mode) = part.mode(a.kind) else {
            return Ok(None);
        };
        let op = launch_redop(a, mode)?;
        // Bytes per rank: what each rank pushes to a peer, the size of a window slot.
        let bytes = a.count.saturating_mul(a.dtype.size());
        let Some(cfg) = self.direct_config(eager)? else {
            return Ok(None);
        };
        let lim = cfg.limits(self.nranks);
        // Read for every op (a bad value fails each one, before any exchange with the peers).
        let most = split_max()?;
        let defer = defer_wait()?;
        if matches!(mode, k::MODE_AR | k::MODE_BC | k::MODE_RED)
            && part == Part::Whole
            && self.nodes <= 1
            && self.nranks <= k::MAX_RANKS
            && (mode == k::MODE_AR || a.peer < self.nranks)
            && let Some(split) = split_how(
                a.kind,
                a.count,
                a.dtype.size(),
                u64::from(self.nranks),
                lim,
                most,
            )
        {
            // SAFETY: the caller's contract.
            return unsafe { self.split_op(a, eager, split) };
        }
        // A part of a split op: its plan sized it to the split's share or chunk, within a slot.
        let max = if part != Part::Whole {
            lim.slot()
        } else {
            lim.of(mode)
        };
        if self.nodes > 1
            || self.nranks < 2
            || self.nranks > k::MAX_RANKS
            || bytes == 0
            || bytes > max
            || (a.kind.has_root() || part.rooted()) && a.peer >= self.nranks
        {
            return Ok(None);
        }
        let me_root = a.peer == self.rank;
        let (device, [send, recv]) = direct_buffers(a, part, u64::from(self.nranks), me_root)?;
        let dev = match device {
            Some(d) => d,
            // No buffer of its own (a non-root's gather of a split reduce reads its scratch
            // slot only): the device of the windows that the op's first parts used.
            None => {
                let c = lock(&self.gpu);
                match if eager { &c.eager } else { &c.direct } {
                    State::On(w) => w.device,
                    _ => 0,
                }
            }
        };
        ensure_context(dev)?;
        crate::gpu::prof::mark(crate::gpu::prof::BUFFERS);
        let mut c = lock(&self.gpu);
        let crate::gpu::CommGpu {
            direct,
            eager: eager_state,
            last,
            ..
        } = &mut *c;
        let state = if eager { eager_state } else { direct };
        let Some(w) = self.ready_windows(state, &cfg, dev, eager, a)? else {
            return Ok(None);
        };
        if bytes > w.slot {
            return Ok(None);
        }
        let (send_scratch, recv_scratch) = part.scratch(me_root);
        let l = Launch {
            eager,
            part,
            mode,
            op,
            bytes,
            defer,
            dev,
            send: if send_scratch {
                w.scratch(self.rank)
            } else {
                send
            },
            recv: if recv_scratch {
                w.scratch(self.rank)
            } else {
                recv
            },
        };
        // SAFETY: the caller's contract; the buffers were checked above.
        unsafe { self.launch_direct(w, last, a, &l) }
    }

    /// The direct path's settings for this op: the eager ones (rule 8) or the captures'.
    /// `None`: this op takes the daemon's path (direct ops off, or an eager op where two ranks
    /// are one process: the windows' setup blocks each rank until every rank takes part, and
    /// one thread may drive several ranks).
    fn direct_config(&self, eager: bool) -> Result<Option<Config>> {
        let cfg = if eager {
            let e = super::eager::EagerConfig::cached()?;
            if !e.enabled || self.ranks_share_a_process {
                return Ok(None);
            }
            // The environment read once for eager ops (each one asks: a few microseconds
            // per op otherwise); captures read it each time.
            static BLOCKS: std::sync::OnceLock<std::result::Result<u32, String>> =
                std::sync::OnceLock::new();
            let blocks = BLOCKS
                .get_or_init(|| Config::from_env().map(|c| c.blocks))
                .clone()
                .map_err(Error::InvalidArgument)?;
            Config {
                enabled: true,
                shared_gpus: e.shared_gpus,
                max_bytes: e.max_bytes,
                blocks,
            }
        } else {
            Config::from_env().map_err(Error::InvalidArgument)?
        };
        if !cfg.enabled {
            let mut c = lock(&self.gpu);
            if matches!(c.direct, State::Unknown) {
                c.direct = State::Off("COMMD_GRAPH_DIRECT=0".into());
            }
            return Ok(None);
        }
        Ok(Some(cfg))
    }

    /// This communicator's windows for the op on `dev`, set up at its first direct op.
    /// `None`: the direct path was refused for it (the op takes the daemon's path).
    fn ready_windows<'s>(
        &self,
        state: &'s mut State,
        cfg: &Config,
        dev: i32,
        eager: bool,
        a: &CudaOpArgs,
    ) -> Result<Option<&'s mut Windows>> {
        if matches!(state, State::Unknown) {
            match self.setup(cfg, dev, eager) {
                Ok(s) => *state = s,
                Err(e) => {
                    // The exchange itself failed (a rank that posted another op instead, whose
                    // op failed as a mismatch with it): this op fails too, so that every rank
                    // has spent one op of the communicator's sequence and the next ops pair as
                    // posted. Taking the daemon's path now would pair this op with the peer's
                    // next one.
                    *state = State::Off(format!("setting up the direct path failed: {e}"));
                    return Err(e);
                }
            }
        }
        if let State::On(w) = state
            && w.device != dev
        {
            return Err(Error::InvalidArgument(format!(
                "{} on device {dev}, but this rank's earlier direct ops on the communicator used device {}",
                a.kind.name(),
                w.device
            )));
        }
        match state {
            State::On(w) => Ok(Some(w)),
            _ => Ok(None),
        }
    }

    /// Launches the op's kernel on `a.stream` after what it must wait for, and returns it
    /// posted (an eager op with its status word and completion event).
    ///
    /// # Safety
    /// As `try_direct`; `l`'s buffers were checked against the op.
    unsafe fn launch_direct(
        &self,
        w: &mut Windows,
        last: &mut Option<(usize, Arc<CudaEvent>)>,
        a: &CudaOpArgs,
        l: &Launch,
    ) -> Result<Option<CudaPosted>> {
        let i = &self.client;
        let mut g = lock(&i.gpu);
        let pool = g.events.clone();
        let kern = g.kernels.get_or_insert_with(kernels::Kernels::new);
        kern.prepare(a.dtype, l.op)?;
        // SAFETY: `a.stream` and `a.after` are live (caller) and of the op's device.
        unsafe { crate::gpu::order::wait_after(&pool, l.dev, a)? };
        // An eager op on another stream than the communicator's last eager op (of either path)
        // waits for it on the GPU: the windows' epochs and the daemon's ready counter both
        // need the communicator's ops in issue order (as `post_cuda_ordered`).
        if l.eager
            && let Some((ls, ev)) = last.as_ref()
            && *ls != a.stream as usize
        {
            // SAFETY: `a.stream` is live (caller); the event is owned by the communicator.
            unsafe { ev.wait_on(a.stream)? };
        }
        // An eager op's status word, zeroed (the kernel writes its failure code there).
        let status = match (&w.status, l.eager) {
            (Some(sp), true) => Some((sp.clone(), sp.take()?)),
            (None, true) => {
                return Err(Error::InvalidArgument(
                    "eager direct windows without status words (internal error)".into(),
                ));
            }
            _ => None,
        };
        let (blocks, unit) = launch_grid(w.grid, l.bytes, self.nranks, one_block_max()?);
        let args = self.direct_args(w, a, l, blocks, unit, status.as_ref().map_or(0, |s| s.1));
        crate::gpu::prof::mark(crate::gpu::prof::PREPARE);
        // SAFETY: the windows, record and hint word live for the process (`setup`); the
        // buffers were checked by the caller, who vouches for the stream.
        if let Err(e) = unsafe { kern.launch_direct(a.stream, a.dtype, l.op, blocks, &args) } {
            if let Some((sp, word)) = &status {
                sp.give_back(*word);
            }
            return Err(e.into());
        }
        crate::gpu::prof::mark(crate::gpu::prof::LAUNCH);
        w.next_k = w.next_k.wrapping_add(1);
        if l.eager {
            w.epoch += 1;
        }
        let Some((sp, word)) = status else {
            let done = if a.record {
                let ev = pool.get(l.dev)?;
                // SAFETY: `a.stream` is live and of the event's device.
                unsafe { ev.record(a.stream)? };
                Some(Arc::new(ev))
            } else {
                None
            };
            return Ok(Some(CudaPosted {
                request: Request::new(i.clone(), 0, Some(Ok(0)), None),
                done,
                device: l.dev,
                last_ticket: 0,
                bytes: l.bytes,
                captured: true,
            }));
        };
        // SAFETY: `a.stream` is live (caller); the kernel holding `word` was launched on it.
        unsafe { self.eager_launched(a, &pool, last, sp, word, l) }.map(Some)
    }

    /// The kernel's arguments: the windows, the buffers, and the op's place in the windows'
    /// sequence.
    fn direct_args(
        &self,
        w: &Windows,
        a: &CudaOpArgs,
        l: &Launch,
        blocks: u32,
        unit: u32,
        status: u32,
    ) -> DirectArgs {
        let mode = forwarded(l.mode, l.part, self.nranks, l.bytes, w.fwd_min);
        DirectArgs {
            win: w.win,
            input: l.send,
            out: l.recv,
            count: a.count,
            slot: w.slot,
            rec: w.rec_dev,
            hint: w.hint_dev,
            timeout_ns: self
                .op_timeout
                .unwrap_or(std::time::Duration::from_secs(DEFAULT_TIMEOUT_S))
                .as_nanos()
                .try_into()
                .unwrap_or(u64::MAX),
            me: self.rank,
            n: self.nranks,
            sig: part_signature(l.part, a.kind, a.dtype, l.op, a.peer),
            k: w.next_k,
            divisor: self.nranks,
            mode,
            root: a.peer,
            status,
            unit,
            ll: u32::from(ll_op(l.eager, w.epoch + 1, blocks, l.bytes, w.ll_max, mode)),
            defer: u32::from(l.defer),
            dseq: if l.eager { w.daemon_ops } else { 0 },
            epoch: if l.eager { w.epoch + 1 } else { 0 },
        }
    }

    /// An eager op whose kernel was launched: one event after the kernel is the op's
    /// completion, the order point for the communicator's next op on another stream, and
    /// (`a.record`) the caller's done event. (A word whose kernel was launched is never given
    /// back: if this record failed, the kernel could still write it after another op took it.)
    ///
    /// # Safety
    /// `a.stream` is live, not capturing, and runs the kernel that holds `word`.
    unsafe fn eager_launched(
        &self,
        a: &CudaOpArgs,
        pool: &Arc<EventPool>,
        last: &mut Option<(usize, Arc<CudaEvent>)>,
        sp: Arc<super::eager::StatusPool>,
        word: u32,
        l: &Launch,
    ) -> Result<CudaPosted> {
        let ev = pool.get(l.dev).map(Arc::new).and_then(|ev| {
            // SAFETY: `a.stream` is live and of the event's device.
            unsafe { ev.record(a.stream) }.map(|()| ev)
        });
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                // The op is launched but no event orders the communicator's next op after it.
                // Eager epochs are numbered in issue order (`DirectArgs::epoch`), so the GPU
                // must run them in that order: wait for this one before failing.
                // SAFETY: `a.stream` is live (caller); an eager op's stream is not capturing.
                let _ = unsafe { sys::cuStreamSynchronize(a.stream) };
                return Err(e);
            }
        };
        *last = Some((a.stream as usize, ev.clone()));
        let op = sp.launched(word, ev.clone(), false);
        let posted = self.eager_posted(a, sp, op, ev, l.dev, l.bytes);
        crate::gpu::prof::mark(crate::gpu::prof::EVENT);
        Ok(posted)
    }

    /// An op past the direct limit as direct ops (`COMMD_DIRECT_SPLIT_MAX_BYTES`,
    /// [`split_share`]), each a kernel on the caller's stream, marked [`PART`]: the count's
    /// remainder modulo the ranks first (the same op on the last elements; first, so that ranks
    /// whose counts differ only there fail at once), then the body in shares of `share`
    /// elements, one per rank:
    /// - all-reduce: a reduce-scatter into this rank's share of the output (NCCL's in-place
    ///   layout when the buffers are one), then an all-gather of the shares in place;
    /// - broadcast: a scatter of the root's input into each rank's share of the output, then the
    ///   same all-gather;
    /// - reduce: a reduce-scatter into the root's share of its output and the other ranks'
    ///   scratch slots (their buffers are the input only), then a gather of the shares to the
    ///   root.
    ///
    /// Each GPU sends at most 2 (n - 1) / n x the bytes in two launches, against the daemon's
    /// copy-engine rounds with a host turnaround each. A reduce whose share is past the split
    /// runs in chunks instead ([`Split::Chunks`]): on 2 ranks the same reduce on each range of
    /// at most the direct limit, one launch each; on 3+ each chunk split in shares as above. An eager call's request fails if any part
    /// failed (`super::eager::LocalDone::earlier`); `Ok(None)` when the direct path is off (no part ran: the
    /// same on every rank).
    ///
    /// # Safety
    /// As `try_direct`.
    pub(super) unsafe fn split_op(
        &self,
        a: &CudaOpArgs,
        eager: bool,
        split: Split,
    ) -> Result<Option<CudaPosted>> {
        let es = a.dtype.size();
        let plan = split_plan(
            a.kind,
            a.count,
            es,
            self.nranks,
            self.rank,
            a.peer,
            a.send,
            a.recv,
            split,
        )
        .map_err(Error::InvalidArgument)?;
        let parts: Vec<(CudaOpArgs, Part)> = plan
            .into_iter()
            .map(|p| {
                let args = CudaOpArgs {
                    kind: p.kind,
                    count: p.count,
                    send: p.send,
                    recv: p.recv,
                    ..*a
                };
                (args, p.part)
            })
            .collect();
        let last = parts.len() - 1;
        let mut earlier = Vec::with_capacity(last);
        for (i, (mut p, part)) in parts.into_iter().enumerate() {
            if i > 0 {
                p.after = None;
            }
            p.record = a.record && i == last;
            // SAFETY: the caller's contract; every part lies within the op's buffers (or a
            // scratch slot of the windows).
            let Some(mut posted) = (unsafe { self.direct_op(&p, eager, part)? }) else {
                if i == 0 {
                    return Ok(None);
                }
                return Err(Error::InvalidArgument(format!(
                    "{} split into direct ops: part {i} could not run after part 0 did (internal error)",
                    a.kind.name()
                )));
            };
            if i < last {
                earlier.extend(posted.request.local.take().map(|l| l.op));
                continue;
            }
            if let Some(l) = posted.request.local.as_mut() {
                l.earlier = std::mem::take(&mut earlier);
                l.what = a.kind.name();
            }
            posted.bytes = a.count.saturating_mul(es);
            return Ok(Some(posted));
        }
        Ok(None)
    }

    /// The posted op of an eager direct op (collective or send/recv): its status `op` (launched
    /// on a word of `pool`), completed by `ev` (recorded after its kernel).
    pub(crate) fn eager_posted(
        &self,
        a: &CudaOpArgs,
        pool: Arc<super::eager::StatusPool>,
        op: Arc<super::eager::OpStatus>,
        ev: Arc<crate::gpu::CudaEvent>,
        dev: i32,
        bytes: u64,
    ) -> CudaPosted {
        CudaPosted {
            request: Request::new(
                self.client.clone(),
                0,
                None,
                Some(super::eager::LocalDone {
                    pool,
                    op,
                    earlier: Vec::new(),
                    comm_id: self.comm_id,
                    handle: self.handle,
                    rank: self.rank,
                    what: a.kind.name(),
                }),
            ),
            done: a.record.then_some(ev),
            device: dev,
            last_ticket: 0,
            bytes,
            captured: false,
        }
    }
}

/// What one direct launch is, once its windows are known.
struct Launch {
    eager: bool,
    part: Part,
    mode: u32,
    op: RedOp,
    bytes: u64,
    defer: bool,
    dev: i32,
    send: sys::CUdeviceptr,
    recv: sys::CUdeviceptr,
}

/// The reduction the op's kernel module is loaded for: copies (all-gather, broadcast,
/// all-to-all, scatter, gather) load the (dtype, sum) module, which any dtype has.
fn launch_redop(a: &CudaOpArgs, mode: u32) -> Result<RedOp> {
    match (mode, a.redop) {
        (k::MODE_AG | k::MODE_BC | k::MODE_A2A | k::MODE_SC | k::MODE_GA, _) => Ok(RedOp::Sum),
        (_, Some(op)) => Ok(op),
        (_, None) => Err(Error::InvalidArgument(format!(
            "{} needs a reduction op",
            a.kind.name()
        ))),
    }
}

/// The op's send and recv buffers, each checked to lie in one allocation of one device:
/// (that device, [send, recv]); 0 for a buffer the op does not use. A non-root's share of a
/// split reduce is in its scratch slot instead (the caller's).
fn direct_buffers(
    a: &CudaOpArgs,
    part: Part,
    n: u64,
    me_root: bool,
) -> Result<(Option<i32>, [u64; 2])> {
    // (uses, elements) of the send and the recv buffer.
    let (send_use, recv_use) = part.buffers(a.kind, a.count, n, me_root);
    let mut device = None;
    let mut bufs = [0u64; 2];
    let mut span = None;
    for (i, (what, (uses, elems), p)) in [("send", send_use, a.send), ("recv", recv_use, a.recv)]
        .into_iter()
        .enumerate()
    {
        if !uses {
            continue;
        }
        let p = p.ok_or_else(|| {
            Error::InvalidArgument(format!("{} needs a {what} buffer", a.kind.name()))
        })?;
        let len = elems
            .and_then(|e| e.checked_mul(a.dtype.size()))
            .ok_or_else(|| Error::InvalidArgument(format!("count {} overflows", a.count)))?;
        // In place: one query for both buffers.
        let (base, size, ordinal) = match span {
            Some((q, s)) if q == p => s,
            _ => pointer_span(p)?,
        };
        span = Some((p, (base, size, ordinal)));
        if p.checked_add(len).is_none_or(|end| end > base + size) {
            return Err(Error::InvalidArgument(format!(
                "{} {what} buffer {p:#x}: {len} bytes run past its allocation ({base:#x}, {size} bytes)",
                a.kind.name(),
            )));
        }
        if *device.get_or_insert(ordinal) != ordinal {
            return Err(Error::InvalidArgument(format!(
                "{} buffers on two devices ({} and {ordinal})",
                a.kind.name(),
                device.unwrap_or(-1),
            )));
        }
        bufs[i] = p;
    }
    Ok((device, bufs))
}
