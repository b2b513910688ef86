//! Collectives across nodes, hierarchical: each daemon acts for all of its node's ranks (the
//! intra-node part reads and writes their shared-memory buffers directly), and one daemon per node
//! talks to the others over the [`Wire`].
//!
//! Reductions are *exact*: every element is reduced in rank order with the accumulator type of
//! the single-node path (f32 for f16/bf16, i128 for integer averages), so results are bitwise
//! identical to a single-node communicator of the same size. Two algorithms keep that property:
//! - **one-shot** (small messages, one network round): every node sends its ranks' inputs to the
//!   nodes that need the result, which reduce all inputs locally in rank order;
//! - **chain** (large messages, pipelined): the running accumulator of ranks `0..k` travels in
//!   chunks along the nodes in rank order (each node folds in its ranks), and the last node's
//!   result is pipelined back along a chain of the nodes. Per node that is about 2x the message
//!   each way, the same as a ring at large node counts (a ring would reduce in a different order
//!   per segment, and so would not be exact).
//!
//! Data-movement collectives (all-gather, all-to-all, broadcast, reduce-scatter) send each block
//! once to each node that needs it; broadcast of large messages is a pipelined chain.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

mod chain;
mod moves;

use commd_proto::num::usize_of;
use std::time::Instant;

use commd_proto::desc::{DType, OpKind, RedOp};

use super::wire::{CLASS_COLL, NetError, RecvId, SendId, Sig, Tag, Wire};
use crate::engine::RankBufs;
use crate::engine::reduce::{self, Kernel};

/// Who is where.
#[derive(Clone, Debug)]
pub struct Topo {
    pub me: usize,
    /// Node ids (advertised peer addresses), node 0 hosting rank 0.
    pub nodes: Vec<String>,
    pub rank_node: Vec<usize>,
    /// Per node, its ranks ascending.
    pub node_ranks: Vec<Vec<u32>>,
}

impl Topo {
    pub fn new(me: usize, nodes: Vec<String>, rank_node: Vec<usize>) -> Self {
        let mut node_ranks = vec![Vec::new(); nodes.len()];
        for (r, &n) in rank_node.iter().enumerate() {
            if let Some(v) = node_ranks.get_mut(n) {
                v.push(crate::ranks::of(r));
            }
        }
        Self {
            me,
            nodes,
            rank_node,
            node_ranks,
        }
    }

    pub fn nranks(&self) -> usize {
        self.rank_node.len()
    }

    pub fn local(&self) -> &[u32] {
        &self.node_ranks[self.me]
    }

    /// "node 1 (10.0.0.2:7400, ranks 2,3)".
    pub fn label(&self, node: usize) -> String {
        let Some(id) = self.nodes.get(node) else {
            return format!("node {node}");
        };
        format!("node {node} ({id}, {})", ranks_text(&self.node_ranks[node]))
    }
}

pub use crate::ranks::text as ranks_text;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    Auto,
    OneShot,
    Chain,
}

#[derive(Clone, Copy, Debug)]
pub struct Tuning {
    pub chunk: u64,
    pub small: u64,
    pub algo: Algo,
    /// Data-plane threads a reduction or copy of one chunk may split over (config `workers`).
    pub workers: usize,
}

/// One matched collective, as seen by this node.
pub struct Coll {
    pub kind: OpKind,
    pub dtype: DType,
    pub redop: Option<RedOp>,
    pub count: u64,
    pub root: u32,
    pub seq: u64,
    /// This node's ranks and their buffers, ascending by rank.
    pub bufs: Vec<(u32, RankBufs)>,
}

impl Coll {
    pub fn sig(&self) -> Sig {
        Sig {
            op: u8::try_from(self.kind.code()).expect("every op code is below 256"),
            dtype: self.dtype.code(),
            redop: self.redop.map_or(0xff, |r| r.code()),
            root: if self.kind.has_root() { self.root } else { 0 },
            count: self.count,
        }
    }
}

