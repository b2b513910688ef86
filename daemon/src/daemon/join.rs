//! Forming communicators: unique ids, each rank's join (local, or through the root daemon of
//! a communicator that spans nodes, and the root's side of a peer's join), the pacing the
//! ranks vote for, withdrawals on timeout, destroying a communicator.
//!
//! May use: what `daemon` may (`comm`, `session`, `net`, `config`).

use super::*;

/// (communicator handle, daemon-wide id, doorbell slot).
/// A joined rank's communicator handle, daemon-wide id, doorbell slot, and node count.
/// A shrink's child: its parent's daemon-wide id and the parent ranks it left out.
pub(super) type ParentLink = (u64, Vec<u32>);

pub(super) type JoinResult = Result<(u32, u64, u32, u32), DaemonError>;

pub(super) struct Joiner {
    pub(super) session: Arc<Session>,
    pub(super) tx: oneshot::Sender<JoinResult>,
}

/// A rank of a communicator rooted here: local, or joined by another node's daemon.
pub(super) enum Slot {
    Local(Joiner),
    Remote {
        node: String,
        data_addr: String,
        rdma: crate::net::rdma::Offer,
        pid: i32,
        tx: oneshot::Sender<Result<pb::PeerJoinReply, DaemonError>>,
    },
}

impl Slot {
    pub(super) fn session_id(&self) -> Option<u64> {
        match self {
            Slot::Local(j) => Some(j.session.id),
            Slot::Remote { .. } => None,
        }
    }

    pub(super) fn pid(&self) -> i32 {
        match self {
            Slot::Local(j) => j.session.pid,
            Slot::Remote { pid, .. } => *pid,
        }
    }

    pub(super) fn fail(self, e: DaemonError) {
        match self {
            Slot::Local(j) => {
                let _ = j.tx.send(Err(e));
            }
            Slot::Remote { tx, .. } => {
                let _ = tx.send(Err(e));
            }
        }
    }
}

pub(super) struct PendingJoin {
    pub(super) nranks: u32,
    pub(super) op_timeout: Duration,
    /// The ranks joined so far (a map: memory in proportion to the ranks that joined, not to
    /// the nranks a first caller claims).
    pub(super) members: BTreeMap<u32, Slot>,
    pub(super) pacing: Option<PacingVote>,
    /// A shrink's child: the survivors' exclude list, as the first of them gave it.
    pub(super) shrink: Option<ShrinkVote>,
}

/// This node's ranks of a communicator rooted at another node, waiting for the root's answer.
pub(super) struct RemoteJoin {
    pub(super) nranks: u32,
    pub(super) op_timeout: Duration,
    pub(super) root: String,
    pub(super) local: HashMap<u32, Joiner>,
    pub(super) pacing: Option<PacingVote>,
    pub(super) shrink: Option<ShrinkVote>,
}

/// A rank's creation-time options from `CreateCommunicatorRequest`.
#[derive(Clone, Copy, Debug, Default)]
pub struct JoinOpts {
    /// `None`: the daemon's `op_timeout_ms`.
    pub op_timeout: Option<Duration>,
    /// GPU copy pacing in bytes/s as resolved by [`Daemon::resolve_pacing`] (`None`: uncapped).
    pub pacing: Option<u64>,
}

/// The GPU pacing the first local rank of a forming communicator asked for. Pacing is per node
/// (one [`crate::pacing::Pacer`] in this daemon for all its ranks), so only this node's ranks
/// must agree; ranks on other nodes are paced by their own daemon.
#[derive(Clone, Copy, Debug)]
pub(super) struct PacingVote {
    pub(super) rank: u32,
    pub(super) rate: Option<u64>,
}

/// Records `rank`'s pacing in `vote`, or refuses it if an earlier local rank asked for another.
fn vote_pacing(
    vote: &mut Option<PacingVote>,
    short: &str,
    rank: u32,
    rate: Option<u64>,
) -> Result<(), DaemonError> {
    match *vote {
        Some(v) if v.rate != rate => Err(DaemonError::InvalidArgument(format!(
            "rank {rank} joins communicator {short} with GPU pacing {}, but rank {} joined with {}; every rank of a communicator on a node must ask for the same pacing (pacing_bytes_per_sec; unset means the daemon's gpu_pacing_gbps)",
            crate::pacing::describe(rate),
            v.rank,
            crate::pacing::describe(v.rate)
        ))),
        Some(_) => Ok(()),
        None => {
            *vote = Some(PacingVote { rank, rate });
            Ok(())
        }
    }
}

