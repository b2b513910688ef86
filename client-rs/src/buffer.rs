//! Host buffers in shared memory ([`Buffer`]) and the ops that borrow them ([`Pending`]).

use std::fs::File;
use std::marker::PhantomData;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::{Client, Error, Inner, Result};
use commd_proto::num::usize_of;
use commd_proto::pb;
use memmap2::{MmapOptions, MmapRaw};

/// A host buffer in shared memory, registered with the daemon. Deregistered on drop.
pub struct Buffer {
    pub(crate) client: Arc<Inner>,
    pub(crate) mem_id: u32,
    pub(crate) map: Mapping,
    pub(crate) len: u64,
}

/// Where a [`Buffer`]'s bytes are mapped in this process.
pub(crate) enum Mapping {
    /// The buffer's own mapping, unmapped with it.
    Own(MmapRaw),
    /// A [`hostmem`] block's address: the block owns the mapping; the buffer is its registration.
    Block(usize),
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Buffer(mem {}, {} bytes)", self.mem_id, self.len)
    }
}

#[allow(unsafe_code)] // the ring and doorbell pages are shared memory mapped from the daemon
impl Buffer {
    pub fn mem_id(&self) -> u32 {
        self.mem_id
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn as_ptr(&self) -> *mut u8 {
        match &self.map {
            Mapping::Own(m) => m.as_mut_ptr(),
            Mapping::Block(a) => *a as *mut u8,
        }
    }
    /// True for the registration of a [`hostmem`] block (its bytes belong to the block, which
    /// the allocator may unmap while this registration lives on in an op): never hand such a
    /// buffer's bytes out.
    pub fn is_block(&self) -> bool {
        matches!(self.map, Mapping::Block(_))
    }
    /// Does `self` belong to `client`'s session?
    pub fn is_of(&self, client: &Client) -> bool {
        Arc::ptr_eq(&self.client, &client.inner)
    }
    /// The buffer's bytes. Do not hold this across an op that writes the buffer.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, lives as long as self, and is only written by the
        // daemon during ops that name it, which the module-level ownership rules exclude here.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), usize_of(self.len)) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only reference from this process.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), usize_of(self.len)) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let i = &self.client;
        if i.owned_here() && i.ring.session_error().load(Ordering::Acquire) == 0 {
            let _ = i.watched(i.rpc.clone().deregister_memory(pb::MemRef {
                session_id: i.session_id,
                mem_id: self.mem_id,
            }));
        }
    }
}

/// A buffer location: `(buffer, byte offset)`.
pub type At<'b> = (&'b Buffer, u64);

/// A posted op. Waits for completion when dropped, so buffers outlive the daemon's use of them.
#[must_use = "an op is only known to be done after wait()"]
pub struct Pending<'b> {
    pub(crate) client: Arc<Inner>,
    pub(crate) user_data: u64,
    pub(crate) done: bool,
    pub(crate) _bufs: PhantomData<&'b Buffer>,
}

impl Pending<'_> {
    pub fn user_data(&self) -> u64 {
        self.user_data
    }

    /// Blocks until the op completes; a failed op becomes an [`Error::Op`].
    pub fn wait(mut self) -> Result<()> {
        self.done = true;
        self.client.wait(self.user_data, None).map(|_| ())
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.client.wait(self.user_data, None);
        }
    }
}

impl Client {
    /// Allocates `bytes` of shared host memory registered with the daemon.
    pub fn alloc(&self, bytes: u64) -> Result<Buffer> {
        if bytes == 0 {
            return Err(Error::InvalidArgument(
                "cannot allocate a 0-byte buffer".into(),
            ));
        }
        use rustix::fs::{MemfdFlags, SealFlags};
        // What the system refuses (a size past the address space or the memory limits, out of
        // file descriptors) is the caller's request, named with its size: not a bug of commd.
        let refused = |what: &str, e: std::io::Error| {
            Error::InvalidArgument(format!(
                "cannot allocate a shared buffer of {bytes} bytes: {what}: {e}"
            ))
        };
        let fd =
            rustix::fs::memfd_create("commd-buf", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                .map_err(|e| refused("memfd_create", e.into()))?;
        rustix::fs::ftruncate(&fd, bytes).map_err(|e| refused("ftruncate", e.into()))?;
        // Every page allocated here, by this process (charged to its memory limits, refused
        // here when memory is short), never by the daemon when an op first writes a page the
        // caller did not touch.
        rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, bytes)
            .map_err(|e| refused("fallocate", e.into()))?;
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(std::io::Error::from)?;
        let file = File::from(fd);
        let len = usize::try_from(bytes)
            .map_err(|_| refused("mmap", std::io::ErrorKind::InvalidInput.into()))?;
        let map = MmapOptions::new()
            .len(len)
            .map_raw(&file)
            .map_err(|e| refused("mmap", e))?;
        // Written once here, so that every page is in memory and up to date: the daemon
        // refuses ops over pages that are not (fallocate alone leaves shmem pages "not up to
        // date"), rather than fault them in on its own account.
        populate(&map);
        let mem_id = self.register_fd(file.as_fd(), bytes)?;
        Ok(Buffer {
            client: self.inner.clone(),
            mem_id,
            map: Mapping::Own(map),
            len: bytes,
        })
    }
}

/// Faults in every page of `map` for writing (`MADV_POPULATE_WRITE`, Linux 5.14), or writes a
/// zero to each page where the kernel lacks it. The pages are fresh zeroes either way.
#[allow(unsafe_code)] // madvise and writes through the buffer's own fresh mapping
fn populate(map: &MmapRaw) {
    const MADV_POPULATE_WRITE: libc::c_int = 23;
    let (base, len) = (map.as_mut_ptr(), map.len());
    // SAFETY: the whole of a mapping this function's caller just made and nobody else uses yet.
    if unsafe { libc::madvise(base.cast(), len, MADV_POPULATE_WRITE) } == 0 {
        return;
    }
    for off in (0..len).step_by(4096) {
        // SAFETY: inside the fresh mapping (as above); the page holds zeroes.
        unsafe { std::ptr::write_volatile(base.add(off), 0) };
    }
}
