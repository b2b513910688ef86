//! Host blocks: large CPU allocations owned by commd, so that collectives on them run in place.
//!
//! An ordinary allocation lives in the process's private pages, which the daemon cannot map, so
//! every op on it is staged: copied into a shared buffer and back (two copies per rank and op,
//! which take longer than the op itself: docs/benchmarks.md row `host-allreduce-32M-plain`).
//! Reading the private pages from the daemon (`process_vm_readv`) is no faster than staging
//! (docs/benchmarks.md row `host-zero-copy-probe-32M`). So the allocations themselves are made
//! where the daemon can reach them: [`alloc`]/[`free`] are an allocator (torch's CPU allocator
//! calls them for large tensors, through `commd._c10d`), and [`adopt`] gives an op on a block its
//! registration with the daemon.
//!
//! - A block starts as a private anonymous mapping of whole pages: nothing changes for memory
//!   that is never communicated.
//! - The first op on a block *moves* it into a sealed memfd: its bytes are copied into the memfd,
//!   which is then mapped over the same addresses (`mremap`), and the memfd is registered with
//!   the daemon. Later ops on it copy nothing. The move copies the block's bytes at that moment:
//!   another thread writing to the same allocation during that first op (also outside the op's
//!   range) may lose that write, so the ownership rule of an op covers its whole allocation for
//!   the first op.
//! - [`free`] keeps up to [`cache_limit`] bytes of freed blocks for reuse by an allocation of the
//!   same page count: moved blocks keep their registration, so a training loop allocating the
//!   same sizes every step moves and registers each block once.
//! - Memory pressure gives the cache back: freed private blocks are `MADV_FREE`, which the
//!   kernel reclaims by itself; freed moved blocks (shared pages, which it cannot drop) are
//!   unmapped and deregistered by [`release_cache`], which a watcher thread calls when the
//!   kernel reports memory stalls (a PSI trigger on `/proc/pressure/memory`: 100 ms of stall
//!   within 2 s), and [`alloc`] calls before it gives up on a fresh mapping.
//! - `fork()`: a shared mapping would stay shared with the child, so a child writing to a tensor
//!   it inherited would change the parent's (and the parent's later writes would show in the
//!   child). A `pthread_atfork` child handler gives the child a private copy of every moved live
//!   block and unmaps the cached ones, while the parent waits in its own handler until that is
//!   done, so the child's copy is the memory as it was at the fork. Blocks never moved are
//!   private anyway and fork as usual (copy on write).
//! - Safety: the daemon maps the memfd itself, so freeing a block (or the process dying) during
//!   an op never leaves the daemon with freed pages; it only ever sees memfds this process sent.
//!
//! The table is one mutex (a pthread mutex, locked across `fork` by the prepare handler).

#![allow(unsafe_code)] // host blocks are mappings this module owns

use std::cell::UnsafeCell;
use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Once};

use crate::{Buffer, Client, Mapping};

/// The default bound on freed blocks kept for reuse (`COMMD_CPU_CACHE_MIB` overrides).
pub const DEFAULT_CACHE_BYTES: usize = 256 << 20;

struct Shared {
    fd: OwnedFd,
    /// The registration with a session (the one that last ran an op on the block).
    reg: Option<Arc<Buffer>>,
}

struct Block {
    len: usize,
    live: bool,
    shared: Option<Shared>,
}

struct Table {
    blocks: BTreeMap<usize, Block>,
    /// Freed blocks kept for reuse: page-rounded length -> addresses.
    free: BTreeMap<usize, Vec<usize>>,
    cached: usize,
    /// The channel to the helper thread that drops registrations (forgotten in a forked child).
    reaper: Option<std::sync::mpsc::Sender<Arc<Buffer>>>,
}

struct Locked {
    m: UnsafeCell<libc::pthread_mutex_t>,
    t: UnsafeCell<Table>,
}

// SAFETY: `t` is only reached through `Guard`, which holds `m`.
unsafe impl Sync for Locked {}

static STATE: Locked = Locked {
    m: UnsafeCell::new(libc::PTHREAD_MUTEX_INITIALIZER),
    t: UnsafeCell::new(Table {
        blocks: BTreeMap::new(),
        free: BTreeMap::new(),
        cached: 0,
        reaper: None,
    }),
};

