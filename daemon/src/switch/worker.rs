//! The worker side of a switch session: this daemon's data-plane threads that stream the node's
//! partial result to the switch and receive the aggregate (see `../shared/specs/switchml.md`).
//!
//! `T` threads each take a contiguous 1/T of the tensor's packets; thread `t` of every worker
//! uses the same `W` slots (`t*W .. (t+1)*W`), sends from `worker_port + t`, and numbers its
//! packets the same way, so that every worker can accept the result that another worker's
//! packet completed. Each slot alternates sets; a result releases the next packet on that slot.
//! An outstanding packet is resent unchanged after a timeout (10 ms, doubled after every 100
//! timeouts, as the reference). Results are accepted only for the current job number, the
//! slot's current set and the expected packet id, so duplicates and stale results are dropped.
//!
//! float32 uses block floating point: each packet's two halves carry exponents (`e0`, `e1`) of
//! the packet the slot sends *next*, and a leading exponent-only round per slot agrees the first
//! ones; values go out as `round(x * INT32_MAX / (n * 2^E))`. A block holding NaN, infinity or
//! |x| >= 2^126 makes every worker see [`EXP_UNREPRESENTABLE`]; the op then reports
//! [`Outcome::Unrepresentable`] on every worker alike, and the caller redoes it over TCP.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use commd_host::cores;
use commd_switch::packet::{
    self, EXP_UNREPRESENTABLE, HEADER_BYTES, Header, PacketSize, block_exponent, dequantize,
    quantize,
};
pub use commd_switch::udpio::Stats;

/// A session's data-plane parameters (identical on every worker except `bind` and `rank`).
#[derive(Clone, Debug)]
pub struct Params {
    /// The switch's UDP data address.
    pub switch: SocketAddr,
    /// This worker's IP (what it registered with the controller).
    pub bind: IpAddr,
    /// First UDP source port; thread `t` uses `port + t`.
    pub port: u16,
    pub threads: usize,
    /// Outstanding packets per thread (slots per thread).
    pub window: usize,
    pub size: PacketSize,
    pub workers: u32,
    /// First retransmission timeout.
    pub timeout: Duration,
    /// No result at all for this long: the op fails naming the switch.
    pub stall: Duration,
    /// Pin polling threads to free cores (see [`cores`]).
    pub pin: bool,
    /// For logs and claims.
    pub label: String,
}

/// How an op ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    Done,
    /// Some block held a value the 8-bit exponent cannot express (NaN, inf, >= 2^126): every
    /// worker sees this for the same op; the buffer holds garbage for those blocks.
    Unrepresentable,
}

struct Job {
    ptr: usize,
    /// Elements of the whole tensor (all threads).
    count: usize,
    float: bool,
    job: u8,
    op: Arc<OpState>,
}

/// One op in flight; the net thread polls it.
pub struct OpState {
    left: AtomicUsize,
    err: Mutex<Option<String>>,
    unrep: AtomicBool,
    cancel: AtomicBool,
    wake: Option<Arc<OwnedFd>>,
}

impl OpState {
    /// `None` while running.
    pub fn result(&self) -> Option<Result<Outcome, String>> {
        if self.left.load(Ordering::Acquire) > 0 {
            return None;
        }
        if let Some(e) = self.err.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Some(Err(e));
        }
        Some(Ok(if self.unrep.load(Ordering::Acquire) {
            Outcome::Unrepresentable
        } else {
            Outcome::Done
        }))
    }

    /// Stops the threads at their next poll (the op then fails).
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    fn finish(&self, r: Result<bool, String>) {
        match r {
            Ok(unrep) => {
                if unrep {
                    self.unrep.store(true, Ordering::Release);
                }
            }
            Err(e) => {
                let mut g = self.err.lock().unwrap_or_else(|e| e.into_inner());
                if g.is_none() {
                    *g = Some(e);
                }
                self.cancel.store(true, Ordering::Release);
            }
        }
        if self.left.fetch_sub(1, Ordering::AcqRel) == 1
            && let Some(w) = &self.wake
        {
            let _ = rustix::io::write(&**w, &1u64.to_ne_bytes());
        }
    }
}

