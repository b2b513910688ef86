//! Host memory registered by clients: memfds passed over the fd socket, mapped shared.
//!
//! A client could shrink a memfd after the daemon mapped it, and the daemon's next access would
//! die with SIGBUS. So the daemon maps only memfds sealed with `F_SEAL_SHRINK` (the client library
//! seals them); everything else is refused with a message saying so.

#![allow(unsafe_code)] // client memory is mapped shared memory

use std::fs::File;
use std::os::fd::OwnedFd;

use memmap2::{MmapOptions, MmapRaw};
use rustix::fs::SealFlags;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ShmError {
    #[error("registered fd is not a regular file (memfd expected)")]
    NotRegular,
    #[error(
        "registered memfd is not sealed against shrinking (F_SEAL_SHRINK); the daemon refuses it because shrinking would crash the daemon on access"
    )]
    NotSealed,
    #[error("registered memfd has {have} bytes, registration asks for {want}")]
    TooSmall { have: u64, want: u64 },
    #[error("registration of 0 bytes")]
    Empty,
    #[error("mapping registered memory: {0}")]
    Io(#[from] std::io::Error),
}

/// One mapped registration. Lives while any session table entry or in-flight op holds it.
pub struct MemRegion {
    map: MmapRaw,
    len: u64,
    /// A client's memory (checked by [`MemRegion::check_populated`] before each op), not the
    /// daemon's own.
    user: bool,
}

impl std::fmt::Debug for MemRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemRegion").field("len", &self.len).finish()
    }
}

// SAFETY: MemRegion only hands out raw pointers; all accesses through them are made by the engine
// under its own documented rules. The mapping itself is immutable metadata.
unsafe impl Send for MemRegion {}
// SAFETY: as above.
unsafe impl Sync for MemRegion {}

