//! Eager collectives as direct ops (docs/design-gpu.md, direct collectives rule 8): the same
//! kernel as a captured direct op, launched for an op posted outside any capture, on windows
//! of their own (so eager ops and graph replays never share a protocol instance).
//!
//! A captured op's failure is raised at the communicator's next call; an eager op has a
//! `Request` that must say whether *that* op succeeded. So every eager direct op gets a status
//! word of its own in the windows' record page (`kernels::direct::STATUS_OFF`), zeroed before
//! the launch: the kernel writes its failure code there, and once the event recorded after the
//! op completed, the word is the op's outcome (0: done). Words are reused only after their
//! op's outcome was read ([`StatusPool`]); a communicator's direct ops run in order on the GPU,
//! so when every word is in flight, the oldest op is the first to finish.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::super::kernels::p2p as kp;
use super::config::env_int;
use super::k;
use super::signature::Record;
use super::signature::{explain_code, explain_p2p, explain_p2p_code, op_error_kind};
use crate::{Error, Result, lock};

/// `COMMD_EAGER_DIRECT` (`auto`/`on`/`1`, the default, as measured on GPUs: docs/benchmarks.md
/// row `nccl4-allreduce-8B`; `0`/`off`: every eager op through the
/// daemon; `shared`, tests only: ranks sharing a GPU too) and `COMMD_EAGER_DIRECT_MAX_BYTES`
/// (the largest op, bytes per rank; default `direct::default_max_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EagerConfig {
    pub enabled: bool,
    pub shared_gpus: bool,
    pub max_bytes: Option<u64>,
}

impl EagerConfig {
    pub fn parse(mode: Option<&str>, max: Option<&str>) -> std::result::Result<Self, String> {
        let (enabled, shared_gpus) = match mode.map(str::trim) {
            Some("0") | Some("off") => (false, false),
            None | Some("") | Some("auto") | Some("1") | Some("on") => (true, false),
            Some("shared") => (true, true),
            Some(v) => {
                return Err(format!(
                    "COMMD_EAGER_DIRECT={v:?}: expected auto/on (the default), 0/off, or shared (tests only: also ranks sharing a GPU)"
                ));
            }
        };
        let max_bytes = env_int("COMMD_EAGER_DIRECT_MAX_BYTES", max, 1, 1 << 30)?;
        Ok(Self {
            enabled,
            shared_gpus,
            max_bytes,
        })
    }

    /// The process's setting, read once (every eager GPU op asks); a bad one fails every
    /// eager GPU op with its name rather than guess.
    pub fn cached() -> Result<Self> {
        Self::cached_text().map_err(Error::InvalidArgument)
    }

    /// As [`Self::cached`], the error as its text.
    pub fn cached_text() -> std::result::Result<Self, String> {
        static C: OnceLock<std::result::Result<EagerConfig, String>> = OnceLock::new();
        C.get_or_init(|| {
            Self::parse(
                commd_settings::get(&commd_settings::keys::EAGER_DIRECT).as_deref(),
                commd_settings::get(&commd_settings::keys::EAGER_DIRECT_MAX_BYTES).as_deref(),
            )
        })
        .clone()
    }
}

/// Whether an op's GPU work has finished (the event recorded after it).
pub(crate) trait Completion: Send + Sync {
    fn finished(&self) -> Result<bool>;
}

impl Completion for crate::gpu::CudaEvent {
    fn finished(&self) -> Result<bool> {
        self.query()
    }
}

/// One eager direct op's status word and completion.
pub(crate) struct OpStatus {
    /// Word index + 1 (the kernel's `status`).
    index: u32,
    done: Arc<dyn Completion>,
    /// Its kernel writes [`kp::DONE`] into the word when it succeeded (direct send/recv): a
    /// look at the word, not the event, tells it finished (a failure code still waits for the
    /// event: other blocks of the op may still run).
    signals: bool,
    /// The word's value once read (the op's outcome).
    code: OnceLock<u32>,
}