impl Daemon {
    /// A fresh unique id for a session of `uid` (see [`crate::issued`] for the limits).
    pub fn unique_id(&self, uid: u32) -> UniqueId {
        let u = UniqueId::random_with_root(&self.node_id().unwrap_or_default());
        let cap = self.cfg.max_unique_ids_per_uid;
        let dropped = lock(&self.issued).insert(uid, u.token, Instant::now(), cap);
        if dropped > 0 {
            tracing::debug!(target: "commd::session", "uid {uid} holds {cap} unused unique ids (max_unique_ids_per_uid): dropped its {dropped} oldest");
        }
        u
    }

    /// Registers this rank for the communicator and returns a receiver that resolves once every
    /// rank has joined (or the communicator cannot form).
    /// Records a rank's per-communicator `switch` option ("" = the daemon's setting) before it
    /// joins; the first local rank that sets one decides for this node.
    pub fn note_switch(&self, uid_bytes: &[u8], value: &str) -> Result<(), DaemonError> {
        if value.is_empty() {
            return Ok(());
        }
        crate::switch::check_controller(value)
            .map_err(|e| DaemonError::InvalidArgument(format!("switch option '{value}': {e}")))?;
        let uid =
            UniqueId::decode(uid_bytes).map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
        let mut m = lock(&self.switch_opts);
        if m.len() > 4096 {
            m.clear();
        }
        m.entry(uid.token).or_insert_with(|| value.to_string());
        Ok(())
    }

    /// Memberships of `uid`'s sessions in communicators still forming (rooted here, or
    /// waiting for another node's root), counted in `max_comms_per_uid`.
    pub(super) fn pending_memberships(&self, uid: u32) -> usize {
        let here: usize = lock(&self.joins)
            .values()
            .map(|j| {
                j.members
                    .values()
                    .filter(|m| matches!(m, Slot::Local(jn) if jn.session.uid == uid))
                    .count()
            })
            .sum();
        let there: usize = lock(&self.remote_joins)
            .values()
            .map(|rj| rj.local.values().filter(|j| j.session.uid == uid).count())
            .sum();
        here + there
    }

    pub fn join(
        self: &Arc<Self>,
        session: Arc<Session>,
        uid_bytes: &[u8],
        rank: u32,
        nranks: u32,
        opts: JoinOpts,
        wait: Duration,
    ) -> Result<oneshot::Receiver<JoinResult>, DaemonError> {
        let uid =
            UniqueId::decode(uid_bytes).map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
        self.join_uid(session, uid, (rank, nranks), opts, wait, None)
    }

    /// Joins `rank` of `nranks` to `uid`: an issued id, or (`shrink`) a shrink's child, whose
    /// token the survivors derived from their parent's.
    pub(super) fn join_uid(
        self: &Arc<Self>,
        session: Arc<Session>,
        uid: UniqueId,
        (rank, nranks): (u32, u32),
        opts: JoinOpts,
        wait: Duration,
        shrink: Option<ShrinkVote>,
    ) -> Result<oneshot::Receiver<JoinResult>, DaemonError> {
        if self.is_shutting_down() {
            return Err(DaemonError::Unavailable("daemon is shutting down".into()));
        }
        let held = self.uid_usage(session.uid).communicators;
        if held >= self.cfg.max_comms_per_uid {
            return Err(DaemonError::ResourceExhausted(format!(
                "uid {} is a member of {held} communicators, its maximum (max_comms_per_uid={}); destroy unused ones first",
                session.uid, self.cfg.max_comms_per_uid
            )));
        }
        if nranks == 0 || nranks > commd_proto::desc::MAX_RANKS {
            return Err(DaemonError::InvalidArgument(format!(
                "nranks {nranks} must be in 1..={}",
                commd_proto::desc::MAX_RANKS
            )));
        }
        if rank >= nranks {
            return Err(DaemonError::InvalidArgument(format!(
                "rank {rank} is out of range for nranks {nranks}"
            )));
        }
        if !uid.root.is_empty() && Some(&uid.root) != self.node_id().as_ref() {
            return self.join_via_root(session, uid, (rank, nranks), opts, wait, shrink);
        }
        self.check_spoiled(&uid.token)?;
        let mut joins = lock(&self.joins);
        if let std::collections::hash_map::Entry::Vacant(e) = joins.entry(uid.token) {
            // A shrink's child needs no issued id: its token is derived from the parent's,
            // which this rank holds.
            if shrink.is_none() && !lock(&self.issued).take(&uid.token, Instant::now()) {
                return Err(DaemonError::NotFound(format!(
                    "unique id {} was not issued by this daemon, or its communicator already formed (ids are single-use, expire after 24 h unused, and a user's oldest unused ids are dropped beyond max_unique_ids_per_uid); an id made on another node by a daemon without a peer service (peer_listen=off, the default) can only be used on that node",
                    uid.short()
                )));
            }
            let op_timeout = opts.op_timeout.unwrap_or(self.cfg.op_timeout);
            crate::telemetry::comm_joining(&uid.token, nranks);
            e.insert(PendingJoin {
                nranks,
                op_timeout,
                members: BTreeMap::new(),
                pacing: None,
                shrink: None,
            });
        }
        let Some(j) = joins.get_mut(&uid.token) else {
            return Err(DaemonError::Internal("pending join vanished".into()));
        };
        if let Some(v) = shrink
            && let Err(why) = vote_shrink(&mut j.shrink, v)
        {
            // Every survivor that joined fails now, and so does every later one.
            if let Some(j) = joins.remove(&uid.token) {
                for m in j.members.into_values() {
                    m.fail(DaemonError::InvalidArgument(why.clone()));
                }
            }
            drop(joins);
            self.spoil(uid.token, &why);
            return Err(DaemonError::InvalidArgument(why));
        }
        if j.nranks != nranks {
            let first = j.members.keys().next().copied().unwrap_or(0);
            return Err(DaemonError::InvalidArgument(format!(
                "rank {rank} joins communicator {} with nranks={nranks}, but rank {first} joined with nranks={}",
                uid.short(),
                j.nranks
            )));
        }
        if let Some(m) = j.members.get(&rank) {
            return Err(DaemonError::AlreadyExists(format!(
                "rank {rank} of communicator {} already joined (pid {})",
                uid.short(),
                m.pid()
            )));
        }
        vote_pacing(&mut j.pacing, &uid.short(), rank, opts.pacing)?;
        let (tx, rx) = oneshot::channel();
        j.members.insert(rank, Slot::Local(Joiner { session, tx }));
        if j.members.len() == j.nranks as usize
            && let Some(j) = joins.remove(&uid.token)
        {
            drop(joins);
            self.form(uid, j);
        }
        Ok(rx)
    }

