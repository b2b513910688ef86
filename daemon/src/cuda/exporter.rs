//! Which process exported a legacy CUDA IPC handle (`cuIpcGetMemHandle`), and whether the
//! process registering it could open it itself.
//!
//! A root daemon opens any handle a client sends, and the ops it then runs read and write that
//! memory for the client. In NVIDIA's driver a legacy handle is a bearer capability: the
//! exporter's RM client shares the memory with any process (the resource server checks only the
//! owner's share policy, never the importer's uid: `clientCopyResource` and the share callbacks
//! in open-gpu-kernel-modules), and the pid the handle carries is not checked on open (the runs
//! that show both are in docs/reliability.md, section 10). So the daemon never opens for a
//! session memory that the session's process could not open itself, and it refuses a handle
//! copied from another process:
//! 1. the pid the handle carries must be the session's own (a handle copied from another
//!    process, of the same user or not, is refused with that process named); the daemon learns
//!    once where its driver writes the pid, from two handles of its own allocations, and refuses
//!    legacy handles when it cannot;
//! 2. the session's process must hold the handle's GPU device node open (`/dev/nvidiaN`), as
//!    every process with a CUDA context on that GPU does: a process without the GPU (a container
//!    it was not given to) is refused, however it came by the handle.
//!
//! A process that passes both could have opened the handle with the driver directly. Both checks
//! are `cuda_ipc_owner_check` (on by default). cuMem memory is registered by POSIX fds passed
//! over the fd socket, whose sender the kernel names; it needs none of this.
//!
//! May use: `Cuda`'s allocation and export, `/proc`.

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

/// Whether process `pid` holds the device node of the GPU with PCI bus id `bus` open
/// (`/dev/nvidiaN`, char major 195), as every process with a CUDA context on it does: the
/// driver opens a legacy handle for any process that can reach the GPU, so one that holds the
/// node gains nothing through the daemon, and one that does not (a container without that GPU)
/// is refused. When the driver does not say the GPU's minor, any GPU node counts.
pub fn holds_gpu(pid: i32, bus: &str) -> Result<bool, String> {
    let minor = gpu_minor(bus);
    let dir = format!("/proc/{pid}/fd");
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{dir}: {e}"))?;
    for e in entries.flatten() {
        // stat through the magic link: the device itself, whatever its path in the process's
        // mount namespace.
        let Ok(st) = rustix::fs::stat(e.path()) else {
            continue;
        };
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::CharacterDevice
        {
            continue;
        }
        let (maj, min) = (rustix::fs::major(st.st_rdev), rustix::fs::minor(st.st_rdev));
        if maj == NVIDIA_MAJOR && minor.map_or(min < CTL_MINOR, |m| m == min) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The NVIDIA driver's char major; minor 255 is `/dev/nvidiactl`, below it the GPUs.
const NVIDIA_MAJOR: u32 = 195;
const CTL_MINOR: u32 = 255;

/// The device minor of the GPU at PCI bus id `bus` (`/proc/driver/nvidia/gpus/BUS/information`).
fn gpu_minor(bus: &str) -> Option<u32> {
    let p = format!(
        "/proc/driver/nvidia/gpus/{}/information",
        bus.to_ascii_lowercase()
    );
    let text = std::fs::read_to_string(p).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("Device Minor:"))
        .and_then(|v| v.trim().parse().ok())
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

    /// Two handles one process (pid 529) exported on an H200.
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
    fn a_process_holding_no_gpu_node_is_told_apart_from_a_missing_one() {
        // A child with /dev/null (a char device, not a GPU) as its stdin, and nothing of
        // this test process's CUDA, if another test opened it.
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .stdin(std::fs::File::open("/dev/null").unwrap())
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let r = holds_gpu(pid, "0000:00:06.0");
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(r, Ok(false));
        assert!(holds_gpu(i32::MAX, "0000:00:06.0").is_err());
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
