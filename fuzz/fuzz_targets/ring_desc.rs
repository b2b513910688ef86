//! Ring submission descriptors (64 bytes of client-written shared memory): decoding and the
//! field checks must never panic, for any bit pattern; an op that decodes has a kind, dtype and
//! counts that the daemon's size arithmetic handles without overflow panics.
#![no_main]

use commd_proto::desc::{SubmitDesc, cuda_phases};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < size_of::<SubmitDesc>() {
        return;
    }
    // SAFETY: SubmitDesc is repr(C) and made only of integers: every bit pattern is a value.
    let d: SubmitDesc = unsafe { std::ptr::read_unaligned(data.as_ptr().cast()) };
    let Ok(op) = d.decode() else { return };
    let _ = op.check();
    let nranks = u32::from(data.get(64).copied().unwrap_or(2)).max(1);
    let es = op.dtype.size();
    let _ = op.kind.send_elems(op.count, u64::from(nranks));
    let _ = op.kind.recv_elems(op.count, u64::from(nranks));
    let _ = cuda_phases(op.kind, op.count, es, nranks, 1 << 20, false);
});