/// Renders a wire signature like the single-node mismatch errors do.
pub fn sig_text(s: &Sig) -> String {
    let kind = OpKind::from_code(u16::from(s.op)).map_or("?", |k| k.name());
    let dt = DType::from_code(s.dtype).map_or("?", |d| d.name());
    let mut t = format!("{kind}(dtype={dt}, count={}", s.count);
    if let Some(r) = RedOp::from_code(s.redop) {
        t.push_str(&format!(", op={}", r.name()));
    }
    if OpKind::from_code(u16::from(s.op)).is_some_and(|k| k.has_root()) {
        t.push_str(&format!(", root={}", s.root));
    }
    t.push(')');
    t
}

/// Daemon-owned, grow-only, 16-byte aligned scratch for one communicator.
#[derive(Default)]
pub struct Scratch {
    buf: Vec<u128>,
}

impl Scratch {
    /// A region of at least `bytes` bytes (contents unspecified), valid until the next call.
    pub fn get(&mut self, bytes: u64) -> *mut u8 {
        let words = usize_of(bytes).div_ceil(16).max(1);
        if self.buf.len() < words {
            self.buf = vec![0u128; words];
        }
        self.buf.as_mut_ptr().cast()
    }
}

/// Posts, waits and releases; keeps the algorithms short.
struct Io<'a> {
    w: &'a mut Wire,
    t: &'a Topo,
    sig: Sig,
    seq: u64,
    sends: Vec<SendId>,
    deadline: Instant,
    what: String,
}

impl Io<'_> {
    /// # Safety
    /// `ptr` valid for `len` reads until [`Io::finish`] returns.
    unsafe fn send(
        &mut self,
        node: usize,
        msg: u64,
        ptr: *const u8,
        len: u64,
    ) -> Result<(), NetError> {
        let sig = self.sig;
        // SAFETY: forwarded.
        let id = unsafe {
            self.w.send(
                node,
                Tag {
                    class: CLASS_COLL,
                    a: self.seq,
                    b: msg,
                },
                &sig,
                ptr,
                usize_of(len),
            )?
        };
        self.sends.push(id);
        Ok(())
    }

    /// # Safety
    /// `ptr` valid for `len` writes until the receive completes or [`Io::finish`] returns.
    unsafe fn recv(
        &mut self,
        node: usize,
        msg: u64,
        ptr: *mut u8,
        len: u64,
    ) -> Result<RecvId, NetError> {
        let sig = self.sig;
        // SAFETY: forwarded.
        unsafe {
            self.w.recv(
                node,
                Tag {
                    class: CLASS_COLL,
                    a: self.seq,
                    b: msg,
                },
                Some(sig),
                ptr,
                len,
                sig_text,
            )
        }
    }

    fn wait(&mut self, recvs: &[RecvId]) -> Result<(), NetError> {
        let t = self.t;
        let what = &self.what;
        let seq = self.seq;
        let progress: Vec<Option<u64>> = (0..t.nodes.len())
            .map(|n| self.w.peer_progress(n))
            .collect();
        self.w.wait(&[], recvs, self.deadline, sig_text, &|peers: &[usize]| {
            let who: Vec<String> = peers
                .iter()
                .map(|&p| {
                    let posted = progress[p].map_or(String::new(), |x| {
                        if x <= seq {
                            format!(": its ranks have posted only {x} collectives, so some of them never posted seq {seq}")
                        } else {
                            String::new()
                        }
                    });
                    format!("{}{posted}", t.label(p))
                })
                .collect();
            format!("{what} timed out waiting for data from {}", who.join("; "))
        })?;
        for r in recvs {
            self.w.release_recv(r);
        }
        Ok(())
    }

    fn finish(mut self) -> Result<(), NetError> {
        self.flush()
    }

    /// Moves whatever bytes the streams take or hold now, without waiting: called between the
    /// chunks of a pipelined algorithm, so that data flows while this thread computes.
    fn progress(&mut self) -> Result<(), NetError> {
        self.w.pump(None, sig_text)
    }

    /// Waits until every send so far has left (its source may be overwritten after this).
    fn flush(&mut self) -> Result<(), NetError> {
        let sends = std::mem::take(&mut self.sends);
        let what = self.what.clone();
        let t = self.t;
        self.w.wait(&sends, &[], self.deadline, sig_text, &|_| {
            format!(
                "{what} timed out sending: the other {} node(s) stopped reading",
                t.nodes.len() - 1
            )
        })?;
        for s in sends {
            self.w.release_send(s);
        }
        Ok(())
    }
}

