//! The session's own state: fd staging, ownership across fork, communicator failures, and
//! abandoning the session when its daemon is gone.

use std::os::fd::AsFd;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::{Error, Inner, OpErrorKind, Result, lock};
use commd_proto::desc::{CompletionDesc, status};
use commd_proto::fdproto::{self, FdMsg, kind};
use commd_proto::pb;

impl Inner {
    /// Passes `fd` to the daemon on the fd socket; returns the token a registration names it by.
    pub(crate) fn stage_fd(&self, fd: std::os::fd::BorrowedFd<'_>) -> Result<u64> {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        let sock = lock(&self.fd_sock);
        let gone = |e: std::io::Error| {
            self.lost(&format!(
                "the daemon's fd socket failed ({e}): the daemon exited or closed this session"
            ))
        };
        fdproto::send(
            sock.as_fd(),
            &FdMsg {
                kind: kind::STAGE,
                session_id: self.session_id,
                token,
                ..Default::default()
            },
            Some(fd),
        )
        .map_err(gone)?;
        // Wait for the reply in slices, so a stopped daemon is reported, not waited for forever.
        loop {
            let mut fds = [rustix::event::PollFd::new(
                &*sock,
                rustix::event::PollFlags::IN | rustix::event::PollFlags::RDHUP,
            )];
            let slice = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            match rustix::event::poll(&mut fds, Some(&slice)) {
                Ok(0) | Err(rustix::io::Errno::INTR) => {
                    if let Some(e) = self.daemon_stalled() {
                        return Err(e);
                    }
                }
                Ok(_) => break,
                Err(e) => return Err(gone(e.into())),
            }
        }
        match fdproto::recv(sock.as_fd()).map_err(gone)? {
            Some((m, _)) if m.kind == kind::STAGE_OK && m.token == token => Ok(token),
            Some((m, _)) if m.kind == kind::ERROR => Err(Error::InvalidArgument(format!(
                "daemon refused the fd: {}",
                m.text
            ))),
            Some(_) => Err(Error::DaemonLost {
                session: self.session_id,
                reason: "unexpected fd-socket reply".into(),
            }),
            None => Err(Error::DaemonLost {
                session: self.session_id,
                reason: "fd socket closed".into(),
            }),
        }
    }

    pub(crate) fn owned_here(&self) -> bool {
        self.pid == std::process::id()
    }

    pub(crate) fn check_owner(&self) -> Result<()> {
        if self.abandoned.load(Ordering::Acquire) {
            let why = lock(&self.abandoned_why).clone();
            return Err(self.lost(&format!(
                "this session was abandoned when its daemon exited or stopped answering ({why}; \
                 a stopped daemon that resumes could still carry out the ops it had, so the \
                 session takes no new ones): connect again"
            )));
        }
        if self.owned_here() {
            Ok(())
        } else {
            Err(Error::InvalidArgument(format!(
                "this commd session belongs to process {} (it was inherited through fork); \
                 connect again in process {}",
                self.pid,
                std::process::id()
            )))
        }
    }

    /// `FailCommunicator` for communicator `handle` of this session ([`Communicator::fail`]).
    pub(crate) fn fail_comm(&self, handle: u32, status: u32, message: &str) -> Result<()> {
        self.watched(
            self.rpc
                .clone()
                .fail_communicator(pb::FailCommunicatorRequest {
                    session_id: self.session_id,
                    comm: handle,
                    status,
                    message: message.to_string(),
                }),
        )?
        .map_err(|s| Error::rpc("fail_communicator", s))?;
        Ok(())
    }

    /// `GetCommFailure` for communicator `handle` of this session ([`Communicator::failure`]).
    pub(crate) fn comm_failure(&self, handle: u32) -> Result<Option<(u32, String)>> {
        let r = self
            .watched(self.rpc.clone().get_comm_failure(pb::CommRef {
                session_id: self.session_id,
                comm: handle,
            }))?
            .map_err(|s| Error::rpc("get_comm_failure", s))?
            .into_inner();
        Ok((r.status != 0).then_some((r.status, r.message)))
    }

