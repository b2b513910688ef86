//! Memory a session registers with the daemon: shared-memory regions (staged fds), CUDA
//! allocations by IPC handle and cuMem pieces, and each rank's GPU scratch of a communicator
//! (with the init lines naming its GPU and the shared-GPU hint).
//!
//! May use: what `daemon` may (`session`, `shm`, `cuda`, `comm`).

use super::*;

impl Daemon {
    pub fn stage_fd(&self, s: &Session, token: u64, fd: OwnedFd) -> Result<(), DaemonError> {
        let mut t = s.tables();
        if t.staged.len() >= MAX_STAGED {
            return Err(DaemonError::ResourceExhausted(format!(
                "more than {MAX_STAGED} fds staged and not registered"
            )));
        }
        t.staged.insert(token, fd);
        Ok(())
    }

    pub fn register(&self, s: &Session, token: u64, bytes: u64) -> Result<u32, DaemonError> {
        let fd = s.tables().staged.remove(&token).ok_or_else(|| {
            DaemonError::NotFound(format!(
                "no fd staged under token {token}: stage it on the fd socket first"
            ))
        })?;
        {
            let t = s.tables();
            if t.registered_bytes.saturating_add(bytes) > self.cfg.max_registered_bytes {
                return Err(DaemonError::ResourceExhausted(format!(
                    "registering {bytes} bytes would exceed the session limit of {} bytes (max_registered_bytes)",
                    self.cfg.max_registered_bytes
                )));
            }
        }
        // Check and charge under one lock, so concurrent registrations of a uid cannot both
        // pass; each session's tables are locked only briefly, one at a time.
        let _charge = lock(&self.reg_charge);
        let held = self.uid_usage(s.uid).registered_bytes;
        let cap = self.cfg.max_registered_bytes_per_uid;
        if held.saturating_add(bytes) > cap {
            return Err(DaemonError::ResourceExhausted(format!(
                "registering {bytes} bytes would bring uid {} to {} bytes of registered host memory, above its limit of {cap} bytes (max_registered_bytes_per_uid)",
                s.uid,
                held.saturating_add(bytes)
            )));
        }
        let region = MemRegion::from_fd(fd, bytes)
            .map_err(|e| DaemonError::InvalidArgument(e.to_string()))?;
        let mut t = s.tables();
        t.next_mem += 1;
        let id = t.next_mem;
        t.registered_bytes += bytes;
        t.mems.insert(id, Arc::new(region));
        Ok(id)
    }

    /// What the sessions of `uid` hold now.
    pub fn uid_usage(&self, uid: u32) -> UidUsage {
        let mut u = UidUsage::default();
        for s in self.sessions().iter().filter(|s| s.uid == uid) {
            let t = s.tables();
            u.sessions += 1;
            u.communicators += t.comms.len();
            u.registered_bytes = u.registered_bytes.saturating_add(t.registered_bytes);
        }
        u
    }

    /// Registers a client's device allocation by IPC handle; returns (mem id, cached, open us).
    /// The same handle registered again by the session returns the open mapping. With `vmm`,
    /// `handle` is empty and the registration is a mirror of the client's cuMem address range
    /// of `bytes`, its pieces mapped by [`Daemon::map_cuda_pieces`].
    pub fn register_cuda(
        &self,
        s: &Session,
        handle: &[u8],
        uuid: &[u8],
        bytes: u64,
        vmm: bool,
    ) -> Result<(u32, bool, u64), DaemonError> {
        let c = crate::cuda::get()
            .map_err(|why| DaemonError::Unavailable(format!("this daemon has no CUDA: {why}")))?;
        if bytes == 0 {
            return Err(DaemonError::InvalidArgument(
                "registration of 0 bytes".into(),
            ));
        }
        if vmm {
            if !handle.is_empty() {
                return Err(DaemonError::InvalidArgument(
                    "a cuMem range registration carries no IPC handle".into(),
                ));
            }
            let mem = c
                .reserve_vmm(uuid, bytes)
                .map_err(DaemonError::InvalidArgument)?;
            let mut t = s.tables();
            t.next_mem += 1;
            let id = t.next_mem;
            t.cuda_mems.insert(id, Arc::new(mem));
            return Ok((id, false, 0));
        }
        if let Some(id) = s.tables().ipc_cache.get(handle).copied() {
            c.stats.hits.fetch_add(1, Ordering::Relaxed);
            s.ipc_hits.fetch_add(1, Ordering::Relaxed);
            return Ok((id, true, 0));
        }
        let mem = c
            .open_ipc(uuid, handle, bytes)
            .map_err(DaemonError::InvalidArgument)?;
        s.ipc_opens.fetch_add(1, Ordering::Relaxed);
        let us = mem.open_us;
        let mut t = s.tables();
        // Another thread of the client may have registered the same handle meanwhile.
        if let Some(id) = t.ipc_cache.get(handle).copied() {
            return Ok((id, true, 0));
        }
        t.next_mem += 1;
        let id = t.next_mem;
        t.cuda_mems.insert(id, Arc::new(mem));
        t.ipc_cache.insert(handle.to_vec(), id);
        Ok((id, false, us))
    }

