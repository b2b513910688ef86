//! Files and directories the daemon writes where another user might have a say.
//!
//! A root daemon must never write through a name that another user controls (a symlink or hard
//! link planted in `/dev/shm` or `/tmp` would make root truncate any file). So every path here
//! is walked from `/` one component at a time with `O_NOFOLLOW`: each directory on the way must
//! be owned by root or by this process's user and not writable by others unless it is sticky
//! (`/tmp`), a symlink on the way is followed only when root or this user owns it, and the file
//! itself is opened relative to the checked directory, never through a symlink, and must turn
//! out to be a regular file of an allowed owner with a single link.
//!
//! Owns no state. Used by the CPU claim registry ([`crate::cores`]) and the daemon's socket lock
//! (`commd_daemon::serve`). Uses only `rustix`; names nothing of the daemon.

use std::ffi::OsString;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

/// Why a path was refused or could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum PathError {
    #[error("{path}: {err}")]
    Io { path: PathBuf, err: std::io::Error },
    #[error(
        "{path} is a symbolic link; refusing to follow it (a link there could make the daemon write another file)"
    )]
    Symlink { path: PathBuf },
    #[error(
        "{path} is owned by uid {owner}, not by root or this process's user (uid {me}); refusing to use it"
    )]
    Owner { path: PathBuf, owner: u32, me: u32 },
    #[error(
        "{path} is writable by users other than its owner (mode {mode:o}); refusing to use it (make it writable only by its owner; a shared directory must be sticky, as /tmp is)"
    )]
    Writable { path: PathBuf, mode: u32 },
    #[error("{path} is not a {want}")]
    Kind { path: PathBuf, want: &'static str },
    #[error(
        "{path} has {links} hard links; refusing to use it (a hard link there could name another file)"
    )]
    Links { path: PathBuf, links: u64 },
    #[error("{path}: more than {MAX_LINKS} symbolic links on the way, or a '..' component")]
    Walk { path: PathBuf },
}

impl From<PathError> for std::io::Error {
    fn from(e: PathError) -> Self {
        match e {
            PathError::Io { err, .. } => err,
            other => std::io::Error::new(std::io::ErrorKind::PermissionDenied, other.to_string()),
        }
    }
}

/// Symlinks followed in one walk at most (the kernel's own limit).
const MAX_LINKS: usize = 40;

fn io(path: &Path, err: Errno) -> PathError {
    PathError::Io {
        path: path.to_path_buf(),
        err: err.into(),
    }
}

fn me() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Owner is root or us.
fn trusted_owner(path: &Path, st: &rfs::Stat) -> Result<(), PathError> {
    if st.st_uid == 0 || st.st_uid == me() {
        Ok(())
    } else {
        Err(PathError::Owner {
            path: path.to_path_buf(),
            owner: st.st_uid,
            me: me(),
        })
    }
}

/// A directory another user cannot rename entries in: trusted owner, and not group/other
/// writable unless sticky (where others may add names but not replace ours).
fn check_dir(path: &Path, fd: &OwnedFd) -> Result<(), PathError> {
    let st = rfs::fstat(fd).map_err(|e| io(path, e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return Err(PathError::Kind {
            path: path.to_path_buf(),
            want: "directory",
        });
    }
    trusted_owner(path, &st)?;
    let mode = st.st_mode & 0o7777;
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(PathError::Writable {
            path: path.to_path_buf(),
            mode,
        });
    }
    Ok(())
}

fn absolute(path: &Path) -> Result<PathBuf, PathError> {
    if path.is_absolute() {
        return Ok(path.to_path_buf());
    }
    let cwd = std::env::current_dir().map_err(|err| PathError::Io {
        path: path.to_path_buf(),
        err,
    })?;
    Ok(cwd.join(path))
}

