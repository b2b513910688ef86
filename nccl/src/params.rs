//! NCCL 2.32's parameter API (`ncclParamBind`, `ncclParamGet*`, `ncclParamGetParameter`,
//! `ncclParamGetAllParameterKeys`, `ncclParamDumpAll`) over commd's settings registry
//! (`commd_settings`): the parameters are the settings this process's commd code reads (the
//! `COMMD_*` client settings and the `NCCL_*` variables this library honours), each with its
//! effective value (the environment's, else the registry's default). A key names a setting
//! (`COMMD_CLIENT_SPIN_US`), or one of the `NCCL_*` ones without the prefix (`DEBUG`); any other
//! key, NCCL's own tuning variables included, is `ncclInvalidArgument`: commd does not read it.
//! Returned strings live until the next call of the same function on the same thread, as NCCL's.

#![allow(unsafe_code)] // the C ABI: out pointers and C strings from C callers

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

use commd_settings::{KEYS, Key};

use crate::ffi::{Outcome, guard, invalid, ncclResult_t, put};
use crate::ok;

/// The opaque handle C code holds: the address of the setting's registry entry.
type Handle = *const c_void;

fn find(key: *const c_char) -> Outcome<&'static Key> {
    if key.is_null() {
        return Err(invalid("key is NULL"));
    }
    // SAFETY: NCCL's contract: a C string.
    let k = unsafe { CStr::from_ptr(key) }.to_string_lossy();
    let k = k.trim();
    commd_settings::key(k)
        .or_else(|| commd_settings::key(&format!("NCCL_{k}")))
        .ok_or_else(|| {
            invalid(format!(
                "no parameter {k:?}: commd's parameters are its settings (`commd config --client` \
                 lists them); NCCL's own tuning variables are not read by commd"
            ))
        })
}

fn of_handle(h: Handle) -> Outcome<&'static Key> {
    KEYS.iter()
        .copied()
        .find(|k| std::ptr::eq(*k as *const Key as *const c_void, h))
        .ok_or_else(|| invalid("not a parameter handle from ncclParamBind"))
}

/// A setting's effective value as text ("" when unset and without a default).
fn value(k: &'static Key) -> String {
    commd_settings::effective(k).0.unwrap_or_default()
}

