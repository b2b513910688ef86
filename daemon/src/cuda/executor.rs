//! The `commd-gpu` thread: polls the ready counters of matched jobs, issues their copies on
//! the source GPUs' push streams, polls the copies' events, publishes done, completes the ops;
//! one-phase jobs without scratch run beside earlier ones when their buffers and the ranks'
//! program order allow (`turn`, `beside`),
//! replays of persistent ops (`graphs`) interleave with eager jobs, and pacing caps
//! each communicator's copy rate.
//!
//! May use: `plan`, `doorbell` (bells; the ops it completes through `Done`), `mem`,
//! `topology`'s streams, `graphs`, `pacing`, `fanout`, `telemetry` (op spans).

#![allow(unsafe_code)] // CUDA driver calls and device memory

use super::*;

/// A matched GPU op, ready for the executor.
pub struct GpuJob {
    /// The op's trace span (`comm::op_span`); it ends when the job is dropped.
    pub span: tracing::Span,
    pub comm_id: u64,
    pub label: String,
    pub bells: Vec<Bell>,
    pub phases: Vec<Phase>,
    pub ops: Vec<Box<dyn Done>>,
    pub timeout: Duration,
    /// The communicator's GPU copy pacing: ask `admit` before issuing each phase's copies.
    pub pacer: std::sync::Arc<crate::pacing::Pacer>,
    /// Captured into CUDA graphs: registered, then run on every replay (`graphs`).
    pub persistent: bool,
    /// The capture's tag (`flags::PERSISTENT`), as rank 0 of the op named it.
    pub graph_tag: u32,
    /// The scratch allocations its reductions use (`DevMem` addresses): a job starts only when
    /// no other job holds one of them, and holds them until it finishes, since a session's
    /// communicators on one GPU share their scratch (`session::Tables::scratch_pool`).
    pub scratch: Vec<usize>,
}

enum State {
    Waiting {
        since: Instant,
    },
    InFlight {
        events: Vec<(usize, sys::CUevent)>,
        /// When the phase's turn came, when every ready was seen, when its copies were issued.
        turn: Instant,
        ready: Instant,
        issued: Instant,
    },
}

/// Where the executor's time per phase goes, by phase shape (number of copies, bytes), logged
/// (target `commd::cuda`, level INFO) when the executor goes idle: from the phase's turn (the
/// previous phase of its communicator done, or the job reaching the front of its queue) until
/// every rank's ready counter is seen (in a steady stream of ops: the clients' streams passing
/// the previous op's done counter and signalling the next one), the time spent issuing its
/// copies (driver calls), and from then until the copies' events are seen complete.
#[derive(Default)]
struct PhaseTimes {
    by_shape: HashMap<(usize, u64), PhaseAcc>,
}

#[derive(Default, Clone, Copy)]
struct PhaseAcc {
    phases: u64,
    wait_ns: u64,
    issue_ns: u64,
    copy_ns: u64,
}

impl PhaseTimes {
    fn add(&mut self, copies: usize, bytes: u64, wait: Duration, issue: Duration, copy: Duration) {
        let a = self.by_shape.entry((copies, bytes)).or_default();
        a.phases += 1;
        a.wait_ns += u64::try_from(wait.as_nanos()).unwrap_or(u64::MAX);
        a.issue_ns += u64::try_from(issue.as_nanos()).unwrap_or(u64::MAX);
        a.copy_ns += u64::try_from(copy.as_nanos()).unwrap_or(u64::MAX);
    }

    /// Logs and clears the shapes with enough phases to mean something.
    fn report(&mut self) {
        let mut shapes: Vec<_> = self.by_shape.drain().collect();
        shapes.sort_by_key(|((c, b), _)| (*b, *c));
        for ((copies, bytes), a) in shapes {
            if a.phases < 20 {
                continue;
            }
            let n = a.phases as f64;
            tracing::info!(
                target: "commd::cuda",
                "executor: {} phases of {} copies, {} KiB: mean us per phase: until every ready counter was seen {:.1}, issuing the copies {:.1}, copies until their events were seen complete {:.1}",
                a.phases,
                copies,
                bytes / 1024,
                a.wait_ns as f64 / n / 1e3,
                a.issue_ns as f64 / n / 1e3,
                a.copy_ns as f64 / n / 1e3,
            );
        }
    }
}

struct Active {
    job: GpuJob,
    phase: usize,
    state: State,
    /// Events of the current phase's `early` copies, issued when the previous phase started.
    ahead: Vec<(usize, sys::CUevent)>,
    /// Events of earlier phases' `main` copies (an all-reduce's reduced pieces pushed out)
    /// still in flight: a phase other than the last is done once its `early` copies (the
    /// round's inputs, all its kernel reads) are, and the last phase waits for these too.
    trailing: Vec<(usize, sys::CUevent)>,
    /// The current phase's done ticket was written before every rank reached the phase
    /// (`signal_ahead`).
    signaled: bool,
    /// A failed replay's status and message (persistent jobs only; set by `finish`).
    failure: Option<(u32, String)>,
    /// It holds its scratch (`GpuJob::scratch`), from its first phase's start to its end.
    holds: bool,
    /// Its communicator's queue was logged while it waited at the front (`log_stuck`).
    logged: bool,
}

