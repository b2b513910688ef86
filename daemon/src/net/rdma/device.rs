//! RDMA device discovery and checks: which devices and ports exist, their state, link layer,
//! active MTU and GID table, the GID this daemon uses (the RoCE v2 GID of the advertised IP, or
//! the configured override), and warnings for the known traps. Used by the daemon at start and
//! by `commd topo`.
//!
//! The selection logic ([`pick_gid`], [`port_warnings`]) is pure and unit-tested; the probing
//! talks to libibverbs through `sideway` (loaded at run time: [`libibverbs_loadable`] explains a
//! host without rdma-core).

#![allow(unsafe_code)] // verbs calls and memory registered with the NIC

use std::net::{IpAddr, Ipv6Addr};

pub use crate::config::GidChoice;

use sideway::ibverbs::address::GidType;
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{LinkLayer, PortState};

/// GID types as this module sees them (sideway's enum panics on unknown values, so the raw
/// type is mapped here).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidKind {
    Ib,
    RoceV1,
    RoceV2,
}

impl GidKind {
    pub fn name(self) -> &'static str {
        match self {
            GidKind::Ib => "IB",
            GidKind::RoceV1 => "RoCE v1",
            GidKind::RoceV2 => "RoCE v2",
        }
    }
}

#[derive(Clone, Debug)]
pub struct GidRow {
    pub index: u32,
    pub gid: Ipv6Addr,
    pub kind: GidKind,
    pub netdev: String,
}

/// One port of one device, as probed.
#[derive(Clone, Debug)]
pub struct PortInfo {
    pub device: String,
    pub port: u8,
    pub active: bool,
    pub state: String,
    /// "InfiniBand" or "Ethernet".
    pub link: String,
    pub active_mtu: u32,
    pub max_mtu: u32,
    pub lid: u16,
    pub gids: Vec<GidRow>,
    pub vendor_id: u32,
}

impl PortInfo {
    pub fn is_ib(&self) -> bool {
        self.link == "InfiniBand"
    }
}

/// True when `libibverbs.so.1` can be loaded; otherwise the loader's reason.
pub fn libibverbs_loadable() -> Result<(), String> {
    let name = c"libibverbs.so.1";
    // SAFETY: dlopen with a valid NUL-terminated name; the handle is closed right away (the
    // library stays loaded if rdma-mummy-sys holds it too). dlerror returns a thread-local
    // C string or NULL, read before any other dl call on this thread.
    unsafe {
        let h = libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if h.is_null() {
            let e = libc::dlerror();
            let why = if e.is_null() {
                "not found".to_string()
            } else {
                std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
            };
            return Err(format!(
                "libibverbs.so.1 cannot be loaded ({why}); install rdma-core / libibverbs1"
            ));
        }
        libc::dlclose(h);
    }
    Ok(())
}

