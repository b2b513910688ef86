//! Which NIC serves which GPU, and how GPU memory reaches the NIC.
//!
//! NIC-GPU affinity comes from the PCI topology in sysfs: the fewer PCI bridges between a GPU
//! and a NIC (the distance between their device paths under `/sys/devices`), the better; a
//! GPU's traffic is striped over the NICs at the smallest distance. GPU memory is registered
//! through dma-buf (GPUDirect RDMA) only when CUDA exports dma-bufs, the NIC's driver accepts
//! them, and the path carries GPU buffers; otherwise data is staged through registered host
//! memory. Both choices are pure functions over what was probed, so they are unit-tested with
//! a fake sysfs tree.

use std::path::{Path, PathBuf};

/// The PCI device path components of `link` (a sysfs symlink such as
/// `/sys/class/infiniband/mlx5_0/device` or `/sys/bus/pci/devices/0000:81:00.0`), from the
/// root complex down, e.g. `["pci0000:80", "0000:80:01.0", "0000:81:00.0"]`.
pub fn pci_chain(link: &Path) -> Option<Vec<String>> {
    let real = std::fs::canonicalize(link).ok()?;
    let parts: Vec<String> = real
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let start = parts.iter().position(|p| p.starts_with("pci"))?;
    Some(parts[start..].to_vec())
}

/// Hops between two PCI devices through their closest common bridge (`usize::MAX`: different
/// root complexes, i.e. across the CPU interconnect).
pub fn distance(a: &[String], b: &[String]) -> usize {
    let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    if common == 0 {
        return usize::MAX;
    }
    (a.len() - common) + (b.len() - common)
}

/// For each GPU, the indices of the NICs at the smallest distance (all of them when nothing is
/// known, so traffic is striped over every NIC).
pub fn nics_for_gpus(
    gpus: &[Option<Vec<String>>],
    nics: &[Option<Vec<String>>],
) -> Vec<Vec<usize>> {
    gpus.iter()
        .map(|g| {
            let d: Vec<usize> = nics
                .iter()
                .map(|n| match (g, n) {
                    (Some(g), Some(n)) => distance(g, n),
                    _ => usize::MAX,
                })
                .collect();
            let best = d.iter().copied().min().unwrap_or(usize::MAX);
            if best == usize::MAX {
                return (0..nics.len()).collect();
            }
            (0..nics.len()).filter(|&i| d[i] == best).collect()
        })
        .collect()
}

/// The sysfs paths of RDMA device `dev` and of the GPU at PCI bus id `bus` under `root`
/// (normally `/sys`).
pub fn sysfs_links(root: &Path, nic: &str, gpu_bus_id: &str) -> (PathBuf, PathBuf) {
    (
        root.join("class/infiniband").join(nic).join("device"),
        root.join("bus/pci/devices")
            .join(gpu_bus_id.to_ascii_lowercase()),
    )
}

/// How a path moves GPU memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuPath {
    /// GPUDirect RDMA: GPU memory registered with the NIC through dma-buf.
    DmaBuf,
    /// Copies through registered host staging buffers.
    HostStaging,
}

/// What was probed for one NIC path.
#[derive(Clone, Debug)]
pub struct GpuProbe {
    /// CUDA is available in the daemon.
    pub cuda: bool,
    /// The CUDA driver exports dma-bufs (`CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`).
    pub cuda_dmabuf: bool,
    /// The NIC's `ibv_reg_dmabuf_mr` probe: `Ok` when the provider implements it, else why not.
    pub nic_dmabuf: Result<(), String>,
    /// The multi-node engine carries GPU buffers on this path (this build: host memory only).
    pub engine_gpu: bool,
}