struct Guard;

fn lock() -> Guard {
    // SAFETY: a statically initialised, never destroyed mutex.
    unsafe { libc::pthread_mutex_lock(STATE.m.get()) };
    Guard
}

impl std::ops::Deref for Guard {
    type Target = Table;
    fn deref(&self) -> &Table {
        // SAFETY: the mutex is held while the guard lives.
        unsafe { &*STATE.t.get() }
    }
}

impl std::ops::DerefMut for Guard {
    fn deref_mut(&mut self) -> &mut Table {
        // SAFETY: as in deref; one guard at a time.
        unsafe { &mut *STATE.t.get() }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        // SAFETY: locked by `lock`.
        unsafe { libc::pthread_mutex_unlock(STATE.m.get()) };
    }
}

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static REUSED: AtomicU64 = AtomicU64::new(0);
static MOVED: AtomicU64 = AtomicU64::new(0);
static REGISTERED: AtomicU64 = AtomicU64::new(0);
static FORK_COPIES: AtomicU64 = AtomicU64::new(0);
static RELEASED: AtomicU64 = AtomicU64::new(0);
static CACHE_LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
static REFUSED_SAID: Once = Once::new();

/// Counters of the allocator since the process started (`commd._native.host_blocks()`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Blocks handed out by [`alloc`] (fresh or reused).
    pub allocs: u64,
    /// Of those, reused from the cache of freed blocks.
    pub reused: u64,
    /// Blocks moved into shared memory by a first op.
    pub moved: u64,
    /// Registrations with a session.
    pub registered: u64,
    /// Moved blocks copied private in a forked child (counted in the child).
    pub fork_copies: u64,
    /// Live blocks now, their bytes, and how many of them are shared.
    pub live: u64,
    pub live_bytes: u64,
    pub live_shared: u64,
    /// Freed blocks kept for reuse, in bytes.
    pub cached_bytes: u64,
    /// Bytes of cached blocks given back by [`release_cache`] (memory pressure, a failed
    /// mapping, or a caller).
    pub released_bytes: u64,
}

pub fn stats() -> Stats {
    let t = lock();
    let mut s = Stats {
        allocs: ALLOCS.load(Ordering::Relaxed),
        reused: REUSED.load(Ordering::Relaxed),
        moved: MOVED.load(Ordering::Relaxed),
        registered: REGISTERED.load(Ordering::Relaxed),
        fork_copies: FORK_COPIES.load(Ordering::Relaxed),
        released_bytes: RELEASED.load(Ordering::Relaxed),
        cached_bytes: t.cached as u64,
        ..Stats::default()
    };
    for b in t.blocks.values().filter(|b| b.live) {
        s.live += 1;
        s.live_bytes += b.len as u64;
        s.live_shared += u64::from(b.shared.is_some());
    }
    s
}

/// The bound on freed blocks kept for reuse: `COMMD_CPU_CACHE_MIB` (MiB), else
/// [`DEFAULT_CACHE_BYTES`].
pub fn cache_limit() -> usize {
    let v = CACHE_LIMIT.load(Ordering::Relaxed);
    if v != usize::MAX {
        return v;
    }
    let v = match commd_settings::get(&commd_settings::keys::CPU_CACHE_MIB) {
        None => DEFAULT_CACHE_BYTES,
        Some(s) => match s.trim().parse::<usize>() {
            Ok(m) => m.saturating_mul(1 << 20),
            Err(_) => {
                eprintln!(
                    "commd: COMMD_CPU_CACHE_MIB={s:?} is not a whole number of MiB; using {}",
                    DEFAULT_CACHE_BYTES >> 20
                );
                DEFAULT_CACHE_BYTES
            }
        },
    };
    CACHE_LIMIT.store(v, Ordering::Relaxed);
    v
}

fn page() -> usize {
    rustix::param::page_size()
}

fn round(n: usize) -> Option<usize> {
    let p = page();
    n.max(1).checked_add(p - 1).map(|v| v / p * p)
}

/// Allocates `bytes` (page-aligned, whole pages); null when the memory cannot be had. For
/// allocators: pair it with [`free`].
pub extern "C" fn alloc(bytes: usize) -> *mut libc::c_void {
    take(bytes, false)
}