#[derive(Default)]
struct PoolState {
    free: Vec<u32>,
    /// Ops whose word is in use, oldest first.
    inflight: VecDeque<Arc<OpStatus>>,
}

/// The status words of one set of eager windows, and the failure record before them.
pub(crate) struct StatusPool {
    /// Host address of the record page (the record, then the words at `STATUS_OFF`).
    page: usize,
    st: Mutex<PoolState>,
}

impl StatusPool {
    /// # Safety
    /// `page` is the address of a page (4096 bytes, 8-aligned) that lives as long as the pool.
    pub(crate) unsafe fn new(page: usize) -> Self {
        Self {
            page,
            st: Mutex::new(PoolState {
                free: (1..=k::STATUS_WORDS).rev().collect(),
                inflight: VecDeque::new(),
            }),
        }
    }

    fn word(&self, index: u32) -> &AtomicU32 {
        debug_assert!((1..=k::STATUS_WORDS).contains(&index));
        // SAFETY: `index` is in 1..=STATUS_WORDS, so the word lies in the page (`new`'s
        // contract), which outlives `self`; u32 words are 4-aligned there.
        unsafe {
            &*((self.page + commd_proto::num::usize_of(k::STATUS_OFF)) as *const AtomicU32)
                .add(index as usize - 1)
        }
    }

    /// A zeroed word for the next op (its kernel's `status`). When every word is in flight, waits
    /// for the oldest op to finish (the communicator's direct ops finish in order).
    pub(crate) fn take(&self) -> Result<u32> {
        loop {
            let oldest = {
                let mut g = lock(&self.st);
                if let Some(i) = g.free.pop() {
                    self.word(i).store(0, Ordering::Release);
                    return Ok(i);
                }
                g.inflight.front().cloned()
            };
            let Some(op) = oldest else {
                return Err(Error::InvalidArgument(
                    "no status word free and none in flight (internal error)".into(),
                ));
            };
            self.poll(&op, None)?;
        }
    }

    /// A word taken for an op that was not launched.
    pub(crate) fn give_back(&self, index: u32) {
        lock(&self.st).free.push(index);
    }

    /// The launched op of word `index`, finished once `done` says so.
    pub(crate) fn launched(
        &self,
        index: u32,
        done: Arc<dyn Completion>,
        signals: bool,
    ) -> Arc<OpStatus> {
        let op = Arc::new(OpStatus {
            index,
            done,
            signals,
            code: OnceLock::new(),
        });
        lock(&self.st).inflight.push_back(op.clone());
        op
    }

    /// Reads the word of a finished op (once), frees it, and returns the op's code.
    fn finish(&self, op: &Arc<OpStatus>) -> u32 {
        let mut g = lock(&self.st);
        if let Some(c) = op.code.get() {
            return *c;
        }
        let c = match self.word(op.index).load(Ordering::Acquire) {
            kp::DONE if op.signals => 0,
            c => c,
        };
        let _ = op.code.set(c);
        // Only this op's entry (an entry is removed once, under the lock, with its code set).
        if let Some(p) = g.inflight.iter().position(|x| Arc::ptr_eq(x, op)) {
            g.inflight.remove(p);
        }
        g.free.push(op.index);
        c
    }

