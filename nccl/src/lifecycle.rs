//! Communicator lifecycle: unique ids, the `ncclCommInit*` family, split, finalize, destroy and
//! abort, and the reading of `ncclConfig_t`. It checks and converts the C arguments and hands
//! the work to `comm::Comm`; it keeps no state of its own.

#![allow(unsafe_code)] // the C ABI: raw pointers from C callers

use std::ffi::{c_char, c_int};
use std::sync::Arc;

use crate::comm::{self, Comm, UNIQUE_ID_BYTES};
use crate::ffi::{self, Failure, Outcome, guard, invalid, ncclResult_t, put};
use crate::memory::forget_registrations;
use crate::{ConfigHead, ncclComm_t, ncclUniqueId, ok};

pub(crate) const API_MAGIC: u32 = 0xcafe_beef;
const CONFIG_UNDEF_INT: c_int = c_int::MIN;
const SPLIT_NOCOLOR: c_int = -1;

/// Whether a config asks for a blocking communicator (the default).
///
/// # Safety
/// `config` is null or points to an `ncclConfig_t` the caller initialised.
pub(crate) unsafe fn blocking(config: *const ConfigHead) -> Outcome<bool> {
    if config.is_null() {
        return Ok(true);
    }
    // SAFETY: the caller's contract; the head is read only after its size says it is there.
    let size = unsafe { (*config).size };
    // SAFETY: as above (the magic and version follow the size in every config version).
    let magic = unsafe { (*config).magic };
    if magic != API_MAGIC || size < std::mem::size_of::<ConfigHead>() {
        return Err(invalid(
            "config was not initialised with NCCL_CONFIG_INITIALIZER (bad magic or size)",
        ));
    }
    // SAFETY: size covers the field.
    let b = unsafe { (*config).blocking };
    match b {
        CONFIG_UNDEF_INT | 1 => Ok(true),
        0 => Ok(false),
        _ => Err(invalid(format!(
            "config blocking attribute {b} is invalid (0 or 1)"
        ))),
    }
}

/// `ncclConfig_t` as NCCL 2.31/2.32 lay it out (`ncclConfig_v23100`).
#[repr(C)]
struct FullConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const std::ffi::c_char,
    split_share: c_int,
    traffic_class: c_int,
    comm_name: *const std::ffi::c_char,
    ints: [c_int; 15],
}

const _: () = assert!(std::mem::offset_of!(FullConfig, cga_cluster_size) == 20);
const _: () = assert!(std::mem::offset_of!(FullConfig, net_name) == 32);
const _: () = assert!(std::mem::offset_of!(FullConfig, comm_name) == 48);
const _: () = assert!(std::mem::size_of::<FullConfig>() == 120);

/// Names of `FullConfig::ints`, in order.
const TAIL: [&str; 15] = [
    "collnetEnable",
    "CTAPolicy",
    "shrinkShare",
    "nvlsCTAs",
    "nChannelsPerNetPeer",
    "nvlinkCentricSched",
    "graphUsageMode",
    "numRmaCtx",
    "maxP2pPeers",
    "graphStreamOrdering",
    "launchOrderImplicit",
    "numRmaSig",
    "rmaEagerInit",
    "hostCftMode",
    "nvlsHostMode",
];

/// The fields of a communicator's config other than `blocking`, set by the caller: `commName`
/// goes into the INIT line and names the communicator in the daemon (returned); `splitShare`/`shrinkShare` ask for what commd always does (a child
/// shares the daemon's resources with its parent); every other field tunes NCCL's own kernels,
/// channels or transports, which commd does not have, and is said once per process on stderr
/// (whatever `NCCL_DEBUG` says: a setting that is not applied must not pass unseen).
///
/// # Safety
/// `config` is null or a config whose magic and size `blocking` checked.
unsafe fn report_config(config: *const ConfigHead) -> Option<String> {
    if config.is_null() {
        return None;
    }
    // SAFETY: the caller's contract: `size` bytes are readable.
    let size = unsafe { (*config).size }.min(std::mem::size_of::<FullConfig>());
    let mut f: FullConfig = FullConfig {
        size: 0,
        magic: 0,
        version: 0,
        blocking: CONFIG_UNDEF_INT,
        cga_cluster_size: CONFIG_UNDEF_INT,
        min_ctas: CONFIG_UNDEF_INT,
        max_ctas: CONFIG_UNDEF_INT,
        net_name: std::ptr::null(),
        split_share: CONFIG_UNDEF_INT,
        traffic_class: CONFIG_UNDEF_INT,
        comm_name: std::ptr::null(),
        ints: [CONFIG_UNDEF_INT; 15],
    };
    // SAFETY: `size` bytes of the caller's struct over our copy (at least that large); every
    // bit pattern is a valid FullConfig.
    unsafe { std::ptr::copy_nonoverlapping(config.cast::<u8>(), (&raw mut f).cast::<u8>(), size) };
    let text = |p: *const std::ffi::c_char| -> Option<String> {
        if p.is_null() {
            return None;
        }
        // SAFETY: NCCL's contract: a C string (not NULL, checked).
        let s = unsafe { std::ffi::CStr::from_ptr(p) };
        Some(s.to_string_lossy().into_owned())
    };
    let comm_name = text(f.comm_name);
    if let Some(name) = &comm_name {
        crate::log::info(crate::log::INIT, comm::current_device(), || {
            format!("ncclConfig_t.commName {name:?}")
        });
    }
    let mut unapplied: Vec<String> = Vec::new();
    for (name, v) in [
        ("cgaClusterSize", f.cga_cluster_size),
        ("minCTAs", f.min_ctas),
        ("maxCTAs", f.max_ctas),
        ("trafficClass", f.traffic_class),
    ]
    .into_iter()
    .chain(TAIL.iter().copied().zip(f.ints))
    {
        if v != CONFIG_UNDEF_INT && name != "shrinkShare" {
            unapplied.push(format!("{name}={v}"));
        }
    }
    if let Some(n) = text(f.net_name) {
        unapplied.push(format!("netName={n:?}"));
    }
    if unapplied.is_empty() {
        return comm_name;
    }
    static SAID: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut said = comm::lock(&SAID);
    unapplied.retain(|u| !said.contains(u));
    if unapplied.is_empty() {
        return comm_name;
    }
    said.extend(unapplied.iter().cloned());
    crate::log::notice(&format!(
        "ncclConfig_t {} not applied: they tune NCCL's own kernels, channels and transports, \
         which commd does not have (its daemon sizes its work and picks its transports; \
         nccl/README.md, \"Communicator config\")",
        unapplied.join(", ")
    ));
    comm_name
}

