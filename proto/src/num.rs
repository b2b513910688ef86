//! Integer conversions that are lossless on the targets commd supports.
//!
//! commd runs only on 64-bit hosts (the daemon maps GPU-sized buffers and shares 64-bit offsets
//! with its clients), so a `u64` holding an in-process size, offset or index always fits a
//! `usize`. [`usize_of`] says so in one place, instead of an `as usize` at every use; a value
//! that comes from outside the process and may be out of range is still converted with
//! `try_from` and refused with an error where it enters.

#[cfg(not(target_pointer_width = "64"))]
compile_error!("commd supports 64-bit targets only");

/// `x` as a `usize`: exact, since `usize` is 64 bits wide on every target this crate builds for
/// (the `compile_error!` above refuses the others).
#[inline]
#[must_use]
// Lossless: target_pointer_width = "64" (checked above at compile time).
#[allow(clippy::cast_possible_truncation)]
pub const fn usize_of(x: u64) -> usize {
    x as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usize_of_is_exact() {
        for x in [0, 1, u64::from(u32::MAX) + 1, u64::MAX] {
            assert_eq!(u64::try_from(usize_of(x)).unwrap(), x);
        }
    }
}
