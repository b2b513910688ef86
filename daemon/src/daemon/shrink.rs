//! Shrinking a communicator (`ShrinkCommunicator`, NCCL's `ncclCommShrink`, torch's
//! `shrink_group`): the survivors make a child without the excluded ranks from the parent's
//! membership, with no new unique id and no rendezvous outside the daemons.
//!
//! The child's token is derived from the parent's (a credential only its ranks and daemons
//! hold) and the parent rank's shrink count, so every survivor names the same child; its root
//! is the daemon of the lowest surviving rank, which holds the parent and admits the join
//! without an issued id. Every survivor carries its exclude list: where two lists meet (at
//! the root, or on one node) the join fails on every rank that joined, naming both lists, and
//! the child's token is spoiled so that later survivors fail at once too.
//!
//! May use: what `daemon` may (`comm`, `session`, `net`, `config`).

use super::*;

/// How long a spoiled child token fails later joins at once (then they time out as usual).
const SPOILED_FOR: Duration = Duration::from_secs(600);
/// Spoiled tokens kept at most (the oldest are dropped beyond it).
const SPOILED_MAX: usize = 4096;

/// A survivor's shrink, as its join carries it.
#[derive(Clone, Debug)]
pub(super) struct ShrinkVote {
    /// Parent ranks left out, ascending, no repeats.
    pub(super) exclude: Vec<u32>,
    /// The caller's rank in the parent and its process id.
    pub(super) parent_rank: u32,
    pub(super) pid: i32,
    /// The parent's token and the shrink's epoch (what the child's token is derived from).
    pub(super) parent_token: [u8; 16],
    pub(super) epoch: u32,
    /// The parent's daemon-wide id here (unknown for a rank of another node).
    pub(super) parent: Option<u64>,
}

impl ShrinkVote {
    /// The parent link of the child formed here: its id and the ranks left out.
    pub(super) fn parent_link(self) -> Option<(u64, Vec<u32>)> {
        self.parent.map(|p| (p, self.exclude))
    }

    /// `req` as a shrink's join of this vote.
    pub(super) fn on_request(&self, req: pb::PeerJoinRequest) -> pb::PeerJoinRequest {
        pb::PeerJoinRequest {
            shrink: true,
            parent_token: self.parent_token.to_vec(),
            shrink_epoch: self.epoch,
            exclude: self.exclude.clone(),
            parent_rank: self.parent_rank,
            ..req
        }
    }
}

/// Records `v` as the child's exclude list, or says how it disagrees with the first one.
pub(super) fn vote_shrink(first: &mut Option<ShrinkVote>, v: ShrinkVote) -> Result<(), String> {
    match first {
        None => {
            *first = Some(v);
            Ok(())
        }
        Some(f) if f.exclude == v.exclude && f.epoch == v.epoch => {
            if f.parent.is_none() {
                f.parent = v.parent;
            }
            Ok(())
        }
        Some(f) => Err(format!(
            "shrink #{} of communicator {}: parent rank {} (pid {}) excludes ranks [{}], but parent rank {} (pid {}) excludes [{}]; every surviving rank must pass the same exclude list (no child was made)",
            v.epoch,
            short(&f.parent_token),
            v.parent_rank,
            v.pid,
            crate::ranks::list(&v.exclude),
            f.parent_rank,
            f.pid,
            crate::ranks::list(&f.exclude)
        )),
    }
}

/// The token of the `epoch`-th shrink's child of the communicator with token `parent`.
pub(super) fn child_token(parent: &[u8; 16], epoch: u32) -> [u8; 16] {
    let mut h = ring::digest::Context::new(&ring::digest::SHA256);
    h.update(b"commd shrink child v1\0");
    h.update(parent);
    h.update(&epoch.to_le_bytes());
    let d = h.finish();
    let mut t = [0u8; 16];
    t.copy_from_slice(&d.as_ref()[..16]);
    t
}

fn short(token: &[u8; 16]) -> String {
    token[..4].iter().map(|b| format!("{b:02x}")).collect()
}

/// A shrink as the caller asked for it.
#[derive(Clone, Debug)]
pub struct ShrinkArgs {
    /// Parent ranks to leave out (any order; repeats are refused).
    pub exclude: Vec<u32>,
    /// Revoke the parent first (its queued ops fail), else wait for this rank's ops on it.
    pub abort: bool,
    /// `None`: the parent's op timeout.
    pub op_timeout: Option<Duration>,
    pub wait: Duration,
}

