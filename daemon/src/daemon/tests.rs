//! Communicator creation options and `SetCommPacing`, driven through [`Daemon`] directly
//! (single node: joins resolve synchronously when the last rank arrives).

use super::*;
use crate::config::Inputs;

const GB: u64 = 1_000_000_000;

fn daemon(flags: &[(&str, &str)]) -> Arc<Daemon> {
    let mut flags: Vec<(String, String)> = flags
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    flags.push(("cuda".into(), "0".into()));
    let cfg = Config::load(&Inputs {
        // Never the host's /etc/commd/commd.toml: an empty file of our own.
        config_file: Some(empty_toml()),
        flags,
        env: Default::default(),
    })
    .expect("test config");
    Daemon::new(cfg)
}

fn empty_toml() -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("commd-daemon-test-{}.toml", std::process::id()));
    std::fs::write(&p, "").expect("write empty config");
    p
}

fn session(d: &Daemon) -> Arc<Session> {
    d.hello(1000, std::process::id().cast_signed(), "test".into(), 0, 0)
        .expect("hello")
}

fn opts(pacing: Option<u64>) -> JoinOpts {
    JoinOpts {
        op_timeout: None,
        pacing,
    }
}

/// Joins `pacings.len()` ranks (rank i asks for `pacings[i]`, as on the wire: `None` = the
/// daemon's default); returns each rank's join outcome and, once formed, the communicator.
fn create(
    d: &Arc<Daemon>,
    pacings: &[Option<u64>],
) -> (Vec<Result<u32, String>>, Option<Arc<Comm>>) {
    let uid = d.unique_id(0).encode();
    let n = u32::try_from(pacings.len()).unwrap();
    let mut rxs = Vec::new();
    for (rank, &p) in pacings.iter().enumerate() {
        let s = session(d);
        let joined = d.resolve_pacing(p).and_then(|p| {
            d.join(
                s.clone(),
                &uid,
                u32::try_from(rank).unwrap(),
                n,
                opts(p),
                Duration::from_secs(5),
            )
        });
        rxs.push((s, joined));
    }
    let mut out = Vec::new();
    let mut comm = None;
    for (s, joined) in rxs {
        out.push(match joined {
            Err(e) => Err(e.to_string()),
            Ok(mut rx) => match rx.try_recv() {
                Ok(Ok((h, _, _, _))) => {
                    comm = s.tables().comms.get(&h).map(|(c, _)| c.clone());
                    Ok(h)
                }
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err("still joining".into()),
            },
        });
    }
    (out, comm)
}

#[test]
fn ranks_that_agree_share_one_pacer_with_their_cap() {
    let d = daemon(&[]);
    let (res, comm) = create(&d, &[Some(5 * GB), Some(5 * GB), Some(5 * GB)]);
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    let comm = comm.expect("formed");
    assert_eq!(comm.pacer.rate(), Some(5 * GB));
    // 0 on the wire is uncapped.
    let (res, comm) = create(&d, &[Some(0), Some(0)]);
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    assert_eq!(comm.expect("formed").pacer.rate(), None);
}

#[test]
fn absent_means_the_daemon_default_also_when_mixed_with_its_explicit_value() {
    let d = daemon(&[("gpu_pacing_gbps", "40")]);
    let (res, comm) = create(&d, &[None, Some(40 * GB)]);
    assert!(res.iter().all(Result::is_ok), "{res:?}");
    assert_eq!(comm.expect("formed").pacer.rate(), Some(40 * GB));
    let d = daemon(&[]);
    let (_, comm) = create(&d, &[None, None]);
    assert_eq!(
        comm.expect("formed").pacer.rate(),
        None,
        "uncapped by default"
    );
}

#[test]
fn mismatched_pacing_fails_the_later_rank_naming_both_values() {
    let d = daemon(&[("gpu_pacing_gbps", "40")]);
    let (res, comm) = create(&d, &[Some(5 * GB), None]);
    assert!(comm.is_none());
    assert_eq!(res[0], Err("still joining".into()));
    let e = res[1].clone().unwrap_err();
    assert!(
        e.contains("rank 1")
            && e.contains("40 GB/s")
            && e.contains("rank 0")
            && e.contains("5 GB/s"),
        "{e}"
    );
    let (res, _) = create(&d, &[Some(0), Some(GB)]);
    let e = res[1].clone().unwrap_err();
    assert!(e.contains("uncapped") && e.contains("1 GB/s"), "{e}");
}

