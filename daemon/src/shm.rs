//! Host memory registered by clients: memfds passed over the fd socket, mapped shared.
//!
//! A client could shrink a memfd after the daemon mapped it, and the daemon's next access would
//! die with SIGBUS. So the daemon maps only memfds sealed with `F_SEAL_SHRINK` (the client library
//! seals them); everything else is refused with a message saying so.

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
        let have = st.st_size as u64;
        if have < bytes {
            return Err(ShmError::TooSmall { have, want: bytes });
        }
        let file = File::from(fd);
        // populate: fault the page tables in now rather than on the first collective.
        let map = MmapOptions::new()
            .len(bytes as usize)
            .populate()
            .map_raw(&file)?;
        Ok(Self { map, len: bytes })
    }

    /// A region over daemon-private memory (staging buffers, tests).
    pub fn anonymous(bytes: u64) -> Result<Self, ShmError> {
        if bytes == 0 {
            return Err(ShmError::Empty);
        }
        let map = MmapOptions::new().len(bytes as usize).map_anon()?;
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