impl Active {
    /// A job at its first phase, waiting for the ranks' streams from now on.
    fn new(job: GpuJob) -> Self {
        Self {
            job,
            phase: 0,
            state: State::Waiting {
                since: Instant::now(),
            },
            ahead: Vec::new(),
            trailing: Vec::new(),
            signaled: false,
            failure: None,
            holds: false,
            logged: false,
        }
    }
}

/// Work for the executor thread.
pub(super) enum Cmd {
    Job(GpuJob),
    /// A persistent op, matched at capture (`graphs`).
    Register(GpuJob),
    Poison {
        bells: Vec<Bell>,
        phases: u32,
        st: u32,
        msg: String,
    },
    Release {
        session: u64,
        slots: Vec<u32>,
        reply: std::sync::mpsc::Sender<Vec<u32>>,
    },
}

#[derive(Default)]
pub(super) struct Executor {
    incoming: Mutex<VecDeque<Cmd>>,
    cv: Condvar,
    /// Scratch allocations held by a running job (`GpuJob::scratch`); the executor thread
    /// alone uses it (a mutex only for `Sync`).
    busy: Mutex<std::collections::HashSet<usize>>,
}

impl Executor {
    pub(super) fn push(&self, cmd: Cmd) {
        self.incoming
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push_back(cmd);
        self.cv.notify_one();
    }