fn integer<T: TryFrom<i128>>(k: &'static Key) -> Outcome<T> {
    let v = value(k);
    let t = v.trim();
    let n: Option<i128> = match t {
        "" => None,
        _ => t.parse().ok(),
    };
    let what = std::any::type_name::<T>();
    n.and_then(|n| T::try_from(n).ok()).ok_or_else(|| {
        invalid(format!(
            "parameter {} is {v:?}, which is not a value of {what}",
            k.name
        ))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclParamBind(out: *mut Handle, key: *const c_char) -> ncclResult_t {
    guard("ncclParamBind", || {
        let k = find(key)?;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(out, k as *const Key as Handle, "out") }?;
        ok()
    })
}

macro_rules! integer_getters {
    ($($name:ident: $t:ty;)*) => {
        $(
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name(h: Handle, out: *mut $t) -> ncclResult_t {
                guard(stringify!($name), || {
                    let v: $t = integer(of_handle(h)?)?;
                    // SAFETY: NCCL's contract on the out pointer.
                    unsafe { put(out, v, "out") }?;
                    ok()
                })
            }
        )*
    };
}

integer_getters! {
    ncclParamGetI8: i8;
    ncclParamGetI16: i16;
    ncclParamGetI32: i32;
    ncclParamGetI64: i64;
    ncclParamGetU8: u8;
    ncclParamGetU16: u16;
    ncclParamGetU32: u32;
    ncclParamGetU64: u64;
}

thread_local! {
    static STR: RefCell<CString> = RefCell::new(CString::default());
    static PARAM: RefCell<CString> = RefCell::new(CString::default());
}

/// Keeps `v` in `slot` (this thread's) and returns its address, valid until the next call that
/// uses the same slot.
fn keep(slot: &'static std::thread::LocalKey<RefCell<CString>>, v: String) -> *const c_char {
    let c = CString::new(v.replace('\0', "\\0")).unwrap_or_default();
    slot.with(|s| {
        *s.borrow_mut() = c;
        s.borrow().as_ptr()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclParamGetStr(h: Handle, out: *mut *const c_char) -> ncclResult_t {
    guard("ncclParamGetStr", || {
        let p = keep(&STR, value(of_handle(h)?));
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(out, p, "out") }?;
        ok()
    })
}

/// The value's bytes (its text, without a terminating NUL) into `out`, their count in `len`;
/// a buffer too small for them is `ncclInvalidArgument` (with `len` set to the size needed).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclParamGet(
    h: Handle,
    out: *mut c_void,
    max_len: c_int,
    len: *mut c_int,
) -> ncclResult_t {
    guard("ncclParamGet", || {
        let v = value(of_handle(h)?);
        let n = c_int::try_from(v.len()).map_err(|_| invalid("value too long"))?;
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(len, n, "len") }?;
        if n > max_len {
            return Err(invalid(format!(
                "the value takes {n} bytes; maxLen is {max_len}"
            )));
        }
        if n > 0 {
            if out.is_null() {
                return Err(invalid("out is NULL"));
            }
            // SAFETY: the caller's buffer holds max_len >= n bytes (NCCL's contract).
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), out.cast::<u8>(), v.len()) };
        }
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclParamGetParameter(
    key: *const c_char,
    out: *mut *const c_char,
    len: *mut c_int,
) -> ncclResult_t {
    guard("ncclParamGetParameter", || {
        let v = value(find(key)?);
        let n = c_int::try_from(v.len()).map_err(|_| invalid("value too long"))?;
        let p = keep(&PARAM, v);
        // SAFETY: NCCL's contract on the out pointers (len may be NULL).
        unsafe { put(out, p, "value") }?;
        if !len.is_null() {
            // SAFETY: as above.
            unsafe { put(len, n, "valueLen") }?;
        }
        ok()
    })
}

/// Every parameter's name, NUL-terminated, with a table of pointers to them (for the process's
/// life: the registry does not change).
fn names() -> &'static (Vec<CString>, Vec<usize>) {
    static NAMES: OnceLock<(Vec<CString>, Vec<usize>)> = OnceLock::new();
    NAMES.get_or_init(|| {
        let names: Vec<CString> = KEYS
            .iter()
            .filter_map(|k| CString::new(k.name).ok())
            .collect();
        let ptrs = names.iter().map(|c| c.as_ptr() as usize).collect();
        (names, ptrs)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclParamGetAllParameterKeys(
    table: *mut *const *const c_char,
    len: *mut c_int,
) -> ncclResult_t {
    guard("ncclParamGetAllParameterKeys", || {
        let (_, ptrs) = names();
        let n = c_int::try_from(ptrs.len()).map_err(|_| invalid("too many parameters"))?;
        // SAFETY: NCCL's contract on the out pointers; the table lives for the process.
        unsafe { put(table, ptrs.as_ptr().cast::<*const c_char>(), "table") }?;
        // SAFETY: as above.
        unsafe { put(len, n, "tableLen") }?;
        ok()
    })
}

/// Every parameter with its value, one INFO line each (subsystem ENV), as NCCL dumps to its log.
#[unsafe(no_mangle)]
pub extern "C" fn ncclParamDumpAll() {
    for &k in KEYS {
        let (v, src, _) = commd_settings::effective(k);
        crate::log::info(crate::log::ENV, -1, || {
            let src = match src {
                commd_settings::Source::Env => "env",
                commd_settings::Source::Default => "default",
            };
            format!("{}={} ({src})", k.name, v.unwrap_or_default())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_read_and_refuse() {
        let mut h: Handle = std::ptr::null();
        // SAFETY: valid out pointer and C strings.
        let r = unsafe { ncclParamBind(&mut h, c"COMMD_CLIENT_SPIN_US".as_ptr()) };
        assert_eq!(r, 0);
        let mut v = 0u64;
        // SAFETY: a handle from ncclParamBind, valid out pointer.
        assert_eq!(unsafe { ncclParamGetU64(h, &mut v) }, 0);
        let want: u64 = value(of_handle(h).unwrap()).trim().parse().unwrap();
        assert_eq!(v, want);
        let mut small = 0i8;
        if want > 127 {
            // SAFETY: as above.
            assert_eq!(unsafe { ncclParamGetI8(h, &mut small) }, 4);
        }
        // SAFETY: valid out pointers and C strings.
        assert_eq!(unsafe { ncclParamBind(&mut h, c"DEBUG".as_ptr()) }, 0);
        assert_eq!(of_handle(h).unwrap().name, "NCCL_DEBUG");
        // SAFETY: as above.
        let r = unsafe { ncclParamBind(&mut h, c"NCCL_P2P_LEVEL".as_ptr()) };
        assert_eq!(r, 4);
        // SAFETY: a made-up handle is refused, not read.
        assert_eq!(unsafe { ncclParamGetU64(8 as Handle, &mut v) }, 4);
        let (mut t, mut n): (*const *const c_char, c_int) = (std::ptr::null(), 0);
        // SAFETY: valid out pointers.
        assert_eq!(unsafe { ncclParamGetAllParameterKeys(&mut t, &mut n) }, 0);
        assert_eq!(usize::try_from(n).unwrap(), KEYS.len());
        // SAFETY: the table holds n C strings.
        let first = unsafe { CStr::from_ptr(*t) }.to_str().unwrap();
        assert_eq!(first, KEYS[0].name);
    }
}
