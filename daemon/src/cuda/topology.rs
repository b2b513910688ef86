//! The node's GPUs as the daemon found them at start: devices, contexts and copy streams, the
//! peer matrix (which pairs copy directly and why), its log lines and the `Topology` RPC reply.
//!
//! May use: the driver (`cu`), the `Cuda` state it fills in.

#![allow(unsafe_code)] // CUDA driver calls and device memory

use super::*;

impl Cuda {
    /// Finds the GPUs, the paths between them (enabling peer access where it works), creates
    /// the copy streams and the copy-issuing threads.
    pub(super) fn probe(slot_bytes: u64) -> Result<Self, CuError> {
        let n = cu::device_count()?;
        let mut driver_version = 0;
        ck(
            // SAFETY: valid out pointer; the driver is initialized.
            unsafe { sys::cuDriverGetVersion(&mut driver_version) },
            "cuDriverGetVersion",
        )?;
        let mut gpus = Vec::new();
        for i in 0..n {
            gpus.push(probe_gpu(i)?);
        }
        let mut links = Vec::new();
        for a in 0..gpus.len() {
            for b in 0..gpus.len() {
                if a == b {
                    continue;
                }
                links.push(probe_link(&gpus, a, b)?);
            }
        }
        create_streams(&mut gpus)?;
        let issuers = issuers(gpus.len());
        Ok(Self {
            gpus,
            links,
            driver_version,
            stats: IpcStats::default(),
            slot_bytes,
            exec: Executor::default(),
            issuers,
        })
    }

    /// Logs what was found and, for each GPU pair, the path copies take and why.
    pub fn log_topology(&self) {
        for g in &self.gpus {
            tracing::info!(target: "commd::init", "GPU {} {} {} ({}), {} GiB, sm_{}{}, {} copy engines, {} SMs", g.ordinal, g.name, cu::uuid_string(&g.uuid), g.pci_bus_id, g.memory_bytes >> 30, g.compute_capability.0, g.compute_capability.1, g.copy_engines, g.sm_count);
        }
        for l in &self.links {
            tracing::info!(target: "commd::init", "GPU {} -> GPU {}: {} (perf rank {}, native atomics {})", l.from, l.to, l.path, l.performance_rank, l.native_atomics);
        }
    }
}

/// GPU `i`: its identity, memory, engines and primary context (streams come later).
fn probe_gpu(i: i32) -> Result<Gpu, CuError> {
    use sys::CUdevice_attribute as A;
    let mut dev = 0;
    // SAFETY: valid out pointer, ordinal < count.
    ck(unsafe { sys::cuDeviceGet(&mut dev, i) }, "cuDeviceGet")?;
    let mut name = [0 as std::ffi::c_char; 256];
    ck(
        // SAFETY: the buffer holds 256 bytes as we say.
        unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev) },
        "cuDeviceGetName",
    )?;
    let mut pci = [0 as std::ffi::c_char; 64];
    ck(
        // SAFETY: the buffer holds 64 bytes as we say.
        unsafe { sys::cuDeviceGetPCIBusId(pci.as_mut_ptr(), 64, dev) },
        "cuDeviceGetPCIBusId",
    )?;
    let mut mem = 0usize;
    ck(
        // SAFETY: valid out pointer.
        unsafe { sys::cuDeviceTotalMem_v2(&mut mem, dev) },
        "cuDeviceTotalMem",
    )?;
    let ctx = cu::primary_ctx(dev)?;
    Ok(Gpu {
        ordinal: i,
        dev,
        ctx,
        uuid: cu::device_uuid(dev)?,
        name: cstr(&name),
        pci_bus_id: cstr(&pci),
        memory_bytes: mem as u64,
        copy_engines: cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)?,
        sm_count: cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
        compute_capability: (
            cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            cu::device_attr(dev, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        streams: Vec::new(),
        events: Mutex::new(Vec::new()),
    })
}