    pub(crate) fn lost(&self, reason: &str) -> Error {
        Error::DaemonLost {
            session: self.session_id,
            reason: reason.to_string(),
        }
    }

    /// Ends the session from this side, once the daemon exited or stopped answering: it takes
    /// no new work, the fd connection is shut down (a resumed daemon then ends the session,
    /// failing what it still has, before it runs more of it), and every GPU stream of this
    /// process waiting on one of its doorbells is released with the error word set.
    pub(crate) fn abandon_session(&self, why: &str) {
        {
            // Before the flag: a call that sees the flag finds the reason.
            let mut w = lock(&self.abandoned_why);
            if w.is_empty() {
                *w = why.to_string();
            }
        }
        if self.abandoned.swap(true, Ordering::AcqRel) {
            return;
        }
        if let Some(fd) = &self.fd_sock_ctl {
            let _ = rustix::net::shutdown(fd, rustix::net::Shutdown::Both);
        }
        self.release_gpu_streams();
        self.release_graph_streams();
    }

    /// Contract 5 (docs/contracts.md) done by the client for a daemon that can no longer do it: each
    /// doorbell's done counter moves 2^30 past its ready counter, past every ticket a stream of
    /// this process can still wait for (tickets in flight are a few phases ahead of ready), and
    /// its error word says the daemon was lost, which the next call raises. Only once the
    /// session is abandoned: no new op can be posted, so no later wait is satisfied by this.
    pub(crate) fn release_gpu_streams(&self) {
        for slot in 0..commd_proto::desc::doorbell::SLOTS {
            if let Some((ready, done, err)) = self.ring.doorbell(slot) {
                let _ =
                    err.compare_exchange(0, status::PEER_LOST, Ordering::AcqRel, Ordering::Acquire);
                done.store(
                    ready.load(Ordering::Acquire).wrapping_add(1 << 30),
                    Ordering::Release,
                );
            }
            // Direct captured ops (docs/design-gpu.md, direct collectives rule 4) waiting for a peer stop on this bit.
            if let Some(h) = self.ring.doorbell_hint(slot) {
                h.fetch_or(commd_proto::desc::doorbell::HINT_BROKEN, Ordering::AcqRel);
            }
        }
    }

    /// Runs a control-plane call to completion, unless the daemon's heartbeat stands still for
    /// `daemon_timeout` first (a stopped daemon would otherwise hang the call forever): then
    /// [`Error::DaemonLost`]. Calls that legitimately take long (a join waiting for its ranks)
    /// keep going: the daemon's ring poller beats while its control plane works.
    pub(crate) fn watched<F: std::future::Future>(&self, fut: F) -> Result<F::Output> {
        if self.daemon_timeout.is_none() {
            return Ok(self.rt.block_on(fut));
        }
        self.rt.block_on(async {
            tokio::pin!(fut);
            loop {
                tokio::select! {
                    out = &mut fut => return Ok(out),
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {
                        if let Some(e) = self.daemon_stalled() {
                            return Err(e);
                        }
                    }
                }
            }
        })
    }

    pub(crate) fn finish(&self, c: CompletionDesc) -> Result<CompletionDesc> {
        if c.status == status::OK {
            return Ok(c);
        }
        let kind = OpErrorKind::from_status(c.status);
        let message = match self.watched(self.rpc.clone().get_op_error(pb::OpRef {
            session_id: self.session_id,
            user_data: c.user_data,
        })) {
            Ok(Ok(r)) => r.into_inner().message,
            Ok(Err(_)) | Err(_) => format!(
                "op failed with status {} (the daemon is gone, so no message is available)",
                status::name(c.status)
            ),
        };
        Err(Error::Op { kind, message })
    }
}
