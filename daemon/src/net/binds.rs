//! Incoming streams waiting for their communicator. A peer opens its streams to this node (TCP
//! connections, `conn`; RDMA queue pairs, `rdma`) with the communicator's token, its node and
//! each stream's index, possibly before that communicator has formed here: each stream waits
//! here until the communicator takes it, at most a minute, and at most a bounded number wait at
//! once (a peer that never forms its communicator cannot pile them up).

use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// (communicator token, the peer's node, the stream's index).
pub type BindKey = ([u8; 16], String, u32);

/// How long an unclaimed stream waits for its communicator before it is dropped.
const UNCLAIMED_TTL: Duration = Duration::from_secs(60);

/// Streams of one kind (`S`) waiting for their communicators.
pub struct Binds<S> {
    waiting: Mutex<HashMap<BindKey, (S, Instant)>>,
    cv: Condvar,
    /// What a stream is called in logs ("data connection", "RDMA stream").
    what: &'static str,
    /// The most that may wait at once.
    max: usize,
}

impl<S> std::fmt::Debug for Binds<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Binds")
            .field("what", &self.what)
            .field("waiting", &lock(&self.waiting).len())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<S> Binds<S> {
    pub fn new(what: &'static str, max: usize) -> Self {
        Self {
            waiting: Mutex::new(HashMap::new()),
            cv: Condvar::new(),
            what,
            max,
        }
    }

    /// Keeps `s` for its communicator, after dropping the streams that waited past their time
    /// (each logged); `Err` gives `s` back when the most that may wait already do.
    pub fn offer(&self, key: BindKey, s: S) -> Result<(), S> {
        let mut m = lock(&self.waiting);
        let now = Instant::now();
        let what = self.what;
        m.retain(|k, (_, t)| {
            let keep = now.duration_since(*t) < UNCLAIMED_TTL;
            if !keep {
                crate::telemetry::ratelimit::warn_limited!(target: "commd::net", "{what} from node {} dropped: no communicator with its token formed here", k.1);
            }
            keep
        });
        if m.len() >= self.max {
            return Err(s);
        }
        m.insert(key, (s, now));
        self.cv.notify_all();
        Ok(())
    }

    /// Takes the `n` streams (indexes 0 to n - 1) of `node` for the communicator `token`,
    /// waiting until `deadline` for the missing ones; `Err` is the count that came in time.
    pub fn take(
        &self,
        token: &[u8; 16],
        node: &str,
        n: usize,
        deadline: Instant,
    ) -> Result<Vec<S>, usize> {
        let mut out: Vec<Option<S>> = (0..n).map(|_| None).collect();
        let mut m = lock(&self.waiting);
        loop {
            for (i, slot) in out.iter_mut().enumerate() {
                if slot.is_none() {
                    *slot = m
                        .remove(&(
                            *token,
                            node.to_string(),
                            u32::try_from(i).expect("n is a tcp_streams count (at most 16)"),
                        ))
                        .map(|(s, _)| s);
                }
            }
            if out.iter().all(Option::is_some) {
                return Ok(out.into_iter().flatten().collect());
            }
            let now = Instant::now();
            if now >= deadline {
                // The streams that came stay taken (dropped): the communicator fails as a whole.
                return Err(out.iter().filter(|s| s.is_some()).count());
            }
            m = self
                .cv
                .wait_timeout(m, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_wait_for_their_communicator_and_a_late_one_is_counted() {
        let b: Binds<u32> = Binds::new("test stream", 2);
        let t = [7u8; 16];
        b.offer((t, "n1".into(), 1), 11).unwrap();
        b.offer((t, "n1".into(), 0), 10).unwrap();
        assert_eq!(b.offer((t, "n1".into(), 2), 12), Err(12), "the cap holds");
        let soon = Instant::now() + Duration::from_millis(50);
        assert_eq!(b.take(&t, "n1", 2, soon), Ok(vec![10, 11]));
        b.offer((t, "n2".into(), 0), 20).unwrap();
        let soon = Instant::now() + Duration::from_millis(50);
        assert_eq!(
            b.take(&t, "n2", 2, soon),
            Err(1),
            "stream 1 of n2 never came"
        );
    }

    #[test]
    fn a_stream_offered_while_waiting_wakes_the_taker() {
        let b = std::sync::Arc::new(Binds::<u32>::new("test stream", 8));
        let t = [1u8; 16];
        let b2 = b.clone();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            b2.offer((t, "n".into(), 0), 5).unwrap();
        });
        let got = b.take(&t, "n", 1, Instant::now() + Duration::from_secs(10));
        h.join().unwrap();
        assert_eq!(got, Ok(vec![5]));
    }
}