    /// The op's code once it finished: `Ok(None)` while it runs after `limit` (forever if
    /// `None`).
    pub(crate) fn poll(&self, op: &Arc<OpStatus>, limit: Option<Duration>) -> Result<Option<u32>> {
        if let Some(c) = op.code.get() {
            return Ok(Some(*c));
        }
        // A send/recv that says it is done costs no driver call (each is one, and the
        // library looks at every op it posted).
        if op.signals && self.word(op.index).load(Ordering::Acquire) == kp::DONE {
            return Ok(Some(self.finish(op)));
        }
        // One query before any clock read: a test (`limit` zero) of a finished op costs only it.
        if op.done.finished()? {
            return Ok(Some(self.finish(op)));
        }
        let t0 = Instant::now();
        let mut nap = Duration::from_micros(20);
        let mut spins = 0u32;
        loop {
            let waited = t0.elapsed();
            if limit.is_some_and(|l| waited >= l) {
                return Ok(None);
            }
            // A small op finishes within microseconds: yield first, then sleep, longer and
            // longer (at most 1 ms), never past `limit`.
            if spins < 200 {
                spins += 1;
                std::thread::yield_now();
            } else {
                let left = limit.map_or(nap, |l| l.saturating_sub(waited));
                std::thread::sleep(nap.min(left));
                nap = (nap * 2).min(Duration::from_millis(1));
            }
            if op.done.finished()? {
                return Ok(Some(self.finish(op)));
            }
        }
    }

    /// The windows' failure record, if the kernel wrote one not yet raised (left for the
    /// communicator's next call, which raises it: `direct_check`).
    fn peek_record(&self) -> Option<Record> {
        super::record::read_record(self.page, false)
    }
}

/// What a [`crate::Request`] of an eager direct op completes from (instead of the daemon's
/// completion queue).
pub(crate) struct LocalDone {
    pub(crate) pool: Arc<StatusPool>,
    pub(crate) op: Arc<OpStatus>,
    /// Ops launched before `op` as parts of the same call (an all-reduce split into direct
    /// ops, `Communicator::split_op`), on the same stream: finished once `op` is, and
    /// a failure of any of them is the call's.
    pub(crate) earlier: Vec<Arc<OpStatus>>,
    pub(crate) comm_id: u64,
    /// The communicator's handle in this session (for the daemon's reason: `direct_error`).
    pub(crate) handle: u32,
    pub(crate) rank: u32,
    pub(crate) what: &'static str,
}

