//! Collectives across nodes on the network thread: host buffers in and out (staged through
//! host memory for GPU buffers), the algorithm over the wire, or the switch session.
//!
//! May use: what `thread` may.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

use super::*;

impl Thread {
    pub(super) fn coll(&mut self, w: Option<&mut Wire>, mut coll: Coll, ops: Vec<Posted>) {
        let (Some(w), None) = (w, &self.broken) else {
            let msg = self.why_not_running();
            for p in ops {
                let c = p.op.comm;
                p.complete(c, status::ABORTED, Some(msg.clone()));
            }
            return;
        };
        let what = format!("{} seq {}", coll.kind.name(), coll.seq);
        w.progress = coll.seq + 1;
        let t0 = Instant::now();
        let deadline = t0 + self.s.op_timeout;
        let gpu = ops.iter().any(|p| p.cuda.is_some());
        let mut stage = Vec::new();
        let r = if gpu {
            self.stage_in(w, &mut coll, &ops, deadline, &mut stage)
        } else {
            Ok(())
        };
        let staged_in = t0.elapsed();
        let mut r = r
            .and_then(|()| self.exec_coll(w, &coll, deadline, &what))
            .map(|(alg, transport)| (alg, transport, t0.elapsed()));
        if gpu && let Ok(x) = r {
            r = self.stage_out(&ops, &stage).map(|()| x);
        }
        for (_, b) in stage {
            self.pool.give(b);
        }
        match r {
            Ok((alg, transport, ran)) => {
                tracing::trace!(target: "commd::net", comm = self.s.comm_id, op = coll.kind.name(), seq = coll.seq, bytes = coll.count * coll.dtype.size(), algorithm = alg, transport = transport, staged_in_us = u64::try_from(staged_in.as_micros()).unwrap_or(u64::MAX), ran_us = u64::try_from(ran.as_micros()).unwrap_or(u64::MAX), us = u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX), "executed");
                for p in ops {
                    if let Some(b) = p.bell() {
                        crate::cuda::signal_done(&b, b.ticket);
                    }
                    let c = p.op.comm;
                    p.complete(c, status::OK, None);
                }
            }
            Err(e) => {
                let (st, msg) = self.describe(&what, &e);
                for p in ops {
                    let c = p.op.comm;
                    p.complete(c, st, Some(msg.clone()));
                }
                self.fail(w, &what, e);
            }
        }
    }

    /// Runs a matched collective on host buffers: through the switch session when it can
    /// carry it, else the TCP/RDMA algorithms. Returns the algorithm and transport used.
    pub(super) fn exec_coll(
        &mut self,
        w: &mut Wire,
        coll: &Coll,
        deadline: Instant,
        what: &str,
    ) -> Result<(&'static str, &'static str), NetError> {
        let mut transport = "tcp";
        if self.sw.is_some() {
            match algo::switch_fits(coll) {
                Ok(true) => {
                    if self.switch_op(w, coll, deadline, what)? {
                        return Ok(("switch", "switch"));
                    }
                    transport = "tcp (switch could not carry the values)";
                }
                Ok(false) => {}
                Err(why) => {
                    if self.sw_skipped.insert(why.clone()) {
                        tracing::info!(target: "commd::net", "{}: {why}; such all-reduces go over TCP", self.s.label);
                    }
                }
            }
        }
        let topo = self.s.topo.clone();
        let tuning = self.ctx.tuning;
        let alg = algo::run(
            w,
            &topo,
            coll,
            &mut self.scratch,
            &tuning,
            deadline,
            what.to_string(),
        )?;
        Ok((alg, transport))
    }

    /// Host staging of a GPU collective, before it runs: waits until every local rank's
    /// stream has reached the op (pumping the wire meanwhile), copies each rank's input into
    /// a pinned host buffer, and points `coll`'s buffers at host memory. `stage` receives the
    /// buffers (rank, input or output) for `stage_out` and the pool.
    pub(super) fn stage_in(
        &mut self,
        w: &mut Wire,
        coll: &mut Coll,
        ops: &[Posted],
        deadline: Instant,
        stage: &mut Vec<(bool, staging::Pinned)>,
    ) -> Result<(), NetError> {
        let cuda = crate::cuda::get().map_err(NetError::Local)?;
        let bells: Vec<crate::cuda::Bell> = ops.iter().filter_map(|p| p.bell()).collect();
        let t0 = Instant::now();
        loop {
            if let Some(b) = bells.iter().find(|b| b.session.is_closed()) {
                return Err(NetError::LocalRank(
                    status::PEER_LOST,
                    format!(
                        "rank {} (pid {}) was lost during the op",
                        b.rank,
                        b.session.pid()
                    ),
                ));
            }
            if bells.iter().all(|b| b.ready(0)) {
                break;
            }
            if Instant::now() > deadline {
                let late = crate::cuda::late_streams(&bells, 0);
                return Err(NetError::LocalRank(
                    status::TIMEOUT,
                    format!(
                        "timed out after {:.1} s waiting for the GPU streams of {} to reach the op; is that rank's stream blocked behind other work?",
                        t0.elapsed().as_secs_f64(),
                        late.join(", ")
                    ),
                ));
            }
            // Spin briefly (a stream usually arrives within microseconds), then keep the
            // sockets moving at a gentler pace.
            let wait = if t0.elapsed() < Duration::from_millis(1) {
                None
            } else {
                Some(Instant::now() + Duration::from_micros(200))
            };
            w.pump(wait, algo::sig_text)?;
        }
        let local = |e: commd_cuda::CuError| NetError::Local(format!("host staging: {e}"));
        let mut copies = Vec::new();
        let mut r = Ok(());
        'ops: for (p, (rank, bufs)) in ops.iter().zip(coll.bufs.iter_mut()) {
            debug_assert_eq!(p.rank, *rank);
            // In place (the same GPU range in and out): one host buffer serves both, and the
            // host algorithms run in place too (less memory traffic).
            let in_place = matches!(
                coll.kind,
                OpKind::AllReduce | OpKind::Broadcast | OpKind::Reduce
            ) && matches!((&p.gbufs.send, &p.gbufs.recv), (Some(s), Some(r)) if s.same_range(r));
            for (recv, g) in [(false, &p.gbufs.send), (true, &p.gbufs.recv)] {
                let Some(g) = g else { continue };
                if recv && in_place {
                    bufs.recv = bufs.send.clone();
                    if let Some((flag, _)) = stage.last_mut() {
                        *flag = true; // the input's buffer is also the output's
                    }
                    continue;
                }
                let (b, span) = match self.pool.take(cuda, g.bytes) {
                    Ok(b) => match b.span(g.bytes) {
                        Some(span) => (b, span),
                        None => {
                            r = Err(NetError::Local("host staging buffer too small".into()));
                            self.pool.give(b);
                            break 'ops;
                        }
                    },
                    Err(why) => {
                        r = Err(NetError::Local(why));
                        break 'ops;
                    }
                };
                if !recv && g.bytes > 0 {
                    // SAFETY: `b` is kept (in `stage`) until the copy's event is waited for
                    // below; the GPU span is bounds-checked and kept alive by the op.
                    match unsafe { cuda.copy_host(g, b.ptr(), false) } {
                        Ok(e) => copies.push(e),
                        Err(e) => r = Err(local(e)),
                    }
                }
                if recv {
                    bufs.recv = Some(span);
                } else {
                    bufs.send = Some(span);
                }
                stage.push((recv, b));
                if r.is_err() {
                    break 'ops;
                }
            }
        }
        for e in copies {
            if let Err(e) = cuda.wait_event(e) {
                r = r.and(Err(local(e)));
            }
        }
        r
    }

    /// Host staging of a GPU collective, after it ran: copies each rank's output from its
    /// host buffer into its GPU buffer and waits for the copies.
    pub(super) fn stage_out(
        &self,
        ops: &[Posted],
        stage: &[(bool, staging::Pinned)],
    ) -> Result<(), NetError> {
        let cuda = crate::cuda::get().map_err(NetError::Local)?;
        let mut outs = stage.iter().filter(|(recv, _)| *recv).map(|(_, b)| b);
        let mut copies = Vec::new();
        let mut r = Ok(());
        for p in ops {
            let Some(g) = &p.gbufs.recv else { continue };
            let Some(b) = outs.next() else {
                r = Err(NetError::Local(
                    "host staging: an output buffer is missing".into(),
                ));
                break;
            };
            if g.bytes == 0 {
                continue;
            }
            // SAFETY: the host buffer is held by the caller until this returns, after the
            // copies are waited for; the GPU span is bounds-checked and kept alive by the op.
            match unsafe { cuda.copy_host(g, b.ptr(), true) } {
                Ok(e) => copies.push(e),
                Err(e) => {
                    r = Err(NetError::Local(format!("host staging: {e}")));
                    break;
                }
            }
        }
        for e in copies {
            if let Err(e) = cuda.wait_event(e) {
                r = r.and(Err(NetError::Local(format!("host staging: {e}"))));
            }
        }
        r
    }
    /// Runs `coll` through the switch session: `Ok(false)` when a float32 block could not be
    /// carried (every node redoes the op over TCP).
    pub(super) fn switch_op(
        &mut self,
        w: &mut Wire,
        coll: &Coll,
        deadline: Instant,
        what: &str,
    ) -> Result<bool, NetError> {
        let Some(sw) = self.sw.as_mut() else {
            return Ok(false);
        };
        let via = self
            .s
            .switch
            .clone()
            .unwrap_or_else(|| self.ctx.switch.controller.clone());
        let r = algo::run_switch(
            w,
            &self.s.topo,
            coll,
            &mut self.scratch,
            sw,
            deadline,
            what.to_string(),
            &via,
        )?;
        if r == algo::SwitchRun::Unrepresentable {
            tracing::warn!(target: "commd::net", "{}: {what}: a float32 value is NaN, infinite or too large (>= 2^126) for the switch's block floating point; redoing it over TCP", self.s.label);
            return Ok(false);
        }
        Ok(true)
    }
}
