//! The `commd` subcommands other than `serve` (the daemon itself): `bench` (`commd bench`, with
//! an embedded daemon or against a running one), `health` (`commd health`), `stat` (`commd
//! stat`, `commd status`, `commd links`: the admin service's view printed), `switch` (`commd
//! switch`, the software switch of the `commd-switch` crate). `main.rs` parses the command line
//! and calls them.
//!
//! May use: every module of the daemon library (this is the top layer, beside `serve`).

pub mod bench;
pub mod health;
pub mod stat;
pub mod status;
pub mod switch;
pub mod topo;
