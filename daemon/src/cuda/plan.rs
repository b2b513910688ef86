//! The copies of a matched GPU op, phase by phase (`plan`): which source range goes to which
//! destination range for each op kind, mirroring the round and phase structure the client
//! follows on its stream (`commd_proto::desc::CudaShape`). Pure: no driver calls.
//!
//! May use: `mem` (spans), `commd_proto`.

use super::*;

/// One copy of a phase, issued on the source GPU's stream towards the destination (a push).
#[derive(Clone, Debug)]
pub struct CopyOp {
    pub src: GpuSpan,
    pub dst: GpuSpan,
}

/// One rank's GPU buffers for a matched op.
#[derive(Clone, Debug, Default)]
pub struct GpuBufs {
    pub send: Option<GpuSpan>,
    pub recv: Option<GpuSpan>,
}

/// The copies of one doorbell phase. `main` copies start once every rank's stream has reached
/// the phase (its ready counter); `early` copies only fill the scratch buffer that the previous
/// round's kernel does not read, so the executor issues them one phase ahead, when the previous
/// phase starts (the copy engines then keep moving data while the clients' kernels run). A
/// phase is done when its `early` copies are (the round's inputs, all its kernels read); its
/// `main` copies (an all-reduce's previous round pushed out) trail on, and the last phase is
/// done when every copy of the op is.
#[derive(Clone, Debug, Default)]
pub struct Phase {
    pub early: Vec<CopyOp>,
    pub main: Vec<CopyOp>,
}

impl Phase {
    pub fn copies(&self) -> impl Iterator<Item = &CopyOp> {
        self.early.iter().chain(self.main.iter())
    }
}

