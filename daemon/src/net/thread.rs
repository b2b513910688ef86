//! The communicator's network thread (`commd-net-<id>`): connecting to the other nodes, its
//! command loop (collectives, cross-node p2p and the communicator's local steps, in posting
//! order), and failing everything with a message naming the node when something breaks.
//!
//! May use: `super` (wire, links, staging, algorithms), `posted`, `cuda` (done counters).

use super::*;

pub(super) struct Thread {
    pub(super) ctx: Arc<NetCtx>,
    pub(super) s: Setup,
    pub(super) broken: Option<(u32, String)>,
    pub(super) inflight: Vec<Inflight>,
    /// Host-staged GPU p2p ops waiting for a stream or a copy (see `StagedP2p`).
    pub(super) staged: Vec<StagedP2p>,
    pub(super) pool: staging::Pool,
    pub(super) scratch: Scratch,
    pub(super) sw: Option<crate::switch::worker::Worker>,
    pub(super) sw_info: Arc<Mutex<switchpath::SwitchInfo>>,
    /// Reasons already logged for ops the switch cannot take.
    pub(super) sw_skipped: std::collections::HashSet<String>,
}

pub(super) fn wake_dup(fd: &Arc<OwnedFd>) -> std::io::Result<OwnedFd> {
    Ok(rustix::io::fcntl_dupfd_cloexec(&**fd, 0)?)
}

impl Thread {
    /// Why an op cannot run: the communicator broke (its message), or it never connected.
    pub(super) fn why_not_running(&self) -> String {
        self.broken
            .clone()
            .map(|b| b.1)
            .unwrap_or_else(|| format!("{}: not connected", self.s.label))
    }

    pub(super) fn run(
        ctx: Arc<NetCtx>,
        s: Setup,
        rx: mpsc::Receiver<Cmd>,
        wake: Arc<OwnedFd>,
        sw_info: Arc<Mutex<switchpath::SwitchInfo>>,
    ) {
        let mut t = Thread {
            ctx,
            s,
            broken: None,
            inflight: Vec::new(),
            staged: Vec::new(),
            pool: staging::Pool::default(),
            scratch: Scratch::default(),
            sw: None,
            sw_info,
            sw_skipped: Default::default(),
        };
        let mut wire = match t.connect(&wake) {
            Ok(w) => Some(w),
            Err(why) => {
                let msg = format!("{}: connecting to the other nodes failed: {why}", t.s.label);
                tracing::warn!(target: "commd::net", "{msg}");
                t.break_comm(status::PEER_LOST, msg);
                None
            }
        };
        if let Some(w) = wire.as_mut() {
            let wanted =
                t.s.switch
                    .clone()
                    .unwrap_or_else(|| t.ctx.switch.controller.clone());
            match switchpath::setup(
                &t.ctx, &t.s.topo, w, &wanted, &t.s.token, &t.s.label, &wake, &t.sw_info,
            ) {
                Ok(sw) => t.sw = sw,
                Err(e) => t.fail(w, "switch session setup", e),
            }
        }
        let mut queue: VecDeque<Cmd> = VecDeque::new();
        let mut disconnected = false;
        loop {
            loop {
                match rx.try_recv() {
                    Ok(c) => queue.push_back(c),
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => {
                        disconnected = true;
                        break;
                    }
                }
            }
            if disconnected && queue.is_empty() {
                queue.push_back(Cmd::End);
            }
            // Commands that arrive while one runs find the wake fd already drained (the op's
            // own `pump` calls read it): after running any, look at the channel again before
            // sleeping. (Without this a stream of GPU ops, which clients post ahead of their
            // streams, stalled up to 1 s between ops.)
            let mut ran = false;
            while let Some(c) = queue.front() {
                let blocked = matches!(c, Cmd::Coll { .. })
                    && !(t.inflight.is_empty() && t.staged.is_empty())
                    && t.broken.is_none();
                if blocked {
                    break;
                }
                let Some(c) = queue.pop_front() else { break };
                ran = true;
                match c {
                    Cmd::End => {
                        t.fail_queue(&mut queue);
                        t.settle_staged();
                        if let Some(w) = wire.take() {
                            t.end(w);
                        }
                        return;
                    }
                    Cmd::Abort(st, msg) => {
                        if t.broken.is_none() {
                            if let Some(w) = wire.as_mut() {
                                w.abort(st, &msg, Duration::from_millis(500));
                            }
                            t.broken = Some((st, msg.clone()));
                            t.fail_inflight();
                        }
                    }
                    Cmd::Run(f) => f(),
                    Cmd::P2p(p) => t.post_p2p(wire.as_mut(), *p),
                    Cmd::Coll { coll, ops } => t.coll(wire.as_mut(), coll, ops),
                }
            }
            match wire.as_mut() {
                Some(w) if t.broken.is_none() => {
                    // Staged GPU ops wait on streams and copies, not sockets: poll those often.
                    let wait = if ran {
                        None
                    } else if t.staged.is_empty() {
                        Some(Instant::now() + Duration::from_secs(1))
                    } else {
                        Some(Instant::now() + Duration::from_micros(100))
                    };
                    let r = w.pump(wait, algo::sig_text);
                    let r = r
                        .and_then(|()| t.check_inflight(w))
                        .and_then(|()| t.progress_staged(w));
                    if let Err(e) = r {
                        t.fail(w, "", e);
                    }
                }
                _ => {
                    // Broken or never connected: only wait for commands to fail or End.
                    let mut fds = [rustix::event::PollFd::new(
                        &*wake,
                        rustix::event::PollFlags::IN,
                    )];
                    let ts = rustix::event::Timespec {
                        tv_sec: 1,
                        tv_nsec: 0,
                    };
                    let _ = rustix::event::poll(&mut fds, Some(&ts));
                    let mut b = [0u8; 8];
                    let _ = rustix::io::read(&*wake, &mut b);
                }
            }
        }
    }