    /// The `commd-gpu` loop: polls ready counters (CPU polling: 3.7 us round trips on our H200s
    /// versus 12.4 us for a daemon stream waiting on the client's counter), issues the pushes,
    /// polls their events, writes done counters, and completes the ops. Jobs of one
    /// communicator run in order (one-phase ones as `turn` allows); different communicators
    /// progress independently. With nothing queued it keeps looking for `IDLE_SPIN` before
    /// sleeping on its condition variable, so a stream of ops (the next one is usually matched
    /// within microseconds) does not pay a thread wake-up per op.
    pub(super) fn run(&self, cuda: &'static Cuda) {
        const IDLE_SPIN: Duration = Duration::from_millis(1);
        let mut queues: HashMap<u64, VecDeque<Active>> = HashMap::new();
        // Persistent ops (captured into CUDA graphs) and, per communicator, the replay running
        // now (at most one: it uses the communicator's scratch, as the eager jobs do).
        let mut graphs = super::graphs::Registry::default();
        let mut replaying: HashMap<u64, (u64, Active)> = HashMap::new();
        let mut times = PhaseTimes::default();
        let mut idle_since = Instant::now();
        loop {
            {
                let mut inc = self.incoming.lock().unwrap_or_else(|e| e.into_inner());
                if queues.is_empty() && inc.is_empty() && graphs.is_empty() {
                    if idle_since.elapsed() < IDLE_SPIN {
                        drop(inc);
                        std::thread::yield_now();
                        continue;
                    }
                    if !times.by_shape.is_empty() {
                        drop(inc);
                        times.report();
                        continue;
                    }
                    inc = self
                        .cv
                        .wait_timeout(inc, Duration::from_millis(100))
                        .map(|(g, _)| g)
                        .unwrap_or_else(|e| e.into_inner().0);
                }
                for cmd in inc.drain(..) {
                    match cmd {
                        Cmd::Job(job) => queues
                            .entry(job.comm_id)
                            .or_default()
                            .push_back(Active::new(job)),
                        Cmd::Register(job) => graphs.register(job),
                        Cmd::Poison {
                            bells,
                            phases,
                            st,
                            msg,
                        } => graphs.poison_new(bells, phases, st, msg),
                        Cmd::Release {
                            session,
                            slots,
                            reply,
                        } => {
                            let _ = reply.send(graphs.release(session, &slots));
                        }
                    }
                }
            }
            let mut progressed = false;
            // Replays first: a replay that every rank fired runs before the communicator's
            // next eager job unless that job already started (its streams are then past the
            // replay, or on other streams). Eager jobs wait while a replay runs.
            for comm in graphs.comms() {
                if let Some((id, a)) = replaying.get_mut(&comm) {
                    let (moved, finished) = step(cuda, &mut times, a);
                    progressed |= moved;
                    if finished {
                        let id = *id;
                        if let Some((_, a)) = replaying.remove(&comm) {
                            graphs.finished(comm, id, a.job, a.failure);
                        }
                        if let Some(Active {
                            phase: 0,
                            state: State::Waiting { since },
                            ..
                        }) = queues.get_mut(&comm).and_then(|q| q.front_mut())
                        {
                            *since = Instant::now();
                        }
                    }
                    continue;
                }
                let eager_started = queues.get(&comm).is_some_and(|q| q.iter().any(started));
                let (moved, start) = graphs.poll(comm, !eager_started);
                progressed |= moved;
                if let Some((id, job)) = start {
                    progressed = true;
                    replaying.insert(comm, (id, Active::new(job)));
                }
            }
            for (comm, q) in queues.iter_mut() {
                if replaying.contains_key(comm) {
                    continue;
                }
                // The front job, then each later job that `turn` lets start or progress.
                let mut i = 0;
                while i < q.len() {
                    let s = q.make_contiguous();
                    let t = turn(s, i);
                    let (_, rest) = s.split_at_mut(i);
                    let Some((a, after)) = rest.split_first_mut() else {
                        break;
                    };
                    if i == 0 {
                        log_stuck(a, after);
                    }
                    match t {
                        Turn::Stop => break,
                        Turn::Skip => {
                            i += 1;
                            continue;
                        }
                        Turn::Step => {}
                    }
                    let (moved, finished) = step(cuda, &mut times, a);
                    progressed |= moved;
                    if !finished {
                        i += 1;
                        continue;
                    }
                    q.remove(i);
                    // The next job's turn starts now (its timeout and phase times count from
                    // here, not from when it was queued).
                    if i == 0
                        && let Some(Active {
                            phase: 0,
                            state: State::Waiting { since },
                            ..
                        }) = q.front_mut()
                    {
                        *since = Instant::now();
                    }
                }
            }
            queues.retain(|_, q| !q.is_empty());
            if progressed {
                idle_since = Instant::now();
            } else if idle_since.elapsed() > Duration::from_millis(200) && queues.is_empty() {
                // Only armed graphs, no replay for a while: look every half millisecond (a
                // replay's first phase may wait that long; a steady stream of replays keeps
                // the loop in the faster modes below).
                std::thread::sleep(Duration::from_micros(500));
            } else if idle_since.elapsed() > Duration::from_millis(2) {
                // Nothing moved for a while (a stream still computing): poll gently.
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Whether job `b`, queued after `a` on the same communicator, may run at the same time as
/// `a`: both are one-phase jobs without scratch (send/recv, broadcast, gathers, all-to-all:
/// their copies go straight between the ranks' buffers), and no copy of one writes where a copy
/// of the other reads or writes. Everything else keeps the communicator's order.
fn beside(a: &GpuJob, b: &GpuJob) -> bool {
    if !simple(a) || !simple(b) {
        return false;
    }
    a.phases[0].copies().all(|x| {
        b.phases[0]
            .copies()
            .all(|y| !y.dst.overlaps(&x.src) && !y.dst.overlaps(&x.dst) && !y.src.overlaps(&x.dst))
    })
}

/// A front job still waiting after half its timeout, or 30 s if that is sooner (torch's
/// default timeouts are 10-30 minutes): the communicator's queue once, at WARN (which ranks'
/// streams each job waits for, the first `LISTED` jobs), so a hang can be read from the log
/// before the timeout fails it.
fn log_stuck(a: &mut Active, after: &[Active]) {
    const LISTED: usize = 16;
    let State::Waiting { since } = a.state else {
        return;
    };
    if a.logged || since.elapsed() < (a.job.timeout / 2).min(Duration::from_secs(30)) {
        return;
    }
    a.logged = true;
    let line = |j: &Active| {
        let late = late_streams(&j.job.bells, phase_word(j.phase));
        let state = if started(j) {
            "started".to_string()
        } else if late.is_empty() {
            "ready".to_string()
        } else {
            format!("waiting for {}", late.join(", "))
        };
        let tickets: Vec<String> = j
            .job
            .bells
            .iter()
            .map(|b| format!("rank {} ticket {}", b.rank, b.ticket))
            .collect();
        format!("{} [{}]: {state}", j.job.label, tickets.join(", "))
    };
    let mut queue: Vec<String> = std::iter::once(&*a)
        .chain(after)
        .take(LISTED)
        .map(line)
        .collect();
    if after.len() + 1 > LISTED {
        queue.push(format!("{} more", after.len() + 1 - LISTED));
    }
    tracing::warn!(
        target: "commd::cuda",
        "GPU jobs of one communicator waiting for {:.1} s, in queue order: {}",
        since.elapsed().as_secs_f64(),
        queue.join("; ")
    );
}

/// What the executor's scan does with the job at one position of a communicator's queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Turn {
    /// Advance it (check its streams, issue its copies, poll them).
    Step,
    /// Leave it for now; look at the next one.
    Skip,
    /// Look no further in this queue.
    Stop,
}

/// A queued job as the scan sees it (`Active`; the tests' own jobs).
trait Queued {
    /// One phase, no scratch, not captured (`simple`).
    fn simple(&self) -> bool;
    /// It issued copies or finished a phase.
    fn started(&self) -> bool;
    /// Every rank's stream has reached its first phase.
    fn ready(&self) -> bool;
    /// A copy of one writes where a copy of the other reads or writes (`beside` is false).
    fn conflicts(&self, o: &Self) -> bool;
    /// They share a rank, and on every rank they share this job's op was posted first.
    fn first_in_program(&self, o: &Self) -> bool;
}

/// The scan's rule for job `i` of a queue. The front job always steps (its streams and its
/// timeout are checked there), unless a later job that passed it conflicts and is running.
/// A later job runs beside the ones before it when it is one-phase, its streams have all
/// reached it, and every earlier unfinished job either does not conflict with it, or has not
/// started, its streams have not all reached it, and comes later in the program order of every
/// rank the two share; and no later job that started conflicts with it.
///
/// Jobs are queued in the order the daemon matched them, which is not each rank's program
/// order across peers, so a later job is not waited for when its streams have not reached it:
/// the job that lets them may be queued behind it (a ring of send/recv groups: rank 2's stream
/// waits at its group's end for its send to rank 3, matched after rank 1's next send to rank
/// 2; nccl-tests' hypercube: rank 0's round-2 send, matched before rank 1's round-1 send to
/// rank 0 that writes what it reads). A ready earlier job with a conflict keeps the queue's
/// order (a p2p group's ops on one rank may run in any order; an in-place ring has no order
/// that serves every rank). Nothing runs beside a multi-phase job, so the scan stops at the
/// first one.
fn turn<T: Queued>(q: &[T], i: usize) -> Turn {
    let a = &q[i];
    if i > 0 && (!a.simple() || !q[0].simple()) {
        return Turn::Stop;
    }
    if a.started() {
        return Turn::Step;
    }
    let after = &q[i + 1..];
    let passed = |a: &T| after.iter().any(|k| k.started() && k.conflicts(a));
    if i == 0 {
        return if a.simple() && passed(a) {
            Turn::Skip
        } else {
            Turn::Step
        };
    }
    // Readiness first (a few atomic loads); the buffer checks only for a job that could start.
    let clear = a.ready()
        && q[..i]
            .iter()
            .all(|b| !b.conflicts(a) || (!b.started() && !b.ready() && a.first_in_program(b)))
        && !passed(a);
    if clear { Turn::Step } else { Turn::Skip }
}

impl Queued for Active {
    fn simple(&self) -> bool {
        simple(&self.job)
    }
    fn started(&self) -> bool {
        started(self)
    }
    fn ready(&self) -> bool {
        self.job
            .bells
            .iter()
            .all(|b| b.ready(phase_word(self.phase)))
    }
    fn conflicts(&self, o: &Self) -> bool {
        !beside(&self.job, &o.job)
    }
    fn first_in_program(&self, o: &Self) -> bool {
        // Evaluated on every pass of the loop while a ready job waits: no allocation.
        program_first(tickets(&self.job), tickets(&o.job))
    }
}

/// (rank, ticket) of each eager op of a job.
fn tickets(j: &GpuJob) -> impl Iterator<Item = (u32, u32)> + Clone + '_ {
    j.bells
        .iter()
        .filter(|b| !b.graph)
        .map(|b| (b.rank, b.ticket))
}

/// `a` and `b` ((rank, ticket) of each op) share a rank, and on every rank they share `a`'s op
/// has the earlier ticket (tickets wrap).
fn program_first(
    a: impl IntoIterator<Item = (u32, u32)>,
    b: impl IntoIterator<Item = (u32, u32)> + Clone,
) -> bool {
    let mut shared = false;
    for (r, ta) in a {
        for (_, tb) in b.clone().into_iter().filter(|(rb, _)| *rb == r) {
            shared = true;
            if ta.wrapping_sub(tb).cast_signed() >= 0 {
                return false;
            }
        }
    }
    shared
}

/// The job issued copies (or finished a phase): others order themselves around it.
fn started(a: &Active) -> bool {
    a.phase > 0 || matches!(a.state, State::InFlight { .. })
}

/// One phase, no scratch, not captured: a job that may run beside others (`beside`).
fn simple(j: &GpuJob) -> bool {
    j.phases.len() == 1 && j.scratch.is_empty() && !j.persistent
}

/// Advances one job; returns (made progress, finished).
fn step(cuda: &'static Cuda, times: &mut PhaseTimes, a: &mut Active) -> (bool, bool) {
    match &mut a.state {
        State::Waiting { since } => {
            let phase = phase_word(a.phase);
            if let Some(lost) = a.job.bells.iter().find(|b| b.session.is_closed()) {
                let msg = format!(
                    "{}: rank {} (pid {}) was lost during the op",
                    a.job.label,
                    lost.rank,
                    lost.session.pid()
                );
                finish(cuda, a, status::PEER_LOST, Some(msg));
                return (true, true);
            }
            if !a.job.bells.iter().all(|b| b.ready(phase)) {
                let early = signal_ahead(a);
                let State::Waiting { since } = &a.state else {
                    return (early, false);
                };
                if since.elapsed() > a.job.timeout {
                    let late = late_streams(&a.job.bells, phase);
                    let msg = format!(
                        "{}: timed out after {:.1} s waiting for the GPU streams of {} to reach the op (phase {phase}); is that rank's stream blocked behind other work?",
                        a.job.label,
                        since.elapsed().as_secs_f64(),
                        late.join(", ")
                    );
                    tracing::warn!(target: "commd::cuda", "{msg}");
                    finish(cuda, a, status::TIMEOUT, Some(msg));
                    return (true, true);
                }
                return (early, false);
            }
            // A scratch shared with another communicator's running job: wait for it (only
            // reductions have scratch; jobs of one communicator already run in order).
            if !a.holds && !a.job.scratch.is_empty() {
                let mut busy = cuda.exec.busy.lock().unwrap_or_else(|e| e.into_inner());
                if a.job.scratch.iter().any(|k| busy.contains(k)) {
                    return (false, false);
                }
                busy.extend(a.job.scratch.iter().copied());
                a.holds = true;
            }
            // Pacing: the phase starts once the communicator's cap allows its bytes (the
            // busiest source GPU's, which is what competes with that GPU's compute).
            let p = a.phase;
            let bytes = paced_bytes(&a.job.phases, p, cuda.gpus.len());
            if bytes > 0 && a.job.pacer.admit(bytes, Instant::now()).is_err() {
                return (false, false);
            }
            let turn = *since;
            let ready = Instant::now();
            // This phase's copies (its early ones too on the first phase), then the next
            // phase's early ones: per source GPU one push stream, so they run in that order.
            // The phase is done when its early copies are (the inputs its round's kernels
            // read); its main copies (the previous round's pieces pushed out, which no kernel
            // reads) trail on, and the last phase waits for all of them. Waiting for the pushes
            // too would keep the clients' rounds kernels spinning longer each round
            // (docs/benchmarks.md row `gemm-overlap-2gpu-256M`).
            let mut events = std::mem::take(&mut a.ahead);
            let last = p + 1 == a.job.phases.len();
            let issued = (|| -> Result<Vec<(usize, sys::CUevent)>, CuError> {
                if p == 0 {
                    events.extend(issue(cuda, &a.job.phases[0].early)?);
                }
                let main = issue(cuda, &a.job.phases[p].main)?;
                if last {
                    events.extend(main);
                    events.append(&mut a.trailing);
                } else {
                    a.trailing.extend(main);
                }
                match a.job.phases.get(p + 1) {
                    Some(next) => issue(cuda, &next.early),
                    None => Ok(Vec::new()),
                }
            })();
            match issued {
                Ok(ahead) => {
                    a.ahead = ahead;
                    if events.is_empty() {
                        return phase_done(cuda, a);
                    }
                    a.state = State::InFlight {
                        events,
                        turn,
                        ready,
                        issued: Instant::now(),
                    };
                    (true, false)
                }
                Err(e) => {
                    a.ahead.extend(events);
                    let msg = format!("{}: issuing copies failed: {e}", a.job.label);
                    finish(cuda, a, status::INTERNAL, Some(msg));
                    (true, true)
                }
            }
        }
        State::InFlight {
            events,
            turn,
            ready,
            issued,
        } => {
            let mut pending = false;
            let mut failed = None;
            for (_, e) in events.iter() {
                // SAFETY: the event was recorded by us and is not destroyed while in a job.
                let r = unsafe { sys::cuEventQuery(*e) };
                if r == sys::CUresult::CUDA_ERROR_NOT_READY {
                    pending = true;
                } else if r != sys::CUresult::CUDA_SUCCESS {
                    failed = Some(cu::describe(r).0);
                }
            }
            if pending && failed.is_none() {
                return (false, false);
            }
            let ph = &a.job.phases[a.phase];
            times.add(
                ph.early.len() + ph.main.len(),
                ph.copies().map(|c| c.src.bytes).sum(),
                *ready - *turn,
                *issued - *ready,
                issued.elapsed(),
            );
            for (g, e) in events.drain(..) {
                cuda.recycle(g, e);
            }
            if let Some(why) = failed {
                let msg = format!("{}: a copy failed on the GPU: {why}", a.job.label);
                finish(cuda, a, status::INTERNAL, Some(msg));
                return (true, true);
            }
            phase_done(cuda, a)
        }
    }
}

/// Bytes that starting phase `p` issues (its copies, its early ones on the first phase, and the
/// next phase's early ones), counted on the source GPU that pushes the most of them.
fn paced_bytes(phases: &[Phase], p: usize, ngpus: usize) -> u64 {
    let mut per = vec![0u64; ngpus.max(1)];
    let mut add = |cs: &[CopyOp]| {
        for c in cs {
            if let Some(b) = per.get_mut(c.src.mem.gpu) {
                *b += c.src.bytes;
            }
        }
    };
    if p == 0 {
        add(&phases[0].early);
    }
    add(&phases[p].main);
    if let Some(next) = phases.get(p + 1) {
        add(&next.early);
    }
    per.into_iter().max().unwrap_or(0)
}

/// A phase other than the first and the last needs only its round's inputs (its `early`
/// copies, issued when the previous phase started) for the clients' kernels of the round; its
/// `main` copies and the next round's inputs wait for every rank's stream. So once those inputs
/// are in, each rank's done word gets the phase's ticket at once, before every rank has
/// reached the phase: a rank whose kernel finished its round sooner goes on with the next
/// round instead of waiting for the slowest rank (under a GEMM that holds every SM, the ranks'
/// kernels start at different GEMM boundaries: 0.7 ms apart on average, 2x H100). Eager jobs
/// only (a graph's done words take constant values per phase, `graphs`). Returns whether it
/// signalled.
fn signal_ahead(a: &mut Active) -> bool {
    let p = a.phase;
    if a.signaled || p == 0 || p + 1 >= a.job.phases.len() || a.job.persistent || a.ahead.is_empty()
    {
        return false;
    }
    // SAFETY: the events were recorded by us and are not destroyed while in a job.
    let done = a
        .ahead
        .iter()
        .all(|(_, e)| unsafe { sys::cuEventQuery(*e) } == sys::CUresult::CUDA_SUCCESS);
    if !done {
        return false;
    }
    for b in &a.job.bells {
        if b.graph_words().is_none() {
            signal_done(b, b.ticket.wrapping_add(phase_word(p)));
        }
    }
    a.signaled = true;
    true
}

fn phase_done(cuda: &Cuda, a: &mut Active) -> (bool, bool) {
    let last = a.phase + 1 == a.job.phases.len();
    for b in &a.job.bells {
        match b.graph_words() {
            // A replay: constant values, re-armed after the last phase (docs/contracts.md #6).
            Some(w) => w.phase_done(phase_word(a.phase), last),
            None => signal_done(b, b.ticket.wrapping_add(phase_word(a.phase))),
        }
    }
    a.phase += 1;
    a.signaled = false;
    if a.phase == a.job.phases.len() {
        finish(cuda, a, status::OK, None);
        return (true, true);
    }
    a.state = State::Waiting {
        since: Instant::now(),
    };
    (true, false)
}

/// Completes every op of the job (a failure also releases the streams through the doorbells,
/// in `Posted::complete`). Copies issued ahead are waited for first: they read the clients'
/// buffers, which must stay valid until they are done.
fn finish(cuda: &Cuda, a: &mut Active, st: u32, msg: Option<String>) {
    for (g, e) in a.ahead.drain(..).chain(a.trailing.drain(..)) {
        // SAFETY: the event was recorded by us and is not destroyed while in a job.
        let _ = unsafe { sys::cuEventSynchronize(e) };
        cuda.recycle(g, e);
    }
    // Every copy into the scratch is done (a phase ends with its copies' events): free it.
    if a.holds {
        let mut busy = cuda.exec.busy.lock().unwrap_or_else(|e| e.into_inner());
        for k in &a.job.scratch {
            busy.remove(k);
        }
        a.holds = false;
    }
    crate::telemetry::op_status(&a.job.span, st);
    if a.job.persistent && st != status::OK {
        // A failed replay releases every rank's stream and sets its error words
        // (docs/contracts.md #5).
        let msg = msg.clone().unwrap_or_default();
        let phases = phase_word(a.job.phases.len());
        for b in &a.job.bells {
            super::graphs::fail_bell(b, phases, st, &msg);
        }
        a.failure = Some((st, msg));
    }
    for p in a.job.ops.drain(..) {
        p.complete(st, msg.clone());
    }
}

/// The stream a copy from GPU `from` to GPU `to` goes on: copies within a GPU on its own stream,
/// and every push to other GPUs on one stream per source GPU, so they run one after the other.
/// Measured on 4x H200 (NVSwitch): three concurrent pushes from one GPU to three peers gave
/// 190 GB/s of egress in all, one push at a time ~380 GB/s; NCCL's all-gather reaches 334.
pub(super) fn push_stream(from: usize, to: usize, ngpus: usize) -> usize {
    if from == to || ngpus < 2 {
        to
    } else {
        (from + 1) % ngpus
    }
}

/// Issues one phase's copies as pushes and records one event per stream used. Pushes are issued
/// in rounds, each GPU first to its next GPU, then to the one after, ...: a permutation per
/// round, so no GPU receives from several at once while another idles. With copies from several
/// source GPUs, each GPU's copies are issued from its own thread (`Cuda::issuers`): each driver
/// call costs 2-4 us, so one thread issuing the 12 copies of a 4-GPU phase delayed the last
/// GPU's first push by 30-40 us.
fn issue(cuda: &Cuda, copies: &[CopyOp]) -> Result<Vec<(usize, sys::CUevent)>, CuError> {
    if copies.iter().any(|c| c.after.is_some()) {
        // Dependencies name positions in the list: issued as listed, from this thread.
        return issue_from(cuda, &copies.iter().collect::<Vec<_>>());
    }
    let ng = cuda.gpus.len();
    // Round r holds the pushes from each GPU to the GPU r after it; local copies (round 0, a
    // stream of their own, fast) go last.
    let mut order: Vec<&CopyOp> = copies.iter().collect();
    order.sort_by_key(|c| {
        let r = (c.dst.mem.gpu + ng - c.src.mem.gpu) % ng.max(1);
        if r == 0 { ng } else { r }
    });
    let sources = (0..ng)
        .filter(|&g| order.iter().any(|c| c.src.mem.gpu == g))
        .count();
    let Some(pool) = cuda
        .issuers
        .as_ref()
        .filter(|_| sources > 1 && order.len() >= 4)
    else {
        return issue_from(cuda, &order);
    };
    let lists: Vec<Vec<&CopyOp>> = (0..ng)
        .map(|g| {
            order
                .iter()
                .copied()
                .filter(|c| c.src.mem.gpu == g)
                .collect()
        })
        .collect();
    // Events cross threads as addresses: CUevent is a raw pointer, and the driver lets any
    // thread use it.
    type Issued = Result<Vec<(usize, usize)>, CuError>;
    let results: Vec<Mutex<Option<Issued>>> = (0..ng).map(|_| Mutex::new(None)).collect();
    let ran = pool.run(ng, &|g| {
        if !lists[g].is_empty() {
            let r = issue_from(cuda, &lists[g])
                .map(|v| v.into_iter().map(|(g, e)| (g, e as usize)).collect());
            *results[g].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
        }
    });
    let mut events = Vec::new();
    let mut err = ran.err().map(|why| CuError {
        what: "issuing copies".into(),
        code: 0,
        name: "COMMD_INTERNAL".into(),
        text: why,
    });
    for r in results {
        match r.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(ev)) => events.extend(ev.into_iter().map(|(g, e)| (g, e as sys::CUevent))),
            Some(Err(e)) => err = err.or(Some(e)),
            None => {}
        }
    }
    if let Some(e) = err {
        // The copies that were issued must be done before the caller fails the op.
        for (g, ev) in events {
            // SAFETY: recorded by `issue_from` above and not yet handed to anyone.
            let _ = unsafe { sys::cuEventSynchronize(ev) };
            cuda.recycle(g, ev);
        }
        return Err(e);
    }
    Ok(events)
}