/// Like [`alloc`], with the block's bytes zero (a fresh mapping is; a reused one is cleared).
pub fn alloc_zeroed(bytes: usize) -> *mut libc::c_void {
    take(bytes, true)
}

fn take(bytes: usize, zero: bool) -> *mut libc::c_void {
    static FORK: Once = Once::new();
    FORK.call_once(|| {
        // SAFETY: the handlers follow pthread_atfork's rules (see each).
        unsafe { libc::pthread_atfork(Some(prepare), Some(parent), Some(child)) };
    });
    let Some(len) = round(bytes) else {
        return std::ptr::null_mut();
    };
    ALLOCS.fetch_add(1, Ordering::Relaxed);
    {
        let mut t = lock();
        if let Some(addr) = t.free.get_mut(&len).and_then(|v| v.pop()) {
            if t.free.get(&len).is_some_and(|v| v.is_empty()) {
                t.free.remove(&len);
            }
            t.cached -= len;
            let mut shared = false;
            if let Some(b) = t.blocks.get_mut(&addr) {
                b.live = true;
                shared = b.shared.is_some();
            }
            drop(t);
            REUSED.fetch_add(1, Ordering::Relaxed);
            let p = addr as *mut libc::c_void;
            if zero {
                // SAFETY: the block's own `len` bytes, just handed out. Private pages are
                // zeroed by dropping them (MADV_DONTNEED); a memfd's must be written.
                unsafe {
                    if shared || libc::madvise(p, len, libc::MADV_DONTNEED) != 0 {
                        std::ptr::write_bytes(p as *mut u8, 0, len);
                    }
                }
            }
            return p;
        }
    }
    let mut p = fresh_mapping(len);
    if p == libc::MAP_FAILED && release_cache() > 0 {
        p = fresh_mapping(len);
    }
    if p == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    lock().blocks.insert(
        p as usize,
        Block {
            len,
            live: true,
            shared: None,
        },
    );
    p
}

fn fresh_mapping(len: usize) -> *mut libc::c_void {
    // SAFETY: a fresh anonymous mapping; no existing memory is touched.
    unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    }
}

/// Gives every cached freed block back to the system: unmapped here, its registration (if
/// any) ended, so the daemon's mapping goes too once no op holds it. Returns the bytes given
/// back. Live blocks are untouched.
pub fn release_cache() -> usize {
    let mut t = lock();
    let addrs: Vec<usize> = std::mem::take(&mut t.free)
        .into_values()
        .flatten()
        .collect();
    let bytes = std::mem::take(&mut t.cached);
    let mut left = Vec::new();
    for a in addrs {
        let Some(b) = t.blocks.remove(&a) else {
            continue;
        };
        // SAFETY: a freed block's own mapping, removed from the table above; nobody holds it.
        unsafe { libc::munmap(a as *mut libc::c_void, b.len) };
        left.extend(drop_off_thread(&mut t, b.shared.and_then(|s| s.reg)));
    }
    drop(t);
    drop(left);
    RELEASED.fetch_add(bytes as u64, Ordering::Relaxed);
    bytes
}

/// Starts, once per process, the thread that calls [`release_cache`] when the kernel reports
/// memory stalls. Without PSI (an old kernel, `/proc/pressure` not mounted) there is no thread:
/// the cache is then bounded by [`cache_limit`] alone, and a failed mapping still releases it.
/// A forked child has no watcher (threads do not fork): its `child` handler clears this so the
/// child starts its own at its first cached moved block.
fn watch_pressure() {
    if !WATCHING.swap(true, Ordering::Relaxed) {
        let _ = std::thread::Builder::new()
            .name("commd-mempress".into())
            .spawn(pressure_loop);
    }
}

static WATCHING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn pressure_loop() {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(mut f) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("/proc/pressure/memory")
    else {
        return;
    };
    // Any task stalled on memory for 100 ms within a 2 s window (2 s: the smallest window an
    // unprivileged process may ask for).
    if f.write_all(b"some 100000 2000000\0").is_err() {
        return;
    }
    let fd = rustix::fd::AsFd::as_fd(&f);
    loop {
        let mut fds = [rustix::event::PollFd::new(
            &fd,
            rustix::event::PollFlags::PRI,
        )];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(_) => return,
        }
        let ev = fds[0].revents();
        if ev.contains(rustix::event::PollFlags::ERR) {
            return;
        }
        if ev.contains(rustix::event::PollFlags::PRI) {
            release_cache();
        }
    }
}