    /// Every rank of a communicator rooted here has joined: answer the other nodes with the
    /// membership and form this node's part.
    fn form(&self, uid: UniqueId, j: PendingJoin) {
        let me = self.node_id().unwrap_or_else(|| "local".into());
        let my_data = self
            .net
            .get()
            .map(|n| n.data.addr.to_string())
            .unwrap_or_default();
        let my_rdma = self.net.get().map(|n| n.offer()).unwrap_or_default();
        let mut reply = pb::PeerJoinReply::default();
        for m in j.members.values() {
            let (node, data, rdma) = match m {
                Slot::Local(_) => (me.clone(), my_data.clone(), my_rdma.clone()),
                Slot::Remote {
                    node,
                    data_addr,
                    rdma,
                    ..
                } => (node.clone(), data_addr.clone(), rdma.clone()),
            };
            let idx = match reply.nodes.iter().position(|n| n.node == node) {
                Some(i) => i,
                None => {
                    reply.nodes.push(pb::PeerNode {
                        node,
                        data_addr: data,
                        rdma: rdma.desc,
                        rdma_off: rdma.off,
                    });
                    reply.nodes.len() - 1
                }
            };
            reply
                .rank_node
                .push(u32::try_from(idx).expect("a node index is below the rank count, a u32"));
            reply.rank_pid.push(m.pid());
        }
        let mut local = HashMap::new();
        for (rank, m) in j.members {
            match m {
                Slot::Local(joiner) => {
                    local.insert(rank, joiner);
                }
                Slot::Remote { tx, .. } => {
                    let _ = tx.send(Ok(reply.clone()));
                }
            }
        }
        if !local.is_empty() {
            let pacing = j.pacing.map_or(self.cfg.gpu_pacing, |v| v.rate);
            let parent = j.shrink.and_then(ShrinkVote::parent_link);
            self.form_local(&uid, &reply, &me, (j.op_timeout, pacing, parent), local);
        }
    }

    /// The root answered: form this node's part of a communicator rooted elsewhere.
    fn form_remote(&self, uid: &UniqueId, reply: pb::PeerJoinReply) {
        let Some(rj) = lock(&self.remote_joins).remove(&uid.token) else {
            return;
        };
        let me = self.node_id().unwrap_or_default();
        let pacing = rj.pacing.map_or(self.cfg.gpu_pacing, |v| v.rate);
        let parent = rj.shrink.and_then(ShrinkVote::parent_link);
        self.form_local(uid, &reply, &me, (rj.op_timeout, pacing, parent), rj.local);
    }