#[test]
fn rates_below_the_minimum_are_refused_at_creation() {
    let d = daemon(&[]);
    let e = d.resolve_pacing(Some(5)).unwrap_err();
    assert!(matches!(e, DaemonError::InvalidArgument(_)), "{e:?}");
    assert!(e.to_string().contains("minimum"), "{e}");
    assert_eq!(d.resolve_pacing(Some(MIN)).unwrap(), Some(MIN));
}

const MIN: u64 = crate::pacing::MIN_RATE;

#[test]
fn set_comm_pacing_applies_to_every_rank_and_validates() {
    let d = daemon(&[]);
    let uid = d.unique_id(0).encode();
    let (s0, s1) = (session(&d), session(&d));
    let _rx0 = d.join(
        s0.clone(),
        &uid,
        0,
        2,
        opts(Some(GB)),
        Duration::from_secs(5),
    );
    let mut rx1 = d
        .join(
            s1.clone(),
            &uid,
            1,
            2,
            opts(Some(GB)),
            Duration::from_secs(5),
        )
        .expect("join");
    let (h1, _, _, _) = rx1.try_recv().expect("formed").expect("joined");
    let comm = s1.tables().comms.get(&h1).expect("comm").0.clone();
    // Rank 1 changes it; it is the communicator's one pacer (rank 0 sees the same).
    d.set_comm_pacing(&s1, h1, 7 * GB).expect("set");
    assert_eq!(comm.pacer.rate(), Some(7 * GB));
    let h0 = *s0.tables().comms.keys().next().expect("rank 0's handle");
    d.set_comm_pacing(&s0, h0, 0).expect("uncap");
    assert_eq!(comm.pacer.rate(), None);
    // Too small: refused, the cap unchanged.
    let e = d.set_comm_pacing(&s0, h0, 999).unwrap_err();
    assert!(matches!(e, DaemonError::InvalidArgument(_)), "{e:?}");
    assert!(e.to_string().contains("minimum"), "{e}");
    assert_eq!(comm.pacer.rate(), None);
    // Unknown handles (never created, destroyed): NotFound naming the handle.
    let e = d.set_comm_pacing(&s0, 4242, GB).unwrap_err();
    assert!(matches!(e, DaemonError::NotFound(_)), "{e:?}");
    assert!(e.to_string().contains("4242"), "{e}");
    d.destroy_comm(&s1, h1).expect("destroy");
    let e = d.set_comm_pacing(&s1, h1, GB).unwrap_err();
    assert!(matches!(e, DaemonError::NotFound(_)), "{e:?}");
}

#[test]
fn cuda_ranges_and_pieces_without_cuda_are_refused_and_the_fds_released() {
    let d = daemon(&[]);
    let s = session(&d);
    for token in [7u64, 8] {
        let fd = rustix::fs::memfd_create("piece", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd");
        d.stage_fd(&s, token, fd).expect("stage");
    }
    let e = d
        .map_cuda_pieces(&s, 1, &[(0, 2 << 20, 7), (2 << 20, 2 << 20, 8)])
        .expect_err("no CUDA");
    assert!(matches!(e, DaemonError::Unavailable(_)), "{e}");
    assert!(e.to_string().contains("no CUDA"), "{e}");
    assert!(s.tables().staged.is_empty(), "the staged fds were released");
    let e = d
        .register_cuda(&s, &[], &[0; 16], 1 << 30, true)
        .expect_err("no CUDA");
    assert!(matches!(e, DaemonError::Unavailable(_)), "{e}");
    assert!(s.tables().cuda_mems.is_empty());
}

#[test]
fn ranks_sharing_a_gpu_are_found_once_bound() {
    use super::shared_gpu_ranks;
    assert_eq!(shared_gpu_ranks(&[Some(0), None]), vec![false, false]);
    assert_eq!(shared_gpu_ranks(&[Some(0), Some(0)]), vec![true, true]);
    assert_eq!(
        shared_gpu_ranks(&[Some(0), Some(1), Some(0), Some(2)]),
        vec![true, false, true, false]
    );
    assert_eq!(shared_gpu_ranks(&[None, None]), vec![false, false]);
}

#[test]
fn ranks_with_a_gpu_of_their_own_are_known_only_once_every_rank_bound() {
    use super::own_gpu_ranks;
    assert_eq!(own_gpu_ranks(&[Some(0), None]), vec![false, false]);
    assert_eq!(own_gpu_ranks(&[Some(0), Some(1)]), vec![true, true]);
    assert_eq!(own_gpu_ranks(&[Some(0), Some(0)]), vec![false, false]);
    assert_eq!(
        own_gpu_ranks(&[Some(0), Some(1), Some(0), Some(2)]),
        vec![false, true, false, true]
    );
}
