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
        let region = Self { map, len: bytes };
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