    /// `limits`: the communicator's op timeout, GPU pacing (bytes/s, `None`: uncapped) and,
    /// for a shrink's child, its parent's id and the ranks left out.
    fn form_local(
        &self,
        uid: &UniqueId,
        reply: &pb::PeerJoinReply,
        me: &str,
        limits: (Duration, Option<u64>, Option<ParentLink>),
        mut local: HashMap<u32, Joiner>,
    ) {
        let (op_timeout, pacing, parent) = limits;
        let Ok(n) = u32::try_from(reply.rank_node.len()) else {
            return fail_joiners(
                uid,
                "the root's membership names more than u32::MAX ranks".into(),
                local,
            );
        };
        let my_node = reply.nodes.iter().position(|x| x.node == me);
        let Some(my_node) = my_node else {
            return fail_joiners(
                uid,
                "the root's membership does not include this node".into(),
                local,
            );
        };
        let mine: Vec<u32> = (0..n)
            .filter(|&r| reply.rank_node[r as usize] as usize == my_node)
            .collect();
        if mine.len() != local.len() || mine.iter().any(|r| !local.contains_key(r)) {
            return fail_joiners(
                uid,
                format!(
                    "ranks {:?} are on this node, but {:?} joined here",
                    mine,
                    local.keys().collect::<Vec<_>>()
                ),
                local,
            );
        }
        let id = self.new_id();
        let comm = Arc::new(Comm::new(
            id,
            uid.short(),
            members(reply, &local),
            op_timeout,
            self.cfg.workers,
            pacing,
        ));
        let _ = comm.lineage.set(crate::comm::Lineage {
            token: uid.token,
            rank_node: reply
                .rank_node
                .iter()
                .map(|&i| {
                    reply
                        .nodes
                        .get(i as usize)
                        .map_or_else(String::new, |x| x.node.clone())
                })
                .collect(),
            parent,
        });
        if reply.nodes.len() > 1
            && let Err(why) = self.start_comm_net(uid, reply, my_node, &comm, op_timeout)
        {
            return fail_joiners(uid, why, local);
        }
        lock(&self.comms).insert(id, comm.clone());
        tracing::info!(
            target: "commd::comm",
            "{} formed: {} node(s), local {}, GPU pacing {}",
            comm.label(),
            reply.nodes.len().max(1),
            crate::net::algo::ranks_text(&mine),
            crate::pacing::describe(pacing)
        );
        crate::comm::comm_formed(&comm, &uid.token);
        let nodes =
            u32::try_from(reply.nodes.len().max(1)).expect("nodes are at most the ranks, a u32");
        for rank in mine {
            let Some(m) = local.remove(&rank) else {
                continue;
            };
            hand_out(&comm, id, rank, nodes, m);
        }
    }

    /// Starts the network thread of a communicator that spans nodes; the error says why it
    /// cannot form.
    fn start_comm_net(
        &self,
        uid: &UniqueId,
        reply: &pb::PeerJoinReply,
        my_node: usize,
        comm: &Arc<Comm>,
        op_timeout: Duration,
    ) -> Result<(), String> {
        let Some(ctx) = self.net.get() else {
            return Err("spans nodes but this daemon has no peer service".into());
        };
        let topo = crate::net::algo::Topo::new(
            my_node,
            reply.nodes.iter().map(|x| x.node.clone()).collect(),
            reply.rank_node.iter().map(|&x| x as usize).collect(),
        );
        let weak = Arc::downgrade(comm);
        let setup = crate::net::Setup {
            token: uid.token,
            topo,
            data_addrs: reply.nodes.iter().map(|x| x.data_addr.clone()).collect(),
            offers: reply
                .nodes
                .iter()
                .map(|x| crate::net::rdma::Offer {
                    desc: x.rdma.clone(),
                    off: x.rdma_off.clone(),
                })
                .collect(),
            label: comm.label(),
            comm_id: comm.id,
            op_timeout,
            switch: lock(&self.switch_opts).remove(&uid.token),
            on_fail: Box::new(move |st, msg| {
                if let Some(c) = weak.upgrade() {
                    c.abort_rank(None, st, msg);
                }
            }),
        };
        match crate::net::start(ctx, setup) {
            Ok(h) => {
                let _ = comm.net.set(h);
                Ok(())
            }
            Err(e) => Err(format!("cannot start its network thread: {e}")),
        }
    }

