//! `commd exec -- CMD ARGS...`: runs a job whose code calls NCCL (torch's "nccl" backend,
//! DeepSpeed, dinov2, nccl-tests, vLLM's pynccl) with those calls going to this node's daemon:
//! commd's NCCL-compatible library (`libcommd_nccl.so`, SONAME `libnccl.so.2`) is preloaded,
//! `VLLM_NCCL_SO_PATH` names it, and `COMMD_SOCKET` names the daemon. The command replaces this
//! process (its exit status is the job's).
//!
//! May use: std only (the library is found on disk; nothing here talks to the daemon).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

/// Where the library is looked for, in order: the explicit path, `COMMD_NCCL_LIB`, then beside
/// the `commd` binary (a build tree) and in `PREFIX/lib/commd/` (what `scripts/install` writes).
pub fn candidates(explicit: Option<&Path>, exe: Option<&Path>) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(p) = explicit {
        v.push(p.to_path_buf());
        return v;
    }
    if let Some(p) =
        commd_settings::get_os(&commd_settings::keys::NCCL_LIB).filter(|p| !p.is_empty())
    {
        v.push(PathBuf::from(p));
        return v;
    }
    if let Some(dir) = exe.and_then(Path::parent) {
        v.push(dir.join("libcommd_nccl.so"));
        v.push(dir.join("../lib/commd/libnccl.so.2"));
        v.push(dir.join("../lib/commd/libcommd_nccl.so"));
    }
    v
}

/// The library to preload, or why there is none.
pub fn find_lib(explicit: Option<&Path>) -> Result<PathBuf, String> {
    let exe = std::env::current_exe().ok();
    let tried = candidates(explicit, exe.as_deref());
    for p in &tried {
        if p.is_file() {
            return p
                .canonicalize()
                .map_err(|e| format!("{}: {e}", p.display()));
        }
    }
    let list: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    Err(format!(
        "commd's NCCL library was not found (looked at {}): build it with `cargo build --release -p commd-nccl`, install it with scripts/install, or name it with --nccl-lib or COMMD_NCCL_LIB",
        list.join(", ")
    ))
}

/// `LD_PRELOAD` with `lib` first (a value already there is kept after it, unless it already
/// names the library).
pub fn preload_value(lib: &Path, current: Option<OsString>) -> OsString {
    let mut v = OsString::from(lib.as_os_str());
    if let Some(cur) = current.filter(|c| !c.is_empty()) {
        let l = lib.as_os_str();
        let rest: Vec<&str> = cur
            .to_str()
            .map(|s| {
                s.split([':', ' '])
                    .filter(|p| !p.is_empty() && *p != l)
                    .collect()
            })
            .unwrap_or_default();
        for p in rest {
            v.push(":");
            v.push(p);
        }
    }
    v
}

/// Replaces this process with `cmd` under the library; returns only on failure (an exit code).
pub fn run(lib: &Path, socket: &Path, cmd: &[OsString], verbose: bool) -> i32 {
    let Some((prog, args)) = cmd.split_first() else {
        eprintln!("commd exec: no command given (commd exec -- CMD ARGS...)");
        return crate::exit::USAGE;
    };
    let preload = preload_value(lib, commd_settings::system("LD_PRELOAD"));
    if verbose {
        eprintln!(
            "commd exec: LD_PRELOAD={} VLLM_NCCL_SO_PATH={} COMMD_SOCKET={}",
            preload.to_string_lossy(),
            lib.display(),
            socket.display()
        );
    }
    let err = std::process::Command::new(prog)
        .args(args)
        .env("LD_PRELOAD", &preload)
        .env("VLLM_NCCL_SO_PATH", lib)
        .env("COMMD_SOCKET", socket)
        .exec();
    eprintln!("commd exec: cannot run {}: {err}", prog.to_string_lossy());
    if err.kind() == std::io::ErrorKind::NotFound {
        127
    } else {
        126
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_puts_the_library_first_once() {
        let lib = Path::new("/x/libcommd_nccl.so");
        assert_eq!(
            preload_value(lib, None),
            OsString::from("/x/libcommd_nccl.so")
        );
        assert_eq!(
            preload_value(lib, Some("/a.so /x/libcommd_nccl.so:/b.so".into())),
            OsString::from("/x/libcommd_nccl.so:/a.so:/b.so")
        );
    }

    #[test]
    fn explicit_path_wins_and_build_tree_is_searched() {
        let c = candidates(Some(Path::new("/l.so")), Some(Path::new("/t/commd")));
        assert_eq!(c, vec![PathBuf::from("/l.so")]);
        let c = candidates(None, Some(Path::new("/t/release/commd")));
        if commd_settings::get_os(&commd_settings::keys::NCCL_LIB).is_none() {
            assert_eq!(c[0], PathBuf::from("/t/release/libcommd_nccl.so"));
            assert!(c.iter().any(|p| p.ends_with("lib/commd/libnccl.so.2")));
        }
        let e = find_lib(Some(Path::new("/nonexistent/libnccl.so.2"))).unwrap_err();
        assert!(
            e.contains("/nonexistent/libnccl.so.2") && e.contains("--nccl-lib"),
            "{e}"
        );
    }
}