fn local_err(why: &str) -> NetError {
    NetError::Local(format!("internal error: {why}"))
}

/// Runs `c` on this node; returns the algorithm used.
pub fn run(
    w: &mut Wire,
    t: &Topo,
    c: &Coll,
    scratch: &mut Scratch,
    tu: &Tuning,
    deadline: Instant,
    what: String,
) -> Result<&'static str, NetError> {
    let mut io = Io {
        w,
        t,
        sig: c.sig(),
        seq: c.seq,
        sends: Vec::new(),
        deadline,
        what,
    };
    let es = c.dtype.size();
    let blk = c.count * es;
    let small = match tu.algo {
        Algo::OneShot => true,
        Algo::Chain => false,
        Algo::Auto => blk <= tu.small,
    };
    let name = match c.kind {
        OpKind::AllReduce | OpKind::Reduce => {
            let kernel = c
                .redop
                .and_then(|r| Kernel::new(c.dtype, r).ok())
                .ok_or_else(|| local_err("reduction without a valid op"))?;
            if small {
                one_shot_reduce(&mut io, c, kernel, scratch)?;
                "one-shot"
            } else {
                chain::chain_reduce(&mut io, c, kernel, scratch, tu)?;
                "chain"
            }
        }
        OpKind::ReduceScatter => {
            let kernel = c
                .redop
                .and_then(|r| Kernel::new(c.dtype, r).ok())
                .ok_or_else(|| local_err("reduction without a valid op"))?;
            reduce_scatter(&mut io, c, kernel, scratch)?;
            "one-shot"
        }
        OpKind::AllGather => {
            moves::all_gather(&mut io, c)?;
            "direct"
        }
        OpKind::AllToAll => {
            moves::all_to_all(&mut io, c, scratch)?;
            "direct"
        }
        OpKind::Broadcast => {
            if small || t.nodes.len() <= 2 {
                moves::broadcast_direct(&mut io, c)?;
                "direct"
            } else {
                moves::broadcast_chain(&mut io, c, tu.chunk)?;
                "chain"
            }
        }
        OpKind::Barrier => {
            let mut rs = Vec::new();
            for n in 0..t.nodes.len() {
                if n != t.me {
                    // SAFETY: zero-length transfers touch no memory.
                    unsafe { io.send(n, 0, std::ptr::NonNull::<u8>::dangling().as_ptr(), 0)? };
                    // SAFETY: as above.
                    rs.push(unsafe {
                        io.recv(n, 0, std::ptr::NonNull::<u8>::dangling().as_ptr(), 0)?
                    });
                }
            }
            io.wait(&rs)?;
            "direct"
        }
        OpKind::Send | OpKind::Recv => return Err(local_err("p2p op in the collective path")),
    };
    io.finish()?;
    Ok(name)
}

/// Message id of the zero-length signature check that travels beside a switch all-reduce.
const SWITCH_SIG_MSG: u64 = u64::MAX - 3;

/// Whether a switch session can aggregate `c`: an all-reduce summing int32 (exact) or
/// float32 (sum or avg, block floating point). Otherwise the reason.
pub fn switch_fits(c: &Coll) -> Result<bool, String> {
    if c.kind != OpKind::AllReduce || c.count == 0 {
        return Ok(false);
    }
    match (c.dtype, c.redop) {
        (DType::I32, Some(RedOp::Sum)) => Ok(true),
        (DType::F32, Some(RedOp::Sum | RedOp::Avg)) => Ok(true),
        (d, r) => Err(format!(
            "the switch aggregates int32 sums and float32 sums/averages, not {}/{}",
            d.name(),
            r.map_or("?", |r| r.name())
        )),
    }
}