    /// A local rank joins a communicator rooted at another node: ask its daemon.
    fn join_via_root(
        self: &Arc<Self>,
        session: Arc<Session>,
        uid: UniqueId,
        (rank, nranks): (u32, u32),
        opts: JoinOpts,
        wait: Duration,
        shrink: Option<ShrinkVote>,
    ) -> Result<oneshot::Receiver<JoinResult>, DaemonError> {
        let Some(net) = self.net.get().cloned() else {
            return Err(DaemonError::Unavailable(format!(
                "communicator {} is rooted at {} (another node), but this daemon has no peer service (peer_listen=off); enable it to join multi-node communicators",
                uid.short(),
                uid.root
            )));
        };
        let op_timeout = opts.op_timeout.unwrap_or(self.cfg.op_timeout);
        let (tx, rx) = oneshot::channel();
        let pid = session.pid;
        let req = pb::PeerJoinRequest {
            token: uid.token.to_vec(),
            nranks,
            rank,
            node: net.node.clone(),
            data_addr: net.data.addr.to_string(),
            rdma: net.offer().desc,
            rdma_off: net.offer().off,
            pid,
            // The root answers a little before the caller gives up, so its message (naming the
            // missing ranks) is the one the caller sees.
            timeout_ms: u64::try_from(
                wait.saturating_sub(Duration::from_millis(300))
                    .as_millis()
                    .max(1),
            )
            .unwrap_or(u64::MAX),
            op_timeout_ms: u64::try_from(op_timeout.as_millis()).unwrap_or(u64::MAX),
            ..Default::default()
        };
        let req = match &shrink {
            Some(v) => v.on_request(req),
            None => req,
        };
        self.check_spoiled(&uid.token)?;
        {
            let mut rj = lock(&self.remote_joins);
            let e = rj.entry(uid.token).or_insert_with(|| RemoteJoin {
                nranks,
                op_timeout,
                root: uid.root.clone(),
                local: HashMap::new(),
                pacing: None,
                shrink: None,
            });
            if let Some(v) = shrink
                && let Err(why) = vote_shrink(&mut e.shrink, v)
            {
                // This node's survivors fail now; the root hears the other list too, and fails
                // the rest (its answer to this request is not awaited).
                if let Some(e) = rj.remove(&uid.token) {
                    fail_joiners(&uid, why.clone(), e.local);
                }
                drop(rj);
                self.spoil(uid.token, &why);
                let tls = net.tls.clone();
                let root = uid.root.clone();
                tokio::spawn(async move {
                    let _ = crate::net::peer_client::join(&root, req, wait, tls.as_ref()).await;
                });
                return Err(DaemonError::InvalidArgument(why));
            }
            if e.nranks != nranks {
                return Err(DaemonError::InvalidArgument(format!(
                    "rank {rank} joins communicator {} with nranks={nranks}, but another rank on this node joined with nranks={}",
                    uid.short(),
                    e.nranks
                )));
            }
            if e.local.contains_key(&rank) {
                return Err(DaemonError::AlreadyExists(format!(
                    "rank {rank} of communicator {} already joined on this node",
                    uid.short()
                )));
            }
            vote_pacing(&mut e.pacing, &uid.short(), rank, opts.pacing)?;
            e.local.insert(rank, Joiner { session, tx });
        }
        let d = self.clone();
        tokio::spawn(async move {
            match crate::net::peer_client::join(&uid.root, req, wait, net.tls.as_ref()).await {
                Ok(reply) => d.form_remote(&uid, reply),
                Err(e) => {
                    let e = join_error(&uid.root, e);
                    let j = lock(&d.remote_joins)
                        .get_mut(&uid.token)
                        .and_then(|rj| rj.local.remove(&rank));
                    if let Some(j) = j {
                        let _ = j.tx.send(Err(e));
                    }
                }
            }
        });
        Ok(rx)
    }

