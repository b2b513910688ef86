//! Turning matched ops into steps: a collective's argument check and plan (host engine, GPU
//! copy phases, or the net thread across nodes), a send/recv pair's checks and plan, and the
//! mismatch messages that name the ranks and fields that disagree.
//!
//! May use what `comm` uses (`cuda` plans and jobs, `engine` plans, `net` commands).

use super::*;

impl Comm {
    pub(super) fn collective_step(&self, ops: Vec<Posted>) -> Step {
        let seq = ops[0].seq;
        let kind = ops[0].op.kind;
        if let Some(bad) = ops.iter().find(|p| p.invalid.is_some()) {
            let msg = format!(
                "{}: {} seq {seq}: rank {} posted an invalid op: {}",
                self.label(),
                bad.op.kind.name(),
                bad.rank,
                bad.invalid.clone().unwrap_or_default()
            );
            return invalid_all(ops, msg);
        }
        let sig0 = ops[0].signature();
        if ops.iter().any(|p| p.signature() != sig0) {
            return Step::Fail {
                ops: self.mismatch(ops),
                abort: None,
            };
        }
        let o = &ops[0].op;
        if let Some(why) = self.staging_mismatch(o) {
            let msg = format!("{}: {} seq {seq}: {why}", self.label(), kind.name());
            return invalid_all(ops, msg);
        }
        if self.net.get().is_some() {
            // GPU ops: the net thread stages them through host memory and fills in the
            // buffers (`net::staging`).
            let coll = net::algo::Coll {
                kind,
                dtype: o.dtype,
                redop: o.redop,
                count: o.count,
                root: o.peer,
                seq,
                bufs: ops.iter().map(|p| (p.rank, p.bufs.clone())).collect(),
            };
            let mut ops = ops;
            for p in &mut ops {
                p.transport = crate::telemetry::transport::TCP;
            }
            return Step::Net(net::Cmd::Coll { coll, ops });
        }
        if o.cuda_ticket.is_some() {
            return self.gpu_step(ops);
        }
        let bufs: Vec<RankBufs> = ops.iter().map(|p| p.bufs.clone()).collect();
        match engine::plan_collective(kind, o.dtype, o.redop, o.count, o.peer, &bufs) {
            Some(plan) => Step::Run { plan, ops },
            None => {
                let msg = format!(
                    "{}: {} seq {seq}: internal error building the plan",
                    self.label(),
                    kind.name()
                );
                Step::Fail {
                    ops: ops
                        .into_iter()
                        .map(|p| (p, status::INTERNAL, msg.clone()))
                        .collect(),
                    abort: None,
                }
            }
        }
    }

