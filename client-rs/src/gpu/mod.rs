//! The client's CUDA path: device-memory registration (IPC handles, cached per allocation), the
//! doorbell protocol on the caller's stream (DESIGN.md contract 4), and reduction kernels
//! launched in the caller's context between doorbells.

pub mod cu;
pub mod kernels;
