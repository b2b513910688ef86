//! What commd's two C ABIs share (`client-cpp`'s `commd.h` and `nccl`'s `libnccl.so.2`): each
//! entry point runs its body under [`guard`], which turns a failure into the ABI's status code
//! and this thread's last-error text, and a panic into the ABI's internal-error code, so that
//! nothing unwinds into C. Each ABI keeps its own status type and wording; this crate holds the
//! mechanism only and depends on nothing.

#![forbid(unsafe_code)]

use std::cell::RefCell;
use std::ffi::{CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Sets this thread's last-error text (a NUL inside is written as `\0`).
pub fn set_last_error(message: &str) {
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    // try_with: during thread teardown (e.g. a C++ thread_local destructor calling commd) the
    // slot may be gone; the status code still reports the failure.
    let _ = LAST_ERROR.try_with(|l| *l.borrow_mut() = c);
}

/// This thread's last-error text, as a pointer valid until the next failing call on this
/// thread ("" when none failed or the thread is being torn down).
pub fn last_error_ptr() -> *const c_char {
    LAST_ERROR
        .try_with(|l| l.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

/// This thread's last-error text, copied.
pub fn last_error() -> String {
    LAST_ERROR
        .try_with(|l| l.borrow().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The text of a panic's payload.
pub fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "(no message)".to_string()
    }
}

/// Runs the body of the entry point `func`. `Ok(s)` is returned as is; `Err((s, message))`
/// returns `s` with the last-error text "`func`: `message`" (also given to `report`, e.g. a
/// WARN log line); a panic returns `internal`, with a last-error text that names it a bug.
pub fn guard<S>(
    func: &str,
    internal: S,
    report: impl Fn(&str),
    body: impl FnOnce() -> Result<S, (S, String)>,
) -> S {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(s)) => s,
        Ok(Err((s, message))) => {
            let text = format!("{func}: {message}");
            report(&text);
            set_last_error(&text);
            s
        }
        Err(p) => {
            let text = format!(
                "{func}: internal error (a bug in commd, please report it): panic: {}",
                panic_text(p.as_ref())
            );
            report(&text);
            set_last_error(&text);
            internal
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_returns_its_status_and_sets_the_text() {
        let seen = RefCell::new(String::new());
        let s = guard(
            "f",
            99,
            |t| *seen.borrow_mut() = t.into(),
            || Err((3, "bad\0arg".into())),
        );
        assert_eq!(s, 3);
        assert_eq!(last_error(), "f: bad\\0arg");
        assert_eq!(
            *seen.borrow(),
            "f: bad\0arg",
            "the report gets the text as made"
        );
        assert_eq!(guard("g", 99, |_| {}, || Ok(0)), 0);
        assert_eq!(
            last_error(),
            "f: bad\\0arg",
            "a success leaves the last failure's text"
        );
    }

    #[test]
    fn a_panic_is_the_internal_status_and_says_so() {
        let s = guard(
            "h",
            99,
            |_| {},
            || -> Result<i32, (i32, String)> { panic!("boom {}", 1) },
        );
        assert_eq!(s, 99);
        let t = last_error();
        assert!(
            t.starts_with("h: internal error") && t.ends_with("panic: boom 1"),
            "{t}"
        );
    }
}