    /// A matched GPU op (collective: one op per rank in rank order; p2p: `[send, recv]`) becomes a
    /// job for the copy-engine executor.
    /// Why a GPU op's `HOST_STAGED` flag does not fit this communicator, if it does not.
    fn staging_mismatch(&self, o: &Op) -> Option<&'static str> {
        o.cuda_ticket?;
        match (self.net.get().is_some(), o.staged) {
            (true, false) => Some(STAGED_MISSING),
            (false, true) => Some(
                "GPU op flagged host-staged on a communicator within one node (client and daemon disagree on the communicator's nodes)",
            ),
            _ => None,
        }
    }

    fn gpu_step(&self, ops: Vec<Posted>) -> Step {
        let o = ops[0].op;
        let what = ops[0].describe();
        let label = format!("{}: {what}", self.label());
        let fail = |ops: Vec<Posted>, st: u32, why: String| {
            let msg = format!("{label}: {why}");
            Step::Fail {
                ops: ops.into_iter().map(|p| (p, st, msg.clone())).collect(),
                abort: None,
            }
        };
        if let Some(why) = ops.iter().find_map(|p| self.staging_mismatch(&p.op)) {
            return fail(ops, status::INVALID, why.to_string());
        }
        let c = match cuda::get() {
            Ok(c) => c,
            Err(why) => {
                return fail(
                    ops,
                    status::INVALID,
                    format!("GPU op, but this daemon has no CUDA: {why}"),
                );
            }
        };
        let phases = if o.kind.is_p2p() {
            match (ops[0].gbufs.send.clone(), ops[1].gbufs.recv.clone()) {
                (Some(src), Some(dst)) if src.bytes > 0 => Ok(vec![cuda::Phase {
                    early: Vec::new(),
                    main: vec![cuda::CopyOp {
                        src,
                        dst,
                        after: None,
                    }],
                }]),
                _ => Ok(vec![cuda::Phase::default()]),
            }
        } else {
            let bufs: Vec<GpuBufs> = ops.iter().map(|p| p.gbufs.clone()).collect();
            let scratch = self
                .scratch
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if o.kind.reduces() {
                for (r, p) in ops.iter().enumerate() {
                    let on = |b: &Option<GpuSpan>| b.as_ref().map(|s| s.mem.gpu);
                    let sc = scratch[r].as_ref().map(|s| s.mem.gpu);
                    let devs = [on(&p.gbufs.send), on(&p.gbufs.recv)];
                    if self.nranks > 1 && devs.iter().flatten().any(|d| Some(*d) != sc) {
                        return fail(
                            ops,
                            status::INVALID,
                            format!(
                                "rank {r}'s buffers are not on the GPU its communicator scratch lives on (one GPU per rank and communicator)"
                            ),
                        );
                    }
                }
            }
            cuda::plan(
                o.kind,
                o.dtype,
                o.redop,
                o.count,
                o.peer,
                &bufs,
                &scratch,
                c.slot_bytes,
                o.one_shot,
            )
        };
        let phases = match phases {
            Ok(p) => p,
            Err(why) => return fail(ops, status::INVALID, why),
        };
        // The scratch its reductions use, shared with the ranks' other communicators.
        let mut scratch_keys: Vec<usize> = if o.kind.reduces() && !o.kind.is_p2p() {
            self.scratch
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .iter()
                .flatten()
                .map(|s| Arc::as_ptr(&s.mem) as usize)
                .collect()
        } else {
            Vec::new()
        };
        scratch_keys.sort_unstable();
        scratch_keys.dedup();
        let mut bells = Vec::with_capacity(ops.len());
        for p in &ops {
            let Some(t) = p.cuda else {
                return fail(
                    ops,
                    status::INTERNAL,
                    "GPU op without a doorbell (internal error)".into(),
                );
            };
            if t.phases as usize != phases.len() {
                let why = format!(
                    "rank {} expects {} doorbell phases, the daemon planned {} (client and daemon disagree on gpu_scratch_slot_bytes?)",
                    p.rank,
                    t.phases,
                    phases.len()
                );
                return fail(ops, status::INVALID, why);
            }
            bells.push(cuda::Bell {
                session: p.session.clone() as Arc<dyn cuda::Client>,
                rank: p.rank,
                slot: t.slot,
                ticket: t.ticket,
                graph: t.graph,
                comm_slot: t.comm_slot,
            });
        }
        Step::Gpu(cuda::GpuJob {
            span: report::op_span(self, &ops, "ce_push", "cuda_ce"),
            comm_id: self.id,
            label,
            bells,
            phases,
            ops: ops
                .into_iter()
                .map(|p| Box::new(p) as Box<dyn cuda::Done>)
                .collect(),
            timeout: self.op_timeout,
            pacer: self.pacer.clone(),
            persistent: o.persistent,
            graph_tag: o.graph_tag,
            scratch: scratch_keys,
        })
    }

    /// The error for a sequence number whose ranks disagree: names the fields and the ranks.
    fn mismatch(&self, ops: Vec<Posted>) -> Vec<(Posted, u32, String)> {
        let seq = ops[0].seq;
        let field = |f: &dyn Fn(&Op) -> String| -> Option<String> {
            let vals: Vec<String> = ops.iter().map(|p| f(&p.op)).collect();
            if vals.iter().all(|v| *v == vals[0]) {
                return None;
            }
            let mut groups: Vec<(String, Vec<u32>)> = Vec::new();
            for (p, v) in ops.iter().zip(vals) {
                match groups.iter_mut().find(|(g, _)| *g == v) {
                    Some((_, rs)) => rs.push(p.rank),
                    None => groups.push((v, vec![p.rank])),
                }
            }
            Some(
                groups
                    .iter()
                    .map(|(v, rs)| format!("{v} on {}", ranks(rs)))
                    .collect::<Vec<_>>()
                    .join(" vs "),
            )
        };
        let mut diffs = Vec::new();
        let fields: [(&str, &FieldFn); 7] = [
            ("cuda graph", &|o: &Op| {
                if o.persistent { "captured" } else { "eager" }.to_string()
            }),
            ("memory", &|o: &Op| {
                if o.cuda_ticket.is_some() {
                    "cuda"
                } else {
                    "host"
                }
                .to_string()
            }),
            ("op", &|o: &Op| o.kind.name().to_string()),
            ("dtype", &|o: &Op| o.dtype.name().to_string()),
            ("count", &|o: &Op| o.count.to_string()),
            ("reduction", &|o: &Op| {
                o.redop.map(|r| r.name()).unwrap_or("none").to_string()
            }),
            ("root", &|o: &Op| {
                if o.kind.has_root() {
                    o.peer.to_string()
                } else {
                    "none".into()
                }
            }),
        ];
        for (name, f) in fields {
            if let Some(d) = field(f) {
                diffs.push(format!("{name}: {d}"));
            }
        }
        let msg = format!(
            "{}: mismatched collective at seq {seq}: {}",
            self.label(),
            diffs.join("; ")
        );
        tracing::warn!(target: "commd::comm", "{msg}");
        ops.into_iter()
            .map(|p| (p, status::MISMATCH, msg.clone()))
            .collect()
    }

    pub(super) fn p2p_step(&self, send: Posted, recv: Posted) -> Step {
        let bad = send
            .invalid
            .clone()
            .map(|w| (send.rank, w))
            .or_else(|| recv.invalid.clone().map(|w| (recv.rank, w)));
        if let Some((r, why)) = bad {
            let msg = format!(
                "{}: send rank {} -> rank {} #{}: rank {r} posted an invalid op: {why}",
                self.label(),
                send.rank,
                recv.rank,
                send.seq
            );
            return Step::Fail {
                ops: vec![
                    (send, status::INVALID, msg.clone()),
                    (recv, status::INVALID, msg),
                ],
                abort: None,
            };
        }
        let sb = send.op.count * send.op.dtype.size();
        let rb = recv.op.count * recv.op.dtype.size();
        if send.op.dtype != recv.op.dtype || send.op.count != recv.op.count {
            let msg = format!(
                "{}: mismatched send/recv #{}: rank {} sends {} x {} ({sb} bytes) to rank {}, which receives {} x {} ({rb} bytes)",
                self.label(),
                send.seq,
                send.rank,
                send.op.count,
                send.op.dtype.name(),
                recv.rank,
                recv.op.count,
                recv.op.dtype.name()
            );
            return Step::Fail {
                ops: vec![
                    (send, status::MISMATCH, msg.clone()),
                    (recv, status::MISMATCH, msg),
                ],
                abort: None,
            };
        }
        // Both sides must agree on the memory kind, and on being captured into a CUDA graph:
        // (which side has the property, message).
        let kinds: [(bool, bool, &str); 2] = [
            (
                send.cuda.is_some(),
                recv.cuda.is_some(),
                "uses GPU memory but rank {h} host memory; both sides of a transfer must use the same kind",
            ),
            (
                send.op.persistent,
                recv.op.persistent,
                "captured its side into a CUDA graph but rank {h} issued its side eagerly; both sides must be captured (or neither)",
            ),
        ];
        if let Some(&(s_has, _, what)) = kinds.iter().find(|(a, b, _)| a != b) {
            let (g, h) = if s_has {
                (send.rank, recv.rank)
            } else {
                (recv.rank, send.rank)
            };
            let msg = format!(
                "{}: send/recv #{}: rank {g} {}",
                self.label(),
                send.seq,
                what.replace("{h}", &h.to_string())
            );
            return Step::Fail {
                ops: vec![
                    (send, status::MISMATCH, msg.clone()),
                    (recv, status::MISMATCH, msg),
                ],
                abort: None,
            };
        }
        if send.cuda.is_some() {
            return self.gpu_step(vec![send, recv]);
        }
        match (send.bufs.send.clone(), recv.bufs.recv.clone()) {
            (Some(s), Some(r)) => Step::Run {
                plan: engine::plan_p2p(send.op.dtype, s, r),
                ops: vec![send, recv],
            },
            _ if sb == 0 => {
                let plan = engine::Plan {
                    dtype: send.op.dtype,
                    nranks: 2,
                    tasks: vec![],
                };
                Step::Run {
                    plan,
                    ops: vec![send, recv],
                }
            }
            _ => {
                let msg = format!(
                    "{}: send/recv #{}: internal error: missing buffer",
                    self.label(),
                    send.seq
                );
                Step::Fail {
                    ops: vec![
                        (send, status::INTERNAL, msg.clone()),
                        (recv, status::INTERNAL, msg),
                    ],
                    abort: None,
                }
            }
        }
    }
}