fn mtu_bytes(m: sideway::ibverbs::device_context::Mtu) -> u32 {
    use sideway::ibverbs::device_context::Mtu;
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

/// Every port of every RDMA device on this host, or why there are none.
pub fn probe() -> Result<Vec<PortInfo>, String> {
    let sys = std::path::Path::new("/sys/class/infiniband");
    let names: Vec<String> = std::fs::read_dir(sys)
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    if names.is_empty() {
        return Err(format!(
            "no RDMA devices ({} is empty or absent: no RDMA NIC driver loaded, and no rxe/siw link configured)",
            sys.display()
        ));
    }
    libibverbs_loadable()
        .map_err(|e| format!("RDMA devices {} present, but {e}", names.join(",")))?;
    let list = DeviceList::new().map_err(|e| {
        format!("listing RDMA devices failed: {e} (is the ib_uverbs module loaded?)")
    })?;
    if list.is_empty() {
        return Err(
            "no RDMA devices (libibverbs found none: no NIC driver, or no rxe/siw link configured)"
                .into(),
        );
    }
    let mut out = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(target: "commd::init", "RDMA device {name}: cannot open: {e}");
                continue;
            }
        };
        let attr = match ctx.query_device() {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(target: "commd::init", "RDMA device {name}: query failed: {e}");
                continue;
            }
        };
        for port in 1..=attr.phys_port_cnt() {
            let Ok(p) = ctx.query_port(port) else {
                continue;
            };
            let link = match p.link_layer() {
                LinkLayer::InfiniBand => "InfiniBand",
                LinkLayer::Ethernet => "Ethernet",
                LinkLayer::Unspecified => "InfiniBand",
            };
            let mut gids = Vec::new();
            for i in 0..u32::try_from(p.gid_tbl_len()).unwrap_or(0) {
                let Ok(e) = ctx.query_gid_ex(port, i) else {
                    continue;
                };
                let g = Ipv6Addr::from(e.gid().raw);
                if g.is_unspecified() {
                    continue;
                }
                let kind = match e.gid_type() {
                    GidType::InfiniBand => GidKind::Ib,
                    GidType::RoceV1 => GidKind::RoceV1,
                    GidType::RoceV2 => GidKind::RoceV2,
                };
                gids.push(GidRow {
                    index: i,
                    gid: g,
                    kind,
                    netdev: e.netdev_name().unwrap_or_default(),
                });
            }
            let state = p.port_state();
            out.push(PortInfo {
                device: name.clone(),
                port,
                active: state == PortState::Active,
                state: format!("{state:?}"),
                link: link.into(),
                active_mtu: mtu_bytes(p.active_mtu()),
                max_mtu: mtu_bytes(p.max_mtu()),
                lid: p.lid(),
                gids,
                vendor_id: attr.vendor_id(),
            });
        }
    }
    Ok(out)
}

/// `commd topo`'s RDMA section: devices, ports, state, link layer, MTUs and GID tables, plus
/// the GID this host's daemon would pick for `ip` and the warnings.
pub fn topo_text(choice: &GidChoice, ip: IpAddr) -> String {
    let ports = match probe() {
        Ok(p) => p,
        Err(why) => return format!("RDMA: {why}; inter-node data uses TCP\n"),
    };
    let mut out = format!("RDMA: {} port(s)\n", ports.len());
    for p in &ports {
        out.push_str(&format!(
            "  {}:{} {} {} active MTU {} (max {}){}\n",
            p.device,
            p.port,
            p.state,
            p.link,
            p.active_mtu,
            p.max_mtu,
            if p.is_ib() {
                format!(" LID {}", p.lid)
            } else {
                String::new()
            }
        ));
        let pick = pick_gid(p, choice, ip);
        for g in &p.gids {
            let mark = match &pick {
                Ok((i, _)) if *i == g.index => "  <- used",
                _ => "",
            };
            out.push_str(&format!(
                "    GID[{}] {:<40} {:<8} {}{mark}\n",
                g.index,
                g.gid.to_string(),
                g.kind.name(),
                g.netdev
            ));
        }
        match &pick {
            Ok((i, note)) => {
                out.push_str(&format!("    selected GID[{i}]: {note}\n"));
                for w in port_warnings(p, *i) {
                    out.push_str(&format!("    warning: {w}\n"));
                }
            }
            Err(e) => out.push_str(&format!("    not usable: {e}\n")),
        }
    }
    out
}