/// A session's worker threads.
pub struct Worker {
    pub params: Params,
    pub stats: Arc<Stats>,
    txs: Vec<mpsc::Sender<Job>>,
    joins: Vec<std::thread::JoinHandle<()>>,
    /// Each thread's core (for logs and `commd status`).
    pub cores: Arc<Mutex<Vec<String>>>,
    job: u8,
    wake: Option<Arc<OwnedFd>>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "switch::Worker({})", self.params.label)
    }
}

impl Worker {
    /// Binds the threads' sockets (so a busy port fails here, before any data) and starts them.
    /// `wake` is written when an op completes.
    pub fn start(p: Params, wake: Option<Arc<OwnedFd>>) -> Result<Self, String> {
        if p.threads == 0 || p.window == 0 || p.threads * p.window > packet::SLOTS {
            return Err(format!(
                "{} threads x {} outstanding packets does not fit the switch's {} slots",
                p.threads,
                p.window,
                packet::SLOTS
            ));
        }
        if !p.size.processed() {
            return Err(format!(
                "packet size {} bytes is not aggregated by the switch (256 or 1024)",
                p.size.bytes()
            ));
        }
        let mut socks = Vec::new();
        for t in 0..p.threads {
            let port = u16::try_from(t)
                .ok()
                .and_then(|t| p.port.checked_add(t))
                .ok_or("worker port overflow")?;
            let s = UdpSocket::bind((p.bind, port))
                .map_err(|e| format!("cannot bind switch worker socket {}:{port}: {e}", p.bind))?;
            s.connect(p.switch)
                .map_err(|e| format!("cannot reach the switch at {}: {e}", p.switch))?;
            s.set_nonblocking(true).map_err(|e| e.to_string())?;
            commd_switch::udpio::enable_gro(&s);
            // Room for two windows of results (GRO runs of up to 64 KiB each).
            commd_switch::udpio::size_buffers(
                &s,
                (2 * p.window * (HEADER_BYTES + p.size.bytes())).max(4 << 20),
            );
            socks.push(s);
        }
        let stats = Arc::new(Stats::default());
        let cores = Arc::new(Mutex::new(vec![String::new(); p.threads]));
        let mut txs = Vec::new();
        let mut joins = Vec::new();
        let (ready_tx, ready_rx) = mpsc::channel();
        for (t, sock) in socks.into_iter().enumerate() {
            let (tx, rx) = mpsc::channel::<Job>();
            let mut th = Thread::new(&p, t, sock, stats.clone());
            let cores = cores.clone();
            let ready = ready_tx.clone();
            let name = format!("commd-swk-{t}");
            let label = format!("{} thread {t}", p.label);
            let pin = p.pin;
            let j = std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    let claim = cores::claim(&label, pin);
                    if let Ok(mut c) = cores.lock() {
                        c[t] = claim.text();
                    }
                    let _ = ready.send(());
                    while let Ok(job) = rx.recv() {
                        let op = job.op.clone();
                        let r = th.run(&job);
                        op.finish(r);
                    }
                    drop(claim);
                })
                .map_err(|e| e.to_string())?;
            txs.push(tx);
            joins.push(j);
        }
        for _ in 0..p.threads {
            let _ = ready_rx.recv_timeout(Duration::from_secs(5));
        }
        Ok(Self {
            params: p,
            stats,
            txs,
            joins,
            cores,
            job: 0,
            wake,
        })
    }

    /// Starts an in-place all-reduce (sum) of `count` int32 or float32 elements at `ptr`.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `count` 4-byte elements, 4-byte aligned, and
    /// untouched by anyone else until the returned op's [`OpState::result`] is `Some`.
    pub unsafe fn start_op(&mut self, ptr: *mut u8, count: usize, float: bool) -> Arc<OpState> {
        self.job = self.job.wrapping_add(1);
        self.stats.ops.fetch_add(1, Ordering::Relaxed);
        let op = Arc::new(OpState {
            left: AtomicUsize::new(self.txs.len()),
            err: Mutex::new(None),
            unrep: AtomicBool::new(false),
            cancel: AtomicBool::new(false),
            wake: self.wake.clone(),
        });
        for tx in &self.txs {
            let j = Job {
                ptr: ptr as usize,
                count,
                float,
                job: self.job,
                op: op.clone(),
            };
            if tx.send(j).is_err() {
                op.finish(Err("switch worker thread is gone".into()));
            }
        }
        op
    }

    /// Convenience for tests and benchmarks: runs one op to completion.
    pub fn all_reduce_i32(&mut self, v: &mut [i32]) -> Result<Outcome, String> {
        // SAFETY: `v` is borrowed mutably until the op completes below.
        let op = unsafe { self.start_op(v.as_mut_ptr().cast(), v.len(), false) };
        wait(&op)
    }

    pub fn all_reduce_f32(&mut self, v: &mut [f32]) -> Result<Outcome, String> {
        // SAFETY: as above.
        let op = unsafe { self.start_op(v.as_mut_ptr().cast(), v.len(), true) };
        wait(&op)
    }
}

