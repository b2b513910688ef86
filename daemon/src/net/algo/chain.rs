//! The chain reduction across nodes (large all-reduce and reduce, pipelined; the parent
//! module's doc says why it is exact): the running accumulator of ranks `0..k` travels chunk by
//! chunk along the runs of consecutive ranks on one node, each run folding in its ranks; the
//! last run's node finishes the result and sends it back along a chain of the nodes
//! (all-reduce) or to the root's node (reduce). The I/O helpers and buffer accessors are the
//! parent module's.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

use super::*;
use crate::engine::reduce::Chain;
use commd_proto::num::usize_of;

pub(super) fn chain_reduce(
    io: &mut Io<'_>,
    c: &Coll,
    k: Kernel,
    scratch: &mut Scratch,
    tu: &Tuning,
) -> Result<(), NetError> {
    let op = ChainOp::new(io.t, c, k, scratch, tu);
    // Post every incoming accumulator chunk up front, then the final-result receivers.
    let incoming = op.post_incoming(io)?;
    let finals = op.post_finals(io)?;
    // The chain itself, chunk by chunk.
    for ci in 0..op.nchunks {
        for (m, &j) in op.mine.iter().enumerate() {
            op.fold(io, &incoming, ci, m, j)?;
        }
    }
    op.forward_finals(io, &finals)
}

/// Maximal runs of consecutive ranks on one node: (node, first rank, end rank).
fn runs(t: &Topo) -> Vec<(usize, usize, usize)> {
    let mut v: Vec<(usize, usize, usize)> = Vec::new();
    for (r, &node) in t.rank_node.iter().enumerate() {
        match v.last_mut() {
            Some(last) if last.0 == node => last.2 = r + 1,
            _ => v.push((node, r, r + 1)),
        }
    }
    v
}

/// Tag of final-result chunk `ci` (apart from the accumulators' `ci * nruns + run`).
fn bcast_tag(ci: u64) -> u64 {
    (1u64 << 48) | ci
}

/// One chain reduction as this node runs it: the op, the runs and chunks, which runs are this
/// node's, where the final result travels, and the scratch of the accumulators.
struct ChainOp<'a> {
    t: &'a Topo,
    c: &'a Coll,
    k: Kernel,
    n: usize,
    /// Element size and accumulator size in bytes.
    es: u64,
    acc: u64,
    runs: Vec<(usize, usize, usize)>,
    /// Index of the last run, and its node (which finishes the result).
    last: usize,
    last_node: usize,
    root_node: usize,
    /// Elements per chunk, and chunks.
    celems: u64,
    nchunks: u64,
    /// Indices of this node's runs.
    mine: Vec<usize>,
    /// Bytes of one accumulator region (count accumulators).
    region: u64,
    /// This node ends the chain of a reduce whose root lives elsewhere: the result goes to the
    /// final buffer in the scratch, and from there to the root's node.
    final_remote: bool,
    /// The scratch: per run of mine, accumulators in and out; then the final buffer.
    base: *mut u8,
    /// The nodes from the last one on, the order the final result of an all-reduce travels,
    /// and this node's place in it.
    order: Vec<usize>,
    pos: usize,
    /// Data-plane threads one chunk's fold or copy may use.
    workers: usize,
}

impl<'a> ChainOp<'a> {
    fn new(t: &'a Topo, c: &'a Coll, k: Kernel, scratch: &mut Scratch, tu: &Tuning) -> Self {
        let chunk = tu.chunk;
        let n = t.nranks();
        let es = c.dtype.size();
        let acc = k.acc_size() as u64;
        let runs = runs(t);
        let last = runs.len() - 1;
        let last_node = runs[last].0;
        let root_node = t.rank_node[c.root as usize];
        let celems = (chunk / acc).max(1);
        let nchunks = c.count.div_ceil(celems).max(1);
        let mine: Vec<usize> = (0..runs.len()).filter(|&j| runs[j].0 == t.me).collect();
        // Scratch: per run of mine, accumulators in and out; plus the final result when this
        // node ends the chain of a reduce whose root lives elsewhere.
        let region = c.count * acc;
        let final_remote = c.kind == OpKind::Reduce && t.me == last_node && root_node != t.me;
        let total = region * 2 * mine.len() as u64 + if final_remote { c.count * es } else { 0 };
        let base = scratch.get(total);
        let order: Vec<usize> = (0..t.nodes.len())
            .map(|i| (last_node + i) % t.nodes.len())
            .collect();
        let pos = order.iter().position(|&x| x == t.me).unwrap_or(0);
        Self {
            t,
            c,
            k,
            n,
            es,
            acc,
            runs,
            last,
            last_node,
            root_node,
            celems,
            nchunks,
            mine,
            region,
            final_remote,
            base,
            order,
            pos,
            workers: tu.workers,
        }
    }