impl LocalDone {
    /// The op's outcome once it finished (`Ok(None)` while it runs after `limit`), as the
    /// request keeps it: `Ok(0)` done, or the error saying why it failed (with the daemon's
    /// reason when the communicator broke, asked of `client` where given).
    pub(crate) fn poll(
        &self,
        limit: Option<Duration>,
        client: Option<&crate::Inner>,
    ) -> Result<Option<std::result::Result<u64, Error>>> {
        let Some(last) = self.pool.poll(&self.op, limit)? else {
            return Ok(None);
        };
        // Every part is read (its word freed); the first failure in launch order is the call's.
        let mut code = 0;
        for op in &self.earlier {
            let c = self.pool.poll(op, None)?.unwrap_or(0);
            if code == 0 {
                code = c;
            }
        }
        if code == 0 {
            code = last;
        }
        if code == 0 {
            return Ok(Some(Ok(0)));
        }
        // The record says more (the peer, the fields that differ) when it is this op's: the
        // first failure of the windows writes it, later ops are POISONED.
        let p2p = self.what == "send" || self.what == "recv";
        let detail = match self.pool.peek_record() {
            Some(r) if p2p && r.code == code => explain_p2p(&r),
            _ if p2p => explain_p2p_code(code),
            Some(r) if r.code == code => super::signature::explain(&r, self.rank, true),
            _ => explain_code(code),
        };
        let how = if p2p {
            "an eager GPU send/recv run as a direct op"
        } else {
            "an eager GPU collective run as a direct op"
        };
        let message = format!(
            "{} on communicator {} ({how}) failed; its results are not valid: {detail}",
            self.what, self.comm_id
        );
        Ok(Some(Err(match client {
            Some(c) => {
                if code == k::ELSEWHERE {
                    // The peer waits on the daemon's path for this op's counterpart: told now
                    // (the record, only peeked here, is read where it lies), if the watchdog
                    // has not told it yet. `direct_check`, which takes it, tells it itself.
                    c.report_direct_failures(None);
                }
                c.direct_error(self.handle, code, message)
            }
            None => Error::Op {
                kind: op_error_kind(code),
                message,
            },
        })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;

    struct Fake(AtomicBool);
    impl Completion for Fake {
        fn finished(&self) -> Result<bool> {
            Ok(self.0.load(Ordering::Acquire))
        }
    }

    fn page() -> usize {
        let p: &'static mut [u64; 512] = Box::leak(Box::new([0u64; 512]));
        p.as_mut_ptr() as usize
    }

    #[test]
    fn config_is_on_by_default_and_refuses_bad_values() {
        assert_eq!(
            EagerConfig::parse(None, None).unwrap(),
            EagerConfig {
                enabled: true,
                shared_gpus: false,
                max_bytes: None
            }
        );
        let on = EagerConfig::parse(Some("auto"), Some("65536")).unwrap();
        assert!(on.enabled && !on.shared_gpus && on.max_bytes == Some(65536));
        let sh = EagerConfig::parse(Some("shared"), None).unwrap();
        assert!(sh.enabled && sh.shared_gpus);
        assert!(!EagerConfig::parse(Some("off"), None).unwrap().enabled);
        assert!(!EagerConfig::parse(Some("0"), None).unwrap().enabled);
        assert!(EagerConfig::parse(Some(""), None).unwrap().enabled);
        for (m, x) in [
            (Some("yes"), None),
            (None, Some("0")),
            (None, Some("-5")),
            (None, Some("2147483648")),
        ] {
            let e = EagerConfig::parse(m, x).unwrap_err();
            assert!(e.contains("COMMD_EAGER_DIRECT"), "{e}");
        }
    }

    #[test]
    fn a_word_is_reused_only_after_its_op_was_read() {
        // SAFETY: a leaked, zeroed, 8-aligned page.
        let pool = unsafe { StatusPool::new(page()) };
        let f1 = Arc::new(Fake(AtomicBool::new(false)));
        let i1 = pool.take().unwrap();
        let op1 = pool.launched(i1, f1.clone(), false);
        // The kernel fails the op: its word holds the code, but the op has not finished yet.
        pool.word(i1).store(k::MISMATCH, Ordering::Release);
        assert_eq!(pool.poll(&op1, Some(Duration::ZERO)).unwrap(), None);
        // Every other word, taken and launched.
        let mut ops = Vec::new();
        for _ in 1..k::STATUS_WORDS {
            let i = pool.take().unwrap();
            assert_ne!(i, i1);
            ops.push(pool.launched(i, Arc::new(Fake(AtomicBool::new(true))), false));
        }
        // All in flight: the next take waits for the oldest (op1) and reads it first, so its
        // failure is kept, not wiped by the word's next user.
        f1.0.store(true, Ordering::Release);
        let again = pool.take().unwrap();
        assert_eq!(again, i1);
        assert_eq!(pool.word(i1).load(Ordering::Acquire), 0, "zeroed for reuse");
        assert_eq!(pool.poll(&op1, None).unwrap(), Some(k::MISMATCH));
        // A finished op read twice gives the same code; a succeeded op gives 0.
        assert_eq!(pool.poll(&ops[0], None).unwrap(), Some(0));
        assert_eq!(pool.poll(&ops[0], None).unwrap(), Some(0));
        pool.give_back(again);
        let g = lock(&pool.st);
        assert_eq!(g.inflight.len(), ops.len() - 1);
        assert_eq!(g.free.len(), 2);
    }

    #[test]
    fn a_send_recv_that_says_done_finishes_without_its_event_but_a_failure_waits() {
        // SAFETY: as above.
        let pool = unsafe { StatusPool::new(page()) };
        let ev = Arc::new(Fake(AtomicBool::new(false)));
        let i = pool.take().unwrap();
        let op = pool.launched(i, ev.clone(), true);
        assert_eq!(pool.poll(&op, Some(Duration::ZERO)).unwrap(), None);
        pool.word(i).store(kp::DONE, Ordering::Release);
        // Done, with the event not yet seen complete: success, the word free again.
        assert_eq!(pool.poll(&op, Some(Duration::ZERO)).unwrap(), Some(0));
        assert!(lock(&pool.st).free.contains(&i));
        // A failure code: the op's other blocks may still run, so its event decides.
        let j = pool.take().unwrap();
        let op = pool.launched(j, ev.clone(), true);
        pool.word(j).store(k::TIMEOUT, Ordering::Release);
        assert_eq!(pool.poll(&op, Some(Duration::ZERO)).unwrap(), None);
        ev.0.store(true, Ordering::Release);
        assert_eq!(
            pool.poll(&op, Some(Duration::ZERO)).unwrap(),
            Some(k::TIMEOUT)
        );
        // An op that does not signal (a collective): DONE is not its word's to have, and only
        // its event says it finished.
        let ev2 = Arc::new(Fake(AtomicBool::new(false)));
        let q = pool.take().unwrap();
        let op = pool.launched(q, ev2.clone(), false);
        pool.word(q).store(kp::DONE, Ordering::Release);
        assert_eq!(pool.poll(&op, Some(Duration::ZERO)).unwrap(), None);
    }

    #[test]
    fn a_running_op_times_out_its_poll_but_not_its_word() {
        // SAFETY: as above.
        let pool = unsafe { StatusPool::new(page()) };
        let f = Arc::new(Fake(AtomicBool::new(false)));
        let i = pool.take().unwrap();
        let op = pool.launched(i, f.clone(), false);
        let t0 = Instant::now();
        assert_eq!(
            pool.poll(&op, Some(Duration::from_millis(30))).unwrap(),
            None
        );
        assert!(t0.elapsed() >= Duration::from_millis(30));
        assert!(!lock(&pool.st).free.contains(&i));
        f.0.store(true, Ordering::Release);
        assert_eq!(pool.poll(&op, Some(Duration::ZERO)).unwrap(), Some(0));
        assert!(lock(&pool.st).free.contains(&i));
    }

    #[test]
    fn a_split_call_fails_with_its_first_failed_part_and_frees_every_word() {
        // SAFETY: as above.
        let pool = Arc::new(unsafe { StatusPool::new(page()) });
        let done = Arc::new(Fake(AtomicBool::new(true)));
        let launch = |code: u32| {
            let i = pool.take().unwrap();
            pool.word(i).store(code, Ordering::Release);
            pool.launched(i, done.clone(), false)
        };
        let call = |earlier: Vec<Arc<OpStatus>>, last: Arc<OpStatus>| LocalDone {
            pool: pool.clone(),
            op: last,
            earlier,
            comm_id: 7,
            handle: 0,
            rank: 0,
            what: "all_reduce",
        };
        // A reduce-scatter part that failed as a mismatch, then an all-gather part that
        // succeeded (the peers' later parts can pair by chance): the call fails, and says so.
        let c = call(vec![launch(k::MISMATCH)], launch(0));
        let e = c.poll(None, None).unwrap().unwrap().unwrap_err();
        assert!(e.to_string().contains("mismatch"), "{e}");
        assert!(
            e.to_string().contains("all_reduce on communicator 7"),
            "{e}"
        );
        // Two failed parts: the first in launch order is the call's.
        let c = call(vec![launch(0), launch(k::TIMEOUT)], launch(k::POISONED));
        let e = c.poll(None, None).unwrap().unwrap().unwrap_err();
        assert!(e.to_string().contains("within the op timeout"), "{e}");
        // Every part succeeded: so does the call.
        let c = call(vec![launch(0), launch(0)], launch(0));
        assert_eq!(c.poll(None, None).unwrap().unwrap().unwrap(), 0);
        // Every word read and free again.
        let g = lock(&pool.st);
        assert!(g.inflight.is_empty());
        assert_eq!(g.free.len(), k::STATUS_WORDS as usize);
    }
}
