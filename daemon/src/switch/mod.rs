//! Switch sessions, the daemon's side: SwitchML-compatible in-network aggregation (see
//! `../shared/specs/switchml.md` and docs/switch.md).
//!
//! - [`worker`]: this daemon's data-plane threads of a session.
//! - [`session`]: session bring-up through the SwitchML controller API, checked.
//!
//! The packet format, the switch's aggregation semantics, the batched UDP I/O and `commd switch`
//! itself are the `commd-switch` crate's; the host-wide CPU claims that keep polling threads off
//! each other's cores are `commd-host`'s.

pub mod session;
pub mod worker;

pub use crate::config::{SwitchSettings as Settings, check_controller};

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;
    use std::time::Duration;

    use super::session::{Want, bring_up};
    use commd_switch::packet::PacketSize;
    use commd_switch::server::{self, SwitchArgs};

    thread_local! {
        static THREADS: std::cell::Cell<usize> = const { std::cell::Cell::new(2) };
        static WINDOW: std::cell::Cell<usize> = const { std::cell::Cell::new(16) };
    }

    fn switch(drop: f64, dup: f64, reorder: f64) -> (tokio::runtime::Runtime, server::Running) {
        switch_with(drop, dup, reorder, false)
    }

    fn switch_with(
        drop: f64,
        dup: f64,
        reorder: f64,
        slot_metrics: bool,
    ) -> (tokio::runtime::Runtime, server::Running) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let a = SwitchArgs {
            listen: "127.0.0.1:0".parse().unwrap(),
            data: "127.0.0.1:0".parse().unwrap(),
            metrics: "off".into(),
            slots: 8192,
            drop,
            dup,
            reorder,
            seed: 7,
            pin: "off".into(),
            slot_metrics,
        };
        let r = server::start(&a, &rt).unwrap();
        (rt, r)
    }

    /// `n` workers (threads, each with its own loopback IP) run `ops` all-reduces of `count`
    /// elements; returns each worker's results.
    fn run(
        ctl: String,
        n: u32,
        size: PacketSize,
        scope: &str,
        ops: &[(bool, usize)],
    ) -> Vec<Vec<Result<Vec<f64>, String>>> {
        let (threads, window) = (THREADS.with(|t| t.get()), WINDOW.with(|t| t.get()));
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                THREADS.with(|t| t.set(threads));
                let ctl = ctl.clone();
                let scope = scope.to_string();
                let ops = ops.to_vec();
                std::thread::spawn(move || {
                    THREADS.with(|t| t.set(threads));
                    WINDOW.with(|t| t.set(window));
                    let want = Want {
                        controller: ctl,
                        bind: Ipv4Addr::new(127, 0, 1, 2 + u8::try_from(rank).unwrap()),
                        threads: THREADS.with(|t| t.get()),
                        window: WINDOW.with(|t| t.get()),
                        size,
                        timeout: Duration::from_millis(5),
                        stall: Duration::from_secs(5),
                        pin: false,
                    };
                    let mut w = bring_up(
                        &want,
                        rank,
                        n,
                        &scope,
                        "test",
                        None,
                        Duration::from_secs(10),
                    )
                    .unwrap();
                    ops.iter()
                        .enumerate()
                        .map(|(k, &(float, count))| {
                            if float {
                                let mut v: Vec<f32> = (0..count)
                                    .map(|i| {
                                        ((i * 31 + k * 7 + rank as usize * 13) % 1000) as f32
                                            * 0.013
                                            - 6.0
                                    })
                                    .collect();
                                w.all_reduce_f32(&mut v)?;
                                Ok(v.into_iter().map(f64::from).collect())
                            } else {
                                let mut v: Vec<i32> = (0..count)
                                    .map(|i| {
                                        i32::try_from(i).unwrap().wrapping_mul(7919).wrapping_add(
                                            rank.cast_signed() * 1_000_003
                                                + i32::try_from(k).unwrap(),
                                        )
                                    })
                                    .collect();
                                w.all_reduce_i32(&mut v)?;
                                Ok(v.into_iter().map(f64::from).collect())
                            }
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    }

    fn check(n: u32, ops: &[(bool, usize)], got: &[Vec<Result<Vec<f64>, String>>]) {
        for (k, &(float, count)) in ops.iter().enumerate() {
            for i in 0..count {
                let want: f64 = if float {
                    (0..n)
                        .map(|r| {
                            f64::from(
                                ((i * 31 + k * 7 + r as usize * 13) % 1000) as f32 * 0.013 - 6.0,
                            )
                        })
                        .sum()
                } else {
                    f64::from((0..n).fold(0i32, |a, r| {
                        a.wrapping_add(
                            i32::try_from(i).unwrap().wrapping_mul(7919).wrapping_add(
                                r.cast_signed() * 1_000_003 + i32::try_from(k).unwrap(),
                            ),
                        )
                    }))
                };
                for (r, res) in got.iter().enumerate() {
                    let v = res[k].as_ref().unwrap()[i];
                    if float {
                        // Block exponent here <= 3 (|x| < 8): bound n^2/2 * 2^3 / INT32_MAX.
                        assert!(
                            (v - want).abs() < 1e-5,
                            "op {k} worker {r} [{i}]: {v} vs {want}"
                        );
                    } else {
                        assert_eq!(v, want, "op {k} worker {r} [{i}]");
                    }
                }
            }
        }
    }

    #[test]
    fn workers_through_the_software_switch_int32_exact_float32_bounded() {
        let (_rt, sw) = switch(0.0, 0.0, 0.0);
        let ops = [
            (false, 1),
            (false, 100_003),
            (true, 77_777),
            (false, 64),
            (true, 5),
        ];
        let got = run(sw.listen.to_string(), 3, PacketSize::Mtu256, "a", &ops);
        check(3, &ops, &got);
    }

    /// Per-slot series (up to 8192 per session) only with `--slot-metrics`; the rest always,
    /// in valid OpenMetrics text.
    #[test]
    fn slot_series_only_when_asked() {
        let ops = [(false, 1025)];
        for on in [false, true] {
            let (_rt, sw) = switch_with(0.0, 0.0, 0.0, on);
            let got = run(sw.listen.to_string(), 2, PacketSize::Mtu256, "s", &ops);
            check(2, &ops, &got);
            let m = sw.switch.metrics_text();
            assert_eq!(m.contains("commd_switch_slot_packets_total{"), on, "{m}");
            assert!(
                m.contains("commd_switch_worker_packets_total{session="),
                "{m}"
            );
            assert!(m.contains("# TYPE commd_switch_sessions gauge"), "{m}");
            assert!(m.contains("commd_switch_data_plane_core{where="), "{m}");
            assert!(m.trim_end().ends_with("# EOF"), "{m}");
        }
    }

    #[test]
    fn drops_duplicates_and_reordering_do_not_change_results() {
        let (_rt, sw) = switch(0.01, 0.01, 0.01);
        let ops = [(false, 50_001), (true, 30_001), (false, 257)];
        let got = run(sw.listen.to_string(), 4, PacketSize::Mtu1024, "b", &ops);
        check(4, &ops, &got);
        let m = sw.switch.metrics_text();
        assert!(
            m.contains("commd_switch_injected_total{fault=\"drop\"}"),
            "{m}"
        );
        assert!(
            !m.contains("commd_switch_injected_total{fault=\"drop\"} 0\n"),
            "{m}"
        );
    }

    #[test]
    fn one_thread_wide_window_with_faults() {
        THREADS.with(|t| t.set(1));
        WINDOW.with(|t| t.set(128));
        let (_rt, sw) = switch(0.01, 0.01, 0.01);
        let ops = [(false, 300_007), (false, 300_007), (true, 5)];
        let got = run(sw.listen.to_string(), 3, PacketSize::Mtu1024, "c", &ops);
        check(3, &ops, &got);
    }
}

/// `cargo test --release -p commd --lib switch_goodput -- --ignored --nocapture`: goodput of
/// 4 in-process workers through an in-process switch, with the workers' counters.
#[cfg(test)]
mod perf {
    use std::net::Ipv4Addr;
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::{Duration, Instant};

    use super::session::{Want, bring_up};
    use commd_switch::packet::PacketSize;
    use commd_switch::server::{self, SwitchArgs};

    #[test]
    #[ignore]
    fn switch_goodput() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let a = SwitchArgs {
            listen: "127.0.0.1:0".parse().unwrap(),
            data: "127.0.0.1:0".parse().unwrap(),
            metrics: "off".into(),
            slots: 8192,
            drop: 0.0,
            dup: 0.0,
            reorder: 0.0,
            seed: 1,
            pin: "off".into(),
            slot_metrics: false,
        };
        let sw = server::start(&a, &rt).unwrap();
        let n = 4u32;
        let window: usize = commd_settings::system("W")
            .and_then(|v| v.into_string().ok())
            .and_then(|v| v.parse().ok())
            .unwrap_or(128);
        let bytes = 4usize << 20;
        let hs: Vec<_> = (0..n)
            .map(|rank| {
                let ctl = sw.listen.to_string();
                std::thread::spawn(move || {
                    let want = Want {
                        controller: ctl,
                        bind: Ipv4Addr::new(127, 0, 2, 2 + u8::try_from(rank).unwrap()),
                        threads: 1,
                        window,
                        size: PacketSize::Mtu1024,
                        timeout: Duration::from_millis(10),
                        stall: Duration::from_secs(10),
                        pin: false,
                    };
                    let mut w =
                        bring_up(&want, rank, n, "p", "perf", None, Duration::from_secs(10)).unwrap();
                    let mut v = vec![1i32; bytes / 4];
                    w.all_reduce_i32(&mut v).unwrap();
                    let t = Instant::now();
                    let iters = 10;
                    for _ in 0..iters {
                        w.all_reduce_i32(&mut v).unwrap();
                    }
                    let dt = t.elapsed().as_secs_f64() / f64::from(iters);
                    let s = &w.stats;
                    println!(
                        "worker {rank}: {:.2} ms/op, {:.2} Gbps goodput; sent {} retrans {} results {} dropped {} sendmmsg {} recvmmsg {}",
                        dt * 1e3,
                        (bytes * 8) as f64 / dt / 1e9,
                        s.packets_sent.load(Relaxed),
                        s.retransmits.load(Relaxed),
                        s.results.load(Relaxed),
                        s.dropped_results.load(Relaxed),
                        s.send_calls.load(Relaxed),
                        s.recv_calls.load(Relaxed)
                    );
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        println!(
            "{}",
            sw.switch
                .metrics_text()
                .lines()
                .filter(|l| l.contains("syscalls")
                    || l.contains("packets_sent")
                    || l.contains("duplicates_total"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}
