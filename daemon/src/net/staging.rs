//! Host staging for GPU ops on communicators that span nodes (`flags::HOST_STAGED`): the net
//! thread copies each local rank's GPU input into pinned host memory with the copy engines, runs
//! the op with the same algorithms and transports as host memory (reductions on the CPU), and
//! copies the results back into the GPU buffers before it publishes the op's done counter. The
//! SMs stay with the user's compute; the price is two PCIe crossings per byte (no GPUDirect
//! transport yet).
//!
//! Buffers come from a per-communicator pool of pinned regions that is kept across ops: pinning
//! (`cuMemHostRegister`) costs about a millisecond per 100 MiB, far more than an op.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

use std::sync::Arc;

use crate::cuda::Cuda;
use crate::engine::Span;
use crate::shm::MemRegion;

/// Smallest staging buffer (pool entries are powers of two from here, so sizes that vary a
/// little reuse one buffer).
const MIN_BYTES: u64 = 1 << 20;
/// Free buffers kept per communicator; more are unpinned and freed.
const MAX_FREE: usize = 16;

/// Daemon-private host memory, pinned for DMA when the driver allows (else pageable: copies
/// still work, synchronously and slower, and the reason is logged once per buffer).
pub struct Pinned {
    cuda: &'static Cuda,
    region: Arc<MemRegion>,
    pinned: bool,
}

impl Pinned {
    fn new(cuda: &'static Cuda, bytes: u64) -> Result<Self, String> {
        let region = Arc::new(
            MemRegion::anonymous(bytes)
                .map_err(|e| format!("allocating {bytes} bytes of host staging: {e}"))?,
        );
        let t0 = std::time::Instant::now();
        // SAFETY: the region is a live, page-aligned private mapping; `Drop` unregisters it
        // before the region can go away (the pool holds the last use of its spans).
        let pinned = match unsafe { cuda.host_register(region.base(), bytes) } {
            Ok(()) => {
                tracing::info!(target: "commd::net", "host staging: pinned a {} KiB buffer in {:.1} ms", bytes >> 10, t0.elapsed().as_secs_f64() * 1e3);
                true
            }
            Err(e) => {
                tracing::warn!(target: "commd::net", "host staging buffer of {bytes} bytes not pinned ({e}); GPU copies through it are slower");
                false
            }
        };
        Ok(Self {
            cuda,
            region,
            pinned,
        })
    }

    /// Capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.region.len()
    }

    /// The first `bytes` of the buffer as a span for the host engine and the wire.
    pub fn span(&self, bytes: u64) -> Option<Span> {
        Span::new(self.region.clone(), 0, bytes)
    }

    pub fn ptr(&self) -> *mut u8 {
        self.region.base()
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.pinned {
            // SAFETY: registered in `new`; buffers return to the pool (or drop) only after their
            // copies completed.
            if let Err(e) = unsafe { self.cuda.host_unregister(self.region.base()) } {
                tracing::warn!(target: "commd::net", "unpinning a host staging buffer: {e}");
            }
        }
    }
}

/// A communicator's staging buffers (owned by its net thread).
#[derive(Default)]
pub struct Pool {
    free: Vec<Pinned>,
}

impl Pool {
    /// A buffer of at least `bytes` (at least 1 byte): the smallest free one that fits, or a
    /// new one.
    pub fn take(&mut self, cuda: &'static Cuda, bytes: u64) -> Result<Pinned, String> {
        let want = bytes.max(1);
        if let Some(i) = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, b)| b.capacity() >= want)
            .min_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i)
        {
            return Ok(self.free.swap_remove(i));
        }
        Pinned::new(cuda, size_class(want))
    }

    /// Returns a buffer whose copies are all complete.
    pub fn give(&mut self, b: Pinned) {
        self.free.push(b);
        if self.free.len() > MAX_FREE {
            // Keep the largest: they serve every smaller request.
            self.free.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
            self.free.truncate(MAX_FREE);
        }
    }
}

/// The pool's size class of a request: a power of two, at least `MIN_BYTES`.
fn size_class(bytes: u64) -> u64 {
    bytes
        .max(MIN_BYTES)
        .checked_next_power_of_two()
        .unwrap_or(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes_are_powers_of_two_and_fit() {
        for b in [
            1u64,
            4096,
            MIN_BYTES,
            MIN_BYTES + 1,
            3 << 20,
            1 << 30,
            (1 << 30) + 5,
        ] {
            let c = size_class(b);
            assert!(c >= b && c >= MIN_BYTES, "{b} -> {c}");
            assert!(c.is_power_of_two(), "{b} -> {c}");
            assert!(c / 2 < b.max(MIN_BYTES), "{b} -> {c} wastes more than half");
        }
        assert_eq!(size_class(u64::MAX), u64::MAX);
    }
}