    fn region_at(&self, k: usize) -> *mut u8 {
        // SAFETY: k <= 2 * mine.len(), so the offset stays inside the `total` bytes requested.
        unsafe { self.base.add(k * usize_of(self.region)) }
    }

    fn acc_in(&self, m: usize) -> *mut u8 {
        self.region_at(2 * m)
    }

    fn acc_out(&self, m: usize) -> *mut u8 {
        self.region_at(2 * m + 1)
    }

    fn final_buf(&self) -> *mut u8 {
        self.region_at(2 * self.mine.len())
    }

    /// Elements `[e0, e1)` of chunk `ci`.
    fn range(&self, ci: u64) -> (u64, u64) {
        let e0 = ci * self.celems;
        (e0, (e0 + self.celems).min(self.c.count))
    }

    /// Posts every incoming accumulator chunk of each of this node's runs but the first run.
    fn post_incoming(&self, io: &mut Io<'_>) -> Result<Vec<Vec<RecvId>>, NetError> {
        let nruns = self.runs.len() as u64;
        let mut incoming: Vec<Vec<RecvId>> = vec![Vec::new(); self.mine.len()];
        for (m, &j) in self.mine.iter().enumerate() {
            if j == 0 {
                continue;
            }
            for ci in 0..self.nchunks {
                let (e0, e1) = self.range(ci);
                // SAFETY: inside acc_in(m), which holds count accumulators.
                let id = unsafe {
                    io.recv(
                        self.runs[j - 1].0,
                        ci * nruns + j as u64,
                        self.acc_in(m).add(usize_of(e0 * self.acc)),
                        (e1 - e0) * self.acc,
                    )?
                };
                incoming[m].push(id);
            }
        }
        Ok(incoming)
    }

    /// Final-result receivers (non-last nodes of an all-reduce get it back along a chain;
    /// the root's node of a reduce gets it from the last node).
    fn post_finals(&self, io: &mut Io<'_>) -> Result<Vec<RecvId>, NetError> {
        let (t, c, es) = (self.t, self.c, self.es);
        let mut finals: Vec<RecvId> = Vec::new();
        if c.kind == OpKind::AllReduce && t.me != self.last_node {
            let dst = recv_ptr(c, 0)?;
            for ci in 0..self.nchunks {
                let (e0, e1) = self.range(ci);
                // SAFETY: inside rank bufs[0]'s recv span of count elements.
                finals.push(unsafe {
                    io.recv(
                        self.order[self.pos - 1],
                        bcast_tag(ci),
                        dst.add(usize_of(e0 * es)),
                        (e1 - e0) * es,
                    )?
                });
            }
        } else if c.kind == OpKind::Reduce && t.me == self.root_node && t.me != self.last_node {
            let i = local_index(c, c.root).ok_or_else(|| local_err("root not local"))?;
            let dst = recv_ptr(c, i)?;
            for ci in 0..self.nchunks {
                let (e0, e1) = self.range(ci);
                // SAFETY: inside the root's recv span.
                finals.push(unsafe {
                    io.recv(
                        self.last_node,
                        bcast_tag(ci),
                        dst.add(usize_of(e0 * es)),
                        (e1 - e0) * es,
                    )?
                });
            }
        }
        Ok(finals)
    }

    /// Chunk `ci` through run `j` (this node's `m`-th): waits for the accumulators from the
    /// run before, folds in the run's ranks, and passes the accumulators on or, in the last
    /// run, finishes the chunk.
    fn fold(
        &self,
        io: &mut Io<'_>,
        incoming: &[Vec<RecvId>],
        ci: u64,
        m: usize,
        j: usize,
    ) -> Result<(), NetError> {
        let (c, es) = (self.c, self.es);
        let (e0, _) = self.range(ci);
        if j > 0 {
            let id = incoming[m][usize_of(ci)];
            io.wait(&[id])?;
        }
        let (_, r0, r1) = self.runs[j];
        let mut inputs = Vec::with_capacity(r1 - r0);
        for r in r0..r1 {
            let i = local_index(c, crate::ranks::of(r))
                .ok_or_else(|| local_err("run rank not local"))?;
            // SAFETY: e0 < count: inside the send span.
            inputs.push(unsafe { send_ptr(c, i)?.add(usize_of(e0 * es)) });
        }
        let ch_in = if j > 0 {
            // SAFETY: inside acc_in(m).
            unsafe { self.acc_in(m).add(usize_of(e0 * self.acc)).cast_const() }
        } else {
            std::ptr::null()
        };
        if j < self.last {
            return self.pass_on(io, ci, m, j, ch_in, &inputs);
        }
        self.finish(io, ci, ch_in, &inputs)
    }

