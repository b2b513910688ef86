//! The copies of a matched GPU op, phase by phase (`plan`): which source range goes to which
//! destination range for each op kind, mirroring the round and phase structure the client
//! follows on its stream (`commd_proto::desc::CudaShape`). Pure: no driver calls.
//!
//! May use: `mem` (spans), `commd_proto`.

use super::*;

/// One copy of a phase, issued on the source GPU's stream towards the destination (a push).
/// `after`: the index, in the same list, of a copy that must be done before this one starts
/// (a chained broadcast forwards a chunk once it has arrived); such a list is issued in order.
#[derive(Clone, Debug)]
pub struct CopyOp {
    pub src: GpuSpan,
    pub dst: GpuSpan,
    pub after: Option<usize>,
}

/// A broadcast of at least this many bytes on 3 or more ranks is a pipelined chain
/// ([`chain_hops`]) instead of the root pushing the whole buffer to every rank: a GPU's pushes
/// to several peers share its egress (4x H200: ~380 GB/s for one push, 190 GB/s for three
/// together), so the root's n-1 pushes took (n-1) x the one-push time (2.8x NCCL on 4 GPUs).
pub const CHAIN_MIN_BYTES: u64 = 32 << 20;

/// When a broadcast is a chain: by default when every rank has a GPU of its own (where the
/// root's egress is the limit). With ranks sharing GPUs the chain measured 5-17% slower than
/// the pushes on 2x H100 (3 and 4 ranks; docs/benchmarks.md), so they keep the pushes.
/// `COMMD_GPU_BCAST_CHAIN` in the daemon's environment: `0` never, `all` in every layout (to
/// test the chain on fewer GPUs than ranks).
fn chain_for(gpus: &[usize]) -> bool {
    static MODE: std::sync::OnceLock<u8> = std::sync::OnceLock::new();
    let mode = *MODE.get_or_init(|| {
        match commd_settings::get(&commd_settings::keys::GPU_BCAST_CHAIN)
            .as_deref()
            .map(str::trim)
        {
            Some("0") => 0,
            Some("all") => 2,
            Some("1") | Some("") | None => 1,
            Some(v) => {
                tracing::warn!(target: "commd::cuda", "COMMD_GPU_BCAST_CHAIN={v:?} is not 0, 1 or all; using 1 (a chain when every rank has its own GPU)");
                1
            }
        }
    });
    match mode {
        0 => false,
        2 => true,
        _ => gpus.iter().enumerate().all(|(i, g)| !gpus[..i].contains(g)),
    }
}

/// One copy of a chained broadcast: bytes `[off, off + len)` from rank `from` to rank `to`,
/// after the hop `after` (the one that brought this chunk to `from`), if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hop {
    pub from: usize,
    pub to: usize,
    pub off: u64,
    pub len: u64,
    pub after: Option<usize>,
}

/// The hops of a pipelined chain broadcast of `bytes` from `root` over `n` ranks: root, root+1,
/// ... (mod n), each rank forwarding chunk c to the next once it has it. Chunks of at least 16
/// MiB, at most 32 of them (each costs a few driver calls per hop, issued while the copies
/// run). Listed hop by hop: where two hops leave one GPU on one stream (ranks sharing GPUs),
/// the later hop's chunks queue behind the earlier hop's instead of each chunk waiting for the
/// hops between them (seen on 2x H100, 4 ranks: chunk by chunk took 3x the one-hop time).
pub fn chain_hops(n: usize, root: usize, bytes: u64) -> Vec<Hop> {
    let chunk = (bytes.div_ceil(32)).max(16 << 20).min(bytes.max(1));
    let chunks: Vec<(u64, u64)> = (0..bytes.div_ceil(chunk))
        .map(|c| (c * chunk, chunk.min(bytes - c * chunk)))
        .collect();
    let mut hops = Vec::new();
    for k in 0..n.saturating_sub(1) {
        for (c, &(off, len)) in chunks.iter().enumerate() {
            hops.push(Hop {
                from: (root + k) % n,
                to: (root + k + 1) % n,
                off,
                len,
                after: (k > 0).then(|| (k - 1) * chunks.len() + c),
            });
        }
    }
    hops
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
    let op = Matched {
        kind,
        es: dtype.size(),
        count,
        root: root as usize,
        bufs,
    };
    if kind.reduces() {
        let _ = redop.ok_or("reduction op missing (internal error)")?;
        return op.reduce_phases(scratch, slot_bytes, one_shot);
    }
    op.copy_phase()
}

