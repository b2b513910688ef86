//! Conversions of Python arguments to the client's types: timeouts, pacing caps, and the names
//! of ops, dtypes and reductions. Each refuses a bad value with a `ValueError` that names it.

use std::time::Duration;

use commd_client::desc::{DType, OpKind, RedOp};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// Seconds (None: no limit) to a Duration, refusing negative and non-finite values.
pub(crate) fn duration(secs: Option<f64>, what: &str) -> PyResult<Option<Duration>> {
    match secs {
        None => Ok(None),
        Some(s) if s.is_finite() && s >= 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of seconds, got {s}"
        ))),
    }
}

/// A GPU pacing cap in GB/s (1e9 bytes/s) as bytes/s: `None` stays `None`, 0 means uncapped;
/// negative, non-finite and nonzero values below the daemon's minimum (1 MB/s) are refused here
/// (the daemon checks the minimum too, for every client).
pub(crate) fn pacing(gbps: Option<f64>, what: &str) -> PyResult<Option<u64>> {
    let min = commd_client::MIN_PACING_BYTES_PER_SEC;
    match gbps {
        None => Ok(None),
        Some(g) if !g.is_finite() || g < 0.0 => Err(PyValueError::new_err(format!(
            "{what} must be a non-negative number of GB/s (0 or None: uncapped), got {g}"
        ))),
        Some(g) => {
            // `as` saturates: absurdly large caps become u64::MAX bytes/s, i.e. no limit in
            // effect; `g` is finite and non-negative here, so no sign is lost.
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let b = (g * 1e9).round() as u64;
            if b > 0 && b < min {
                return Err(PyValueError::new_err(format!(
                    "{what}={g} GB/s is below the minimum of {} GB/s (1 MB/s); the cap is in GB/s, and 0 or None means uncapped",
                    min as f64 / 1e9
                )));
            }
            Ok(Some(b))
        }
    }
}

pub(crate) fn parse_kind(s: &str) -> PyResult<OpKind> {
    OpKind::parse(s).ok_or_else(|| PyValueError::new_err(format!("unknown op {s:?}")))
}

pub(crate) fn parse_dtype(s: &str) -> PyResult<DType> {
    DType::parse(s).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unsupported dtype {s:?} (commd reduces f32, f64, f16, bf16, i8, u8, i32, i64, u32, u64, f8e4m3, f8e5m2)"
        ))
    })
}

pub(crate) fn parse_redop(s: &str) -> PyResult<RedOp> {
    RedOp::parse(s).ok_or_else(|| PyValueError::new_err(format!("unknown reduction {s:?}")))
}