/// The bound from which [`malloc`], [`calloc`] and [`realloc`] serve blocks (1 MiB unless set).
static MIN_BYTES: AtomicUsize = AtomicUsize::new(1 << 20);

pub fn set_min_bytes(n: usize) {
    MIN_BYTES.store(n.max(1), Ordering::Relaxed);
}

/// A `malloc` that serves requests of at least the minimum ([`set_min_bytes`]) from blocks
/// and smaller ones (and any a block cannot serve) from the C library. Pair with [`free_any`].
pub fn malloc(bytes: usize) -> *mut libc::c_void {
    if bytes >= MIN_BYTES.load(Ordering::Relaxed) {
        let p = alloc(bytes);
        if !p.is_null() {
            return p;
        }
    }
    // SAFETY: plain C allocation.
    unsafe { libc::malloc(bytes) }
}

/// `calloc` of the same kind as [`malloc`].
pub fn calloc(n: usize, size: usize) -> *mut libc::c_void {
    let Some(bytes) = n.checked_mul(size) else {
        return std::ptr::null_mut();
    };
    if bytes >= MIN_BYTES.load(Ordering::Relaxed) {
        let p = alloc_zeroed(bytes);
        if !p.is_null() {
            return p;
        }
    }
    // SAFETY: plain C allocation.
    unsafe { libc::calloc(n, size) }
}

/// `realloc` of the same kind as [`malloc`]: a pointer from either source, moved to a block
/// when it grows to the minimum, kept in place when a block shrinks.
///
/// # Safety
/// `p` is null or a live pointer from [`malloc`]/[`calloc`]/[`realloc`].
pub unsafe fn realloc(p: *mut libc::c_void, bytes: usize) -> *mut libc::c_void {
    if p.is_null() {
        return malloc(bytes);
    }
    let block = {
        let t = lock();
        t.blocks
            .get(&(p as usize))
            .filter(|b| b.live)
            .map(|b| b.len)
    };
    let old = match block {
        Some(len) if bytes <= len => return p,
        Some(len) => len,
        None if bytes < MIN_BYTES.load(Ordering::Relaxed) => {
            // SAFETY: a C library pointer (the caller's contract), staying one.
            return unsafe { libc::realloc(p, bytes) };
        }
        // SAFETY: a live C library pointer.
        None => unsafe { libc::malloc_usable_size(p) },
    };
    let q = malloc(bytes);
    if !q.is_null() {
        // SAFETY: both live, distinct; `old.min(bytes)` fits in each.
        unsafe { std::ptr::copy_nonoverlapping(p as *const u8, q as *mut u8, old.min(bytes)) };
        // SAFETY: the caller's pointer, now replaced.
        unsafe { free_any(p) };
    }
    q
}

/// A block of this allocator owned by Rust code, freed when dropped: the memory an ordinary
/// allocation of a program using the allocator gets (`commd bench --memory allocator`).
#[derive(Debug)]
pub struct OwnedBlock {
    addr: usize,
    len: usize,
}

impl OwnedBlock {
    /// A zeroed block of `bytes` (at least 1); `None` when the memory cannot be had.
    pub fn new(bytes: usize) -> Option<Self> {
        let p = alloc_zeroed(bytes.max(1));
        (!p.is_null()).then_some(Self {
            addr: p as usize,
            len: bytes,
        })
    }

    /// Its address, for [`adopt`].
    pub fn addr(&self) -> usize {
        self.addr
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: a live block of at least `len` bytes owned by `self`; the daemon writes it only
        // during ops that name it, which the caller does not overlap with this borrow (the
        // crate's ownership rules).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; `&mut self` makes this the only reference in this process.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut u8, self.len) }
    }
}

impl Drop for OwnedBlock {
    fn drop(&mut self) {
        free(self.addr as *mut libc::c_void);
    }
}

