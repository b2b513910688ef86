//! A multi-node communicator's switch session: whether to use one (every node must ask for the
//! same controller, and the job must fit), bring-up through the controller beside the wire (the
//! wire keeps heartbeating), and agreement on the outcome, so that either every node uses the
//! switch or every node logs the same reason and uses TCP.

#![allow(unsafe_code)] // host-staged GPU memory and registered buffers moved by the network thread

use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::NetCtx;
use super::algo::{self, Topo};
use super::wire::{CLASS_COLL, NetError, Sig, Tag, Wire};
use crate::switch::session::{Want, bring_up};
use crate::switch::worker::{Stats, Worker};
use commd_switch::packet::{MAX_WORKERS, PacketSize};

/// What `commd status` shows about a communicator's switch session.
#[derive(Debug, Default)]
pub struct SwitchInfo {
    /// "off", "via HOST:PORT, session 0x..", or "TCP fallback: why".
    pub state: String,
    pub stats: Option<Arc<Stats>>,
    pub cores: Option<Arc<Mutex<Vec<String>>>>,
}

impl SwitchInfo {
    pub fn text(&self) -> String {
        let mut s = self.state.clone();
        if let Some(c) = &self.cores {
            let c = c.lock().unwrap_or_else(|e| e.into_inner());
            let threads: Vec<String> = c
                .iter()
                .enumerate()
                .map(|(i, x)| format!("thread {i} {x}"))
                .collect();
            s.push_str(&format!("; {}", threads.join(", ")));
        }
        if let Some(st) = &self.stats {
            use std::sync::atomic::Ordering::Relaxed;
            s.push_str(&format!(
                "; {} ops, {} packets sent, {} retransmitted, {} results, {} dropped",
                st.ops.load(Relaxed),
                st.packets_sent.load(Relaxed),
                st.retransmits.load(Relaxed),
                st.results.load(Relaxed),
                st.dropped_results.load(Relaxed)
            ));
        }
        s
    }
}

const WANT_MSG: u64 = u64::MAX - 1;
const OK_MSG: u64 = u64::MAX - 2;
const TEXT: usize = 256;
const SETUP_SIG: Sig = Sig {
    op: 0xfe,
    dtype: 0,
    redop: 0xff,
    root: 0,
    count: 0,
};

fn pad(s: &str) -> [u8; TEXT] {
    let mut b = [0u8; TEXT];
    let n = s.len().min(TEXT);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
    b
}

fn unpad(b: &[u8]) -> String {
    let n = b.iter().position(|&x| x == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..n]).into_owned()
}

/// Sends `mine` to every other node and returns every node's text (index = node).
fn exchange(
    w: &mut Wire,
    t: &Topo,
    msg: u64,
    mine: &str,
    deadline: Instant,
) -> Result<Vec<String>, NetError> {
    let n = t.nodes.len();
    let out = pad(mine);
    let mut inb = vec![[0u8; TEXT]; n];
    let tag = Tag {
        class: CLASS_COLL,
        a: msg,
        b: 0,
    };
    let mut sends = Vec::new();
    let mut recvs = Vec::new();
    for (i, b) in inb.iter_mut().enumerate() {
        if i == t.me {
            continue;
        }
        // SAFETY: `out` and `inb` outlive the wait below, which completes both transfers.
        unsafe {
            sends.push(w.send(i, tag, &SETUP_SIG, out.as_ptr(), TEXT)?);
            recvs.push(w.recv(i, tag, None, b.as_mut_ptr(), TEXT as u64, algo::sig_text)?);
        }
    }
    w.wait(
        &sends,
        &recvs,
        deadline,
        algo::sig_text,
        &|peers: &[usize]| {
            let who: Vec<String> = peers.iter().map(|&p| t.label(p)).collect();
            format!(
                "switch session setup timed out waiting for {}",
                who.join(", ")
            )
        },
    )?;
    for s in sends {
        w.release_send(s);
    }
    for r in &recvs {
        w.release_recv(r);
    }
    Ok((0..n)
        .map(|i| {
            if i == t.me {
                mine.to_string()
            } else {
                unpad(&inb[i])
            }
        })
        .collect())
}