    /// The root side of a peer's Join: validates the token and records the rank.
    pub fn peer_join(
        &self,
        r: &pb::PeerJoinRequest,
    ) -> Result<oneshot::Receiver<Result<pb::PeerJoinReply, DaemonError>>, DaemonError> {
        if self.is_shutting_down() {
            return Err(DaemonError::Unavailable("daemon is shutting down".into()));
        }
        let token: [u8; 16] = r.token.as_slice().try_into().map_err(|_| {
            crate::telemetry::ratelimit::warn_limited!(target: "commd::net", "rejected a join from node {}: malformed token", r.node);
            DaemonError::PermissionDenied("malformed communicator token".into())
        })?;
        let short: String = token[..4].iter().map(|b| format!("{b:02x}")).collect();
        let (rank, nranks) = (r.rank, r.nranks);
        if nranks == 0 || nranks > commd_proto::desc::MAX_RANKS || rank >= nranks {
            return Err(DaemonError::InvalidArgument(format!(
                "rank {rank} / nranks {nranks} out of range"
            )));
        }
        self.check_spoiled(&token)?;
        let shrink = if r.shrink {
            Some(self.admit_shrink(r, &token)?)
        } else {
            None
        };
        let mut joins = lock(&self.joins);
        if let std::collections::hash_map::Entry::Vacant(e) = joins.entry(token) {
            if shrink.is_none() && !lock(&self.issued).take(&token, Instant::now()) {
                crate::telemetry::ratelimit::warn_limited!(target: "commd::net", "rejected a join of rank {rank} from node {} (pid {}): unknown or stale token {short}..", r.node, r.pid);
                return Err(DaemonError::PermissionDenied(format!(
                    "communicator token {short}.. is not known to the root daemon: a wrong or stale unique id (ids are single-use; was the communicator already formed, or the root daemon restarted?)"
                )));
            }
            e.insert(PendingJoin {
                nranks,
                op_timeout: Duration::from_millis(r.op_timeout_ms.max(1)),
                members: BTreeMap::new(),
                pacing: None,
                shrink: None,
            });
        }
        let Some(j) = joins.get_mut(&token) else {
            return Err(DaemonError::Internal("pending join vanished".into()));
        };
        if let Some(v) = shrink
            && let Err(why) = vote_shrink(&mut j.shrink, v)
        {
            if let Some(j) = joins.remove(&token) {
                for m in j.members.into_values() {
                    m.fail(DaemonError::InvalidArgument(why.clone()));
                }
            }
            drop(joins);
            self.spoil(token, &why);
            return Err(DaemonError::InvalidArgument(why));
        }
        if j.nranks != nranks {
            let first = j.members.keys().next().copied().unwrap_or(0);
            return Err(DaemonError::InvalidArgument(format!(
                "rank {rank} (node {}) joins communicator {short} with nranks={nranks}, but rank {first} joined with nranks={}",
                r.node, j.nranks
            )));
        }
        if let Some(m) = j.members.get(&rank) {
            return Err(DaemonError::AlreadyExists(format!(
                "rank {rank} of communicator {short} already joined (pid {})",
                m.pid()
            )));
        }
        let (tx, rx) = oneshot::channel();
        j.members.insert(
            rank,
            Slot::Remote {
                node: r.node.clone(),
                data_addr: r.data_addr.clone(),
                rdma: crate::net::rdma::Offer {
                    desc: r.rdma.clone(),
                    off: r.rdma_off.clone(),
                },
                pid: r.pid,
                tx,
            },
        );
        if j.members.len() == j.nranks as usize
            && let Some(j) = joins.remove(&token)
        {
            drop(joins);
            self.form(
                UniqueId {
                    token,
                    root: String::new(),
                },
                j,
            );
        }
        Ok(rx)
    }

    /// A remote rank's join timed out at the root: withdraw it and name the missing ranks.
    pub fn peer_join_timed_out(&self, token: &[u8], rank: u32, waited: Duration) -> String {
        let Ok(token) = <[u8; 16]>::try_from(token) else {
            return "malformed token".into();
        };
        self.withdraw(&token, rank, waited)
    }

    /// Withdraws a rank that gave up waiting; returns the message naming the missing ranks.
    pub fn join_timed_out(&self, uid_bytes: &[u8], rank: u32, waited: Duration) -> String {
        let Ok(uid) = UniqueId::decode(uid_bytes) else {
            return "invalid unique id".into();
        };
        if let Some(rj) = lock(&self.remote_joins).get_mut(&uid.token) {
            rj.local.remove(&rank);
            if rj.local.is_empty() {
                rj.pacing = None;
            }
            return format!(
                "communicator {} (rooted at {}) did not form within {:.1} s; the root daemon did not answer in time",
                uid.short(),
                rj.root,
                waited.as_secs_f64()
            );
        }
        self.withdraw(&uid.token, rank, waited)
    }

    fn withdraw(&self, token: &[u8; 16], rank: u32, waited: Duration) -> String {
        let short: String = token[..4].iter().map(|b| format!("{b:02x}")).collect();
        let mut joins = lock(&self.joins);
        let Some(j) = joins.get_mut(token) else {
            return format!(
                "communicator {short} did not form within {:.1} s",
                waited.as_secs_f64()
            );
        };
        let joined: Vec<u32> = j.members.keys().copied().collect();
        let missing: Vec<u32> = (0..j.nranks)
            .filter(|r| !j.members.contains_key(r))
            .collect();
        let nranks = j.nranks;
        j.members.remove(&rank);
        // The pacing was this node's ranks' choice: with none of them left, the next decides.
        if !j.members.values().any(|m| matches!(m, Slot::Local(_))) {
            j.pacing = None;
        }
        if j.members.is_empty() {
            joins.remove(token);
        }
        format!(
            "timed out after {:.1} s waiting for rank(s) [{}] to join communicator {} ({} ranks, {} missing); joined: [{}]",
            waited.as_secs_f64(),
            crate::ranks::list(&missing),
            short,
            nranks,
            missing.len(),
            crate::ranks::list(&joined)
        )
    }