/// Frees a pointer from [`malloc`]/[`calloc`]/[`realloc`], a block or not.
///
/// # Safety
/// `p` is null or a live pointer from those functions.
pub unsafe fn free_any(p: *mut libc::c_void) {
    if !p.is_null() && !free(p) {
        // SAFETY: not a block, so a C library pointer (the caller's contract).
        unsafe { libc::free(p) };
    }
}

/// Frees a block from [`alloc`] and returns true; a pointer that is not a live block is
/// ignored (never unmapped) and returns false, so a caller can hand it to another allocator.
pub extern "C" fn free(p: *mut libc::c_void) -> bool {
    let addr = p as usize;
    let limit = cache_limit();
    let mut t = lock();
    let release = {
        let Some(b) = t.blocks.get_mut(&addr) else {
            return false;
        };
        if !b.live {
            return false;
        }
        b.live = false;
        let len = b.len;
        let anon = b.shared.is_none();
        if t.cached + len <= limit {
            t.cached += len;
            t.free.entry(len).or_default().push(addr);
            if anon {
                // Its pages may go back to the system under pressure (a reuse refaults them).
                // SAFETY: the block's own pages, which nobody uses now.
                unsafe { libc::madvise(addr as *mut libc::c_void, len, libc::MADV_FREE) };
            } else {
                watch_pressure();
            }
            None
        } else {
            t.blocks.remove(&addr)
        }
    };
    let mut left = None;
    if let Some(b) = release {
        // SAFETY: the block's own mapping, removed from the table above.
        unsafe { libc::munmap(addr as *mut libc::c_void, b.len) };
        // The registration (if any) ends when its last op lets go of it; the daemon keeps its
        // own mapping of the memfd until then.
        left = drop_off_thread(&mut t, b.shared.and_then(|s| s.reg));
    }
    drop(t);
    drop(left);
    true
}

/// Hands a registration to a helper thread that drops it: its drop deregisters with a daemon
/// call, which an allocator's `free` (called anywhere, locks held) must not wait for. Called
/// under the table's lock, so no thread is inside the channel at a fork. Returns the
/// registration when no helper can be had: the caller drops it after unlocking.
fn drop_off_thread(t: &mut Table, reg: Option<Arc<Buffer>>) -> Option<Arc<Buffer>> {
    let reg = reg?;
    if t.reaper.is_none() {
        let (tx, rx) = std::sync::mpsc::channel::<Arc<Buffer>>();
        let spawned = std::thread::Builder::new()
            .name("commd-hostmem".into())
            .spawn(move || rx.into_iter().for_each(drop));
        if spawned.is_err() {
            return Some(reg);
        }
        t.reaper = Some(tx);
    }
    let tx = t.reaper.as_ref()?;
    tx.send(reg).err().map(|e| e.0)
}

/// The registration and byte offset of `[addr, addr + bytes)` when it lies in one live block,
/// moving the block into shared memory and registering it with `client` first if needed; None
/// when the range is not in a block (the op is staged as before). An error is returned only
/// where the move failed half-way, which cannot happen with a working kernel; a registration
/// the daemon refuses (its memory limits) returns None and is said once on stderr.
///
/// The returned buffer's bytes belong to the block: do not read them through it.
pub fn adopt(client: &Client, addr: usize, bytes: usize) -> Option<(Arc<Buffer>, u64)> {
    let mut t = lock();
    let (&start, b) = t.blocks.range_mut(..=addr).next_back()?;
    if !b.live || bytes == 0 || addr.checked_add(bytes)? > start + b.len {
        return None;
    }
    if b.shared.is_none() {
        let fd = move_to_memfd(start, b.len).ok()?;
        MOVED.fetch_add(1, Ordering::Relaxed);
        b.shared = Some(Shared { fd, reg: None });
    }
    let len = b.len;
    let sh = b.shared.as_mut()?;
    if let Some(r) = &sh.reg
        && r.is_of(client)
    {
        return Some((r.clone(), (addr - start) as u64));
    }
    // Register (a daemon call) under the table's lock: a block's registration is made once.
    match client.register_fd(sh.fd.as_fd(), len as u64) {
        Ok(mem_id) => {
            REGISTERED.fetch_add(1, Ordering::Relaxed);
            let reg = Arc::new(Buffer {
                client: client.inner.clone(),
                mem_id,
                map: Mapping::Block(start),
                len: len as u64,
            });
            let old = sh.reg.replace(reg.clone());
            let left = drop_off_thread(&mut t, old);
            drop(t);
            drop(left);
            Some((reg, (addr - start) as u64))
        }
        Err(e) => {
            drop(t);
            REFUSED_SAID.call_once(|| {
                eprintln!(
                    "commd: a CPU tensor's memory could not be registered with the daemon ({e}); ops on such tensors are staged (copied) instead"
                )
            });
            None
        }
    }
}