/// How a switch all-reduce ended.
#[derive(Debug, PartialEq, Eq)]
pub enum SwitchRun {
    Done,
    /// A float32 block held a value the switch cannot carry: redo the op over TCP (every node
    /// sees this for the same op, and no output was written).
    Unrepresentable,
}

/// Hierarchical all-reduce through a switch session: this node's ranks are reduced locally (in
/// rank order) into the scratch, the switch sums the nodes' partials, and the result goes to
/// every local output. A zero-length message to every node carries the op's signature beside
/// the switch traffic, so a collective that differs across nodes fails instead of mixing data,
/// and a lost node is noticed by the wire while the switch waits.
#[allow(clippy::too_many_arguments)]
pub fn run_switch(
    w: &mut Wire,
    t: &Topo,
    c: &Coll,
    scratch: &mut Scratch,
    sw: &mut crate::switch::worker::Worker,
    deadline: Instant,
    what: String,
    via: &str,
) -> Result<SwitchRun, NetError> {
    let mut io = Io {
        w,
        t,
        sig: c.sig(),
        seq: c.seq,
        sends: Vec::new(),
        deadline,
        what: what.clone(),
    };
    let t0 = Instant::now();
    let dangling = std::ptr::NonNull::<u8>::dangling().as_ptr();
    let mut rs = Vec::new();
    for n in (0..t.nodes.len()).filter(|&n| n != t.me) {
        // SAFETY: zero-length transfers touch no memory.
        unsafe { io.send(n, SWITCH_SIG_MSG, dangling, 0)? };
        // SAFETY: as above.
        rs.push(unsafe { io.recv(n, SWITCH_SIG_MSG, dangling, 0)? });
    }
    let float = c.dtype == DType::F32;
    let count = usize_of(c.count);
    let mut inputs = Vec::with_capacity(c.bufs.len());
    for i in 0..c.bufs.len() {
        inputs.push(send_ptr(c, i)?);
    }
    // The switch works in place on one buffer. Rank 0's output serves when it is not an input
    // (the inputs stay intact for a float32 redo over TCP), or when an in-place int32 op has a
    // single local rank (int32 is never redone): that saves a copy in and a copy out of the
    // whole tensor. Otherwise a scratch buffer.
    let out0 = recv_ptr(c, 0)?;
    let aliased = inputs.iter().any(|&p| p == out0.cast_const());
    let acc = if !aliased || (!float && inputs.len() == 1) {
        out0
    } else {
        scratch.get(c.count * 4)
    };
    if !(aliased && inputs.len() == 1 && acc == out0) {
        let k = Kernel::new(c.dtype, RedOp::Sum).map_err(|e| local_err(&e.to_string()))?;
        // SAFETY: inputs are valid registered spans of count elements (aligned); acc is rank 0's
        // output (count elements, aliasing no input) or the scratch (count * 4 bytes, 16-byte
        // aligned, overlapping no registration).
        unsafe {
            reduce::reduce(
                k,
                crate::ranks::of(inputs.len()),
                &inputs,
                &[acc],
                count,
                false,
            )
        };
    }
    let t1 = Instant::now();
    // SAFETY: acc stays untouched by anyone else until the op completes (we wait for it below,
    // cancelling it first on any error).
    let op = unsafe { sw.start_op(acc, count, float) };
    let r = loop {
        if let Some(r) = op.result() {
            break r;
        }
        let now = Instant::now();
        let err = if now >= deadline {
            Some(NetError::Timeout(format!(
                "{what} timed out in the switch session via {via}"
            )))
        } else {
            io.w.pump(
                Some(deadline.min(now + std::time::Duration::from_millis(50))),
                sig_text,
            )
            .err()
        };
        if let Some(e) = err {
            op.cancel();
            while op.result().is_none() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            return Err(e);
        }
    };
    let t2 = Instant::now();
    let outcome = r.map_err(|e| NetError::Timeout(format!("switch session via {via}: {e}")))?;
    io.wait(&rs)?;
    io.finish()?;
    let t3 = Instant::now();
    tracing::debug!(target: "commd::switch", "{what}: local {:?}, switch {:?}, signatures {:?}", t1 - t0, t2 - t1, t3 - t2);
    if outcome == super::super::switch::worker::Outcome::Unrepresentable {
        return Ok(SwitchRun::Unrepresentable);
    }
    let avg = c.redop == Some(RedOp::Avg);
    let n = t.nranks() as f32;
    if avg && acc == out0 {
        // SAFETY: acc is rank 0's output, count f32, touched by no one else until we return.
        let v = unsafe { std::slice::from_raw_parts_mut(acc.cast::<f32>(), count) };
        v.iter_mut().for_each(|x| *x /= n);
    }
    for i in 0..c.bufs.len() {
        let out = recv_ptr(c, i)?;
        if out == acc {
            continue;
        }
        if avg && acc != out0 {
            // SAFETY: acc holds count f32; out is a registered span of count f32, disjoint from it.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(acc.cast::<f32>().cast_const(), count),
                    std::slice::from_raw_parts_mut(out.cast::<f32>(), count),
                )
            };
            for (d, s) in dst.iter_mut().zip(src) {
                *d = *s / n;
            }
        } else {
            // SAFETY: both spans hold count * 4 bytes and do not overlap.
            unsafe { copy(out, acc, c.count * 4) };
        }
    }
    Ok(SwitchRun::Done)
}

