//! Which process exported a legacy CUDA IPC handle (`cuIpcGetMemHandle`).
//!
//! A root daemon opens any handle a client sends, and the ops it then runs read and write that
//! memory for the client: a handle copied from another user's process would give the client
//! that process's GPU memory. So a session registers only handles its own process exported. The
//! driver writes the exporter's pid into the handle (it refuses handles across PID namespaces
//! for that reason, openucx/ucx#11514) but does not document where; the daemon learns the place
//! once from two handles of its own allocations, and refuses legacy handles when it cannot
//! (`cuda_ipc_owner_check`). cuMem memory is registered by POSIX fds passed over the fd socket,
//! whose sender the kernel names; it needs none of this.
//!
//! May use: `Cuda`'s allocation and export.

use std::sync::OnceLock;

use super::Cuda;

/// Where this driver's handles hold the exporter's pid, learned once.
static PID_OFFSET: OnceLock<Result<usize, String>> = OnceLock::new();

/// The handle length (CUipcMemHandle).
const HANDLE: usize = 64;

impl Cuda {
    /// The pid of the process that exported `handle`.
    pub fn exporter_pid(&'static self, handle: &[u8]) -> Result<u32, String> {
        if handle.len() != HANDLE {
            return Err(format!(
                "a CUDA IPC handle is {HANDLE} bytes, not {}",
                handle.len()
            ));
        }
        let off = PID_OFFSET.get_or_init(|| self.learn_pid_offset()).clone()?;
        let b = handle.get(off..off + 4).ok_or("handle too short")?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn learn_pid_offset(&'static self) -> Result<usize, String> {
        let gpu = self.gpus.first().ok_or("no GPU")?;
        let mut handles = Vec::new();
        for _ in 0..2 {
            let mem = self.alloc(&gpu.uuid, 4096)?;
            handles.push(self.export(&mem)?);
        }
        let r = pid_offset(std::process::id(), &handles);
        match &r {
            Ok(off) => {
                tracing::debug!(target: "commd::cuda", off, "CUDA IPC handles carry the exporter's pid")
            }
            Err(why) => {
                tracing::warn!(target: "commd::cuda", "legacy CUDA IPC registrations will be refused (cuda_ipc_owner_check=on): {why}")
            }
        }
        r
    }
}

/// The one offset at which every handle in `handles` (all exported by process `pid`) holds
/// `pid`, little-endian; offset 8 when several do (where the GPU machines' driver writes it).
fn pid_offset(pid: u32, handles: &[Vec<u8>]) -> Result<usize, String> {
    let want = pid.to_le_bytes();
    let at: Vec<usize> = (0..=HANDLE - 4)
        .filter(|&i| handles.iter().all(|h| h.get(i..i + 4) == Some(&want[..])))
        .collect();
    match at.as_slice() {
        [one] => Ok(*one),
        many if many.contains(&8) => Ok(8),
        [] => Err(format!(
            "this driver's IPC handles do not carry the exporting process's id ({pid}) where expected"
        )),
        many => Err(format!(
            "this driver's IPC handles carry the exporting process's id ({pid}) at several places ({many:?})"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// Two handles one process (pid 529) exported on an H200 (2026-12-03).
    const SEEN: [&str; 2] = [
        "700ea837000000001102000000000000000040000000000000040000000000000600000000ff000032000000000000001b00d0c19600005c0000000000000000",
        "700ea837000000001102000000000000000040000000000000040000000000000600000000ff000033000000000000001b00d0c19800005c0000000000000000",
    ];

    #[test]
    fn the_pid_is_found_where_the_driver_writes_it() {
        let h: Vec<Vec<u8>> = SEEN.iter().map(|s| hex(s)).collect();
        assert_eq!(pid_offset(529, &h), Ok(8));
    }

    #[test]
    fn a_layout_without_the_pid_or_with_it_in_two_places_is_not_guessed() {
        let h: Vec<Vec<u8>> = SEEN.iter().map(|s| hex(s)).collect();
        assert!(pid_offset(530, &h).unwrap_err().contains("do not carry"));
        let mut twice = vec![0u8; HANDLE];
        twice[20..24].copy_from_slice(&529u32.to_le_bytes());
        twice[40..44].copy_from_slice(&529u32.to_le_bytes());
        let e = pid_offset(529, &[twice]).unwrap_err();
        assert!(e.contains("several places"), "{e}");
    }
}