impl MemRegion {
    pub fn from_fd(fd: OwnedFd, bytes: u64) -> Result<Self, ShmError> {
        if bytes == 0 {
            return Err(ShmError::Empty);
        }
        let st = rustix::fs::fstat(&fd).map_err(std::io::Error::from)?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(ShmError::NotRegular);
        }
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|_| ShmError::NotSealed)?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(ShmError::NotSealed);
        }
        // A regular file's size is never negative; one that were would be refused as too small.
        let have = u64::try_from(st.st_size).unwrap_or(0);
        if have < bytes {
            return Err(ShmError::TooSmall { have, want: bytes });
        }
        let file = File::from(fd);
        let len = usize::try_from(bytes).map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "registration larger than the address space",
            )
        })?;
        let map = MmapOptions::new().len(len).map_raw(&file)?;
        let region = Self {
            map,
            len: bytes,
            user: true,
        };
        region.prefault_resident();
        Ok(region)
    }

    /// Faults in the page tables of the pages the client already has in memory, so the first
    /// collective does not take those faults, and nothing else. Not `MAP_POPULATE`: it does this
    /// for the whole range, which allocates every hole of a sparse memfd in the daemon (a sealed
    /// 4 GiB memfd with 40 MB resident would make the daemon populate all 4 GiB). Pages the
    /// client never touched are allocated only when an op writes them.
    fn prefault_resident(&self) {
        const PAGE: usize = 4096;
        // mincore in windows of 64 MiB (16 Ki pages, one byte each).
        const WINDOW: usize = 16 << 10;
        let base = self.map.as_mut_ptr();
        let pages = commd_proto::num::usize_of(self.len).div_ceil(PAGE);
        let mut vec = vec![0u8; WINDOW];
        let mut first = 0;
        while first < pages {
            let n = WINDOW.min(pages - first);
            // SAFETY: `[base + first * PAGE, + n * PAGE)` lies inside this mapping (page
            // aligned: mmap returns page-aligned addresses; the last page may extend past `len`,
            // which mincore accepts for a mapping rounded up to whole pages), and `vec` has room
            // for `n` bytes.
            let r =
                unsafe { libc::mincore(base.add(first * PAGE).cast(), n * PAGE, vec.as_mut_ptr()) };
            if r != 0 {
                return; // Best effort: the pages fault in on first use instead.
            }
            for (i, v) in vec[..n].iter().enumerate() {
                if v & 1 != 0 {
                    // SAFETY: inside the mapping (above); a read of a resident page of a sealed
                    // (non-shrinkable) memfd cannot fault with SIGBUS.
                    unsafe { std::ptr::read_volatile(base.add((first + i) * PAGE)) };
                }
            }
            first += n;
        }
    }

    /// Checks that `[off, off + len)` of a client's region is all in memory, so that the op
    /// touching it allocates nothing in the daemon: a page the client never wrote (a hole of
    /// its memfd, or one it punched after registering) would be allocated by the daemon's first
    /// access and charged to the daemon's memory, not the client's, up to the whole registration.
    /// A page only fallocated counts as missing (shmem leaves it "not up to date" until written,
    /// and `mincore` cannot tell it from a hole). A page swapped out is read back first (`MADV_WILLNEED` swaps shmem in, charged to its
    /// owner; holes stay holes) and checked again. The range must lie inside the region.
    ///
    /// Cost: one `mincore` per 64 MiB of range, about 1 us for a small op and 15 us for 32 MiB
    /// once the daemon's page tables hold the pages (docs/reliability.md, "Tenancy").
    pub fn check_populated(&self, off: u64, len: u64) -> Result<(), String> {
        if !self.user || len == 0 {
            return Ok(());
        }
        if self.first_missing(off, len).is_none() {
            return Ok(());
        }
        self.swap_in(off, len);
        match self.first_missing(off, len) {
            None => Ok(()),
            Some(p) => Err(format!(
                "bytes from offset {} of this buffer are not in memory (a page never written, only fallocated, freed with a hole punch, or swapped out and not read back within 2 ms); the daemon does not fault in a client's pages for an op (they would be charged to the daemon, not to you): write the whole buffer first (or MADV_POPULATE_WRITE it), as commd's own buffers and CPU allocator do",
                p.max(off)
            )),
        }
    }

    /// The offset of the first page of `[off, off + len)` that is not in memory.
    fn first_missing(&self, off: u64, len: u64) -> Option<u64> {
        const PAGE: u64 = 4096;
        // mincore in windows of 64 MiB (16 Ki pages, one byte each).
        const WINDOW: u64 = 16 << 10;
        let start = off / PAGE;
        let end = (off + len).div_ceil(PAGE);
        let base = self.map.as_mut_ptr();
        let mut vec = [0u8; 256];
        let mut big = Vec::new();
        let mut page = start;
        while page < end {
            let n = WINDOW.min(end - page);
            let n_us = commd_proto::num::usize_of(n);
            let v: &mut [u8] = if n_us <= vec.len() {
                &mut vec[..n_us]
            } else {
                big.resize(n_us, 0);
                &mut big[..]
            };
            // SAFETY: `[base + page * PAGE, + n * PAGE)` lies inside this mapping (the caller's
            // range is inside the region; the last page may extend past `len`, which mincore
            // accepts for a mapping rounded up to whole pages), and `v` has `n` bytes.
            let r = unsafe {
                libc::mincore(
                    base.add(commd_proto::num::usize_of(page * PAGE)).cast(),
                    commd_proto::num::usize_of(n * PAGE),
                    v.as_mut_ptr(),
                )
            };
            if r != 0 {
                // Cannot tell: treat the window as missing rather than fault it in.
                return Some(page * PAGE);
            }
            if let Some(i) = v.iter().position(|b| b & 1 == 0) {
                return Some((page + i as u64) * PAGE);
            }
            page += n;
        }
        None
    }

    /// Asks the kernel to read swapped-out pages of the range back (shmem: without allocating
    /// holes), and waits briefly for them.
    fn swap_in(&self, off: u64, len: u64) {
        const PAGE: u64 = 4096;
        let start = off / PAGE * PAGE;
        let end = (off + len).div_ceil(PAGE) * PAGE;
        // SAFETY: a page-aligned range inside this mapping (as in `first_missing`); WILLNEED
        // only starts reads, it changes no memory.
        unsafe {
            libc::madvise(
                self.map
                    .as_mut_ptr()
                    .add(commd_proto::num::usize_of(start))
                    .cast(),
                commd_proto::num::usize_of(end - start),
                libc::MADV_WILLNEED,
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }

    /// A region over daemon-private memory (staging buffers, tests).
    pub fn anonymous(bytes: u64) -> Result<Self, ShmError> {
        if bytes == 0 {
            return Err(ShmError::Empty);
        }
        let map = MmapOptions::new()
            .len(commd_proto::num::usize_of(bytes))
            .map_anon()?;
        Ok(Self {
            map: MmapRaw::from(map),
            len: bytes,
            user: false,
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn base(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::fs::MemfdFlags;

    fn memfd(len: u64, seal: bool) -> OwnedFd {
        let fd =
            rustix::fs::memfd_create("t", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING).unwrap();
        rustix::fs::ftruncate(&fd, len).unwrap();
        if seal {
            rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW).unwrap();
        }
        fd
    }

    #[test]
    fn a_sparse_memfd_is_not_populated_by_registration() {
        // 1 GiB sealed memfd with 1 MiB written: registering it must not allocate the holes.
        let len: u64 = 1 << 30;
        let fd = memfd(len, true);
        let f = File::from(fd.try_clone().unwrap());
        use std::os::unix::fs::FileExt;
        f.write_all_at(&vec![7u8; 1 << 20], 0).unwrap();
        let blocks = || u64::try_from(rustix::fs::fstat(&fd).unwrap().st_blocks).unwrap() * 512;
        let before = blocks();
        let t = std::time::Instant::now();
        let r = MemRegion::from_fd(fd.try_clone().unwrap(), len).unwrap();
        let after = blocks();
        assert!(
            after - before < 1 << 20,
            "registration allocated {} bytes",
            after - before
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(5));
        // SAFETY: inside the mapping; the first MiB was written above.
        assert_eq!(unsafe { *r.base().add(4096) }, 7);
    }

    #[test]
    fn an_op_over_pages_the_client_never_wrote_is_refused_and_allocates_nothing() {
        let len: u64 = 8 << 20;
        let fd = memfd(len, true);
        let f = File::from(fd.try_clone().unwrap());
        use std::os::unix::fs::FileExt;
        // The first 4 MiB written, the rest a hole.
        f.write_all_at(&vec![1u8; 4 << 20], 0).unwrap();
        let blocks = || u64::try_from(rustix::fs::fstat(&fd).unwrap().st_blocks).unwrap() * 512;
        let r = MemRegion::from_fd(fd.try_clone().unwrap(), len).unwrap();
        assert!(r.check_populated(0, 4 << 20).is_ok());
        assert!(r.check_populated(4096 + 8, 100).is_ok());
        let before = blocks();
        let e = r.check_populated(1 << 20, 4 << 20).unwrap_err();
        assert!(
            e.contains("offset 4194304") && e.contains("not in memory"),
            "{e}"
        );
        assert!(r.check_populated((8 << 20) - 4, 4).is_err());
        assert_eq!(blocks(), before, "the check allocated pages");
        // A hole punched after registration is seen too.
        rustix::fs::fallocate(
            &fd,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            1 << 20,
            4096,
        )
        .unwrap();
        let e = r.check_populated(0, 2 << 20).unwrap_err();
        assert!(e.contains("offset 1048576"), "{e}");
        // Daemon-private regions are not checked (their pages are the daemon's own).
        let own = MemRegion::anonymous(1 << 20).unwrap();
        assert!(own.check_populated(0, 1 << 20).is_ok());
        // Allocated by fallocate but never written: shmem keeps such pages "not up to date",
        // which mincore cannot tell from a hole, so they are refused too (the client library
        // writes its buffers after fallocate).
        let fd = memfd(1 << 20, true);
        rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, 1 << 20).unwrap();
        let r = MemRegion::from_fd(fd, 1 << 20).unwrap();
        assert!(r.check_populated(0, 1 << 20).is_err());
        // A larger range than one mincore window, all written.
        let big: u64 = 80 << 20;
        let fd = memfd(big, true);
        File::from(fd.try_clone().unwrap())
            .write_all_at(&vec![3u8; commd_proto::num::usize_of(big)], 0)
            .unwrap();
        let r = MemRegion::from_fd(fd, big).unwrap();
        assert!(r.check_populated(0, big).is_ok());
    }

    #[test]
    fn accepts_sealed_memfd_only() {
        assert!(MemRegion::from_fd(memfd(8192, true), 8192).is_ok());
        assert!(matches!(
            MemRegion::from_fd(memfd(8192, false), 8192),
            Err(ShmError::NotSealed)
        ));
        assert!(matches!(
            MemRegion::from_fd(memfd(4096, true), 8192),
            Err(ShmError::TooSmall { .. })
        ));
        assert!(matches!(
            MemRegion::from_fd(memfd(4096, true), 0),
            Err(ShmError::Empty)
        ));
        let (a, _b) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::STREAM,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        assert!(matches!(
            MemRegion::from_fd(a, 10),
            Err(ShmError::NotRegular)
        ));
    }
}
