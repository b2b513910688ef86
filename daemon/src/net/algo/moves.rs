//! Data-movement collectives across nodes (all-gather, all-to-all, broadcast): each block is sent
//! once to each node that needs it; broadcast of large messages is a pipelined chain. The
//! reductions, the topology and the I/O helpers are the parent module's.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

use super::*;
use commd_proto::num::usize_of;

pub(super) fn all_gather(io: &mut Io<'_>, c: &Coll) -> Result<(), NetError> {
    let t = io.t;
    let n = t.nranks();
    let blk = c.count * c.dtype.size();
    for node in 0..t.nodes.len() {
        if node == t.me {
            continue;
        }
        for (i, (r, _)) in c.bufs.iter().enumerate() {
            // SAFETY: the send span lives until the op completes.
            unsafe { io.send(node, u64::from(*r), send_ptr(c, i)?, blk)? };
        }
    }
    let first = recv_ptr(c, 0)?;
    let mut rs = Vec::new();
    for r in 0..n {
        let node = t.rank_node[r];
        if node != t.me {
            // SAFETY: block r of the first local rank's recv span (n blocks).
            rs.push(unsafe { io.recv(node, r as u64, first.add(r * usize_of(blk)), blk)? });
        }
    }
    // Local blocks meanwhile.
    for (i, _) in c.bufs.iter().enumerate() {
        let dst = recv_ptr(c, i)?;
        for (j, (r, _)) in c.bufs.iter().enumerate() {
            // SAFETY: block r of a recv span; a send span of one block.
            unsafe { copy(dst.add(*r as usize * usize_of(blk)), send_ptr(c, j)?, blk) };
        }
    }
    io.wait(&rs)?;
    for i in 1..c.bufs.len() {
        let dst = recv_ptr(c, i)?;
        for r in 0..n {
            if t.rank_node[r] != t.me {
                let off = r * usize_of(blk);
                // SAFETY: block r of both recv spans.
                unsafe { copy(dst.add(off), first.add(off).cast_const(), blk) };
            }
        }
    }
    Ok(())
}

fn overlaps(c: &Coll) -> bool {
    let span = |s: &Option<crate::engine::Span>| {
        s.as_ref()
            .map(|s| (s.ptr() as usize, s.ptr() as usize + usize_of(s.bytes())))
    };
    c.bufs.iter().any(|(_, a)| {
        c.bufs
            .iter()
            .any(|(_, b)| match (span(&a.send), span(&b.recv)) {
                (Some((s0, s1)), Some((r0, r1))) => s0 < r1 && r0 < s1,
                _ => false,
            })
    })
}

pub(super) fn all_to_all(io: &mut Io<'_>, c: &Coll, scratch: &mut Scratch) -> Result<(), NetError> {
    let t = io.t;
    let n = t.nranks();
    let blk = c.count * c.dtype.size();
    let row = blk * n as u64;
    // In-place (send overlapping a recv): stage the inputs first.
    let staged = overlaps(c).then(|| scratch.get(row * c.bufs.len() as u64));
    let src = |i: usize| -> Result<*const u8, NetError> {
        match staged {
            // SAFETY: row i of the staging area.
            Some(b) => Ok(unsafe { b.add(i * usize_of(row)).cast_const() }),
            None => send_ptr(c, i),
        }
    };
    if let Some(b) = staged {
        for i in 0..c.bufs.len() {
            // SAFETY: send spans of n blocks into distinct staging rows.
            unsafe { copy(b.add(i * usize_of(row)), send_ptr(c, i)?, row) };
        }
    }
    for (i, (r, _)) in c.bufs.iter().enumerate() {
        for q in 0..n {
            let node = t.rank_node[q];
            if node != t.me {
                // SAFETY: block q of rank r's input.
                unsafe {
                    io.send(
                        node,
                        u64::from(*r) * n as u64 + q as u64,
                        src(i)?.add(q * usize_of(blk)),
                        blk,
                    )?
                };
            }
        }
    }
    let mut rs = Vec::new();
    for r in 0..n {
        let node = t.rank_node[r];
        if node == t.me {
            continue;
        }
        for (qi, (q, _)) in c.bufs.iter().enumerate() {
            // SAFETY: block r of rank q's recv span.
            rs.push(unsafe {
                io.recv(
                    node,
                    (r * n) as u64 + u64::from(*q),
                    recv_ptr(c, qi)?.add(r * usize_of(blk)),
                    blk,
                )?
            });
        }
    }
    for (i, (r, _)) in c.bufs.iter().enumerate() {
        for (qi, (q, _)) in c.bufs.iter().enumerate() {
            // SAFETY: block q of r's input into block r of q's output.
            unsafe {
                copy(
                    recv_ptr(c, qi)?.add(*r as usize * usize_of(blk)),
                    src(i)?.add(*q as usize * usize_of(blk)),
                    blk,
                )
            };
        }
    }
    io.wait(&rs)
}