/// The GID to use on `port` for a daemon advertising `ip`: `(index, note)` or why none fits.
pub fn pick_gid(port: &PortInfo, choice: &GidChoice, ip: IpAddr) -> Result<(u32, String), String> {
    let want = match ip {
        IpAddr::V4(a) => a.to_ipv6_mapped(),
        IpAddr::V6(a) => a,
    };
    match choice {
        GidChoice::Index(i) => {
            let Some(r) = port.gids.iter().find(|r| r.index == *i) else {
                return Err(format!(
                    "rdma_gid={i}: {}:{} has no GID at index {i} (valid: {})",
                    port.device,
                    port.port,
                    port.gids
                        .iter()
                        .map(|r| r.index.to_string())
                        .collect::<Vec<_>>()
                        .join(",")
                ));
            };
            Ok((
                *i,
                format!("{} {} (configured index)", r.kind.name(), r.gid),
            ))
        }
        GidChoice::Addr(a) => port
            .gids
            .iter()
            .filter(|r| r.gid == *a)
            .max_by_key(|r| r.kind == GidKind::RoceV2)
            .map(|r| {
                (
                    r.index,
                    format!("{} {} (configured address)", r.kind.name(), r.gid),
                )
            })
            .ok_or_else(|| {
                format!(
                    "rdma_gid={a}: not in the GID table of {}:{}",
                    port.device, port.port
                )
            }),
        GidChoice::Auto if port.is_ib() => port
            .gids
            .first()
            .map(|r| (r.index, format!("IB {}", r.gid)))
            .ok_or_else(|| format!("{}:{} has an empty GID table", port.device, port.port)),
        GidChoice::Auto => {
            let v2 = |r: &&GidRow| r.kind == GidKind::RoceV2;
            if let Some(r) = port.gids.iter().filter(v2).find(|r| r.gid == want) {
                return Ok((
                    r.index,
                    format!("RoCE v2 {} (the advertised IP {ip})", r.gid),
                ));
            }
            // Not the advertised IP (loopback or another interface): an IPv4-mapped RoCE v2 GID
            // routes; a link-local one only works inside one L2 segment.
            let mapped = port
                .gids
                .iter()
                .filter(v2)
                .find(|r| r.gid.to_ipv4_mapped().is_some());
            let any = port.gids.iter().find(v2);
            match mapped.or(any) {
                Some(r) => Ok((
                    r.index,
                    format!(
                        "RoCE v2 {} (the advertised IP {ip} has no GID on {}:{}; set rdma_gid if this is the wrong one)",
                        r.gid, port.device, port.port
                    ),
                )),
                None => Err(format!(
                    "{}:{} has no RoCE v2 GID (RoCE v1 only, or no IP on its netdev)",
                    port.device, port.port
                )),
            }
        }
    }
}

/// Known traps on a port and GID choice, as warnings to log.
pub fn port_warnings(port: &PortInfo, gid_index: u32) -> Vec<String> {
    let mut w = Vec::new();
    let row = port.gids.iter().find(|r| r.index == gid_index);
    if let Some(r) = row {
        if r.kind == GidKind::RoceV1 {
            w.push(format!(
                "{}:{} GID index {gid_index} is RoCE v1 (not routable over IP); the usual choice is the RoCE v2 entry for the same address. A wrong GID index is the most common RoCE misconfiguration",
                port.device, port.port
            ));
        }
        if !port.is_ib() && (r.gid.segments()[0] & 0xffc0) == 0xfe80 {
            w.push(format!(
                "{}:{} uses the link-local GID {} (index {gid_index}): it reaches peers on the same L2 segment only",
                port.device, port.port, r.gid
            ));
        }
    }
    if !port.is_ib() && port.active_mtu < port.max_mtu && port.active_mtu < 4096 {
        w.push(format!(
            "{}:{} active MTU is {} (max {}): the netdev MTU limits RoCE (set it to >= 4200 for 4096), and both ends must agree",
            port.device, port.port, port.active_mtu, port.max_mtu
        ));
    }
    if port.device.starts_with("erdma") {
        w.push(format!(
            "{}:{} is an eRDMA device: its MTU must match the VPC fabric's (active MTU {}); a mismatch shows up as stalls or retry errors",
            port.device, port.port, port.active_mtu
        ));
    }
    w
}

