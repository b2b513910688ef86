//! `commd topo`: the GPUs, their links and the RDMA devices, as a running daemon sees them, or
//! probed here with the daemon's own code when none answers (operators run it first, like
//! `nvidia-smi topo -m`).

use crate::config::Config;
use crate::serve::exit;

/// The RDMA part of `commd topo`: probed by this command on this host (the same library and
/// devices the daemon uses).
fn rdma_topo(cfg: &Config) -> String {
    let choice = crate::net::rdma::GidChoice::parse(&cfg.rdma_gid)
        .unwrap_or(crate::net::rdma::GidChoice::Auto);
    let listen = cfg
        .peer_listen
        .map_or(std::net::IpAddr::from([0, 0, 0, 0]), |a| a.ip());
    let (ip, _) = crate::peer::advertise_ip(&cfg.advertise, listen);
    crate::net::rdma::device::topo_text(&choice, ip)
}

pub fn topo(cfg: &Config, json: bool) -> i32 {
    // Operators run `topo` first, like `nvidia-smi topo -m`: with no daemon answering, this
    // command probes the host itself with the daemon's own code, and says so.
    let (t, source) =
        match commd_client::Client::connect(Some(&cfg.socket)).and_then(|c| c.topology()) {
            Ok(t) => (t, "daemon".to_string()),
            Err(e) => {
                let why = e.to_string();
                let why = why.split(". ").next().unwrap_or(&why).to_string();
                if !json {
                    println!("no daemon answered ({why}): probed this host directly");
                }
                // The probe a daemon runs at start (CUDA only if the config allows it).
                let _ = crate::cuda::init(cfg.cuda, cfg.gpu_scratch_slot_bytes);
                (crate::cuda::topology_reply(), "host probe".to_string())
            }
        };
    let uuid = commd_cuda::uuid_string;
    if json {
        let gpus: Vec<_> = t.gpus.iter().map(|g| serde_json::json!({"ordinal": g.ordinal, "name": g.name,
            "uuid": uuid(&g.uuid), "pci_bus_id": g.pci_bus_id, "memory_bytes": g.memory_bytes,
            "copy_engines": g.copy_engines, "sm_count": g.sm_count, "compute_capability": g.compute_capability})).collect();
        let links: Vec<_> = t.links.iter().map(|l| serde_json::json!({"from": l.from, "to": l.to, "p2p": l.p2p,
            "path": l.path, "performance_rank": l.performance_rank, "native_atomics": l.native_atomics})).collect();
        // The daemon's data links (what the text lists under "Links"), when a daemon answered.
        let data_links: Vec<_> = crate::cli::stat::link_list(cfg)
            .into_iter()
            .map(|(name, kind, what)| serde_json::json!({"name": name, "kind": kind, "description": what}))
            .collect();
        let j = serde_json::json!({"source": source, "cuda_available": t.cuda_available, "cuda_reason": t.cuda_reason,
            "driver_version": t.driver_version, "gpus": gpus, "links": links, "data_links": data_links,
            "rdma": rdma_topo(cfg)});
        println!("{j}");
        return exit::OK;
    }
    if !t.cuda_available {
        let who = if source == "daemon" {
            "the daemon serves"
        } else {
            "a daemon here would serve"
        };
        println!(
            "CUDA: unavailable ({}); {who} host memory only",
            t.cuda_reason
        );
        print!("{}", rdma_topo(cfg));
        return exit::OK;
    }
    println!("CUDA driver {}, {} GPU(s)", t.driver_version, t.gpus.len());
    for g in &t.gpus {
        println!(
            "  GPU{} {} {} pci {} {} GiB sm_{} {} SMs {} copy engines",
            g.ordinal,
            g.name,
            uuid(&g.uuid),
            g.pci_bus_id,
            g.memory_bytes >> 30,
            g.compute_capability.replace('.', ""),
            g.sm_count,
            g.copy_engines
        );
    }
    if t.gpus.len() > 1 {
        print!("P2P   ");
        for g in &t.gpus {
            print!(" GPU{:<3}", g.ordinal);
        }
        println!();
        for a in &t.gpus {
            print!("GPU{:<3}", a.ordinal);
            for b in &t.gpus {
                let cell = if a.ordinal == b.ordinal {
                    "X".to_string()
                } else {
                    match t
                        .links
                        .iter()
                        .find(|l| l.from == a.ordinal && l.to == b.ordinal)
                    {
                        Some(l) if l.p2p => format!(
                            "P{}{}",
                            l.performance_rank,
                            if l.native_atomics { "a" } else { "" }
                        ),
                        Some(_) => "HOST".into(),
                        None => "?".into(),
                    }
                };
                print!(" {cell:<6}");
            }
            println!();
        }
        println!(
            "  P<n>: peer access, driver performance rank n (a: native atomics); HOST: no P2P, the driver stages copies through host memory"
        );
        for l in &t.links {
            println!("  GPU{} -> GPU{}: {}", l.from, l.to, l.path);
        }
    }
    print!("{}", rdma_topo(cfg));
    exit::OK
}