/// A slot or id count in the switch's `u32` ids (tsi), which wrap: every worker numbers them
/// modulo 2^32 with `wrapping_add`, so `x` modulo 2^32 is the exact value.
#[allow(clippy::cast_possible_truncation)]
fn tsi_word(x: usize) -> u32 {
    x as u32
}

fn wait(op: &OpState) -> Result<Outcome, String> {
    loop {
        if let Some(r) = op.result() {
            return r;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.txs.clear();
        for j in self.joins.drain(..) {
            let _ = j.join();
        }
    }
}

/// Retransmission timeout, adapted to the measured round trip (RFC 6298's estimator: smoothed
/// RTT plus four deviations), never below the configured timeout (the reference worker's fixed
/// 10 ms), at most 1 s. A window's round trip grows with the window (the switch answers a slot
/// only when every worker's packet is in), so a fixed timeout below it retransmits whole
/// windows for nothing (docs/benchmarks.md row `switch-allreduce-4M`). Backs off by doubling,
/// as the reference does after every 100 timeouts.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Rto {
    floor: Duration,
    srtt: Option<f64>,
    rttvar: f64,
    backoff: u32,
}

impl Rto {
    pub(crate) fn new(floor: Duration) -> Self {
        Self {
            floor,
            srtt: None,
            rttvar: 0.0,
            backoff: 0,
        }
    }

    /// A round trip measured on a packet sent once.
    pub(crate) fn sample(&mut self, rtt: Duration) {
        let r = rtt.as_secs_f64();
        match self.srtt {
            None => {
                self.srtt = Some(r);
                self.rttvar = r / 2.0;
            }
            Some(s) => {
                self.rttvar = 0.75 * self.rttvar + 0.25 * (s - r).abs();
                self.srtt = Some(0.875 * s + 0.125 * r);
            }
        }
        self.backoff = 0;
    }

    pub(crate) fn back_off(&mut self) {
        self.backoff = (self.backoff + 1).min(10);
    }

    pub(crate) fn timeout(&self) -> Duration {
        let est = self
            .srtt
            .map(|s| Duration::from_secs_f64(s + 4.0 * self.rttvar))
            .unwrap_or(Duration::ZERO);
        (est.max(self.floor) * (1u32 << self.backoff)).min(Duration::from_secs(1))
    }
}

/// Per-slot state of a thread; persists across ops because the switch's sets do.
#[derive(Clone)]
struct SlotState {
    /// Set of the next packet sent on this slot.
    next_set: u8,
    /// The packet in flight on this slot (bytes kept for retransmission), if any.
    busy: bool,
    set: u8,
    tsi: u32,
    /// Round index on this slot within the op.
    round: usize,
    sent_at: Instant,
    /// Whether the packet in flight was sent more than once (its RTT is then ambiguous and not
    /// sampled: Karn's rule).
    resent: bool,
    /// Agreed exponents of the packet whose values this slot sends in its current round.
    exps: (i8, i8),
    pkt: Vec<u8>,
}

struct Thread {
    t: usize,
    threads: usize,
    window: usize,
    size: PacketSize,
    workers: u32,
    stall: Duration,
    sock: UdpSocket,
    stats: Arc<Stats>,
    slots: Vec<SlotState>,
    rx: commd_switch::udpio::RecvBufs,
    vals: Vec<i32>,
    fvals: Vec<f32>,
    /// First packet id of the current op: ids never repeat on a slot across ops, so the switch
    /// can tell a late copy from a new round.
    tsi_base: u32,
    op_base: u32,
    /// Kept across ops: the round trip does not change between them.
    rto: Rto,
}