/// The path copies from GPU `a` to GPU `b` take, and why: peer access is enabled here
/// (`a`'s context made current) where the driver allows it.
fn probe_link(gpus: &[Gpu], a: usize, b: usize) -> Result<Link, CuError> {
    let mut can = 0;
    ck(
        // SAFETY: valid out pointer and devices.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, gpus[a].dev, gpus[b].dev) },
        "cuDeviceCanAccessPeer",
    )?;
    let attr = |x: sys::CUdevice_P2PAttribute| -> i32 {
        let mut v = 0;
        // SAFETY: valid out pointer and devices.
        let r = unsafe { sys::cuDeviceGetP2PAttribute(&mut v, x, gpus[a].dev, gpus[b].dev) };
        if r == sys::CUresult::CUDA_SUCCESS {
            v
        } else {
            0
        }
    };
    let rank = attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK);
    let atomics =
        attr(sys::CUdevice_P2PAttribute::CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED) != 0;
    let mut p2p = can != 0;
    let mut path = if p2p {
        "P2P copy-engine push (issued on the source GPU)".to_string()
    } else {
        "host staging by the driver: cuDeviceCanAccessPeer says no P2P (check IOMMU/ACS settings or the VM/container's GPU isolation)".to_string()
    };
    if p2p {
        cu::set_current(gpus[a].ctx)?;
        // SAFETY: both contexts are retained primary contexts.
        let r = unsafe { sys::cuCtxEnablePeerAccess(gpus[b].ctx, 0) };
        if r != sys::CUresult::CUDA_SUCCESS
            && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        {
            let (name, _) = cu::describe(r);
            p2p = false;
            path = format!("host staging by the driver: enabling peer access failed ({name})");
        }
    }
    Ok(Link {
        from: a,
        to: b,
        p2p,
        performance_rank: rank,
        native_atomics: atomics,
        path,
    })
}

/// One nonblocking copy stream per GPU on every GPU.
fn create_streams(gpus: &mut [Gpu]) -> Result<(), CuError> {
    let ng = gpus.len();
    for g in gpus {
        cu::set_current(g.ctx)?;
        for _ in 0..ng {
            let mut s = std::ptr::null_mut();
            ck(
                // SAFETY: valid out pointer; the device's context is current.
                unsafe {
                    sys::cuStreamCreate(&mut s, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32)
                },
                "cuStreamCreate",
            )?;
            g.streams.push(s);
        }
    }
    Ok(())
}

/// The threads that issue copies beside the executor (none for one GPU, or when they cannot
/// start).
fn issuers(gpus: usize) -> Option<crate::fanout::Fanout> {
    // COMMD_GPU_ISSUE_THREADS=0: the executor issues every copy itself (for measurements).
    let threads =
        commd_settings::get(&commd_settings::keys::GPU_ISSUE_THREADS).is_none_or(|v| v != "0");
    if gpus > 1 && threads {
        match crate::fanout::Fanout::new(gpus - 1, "commd-gpu-issue") {
            Ok(f) => Some(f),
            Err(e) => {
                tracing::warn!(target: "commd::cuda", "no copy-issuing threads ({e}): the executor issues every copy itself");
                None
            }
        }
    } else {
        None
    }
}

/// `Topology` RPC: GPUs, pairs, and the path each pair's copies take (or why CUDA is off).
pub fn topology_reply() -> commd_proto::pb::TopologyReply {
    use commd_proto::pb;
    match get() {
        Err(why) => pb::TopologyReply {
            cuda_available: false,
            cuda_reason: why,
            ..Default::default()
        },
        Ok(c) => pb::TopologyReply {
            cuda_available: true,
            cuda_reason: String::new(),
            driver_version: format!(
                "{}.{}",
                c.driver_version / 1000,
                c.driver_version % 1000 / 10
            ),
            gpus: c
                .gpus
                .iter()
                .map(|g| pb::GpuInfo {
                    ordinal: u32::try_from(g.ordinal).expect("a device ordinal is non-negative"),
                    name: g.name.clone(),
                    uuid: g.uuid.to_vec(),
                    pci_bus_id: g.pci_bus_id.clone(),
                    memory_bytes: g.memory_bytes,
                    copy_engines: u32::try_from(g.copy_engines).unwrap_or(0),
                    sm_count: u32::try_from(g.sm_count).unwrap_or(0),
                    compute_capability: format!(
                        "{}.{}",
                        g.compute_capability.0, g.compute_capability.1
                    ),
                })
                .collect(),
            links: c
                .links
                .iter()
                .map(|l| pb::GpuLink {
                    from: u32::try_from(l.from)
                        .expect("a GPU index is below the device count, a C int"),
                    to: u32::try_from(l.to)
                        .expect("a GPU index is below the device count, a C int"),
                    p2p: l.p2p,
                    path: l.path.clone(),
                    performance_rank: l.performance_rank,
                    native_atomics: l.native_atomics,
                })
                .collect(),
        },
    }
}