/// Issues `copies` in this order from the calling thread, then records one event per stream
/// used. A copy with `after` (an index into `copies`: a chained broadcast's forward) first makes
/// its stream wait (`cuStreamWaitEvent`, across GPUs) for an event recorded after the copy it
/// names; those events are returned too. On failure the copies issued are waited for, the
/// events given back, and the error returned.
fn issue_from(cuda: &Cuda, copies: &[&CopyOp]) -> Result<Vec<(usize, sys::CUevent)>, CuError> {
    let ng = cuda.gpus.len();
    let mut awaited = vec![false; copies.len()];
    for j in copies.iter().filter_map(|c| c.after) {
        if let Some(a) = awaited.get_mut(j) {
            *a = true;
        }
    }
    let mut arrived: Vec<Option<sys::CUevent>> = vec![None; copies.len()];
    let mut events: Vec<(usize, sys::CUevent)> = Vec::new();
    let mut used: Vec<(usize, usize)> = Vec::new();
    let r = (|| -> Result<(), CuError> {
        for (i, c) in copies.iter().enumerate() {
            let (from, to) = (c.src.mem.gpu, c.dst.mem.gpu);
            let si = push_stream(from, to, ng);
            let g = &cuda.gpus[from];
            let src = c.src.mem.ptr_on(from)? + c.src.off;
            let dst = c.dst.mem.ptr_on(from)? + c.dst.off;
            cu::set_current(g.ctx)?;
            if let Some(j) = c.after {
                let Some(e) = arrived.get(j).copied().flatten() else {
                    return Err(CuError {
                        what: "ordering copies".into(),
                        code: 0,
                        name: "COMMD_INTERNAL".into(),
                        text: format!("copy {i} waits for copy {j}, which is not before it"),
                    });
                };
                ck(
                    // SAFETY: the event was recorded above on another stream of this process;
                    // the stream belongs to the current context.
                    unsafe { sys::cuStreamWaitEvent(g.streams[si], e, 0) },
                    "cuStreamWaitEvent",
                )?;
            }
            ck(
                // SAFETY: both spans were bounds-checked against live mappings (valid in the
                // source GPU's context, see `ptr_on`) that the job keeps alive until its events
                // complete; the stream belongs to the source GPU's context.
                unsafe {
                    sys::cuMemcpyAsync(
                        dst,
                        src,
                        commd_proto::num::usize_of(c.src.bytes),
                        g.streams[si],
                    )
                },
                "cuMemcpyAsync",
            )?;
            crate::telemetry::links::gpu_copy(from, to, c.src.bytes);
            if !used.contains(&(from, si)) {
                used.push((from, si));
            }
            if awaited[i] {
                arrived[i] = Some(record(cuda, from, si, &mut events)?);
            }
        }
        for &(from, si) in &used {
            record(cuda, from, si, &mut events)?;
        }
        Ok(())
    })();
    if let Err(e) = r {
        // What was issued must be done before the caller fails the op: wait for every stream
        // used (the events recorded so far may not cover the last copies).
        for &(from, si) in &used {
            let _ = cu::set_current(cuda.gpus[from].ctx);
            // SAFETY: a stream of the GPU's context, now current.
            let _ = unsafe { sys::cuStreamSynchronize(cuda.gpus[from].streams[si]) };
        }
        for (g, ev) in events {
            cuda.recycle(g, ev);
        }
        return Err(e);
    }
    Ok(events)
}