pub(super) fn broadcast_direct(io: &mut Io<'_>, c: &Coll) -> Result<(), NetError> {
    let t = io.t;
    let blk = c.count * c.dtype.size();
    let root_node = t.rank_node[c.root as usize];
    if t.me == root_node {
        let i = local_index(c, c.root).ok_or_else(|| local_err("root not local"))?;
        let src = send_ptr(c, i)?;
        for node in 0..t.nodes.len() {
            if node != t.me {
                // SAFETY: the root's send span lives until the op completes.
                unsafe { io.send(node, 0, src, blk)? };
            }
        }
        for j in 0..c.bufs.len() {
            // SAFETY: recv spans of count elements.
            unsafe { copy(recv_ptr(c, j)?, src, blk) };
        }
        return Ok(());
    }
    let first = recv_ptr(c, 0)?;
    // SAFETY: the first local recv span holds blk bytes.
    let id = unsafe { io.recv(root_node, 0, first, blk)? };
    io.wait(&[id])?;
    for j in 1..c.bufs.len() {
        // SAFETY: recv spans of count elements.
        unsafe { copy(recv_ptr(c, j)?, first, blk) };
    }
    Ok(())
}

pub(super) fn broadcast_chain(io: &mut Io<'_>, c: &Coll, chunk: u64) -> Result<(), NetError> {
    let t = io.t;
    let blk = c.count * c.dtype.size();
    let root_node = t.rank_node[c.root as usize];
    let nn = t.nodes.len();
    let order: Vec<usize> = (0..nn).map(|i| (root_node + i) % nn).collect();
    let pos = order.iter().position(|&x| x == t.me).unwrap_or(0);
    let cb = (chunk / c.dtype.size()).max(1) * c.dtype.size();
    let nchunks = blk.div_ceil(cb).max(1);
    let range = |ci: u64| (ci * cb, ((ci + 1) * cb).min(blk));
    let (buf, ids) = if pos == 0 {
        let i = local_index(c, c.root).ok_or_else(|| local_err("root not local"))?;
        (send_ptr(c, i)?.cast_mut(), Vec::new())
    } else {
        let first = recv_ptr(c, 0)?;
        let mut ids = Vec::new();
        for ci in 0..nchunks {
            let (a, b) = range(ci);
            // SAFETY: inside the first local recv span.
            ids.push(unsafe { io.recv(order[pos - 1], ci, first.add(usize_of(a)), b - a)? });
        }
        (first, ids)
    };
    for ci in 0..nchunks {
        let (a, b) = range(ci);
        if pos > 0 {
            io.wait(&[ids[usize_of(ci)]])?;
        }
        if pos + 1 < nn {
            // SAFETY: the chunk is final and not written again during the op.
            unsafe { io.send(order[pos + 1], ci, buf.add(usize_of(a)), b - a)? };
        }
    }
    for j in 0..c.bufs.len() {
        // SAFETY: recv spans of count elements (the root's source is its send span).
        unsafe { copy(recv_ptr(c, j)?, buf, blk) };
    }
    Ok(())
}
