//! Cross-node send/recv on the network thread: ops posted on the wire, host-staged GPU
//! sends and receives (waiting for their streams and copies), and their completion.
//!
//! May use: what `thread` may.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

use super::*;

pub(super) struct Inflight {
    pub(super) p: Posted,
    pub(super) send: Option<SendId>,
    pub(super) recv: Option<RecvId>,
    pub(super) since: Instant,
    /// GPU p2p: the host staging buffer the wire reads or writes.
    pub(super) stage: Option<staging::Pinned>,
}

/// A host-staged GPU send or recv outside the wire: a send waits for its stream and its copy
/// to host memory before it is posted; a received message waits for the receiver's stream (its
/// buffer free) and its copy to the GPU before the op completes.
pub(super) struct StagedP2p {
    pub(super) p: Posted,
    pub(super) buf: staging::Pinned,
    pub(super) copy: Option<(usize, commd_cuda::sys::CUevent)>,
    pub(super) since: Instant,
}

pub(super) fn p2p_sig(p: &Posted) -> Sig {
    Sig {
        op: u8::try_from(OpKind::Send.code()).expect("every op code is below 256"),
        dtype: p.op.dtype.code(),
        redop: 0xff,
        root: 0,
        count: p.op.count,
    }
}

impl Thread {
    pub(super) fn post_p2p(&mut self, w: Option<&mut Wire>, p: Posted) {
        let (Some(w), None) = (w, &self.broken) else {
            let msg = self.why_not_running();
            let c = p.op.comm;
            p.complete(c, status::ABORTED, Some(msg));
            return;
        };
        if p.cuda.is_some() {
            // Host staging: a send goes to the wire once its stream is there and its data is
            // in host memory (`progress_staged`); a recv lands in host memory first.
            let bytes = p.op.count * p.op.dtype.size();
            let buf = crate::cuda::get().and_then(|c| self.pool.take(c, bytes));
            match buf {
                Ok(buf) if p.op.kind == OpKind::Send => self.staged.push(StagedP2p {
                    p,
                    buf,
                    copy: None,
                    since: Instant::now(),
                }),
                Ok(buf) => self.post_wire(w, p, Some(buf)),
                Err(why) => {
                    let msg = format!("{}: {}: host staging: {why}", self.s.label, p2p_what(&p));
                    let c = p.op.comm;
                    p.complete(c, status::INTERNAL, Some(msg));
                }
            }
            return;
        }
        self.post_wire(w, p, None);
    }

    /// Posts a p2p op's message to the wire, from or into its host buffer (`stage` for a
    /// host-staged GPU op).
    pub(super) fn post_wire(&mut self, w: &mut Wire, p: Posted, stage: Option<staging::Pinned>) {
        let t = &self.s.topo;
        let peer_rank = p.op.peer;
        let node = t.rank_node[peer_rank as usize];
        let sig = p2p_sig(&p);
        let (src, dst) = if p.op.kind == OpKind::Send {
            (p.rank, peer_rank)
        } else {
            (peer_rank, p.rank)
        };
        let a = (u64::from(src) << 32) | u64::from(dst);
        let bytes = p.op.count * p.op.dtype.size();
        let host = |s: &Option<crate::engine::Span>| match (&stage, s) {
            (Some(b), _) => b.ptr(),
            (None, Some(s)) => s.ptr(),
            (None, None) => std::ptr::NonNull::<u8>::dangling().as_ptr(),
        };
        let r = if p.op.kind == OpKind::Send {
            let ptr = host(&p.bufs.send);
            // SAFETY: the span stays alive with the Posted op until it completes.
            unsafe {
                w.send(
                    node,
                    Tag {
                        class: CLASS_P2P,
                        a,
                        b: p.seq,
                    },
                    &sig,
                    ptr,
                    commd_proto::num::usize_of(bytes),
                )
            }
            .map(|id| (Some(id), None))
        } else {
            let ptr = host(&p.bufs.recv);
            // SAFETY: as above; nothing else writes the recv span while the op is pending.
            unsafe {
                w.recv(
                    node,
                    Tag {
                        class: CLASS_P2P,
                        a,
                        b: p.seq,
                    },
                    Some(sig),
                    ptr,
                    bytes,
                    algo::sig_text,
                )
            }
            .map(|id| (None, Some(id)))
        };
        match r {
            Ok((send, recv)) => self.inflight.push(Inflight {
                p,
                send,
                recv,
                since: Instant::now(),
                stage,
            }),
            Err(e) => {
                let what = p2p_what(&p);
                let c = p.op.comm;
                let (st, msg) = self.describe(&what, &e);
                p.complete(c, st, Some(msg));
                if let Some(b) = stage {
                    self.pool.give(b);
                }
            }
        }
    }