fn send_ptr(c: &Coll, i: usize) -> Result<*const u8, NetError> {
    c.bufs[i]
        .1
        .send
        .as_ref()
        .map(|s| s.ptr().cast_const())
        .ok_or_else(|| local_err("missing send buffer"))
}

fn recv_ptr(c: &Coll, i: usize) -> Result<*mut u8, NetError> {
    c.bufs[i]
        .1
        .recv
        .as_ref()
        .map(|s| s.ptr())
        .ok_or_else(|| local_err("missing recv buffer"))
}

/// Index of global rank `r` among this node's ranks.
fn local_index(c: &Coll, r: u32) -> Option<usize> {
    c.bufs.iter().position(|(x, _)| *x == r)
}

/// The pointers of one element-wise step (a chain fold, or a copy to the other local ranks)
/// handed to the data-plane threads.
struct Step {
    acc_in: *const u8,
    acc_out: *mut u8,
    ins: Vec<*const u8>,
    outs: Vec<*mut u8>,
}

// SAFETY: the pointers are only used inside `engine::run_split`, which returns once every piece
// has run; the caller of `par_reduce`/`par_copy` keeps them valid until then, and the pieces
// write disjoint element ranges.
unsafe impl Send for Step {}
// SAFETY: as for Send: the pieces only read shared inputs and write disjoint ranges.
unsafe impl Sync for Step {}

fn offset<T>(p: *const T, bytes: usize) -> *const T {
    p.cast::<u8>().wrapping_add(bytes).cast()
}

