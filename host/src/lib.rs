//! Host-wide facilities that the daemon (`commd serve`) and the software switch (`commd switch`)
//! share, below both of them:
//! - [`private`]: opening paths that no other user can redirect or replace (the daemon's socket
//!   directory and lock, the claim registry);
//! - [`cores`]: host-wide CPU-core claims, so busy-polling threads of several processes never
//!   share a core;
//! - [`default_socket_path`]: where this user's daemon listens by default (clients and the claim
//!   registry find it there).
//!
//! Depends on no other commd crate.

#![deny(unsafe_code)] // allowed only in the modules that say why

pub mod cores;
pub mod private;

use std::path::{Path, PathBuf};

/// The socket a daemon of this user serves by default (no environment consulted):
/// root: `/run/commd/commd.sock`; others: `$XDG_RUNTIME_DIR/commd/commd.sock`, else
/// `/tmp/commd-$UID/commd.sock`.
pub fn default_socket_path() -> PathBuf {
    let uid = rustix::process::geteuid();
    if uid.is_root() {
        return PathBuf::from("/run/commd/commd.sock");
    }
    match commd_settings::system("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => Path::new(&d).join("commd/commd.sock"),
        _ => PathBuf::from(format!("/tmp/commd-{}/commd.sock", uid.as_raw())),
    }
}
