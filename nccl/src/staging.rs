//! Device memory a communicator stages an op's input in: PreMulSum's scaled input, and the
//! input of an in-place all-to-all (the daemon refuses copies whose destination overlaps a
//! source). One `Staging` per use per communicator; the ops using it may be on any streams.
//!
//! Every eager op takes the current buffer only after the op before it (maybe on another
//! stream) finished reading it: the stream waits for that op's event, on the GPU. A buffer
//! outgrown while ops queued earlier may still read it is kept until the communicator goes,
//! and a captured op gets a buffer of its own (its graph replays reading it, for as long as
//! the graph lives), kept likewise.
//!
//! May use: `commd_client` CUDA calls, `ffi`.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use commd_cuda::{self as cu, sys};

use crate::ffi::{self, Failure, Outcome};

#[derive(Default)]
pub struct Staging {
    cur: Option<(u64, u64)>,
    /// Outgrown buffers and those of captured ops, with their bytes: freed with the
    /// communicator.
    kept: Vec<(u64, u64)>,
    /// The event after the last eager op that read `cur`.
    busy: Option<usize>,
}

fn ck(r: sys::CUresult, what: &str) -> Outcome {
    cu::ck(r, what).map_err(cuda_failure)
}

fn cuda_failure(e: cu::CuError) -> Failure {
    Failure {
        code: ffi::UNHANDLED_CUDA_ERROR,
        message: e.to_string(),
    }
}

/// A byte count this process cannot address (never on the 64-bit targets commd runs on).
fn too_large(bytes: u64, what: &str) -> Failure {
    ffi::invalid(format!(
        "{what}: {bytes} bytes do not fit this process's address space"
    ))
}

/// Whether `stream` is being captured into a CUDA graph.
fn capturing(stream: usize) -> Outcome<bool> {
    // SAFETY: the caller's live stream.
    let st =
        unsafe { cu::context::capture_status(stream as sys::CUstream) }.map_err(cuda_failure)?;
    Ok(st != cu::context::Capture::None)
}

fn alloc(bytes: u64, what: &str) -> Outcome<u64> {
    let len = usize::try_from(bytes.max(1)).map_err(|_| too_large(bytes, what))?;
    let mut d = 0;
    ck(
        // SAFETY: valid out pointer; the caller's thread has the context current.
        unsafe { sys::cuMemAlloc_v2(&mut d, len) },
        &format!("cuMemAlloc({what})"),
    )?;
    Ok(d)
}

impl Staging {
    /// Bytes of device memory held (`ncclCommMemStats`).
    pub fn bytes(&self) -> u64 {
        self.kept.iter().chain(&self.cur).map(|(_, n)| n).sum()
    }

    /// Frees everything (the communicator is destroyed: its ops were waited for).
    pub fn free(&mut self) {
        for (p, _) in self.kept.drain(..).chain(self.cur.take()) {
            // SAFETY: memory allocated below, no longer used.
            unsafe { sys::cuMemFree_v2(p) };
        }
        if let Some(e) = self.busy.take() {
            // SAFETY: an event created by `done`.
            unsafe { sys::cuEventDestroy_v2(e as sys::CUevent) };
        }
    }

    /// A buffer of at least `bytes` that work enqueued on `stream` next may write: ordered
    /// after the last eager op that read it, or a captured op's own. `done` must be called
    /// with the same stream once the op that reads it is enqueued.
    pub fn buffer(&mut self, bytes: u64, stream: usize, what: &str) -> Outcome<u64> {
        if capturing(stream)? {
            // NCCL programs capture in thread-local or global mode, where cuMemAlloc on the
            // capturing thread is refused: allocated in relaxed mode.
            let _relaxed = commd_client::gpu::Relaxed::enter()?;
            let d = alloc(bytes, what)?;
            self.kept.push((d, bytes));
            return Ok(d);
        }
        if self.cur.is_none_or(|(_, n)| n < bytes) {
            let d = alloc(bytes, what)?;
            if let Some(old) = self.cur.replace((d, bytes)) {
                // Ops queued earlier may still read it.
                self.kept.push(old);
            }
        }
        if let Some(e) = self.busy {
            ck(
                // SAFETY: a live event of this communicator; the caller's live stream.
                unsafe { sys::cuStreamWaitEvent(stream as sys::CUstream, e as sys::CUevent, 0) },
                "cuStreamWaitEvent",
            )?;
        }
        Ok(self.cur.map(|(d, _)| d).unwrap_or_default())
    }

    /// Enqueues on `stream` a copy of `bytes` at `src` into a buffer (as [`Self::buffer`])
    /// and returns its address.
    ///
    /// # Safety
    /// `src` is device memory of this process holding `bytes` until the stream passes the
    /// copy; the stream is live, of the current context.
    pub unsafe fn copy_in(
        &mut self,
        src: u64,
        bytes: u64,
        stream: usize,
        what: &str,
    ) -> Outcome<u64> {
        let len = usize::try_from(bytes).map_err(|_| too_large(bytes, what))?;
        let d = self.buffer(bytes, stream, what)?;
        ck(
            // SAFETY: the caller's contract for `src` and the stream; `d` holds `bytes`.
            unsafe { sys::cuMemcpyDtoDAsync_v2(d, src, len, stream as sys::CUstream) },
            "cuMemcpyDtoDAsync",
        )?;
        Ok(d)
    }

    /// Records, after the op that read the buffer on `stream`, the event the next `buffer`
    /// waits for (eager ops only: a captured op has its own buffer).
    pub fn done(&mut self, stream: usize) -> Outcome {
        if capturing(stream)? {
            return Ok(());
        }
        let e = match self.busy {
            Some(e) => e,
            None => {
                let e = cu::context::event().map_err(cuda_failure)?;
                self.busy = Some(e as usize);
                e as usize
            }
        };
        ck(
            // SAFETY: a live event of this communicator; the caller's live stream.
            unsafe { sys::cuEventRecord(e as sys::CUevent, stream as sys::CUstream) },
            "cuEventRecord",
        )
    }
}
