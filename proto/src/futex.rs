//! Cross-process futex wait/wake on words in shared memory (non-private futexes, keyed by the
//! backing page, so they work between the daemon and a client mapping the same memfd).

use std::sync::atomic::AtomicU32;
use std::time::Duration;

use rustix::thread::futex;

/// Sleeps while `*word == expected`, at most `timeout`. Spurious wake-ups are allowed: callers
/// re-check their condition in a loop.
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = rustix::time::Timespec {
        // A timeout past i64::MAX seconds is forever all the same.
        tv_sec: i64::try_from(timeout.as_secs()).unwrap_or(i64::MAX),
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // EAGAIN (value changed), EINTR and ETIMEDOUT are all "go and look again".
    let _ = futex::wait(word, futex::Flags::empty(), expected, Some(&ts));
}

/// Wakes every waiter on `word`.
pub fn wake_all(word: &AtomicU32) {
    let _ = futex::wake(word, futex::Flags::empty(), i32::MAX as u32);
}