/// A matched GPU op as the phase builders read it: its kind, geometry and the ranks' buffers.
struct Matched<'a> {
    kind: OpKind,
    /// Element size in bytes.
    es: u64,
    count: u64,
    root: usize,
    bufs: &'a [GpuBufs],
}

impl Matched<'_> {
    fn n(&self) -> usize {
        self.bufs.len()
    }

    /// One rank's block: `count` elements.
    fn blk(&self) -> u64 {
        self.count * self.es
    }

    fn send(&self, r: usize) -> Result<GpuSpan, String> {
        self.bufs[r].send.clone().ok_or_else(|| missing("send", r))
    }

    fn recv(&self, r: usize) -> Result<GpuSpan, String> {
        self.bufs[r].recv.clone().ok_or_else(|| missing("recv", r))
    }

    /// A reduction's phases: each round's inputs pushed into the peers' scratch slots (`early`)
    /// and, for a two-phase all-reduce, the round's reduced pieces pushed out (`main` of the
    /// next phase).
    fn reduce_phases(
        &self,
        scratch: &[Option<GpuSpan>],
        slot_bytes: u64,
        one_shot: bool,
    ) -> Result<Vec<Phase>, String> {
        let (kind, n, es, count) = (self.kind, self.n(), self.es, self.count);
        let blk = self.blk();
        if one_shot && !commd_proto::desc::cuda_one_shot_fits(kind, count, es, slot_bytes) {
            return Err(format!(
                "one-shot {} of {} bytes does not fit the {slot_bytes}-byte scratch slot",
                kind.name(),
                blk
            ));
        }
        let sc = ScratchSlots {
            spans: scratch,
            n,
            slot_bytes,
        };
        let shape = commd_proto::desc::cuda_shape(
            kind,
            count,
            es,
            crate::ranks::of(n),
            slot_bytes,
            one_shot,
        );
        let mut phases = vec![Phase::default(); commd_proto::num::usize_of(shape.phases)];
        for j in 0..shape.rounds {
            let s0 = j * shape.round_elems;
            let len = shape.round_elems.min(count - s0.min(count));
            let (head, tail) = phases.split_at_mut(commd_proto::num::usize_of(j) + 1);
            let round = Round {
                j,
                s0,
                len,
                one_shot,
            };
            self.round_copies(
                &sc,
                &round,
                &mut head[commd_proto::num::usize_of(j)].early,
                &mut tail[0].main,
            )?;
        }
        Ok(phases)
    }

    /// Round `round.j`'s copies: its inputs into the peers' scratch slots (`a`: early copies of
    /// its phase) and, for a two-phase all-reduce, its reduced pieces out to the peers (`b`:
    /// main copies of the next phase).
    fn round_copies(
        &self,
        sc: &ScratchSlots<'_>,
        round: &Round,
        a: &mut Vec<CopyOp>,
        b: &mut Vec<CopyOp>,
    ) -> Result<(), String> {
        let (n, es, blk) = (self.n(), self.es, self.blk());
        let Round {
            j,
            s0,
            len,
            one_shot,
        } = *round;
        match self.kind {
            OpKind::AllReduce if one_shot => {
                for r in 0..n {
                    for k in (0..n).filter(|&k| k != r) {
                        push(
                            a,
                            sub(&self.send(k)?, s0 * es, len * es)?,
                            sub(&sc.of(r)?, sc.slot(j, k, r), len * es)?,
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
                            sub(&self.send(k)?, ps * es, pl * es)?,
                            sub(&sc.of(r)?, sc.slot(j, k, r), pl * es)?,
                        );
                        push(
                            b,
                            sub(&self.recv(r)?, ps * es, pl * es)?,
                            sub(&self.recv(k)?, ps * es, pl * es)?,
                        );
                    }
                }
            }
            OpKind::Reduce => {
                let t = self.root;
                for k in (0..n).filter(|&k| k != t) {
                    push(
                        a,
                        sub(&self.send(k)?, s0 * es, len * es)?,
                        sub(&sc.of(t)?, sc.slot(j, k, t), len * es)?,
                    );
                }
            }
            OpKind::ReduceScatter => {
                for r in 0..n {
                    for k in (0..n).filter(|&k| k != r) {
                        push(
                            a,
                            sub(&self.send(k)?, r as u64 * blk + s0 * es, len * es)?,
                            sub(&sc.of(r)?, sc.slot(j, k, r), len * es)?,
                        );
                    }
                }
            }
            _ => unreachable_kind(self.kind)?,
        }
        Ok(())
    }

    /// A data-movement op: one phase of copies that run concurrently (a chained broadcast's
    /// are ordered by `after`).
    fn copy_phase(&self) -> Result<Vec<Phase>, String> {
        let (kind, n, blk) = (self.kind, self.n(), self.blk());
        let mut a = Vec::new();
        match kind {
            OpKind::AllGather => {
                for k in 0..n {
                    for r in 0..n {
                        push(
                            &mut a,
                            self.send(k)?,
                            sub(&self.recv(r)?, k as u64 * blk, blk)?,
                        );
                    }
                }
            }
            OpKind::Broadcast
                if n >= 3
                    && blk >= CHAIN_MIN_BYTES
                    && chain_for(
                        &self
                            .bufs
                            .iter()
                            .map(|b| b.recv.as_ref().map_or(usize::MAX, |s| s.mem.gpu))
                            .collect::<Vec<_>>(),
                    ) =>
            {
                return self.chain_broadcast();
            }
            OpKind::Broadcast => {
                let src = self.send(self.root)?;
                for r in 0..n {
                    push(&mut a, src.clone(), self.recv(r)?);
                }
            }
            OpKind::AllToAll => {
                for k in 0..n {
                    for r in 0..n {
                        push(
                            &mut a,
                            sub(&self.send(k)?, r as u64 * blk, blk)?,
                            sub(&self.recv(r)?, k as u64 * blk, blk)?,
                        );
                    }
                }
            }
            OpKind::Barrier => {}
            _ => unreachable_kind(kind)?,
        }
        // Copies of one phase run concurrently: a destination that overlaps any other copy's
        // range would make the result depend on timing (in-place all-to-all, or aliased
        // buffers).
        for (i, c) in a.iter().enumerate() {
            if a.iter()
                .enumerate()
                .any(|(j, o)| (i != j && c.dst.overlaps(&o.dst)) || c.dst.overlaps(&o.src))
            {
                return Err(overlap_error(kind));
            }
        }
        Ok(vec![Phase {
            early: Vec::new(),
            main: a,
        }])
    }

    /// A broadcast as a pipelined chain ([`chain_hops`]), beside the root's own copy.
    fn chain_broadcast(&self) -> Result<Vec<Phase>, String> {
        let (n, t, blk) = (self.n(), self.root, self.blk());
        let mut a = Vec::new();
        let src = self.send(t)?;
        // The root's own copy (out of place) runs beside the chain.
        push(&mut a, src.clone(), self.recv(t)?);
        let base = a.len();
        for h in chain_hops(n, t, blk) {
            let from = if h.from == t {
                src.clone()
            } else {
                self.recv(h.from)?
            };
            a.push(CopyOp {
                src: sub(&from, h.off, h.len)?,
                dst: sub(&self.recv(h.to)?, h.off, h.len)?,
                after: h.after.map(|i| base + i),
            });
        }
        // A chain reads what its earlier hops wrote (ordered by `after`); no destination
        // may overlap another or the root's input.
        for (i, c) in a.iter().enumerate() {
            if a.iter()
                .enumerate()
                .any(|(j, o)| i != j && c.dst.overlaps(&o.dst))
                || c.dst.overlaps(&src)
            {
                return Err(overlap_error(self.kind));
            }
        }
        Ok(vec![Phase {
            early: Vec::new(),
            main: a,
        }])
    }
}