    /// Moves host-staged GPU p2p ops along: a send whose stream has reached it gets its copy
    /// to host memory, then goes to the wire; a received message whose receiver's stream has
    /// reached the recv gets its copy to the GPU, then the op completes. An error (a local
    /// rank lost, a stream that never arrives, a failed copy) breaks the communicator.
    pub(super) fn progress_staged(&mut self, w: &mut Wire) -> Result<(), NetError> {
        if self.staged.is_empty() {
            return Ok(());
        }
        let cuda = crate::cuda::get().map_err(NetError::Local)?;
        let mut i = 0;
        while i < self.staged.len() {
            let s = &mut self.staged[i];
            let send = s.p.op.kind == OpKind::Send;
            if let Some(e) = &s.copy {
                let done = cuda.event_done(e);
                if matches!(done, Ok(false)) {
                    i += 1;
                    continue;
                }
                let mut s = self.staged.swap_remove(i);
                if let Some(e) = s.copy.take() {
                    cuda.release_event(e);
                }
                if let Err(e) = done {
                    let what = p2p_what(&s.p);
                    self.staged.push(s);
                    return Err(NetError::Local(format!("{what}: host staging copy: {e}")));
                }
                if send {
                    self.post_wire(w, s.p, Some(s.buf));
                } else {
                    self.pool.give(s.buf);
                    staged_done(s.p);
                }
                continue;
            }
            let Some(b) = s.p.bell() else {
                i += 1;
                continue;
            };
            if b.session.is_closed() {
                return Err(NetError::LocalRank(
                    status::PEER_LOST,
                    format!(
                        "rank {} (pid {}) was lost during {}",
                        b.rank,
                        b.session.pid(),
                        p2p_what(&s.p)
                    ),
                ));
            }
            if !b.ready(0) {
                if s.since.elapsed() > self.s.op_timeout {
                    return Err(NetError::LocalRank(
                        status::TIMEOUT,
                        format!(
                            "{} timed out after {:.1} s: rank {}'s stream never reached it (it signalled {}, the op needs {})",
                            p2p_what(&s.p),
                            s.since.elapsed().as_secs_f64(),
                            b.rank,
                            b.ready_value(),
                            b.ticket
                        ),
                    ));
                }
                i += 1;
                continue;
            }
            let g = if send {
                &s.p.gbufs.send
            } else {
                &s.p.gbufs.recv
            };
            match g.as_ref().filter(|g| g.bytes > 0) {
                Some(g) => {
                    // SAFETY: the buffer stays in `self.staged` (or, on failure, in the pool)
                    // until the copy's event completes; the GPU span lives with the op.
                    let e = unsafe { cuda.copy_host(g, s.buf.ptr(), !send) }.map_err(|e| {
                        NetError::Local(format!("{}: host staging copy: {e}", p2p_what(&s.p)))
                    })?;
                    s.copy = Some(e);
                    s.since = Instant::now();
                    i += 1;
                }
                None => {
                    // Nothing to copy: on to the wire, or done.
                    let s = self.staged.swap_remove(i);
                    if send {
                        self.post_wire(w, s.p, Some(s.buf));
                    } else {
                        self.pool.give(s.buf);
                        staged_done(s.p);
                    }
                }
            }
        }
        Ok(())
    }

    pub(super) fn check_inflight(&mut self, w: &mut Wire) -> Result<(), NetError> {
        let now = Instant::now();
        let mut i = 0;
        while i < self.inflight.len() {
            let f = &self.inflight[i];
            let done = f.send.is_none_or(|s| w.send_done(s))
                && f.recv.as_ref().is_none_or(|r| w.recv_done(r));
            if done {
                let f = self.inflight.swap_remove(i);
                if let Some(s) = f.send {
                    w.release_send(s);
                }
                if let Some(r) = &f.recv {
                    w.release_recv(r);
                }
                match f.stage {
                    None => {
                        let c = f.p.op.comm;
                        f.p.complete(c, status::OK, None);
                    }
                    Some(buf) if f.p.op.kind == OpKind::Send => {
                        self.pool.give(buf);
                        staged_done(f.p);
                    }
                    // The data is in host memory; its copy to the GPU waits for the stream.
                    Some(buf) => self.staged.push(StagedP2p {
                        p: f.p,
                        buf,
                        copy: None,
                        since: Instant::now(),
                    }),
                }
                continue;
            }
            if let Some(r) = &f.recv
                && w.peer_ended(r.peer)
            {
                return Err(NetError::PeerLost {
                    node: r.peer,
                    why: format!(
                        "it left the communicator while {} was pending",
                        p2p_what(&f.p)
                    ),
                });
            }
            if now.duration_since(f.since) > self.s.op_timeout {
                return Err(NetError::Timeout(format!(
                    "{} timed out after {:.1} s: rank {} never posted the matching {}",
                    p2p_what(&f.p),
                    self.s.op_timeout.as_secs_f64(),
                    f.p.op.peer,
                    if f.p.op.kind == OpKind::Send {
                        "recv"
                    } else {
                        "send"
                    }
                )));
            }
            i += 1;
        }
        Ok(())
    }
}

/// Completes a host-staged GPU op whose results are in place: its done counter, then its
/// completion.
pub(super) fn staged_done(p: Posted) {
    if let Some(b) = p.bell() {
        crate::cuda::signal_done(&b, b.ticket);
    }
    let c = p.op.comm;
    p.complete(c, status::OK, None);
}

pub(super) fn p2p_what(p: &Posted) -> String {
    if p.op.kind == OpKind::Send {
        format!("send rank {} -> rank {} #{}", p.rank, p.op.peer, p.seq)
    } else {
        format!("recv rank {} <- rank {} #{}", p.rank, p.op.peer, p.seq)
    }
}
