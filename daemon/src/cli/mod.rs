//! The `commd` subcommands that talk to a daemon or measure one, as opposed to `serve` (the
//! daemon itself) and `switch` (the software switch): `bench` (`commd bench`, with an embedded
//! daemon or against a running one), `health` (`commd health`), `stat` (`commd stat`, `commd
//! status`, `commd links`: the admin service's view printed). `main.rs` parses the command line
//! and calls them.
//!
//! May use: every module of the daemon library (this is the top layer, beside `serve`).

pub mod bench;
pub mod health;
pub mod stat;