/// Opens directory `dir` after checking it and every directory above it (see the module doc).
/// With `create`, missing components are made with `mode` (0o700 or 0o755 typically).
pub fn open_dir(dir: &Path, create: Option<u32>) -> Result<OwnedFd, PathError> {
    let abs = absolute(dir)?;
    let dflags = OFlags::DIRECTORY | OFlags::RDONLY | OFlags::CLOEXEC;
    let root = Path::new("/");
    let start = || -> Result<OwnedFd, PathError> {
        let fd = rfs::open(root, dflags, Mode::empty()).map_err(|e| io(root, e))?;
        check_dir(root, &fd)?;
        Ok(fd)
    };
    let mut fd = start()?;
    let mut shown = PathBuf::from("/");
    // Components still to walk, first at the end.
    let mut todo: Vec<OsString> = Vec::new();
    push_components(&abs, &mut todo, &abs)?;
    let mut links = 0;
    while let Some(name) = todo.pop() {
        let here = shown.join(&name);
        let opened = rfs::openat(
            &fd,
            name.as_os_str(),
            dflags | OFlags::NOFOLLOW,
            Mode::empty(),
        );
        let next = match opened {
            Ok(next) => next,
            Err(Errno::NOENT) if create.is_some() => {
                let mode = Mode::from_raw_mode(create.unwrap_or(0o700));
                match rfs::mkdirat(&fd, name.as_os_str(), mode) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(io(&here, e)),
                }
                // The umask may have narrowed the mode; set it as asked.
                let next = rfs::openat(
                    &fd,
                    name.as_os_str(),
                    dflags | OFlags::NOFOLLOW,
                    Mode::empty(),
                )
                .map_err(|e| io(&here, e))?;
                rfs::fchmod(&next, mode).map_err(|e| io(&here, e))?;
                next
            }
            Err(e @ (Errno::LOOP | Errno::NOTDIR)) => {
                let st = rfs::statat(&fd, name.as_os_str(), AtFlags::SYMLINK_NOFOLLOW)
                    .map_err(|_| io(&here, e))?;
                if FileType::from_raw_mode(st.st_mode) != FileType::Symlink {
                    return Err(io(&here, e));
                }
                // A link in a checked directory, owned by root or us: follow it by hand.
                trusted_owner(&here, &st)?;
                links += 1;
                if links > MAX_LINKS {
                    return Err(PathError::Walk { path: abs });
                }
                let target =
                    rfs::readlinkat(&fd, name.as_os_str(), Vec::new()).map_err(|e| io(&here, e))?;
                let target = PathBuf::from(std::ffi::OsStr::from_bytes(target.as_bytes()));
                if target.is_absolute() {
                    fd = start()?;
                    shown = PathBuf::from("/");
                }
                push_components(&target, &mut todo, &abs)?;
                continue;
            }
            Err(e) => return Err(io(&here, e)),
        };
        check_dir(&here, &next)?;
        fd = next;
        shown = here;
    }
    Ok(fd)
}

/// Pushes `p`'s normal components onto `todo` so that the first is popped first; refuses `..`
/// (walking up through a directory we did not check is what this module exists to avoid).
fn push_components(p: &Path, todo: &mut Vec<OsString>, whole: &Path) -> Result<(), PathError> {
    let mut names = Vec::new();
    for c in p.components() {
        match c {
            Component::Normal(n) => names.push(n.to_os_string()),
            Component::RootDir | Component::CurDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(PathError::Walk {
                    path: whole.to_path_buf(),
                });
            }
        }
    }
    todo.extend(names.into_iter().rev());
    Ok(())
}

/// How [`open_file`] opens the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Read-only; the file must exist and be owned by root or us.
    Read,
    /// Read and write, created with the given mode if missing; the file must be ours.
    ReadWrite(u32),
    /// Read-only, for what a daemon trusts (its config, its TLS key): as [`Access::Read`], and
    /// not writable by group or others; a symlink as the last component (a Kubernetes
    /// ConfigMap's `commd.toml -> ..data/commd.toml`) is followed when root or we own it.
    ReadTrusted,
}

