//! Host-wide CPU claims for data-plane polling threads.
//!
//! The deployment we learned from ran at 0.06 Gbps instead of ~90 because thread `i` of every
//! worker process was pinned to core `i`, so busy-polling threads of different workers shared
//! cores. Here every polling thread (of any session, in any commd process of the same user on the
//! host: daemons and `commd switch`) claims a core in one registry file under an exclusive
//! `flock`; a core is pinned by at most one live thread. A non-root process also reads root's
//! registry (the system daemon's claims) and leaves those cores alone. When no core is free the
//! thread stays unpinned (the scheduler spreads it) and says so. Claims of dead processes are
//! reclaimed.
//!
//! The registry lives in the user's runtime directory (root: `/run/commd/cpu-claims`), never in
//! a directory other users can write to: a root daemon once truncated whatever file a user's
//! symlink at `/dev/shm/commd-cpu-claims` named. Every open goes through [`crate::private`].

use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::private::{Access, open_dir, open_file};

/// The registry's file name inside a runtime directory.
const FILE: &str = "cpu-claims";

/// The system daemon's registry (root's runtime directory).
const ROOT_REGISTRY: &str = "/run/commd/cpu-claims";

/// Where this user's claims live: `COMMD_CPU_CLAIMS`, else `cpu-claims` beside this user's
/// default socket (root: `/run/commd`; others: `$XDG_RUNTIME_DIR/commd` or `/tmp/commd-$UID`).
pub fn registry_path() -> PathBuf {
    commd_settings::get_os(&commd_settings::keys::CPU_CLAIMS)
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let sock = crate::default_socket_path();
            sock.parent().unwrap_or(Path::new("/run/commd")).join(FILE)
        })
}

/// A thread's core, released on drop.
#[derive(Debug)]
pub struct Claim {
    pub core: Option<usize>,
    /// Why the thread is not pinned (when `core` is `None`).
    pub why: String,
    tid: i32,
}

/// Cores this process may run on.
pub fn allowed_cores() -> Vec<usize> {
    match rustix::thread::sched_getaffinity(None) {
        Ok(set) => (0..rustix::thread::CpuSet::MAX_CPU)
            .filter(|&c| set.is_set(c))
            .collect(),
        Err(_) => Vec::new(),
    }
}

fn alive(pid: i32, tid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists()
}

/// One claim: (core, pid, tid, label).
pub type Row = (usize, i32, i32, String);

fn parse_rows(text: &str) -> Vec<Row> {
    text.lines()
        .filter_map(|l| {
            let mut it = l.splitn(4, ' ');
            let core = it.next()?.parse().ok()?;
            let pid = it.next()?.parse().ok()?;
            let tid = it.next()?.parse().ok()?;
            Some((core, pid, tid, it.next().unwrap_or("").to_string()))
        })
        .filter(|&(_, pid, tid, _)| alive(pid, tid))
        .collect()
}

fn with_registry<T>(f: impl FnOnce(&mut Vec<Row>) -> T) -> Result<T, String> {
    let path = registry_path();
    let refused = |e: crate::private::PathError| {
        format!("cannot open the CPU claim registry {}: {e}", path.display())
    };
    if commd_settings::get_os(&commd_settings::keys::CPU_CLAIMS).is_none_or(|p| p.is_empty())
        && let Some(dir) = path.parent()
    {
        // The default runtime directory: private to this user (root's is world-readable, as
        // its socket must be reachable).
        let mode = if rustix::process::geteuid().is_root() {
            0o755
        } else {
            0o700
        };
        open_dir(dir, Some(mode)).map_err(refused)?;
    }
    // Readable by all (the claims are cores and thread ids), writable by its owner only.
    let mut file = open_file(&path, Access::ReadWrite(0o644)).map_err(refused)?;
    rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| format!("cannot lock {}: {e}", path.display()))?;
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    let mut rows = parse_rows(&text);
    let out = f(&mut rows);
    let mut body = String::new();
    for (c, p, t, l) in &rows {
        body.push_str(&format!("{c} {p} {t} {l}\n"));
    }
    // Written over the old text, then cut to length: on a full filesystem (a user can fill
    // `/tmp`, where a non-root registry lives) only growing fails, and the old rows survive; a
    // truncate first would have dropped every claim of the host silently.
    let written = file
        .seek(SeekFrom::Start(0))
        .and_then(|_| file.write_all(body.as_bytes()))
        .and_then(|()| file.set_len(body.len() as u64));
    if let Err(e) = written {
        let _ = file.seek(SeekFrom::Start(0));
        let _ = file.write_all(text.as_bytes());
        let _ = file.set_len(text.len() as u64);
        return Err(format!(
            "cannot write the CPU claim registry {}: {e}",
            path.display()
        ));
    }
    Ok(out)
}