/// `rdma_device` entries: `(name, optional port)`.
pub fn parse_device_list(s: &str) -> Vec<(String, Option<u8>)> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| match x.split_once(':') {
            Some((d, p)) => (d.to_string(), p.parse().ok()),
            None => (x.to_string(), None),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(link: &str, gids: &[(u32, &str, GidKind)]) -> PortInfo {
        PortInfo {
            device: "mlx5_0".into(),
            port: 1,
            active: true,
            state: "Active".into(),
            link: link.into(),
            active_mtu: 4096,
            max_mtu: 4096,
            lid: 0,
            vendor_id: 0,
            gids: gids
                .iter()
                .map(|(i, g, k)| GidRow {
                    index: *i,
                    gid: g.parse().unwrap(),
                    kind: *k,
                    netdev: "eth0".into(),
                })
                .collect(),
        }
    }

    fn roce() -> PortInfo {
        port(
            "Ethernet",
            &[
                (0, "fe80::1", GidKind::RoceV1),
                (1, "fe80::1", GidKind::RoceV2),
                (2, "::ffff:10.0.0.1", GidKind::RoceV1),
                (3, "::ffff:10.0.0.1", GidKind::RoceV2),
                (5, "::ffff:192.168.1.7", GidKind::RoceV2),
            ],
        )
    }

    #[test]
    fn auto_picks_the_roce_v2_gid_of_the_advertised_ip() {
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(pick_gid(&roce(), &GidChoice::Auto, ip).unwrap().0, 3);
        let ip: IpAddr = "192.168.1.7".parse().unwrap();
        assert_eq!(pick_gid(&roce(), &GidChoice::Auto, ip).unwrap().0, 5);
        // An IP without a GID (loopback): the first routable RoCE v2 GID, with a note.
        let (i, note) = pick_gid(&roce(), &GidChoice::Auto, "127.0.0.1".parse().unwrap()).unwrap();
        assert_eq!(i, 3);
        assert!(note.contains("set rdma_gid"), "{note}");
        // Soft-RoCE on a netdev without an IPv4 address: only the link-local RoCE v2 GID.
        let ll = port(
            "Ethernet",
            &[(0, "fe80::5054:ff:fe12:3456", GidKind::RoceV2)],
        );
        assert_eq!(
            pick_gid(&ll, &GidChoice::Auto, "10.9.9.9".parse().unwrap())
                .unwrap()
                .0,
            0
        );
        let v1 = port("Ethernet", &[(0, "fe80::1", GidKind::RoceV1)]);
        assert!(pick_gid(&v1, &GidChoice::Auto, "10.0.0.1".parse().unwrap()).is_err());
    }

    #[test]
    fn ib_uses_index_0_and_overrides_are_checked() {
        let ib = port("InfiniBand", &[(0, "fe80::2", GidKind::Ib)]);
        assert_eq!(
            pick_gid(&ib, &GidChoice::Auto, "10.0.0.1".parse().unwrap())
                .unwrap()
                .0,
            0
        );
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        assert_eq!(pick_gid(&roce(), &GidChoice::Index(1), ip).unwrap().0, 1);
        let e = pick_gid(&roce(), &GidChoice::Index(4), ip).unwrap_err();
        assert!(e.contains("valid: 0,1,2,3,5"), "{e}");
        let a = GidChoice::parse("::ffff:10.0.0.1").unwrap();
        assert_eq!(pick_gid(&roce(), &a, ip).unwrap().0, 3, "RoCE v2 preferred");
        assert_eq!(GidChoice::parse("10.0.0.1").unwrap(), a);
        assert_eq!(GidChoice::parse("").unwrap(), GidChoice::Auto);
        assert_eq!(GidChoice::parse("7").unwrap(), GidChoice::Index(7));
        assert!(GidChoice::parse("eth0").is_err());
    }

    #[test]
    fn traps_are_warned() {
        let w = port_warnings(&roce(), 2);
        assert!(w.iter().any(|x| x.contains("RoCE v1")), "{w:?}");
        let w = port_warnings(&roce(), 1);
        assert!(w.iter().any(|x| x.contains("link-local")), "{w:?}");
        assert!(port_warnings(&roce(), 3).is_empty());
        let mut p = roce();
        p.active_mtu = 1024;
        p.device = "erdma_0".into();
        let w = port_warnings(&p, 3);
        assert!(w.iter().any(|x| x.contains("4200")), "{w:?}");
        assert!(w.iter().any(|x| x.contains("eRDMA")), "{w:?}");
        assert_eq!(
            parse_device_list("mlx5_0:1, mlx5_1"),
            vec![("mlx5_0".into(), Some(1)), ("mlx5_1".into(), None)]
        );
    }
}