/// Opens `path` (see the module doc): the directory is walked and checked, the file is never
/// reached through a symlink, and must be a regular file with one link, owned by us (or, for
/// [`Access::Read`], by root).
pub fn open_file(path: &Path, access: Access) -> Result<File, PathError> {
    open_file_through(path, access, 0)
}

fn open_file_through(path: &Path, access: Access, links: usize) -> Result<File, PathError> {
    let abs = absolute(path)?;
    let (Some(dir), Some(name)) = (abs.parent(), abs.file_name()) else {
        return Err(PathError::Kind {
            path: abs,
            want: "file path",
        });
    };
    let dfd = open_dir(dir, None)?;
    let flags = OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK;
    let (flags, mode) = match access {
        Access::Read | Access::ReadTrusted => (flags | OFlags::RDONLY, Mode::empty()),
        Access::ReadWrite(m) => (
            flags | OFlags::RDWR | OFlags::CREATE,
            Mode::from_raw_mode(m),
        ),
    };
    let fd = match rfs::openat(&dfd, name, flags, mode) {
        Ok(fd) => fd,
        Err(e) => {
            // A symlink there fails with ELOOP (O_NOFOLLOW), or EACCES where the kernel's
            // protected_symlinks refuses it first in a sticky directory: say which.
            let link = rfs::statat(&dfd, name, AtFlags::SYMLINK_NOFOLLOW)
                .ok()
                .filter(|st| FileType::from_raw_mode(st.st_mode) == FileType::Symlink);
            let Some(st) = link else {
                return Err(io(&abs, e));
            };
            if access != Access::ReadTrusted {
                return Err(PathError::Symlink { path: abs });
            }
            // A trusted link in a checked directory: walk its target from the start.
            trusted_owner(&abs, &st)?;
            if links >= MAX_LINKS {
                return Err(PathError::Walk { path: abs });
            }
            let target = rfs::readlinkat(&dfd, name, Vec::new()).map_err(|e| io(&abs, e))?;
            let target = Path::new(std::ffi::OsStr::from_bytes(target.as_bytes()));
            return open_file_through(&dir.join(target), access, links + 1);
        }
    };
    let st = rfs::fstat(&fd).map_err(|e| io(&abs, e))?;
    if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
        return Err(PathError::Kind {
            path: abs,
            want: "regular file",
        });
    }
    match access {
        Access::Read => trusted_owner(&abs, &st)?,
        Access::ReadTrusted => {
            trusted_owner(&abs, &st)?;
            let mode = st.st_mode & 0o7777;
            if mode & 0o022 != 0 {
                return Err(PathError::Writable { path: abs, mode });
            }
        }
        Access::ReadWrite(_) if st.st_uid != me() => {
            return Err(PathError::Owner {
                path: abs,
                owner: st.st_uid,
                me: me(),
            });
        }
        Access::ReadWrite(_) => {}
    }
    #[allow(clippy::unnecessary_cast)] // st_nlink is u32 on some targets
    let links = st.st_nlink as u64;
    if links != 1 {
        return Err(PathError::Links { path: abs, links });
    }
    // Back to blocking I/O (O_NONBLOCK only kept a FIFO planted there from blocking the open).
    rfs::fcntl_setfl(
        &fd,
        rfs::fcntl_getfl(&fd).map_err(|e| io(&abs, e))? - OFlags::NONBLOCK,
    )
    .map_err(|e| io(&abs, e))?;
    Ok(File::from(fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::fs::PermissionsExt;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("commd-private-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir(&d).unwrap();
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
        d
    }

    #[test]
    fn a_symlinked_file_is_never_opened_and_its_target_is_untouched() {
        let d = scratch("link");
        let victim = d.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        let link = d.join("claims");
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        let err = open_file(&link, Access::ReadWrite(0o600)).unwrap_err();
        assert!(matches!(err, PathError::Symlink { .. }), "{err}");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");
        // A dangling link must not create its target either.
        let link2 = d.join("claims2");
        std::os::unix::fs::symlink(d.join("created"), &link2).unwrap();
        assert!(open_file(&link2, Access::ReadWrite(0o600)).is_err());
        assert!(!d.join("created").exists());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn hard_links_and_open_directories_are_refused() {
        let d = scratch("hard");
        let victim = d.join("victim");
        std::fs::write(&victim, "precious").unwrap();
        std::fs::hard_link(&victim, d.join("claims")).unwrap();
        let err = open_file(&d.join("claims"), Access::ReadWrite(0o600)).unwrap_err();
        assert!(matches!(err, PathError::Links { links: 2, .. }), "{err}");
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "precious");

        let open = d.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = open_file(&open.join("claims"), Access::ReadWrite(0o600)).unwrap_err();
        assert!(matches!(err, PathError::Writable { .. }), "{err}");
        assert!(!open.join("claims").exists());
        // Sticky and world-writable (like /tmp, /dev/shm): allowed, entries cannot be replaced.
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let mut f = open_file(&open.join("claims"), Access::ReadWrite(0o600)).unwrap();
        f.write_all(b"x").unwrap();
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn symlinked_directories_of_trusted_owners_are_followed_by_hand() {
        let d = scratch("dirs");
        let real = d.join("real");
        std::fs::create_dir(&real).unwrap();
        std::os::unix::fs::symlink("real", d.join("rel")).unwrap();
        std::os::unix::fs::symlink(&real, d.join("abs")).unwrap();
        for via in ["rel", "abs"] {
            let mut f = open_file(&d.join(via).join("f"), Access::ReadWrite(0o600)).unwrap();
            f.write_all(via.as_bytes()).unwrap();
            let mut s = String::new();
            open_file(&real.join("f"), Access::Read)
                .unwrap()
                .read_to_string(&mut s)
                .unwrap();
            assert!(s.starts_with(via), "{s}");
        }
        // A loop ends with an error, not a hang.
        std::os::unix::fs::symlink("loop", d.join("loop")).unwrap();
        assert!(open_file(&d.join("loop").join("f"), Access::ReadWrite(0o600)).is_err());
        assert!(open_file(&d.join("real/../real/f"), Access::Read).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn missing_directories_are_created_with_the_mode_asked() {
        let d = scratch("mk");
        let deep = d.join("a/b");
        open_dir(&deep, Some(0o700)).unwrap();
        let mode = std::fs::metadata(&deep).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o700);
        assert!(open_dir(&d.join("missing"), None).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_trusted_read_follows_our_links_and_refuses_a_file_others_can_write() {
        let d = scratch("trusted");
        let data = d.join("..data");
        std::fs::create_dir(&data).unwrap();
        std::fs::write(data.join("commd.toml"), "workers = 2\n").unwrap();
        std::fs::set_permissions(
            data.join("commd.toml"),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        // As a Kubernetes ConfigMap mounts it: a relative link to the file in `..data`.
        std::os::unix::fs::symlink("..data/commd.toml", d.join("commd.toml")).unwrap();
        let mut text = String::new();
        open_file(&d.join("commd.toml"), Access::ReadTrusted)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "workers = 2\n");
        // A plain read still refuses the link.
        assert!(matches!(
            open_file(&d.join("commd.toml"), Access::Read),
            Err(PathError::Symlink { .. })
        ));
        // Group- or world-writable: refused, naming the mode.
        std::fs::set_permissions(
            data.join("commd.toml"),
            std::fs::Permissions::from_mode(0o664),
        )
        .unwrap();
        let e = open_file(&d.join("commd.toml"), Access::ReadTrusted).unwrap_err();
        assert!(matches!(e, PathError::Writable { mode: 0o664, .. }), "{e}");
        // A link loop ends with an error, not a hang.
        std::os::unix::fs::symlink("loop", d.join("loop")).unwrap();
        assert!(open_file(&d.join("loop"), Access::ReadTrusted).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