impl Thread {
    fn new(p: &Params, t: usize, sock: UdpSocket, stats: Arc<Stats>) -> Self {
        let plen = HEADER_BYTES + p.size.bytes();
        Self {
            t,
            threads: p.threads,
            window: p.window,
            size: p.size,
            workers: p.workers,
            stall: p.stall,
            sock,
            stats,
            slots: vec![
                SlotState {
                    next_set: 0,
                    busy: false,
                    set: 0,
                    tsi: 0,
                    round: 0,
                    sent_at: Instant::now(),
                    resent: false,
                    exps: (0, 0),
                    pkt: vec![0; plen],
                };
                p.window
            ],
            rx: commd_switch::udpio::RecvBufs::new(),
            vals: vec![0; p.size.values()],
            fvals: vec![0.0; p.size.values()],
            tsi_base: 0,
            op_base: 0,
            rto: Rto::new(p.timeout),
        }
    }

    /// Runs this thread's share of `job`; `Ok(true)` when a block was unrepresentable.
    fn run(&mut self, job: &Job) -> Result<bool, String> {
        let v = self.size.values();
        let total = job.count.div_ceil(v);
        // This thread's packets: [p0, p1) of the tensor.
        let p0 = total * self.t / self.threads;
        let p1 = total * (self.t + 1) / self.threads;
        let np = p1 - p0;
        // Every worker advances the ids by the same amount, whatever this thread's share.
        let span = (job.count.div_ceil(v).div_ceil(self.threads) + 2) * self.threads * self.window;
        self.op_base = self.tsi_base;
        self.tsi_base = self.tsi_base.wrapping_add(tsi_word(span));
        if np == 0 {
            return Ok(false);
        }
        let w = self.window.min(np);
        // Rounds per slot j: packets j, j+w, ... (+1 leading exponent round for floats).
        let rounds = |j: usize| -> usize { (np - j).div_ceil(w) + usize::from(job.float) };
        let mut unrep = false;
        let mut left = 0usize;
        let mut out: Vec<usize> = Vec::with_capacity(w);
        for j in 0..w {
            self.slots[j].round = 0;
            self.build(job, p0, np, w, j, &mut unrep);
            left += rounds(j);
            out.push(j);
        }
        self.send_slots(&out, false)?;
        let mut timeouts = 0u64;
        let mut last_progress = Instant::now();
        let slot_base = self.t * self.window;
        while left > 0 {
            if job.op.cancel.load(Ordering::Acquire) {
                return Err("cancelled".into());
            }
            let timeout = self.rto.timeout();
            let got = self.recv_batch(timeout.min(Duration::from_millis(20)))?;
            let now = Instant::now();
            let mut ready: Vec<usize> = Vec::new();
            for i in 0..got {
                let Ok(h) = Header::parse(self.rx.packet(i).0) else {
                    self.stats.dropped_results.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let j = usize::from(h.slot).wrapping_sub(slot_base);
                let ok = h.job == job.job
                    && h.size == self.size
                    && j < w
                    && self.slots[j].busy
                    && self.slots[j].set == h.set
                    && self.slots[j].tsi == h.tsi;
                if !ok {
                    self.stats.dropped_results.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                self.stats.results.fetch_add(1, Ordering::Relaxed);
                self.accept(job, p0, w, j, i, &h, &mut unrep);
                left -= 1;
                last_progress = now;
                if !self.slots[j].resent {
                    self.rto.sample(now - self.slots[j].sent_at);
                }
                self.slots[j].busy = false;
                self.slots[j].round += 1;
                if self.slots[j].round < rounds(j) {
                    self.build(job, p0, np, w, j, &mut unrep);
                    ready.push(j);
                }
            }
            if !ready.is_empty() {
                self.send_slots(&ready, false)?;
            }
            // Retransmit what timed out.
            let now = Instant::now();
            let timeout = self.rto.timeout();
            let late: Vec<usize> = (0..w)
                .filter(|&j| self.slots[j].busy && now - self.slots[j].sent_at >= timeout)
                .collect();
            if !late.is_empty() {
                self.stats
                    .retransmits
                    .fetch_add(late.len() as u64, Ordering::Relaxed);
                for _ in &late {
                    timeouts += 1;
                    if timeouts.is_multiple_of(100) {
                        self.rto.back_off();
                    }
                }
                self.send_slots(&late, true)?;
            }
            if last_progress.elapsed() > self.stall {
                return Err(format!(
                    "no result from the switch for {} ms ({} packet(s) of thread {} still outstanding): the switch or another worker of the session is not answering",
                    self.stall.as_millis(),
                    (0..w).filter(|&j| self.slots[j].busy).count(),
                    self.t
                ));
            }
        }
        Ok(unrep)
    }

    /// Fills slot `j`'s packet for its current round.
    fn build(&mut self, job: &Job, p0: usize, np: usize, w: usize, j: usize, unrep: &mut bool) {
        let v = self.size.values();
        let half = v / 2;
        let n = self.workers;
        let s = &mut self.slots[j];
        let r = s.round;
        // The packet whose values this round carries, and the one whose exponents it carries.
        let (vals_pkt, exp_pkt) = if job.float {
            (r.checked_sub(1).map(|x| j + x * w), Some(j + r * w))
        } else {
            (Some(j + r * w), None)
        };
        let set = s.next_set;
        s.next_set ^= 1;
        s.set = set;
        // Same on every worker: (op, round, slot) numbered across the session's slots.
        s.tsi = self
            .op_base
            .wrapping_add(tsi_word(r).wrapping_mul(tsi_word(self.threads * self.window)))
            .wrapping_add(tsi_word(self.t * self.window + j));
        let (mut e0, mut e1) = (i8::MIN, i8::MIN);
        let elems = job.count;
        let range = |pk: usize| -> (usize, usize) {
            let a = ((p0 + pk) * v).min(elems);
            let b = ((p0 + pk + 1) * v).min(elems);
            (a, b)
        };
        if let Some(pk) = exp_pkt.filter(|&pk| pk < np) {
            let (a, b) = range(pk);
            let base = job.ptr as *const f32;
            // SAFETY: [a, b) lies within the caller's `count` elements (start_op's contract).
            let xs = unsafe { std::slice::from_raw_parts(base.add(a), b - a) };
            let m = half.min(xs.len());
            e0 = block_exponent(&xs[..m]);
            e1 = block_exponent(&xs[m..]);
        }
        self.vals.iter_mut().for_each(|x| *x = 0);
        if let Some(pk) = vals_pkt {
            let (a, b) = range(pk);
            if job.float {
                let base = job.ptr as *const f32;
                // SAFETY: as above.
                let xs = unsafe { std::slice::from_raw_parts(base.add(a), b - a) };
                let (ea, eb) = s.exps;
                if ea == EXP_UNREPRESENTABLE || eb == EXP_UNREPRESENTABLE {
                    *unrep = true;
                }
                let m = half.min(xs.len());
                quantize(&xs[..m], ea, n, &mut self.vals[..m]);
                quantize(&xs[m..], eb, n, &mut self.vals[half..half + xs.len() - m]);
            } else {
                let base = job.ptr as *const i32;
                // SAFETY: as above.
                let xs = unsafe { std::slice::from_raw_parts(base.add(a), b - a) };
                self.vals[..xs.len()].copy_from_slice(xs);
            }
        }
        let h = Header {
            size: self.size,
            job: job.job,
            tsi: s.tsi,
            slot: u16::try_from(self.t * self.window + j).expect(
                "a slot is below threads * window, at most 16 * 4096 (the registry's bounds)",
            ),
            set,
            e0,
            e1,
        };
        h.write(&mut s.pkt);
        packet::put_values(&mut s.pkt[HEADER_BYTES..], &self.vals);
    }

    /// Takes the result in `rbuf[i]` for slot `j`.
    #[allow(clippy::too_many_arguments)]
    fn accept(
        &mut self,
        job: &Job,
        p0: usize,
        w: usize,
        j: usize,
        i: usize,
        h: &Header,
        unrep: &mut bool,
    ) {
        let v = self.size.values();
        let half = v / 2;
        let r = self.slots[j].round;
        let vals_pkt = if job.float {
            r.checked_sub(1).map(|x| j + x * w)
        } else {
            Some(j + r * w)
        };
        if let Some(pk) = vals_pkt {
            let a = ((p0 + pk) * v).min(job.count);
            let b = ((p0 + pk + 1) * v).min(job.count);
            packet::get_values(&self.rx.packet(i).0[HEADER_BYTES..], &mut self.vals);
            if job.float {
                let (ea, eb) = self.slots[j].exps;
                let m = half.min(b - a);
                dequantize(&self.vals[..m], ea, self.workers, &mut self.fvals[..m]);
                dequantize(
                    &self.vals[half..half + (b - a) - m],
                    eb,
                    self.workers,
                    &mut self.fvals[m..b - a],
                );
                if ea == EXP_UNREPRESENTABLE || eb == EXP_UNREPRESENTABLE {
                    *unrep = true;
                }
                let base = job.ptr as *mut f32;
                // SAFETY: [a, b) lies within the caller's `count` elements, and only this
                // thread touches its packets' ranges.
                let out = unsafe { std::slice::from_raw_parts_mut(base.add(a), b - a) };
                out.copy_from_slice(&self.fvals[..b - a]);
            } else {
                let base = job.ptr as *mut i32;
                // SAFETY: as above.
                let out = unsafe { std::slice::from_raw_parts_mut(base.add(a), b - a) };
                out.copy_from_slice(&self.vals[..b - a]);
            }
        }
        if job.float {
            // The exponents this result agreed are for the slot's next values packet.
            self.slots[j].exps = (h.e0, h.e1);
        }
    }

    fn send_slots(&mut self, js: &[usize], resend: bool) -> Result<(), String> {
        let now = Instant::now();
        let bufs: Vec<&[u8]> = js.iter().map(|&j| &self.slots[j].pkt[..]).collect();
        commd_switch::udpio::send(&self.sock, None, &bufs, &self.stats)?;
        for &j in js {
            self.slots[j].busy = true;
            self.slots[j].sent_at = now;
            self.slots[j].resent = resend;
        }
        self.stats
            .packets_sent
            .fetch_add(js.len() as u64, Ordering::Relaxed);
        self.stats.bytes.fetch_add(
            (js.len() * (HEADER_BYTES + self.size.bytes())) as u64,
            Ordering::Relaxed,
        );
        Ok(())
    }

    /// Waits up to `wait` for results; returns how many landed in `rx`.
    fn recv_batch(&mut self, wait: Duration) -> Result<usize, String> {
        let n = commd_switch::udpio::recv(&self.sock, &mut self.rx, &self.stats)?;
        if n > 0 {
            return Ok(n);
        }
        commd_switch::udpio::wait_readable(&self.sock, wait);
        commd_switch::udpio::recv(&self.sock, &mut self.rx, &self.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::Rto;
    use std::time::Duration;

    #[test]
    fn rto_follows_the_round_trip_but_not_below_the_floor() {
        let ms = Duration::from_millis;
        let mut r = Rto::new(ms(10));
        assert_eq!(r.timeout(), ms(10), "no sample yet: the floor");
        for _ in 0..50 {
            r.sample(ms(1));
        }
        assert_eq!(r.timeout(), ms(10), "a fast path keeps the floor");
        for _ in 0..50 {
            r.sample(ms(30));
        }
        let t = r.timeout();
        assert!(
            t >= ms(30) && t < ms(60),
            "whole-window round trips of 30 ms: {t:?}"
        );
        // Jittery samples widen the margin beyond the mean.
        let mut j = Rto::new(ms(1));
        for i in 0..100 {
            j.sample(ms(if i % 2 == 0 { 10 } else { 30 }));
        }
        assert!(j.timeout() > ms(40), "{:?}", j.timeout());
        r.back_off();
        assert!(
            r.timeout() >= 2 * t - ms(1),
            "backoff doubles: {:?} vs {t:?}",
            r.timeout()
        );
        for _ in 0..20 {
            r.back_off();
        }
        assert_eq!(r.timeout(), Duration::from_secs(1), "capped at 1 s");
        r.sample(ms(30));
        assert!(r.timeout() < ms(100), "a fresh sample ends the backoff");
    }
}
