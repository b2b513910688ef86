//! The engine turns a matched op into a plan of copy and reduce tasks over registered memory and
//! runs it, splitting large plans across data-plane threads.
//!
//! Algorithms are written once against [`Span`] (a validated byte range of a registered region).
//! This is the host-memory implementation that runs everywhere; the CUDA path (copy-engine pushes,
//! reductions in the client's context) plugs in behind the same plan shape later.
//!
//! The engine must not block on anything but its own threads, and must not read a span outside
//! its region: spans are built only by [`Span::new`], which checks bounds and alignment.

#![allow(unsafe_code)] // copies between registered memory regions that clients also map

pub mod reduce;

use commd_proto::num::usize_of;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use commd_proto::desc::{DType, OpKind, RedOp};

use crate::shm::{MemRegion, ShmError};

/// Below this many bytes of work a plan runs on the calling thread.
const PARALLEL_MIN_BYTES: u64 = 256 * 1024;
/// Outputs larger than this (per op) are written with non-temporal stores.
const STREAM_MIN_OUT_BYTES: u64 = 8 << 20;
/// Smallest piece a task is split into when running in parallel.
const MIN_PIECE_BYTES: u64 = 64 * 1024;

/// A bounds-checked byte range inside a registered region.
#[derive(Clone, Debug)]
pub struct Span {
    region: Arc<MemRegion>,
    off: u64,
    bytes: u64,
}

impl Span {
    /// `None` if `[off, off + bytes)` is not inside the region.
    pub fn new(region: Arc<MemRegion>, off: u64, bytes: u64) -> Option<Self> {
        commd_proto::desc::range_in_bounds(off, bytes, region.len()).then_some(Self {
            region,
            off,
            bytes,
        })
    }