    pub fn destroy_comm(&self, s: &Session, handle: u32) -> Result<(), DaemonError> {
        s.tables().doorbell_slots.remove(&handle);
        let Some((comm, rank)) = s.tables().comms.remove(&handle) else {
            return Err(DaemonError::NotFound(format!(
                "no communicator handle {handle} in session {}",
                s.id
            )));
        };
        let msg = format!(
            "{}: rank {rank} (pid {}) destroyed the communicator",
            comm.label(),
            s.pid
        );
        if comm.leave(rank, msg) {
            lock(&self.comms).remove(&comm.id);
        }
        Ok(())
    }

    /// A communicator's GPU pacing request (`pacing_bytes_per_sec`: absent = the daemon's
    /// `gpu_pacing_gbps`, 0 = uncapped) as a rate in bytes/s (`None`: uncapped).
    pub fn resolve_pacing(&self, requested: Option<u64>) -> Result<Option<u64>, DaemonError> {
        match requested {
            None => Ok(self.cfg.gpu_pacing),
            Some(r) => crate::pacing::check_rate(r).map_err(DaemonError::InvalidArgument),
        }
    }

    /// `SetCommPacing`: caps the GPU copies of `s`'s communicator `handle` at `bytes_per_sec`
    /// (0: uncapped), for every rank on this node, from its next copy phase on.
    /// The communicator of `handle` in session `s`, and the session's rank in it.
    pub(crate) fn comm_of(s: &Session, handle: u32) -> Result<(Arc<Comm>, u32), DaemonError> {
        s.tables().comms.get(&handle).cloned().ok_or_else(|| {
            DaemonError::NotFound(format!(
                "no communicator handle {handle} in session {} (destroyed, or never created here)",
                s.id
            ))
        })
    }

    /// `FailCommunicator`: rank `handle` of session `s` says the communicator can no longer run
    /// (a failure its peers cannot see where they wait). Every queued and later op of every
    /// rank fails at once with `status` and the rank's `message`, and every local rank's
    /// direct ops stop (`HINT_BROKEN`).
    pub fn fail_comm(
        &self,
        s: &Session,
        handle: u32,
        status: u32,
        message: &str,
    ) -> Result<(), DaemonError> {
        use commd_proto::desc::status as st;
        let (comm, rank) = Self::comm_of(s, handle)?;
        if !matches!(
            status,
            st::INVALID
                | st::MISMATCH
                | st::PEER_LOST
                | st::TIMEOUT
                | st::ABORTED
                | st::INTERNAL
                | st::REVOKED
        ) {
            return Err(DaemonError::InvalidArgument(format!(
                "{}: FailCommunicator with status {status} ({}): expected a failure code",
                comm.label(),
                st::name(status)
            )));
        }
        // At most 4096 bytes of the rank's words, cut at a character boundary.
        let mut end = message.len().min(4096);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let msg = format!(
            "{}: rank {rank} (pid {}) {} the communicator: {}",
            comm.label(),
            s.pid,
            if status == st::REVOKED {
                "revoked"
            } else {
                "failed"
            },
            &message[..end]
        );
        if status == st::REVOKED {
            self.revoke(&comm, msg);
            return Ok(());
        }
        // Broken (with the reason, for a direct op that stops on the hint and asks:
        // `GetCommFailure`) before the hint, and the hint before the ops fail (a rank told by
        // its op sends its next ones to the daemon, for the reason).
        comm.set_broken(status, msg.clone());
        for &r in &comm.local {
            self.hint(&comm, r, commd_proto::desc::doorbell::HINT_BROKEN);
        }
        if comm.abort_rank(None, status, msg) {
            lock(&self.comms).remove(&comm.id);
        }
        Ok(())
    }

    /// `GetCommFailure`: why communicator `handle` of session `s` is broken for good (the status
    /// its ops fail with, the reason), or `None` while it works.
    pub fn comm_failure(
        &self,
        s: &Session,
        handle: u32,
    ) -> Result<Option<(u32, String)>, DaemonError> {
        Ok(Self::comm_of(s, handle)?.0.broken())
    }