/// Agrees on and brings up the communicator's switch session. `None`: TCP (the reason is logged
/// and put in `info`). A wire error is returned (the communicator is then broken).
#[allow(clippy::too_many_arguments)]
pub fn setup(
    ctx: &NetCtx,
    t: &Topo,
    w: &mut Wire,
    wanted: &str,
    token: &[u8; 16],
    label: &str,
    wake: &Arc<OwnedFd>,
    info: &Mutex<SwitchInfo>,
) -> Result<Option<Worker>, NetError> {
    let set = |s: String| {
        info.lock().unwrap_or_else(|e| e.into_inner()).state = s;
    };
    let deadline = Instant::now() + ctx.peer_timeout.max(Duration::from_secs(10)) * 3;
    let wants = exchange(w, t, WANT_MSG, wanted, deadline)?;
    if wants.iter().all(|x| x == "off") {
        set("off".into());
        return Ok(None);
    }
    let fallback = |why: String| {
        tracing::warn!(target: "commd::net", "{label}: switch session not used, inter-node all-reduce goes over TCP: {why}");
        set(format!("TCP fallback: {why}"));
    };
    if let Some((i, other)) = wants.iter().enumerate().find(|(_, x)| *x != &wants[0]) {
        fallback(format!(
            "the nodes disagree on the switch: {} asks for '{}', {} for '{}'",
            t.label(0),
            wants[0],
            t.label(i),
            other
        ));
        return Ok(None);
    }
    let n = t.nodes.len();
    if n > MAX_WORKERS {
        fallback(format!(
            "{n} nodes; a switch session holds at most {MAX_WORKERS} workers"
        ));
        return Ok(None);
    }
    // Bring up beside the wire, which keeps heartbeating while the controller answers.
    let s = &ctx.switch;
    let bind = match (s.bind.parse::<std::net::Ipv4Addr>(), ctx.switch_ip) {
        (Ok(ip), _) => Some(ip),
        (Err(_), Some(ip)) => Some(ip),
        _ => None,
    };
    let scope: String = token.iter().map(|b| format!("{b:02x}")).collect();
    let rpc_timeout = Duration::from_secs(10);
    let result = match bind {
        None => Err("no IPv4 address to send from: set switch_bind".to_string()),
        Some(bind) => {
            let want = Want {
                controller: wanted.to_string(),
                bind,
                threads: s.threads,
                window: s.window,
                size: PacketSize::from_bytes(s.packet_bytes).unwrap_or(PacketSize::Mtu1024),
                timeout: s.timeout,
                stall: (ctx.peer_timeout * 2).max(Duration::from_secs(2)),
                pin: s.pin,
            };
            let (rank, label2, wake2) = (
                u32::try_from(t.me).expect("nodes are at most the ranks, a u32"),
                label.to_string(),
                wake.clone(),
            );
            let h = std::thread::Builder::new()
                .name("commd-sw-setup".into())
                .spawn(move || {
                    bring_up(
                        &want,
                        rank,
                        u32::try_from(n).expect("nodes are at most the ranks, a u32"),
                        &scope,
                        &label2,
                        Some(wake2),
                        rpc_timeout,
                    )
                })
                .map_err(|e| NetError::Local(e.to_string()))?;
            while !h.is_finished() {
                w.pump(
                    Some(Instant::now() + Duration::from_millis(50)),
                    algo::sig_text,
                )?;
            }
            h.join()
                .unwrap_or_else(|_| Err("switch bring-up thread panicked".into()))
        }
    };
    let mine = match &result {
        Ok(_) => "ok".to_string(),
        Err(e) => format!("{}: {e}", t.label(t.me)),
    };
    let oks = exchange(w, t, OK_MSG, &mine, deadline)?;
    if let Some(bad) = oks.iter().find(|x| *x != "ok") {
        fallback(bad.clone());
        return Ok(None);
    }
    let wk = result.map_err(NetError::Local)?;
    let cores = wk.cores.lock().map(|c| c.join(", ")).unwrap_or_default();
    let st = format!(
        "via {wanted}, session port {} from {}, {} thread(s) x {} slots, {}-byte packets",
        wk.params.port,
        wk.params.bind,
        wk.params.threads,
        wk.params.window,
        wk.params.size.bytes()
    );
    tracing::info!(target: "commd::net", "{label}: switch session {st}; data-plane threads on {cores}");
    let mut g = info.lock().unwrap_or_else(|e| e.into_inner());
    g.state = st;
    g.stats = Some(wk.stats.clone());
    g.cores = Some(wk.cores.clone());
    Ok(Some(wk))
}