/// `reduce::reduce_chain` over `n` elements, split across up to `workers` data-plane threads.
/// Each element is still reduced in rank order by one thread, so the result is bitwise the same.
///
/// # Safety
/// As `reduce::reduce_chain`.
unsafe fn par_reduce(
    (k, dtype): (Kernel, DType),
    nranks: u32,
    ch: reduce::Chain,
    inputs: &[*const u8],
    outputs: &[*mut u8],
    n: usize,
    workers: usize,
) {
    let es = usize_of(dtype.size());
    let acc = k.acc_size();
    let step = Step {
        acc_in: ch.acc_in,
        acc_out: ch.acc_out,
        ins: inputs.to_vec(),
        outs: outputs.to_vec(),
    };
    let accs = usize::from(!ch.acc_in.is_null()) + usize::from(!ch.acc_out.is_null());
    let unit = es * (inputs.len() + outputs.len()) + acc * accs;
    crate::engine::run_split(n as u64, unit as u64, workers, move |s, e| {
        let step = &step; // the whole Step (Send + Sync), not its fields
        let (s, m) = (usize_of(s), usize_of(e - s));
        let at = |p: *const u8, size: usize| if p.is_null() { p } else { offset(p, s * size) };
        let ins: Vec<*const u8> = step.ins.iter().map(|&p| at(p, es)).collect();
        let outs: Vec<*mut u8> = step.outs.iter().map(|&p| at(p, es).cast_mut()).collect();
        let ch = reduce::Chain {
            acc_in: at(step.acc_in, acc),
            acc_out: at(step.acc_out, acc).cast_mut(),
        };
        // SAFETY: elements [s, s + m) of the ranges the caller vouched for; pieces are disjoint.
        unsafe { reduce::reduce_chain(k, nranks, ch, &ins, &outs, m, false) };
    });
}

/// Copies `n` bytes at `src` to each of `dsts`, split across up to `workers` data-plane threads.
///
/// # Safety
/// `src` valid for `n` reads and every `dsts[i]` for `n` writes, none overlapping `src`, until
/// this returns.
unsafe fn par_copy(dsts: &[*mut u8], src: *const u8, n: u64, workers: usize) {
    let len = usize_of(n);
    let apart = |d: *mut u8| {
        let (d, s) = (d as usize, src as usize);
        d.saturating_add(len) <= s || s.saturating_add(len) <= d
    };
    for &d in dsts.iter().filter(|&&d| d.cast_const() != src && !apart(d)) {
        // SAFETY: overlapping ranges (never seen: buffers of two ranks are distinct
        // registrations) take the memmove path; both valid (caller).
        unsafe { copy(d, src, n) };
    }
    let step = Step {
        acc_in: std::ptr::null(),
        acc_out: std::ptr::null_mut(),
        ins: vec![src],
        outs: dsts.iter().copied().filter(|&d| apart(d)).collect(),
    };
    if step.outs.is_empty() || n == 0 {
        return;
    }
    let unit = 1 + step.outs.len() as u64;
    crate::engine::run_split(n, unit, workers, move |s, e| {
        let step = &step; // the whole Step (Send + Sync), not its fields
        let (s, m) = (usize_of(s), usize_of(e - s));
        for &d in &step.outs {
            // SAFETY: bytes [s, s + m) of ranges the caller vouched for; pieces are disjoint.
            unsafe { std::ptr::copy_nonoverlapping(offset(step.ins[0], s), d.add(s), m) };
        }
    });
}

/// # Safety
/// Both ranges valid; they may overlap (memmove).
unsafe fn copy(dst: *mut u8, src: *const u8, n: u64) {
    if n > 0 && dst.cast_const() != src {
        // SAFETY: forwarded.
        unsafe { std::ptr::copy(src, dst, usize_of(n)) };
    }
}