    /// Maps pieces (offset, bytes, staged fd token) into the session's cuMem mirror `mem`;
    /// returns the microseconds spent. Every staged fd named is consumed, even on failure.
    pub fn map_cuda_pieces(
        &self,
        s: &Session,
        mem: u32,
        pieces: &[(u64, u64, u64)],
    ) -> Result<u64, DaemonError> {
        let (m, fds) = {
            let mut t = s.tables();
            let fds: Vec<Option<OwnedFd>> = pieces.iter().map(|p| t.staged.remove(&p.2)).collect();
            (t.cuda_mems.get(&mem).cloned(), fds)
        };
        let c = crate::cuda::get()
            .map_err(|why| DaemonError::Unavailable(format!("this daemon has no CUDA: {why}")))?;
        let m = m.ok_or_else(|| {
            DaemonError::NotFound(format!("no GPU memory handle {mem} in session {}", s.id))
        })?;
        if !m.is_vmm() {
            return Err(DaemonError::InvalidArgument(format!(
                "GPU memory handle {mem} is an IPC registration, not a cuMem range"
            )));
        }
        let mut list = Vec::with_capacity(pieces.len());
        for (p, fd) in pieces.iter().zip(fds) {
            let fd = fd.ok_or_else(|| {
                DaemonError::NotFound(format!(
                    "no fd staged under token {}: stage it on the fd socket first",
                    p.2
                ))
            })?;
            list.push((p.0, p.1, fd));
        }
        let us = c
            .map_pieces(&m, list)
            .map_err(DaemonError::InvalidArgument)?;
        s.ipc_opens
            .fetch_add(pieces.len() as u64, Ordering::Relaxed);
        Ok(us)
    }

    /// The device scratch of `s`'s rank of communicator `handle` on the GPU `uuid` (allocated on
    /// first call): (IPC handle, slot bytes, total bytes).
    pub fn comm_scratch(
        &self,
        s: &Session,
        handle: u32,
        uuid: &[u8],
    ) -> Result<(Vec<u8>, u64, u64), DaemonError> {
        let c = crate::cuda::get()
            .map_err(|why| DaemonError::Unavailable(format!("this daemon has no CUDA: {why}")))?;
        let (comm, rank) = Self::comm_of(s, handle)?;
        let bytes = commd_proto::desc::cuda_scratch_bytes(comm.nranks, c.slot_bytes);
        if bytes == 0 {
            return Ok((Vec::new(), c.slot_bytes, 0));
        }
        let gpu = c.gpu_by_uuid(uuid);
        let mut sc = comm.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(existing) = &sc[rank as usize] {
            if Some(existing.mem.gpu) != gpu {
                return Err(DaemonError::InvalidArgument(format!(
                    "{}: rank {rank} already has its GPU scratch on another GPU; use one GPU per rank and communicator",
                    comm.label()
                )));
            }
            let h = c.export(&existing.mem).map_err(DaemonError::Internal)?;
            return Ok((h, c.slot_bytes, bytes));
        }
        // The session's scratch on that GPU, shared by its communicators (see
        // `Tables::scratch_pool`; the executor runs jobs sharing a scratch one at a time).
        let pooled = gpu.and_then(|g| s.tables().scratch_pool.get(&(g, bytes)).cloned());
        let mem = match pooled {
            Some(m) => m,
            None => {
                let m = Arc::new(
                    c.alloc(uuid, bytes)
                        .map_err(DaemonError::ResourceExhausted)?,
                );
                s.tables().scratch_pool.insert((m.gpu, bytes), m.clone());
                m
            }
        };
        let h = c.export(&mem).map_err(DaemonError::Internal)?;
        let span = crate::cuda::GpuSpan::new(mem, 0, bytes)
            .ok_or_else(|| DaemonError::Internal("scratch span".into()))?;
        sc[rank as usize] = Some(span);
        crate::comm::comm_device(&comm, rank, &sc);
        let gpus: Vec<Option<usize>> = sc.iter().map(|s| s.as_ref().map(|s| s.mem.gpu)).collect();
        drop(sc);
        for (r, shared) in shared_gpu_ranks(&gpus).into_iter().enumerate() {
            if shared {
                self.hint(
                    &comm,
                    crate::ranks::of(r),
                    commd_proto::desc::doorbell::HINT_SHARED_GPU,
                );
            }
        }
        for (r, own) in own_gpu_ranks(&gpus).into_iter().enumerate() {
            if own {
                self.hint(
                    &comm,
                    crate::ranks::of(r),
                    commd_proto::desc::doorbell::HINT_OWN_GPU,
                );
            }
        }
        Ok((h, c.slot_bytes, bytes))
    }

    /// Sets `bit` in the doorbell hint word of `rank` of `comm` (a local rank's session).
    pub(crate) fn hint(&self, comm: &Arc<Comm>, rank: u32, bit: u32) {
        let Some(m) = comm.members.get(rank as usize).filter(|m| m.local) else {
            return;
        };
        let Some(s) = self.session(m.session_id) else {
            return;
        };
        let slot = {
            let t = s.tables();
            t.comms
                .iter()
                .find(|(_, (c, r))| c.id == comm.id && *r == rank)
                .and_then(|(h, _)| t.doorbell_slots.get(h).copied())
        };
        if let Some(w) = slot.and_then(|slot| s.ring.doorbell_hint(slot)) {
            w.fetch_or(bit, Ordering::AcqRel);
        }
    }

    pub fn deregister(&self, s: &Session, mem: u32) -> Result<(), DaemonError> {
        let mut t = s.tables();
        if t.cuda_mems.remove(&mem).is_some() {
            t.ipc_cache.retain(|_, id| *id != mem);
            return Ok(());
        }
        let r = t.mems.remove(&mem).ok_or_else(|| {
            DaemonError::NotFound(format!("no memory handle {mem} in session {}", s.id))
        })?;
        t.registered_bytes -= r.len();
        // In-flight ops keep their own reference; the mapping goes when the last one finishes.
        Ok(())
    }
}
