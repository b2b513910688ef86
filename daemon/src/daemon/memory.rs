//! Memory a session registers with the daemon: shared-memory regions (staged fds), CUDA
//! allocations by IPC handle and cuMem pieces, and each rank's GPU scratch of a communicator
//! (with the init lines naming its GPU and the shared-GPU hint).
//!
//! May use: what `daemon` may (`session`, `shm`, `cuda`, `comm`).

use super::*;

impl Daemon {
    pub fn stage_fd(&self, s: &Session, token: u64, fd: OwnedFd) -> Result<(), DaemonError> {
        if s.tables().staged.len() >= MAX_STAGED {
            return Err(DaemonError::ResourceExhausted(format!(
                "session {} has {MAX_STAGED} fds staged and not registered, its maximum; register them (RegisterMemory) first",
                s.id
            )));
        }
        // Checked and added under one lock, so concurrent sessions of a uid cannot both pass.
        let _charge = lock(&self.reg_charge);
        let (mine, all) = self.usage(s.uid);
        if mine.staged_fds >= self.cfg.max_staged_fds_per_uid {
            return Err(DaemonError::ResourceExhausted(format!(
                "uid {} has {} fds staged and not registered, its maximum (max_staged_fds_per_uid={}); register them first (staged fds expire after staged_fd_timeout_ms)",
                s.uid, mine.staged_fds, self.cfg.max_staged_fds_per_uid
            )));
        }
        if all.staged_fds >= self.cfg.max_staged_fds {
            return Err(DaemonError::ResourceExhausted(format!(
                "the daemon holds {} staged fds, its maximum for all users (max_staged_fds={}); try again shortly",
                all.staged_fds, self.cfg.max_staged_fds
            )));
        }
        s.tables().staged.insert(token, (fd, Instant::now()));
        Ok(())
    }

    /// Refuses one more registration of `s`'s uid beyond its share or the daemon's total (each
    /// is one of the daemon's memory maps). Exact when called under `reg_charge`.
    fn check_registration_count(&self, s: &Session) -> Result<(), DaemonError> {
        let (mine, all) = self.usage(s.uid);
        if mine.registrations >= self.cfg.max_registrations_per_uid {
            return Err(DaemonError::ResourceExhausted(format!(
                "uid {} holds {} memory registrations, its maximum (max_registrations_per_uid={}); deregister unused ones, or register fewer, larger buffers",
                s.uid, mine.registrations, self.cfg.max_registrations_per_uid
            )));
        }
        if all.registrations >= self.cfg.max_registrations {
            return Err(DaemonError::ResourceExhausted(format!(
                "the daemon holds {} memory registrations, its maximum for all users (max_registrations={}, from vm.max_map_count); try again when other jobs end",
                all.registrations, self.cfg.max_registrations
            )));
        }
        Ok(())
    }

    pub fn register(&self, s: &Session, token: u64, bytes: u64) -> Result<u32, DaemonError> {
        let (fd, _) = s.tables().staged.remove(&token).ok_or_else(|| {
            DaemonError::NotFound(format!(
                "no fd staged under token {token}: stage it on the fd socket first (staged fds expire after staged_fd_timeout_ms)"
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
        self.check_registration_count(s)?;
        let held = self.usage(s.uid).0.registered_bytes;
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

    /// What the sessions of `uid` hold now, and what all sessions hold.
    pub fn usage(&self, uid: u32) -> (UidUsage, UidUsage) {
        let (mut mine, mut all) = (UidUsage::default(), UidUsage::default());
        for s in self.sessions() {
            let t = s.tables();
            let u = UidUsage {
                sessions: 1,
                communicators: t.comms.len(),
                registered_bytes: t.registered_bytes,
                registrations: t.mems.len() + t.cuda_mems.len(),
                staged_fds: t.staged.len(),
            };
            drop(t);
            all.add(&u);
            if s.uid == uid {
                mine.add(&u);
            }
        }
        mine.communicators += self.pending_memberships(uid);
        (mine, all)
    }

    /// What the sessions of `uid` hold now.
    pub fn uid_usage(&self, uid: u32) -> UidUsage {
        self.usage(uid).0
    }

    /// Closes the staged fds older than `staged_fd_timeout_ms` (housekeeping); returns how many.
    pub fn expire_staged(&self) -> usize {
        let Some(cutoff) = Instant::now().checked_sub(self.cfg.staged_fd_timeout) else {
            return 0;
        };
        let mut closed = 0;
        for s in self.sessions() {
            let mut t = s.tables();
            let before = t.staged.len();
            t.staged.retain(|_, (_, at)| *at > cutoff);
            closed += before - t.staged.len();
        }
        closed
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
            // Counted without `reg_charge` (opens take long): concurrent ones may pass the
            // bound by the number of threads registering at once.
            self.check_registration_count(s)?;
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
        self.check_registration_count(s)?;
        if self.cfg.cuda_ipc_owner_check {
            check_exporter(c, s, handle, uuid)?;
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
            let fds: Vec<Option<OwnedFd>> = pieces
                .iter()
                .map(|p| t.staged.remove(&p.2).map(|(fd, _)| fd))
                .collect();
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

/// Refuses a legacy CUDA IPC handle that the session's own process did not export, or that it
/// could not open itself (the `cuda::exporter` module doc).
fn check_exporter(
    c: &'static crate::cuda::Cuda,
    s: &Session,
    handle: &[u8],
    uuid: &[u8],
) -> Result<(), DaemonError> {
    let exporter = c.exporter_pid(handle).map_err(|why| {
        DaemonError::PermissionDenied(format!(
            "cannot tell which process exported this CUDA IPC handle ({why}), so it is refused (cuda_ipc_owner_check=on): register cuMem memory instead (PyTorch: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), or set cuda_ipc_owner_check=off on a node where every local user is trusted"
        ))
    })?;
    if i64::from(exporter) != i64::from(s.pid) {
        return Err(DaemonError::PermissionDenied(format!(
            "session {} (uid {}, pid {}) sent a CUDA IPC handle that process {exporter} exported: a session registers only its own process's GPU memory (cuda_ipc_owner_check=on)",
            s.id, s.uid, s.pid
        )));
    }
    // Unknown uuids are refused by the open itself, with the GPUs named.
    let Some(gpu) = c.gpu_by_uuid(uuid) else {
        return Ok(());
    };
    let bit = 1u64
        .checked_shl(u32::try_from(gpu).unwrap_or(u32::MAX))
        .unwrap_or(0);
    if s.tables().gpus_held & bit != 0 {
        return Ok(());
    }
    let bus = &c.gpus[gpu].pci_bus_id;
    match crate::cuda::holds_gpu(s.pid, bus) {
        Ok(true) => {
            s.tables().gpus_held |= bit;
            Ok(())
        }
        Ok(false) => Err(DaemonError::PermissionDenied(format!(
            "session {} (uid {}, pid {}) sent a CUDA IPC handle of GPU {gpu} ({bus}), but its process does not hold that GPU's device open, so it could not open the memory itself; the daemon opens it only for a process that could (cuda_ipc_owner_check=on)",
            s.id, s.uid, s.pid
        ))),
        Err(why) => Err(DaemonError::PermissionDenied(format!(
            "cannot check that session {} (pid {}) holds GPU {gpu}'s device open ({why}), so its CUDA IPC handle is refused (cuda_ipc_owner_check=on; the daemon needs the clients' /proc, e.g. hostPID in Kubernetes)",
            s.id, s.pid
        ))),
    }
}