/// A shrink under way: this rank's place in the child, and the join to wait for.
pub struct Shrinking {
    pub rank: u32,
    pub nranks: u32,
    pub parent: Arc<Comm>,
    pub joined: oneshot::Receiver<JoinResult>,
    /// The child's unique id, for the message of a join that timed out.
    pub uid: Vec<u8>,
}

impl Daemon {
    /// Checks a shrink of `s`'s communicator `handle` and, with `abort`, revokes the parent.
    /// Returns the parent and this rank's place in it, for [`Daemon::shrink_join`] once this
    /// rank's ops on the parent completed.
    pub fn shrink_check(
        &self,
        s: &Session,
        handle: u32,
        a: &ShrinkArgs,
    ) -> Result<(Arc<Comm>, u32), DaemonError> {
        let (parent, rank) = Self::comm_of(s, handle)?;
        if parent.lineage.get().is_none() {
            return Err(DaemonError::Internal(format!(
                "{}: its membership was not recorded; it cannot be shrunk",
                parent.label()
            )));
        }
        let n = parent.nranks;
        let mut ex = a.exclude.clone();
        ex.sort_unstable();
        if let Some(w) = ex.windows(2).find(|w| w[0] == w[1]) {
            return Err(DaemonError::InvalidArgument(format!(
                "{}: rank {} is listed twice in the exclude list",
                parent.label(),
                w[0]
            )));
        }
        if let Some(&r) = ex.iter().find(|&&r| r >= n) {
            return Err(DaemonError::InvalidArgument(format!(
                "{}: exclude list names rank {r}, but the communicator has {n} ranks (0 to {})",
                parent.label(),
                n - 1
            )));
        }
        if ex.binary_search(&rank).is_ok() {
            return Err(DaemonError::InvalidArgument(format!(
                "{}: rank {rank} (pid {}) is in its own exclude list; an excluded rank does not call shrink (it destroys or aborts its communicator)",
                parent.label(),
                s.pid
            )));
        }
        if a.abort {
            self.revoke(
                &parent,
                format!(
                    "{}: rank {rank} (pid {}) revoked the communicator to shrink it (abort) without ranks [{}]",
                    parent.label(),
                    s.pid,
                    crate::ranks::list(&ex)
                ),
            );
        }
        Ok((parent, rank))
    }

    /// Joins this rank to the child of the shrink [`Daemon::shrink_check`] accepted.
    pub fn shrink_join(
        self: &Arc<Self>,
        s: Arc<Session>,
        parent: Arc<Comm>,
        rank: u32,
        a: &ShrinkArgs,
    ) -> Result<Shrinking, DaemonError> {
        let Some(lin) = parent.lineage.get() else {
            return Err(DaemonError::Internal("lineage vanished".into()));
        };
        let mut exclude = a.exclude.clone();
        exclude.sort_unstable();
        let survivors: Vec<u32> = (0..parent.nranks)
            .filter(|r| exclude.binary_search(r).is_err())
            .collect();
        let new_rank = crate::ranks::of(survivors.iter().take_while(|&&r| r < rank).count());
        let nranks = crate::ranks::of(survivors.len());
        let epoch = parent.next_shrink(rank);
        // The child's root is the daemon of its rank 0 (the lowest survivor), which holds the
        // parent. A daemon without a peer service names its ranks' node "local".
        let root = lin
            .rank_node
            .get(survivors[0] as usize)
            .cloned()
            .unwrap_or_default();
        let me = self.node_id();
        let root = if root == "local" || Some(&root) == me.as_ref() {
            me.unwrap_or_default()
        } else {
            root
        };
        let uid = UniqueId {
            token: child_token(&lin.token, epoch),
            root,
        };
        let vote = ShrinkVote {
            exclude,
            parent_rank: rank,
            pid: s.pid,
            parent_token: lin.token,
            epoch,
            parent: Some(parent.id),
        };
        let opts = JoinOpts {
            op_timeout: Some(a.op_timeout.unwrap_or(parent.op_timeout)),
            pacing: parent.pacer.rate(),
        };
        let bytes = uid.encode();
        let joined = self.join_uid(s, uid, (new_rank, nranks), opts, a.wait, Some(vote))?;
        Ok(Shrinking {
            rank: new_rank,
            nranks,
            parent,
            joined,
            uid: bytes,
        })
    }

