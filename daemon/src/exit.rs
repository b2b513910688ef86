//! The process exit codes of every `commd` command (documented in docs/features.md and
//! docs/deploy.md; systemd and scripts match on them).
//!
//! May use: nothing.

pub const OK: i32 = 0;
pub const RUNTIME: i32 = 1;
pub const USAGE: i32 = 2;
pub const SOCKET_BUSY: i32 = 3;
pub const SOCKET_SETUP: i32 = 4;
/// `transport=rdma` on a node without a usable RDMA device.
pub const NO_TRANSPORT: i32 = 5;