    /// The sub-span `[at, at + bytes)` of this span.
    pub fn sub(&self, at: u64, bytes: u64) -> Option<Self> {
        commd_proto::desc::range_in_bounds(at, bytes, self.bytes).then(|| Self {
            region: self.region.clone(),
            off: self.off + at,
            bytes,
        })
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn ptr(&self) -> *mut u8 {
        // SAFETY: off + bytes <= region.len() (checked at construction), so the pointer stays in
        // (or one past) the mapping.
        unsafe { self.region.base().add(usize_of(self.off)) }
    }

    fn key(&self) -> (usize, u64, u64) {
        (
            Arc::as_ptr(&self.region) as usize,
            self.off,
            self.off + self.bytes,
        )
    }
}

#[derive(Clone, Debug)]
pub enum Task {
    /// `dst = src` (same length).
    Copy { src: Span, dst: Span },
    /// Every output = reduction of the inputs, element-wise, `elems` elements.
    Reduce {
        kernel: reduce::Kernel,
        inputs: Vec<Span>,
        outputs: Vec<Span>,
        elems: u64,
    },
}

impl Task {
    fn bytes(&self, esize: u64) -> u64 {
        match self {
            Task::Copy { src, .. } => src.bytes,
            Task::Reduce {
                inputs,
                outputs,
                elems,
                ..
            } => elems * esize * (inputs.len() + outputs.len()) as u64,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Plan {
    pub dtype: DType,
    pub nranks: u32,
    pub tasks: Vec<Task>,
}

/// What a plan reads from and writes into registered memory: bytes and buffer ranges (for the
/// `shm` link counters of `telemetry`; staging copies are not counted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    pub read_bytes: u64,
    pub read_ranges: u64,
    pub written_bytes: u64,
    pub written_ranges: u64,
}

impl Plan {
    pub fn traffic(&self) -> Traffic {
        let es = self.dtype.size();
        let mut t = Traffic::default();
        for task in &self.tasks {
            match task {
                Task::Copy { src, dst } => {
                    t.read_bytes += src.bytes;
                    t.written_bytes += dst.bytes;
                    t.read_ranges += 1;
                    t.written_ranges += 1;
                }
                Task::Reduce {
                    inputs,
                    outputs,
                    elems,
                    ..
                } => {
                    t.read_bytes += elems * es * inputs.len() as u64;
                    t.written_bytes += elems * es * outputs.len() as u64;
                    t.read_ranges += inputs.len() as u64;
                    t.written_ranges += outputs.len() as u64;
                }
            }
        }
        t
    }
}

/// One rank's buffers for a matched collective.
#[derive(Clone, Debug, Default)]
pub struct RankBufs {
    pub send: Option<Span>,
    pub recv: Option<Span>,
}

/// Builds the plan of a matched collective. `bufs[r]` are rank r's buffers, already validated to
/// have the sizes `OpKind::{send,recv}_elems` asks for, and `redop` is defined for `dtype`
/// (`Op::check`); a missing required buffer or reduction, or one the kernels do not implement for
/// `dtype`, is a bug in the caller and yields `None`.
pub fn plan_collective(
    kind: OpKind,
    dtype: DType,
    redop: Option<RedOp>,
    count: u64,
    root: u32,
    bufs: &[RankBufs],
) -> Option<Plan> {
    let n = bufs.len();
    let es = dtype.size();
    let blk = count * es;
    let send = |r: usize| bufs[r].send.clone();
    let recv = |r: usize| bufs[r].recv.clone();
    let kernel = || reduce::Kernel::new(dtype, redop?).ok();
    let mut tasks = Vec::new();
    match kind {
        OpKind::AllReduce => tasks.push(Task::Reduce {
            kernel: kernel()?,
            inputs: (0..n).map(send).collect::<Option<_>>()?,
            outputs: (0..n).map(recv).collect::<Option<_>>()?,
            elems: count,
        }),
        OpKind::Reduce => tasks.push(Task::Reduce {
            kernel: kernel()?,
            inputs: (0..n).map(send).collect::<Option<_>>()?,
            outputs: vec![recv(root as usize)?],
            elems: count,
        }),
        OpKind::ReduceScatter => {
            let kernel = kernel()?;
            for r in 0..n {
                let inputs = (0..n)
                    .map(|k| send(k)?.sub(r as u64 * blk, blk))
                    .collect::<Option<_>>()?;
                tasks.push(Task::Reduce {
                    kernel,
                    inputs,
                    outputs: vec![recv(r)?],
                    elems: count,
                });
            }
        }
        OpKind::AllGather => {
            for r in 0..n {
                for k in 0..n {
                    tasks.push(Task::Copy {
                        src: send(k)?,
                        dst: recv(r)?.sub(k as u64 * blk, blk)?,
                    });
                }
            }
        }
        OpKind::Broadcast => {
            let src = send(root as usize)?;
            for r in 0..n {
                tasks.push(Task::Copy {
                    src: src.clone(),
                    dst: recv(r)?,
                });
            }
        }
        OpKind::AllToAll => {
            for r in 0..n {
                for k in 0..n {
                    tasks.push(Task::Copy {
                        src: send(k)?.sub(r as u64 * blk, blk)?,
                        dst: recv(r)?.sub(k as u64 * blk, blk)?,
                    });
                }
            }
        }
        OpKind::Barrier => {}
        OpKind::Send | OpKind::Recv => return None,
    }
    // Empty tasks and copies of a range onto itself (in-place layouts) do nothing; dropping them
    // also keeps them out of the overlap analysis, where they would force needless staging.
    tasks.retain(|t| {
        t.bytes(es) > 0 && !matches!(t, Task::Copy { src, dst } if src.key() == dst.key())
    });
    Some(Plan {
        dtype,
        nranks: crate::ranks::of(n),
        tasks,
    })
}

/// Plan of a matched send/recv pair.
pub fn plan_p2p(dtype: DType, src: Span, dst: Span) -> Plan {
    let tasks = if src.bytes > 0 && src.key() != dst.key() {
        vec![Task::Copy { src, dst }]
    } else {
        vec![]
    };
    Plan {
        dtype,
        nranks: 2,
        tasks,
    }
}

/// True if some output overlaps some input in a way whose result would depend on task order:
/// anything but an output identical to an input of the same task (in-place).
fn needs_staging(plan: &Plan) -> bool {
    let mut ins: Vec<((usize, u64, u64), usize)> = Vec::new();
    let mut outs: Vec<((usize, u64, u64), usize)> = Vec::new();
    for (t, task) in plan.tasks.iter().enumerate() {
        match task {
            Task::Copy { src, dst } => {
                ins.push((src.key(), t));
                outs.push((dst.key(), t));
            }
            Task::Reduce {
                inputs, outputs, ..
            } => {
                ins.extend(inputs.iter().map(|s| (s.key(), t)));
                outs.extend(outputs.iter().map(|s| (s.key(), t)));
            }
        }
    }
    ins.sort_unstable();
    // Prefix maximum of input ends, per sorted position, to skip outputs that overlap nothing.
    let mut max_end = Vec::with_capacity(ins.len());
    let mut m = (0usize, 0u64);
    for ((reg, _, end), _) in &ins {
        m = if m.0 == *reg {
            (m.0, m.1.max(*end))
        } else {
            (*reg, *end)
        };
        max_end.push(m);
    }
    for ((reg, s, e), t) in &outs {
        let hi = ins.partition_point(|((r, st, _), _)| (*r, *st) < (*reg, *e));
        if hi == 0 || max_end[hi - 1].0 != *reg || max_end[hi - 1].1 <= *s {
            continue;
        }
        for ((r, is, ie), it) in ins[..hi].iter().rev() {
            if *r != *reg {
                break;
            }
            let overlaps = *is < *e && *ie > *s;
            let identical_same_task = *is == *s && *ie == *e && it == t;
            if overlaps && !identical_same_task {
                return true;
            }
        }
    }
    false
}

/// Copies every input of the plan into daemon-private memory so outputs can be written in any
/// order. Used only when [`needs_staging`] says the user's buffers overlap.
fn stage_inputs(plan: &mut Plan) -> Result<(), ShmError> {
    let stage = |s: &Span| -> Result<Span, ShmError> {
        let region = Arc::new(MemRegion::anonymous(s.bytes.max(1))?);
        // SAFETY: both ranges are in bounds of their regions; the staging region is fresh and private.
        unsafe { std::ptr::copy_nonoverlapping(s.ptr(), region.base(), usize_of(s.bytes)) };
        Ok(Span {
            region,
            off: 0,
            bytes: s.bytes,
        })
    };
    for task in &mut plan.tasks {
        match task {
            Task::Copy { src, .. } => *src = stage(src)?,
            Task::Reduce { inputs, .. } => {
                for s in inputs.iter_mut() {
                    *s = stage(s)?;
                }
            }
        }
    }
    Ok(())
}

/// A piece of a task: elements (reduce) or bytes (copy) `[start, end)`.
#[derive(Clone, Copy, Debug)]
struct Piece {
    task: usize,
    start: u64,
    end: u64,
}

fn run_piece(plan: &Plan, p: Piece, stream: bool) {
    let es = plan.dtype.size();
    match &plan.tasks[p.task] {
        Task::Copy { src, dst } => {
            // SAFETY: [start, end) lies within both spans (pieces are cut from the span length),
            // and spans are in bounds of live mappings held by the plan. `copy` tolerates overlap.
            unsafe {
                std::ptr::copy(
                    src.ptr().add(usize_of(p.start)),
                    dst.ptr().add(usize_of(p.start)),
                    usize_of(p.end - p.start),
                )
            }
        }
        Task::Reduce {
            kernel,
            inputs,
            outputs,
            ..
        } => {
            let at = usize_of(p.start * es);
            let ins: Vec<*const u8> = inputs
                .iter()
                .map(|s| {
                    // SAFETY: start < elems and every span holds elems * es bytes.
                    unsafe { s.ptr().add(at) as *const u8 }
                })
                .collect();
            let outs: Vec<*mut u8> = outputs
                .iter()
                .map(|s| {
                    // SAFETY: as above.
                    unsafe { s.ptr().add(at) }
                })
                .collect();
            // SAFETY: spans are element-aligned (offsets checked against the dtype size when the
            // spans were built, mappings are page-aligned), hold `elems` elements, and after
            // staging no output partially overlaps an input.
            unsafe {
                reduce::reduce(
                    *kernel,
                    plan.nranks,
                    &ins,
                    &outs,
                    usize_of(p.end - p.start),
                    stream,
                )
            }
        }
    }
}

/// Runs the plan to completion on up to `workers` threads (the caller's included).
pub fn execute(mut plan: Plan, workers: usize) -> Result<(), ShmError> {
    if plan.tasks.is_empty() {
        return Ok(());
    }
    if needs_staging(&plan) {
        tracing::debug!(target: "commd::engine", "overlapping buffers: staging inputs");
        stage_inputs(&mut plan)?;
    }
    let es = plan.dtype.size();
    let total: u64 = plan.tasks.iter().map(|t| t.bytes(es)).sum();
    let threads = if total < PARALLEL_MIN_BYTES {
        1
    } else {
        workers.max(1)
    };
    let out_bytes: u64 = plan
        .tasks
        .iter()
        .map(|t| match t {
            Task::Copy { dst, .. } => dst.bytes,
            Task::Reduce { outputs, elems, .. } => elems * es * outputs.len() as u64,
        })
        .sum();
    let stream = out_bytes >= STREAM_MIN_OUT_BYTES;
    let target_pieces = (threads * 4) as u64;
    let mut pieces = Vec::new();
    for (t, task) in plan.tasks.iter().enumerate() {
        let (len, unit_bytes) = match task {
            Task::Copy { src, .. } => (src.bytes, 1),
            Task::Reduce {
                elems,
                inputs,
                outputs,
                ..
            } => (*elems, es * (inputs.len() + outputs.len()) as u64),
        };
        let share = (task.bytes(es) * target_pieces)
            .div_ceil(total.max(1))
            .max(1);
        let min_len = (MIN_PIECE_BYTES / unit_bytes).max(1);
        let mut step = len.div_ceil(share).max(min_len);
        if matches!(task, Task::Copy { .. }) {
            step = step.div_ceil(64) * 64;
        }
        let mut s = 0;
        while s < len {
            let e = (s + step).min(len);
            pieces.push(Piece {
                task: t,
                start: s,
                end: e,
            });
            s = e;
        }
    }
    let threads = threads.min(pieces.len());
    if threads <= 1 {
        for p in pieces {
            run_piece(&plan, p, stream);
        }
        return Ok(());
    }
    let n = pieces.len();
    run_job(
        Box::new(move |i| run_piece(&plan, pieces[i], stream)),
        n,
        threads,
        workers,
    );
    Ok(())
}

/// Runs `f(start, end)` over the element range `[0, len)`, cut into pieces of whole 64-element
/// blocks (at least [`MIN_PIECE_BYTES`] of traffic each, `unit_bytes` being the traffic of one
/// element), on up to `workers` threads (the caller's included) of the same pool as
/// [`execute`]; returns when every piece has run. Small ranges run on the calling thread.
/// `f` must be element-wise: the pieces run in any order and at the same time.
pub fn run_split(
    len: u64,
    unit_bytes: u64,
    workers: usize,
    f: impl Fn(u64, u64) + Send + Sync + 'static,
) {
    let unit_bytes = unit_bytes.max(1);
    let threads = if len.saturating_mul(unit_bytes) < PARALLEL_MIN_BYTES {
        1
    } else {
        workers.max(1)
    };
    let min_len = (MIN_PIECE_BYTES / unit_bytes).max(1);
    let step = len
        .div_ceil((threads * 2) as u64)
        .max(min_len)
        .div_ceil(64)
        .saturating_mul(64)
        .max(1);
    let pieces = usize_of(len.div_ceil(step));
    let threads = threads.min(pieces);
    if threads <= 1 {
        if len > 0 {
            f(0, len);
        }
        return;
    }
    run_job(
        Box::new(move |i| {
            let s = i as u64 * step;
            f(s, (s + step).min(len));
        }),
        pieces,
        threads,
        workers,
    );
}

/// Runs pieces `0..pieces` of `run` on the caller and `threads - 1` pool helpers; returns when
/// every piece has run (so nothing `run` points at is touched after this returns).
fn run_job(run: Box<dyn Fn(usize) + Send + Sync>, pieces: usize, threads: usize, workers: usize) {
    let job = Arc::new(Job {
        run,
        pieces,
        next: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        lock: Mutex::new(()),
        cv: Condvar::new(),
    });
    pool(workers).submit(&job, threads - 1);
    job.work();
    job.wait();
}

/// One job being executed by the caller and pool threads, piece by piece.
struct Job {
    run: Box<dyn Fn(usize) + Send + Sync>,
    pieces: usize,
    next: AtomicUsize,
    done: AtomicUsize,
    lock: Mutex<()>,
    cv: Condvar,
}

impl Job {
    fn exhausted(&self) -> bool {
        self.next.load(Ordering::Relaxed) >= self.pieces
    }

    fn work(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.pieces {
                break;
            }
            (self.run)(i);
            if self.done.fetch_add(1, Ordering::AcqRel) + 1 == self.pieces {
                let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
                self.cv.notify_all();
            }
        }
    }

    fn wait(&self) {
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.done.load(Ordering::Acquire) < self.pieces {
            g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Data-plane threads (`commd-exec<i>`) shared by all communicators, started on first use.
/// Spawning threads per op cost ~60 us on our 2-core CI VM, which a parked pool avoids.
struct Pool {
    queue: Mutex<VecDeque<Arc<Job>>>,
    cv: Condvar,
}

impl Pool {
    fn submit(&self, job: &Arc<Job>, helpers: usize) {
        let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        q.push_back(job.clone());
        drop(q);
        for _ in 0..helpers {
            self.cv.notify_one();
        }
    }

    fn worker(&self) {
        loop {
            let job = {
                let mut q = self.queue.lock().unwrap_or_else(|e| e.into_inner());
                loop {
                    while q.front().is_some_and(|j| j.exhausted()) {
                        q.pop_front();
                    }
                    if let Some(j) = q.front() {
                        break j.clone();
                    }
                    q = self.cv.wait(q).unwrap_or_else(|e| e.into_inner());
                }
            };
            job.work();
        }
    }
}

fn pool(workers: usize) -> &'static Pool {
    static POOL: OnceLock<&'static Pool> = OnceLock::new();
    POOL.get_or_init(|| {
        let p: &'static Pool = Box::leak(Box::new(Pool {
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
        }));
        for i in 1..workers.max(2) {
            let r = std::thread::Builder::new()
                .name(format!("commd-exec{i}"))
                .spawn(move || p.worker());
            if let Err(e) = r {
                // The caller still runs every piece itself; the pool only adds parallelism.
                tracing::warn!(target: "commd::engine", "cannot start data-plane thread: {e}");
            }
        }
        p
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(bytes: u64) -> Arc<MemRegion> {
        Arc::new(MemRegion::anonymous(bytes).unwrap())
    }

    fn fill_f32(s: &Span, f: impl Fn(usize) -> f32) {
        for i in 0..(s.bytes / 4) as usize {
            // SAFETY: i < bytes/4 inside the span.
            unsafe { s.ptr().cast::<f32>().add(i).write(f(i)) };
        }
    }

    fn read_f32(s: &Span) -> Vec<f32> {
        // SAFETY: the span is in bounds and aligned.
        (0..(s.bytes / 4) as usize)
            .map(|i| unsafe { s.ptr().cast::<f32>().add(i).read() })
            .collect()
    }

    #[test]
    fn span_bounds_are_checked() {
        let r = region(4096);
        assert!(Span::new(r.clone(), 0, 4096).is_some());
        assert!(Span::new(r.clone(), 1, 4096).is_none());
        assert!(Span::new(r.clone(), u64::MAX, 2).is_none());
        let s = Span::new(r, 100, 100).unwrap();
        assert!(s.sub(0, 100).is_some());
        assert!(s.sub(50, 51).is_none());
    }

    #[test]
    fn in_place_all_to_all_is_staged_and_correct() {
        // 3 ranks, 2 elements per block, in place: recv == send.
        let n = 3;
        let count = 2u64;
        let regs: Vec<_> = (0..n).map(|_| region(4096)).collect();
        let bufs: Vec<RankBufs> = regs
            .iter()
            .map(|r| {
                let s = Span::new(r.clone(), 0, count * 4 * n as u64).unwrap();
                RankBufs {
                    send: Some(s.clone()),
                    recv: Some(s),
                }
            })
            .collect();
        for (r, b) in bufs.iter().enumerate() {
            fill_f32(b.send.as_ref().unwrap(), |i| (r * 100 + i) as f32);
        }
        let plan = plan_collective(OpKind::AllToAll, DType::F32, None, count, 0, &bufs).unwrap();
        assert!(needs_staging(&plan));
        execute(plan, 2).unwrap();
        for (r, b) in bufs.iter().enumerate() {
            let got = read_f32(b.recv.as_ref().unwrap());
            let want: Vec<f32> = (0..n)
                .flat_map(|k| {
                    (0..usize_of(count)).map(move |j| (k * 100 + r * usize_of(count) + j) as f32)
                })
                .collect();
            assert_eq!(got, want, "rank {r}");
        }
    }

    #[test]
    fn run_split_covers_every_element_once_on_several_threads() {
        use std::sync::atomic::AtomicU8;
        let cases = [
            (0, 4, 4),
            (1, 4, 4),
            (1000, 4, 4),
            (1_000_003, 12, 4),
            (3 << 20, 1, 3),
        ];
        for (len, unit, workers) in cases {
            let seen: Arc<Vec<AtomicU8>> = Arc::new((0..len).map(|_| AtomicU8::new(0)).collect());
            let calls = Arc::new(AtomicUsize::new(0));
            let (s2, c2) = (seen.clone(), calls.clone());
            run_split(len, unit, workers, move |a, b| {
                assert!(a < b && b <= len, "piece [{a}, {b}) of {len}");
                c2.fetch_add(1, Ordering::Relaxed);
                for i in a..b {
                    s2[usize_of(i)].fetch_add(1, Ordering::Relaxed);
                }
            });
            assert!(
                seen.iter().all(|x| x.load(Ordering::Relaxed) == 1),
                "len {len}"
            );
            let calls = calls.load(Ordering::Relaxed);
            if len * unit >= 4 * PARALLEL_MIN_BYTES {
                assert!(calls >= 2 * workers, "len {len}: {calls} pieces");
            } else if len * unit < PARALLEL_MIN_BYTES {
                assert!(calls <= 1, "len {len}: {calls} pieces for a small range");
            }
        }
    }

    #[test]
    fn in_place_all_reduce_needs_no_staging_and_large_plans_split() {
        let n = 4;
        let count = 300_000u64; // 1.2 MB per rank: parallel path
        let regs: Vec<_> = (0..n).map(|_| region(count * 4)).collect();
        let bufs: Vec<RankBufs> = regs
            .iter()
            .map(|r| {
                let s = Span::new(r.clone(), 0, count * 4).unwrap();
                RankBufs {
                    send: Some(s.clone()),
                    recv: Some(s),
                }
            })
            .collect();
        for (r, b) in bufs.iter().enumerate() {
            fill_f32(b.send.as_ref().unwrap(), |i| (r + i % 7) as f32);
        }
        let plan = plan_collective(
            OpKind::AllReduce,
            DType::F32,
            Some(RedOp::Sum),
            count,
            0,
            &bufs,
        )
        .unwrap();
        assert!(!needs_staging(&plan));
        execute(plan, 3).unwrap();
        for b in &bufs {
            let got = read_f32(b.recv.as_ref().unwrap());
            for (i, v) in got.iter().enumerate() {
                assert_eq!(*v, (6 + 4 * (i % 7)) as f32);
            }
        }
    }

    #[test]
    fn in_place_reduce_scatter_and_all_gather_need_no_staging() {
        let n = 3usize;
        let count = 5u64;
        let regs: Vec<_> = (0..n).map(|_| region(4096)).collect();
        // reduce_scatter in place: recv = send + rank * count.
        let rs: Vec<RankBufs> = regs
            .iter()
            .enumerate()
            .map(|(r, g)| {
                let s = Span::new(g.clone(), 0, count * 4 * n as u64).unwrap();
                RankBufs {
                    recv: s.sub(r as u64 * count * 4, count * 4),
                    send: Some(s),
                }
            })
            .collect();
        let plan = plan_collective(
            OpKind::ReduceScatter,
            DType::F32,
            Some(RedOp::Sum),
            count,
            0,
            &rs,
        )
        .unwrap();
        assert!(!needs_staging(&plan));
        let ag: Vec<RankBufs> = rs
            .iter()
            .map(|b| RankBufs {
                send: b.recv.clone(),
                recv: b.send.clone(),
            })
            .collect();
        let plan = plan_collective(OpKind::AllGather, DType::F32, None, count, 0, &ag).unwrap();
        assert!(!needs_staging(&plan));
        assert_eq!(plan.tasks.len(), n * (n - 1), "self-copies are dropped");
    }

    #[test]
    fn bitwise_reductions_plan_for_integers_only() {
        let r = region(4096);
        let bufs: Vec<RankBufs> = (0..2)
            .map(|k| RankBufs {
                send: Span::new(r.clone(), k * 1024, 3 * 64),
                recv: Span::new(r.clone(), 2048 + k * 1024, 3 * 64),
            })
            .collect();
        for kind in [OpKind::AllReduce, OpKind::Reduce, OpKind::ReduceScatter] {
            for op in [RedOp::Band, RedOp::Bor, RedOp::Bxor] {
                // 8 i64 = 64 bytes per rank (x3 for the reduce_scatter send buffer).
                assert!(plan_collective(kind, DType::I64, Some(op), 8, 0, &bufs).is_some());
                assert!(plan_collective(kind, DType::F64, Some(op), 8, 0, &bufs).is_none());
            }
        }
    }
}