/// Records an event on GPU `from`'s stream `si`, adds it to `events` and returns it.
fn record(
    cuda: &Cuda,
    from: usize,
    si: usize,
    events: &mut Vec<(usize, sys::CUevent)>,
) -> Result<sys::CUevent, CuError> {
    let e = cuda.event(from)?;
    events.push((from, e));
    cu::set_current(cuda.gpus[from].ctx)?;
    ck(
        // SAFETY: event and stream belong to the source GPU's context.
        unsafe { sys::cuEventRecord(e, cuda.gpus[from].streams[si]) },
        "cuEventRecord",
    )?;
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::{Queued, Turn, program_first, turn};

    /// A queued job for the scan's rule: its ranks' (rank, ticket), and the (rank, buffer
    /// range) its copies read and write.
    #[derive(Clone, Default)]
    struct J {
        multi: bool,
        started: bool,
        ready: bool,
        tickets: Vec<(u32, u32)>,
        reads: Vec<(u32, u64, u64)>,
        writes: Vec<(u32, u64, u64)>,
    }

    /// A send/recv job: `from`'s block [`s0`, `s1`) to `to`'s [`r0`, `r1`) (one buffer per
    /// rank), the ranks' tickets `ts` and `tr`.
    fn p2p(from: u32, ts: u32, s: (u64, u64), to: u32, tr: u32, r: (u64, u64)) -> J {
        J {
            tickets: vec![(from, ts), (to, tr)],
            reads: vec![(from, s.0, s.1)],
            writes: vec![(to, r.0, r.1)],
            ..J::default()
        }
    }

    fn ready(mut j: J) -> J {
        j.ready = true;
        j
    }

    impl Queued for J {
        fn simple(&self) -> bool {
            !self.multi
        }
        fn started(&self) -> bool {
            self.started
        }
        fn ready(&self) -> bool {
            self.ready
        }
        fn conflicts(&self, o: &Self) -> bool {
            let hit = |x: &[(u32, u64, u64)], y: &[(u32, u64, u64)]| {
                x.iter()
                    .any(|a| y.iter().any(|b| a.0 == b.0 && a.1 < b.2 && b.1 < a.2))
            };
            self.multi
                || o.multi
                || hit(&self.writes, &o.reads)
                || hit(&self.writes, &o.writes)
                || hit(&o.writes, &self.reads)
        }
        fn first_in_program(&self, o: &Self) -> bool {
            program_first(self.tickets.iter().copied(), o.tickets.iter().copied())
        }
    }

    #[test]
    fn a_ready_job_passes_an_earlier_one_whose_streams_are_behind() {
        // nccl-tests' sendrecv on 4 ranks, matched out of order: rank 1's second send to rank 2
        // (rank 2's stream still waits at its first group's end) before rank 2's first send to
        // rank 3, which that wait needs. Separate buffers: no conflict.
        let q = [
            p2p(1, 3, (0, 8), 2, 4, (100, 108)),
            ready(p2p(2, 1, (0, 8), 3, 2, (100, 108))),
        ];
        assert_eq!(turn(&q, 0), Turn::Step);
        assert_eq!(
            turn(&q, 1),
            Turn::Step,
            "the ready job must not wait behind"
        );
        let mut q = q;
        q[1].ready = false;
        assert_eq!(
            turn(&q, 1),
            Turn::Skip,
            "a job whose streams are behind waits"
        );
    }

    #[test]
    fn program_order_decides_a_conflict_with_an_earlier_job_not_reached() {
        // Hypercube all-gather: rank 0's round-2 send of blocks 0-1 (ticket 3) was matched
        // before rank 1's round-1 send that writes rank 0's block 1 (rank 0's ticket 2).
        let round2 = p2p(0, 3, (0, 16), 2, 3, (0, 16));
        let round1 = ready(p2p(1, 1, (8, 16), 0, 2, (8, 16)));
        let q = [round2.clone(), round1.clone()];
        assert_eq!(turn(&q, 1), Turn::Step);
        // Had the earlier one come first on rank 0, the later one waits for it.
        let mut late = round1.clone();
        late.tickets = vec![(1, 1), (0, 4)];
        assert_eq!(turn(&[round2.clone(), late], 1), Turn::Skip);
        // An earlier job whose streams reached it keeps the queue's order.
        assert_eq!(
            turn(&[ready(round2.clone()), round1.clone()], 1),
            Turn::Skip
        );
        // And one already running is never overtaken by a conflicting job.
        let mut running = round2;
        running.started = true;
        assert_eq!(turn(&[running, round1], 1), Turn::Skip);
    }

    #[test]
    fn the_front_waits_for_a_later_job_that_passed_it() {
        let front = p2p(0, 3, (0, 16), 2, 3, (0, 16));
        let mut passed = p2p(1, 1, (8, 16), 0, 2, (8, 16));
        passed.started = true;
        assert_eq!(turn(&[front.clone(), passed.clone()], 0), Turn::Skip);
        assert_eq!(
            turn(&[front.clone(), passed], 1),
            Turn::Step,
            "the running job polls"
        );
        let apart = ready(p2p(1, 1, (0, 8), 3, 1, (0, 8)));
        let mut apart_running = apart;
        apart_running.started = true;
        assert_eq!(turn(&[front, apart_running], 0), Turn::Step);
    }

    #[test]
    fn nothing_runs_beside_a_multi_phase_job() {
        let coll = J {
            multi: true,
            ready: true,
            tickets: vec![(0, 5), (1, 5)],
            ..J::default()
        };
        let send = ready(p2p(2, 1, (0, 8), 3, 1, (0, 8)));
        assert_eq!(turn(&[coll.clone(), send.clone()], 0), Turn::Step);
        assert_eq!(turn(&[coll.clone(), send.clone()], 1), Turn::Stop);
        assert_eq!(turn(&[send.clone(), coll.clone(), send], 1), Turn::Stop);
    }

    #[test]
    fn program_order_needs_every_shared_rank() {
        assert!(program_first([(0, 1), (1, 7)], [(1, 8), (2, 1)]));
        assert!(!program_first([(0, 1), (1, 9)], [(1, 8)]));
        // Two shared ranks that disagree (an in-place exchange): no order.
        assert!(!program_first([(0, 1), (1, 2)], [(0, 2), (1, 1)]));
        assert!(!program_first([(0, 1)], [(1, 1)]), "no shared rank");
        // Tickets wrap.
        assert!(program_first([(0, u32::MAX)], [(0, 1)]));
    }
}
