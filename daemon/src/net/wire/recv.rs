//! The wire's receiving side: frames read off a peer's streams (data chunks, heartbeats, END
//! and abort notices), each chunk landing in its posted receive or, when it comes before its
//! receive is posted, in a pooled early buffer. Posting receives and sending are the parent
//! module's.

#![allow(unsafe_code)] // chunks land in registered buffers and host-staged GPU memory

use super::*;

impl Wire {
    /// Reads what stream `si` of peer `pi` has (until it would block): headers, then each
    /// chunk into its posted receive or an early buffer.
    pub(super) fn read_stream(
        &mut self,
        pi: usize,
        si: usize,
        fmt: SigFmt,
    ) -> Result<(), NetError> {
        loop {
            let Some(Some(p)) = self.peers.get_mut(pi) else {
                return Ok(());
            };
            let r = &mut p.rx[si];
            if r.eof {
                return Ok(());
            }
            if let Some(c) = &mut r.cur {
                if c.pos < c.len {
                    let buf: &mut [u8] = match &mut c.early {
                        Some(v) => &mut v[c.pos..c.len],
                        // SAFETY: dest was checked to hold offset+len bytes of a posted receive
                        // whose owner keeps it valid until completion.
                        None => unsafe {
                            std::slice::from_raw_parts_mut(c.dest.add(c.pos), c.len - c.pos)
                        },
                    };
                    match r.sock.read(buf) {
                        Ok(0) => return self.lost(pi, si, "connection closed mid-message"),
                        Ok(n) => {
                            c.pos += n;
                            p.last_rx = Instant::now();
                            self.stats[pi].rx_bytes += n as u64;
                            if let Some(Some(l)) = self.links.get(pi) {
                                l.rx(n as u64, 0);
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                        Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                        Err(e) => return self.lost(pi, si, &format!("receive failed: {e}")),
                    }
                }
                let Some(Some(p)) = self.peers.get_mut(pi) else {
                    return Ok(());
                };
                let r = &mut p.rx[si];
                let Some(c) = &r.cur else { continue };
                if c.pos >= c.len {
                    let c = r.cur.take().unwrap_or_else(|| unreachable!());
                    self.stats[pi].rx_frames += 1;
                    if let Some(Some(l)) = self.links.get(pi) {
                        l.rx(0, 1);
                    }
                    self.finish_chunk(pi, c, fmt)?;
                }
                continue;
            }
            // Reading a header.
            match r.sock.read(&mut r.hdr[r.hpos..]) {
                Ok(0) => {
                    if r.hpos == 0 && p.ended {
                        r.eof = true;
                        return Ok(());
                    }
                    return self.lost(pi, si, "connection closed (daemon exited or link cut)");
                }
                Ok(n) => {
                    r.hpos += n;
                    p.last_rx = Instant::now();
                    self.stats[pi].rx_bytes += n as u64;
                    if let Some(Some(l)) = self.links.get(pi) {
                        l.rx(n as u64, 0);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return self.lost(pi, si, &format!("receive failed: {e}")),
            }
            if r.hpos < HDR {
                continue;
            }
            r.hpos = 0;
            let h = r.hdr;
            self.on_header(pi, si, &h, fmt)?;
        }
    }

    fn lost(&self, pi: usize, _si: usize, why: &str) -> Result<(), NetError> {
        Err(NetError::PeerLost {
            node: pi,
            why: why.to_string(),
        })
    }

    fn on_header(
        &mut self,
        pi: usize,
        si: usize,
        h: &[u8; HDR],
        fmt: SigFmt,
    ) -> Result<(), NetError> {
        if u32_at(h, 0) != MAGIC {
            return Err(NetError::PeerLost {
                node: pi,
                why: "protocol error: bad frame magic".into(),
            });
        }
        let kind = h[4];
        let len = u32_at(h, 48);
        let key = Key {
            peer: pi,
            class: h[5],
            a: u64_at(h, 8),
            b: u64_at(h, 16),
        };
        let Some(Some(p)) = self.peers.get_mut(pi) else {
            return Ok(());
        };
        match kind {
            KIND_HEARTBEAT => {
                p.progress = key.a;
                return Ok(());
            }
            KIND_END => {
                // The peer is done with this communicator on this stream; nothing after it
                // belongs to us (the connection may be bound to another communicator next).
                p.rx[si].eof = true;
                p.rx[si].ended = true;
                p.ended = p.rx.iter().all(|r| r.ended);
                return Ok(());
            }
            KIND_ABORT => {
                if len > MAX_ABORT_TEXT {
                    return Err(NetError::PeerLost {
                        node: pi,
                        why: "protocol error: abort text too long".into(),
                    });
                }
                let mut buf = vec![0u8; len as usize];
                // The text is short: read it here, blocking briefly if it is split.
                let r = p.rx[si]
                    .sock
                    .read_exact_timeout(&mut buf, Duration::from_secs(1));
                let msg = match r {
                    Ok(()) => String::from_utf8_lossy(&buf).into_owned(),
                    Err(e) => format!("(abort text unreadable: {e})"),
                };
                // The status rides in the header's `a` (0 from a daemon before it: aborted).
                let st = u32::try_from(key.a).unwrap_or(0);
                let st = if st == 0 {
                    commd_proto::desc::status::ABORTED
                } else {
                    st
                };
                return Err(NetError::Aborted { node: pi, st, msg });
            }
            KIND_DATA => {}
            k => {
                return Err(NetError::PeerLost {
                    node: pi,
                    why: format!("protocol error: frame kind {k}"),
                });
            }
        }
        if len > MAX_CHUNK_BYTES {
            return Err(NetError::PeerLost {
                node: pi,
                why: format!(
                    "protocol error: a chunk of {len} bytes (at most {MAX_CHUNK_BYTES} are sent)"
                ),
            });
        }
        let offset = u64_at(h, 32);
        let total = u64_at(h, 40);
        let len64 = u64::from(len);
        if offset.checked_add(len64).is_none_or(|e| e > total) {
            return Err(NetError::PeerLost {
                node: pi,
                why: "protocol error: chunk outside its message".into(),
            });
        }
        let hsig = sig_of(h);
        let cur = match self.posted.get_mut(&key) {
            Some(slot) => {
                check_sig(pi, slot, &hsig, total, fmt)?;
                RxCur {
                    key,
                    offset,
                    total,
                    len: len as usize,
                    pos: 0,
                    // SAFETY: offset + len <= total == the posted receive's size.
                    dest: unsafe { slot.ptr.add(commd_proto::num::usize_of(offset)) },
                    early: None,
                    sig: hsig,
                }
            }
            None => {
                let mut buf = self.pool.pop().unwrap_or_default();
                buf.clear();
                buf.resize(len as usize, 0);
                self.early_bytes += len64;
                RxCur {
                    key,
                    offset,
                    total,
                    len: len as usize,
                    pos: 0,
                    dest: std::ptr::null_mut(),
                    early: Some(buf),
                    sig: hsig,
                }
            }
        };
        let Some(Some(p)) = self.peers.get_mut(pi) else {
            return Ok(());
        };
        p.rx[si].cur = Some(cur);
        Ok(())
    }

    fn finish_chunk(&mut self, pi: usize, c: RxCur, fmt: SigFmt) -> Result<(), NetError> {
        let len = c.len as u64;
        match c.early {
            Some(buf) => {
                // The receive may have been posted while this chunk was arriving.
                if let Some(slot) = self.posted.get_mut(&c.key) {
                    check_sig(pi, slot, &c.sig, c.total, fmt)?;
                    self.early_bytes -= len;
                    // SAFETY: offset + len <= total == slot.total (checked when the header came).
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            buf.as_ptr(),
                            slot.ptr.add(commd_proto::num::usize_of(c.offset)),
                            c.len,
                        )
                    };
                    slot.got += len;
                    slot.arrived += 1;
                    self.pool.push(buf);
                } else {
                    self.early.entry(c.key).or_default().push(Early {
                        offset: c.offset,
                        len,
                        buf,
                        sig: c.sig,
                        total: c.total,
                    });
                }
            }
            None => {
                if let Some(slot) = self.posted.get_mut(&c.key) {
                    slot.got += len;
                    slot.arrived += 1;
                }
            }
        }
        Ok(())
    }
}