/// One round of a reduction: its index, its elements `[s0, s0 + len)`, and whether the op is
/// one-shot.
#[derive(Clone, Copy)]
struct Round {
    j: u64,
    s0: u64,
    len: u64,
    one_shot: bool,
}

/// The ranks' scratch of a reduction over `n` ranks, cut into slots of `slot_bytes`.
struct ScratchSlots<'a> {
    spans: &'a [Option<GpuSpan>],
    n: usize,
    slot_bytes: u64,
}

impl ScratchSlots<'_> {
    /// Rank r's scratch.
    fn of(&self, r: usize) -> Result<GpuSpan, String> {
        if self.n == 1 {
            return Err("no scratch needed".into());
        }
        self.spans[r].clone().ok_or_else(|| {
            format!("rank {r} has no GPU scratch for this communicator: the client must call GetCommScratch before posting a GPU reduction")
        })
    }

    /// Slot of peer k in rank r's scratch, in round j's buffer.
    fn slot(&self, j: u64, k: usize, r: usize) -> u64 {
        let i = if k < r { k } else { k - 1 } as u64;
        commd_proto::desc::cuda_scratch_off(j, i, crate::ranks::of(self.n), self.slot_bytes)
    }
}

fn missing(what: &str, r: usize) -> String {
    format!("rank {r} has no {what} buffer (internal error)")
}