    /// Revokes `comm`: every queued and later op of every rank fails with `msg` (status
    /// `REVOKED`), local ranks' direct ops stop; the communicator stays valid as a parent.
    pub(super) fn revoke(&self, comm: &Arc<Comm>, msg: String) {
        comm.set_broken(status::REVOKED, msg.clone());
        for &r in &comm.local {
            self.hint(comm, r, commd_proto::desc::doorbell::HINT_BROKEN);
        }
        if comm.abort_rank(None, status::REVOKED, msg) {
            lock(&self.comms).remove(&comm.id);
        }
    }

    /// The root side of a remote survivor's join of a shrink's child: admitted if its token is
    /// the one derived from a parent this daemon holds.
    pub(super) fn admit_shrink(
        &self,
        r: &pb::PeerJoinRequest,
        token: &[u8; 16],
    ) -> Result<ShrinkVote, DaemonError> {
        let refuse = |why: &str| {
            crate::telemetry::ratelimit::warn_limited!(target: "commd::net", "rejected a shrink's join of rank {} from node {} (pid {}): {why}", r.rank, r.node, r.pid);
            DaemonError::PermissionDenied(format!("shrink's join refused: {why}"))
        };
        let parent_token: [u8; 16] = r
            .parent_token
            .as_slice()
            .try_into()
            .map_err(|_| refuse("malformed parent token"))?;
        if &child_token(&parent_token, r.shrink_epoch) != token {
            return Err(refuse("the token is not the parent's child"));
        }
        let parent = lock(&self.comms)
            .values()
            .find(|c| c.lineage.get().is_some_and(|l| l.token == parent_token))
            .map(|c| c.id);
        if parent.is_none() {
            return Err(refuse(&format!(
                "this daemon holds no communicator {}.. (its ranks here destroyed it, or it never formed here)",
                short(&parent_token)
            )));
        }
        let mut exclude = r.exclude.clone();
        exclude.sort_unstable();
        exclude.dedup();
        Ok(ShrinkVote {
            exclude,
            parent_rank: r.parent_rank,
            pid: r.pid,
            parent_token,
            epoch: r.shrink_epoch,
            parent: None,
        })
    }

    /// Marks a shrink's child that cannot form (mismatched lists): later joins fail with `why`.
    pub(super) fn spoil(&self, token: [u8; 16], why: &str) {
        tracing::warn!(target: "commd::comm", "{why}");
        let mut m = lock(&self.spoiled);
        let now = Instant::now();
        m.retain(|_, (_, t)| now.duration_since(*t) < SPOILED_FOR);
        if m.len() >= SPOILED_MAX
            && let Some(k) = m.iter().min_by_key(|(_, (_, t))| *t).map(|(k, _)| *k)
        {
            m.remove(&k);
        }
        m.insert(token, (why.to_string(), now));
    }

    /// Fails a join of a spoiled child at once, with the reason.
    pub(super) fn check_spoiled(&self, token: &[u8; 16]) -> Result<(), DaemonError> {
        match lock(&self.spoiled).get(token) {
            Some((why, t)) if t.elapsed() < SPOILED_FOR => {
                Err(DaemonError::InvalidArgument(why.clone()))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vote(exclude: &[u32], parent_rank: u32, epoch: u32) -> ShrinkVote {
        ShrinkVote {
            exclude: exclude.to_vec(),
            parent_rank,
            pid: 100 + i32::try_from(parent_rank).unwrap(),
            parent_token: [7; 16],
            epoch,
            parent: None,
        }
    }

    #[test]
    fn child_tokens_differ_by_parent_and_epoch_and_are_stable() {
        let a = child_token(&[1; 16], 0);
        assert_eq!(a, child_token(&[1; 16], 0));
        assert_ne!(a, child_token(&[1; 16], 1));
        assert_ne!(a, child_token(&[2; 16], 0));
        assert_ne!(a, [1; 16]);
    }

    #[test]
    fn votes_agree_or_name_both_lists_and_ranks() {
        let mut first = None;
        vote_shrink(&mut first, vote(&[3], 0, 0)).unwrap();
        let mut local = vote(&[3], 1, 0);
        local.parent = Some(42);
        vote_shrink(&mut first, local).unwrap();
        assert_eq!(first.as_ref().unwrap().parent, Some(42));
        let e = vote_shrink(&mut first, vote(&[1, 3], 2, 0)).unwrap_err();
        assert!(
            e.contains("parent rank 2 (pid 102) excludes ranks [1,3]"),
            "{e}"
        );
        assert!(e.contains("parent rank 0 (pid 100) excludes [3]"), "{e}");
        // Another epoch is another shrink: it disagrees too.
        assert!(vote_shrink(&mut first, vote(&[3], 2, 1)).is_err());
    }
}