    /// A run before the last: folds its ranks into the accumulators of chunk `ci` and sends
    /// them to the next run's node.
    fn pass_on(
        &self,
        io: &mut Io<'_>,
        ci: u64,
        m: usize,
        j: usize,
        ch_in: *const u8,
        inputs: &[*const u8],
    ) -> Result<(), NetError> {
        let (e0, e1) = self.range(ci);
        let ne = usize_of(e1 - e0);
        let nruns = self.runs.len() as u64;
        // SAFETY: inside acc_out(m).
        let out = unsafe { self.acc_out(m).add(usize_of(e0 * self.acc)) };
        // SAFETY: inputs valid for ne elements; accumulators in/out hold ne accumulators
        // in distinct scratch regions.
        unsafe {
            par_reduce(
                (self.k, self.c.dtype),
                crate::ranks::of(self.n),
                Chain {
                    acc_in: ch_in,
                    acc_out: out,
                },
                inputs,
                &[],
                ne,
                self.workers,
            )
        };
        // SAFETY: acc_out(m) is not written again during this op.
        unsafe {
            io.send(
                self.runs[j + 1].0,
                ci * nruns + j as u64 + 1,
                out,
                ne as u64 * self.acc,
            )?
        };
        io.progress()
    }

    /// The last run: finishes chunk `ci` into the outputs and sends it on (all-reduce: to the
    /// next node of the final chain; reduce: to the root's node when it is elsewhere).
    fn finish(
        &self,
        io: &mut Io<'_>,
        ci: u64,
        ch_in: *const u8,
        inputs: &[*const u8],
    ) -> Result<(), NetError> {
        let (c, es) = (self.c, self.es);
        let (e0, e1) = self.range(ci);
        let ne = usize_of(e1 - e0);
        let mut outs = Vec::new();
        if self.final_remote {
            // SAFETY: inside final_buf (count elements).
            outs.push(unsafe { self.final_buf().add(usize_of(e0 * es)) });
        }
        for (i, (r, _)) in c.bufs.iter().enumerate() {
            if c.kind == OpKind::AllReduce || *r == c.root {
                // SAFETY: inside the recv span.
                outs.push(unsafe { recv_ptr(c, i)?.add(usize_of(e0 * es)) });
            }
        }
        // SAFETY: as above; outputs are recv spans (possibly equal to an input: in place)
        // or the final scratch.
        unsafe {
            par_reduce(
                (self.k, self.c.dtype),
                crate::ranks::of(self.n),
                Chain {
                    acc_in: ch_in,
                    acc_out: std::ptr::null_mut(),
                },
                inputs,
                &outs,
                ne,
                self.workers,
            )
        };
        if c.kind == OpKind::AllReduce && self.order.len() > 1 {
            // SAFETY: the first local rank's recv holds the final chunk; it is not written
            // again during this op.
            unsafe {
                io.send(
                    self.order[1],
                    bcast_tag(ci),
                    recv_ptr(c, 0)?.add(usize_of(e0 * es)),
                    ne as u64 * es,
                )?
            };
        } else if self.final_remote {
            // SAFETY: final_buf is not written again during this op.
            unsafe {
                io.send(
                    self.root_node,
                    bcast_tag(ci),
                    self.final_buf().add(usize_of(e0 * es)),
                    ne as u64 * es,
                )?
            };
        }
        io.progress()
    }

    /// Final result coming back: forward along the chain and copy to the other local ranks.
    fn forward_finals(&self, io: &mut Io<'_>, finals: &[RecvId]) -> Result<(), NetError> {
        if finals.is_empty() {
            return Ok(());
        }
        let (c, es) = (self.c, self.es);
        let dst = if c.kind == OpKind::AllReduce {
            recv_ptr(c, 0)?
        } else {
            recv_ptr(c, local_index(c, c.root).unwrap_or(0))?
        };
        for ci in 0..self.nchunks {
            let (e0, e1) = self.range(ci);
            io.wait(&[finals[usize_of(ci)]])?;
            if c.kind == OpKind::AllReduce && self.pos + 1 < self.order.len() {
                // SAFETY: the chunk was received and is not written again.
                unsafe {
                    io.send(
                        self.order[self.pos + 1],
                        bcast_tag(ci),
                        dst.add(usize_of(e0 * es)),
                        (e1 - e0) * es,
                    )?
                };
            }
            if c.kind == OpKind::AllReduce && c.bufs.len() > 1 {
                // Copy each chunk to the other local ranks as it lands (every input was folded
                // before the first final chunk can exist, so in-place buffers are free to write).
                let off = usize_of(e0 * es);
                let mut dsts = Vec::with_capacity(c.bufs.len() - 1);
                for i in 1..c.bufs.len() {
                    // SAFETY: chunk [e0, e1) of a recv span of count elements.
                    dsts.push(unsafe { recv_ptr(c, i)?.add(off) });
                }
                // SAFETY: chunk [e0, e1) of recv spans of count elements; the received chunk
                // is not written again during this op.
                unsafe { par_copy(&dsts, dst.add(off), (e1 - e0) * es, self.workers) };
                io.progress()?;
            }
        }
        Ok(())
    }
}