fn one_shot_reduce(
    io: &mut Io<'_>,
    c: &Coll,
    k: Kernel,
    scratch: &mut Scratch,
) -> Result<(), NetError> {
    let t = io.t;
    let n = t.nranks();
    let blk = c.count * c.dtype.size();
    let root_node = t.rank_node[c.root as usize];
    let needs = |node: usize| c.kind == OpKind::AllReduce || node == root_node;
    for node in 0..t.nodes.len() {
        if node == t.me || !needs(node) {
            continue;
        }
        for (i, (r, _)) in c.bufs.iter().enumerate() {
            // SAFETY: the send span is valid until the op completes (after finish()).
            unsafe { io.send(node, u64::from(*r), send_ptr(c, i)?, blk)? };
        }
    }
    if !needs(t.me) {
        return Ok(());
    }
    let base = scratch.get(blk * n as u64);
    let mut rs = Vec::new();
    for r in 0..n {
        let node = t.rank_node[r];
        if node != t.me {
            // SAFETY: slot r of the scratch holds blk bytes; the scratch lives across the op.
            rs.push(unsafe { io.recv(node, r as u64, base.add(r * usize_of(blk)), blk)? });
        }
    }
    io.wait(&rs)?;
    // In place, the outputs are the buffers being sent.
    io.flush()?;
    let mut inputs = Vec::with_capacity(n);
    for r in 0..n {
        inputs.push(match local_index(c, crate::ranks::of(r)) {
            Some(i) => send_ptr(c, i)?,
            // SAFETY: inside the scratch region of n blocks.
            None => unsafe { base.add(r * usize_of(blk)).cast_const() },
        });
    }
    let mut outputs = Vec::new();
    for (i, (r, _)) in c.bufs.iter().enumerate() {
        if c.kind == OpKind::AllReduce || *r == c.root {
            outputs.push(recv_ptr(c, i)?);
        }
    }
    // SAFETY: every pointer is valid for count elements of the dtype, aligned (registered spans
    // were validated for alignment; the scratch is 16-byte aligned and blk is a multiple of the
    // element size); an output may equal an input (in-place) but no partial overlap is possible
    // between distinct registrations and the scratch.
    unsafe {
        reduce::reduce(
            k,
            crate::ranks::of(n),
            &inputs,
            &outputs,
            usize_of(c.count),
            false,
        )
    };
    Ok(())
}

fn reduce_scatter(
    io: &mut Io<'_>,
    c: &Coll,
    k: Kernel,
    scratch: &mut Scratch,
) -> Result<(), NetError> {
    let t = io.t;
    let n = t.nranks();
    let blk = c.count * c.dtype.size();
    let local = t.local().to_vec();
    // Send block q of each local rank's input to q's node.
    for (i, (r, _)) in c.bufs.iter().enumerate() {
        let src = send_ptr(c, i)?;
        for q in 0..n {
            let node = t.rank_node[q];
            if node != t.me {
                // SAFETY: block q of a send span of n blocks.
                unsafe {
                    io.send(
                        node,
                        u64::from(*r) * n as u64 + q as u64,
                        src.add(q * usize_of(blk)),
                        blk,
                    )?
                };
            }
        }
    }
    // Receive block q (local) of every remote rank r into scratch slot (r, q).
    let remote: Vec<usize> = (0..n).filter(|&r| t.rank_node[r] != t.me).collect();
    let base = scratch.get(blk * (remote.len() * local.len()).max(1) as u64);
    let slot = |ri: usize, qi: usize| (ri * local.len() + qi) * usize_of(blk);
    let mut rs = Vec::new();
    for (ri, &r) in remote.iter().enumerate() {
        for (qi, &q) in local.iter().enumerate() {
            // SAFETY: inside the scratch.
            rs.push(unsafe {
                io.recv(
                    t.rank_node[r],
                    (r * n) as u64 + u64::from(q),
                    base.add(slot(ri, qi)),
                    blk,
                )?
            });
        }
    }
    io.wait(&rs)?;
    for (qi, &q) in local.iter().enumerate() {
        let mut inputs = Vec::with_capacity(n);
        for r in 0..n {
            inputs.push(match local_index(c, crate::ranks::of(r)) {
                // SAFETY: block q of rank r's send span.
                Some(i) => unsafe { send_ptr(c, i)?.add(q as usize * usize_of(blk)) },
                None => {
                    let ri = remote.iter().position(|&x| x == r).unwrap_or(0);
                    // SAFETY: inside the scratch.
                    unsafe { base.add(slot(ri, qi)).cast_const() }
                }
            });
        }
        let out = recv_ptr(c, qi)?;
        // SAFETY: as in one_shot_reduce.
        unsafe {
            reduce::reduce(
                k,
                crate::ranks::of(n),
                &inputs,
                &[out],
                usize_of(c.count),
                false,
            )
        };
    }
    Ok(())
}