    pub(super) fn connect(&mut self, wake: &Arc<OwnedFd>) -> Result<Wire, String> {
        let topo = &self.s.topo;
        let n = topo.nodes.len();
        let mine = self.ctx.offer();
        let mut kinds = vec![Transport::Tcp; n];
        let mut whys = vec![String::new(); n];
        for i in (0..n).filter(|&i| i != topo.me) {
            let theirs = self.s.offers.get(i).cloned().unwrap_or_default();
            let (t, why) = rdma::choose(&self.ctx.transport, &mine, &theirs, &topo.label(i))?;
            kinds[i] = t;
            whys[i] = why;
        }
        let rd = || {
            self.ctx
                .rdma
                .as_ref()
                .map_err(|e| format!("no RDMA transport: {e}"))
        };
        let mut links: Vec<Option<PeerLinks>> = (0..n).map(|_| None).collect();
        // Dial everyone first (the peers accept on their listener threads or peer service),
        // then collect what they opened to us.
        let mut txs: Vec<Option<Vec<Link>>> = (0..n).map(|_| None).collect();
        let mut nics: Vec<String> = vec!["-".into(); n];
        for (i, slot) in txs.iter_mut().enumerate() {
            if i == topo.me {
                continue;
            }
            let label = topo.label(i);
            let s = match kinds[i] {
                Transport::Tcp => {
                    let s = self
                        .ctx
                        .data
                        .dial(
                            &self.s.data_addrs[i],
                            &self.s.token,
                            &self.ctx.node,
                            self.ctx.streams,
                        )
                        .map_err(|e| format!("{label}: {e}"))?;
                    if let Some(a) = s.first().and_then(|s| s.local_addr().ok()) {
                        nics[i] = a.ip().to_string();
                    }
                    s.into_iter().map(Link::Tcp).collect()
                }
                Transport::Rdma => {
                    let r = rd()?;
                    let qps = u32::try_from(r.qps_per_peer)
                        .map_err(|_| format!("{label}: rdma_qps_per_peer out of range"))?;
                    let pend = (0..qps)
                        .map(|q| r.prepare(q, &topo.nodes[i]))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| format!("{label}: {e}"))?;
                    let locals: Vec<_> = pend.iter().map(|p| p.local.clone()).collect();
                    let remotes = peer_client::rdma_connect_blocking(
                        &topo.nodes[i],
                        &self.s.token,
                        &self.ctx.node,
                        &locals,
                        self.ctx.tls.as_ref(),
                    )
                    .map_err(|e| format!("{label}: RDMA connection setup: {e}"))?;
                    let mut devs: Vec<String> = locals.iter().map(|l| l.device.clone()).collect();
                    devs.dedup();
                    nics[i] = devs.join("+");
                    pend.into_iter()
                        .zip(remotes.iter())
                        .map(|(p, r)| p.connect(r).map(Link::Rdma))
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| format!("{label}: {e}"))?
                }
            };
            *slot = Some(s);
        }
        let deadline = Instant::now() + self.ctx.peer_timeout.max(Duration::from_secs(10));
        for (i, tx) in txs.into_iter().enumerate() {
            let Some(tx) = tx else { continue };
            let rx = match kinds[i] {
                Transport::Tcp => self
                    .ctx
                    .data
                    .take_incoming(&self.s.token, &topo.nodes[i], self.ctx.streams, deadline)
                    .map(|v| v.into_iter().map(Link::Tcp).collect()),
                Transport::Rdma => rd()?
                    .take_incoming(&self.s.token, &topo.nodes[i], tx.len(), deadline)
                    .map(|v| v.into_iter().map(Link::Rdma).collect()),
            }
            .map_err(|e| format!("{}: {e}", topo.label(i)))?;
            links[i] = Some(PeerLinks { tx, rx });
        }
        let wake = wake_dup(wake).map_err(|e| e.to_string())?;
        let mut w = Wire::new(
            topo.me,
            links,
            self.ctx.tuning.chunk,
            self.ctx.peer_timeout,
            wake,
        )
        .map_err(|e| e.to_string())?;
        // One link per peer daemon and transport, shared by every communicator to it.
        for i in (0..n).filter(|&i| i != topo.me) {
            let kind = match kinds[i] {
                Transport::Tcp => "tcp",
                Transport::Rdma => "rdma",
            };
            w.links[i] = Some(crate::telemetry::register_link(
                crate::telemetry::LinkDesc {
                    name: &format!("{kind}:{}", topo.nodes[i]),
                    kind,
                    peer: &topo.nodes[i],
                    nic: &nics[i],
                },
            ));
        }
        let paths: Vec<String> = (0..n)
            .filter(|&i| i != topo.me)
            .map(|i| match kinds[i] {
                Transport::Tcp => format!(
                    "{}: TCP, {} stream(s) per direction ({})",
                    topo.label(i),
                    self.ctx.streams,
                    whys[i]
                ),
                Transport::Rdma => format!(
                    "{}: RDMA, {} RC QP(s) per direction on {} ({}); {}",
                    topo.label(i),
                    rd().map_or(0, |r| r.qps_per_peer),
                    nics[i],
                    whys[i],
                    rd().map_or_else(|e| e.to_string(), |r| r.gpu_path_text())
                ),
            })
            .collect();
        tracing::info!(
            target: "commd::net",
            "{}: node {} of {}, local {}; path to {}",
            self.s.label,
            topo.me,
            n,
            algo::ranks_text(topo.local()),
            paths.join("; path to ")
        );
        Ok(w)
    }

    pub(super) fn end(&mut self, mut w: Wire) {
        w.end(Duration::from_secs(1));
        // Give the peers a moment to end too, so their streams come back clean for reuse.
        let until = Instant::now() + Duration::from_millis(300);
        let n = self.s.topo.nodes.len();
        while Instant::now() < until && (0..n).any(|i| i != w.me() && !w.peer_ended(i)) {
            if w.pump(Some(until), algo::sig_text).is_err() {
                break;
            }
        }
        for (peer, tx, rx) in w.into_streams() {
            // TCP connections go back to the pool; RDMA queue pairs are closed here (their
            // registered rings go back to the device's pool).
            let tcp: Vec<_> = tx
                .into_iter()
                .filter_map(|l| match l {
                    Link::Tcp(s) => Some(s),
                    Link::Rdma(_) => None,
                })
                .collect();
            if !tcp.is_empty() {
                self.ctx.data.give_back(&self.s.data_addrs[peer], tcp);
            }
            for (s, clean) in rx {
                if let (Link::Tcp(s), true) = (s, clean) {
                    self.ctx.data.clone().await_bind(s);
                }
            }
        }
        tracing::debug!(target: "commd::net", "{}: ended", self.s.label);
    }

    /// Waits for the staging copies still running (every local rank has left): their host
    /// buffers are unpinned and freed with the thread.
    pub(super) fn settle_staged(&mut self) {
        let Ok(cuda) = crate::cuda::get() else { return };
        for s in &mut self.staged {
            if let Some(e) = s.copy.take() {
                let _ = cuda.wait_event(e);
            }
        }
    }

    pub(super) fn break_comm(&mut self, st: u32, msg: String) {
        if self.broken.is_none() {
            self.broken = Some((st, msg.clone()));
            self.fail_inflight();
            // A lost rank or a revoke stays what it is on every node (a survivor shrinks on
            // it); anything else aborts the communicator.
            match st {
                status::PEER_LOST | status::REVOKED => (self.s.on_fail)(st, msg),
                _ => (self.s.on_fail)(
                    status::ABORTED,
                    format!("aborted after an earlier error: {msg}"),
                ),
            }
        }
    }

    pub(super) fn fail_inflight(&mut self) {
        let (st, msg) = self
            .broken
            .clone()
            .unwrap_or((status::ABORTED, String::new()));
        // Staging buffers go back to the pool, not away: the wire may still point into them
        // until it is dropped (before the pool), and a copy may still be running.
        for f in std::mem::take(&mut self.inflight) {
            let c = f.p.op.comm;
            f.p.complete(c, st, Some(msg.clone()));
            if let Some(b) = f.stage {
                self.pool.give(b);
            }
        }
        for s in std::mem::take(&mut self.staged) {
            if let (Some(e), Ok(cuda)) = (s.copy, crate::cuda::get()) {
                let _ = cuda.wait_event(e);
            }
            let c = s.p.op.comm;
            s.p.complete(c, st, Some(msg.clone()));
            self.pool.give(s.buf);
        }
    }

    pub(super) fn fail_queue(&mut self, q: &mut VecDeque<Cmd>) {
        let msg = self
            .broken
            .clone()
            .map(|b| b.1)
            .unwrap_or_else(|| format!("{}: communicator destroyed", self.s.label));
        for c in q.drain(..) {
            match c {
                Cmd::Coll { ops, .. } => {
                    for p in ops {
                        let c = p.op.comm;
                        p.complete(c, status::ABORTED, Some(msg.clone()));
                    }
                }
                Cmd::P2p(p) => {
                    let c = p.op.comm;
                    p.complete(c, status::ABORTED, Some(msg.clone()));
                }
                Cmd::Run(f) => f(),
                Cmd::Abort(..) | Cmd::End => {}
            }
        }
        self.fail_inflight();
    }

    /// The error text of `e`, naming nodes by their ranks.
    pub(super) fn describe(&self, what: &str, e: &NetError) -> (u32, String) {
        let t = &self.s.topo;
        let pre = if what.is_empty() {
            self.s.label.clone()
        } else {
            format!("{}: {what}", self.s.label)
        };
        match e {
            NetError::PeerLost { node, why } => (
                status::PEER_LOST,
                format!("{pre}: lost {}: {why}", t.label(*node)),
            ),
            NetError::Aborted { node, st, msg } => {
                (*st, format!("{msg} (reported by {})", t.label(*node)))
            }
            NetError::Mismatch(m) => (
                status::MISMATCH,
                format!(
                    "{pre}: mismatched collective across nodes: {}",
                    name_nodes(t, m)
                ),
            ),
            NetError::Timeout(m) => (status::TIMEOUT, format!("{pre}: {m}")),
            NetError::Local(m) => (status::INTERNAL, format!("{pre}: {m}")),
            NetError::LocalRank(st, m) => (*st, format!("{pre}: {m}")),
        }
    }

    pub(super) fn fail(&mut self, w: &mut Wire, what: &str, e: NetError) {
        let (st, msg) = self.describe(what, &e);
        tracing::warn!(target: "commd::net", "{msg}");
        if !matches!(e, NetError::Aborted { .. }) {
            w.abort(st, &msg, Duration::from_millis(500));
        }
        self.break_comm(st, msg);
    }
}

/// Replaces "node N" in wire messages by the node's label (ranks and address).
pub(super) fn name_nodes(t: &Topo, m: &str) -> String {
    let mut out = m.to_string();
    for i in (0..t.nodes.len()).rev() {
        out = out.replace(&format!("node {i} "), &format!("{} ", t.label(i)));
    }
    out
}
