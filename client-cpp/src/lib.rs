//! C ABI over commd-client (work in progress).
