//! commd-c: the C ABI over `commd-client` (header `include/commd.h`, generated from this crate by
//! cbindgen in build.rs), used directly from C and by the header-only C++ wrapper
//! `include/commd.hpp`.
//!
//! Owns: opaque handles (session, communicator, buffer, request) that box the Rust client's
//! objects, status codes with a thread-local last-error message, and argument checks at the
//! boundary. Must not: let a panic unwind into C (every entry point runs in [`error::ffi`]),
//! dereference a NULL handle, or hold a borrow of a buffer past the call that posts an op (the
//! C caller owns the ownership rule; see the header).

#![deny(unsafe_code)] // allowed only in the modules that say why

// Declaration order is the header's order (cbindgen follows it): types, sessions, ops.
mod types;

mod session;

mod ops;

mod error;

use std::os::raw::{c_char, c_int};

pub use ops::*;
pub use session::*;
pub use types::*;

use error::{Outcome, invalid};

/// The library's version ("MAJOR.MINOR.PATCH"); compare with COMMD_VERSION from the header.
#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn commd_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}

/// The message of the last failed commd call on this thread ("" if none failed yet). The
/// pointer stays valid until the next failing commd call on this thread; copy it to keep it.
#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn commd_last_error() -> *const c_char {
    error::last_error_ptr()
}

/// The name of a status code ("COMMD_MISMATCH"), a static string; "COMMD_UNKNOWN_STATUS" for
/// a value that is not a commd_status_t.
#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn commd_status_name(status: c_int) -> *const c_char {
    // An int, not commd_status_t: a C caller may pass any value, and only known codes may
    // become the Rust enum.
    let name = commd_status_t::ALL
        .iter()
        .find(|s| **s as c_int == status)
        .map_or("COMMD_UNKNOWN_STATUS\0", |s| s.name_nul());
    name.as_ptr().cast()
}

/// The size in bytes of one element of `dtype`, or 0 for an unknown code.
#[unsafe(no_mangle)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub extern "C" fn commd_dtype_size(dtype: commd_dtype_t) -> usize {
    u8::try_from(dtype)
        .ok()
        .and_then(commd_proto::desc::DType::from_code)
        .map_or(0, |d| commd_proto::num::usize_of(d.size()))
}

/// Borrows the object behind a C handle.
///
/// # Safety
/// `p` is NULL or points to a live `T` that outlives `'a`.
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub(crate) unsafe fn handle<'a, T>(p: *const T, what: &str) -> Outcome<&'a T> {
    // SAFETY: per this function's contract.
    unsafe { p.as_ref() }.ok_or_else(|| invalid(format!("{what} is NULL")))
}

/// Writes `v` through the out-pointer `p`.
///
/// # Safety
/// `p` is NULL or writable.
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
pub(crate) unsafe fn set_out<T>(p: *mut T, v: T, what: &str) -> Outcome {
    if p.is_null() {
        return Err(invalid(format!("{what} is NULL")));
    }
    // SAFETY: non-NULL and writable per this function's contract.
    unsafe { p.write(v) };
    Ok(())
}

#[cfg(test)]
#[allow(unsafe_code)] // the C ABI: raw pointers from C callers
mod tests {
    /// The committed header must be what cbindgen generates from this crate (build.rs).
    #[test]
    fn header_is_current() {
        let generated = include_str!(concat!(env!("OUT_DIR"), "/commd.h"));
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/include/commd.h");
        if commd_settings::get_os(&commd_settings::keys::BLESS_HEADER).is_some() {
            std::fs::write(path, generated).expect("write include/commd.h");
            return;
        }
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == generated,
            "client-cpp/include/commd.h differs from the header cbindgen generates from \
             client-cpp/src (a C API change without regenerating it?). Regenerate it with\n    \
             COMMD_BLESS_HEADER=1 cargo test --release -p commd-c --lib header_is_current\n\
             and commit include/commd.h."
        );
    }

    #[test]
    fn version_and_status_names() {
        use super::*;
        use std::ffi::CStr;
        // SAFETY: both functions return static NUL-terminated strings.
        let (v, m, u) = unsafe {
            (
                CStr::from_ptr(commd_version()),
                CStr::from_ptr(commd_status_name(commd_status_t::COMMD_MISMATCH as c_int)),
                CStr::from_ptr(commd_status_name(99)),
            )
        };
        assert_eq!(v.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
        assert_eq!(m.to_str().unwrap(), "COMMD_MISMATCH");
        assert_eq!(u.to_str().unwrap(), "COMMD_UNKNOWN_STATUS");
        assert_eq!(commd_dtype_size(COMMD_BFLOAT16), 2);
        assert_eq!(commd_dtype_size(COMMD_INT64), 8);
        assert_eq!(commd_dtype_size(0), 0);
        assert_eq!(commd_dtype_size(1 << 20), 0);
    }
}