/// `commName` as the daemon takes a name (at most 128 bytes, no control characters): NCCL
/// accepts any name, so one the daemon would refuse is shortened and cleaned, never an error.
fn daemon_name(name: &str) -> String {
    let mut out = String::new();
    for ch in name.chars().map(|c| if c.is_control() { ' ' } else { c }) {
        if out.len() + ch.len_utf8() > 128 {
            break;
        }
        out.push(ch);
    }
    out
}

fn uid_bytes(id: &ncclUniqueId) -> [u8; UNIQUE_ID_BYTES] {
    // The same byte, whether `c_char` is signed or not.
    id.internal.map(|c| u8::from_ne_bytes(c.to_ne_bytes()))
}

/// The current result of a create: `ncclInProgress` for a non-blocking communicator whose
/// join still runs.
fn created(c: &Arc<Comm>) -> ncclResult_t {
    if !c.blocking && c.joining() {
        ffi::IN_PROGRESS
    } else {
        ffi::SUCCESS
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(out: *mut ncclUniqueId) -> ncclResult_t {
    guard("ncclGetUniqueId", || {
        let u = comm::client()?.unique_id()?;
        let mut id = ncclUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        if u.len() != UNIQUE_ID_BYTES {
            return Err(Failure {
                code: ffi::INTERNAL_ERROR,
                message: format!("the daemon's unique id has {} bytes, not 128", u.len()),
            });
        }
        for (d, s) in id.internal.iter_mut().zip(&u) {
            *d = c_char::from_ne_bytes([*s]);
        }
        // SAFETY: NCCL's contract on the out pointer.
        unsafe { put(out, id, "uniqueId") }?;
        ok()
    })
}

unsafe fn init_rank(
    out: *mut ncclComm_t,
    nranks: c_int,
    id: &ncclUniqueId,
    rank: c_int,
    config: *const ConfigHead,
) -> Outcome<ncclResult_t> {
    if out.is_null() {
        return Err(invalid("comm is a null pointer"));
    }
    // SAFETY: the caller's contract on config.
    let b = unsafe { blocking(config) }?;
    // SAFETY: as above (`blocking` checked its magic and size).
    let name = unsafe { report_config(config) }.map(|n| daemon_name(&n));
    let c = Comm::create(
        &uid_bytes(id),
        rank,
        nranks,
        comm::current_device(),
        b,
        name,
    )?;
    let r = created(&c);
    // SAFETY: checked non-null above; NCCL's contract.
    unsafe { out.write(comm::handle(c)) };
    Ok(r)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(
    out: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
) -> ncclResult_t {
    // SAFETY: NCCL's contract on the pointers.
    guard("ncclCommInitRank", || unsafe {
        init_rank(out, nranks, &id, rank, std::ptr::null())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    out: *mut ncclComm_t,
    nranks: c_int,
    id: ncclUniqueId,
    rank: c_int,
    config: *mut ConfigHead,
) -> ncclResult_t {
    // SAFETY: NCCL's contract on the pointers.
    guard("ncclCommInitRankConfig", || unsafe {
        init_rank(out, nranks, &id, rank, config)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankScalable(
    out: *mut ncclComm_t,
    nranks: c_int,
    rank: c_int,
    n_id: c_int,
    ids: *mut ncclUniqueId,
    config: *mut ConfigHead,
) -> ncclResult_t {
    guard("ncclCommInitRankScalable", || {
        if n_id < 1 || ids.is_null() {
            return Err(invalid(format!(
                "{n_id} unique ids at {ids:p}: at least one is needed"
            )));
        }
        // The first id names the communicator (commd's daemons need no spread of roots).
        // SAFETY: NCCL's contract: `ids` holds `n_id` ids.
        let id = unsafe { *ids };
        // SAFETY: as above.
        unsafe { init_rank(out, nranks, &id, rank, config) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut ncclComm_t,
    ndev: c_int,
    devlist: *const c_int,
) -> ncclResult_t {
    guard("ncclCommInitAll", || {
        if comms.is_null() {
            return Err(invalid("comms is a null pointer"));
        }
        if ndev < 1 {
            return Err(invalid(format!("ndev {ndev} must be at least 1")));
        }
        let u = comm::client()?.unique_id()?;
        let mut id = [0u8; UNIQUE_ID_BYTES];
        if u.len() == UNIQUE_ID_BYTES {
            id.copy_from_slice(&u);
        }
        let devs: Vec<i32> = (0..ndev)
            .zip(0usize..)
            .map(|(d, i)| {
                if devlist.is_null() {
                    d
                } else {
                    // SAFETY: NCCL's contract: devlist holds ndev entries.
                    unsafe { *devlist.add(i) }
                }
            })
            .collect();
        // The same device may be listed more than once (ranks sharing a GPU: a commd
        // extension), but each must exist.
        let count = comm::device_count();
        if let Some(&d) = devs
            .iter()
            .find(|&&d| d < 0 || count.is_some_and(|n| d >= n))
        {
            return Err(invalid(format!(
                "invalid device {d} in devlist ({})",
                count.map_or("CUDA not loaded".into(), |n| format!(
                    "{n} CUDA devices visible"
                ))
            )));
        }
        // Every rank joins on its own thread (a join returns once all ranks joined).
        let joins: Vec<_> = devs
            .iter()
            .zip(0..ndev)
            .map(|(&d, r)| std::thread::spawn(move || Comm::create(&id, r, ndev, d, true, None)))
            .collect();
        let mut made = Vec::new();
        let mut first = None;
        for j in joins {
            match j.join() {
                Ok(Ok(c)) => made.push(c),
                Ok(Err(f)) => {
                    first.get_or_insert(f);
                }
                Err(_) => {
                    first.get_or_insert(Failure {
                        code: ffi::INTERNAL_ERROR,
                        message: "a join thread panicked".into(),
                    });
                }
            }
        }
        if let Some(f) = first {
            return Err(f);
        }
        for (i, c) in made.into_iter().enumerate() {
            // SAFETY: NCCL's contract: comms holds ndev entries.
            unsafe { comms.add(i).write(comm::handle(c)) };
        }
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommFinalize(c: ncclComm_t) -> ncclResult_t {
    guard("ncclCommFinalize", || {
        comm::get(c)?.finalize()?;
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDestroy(c: ncclComm_t) -> ncclResult_t {
    guard("ncclCommDestroy", || {
        if c.is_null() {
            return ok();
        }
        let comm = comm::release(c)?;
        forget_registrations(c);
        crate::window::forget_windows(c);
        // Outstanding ops finish first (NCCL's destroy flushes them); a failure is already
        // the communicator's async error and does not stop the destroy.
        if !comm.joining() {
            let _ = comm.finalize();
        }
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommAbort(c: ncclComm_t) -> ncclResult_t {
    guard("ncclCommAbort", || {
        if c.is_null() {
            return ok();
        }
        let comm = comm::release(c)?;
        forget_registrations(c);
        crate::window::forget_windows(c);
        comm.abort();
        ok()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommSplit(
    c: ncclComm_t,
    color: c_int,
    key: c_int,
    newcomm: *mut ncclComm_t,
    config: *mut ConfigHead,
) -> ncclResult_t {
    guard("ncclCommSplit", || {
        if newcomm.is_null() {
            return Err(invalid("newcomm is a null pointer"));
        }
        // NCCL_COMM_NULL until a communicator is made (as NCCL: a failed split leaves none).
        // SAFETY: checked non-null; NCCL's contract.
        unsafe { newcomm.write(std::ptr::null_mut()) };
        let parent = comm::get(c)?;
        // SAFETY: NCCL's contract on config.
        let b = match unsafe { blocking(config) } {
            Ok(b) => b,
            Err(f) => return Err(f),
        };
        let b = if config.is_null() { parent.blocking } else { b };
        let color = if color == SPLIT_NOCOLOR { -1 } else { color };
        let out = parent.split(color, key, b)?;
        let r = out.as_ref().map(created).unwrap_or(ffi::SUCCESS);
        let h = out.map(comm::handle).unwrap_or(std::ptr::null_mut());
        // SAFETY: checked non-null; NCCL's contract.
        unsafe { newcomm.write(h) };
        Ok(r)
    })
}