/// Copies the block at `start` into a new sealed memfd and maps the memfd over it.
fn move_to_memfd(start: usize, len: usize) -> std::io::Result<OwnedFd> {
    use rustix::fs::{MemfdFlags, SealFlags};
    let fd = rustix::fs::memfd_create(
        "commd-cpu-tensor",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )?;
    rustix::fs::ftruncate(&fd, len as u64)?;
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)?;
    use std::os::fd::AsRawFd;
    // SAFETY: a fresh shared mapping of the memfd, then a copy of the block's own `len` bytes
    // into it and a move of that mapping over the block (MREMAP_FIXED replaces the block's pages
    // at the same addresses in one step).
    unsafe {
        let tmp = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        );
        if tmp == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        std::ptr::copy_nonoverlapping(start as *const u8, tmp as *mut u8, len);
        let r = libc::mremap(
            tmp,
            len,
            len,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            start as *mut libc::c_void,
        );
        if r == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            libc::munmap(tmp, len);
            return Err(e);
        }
    }
    Ok(fd)
}

/// The pipe on which a forked child tells its parent that its blocks are private (read end,
/// write end); -1 when no live block was shared at the fork.
static FORK_PIPE: [std::sync::atomic::AtomicI32; 2] = [
    std::sync::atomic::AtomicI32::new(-1),
    std::sync::atomic::AtomicI32::new(-1),
];

extern "C" fn prepare() {
    // Held until `parent`/`child`: no other thread is inside the table at the fork.
    std::mem::forget(lock());
    // SAFETY: the table is locked by this thread (above).
    let t = unsafe { &*STATE.t.get() };
    if t.blocks.values().any(|b| b.live && b.shared.is_some()) {
        let mut fds = [-1; 2];
        // SAFETY: a plain pipe2 call on a local array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } == 0 {
            FORK_PIPE[0].store(fds[0], Ordering::Relaxed);
            FORK_PIPE[1].store(fds[1], Ordering::Relaxed);
        }
    }
}

extern "C" fn parent() {
    let (r, w) = (
        FORK_PIPE[0].swap(-1, Ordering::Relaxed),
        FORK_PIPE[1].swap(-1, Ordering::Relaxed),
    );
    if r >= 0 {
        // SAFETY: our pipe's fds. Wait for the child's byte, or its end (EOF: it died).
        unsafe {
            libc::close(w);
            let mut b = 0u8;
            while libc::read(r, (&mut b as *mut u8).cast(), 1) < 0
                && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted
            {
            }
            libc::close(r);
        }
    }
    // SAFETY: locked by `prepare` in this thread.
    unsafe { libc::pthread_mutex_unlock(STATE.m.get()) };
}

