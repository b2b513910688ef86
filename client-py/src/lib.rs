//! `commd._native`: the Python bindings over `commd-client`.
//!
//! This layer is deliberately thin: sessions, communicators, shared-memory buffers (exposed
//! through the buffer protocol, so numpy and torch view them without a copy), op posting and
//! requests. Staging of arbitrary arrays, the numpy-level API and the torch backend live in the
//! Python package (`python/commd`). Every blocking call releases the GIL and wakes up every
//! 100 ms to deliver signals (Ctrl-C interrupts a wait; the op itself keeps running).

#![deny(unsafe_code)] // allowed only in the modules that say why

mod buffer;
mod client;
mod communicator;
mod convert;
mod error;
mod hostmem;
mod request;

use pyo3::prelude::*;

use buffer::Buffer;
use client::Client;
use communicator::Communicator;
use error::{
    AbortedError, CommError, CommTimeoutError, DaemonLostError, DaemonUnavailableError,
    InvalidOpError, MismatchError, PeerLostError, RevokedError, ShutdownError, UnsupportedError,
};
use hostmem::{host_allocator, host_blocks, host_blocks_release, numpy_mem_handler};
use request::{CudaRequest, Request};

/// The names of every environment setting in commd's registry (`commd-settings`): the only
/// `COMMD_*` names the Python package reads (`commd._settings`).
#[pyfunction]
fn setting_names() -> Vec<&'static str> {
    commd_settings::KEYS.iter().map(|k| k.name).collect()
}

/// Version of the bindings (same as the daemon's protocol version string).
#[pyfunction]
fn version() -> &'static str {
    commd_proto::VERSION
}

/// The socket path a client would use now (`$COMMD_SOCKET`, else the per-user default).
#[pyfunction]
fn default_socket() -> String {
    commd_client::resolve_socket_path().display().to_string()
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Client>()?;
    m.add_class::<Buffer>()?;
    m.add_class::<Communicator>()?;
    m.add_class::<Request>()?;
    m.add_class::<CudaRequest>()?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(setting_names, m)?)?;
    m.add_function(wrap_pyfunction!(host_allocator, m)?)?;
    m.add_function(wrap_pyfunction!(host_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(host_blocks_release, m)?)?;
    m.add_function(wrap_pyfunction!(numpy_mem_handler, m)?)?;
    m.add_function(wrap_pyfunction!(default_socket, m)?)?;
    m.add("CommError", py.get_type::<CommError>())?;
    m.add(
        "DaemonUnavailableError",
        py.get_type::<DaemonUnavailableError>(),
    )?;
    m.add("DaemonLostError", py.get_type::<DaemonLostError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add("PeerLostError", py.get_type::<PeerLostError>())?;
    m.add("CommTimeoutError", py.get_type::<CommTimeoutError>())?;
    m.add("ShutdownError", py.get_type::<ShutdownError>())?;
    m.add("AbortedError", py.get_type::<AbortedError>())?;
    m.add("RevokedError", py.get_type::<RevokedError>())?;
    m.add("InvalidOpError", py.get_type::<InvalidOpError>())?;
    m.add("UnsupportedError", py.get_type::<UnsupportedError>())?;
    Ok(())
}