/// Builds the copies of every phase of a matched GPU op (see `commd_proto::desc::CudaShape` for
/// the round and phase structure the client mirrors on its stream). `scratch[r]` is rank r's
/// scratch of `cuda_scratch_bytes(nranks, slot_bytes)` bytes (reductions only). Errors are
/// messages for every rank.
#[allow(clippy::too_many_arguments)]
pub fn plan(
    kind: OpKind,
    dtype: DType,
    redop: Option<RedOp>,
    count: u64,
    root: u32,
    bufs: &[GpuBufs],
    scratch: &[Option<GpuSpan>],
    slot_bytes: u64,
    one_shot: bool,
) -> Result<Vec<Phase>, String> {
    let n = bufs.len();
    let es = dtype.size();
    let blk = count * es;
    let missing = |what: &str, r: usize| format!("rank {r} has no {what} buffer (internal error)");
    let send = |r: usize| bufs[r].send.clone().ok_or_else(|| missing("send", r));
    let recv = |r: usize| bufs[r].recv.clone().ok_or_else(|| missing("recv", r));
    let sub = |s: &GpuSpan, at: u64, len: u64| {
        s.sub(at, len)
            .ok_or_else(|| "buffer range out of bounds (internal error)".to_string())
    };
    let push = |v: &mut Vec<CopyOp>, src: GpuSpan, dst: GpuSpan| {
        if src.bytes > 0 && !src.same_range(&dst) {
            v.push(CopyOp { src, dst });
        }
    };
    if kind.reduces() {
        let _ = redop.ok_or("reduction op missing (internal error)")?;
        if one_shot && !commd_proto::desc::cuda_one_shot_fits(kind, count, es, slot_bytes) {
            return Err(format!(
                "one-shot {} of {} bytes does not fit the {slot_bytes}-byte scratch slot",
                kind.name(),
                blk
            ));
        }
        let scratch_of = |r: usize| -> Result<GpuSpan, String> {
            if n == 1 {
                return Err("no scratch needed".into());
            }
            scratch[r].clone().ok_or_else(|| {
                format!("rank {r} has no GPU scratch for this communicator: the client must call GetCommScratch before posting a GPU reduction")
            })
        };
        // Slot of peer k in rank r's scratch, in round j's buffer.
        let slot = |j: u64, k: usize, r: usize| {
            let i = if k < r { k } else { k - 1 } as u64;
            commd_proto::desc::cuda_scratch_off(j, i, n as u32, slot_bytes)
        };
        let shape = commd_proto::desc::cuda_shape(kind, count, es, n as u32, slot_bytes, one_shot);
        let mut phases = vec![Phase::default(); shape.phases as usize];
        for j in 0..shape.rounds {
            let s0 = j * shape.round_elems;
            let len = shape.round_elems.min(count - s0.min(count));
            let (head, tail) = phases.split_at_mut(j as usize + 1);
            let a = &mut head[j as usize].early;
            let b = &mut tail[0].main;
            match kind {
                OpKind::AllReduce if one_shot => {
                    for r in 0..n {
                        for k in (0..n).filter(|&k| k != r) {
                            push(
                                a,
                                sub(&send(k)?, s0 * es, len * es)?,
                                sub(&scratch_of(r)?, slot(j, k, r), len * es)?,
                            );
                        }
                    }
                }
                OpKind::AllReduce => {
                    for r in 0..n {
                        let (ps, pl) = piece(s0, len, n as u64, r as u64);
                        for k in (0..n).filter(|&k| k != r) {
                            push(
                                a,
                                sub(&send(k)?, ps * es, pl * es)?,
                                sub(&scratch_of(r)?, slot(j, k, r), pl * es)?,
                            );
                            push(
                                b,
                                sub(&recv(r)?, ps * es, pl * es)?,
                                sub(&recv(k)?, ps * es, pl * es)?,
                            );
                        }
                    }
                }
                OpKind::Reduce => {
                    let t = root as usize;
                    for k in (0..n).filter(|&k| k != t) {
                        push(
                            a,
                            sub(&send(k)?, s0 * es, len * es)?,
                            sub(&scratch_of(t)?, slot(j, k, t), len * es)?,
                        );
                    }
                }
                OpKind::ReduceScatter => {
                    for r in 0..n {
                        for k in (0..n).filter(|&k| k != r) {
                            push(
                                a,
                                sub(&send(k)?, r as u64 * blk + s0 * es, len * es)?,
                                sub(&scratch_of(r)?, slot(j, k, r), len * es)?,
                            );
                        }
                    }
                }
                _ => unreachable_kind(kind)?,
            }
        }
        return Ok(phases);
    }
    let mut a = Vec::new();
    match kind {
        OpKind::AllGather => {
            for k in 0..n {
                for r in 0..n {
                    push(&mut a, send(k)?, sub(&recv(r)?, k as u64 * blk, blk)?);
                }
            }
        }
        OpKind::Broadcast => {
            let src = send(root as usize)?;
            for r in 0..n {
                push(&mut a, src.clone(), recv(r)?);
            }
        }
        OpKind::AllToAll => {
            for k in 0..n {
                for r in 0..n {
                    push(
                        &mut a,
                        sub(&send(k)?, r as u64 * blk, blk)?,
                        sub(&recv(r)?, k as u64 * blk, blk)?,
                    );
                }
            }
        }
        OpKind::Barrier => {}
        _ => unreachable_kind(kind)?,
    }
    // Copies of one phase run concurrently: a destination that overlaps any other copy's range
    // would make the result depend on timing (in-place all-to-all, or aliased buffers).
    for (i, c) in a.iter().enumerate() {
        if a.iter()
            .enumerate()
            .any(|(j, o)| (i != j && c.dst.overlaps(&o.dst)) || c.dst.overlaps(&o.src))
        {
            return Err(format!(
                "{}: GPU buffers overlap (in-place {} is not supported on GPU memory; use separate send and recv tensors)",
                kind.name(),
                kind.name()
            ));
        }
    }
    Ok(vec![Phase {
        early: Vec::new(),
        main: a,
    }])
}

fn unreachable_kind(kind: OpKind) -> Result<(), String> {
    Err(format!("{} has no GPU plan (internal error)", kind.name()))
}

/// Pieces of an all-reduce round: the client's split, shared so both sides agree.
pub use commd_client::gpu::piece;