extern "C" fn child() {
    // SAFETY: the table was locked by `prepare` in the thread that forked, which this is; the
    // child has no other thread. Only system calls and the table's own memory are used.
    let t = unsafe { &mut *STATE.t.get() };
    // The parent's helper thread is not in the child, and its channel may have been mid-call
    // in that thread at the fork: never touched here (a drop could wait on its lock).
    std::mem::forget(t.reaper.take());
    WATCHING.store(false, Ordering::Relaxed);
    let mut gone = Vec::new();
    for (&start, b) in t.blocks.iter_mut() {
        let Some(sh) = b.shared.take() else { continue };
        // The registration belongs to the parent's session: never dropped (that would
        // deregister the parent's memory), only forgotten.
        std::mem::forget(sh.reg);
        drop(sh.fd);
        if b.live {
            // SAFETY: copies the block's bytes into a fresh private mapping and moves it over
            // the shared one at the same addresses. On failure the child keeps the shared
            // mapping and must not run on: it exits rather than share the parent's memory.
            unsafe {
                let tmp = libc::mmap(
                    std::ptr::null_mut(),
                    b.len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                );
                let ok = tmp != libc::MAP_FAILED && {
                    std::ptr::copy_nonoverlapping(start as *const u8, tmp as *mut u8, b.len);
                    libc::mremap(
                        tmp,
                        b.len,
                        b.len,
                        libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
                        start as *mut libc::c_void,
                    ) != libc::MAP_FAILED
                };
                if !ok {
                    let msg = b"commd: a forked child could not copy its parent's shared CPU tensors (out of memory); it exits\n";
                    libc::write(2, msg.as_ptr().cast(), msg.len());
                    libc::_exit(127);
                }
            }
            FORK_COPIES.fetch_add(1, Ordering::Relaxed);
        } else {
            // A cached block: nobody in the child can hold it.
            // SAFETY: the block's mapping, dropped from the table below.
            unsafe { libc::munmap(start as *mut libc::c_void, b.len) };
            gone.push(start);
        }
    }
    for a in gone {
        if let Some(b) = t.blocks.remove(&a)
            && let Some(v) = t.free.get_mut(&b.len)
        {
            v.retain(|&x| x != a);
            t.cached -= b.len;
        }
    }
    t.free.retain(|_, v| !v.is_empty());
    let w = FORK_PIPE[1].swap(-1, Ordering::Relaxed);
    let r = FORK_PIPE[0].swap(-1, Ordering::Relaxed);
    if w >= 0 {
        // SAFETY: our pipe's fds.
        unsafe {
            libc::write(w, b"x".as_ptr().cast(), 1);
            libc::close(w);
            libc::close(r);
        }
    }
    // SAFETY: locked by `prepare` in the thread that forked.
    unsafe { libc::pthread_mutex_unlock(STATE.m.get()) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_reuses_freed_blocks_of_the_same_page_count_and_ignores_foreign_pointers() {
        let p = alloc(3 * page() + 5);
        assert!(!p.is_null());
        assert_eq!(p as usize % page(), 0);
        // SAFETY: 4 pages were allocated.
        unsafe { std::ptr::write_bytes(p as *mut u8, 7, 4 * page()) };
        assert!(free(p));
        let q = alloc(4 * page());
        assert_eq!(p, q, "a freed block of the same page count is reused");
        let mut x = 5u64;
        assert!(!free((&mut x as *mut u64).cast()), "not a block: ignored");
        assert_eq!(x, 5);
        assert!(free(q));
        assert!(!free(q), "a second free of a cached block is ignored");
    }

    #[test]
    fn the_malloc_family_keeps_bytes_and_zeroes_reused_blocks() {
        set_min_bytes(64 << 10);
        let small = malloc(100);
        let big = calloc(1, 200 << 10);
        // SAFETY: each pointer is used within its size; freed once.
        unsafe {
            assert!(!small.is_null() && !big.is_null());
            assert!(lock().blocks.contains_key(&(big as usize)));
            assert!(!lock().blocks.contains_key(&(small as usize)));
            assert!(
                std::slice::from_raw_parts(big as *const u8, 200 << 10)
                    .iter()
                    .all(|&b| b == 0)
            );
            std::ptr::write_bytes(big as *mut u8, 9, 200 << 10);
            std::ptr::write_bytes(small as *mut u8, 5, 100);
            // Growing a C pointer past the minimum moves it into a block, bytes kept.
            let grown = realloc(small, 300 << 10);
            assert!(lock().blocks.contains_key(&(grown as usize)));
            assert!(
                std::slice::from_raw_parts(grown as *const u8, 100)
                    .iter()
                    .all(|&b| b == 5)
            );
            free_any(big);
            // The freed block comes back zeroed to calloc.
            let again = calloc(200 << 10, 1);
            assert_eq!(again, big, "the cached block is reused");
            assert!(
                std::slice::from_raw_parts(again as *const u8, 200 << 10)
                    .iter()
                    .all(|&b| b == 0)
            );
            free_any(again);
            free_any(grown);
        }
    }
}