/// The system daemon's live claims, read-only, when this process is not root and keeps its
/// own registry elsewhere (empty when there is none or it cannot be read safely).
fn system_claims() -> Vec<Row> {
    let root = Path::new(ROOT_REGISTRY);
    if rustix::process::geteuid().is_root() || registry_path() == root {
        return Vec::new();
    }
    let Ok(mut file) = open_file(root, Access::Read) else {
        return Vec::new();
    };
    if rustix::fs::flock(&file, rustix::fs::FlockOperation::LockShared).is_err() {
        return Vec::new();
    }
    let mut text = String::new();
    let _ = file.read_to_string(&mut text);
    parse_rows(&text)
}

/// Claims a free core for the calling thread and pins it there, or explains why not.
/// `pin = false` only records nothing and returns unpinned.
pub fn claim(label: &str, pin: bool) -> Claim {
    let tid = rustix::thread::gettid().as_raw_nonzero().get();
    if !pin {
        return Claim {
            core: None,
            why: "pinning is off (switch_pin=off)".into(),
            tid,
        };
    }
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    let allowed = allowed_cores();
    let label = label.replace(['\n', ' '], "_");
    let system = system_claims();
    let picked = with_registry(|rows| {
        // Prefer the highest free core: core 0 tends to carry interrupts and housekeeping.
        let free = allowed
            .iter()
            .rev()
            .copied()
            .find(|c| !rows.iter().chain(&system).any(|r| r.0 == *c));
        if let Some(c) = free {
            rows.push((c, pid, tid, label.clone()));
        }
        free
    });
    match picked {
        Ok(Some(core)) => {
            let mut set = rustix::thread::CpuSet::new();
            set.set(core);
            match rustix::thread::sched_setaffinity(None, &set) {
                Ok(()) => Claim {
                    core: Some(core),
                    why: String::new(),
                    tid,
                },
                Err(e) => {
                    release(tid);
                    Claim {
                        core: None,
                        why: format!("sched_setaffinity({core}): {e}"),
                        tid,
                    }
                }
            }
        }
        Ok(None) => Claim {
            core: None,
            why: format!(
                "every allowed core ({}) is already claimed by another polling thread on this host",
                allowed.len()
            ),
            tid,
        },
        Err(why) => Claim {
            core: None,
            why,
            tid,
        },
    }
}

fn release(tid: i32) {
    let pid = rustix::process::getpid().as_raw_nonzero().get();
    let _ = with_registry(|rows| rows.retain(|r| !(r.1 == pid && r.2 == tid)));
}

impl Claim {
    /// "core 3" or "unpinned (why)".
    pub fn text(&self) -> String {
        match self.core {
            Some(c) => format!("core {c}"),
            None => format!("unpinned ({})", self.why),
        }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.core.is_some() {
            release(self.tid);
        }
    }
}

/// Every live claim of this user's registry: (core, pid, tid, label).
pub fn host_claims() -> Vec<Row> {
    with_registry(|rows| rows.clone()).unwrap_or_else(|why| {
        tracing::warn!("{why}");
        Vec::new()
    })
}

#[cfg(test)]
#[allow(unsafe_code)] // tests set the environment and touch raw memory
mod tests {
    use super::*;

    #[test]
    fn threads_never_share_a_core_and_claims_go_away_with_them() {
        let base = std::env::temp_dir().join(format!("commd-cores-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir(&base).unwrap();
        // A registry name planted as a symlink (the /dev/shm attack): refused, target untouched,
        // the thread unpinned with the reason.
        let victim = base.join("victim");
        std::fs::write(&victim, "precious\n").unwrap();
        let planted = base.join("planted");
        std::os::unix::fs::symlink(&victim, &planted).unwrap();
        // SAFETY: this test is the only user of the variable in this test binary.
        unsafe { std::env::set_var("COMMD_CPU_CLAIMS", &planted) };
        let c = claim("t", true);
        assert_eq!(c.core, None);
        assert!(c.why.contains("symbolic link"), "{}", c.why);
        assert!(host_claims().is_empty());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious\n");

        let dir = base.join("claims");
        // SAFETY: as above.
        unsafe { std::env::set_var("COMMD_CPU_CLAIMS", &dir) };
        let n = allowed_cores().len();
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = std::sync::Arc::new(std::sync::Barrier::new(n + 2));
        let hs: Vec<_> = (0..n + 1)
            .map(|i| {
                let tx = tx.clone();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let c = claim(&format!("t{i}"), true);
                    tx.send(c.core).unwrap();
                    stop.wait();
                })
            })
            .collect();
        let got: Vec<Option<usize>> = (0..n + 1).map(|_| rx.recv().unwrap()).collect();
        let mut pinned: Vec<usize> = got.iter().flatten().copied().collect();
        pinned.sort_unstable();
        let before = pinned.len();
        pinned.dedup();
        assert_eq!(
            before,
            pinned.len(),
            "two threads pinned to one core: {got:?}"
        );
        assert_eq!(pinned.len(), n, "every allowed core used once: {got:?}");
        assert_eq!(got.iter().filter(|c| c.is_none()).count(), 1);
        assert_eq!(host_claims().len(), n);
        stop.wait();
        for h in hs {
            h.join().unwrap();
        }
        assert!(host_claims().is_empty(), "{:?}", host_claims());
        let _ = std::fs::remove_dir_all(&base);
    }
}