    pub fn set_comm_pacing(
        &self,
        s: &Session,
        handle: u32,
        bytes_per_sec: u64,
    ) -> Result<(), DaemonError> {
        let (comm, rank) = Self::comm_of(s, handle)?;
        let rate = crate::pacing::check_rate(bytes_per_sec)
            .map_err(|e| DaemonError::InvalidArgument(format!("{}: {e}", comm.label())))?;
        let was = comm.pacer.rate();
        comm.pacer.set_rate(rate);
        tracing::info!(
            target: "commd::comm",
            "{}: rank {rank} (pid {}) set GPU pacing to {} (was {})",
            comm.label(),
            s.pid,
            crate::pacing::describe(rate),
            crate::pacing::describe(was)
        );
        Ok(())
    }
}

/// A failed join at the root daemon `root` as this daemon's error.
fn join_error(root: &str, e: crate::net::peer_client::JoinError) -> DaemonError {
    match e {
        crate::net::peer_client::JoinError::Unreachable(e) => DaemonError::Unavailable(format!(
            "cannot reach the root daemon {root} of this communicator (the address in the unique id): {e}"
        )),
        crate::net::peer_client::JoinError::Refused(s) => from_status(root, s),
    }
}

fn from_status(root: &str, s: tonic::Status) -> DaemonError {
    use tonic::Code;
    let m = s.message().to_string();
    match s.code() {
        Code::InvalidArgument => DaemonError::InvalidArgument(m),
        Code::NotFound => DaemonError::NotFound(m),
        Code::PermissionDenied => {
            DaemonError::PermissionDenied(format!("root daemon {root} refused the join: {m}"))
        }
        Code::AlreadyExists => DaemonError::AlreadyExists(m),
        Code::ResourceExhausted => DaemonError::ResourceExhausted(m),
        Code::DeadlineExceeded => DaemonError::DeadlineExceeded(m),
        Code::Unavailable => DaemonError::Unavailable(format!("root daemon {root}: {m}")),
        _ => DaemonError::Internal(format!("root daemon {root}: {m}")),
    }
}

/// A communicator that cannot form: logs why and fails every rank that joined here.
fn fail_joiners(uid: &UniqueId, why: String, local: HashMap<u32, Joiner>) {
    tracing::warn!(target: "commd::comm", "communicator {}: {why}", uid.short());
    for (_, j) in local {
        let _ = j.tx.send(Err(DaemonError::Internal(format!(
            "communicator {}: {why}",
            uid.short()
        ))));
    }
}

/// Every rank of a communicator forming here: this node's (`local`) with their sessions, the
/// others with the pid the root reported.
fn members(reply: &pb::PeerJoinReply, local: &HashMap<u32, Joiner>) -> Vec<Member> {
    (0..u32::try_from(reply.rank_node.len()).expect("form_local checked that the ranks fit u32"))
        .map(|r| match local.get(&r) {
            Some(j) => Member {
                session_id: j.session.id,
                pid: j.session.pid,
                local: true,
            },
            None => Member {
                session_id: 0,
                pid: reply.rank_pid.get(r as usize).copied().unwrap_or(0),
                local: false,
            },
        })
        .collect()
}

/// Gives a local rank its handle to the formed communicator `comm` (daemon-wide `id`, over
/// `nodes` nodes) and a free doorbell slot, and answers its join.
fn hand_out(comm: &Arc<Comm>, id: u64, rank: u32, nodes: u32, m: Joiner) {
    let (handle, slot) = {
        let mut t = m.session.tables();
        t.next_comm += 1;
        let h = t.next_comm;
        t.comms.insert(h, (comm.clone(), rank));
        let used: std::collections::HashSet<u32> = t.doorbell_slots.values().copied().collect();
        let slot = (0..commd_proto::desc::doorbell::SLOTS)
            .find(|i| !used.contains(i))
            .unwrap_or(commd_proto::desc::doorbell::NO_SLOT);
        if let Some((ready, done, err)) = m.session.ring.doorbell(slot) {
            ready.store(0, Ordering::Release);
            done.store(0, Ordering::Release);
            err.store(0, Ordering::Release);
            if let Some(hint) = m.session.ring.doorbell_hint(slot) {
                hint.store(0, Ordering::Release);
            }
            t.doorbell_slots.insert(h, slot);
        }
        (h, slot)
    };
    if m.session.is_closed() {
        comm.abort_rank(
            Some(rank),
            status::PEER_LOST,
            format!("{}: rank {rank} exited while joining", comm.label()),
        );
    }
    let _ = m.tx.send(Ok((handle, id, slot, nodes)));
}