fn sub(s: &GpuSpan, at: u64, len: u64) -> Result<GpuSpan, String> {
    s.sub(at, len)
        .ok_or_else(|| "buffer range out of bounds (internal error)".to_string())
}

/// Adds a copy, unless it moves nothing (empty, or a range onto itself).
fn push(v: &mut Vec<CopyOp>, src: GpuSpan, dst: GpuSpan) {
    if src.bytes > 0 && !src.same_range(&dst) {
        v.push(CopyOp {
            src,
            dst,
            after: None,
        });
    }
}

fn overlap_error(kind: OpKind) -> String {
    format!(
        "{}: GPU buffers overlap (in-place {} is not supported on GPU memory; use separate send and recv tensors)",
        kind.name(),
        kind.name()
    )
}

fn unreachable_kind(kind: OpKind) -> Result<(), String> {
    Err(format!("{} has no GPU plan (internal error)", kind.name()))
}

/// Pieces of an all-reduce round: the client's split, shared so both sides agree.
pub use commd_cuda::piece;

#[cfg(test)]
mod tests {
    use super::{Hop, chain_hops};

    #[test]
    fn a_chain_brings_every_chunk_to_every_rank_once_after_it_arrived_upstream() {
        for (n, root, bytes) in [
            (3, 0, 32u64 << 20),
            (4, 2, 1 << 30),
            (4, 1, (100 << 20) + 7),
            (8, 7, 600 << 20),
        ] {
            let hops = chain_hops(n, root, bytes);
            // Each non-root rank receives every byte exactly once; the root receives nothing.
            for r in 0..n {
                let mut got: Vec<(u64, u64)> = hops
                    .iter()
                    .filter(|h| h.to == r)
                    .map(|h| (h.off, h.len))
                    .collect();
                got.sort();
                if r == root {
                    assert!(got.is_empty());
                    continue;
                }
                let mut at = 0;
                for (o, l) in got {
                    assert_eq!(o, at, "n {n} root {root}: rank {r} has a gap or overlap");
                    at += l;
                }
                assert_eq!(at, bytes);
            }
            for (i, h) in hops.iter().enumerate() {
                assert!(h.len >= 1 && h.len <= bytes);
                match h.after {
                    // Only the root starts a chunk; a forward waits for the hop that brought
                    // that chunk to its source, listed earlier.
                    None => assert_eq!(h.from, root),
                    Some(j) => {
                        let up: Hop = hops[j];
                        assert!(j < i);
                        assert_eq!((up.to, up.off, up.len), (h.from, h.off, h.len));
                    }
                }
            }
            let chunks = hops.iter().filter(|h| h.after.is_none()).count();
            assert!((1..=32).contains(&chunks), "{chunks} chunks");
        }
    }
}