/// The GPU memory path for one NIC and the reason, for the communicator-init log.
pub fn gpu_path(p: &GpuProbe) -> (GpuPath, String) {
    let staging = |why: String| (GpuPath::HostStaging, format!("host staging: {why}"));
    if !p.cuda {
        return staging("no CUDA in the daemon".into());
    }
    if !p.cuda_dmabuf {
        return staging("the CUDA driver does not export dma-bufs".into());
    }
    if let Err(e) = &p.nic_dmabuf {
        return staging(format!("the NIC does not register dma-bufs ({e})"));
    }
    if !p.engine_gpu {
        return staging(
            "GPU buffers across nodes go through host memory in this build (dma-buf capable)"
                .into(),
        );
    }
    (GpuPath::DmaBuf, "GPUDirect RDMA through dma-buf".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(s: &str) -> Option<Vec<String>> {
        Some(s.split('/').map(String::from).collect())
    }

    #[test]
    fn closest_nic_by_pci_distance_from_a_fake_sysfs() {
        let root = std::env::temp_dir().join(format!("commd-sysfs-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let dev = root.join("devices");
        // Two root complexes; GPU0 and mlx5_0 share a switch, GPU1 and mlx5_1 share another.
        let paths = [
            ("gpu0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0"),
            ("nic0", "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:01.0"),
            ("gpu1", "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:00.0"),
            ("nic1", "pci0000:80/0000:80:01.0/0000:81:00.0/0000:82:01.0"),
        ];
        for (_, p) in &paths {
            std::fs::create_dir_all(dev.join(p)).unwrap();
        }
        let link = |l: PathBuf, target: &str| {
            std::fs::create_dir_all(l.parent().unwrap()).unwrap();
            std::os::unix::fs::symlink(dev.join(target), l).unwrap();
        };
        let (n0, g0) = sysfs_links(&root, "mlx5_0", "0000:02:00.0");
        let (n1, g1) = sysfs_links(&root, "mlx5_1", "0000:82:00.0");
        link(n0.clone(), paths[1].1);
        link(g0.clone(), paths[0].1);
        link(n1.clone(), paths[3].1);
        link(g1.clone(), paths[2].1);
        let nics = vec![pci_chain(&n0), pci_chain(&n1)];
        let gpus = vec![pci_chain(&g0), pci_chain(&g1), None];
        assert_eq!(nics[0].as_ref().unwrap()[0], "pci0000:00");
        let pick = nics_for_gpus(&gpus, &nics);
        assert_eq!(pick, vec![vec![0], vec![1], vec![0, 1]]);
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn distance_counts_hops_and_ties_stripe() {
        let g = chain("pci0000:00/a/b/gpu");
        let near = chain("pci0000:00/a/b/nic");
        let far = chain("pci0000:00/x/nic");
        let other = chain("pci0000:80/y/nic");
        assert_eq!(distance(g.as_ref().unwrap(), near.as_ref().unwrap()), 2);
        assert_eq!(distance(g.as_ref().unwrap(), far.as_ref().unwrap()), 5);
        assert_eq!(
            distance(g.as_ref().unwrap(), other.as_ref().unwrap()),
            usize::MAX
        );
        let pick = nics_for_gpus(std::slice::from_ref(&g), &[near.clone(), near, far]);
        assert_eq!(pick, vec![vec![0, 1]]);
    }

    #[test]
    fn dmabuf_only_when_every_part_supports_it() {
        let mut p = GpuProbe {
            cuda: true,
            cuda_dmabuf: true,
            nic_dmabuf: Ok(()),
            engine_gpu: true,
        };
        assert_eq!(gpu_path(&p).0, GpuPath::DmaBuf);
        p.nic_dmabuf = Err("Operation not supported".into());
        let (path, why) = gpu_path(&p);
        assert_eq!(path, GpuPath::HostStaging);
        assert!(why.contains("does not register dma-bufs"), "{why}");
        p.nic_dmabuf = Ok(());
        p.engine_gpu = false;
        assert_eq!(gpu_path(&p).0, GpuPath::HostStaging);
        p.cuda = false;
        assert!(gpu_path(&p).1.contains("no CUDA"));
    }
}
