use super::*;

fn args(extra: &[&str]) -> BenchArgs {
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: BenchArgs,
    }
    let argv = std::iter::once("bench").chain(extra.iter().copied());
    <Cli as clap::Parser>::try_parse_from(argv)
        .expect("bench args")
        .a
}

#[test]
fn sizes_iterations_and_geometry_follow_nccl_tests() {
    let a = args(&["-b", "8", "-e", "100", "-f", "3"]);
    assert_eq!(sizes(&a), [8, 24, 72]);
    assert_eq!(sizes(&args(&["-b", "1G", "-e", "1G"])), [1 << 30]);
    assert_eq!(iters_for(&a, 8), (1000, 100));
    assert_eq!(iters_for(&a, 1 << 30), (5, 2));
    assert_eq!(iters_for(&a, 64 << 20), (32, 6));
    assert_eq!(iters_for(&args(&["-n", "7", "-w", "3"]), 8), (7, 3));
    assert_eq!(geometry(OpKind::AllReduce, DType::F32, 4, 8), (8, 2));
    assert_eq!(geometry(OpKind::AllReduce, DType::F64, 4, 4), (8, 1));
    assert_eq!(
        geometry(OpKind::AllGather, DType::F32, 3, 8192),
        (8184, 682)
    );
    assert_eq!(geometry(OpKind::ReduceScatter, DType::F32, 4, 8), (16, 1));
    assert_eq!(geometry(OpKind::AllToAll, DType::BF16, 4, 64), (64, 8));
    assert_eq!(bus_factor(OpKind::AllReduce, 4), 1.5);
    assert_eq!(bus_factor(OpKind::AllGather, 4), 0.75);
    assert_eq!(bus_factor(OpKind::Broadcast, 4), 1.0);
}

#[test]
fn nccl_tests_step_bytes_average_threads_and_all() {
    assert_eq!(
        sizes(&args(&["-b", "1K", "-e", "4K", "-i", "1K"])),
        [1024, 2048, 3072, 4096]
    );
    let v = [3.0, 1.0, 2.0];
    assert_eq!(over_ranks(&v, 0), 3.0);
    assert_eq!(over_ranks(&v, 1), 2.0);
    assert_eq!(over_ranks(&v, 2), 1.0);
    assert_eq!(over_ranks(&v, 3), 3.0);
    assert_eq!(args(&[]).average, 3, "the slowest rank, as before");
    let e = select(&args(&["-t", "2"])).unwrap_err();
    assert!(e.contains("-t 2 -g 1") && e.contains("--ranks"), "{e}");
    assert!(select(&args(&["-g", "4"])).is_err());
    let all = args(&["-d", "all", "-o", "all"]);
    assert_eq!((all.dtype.as_str(), all.redop.as_str()), ("all", "all"));
    assert!(
        select(&all).is_err(),
        "`all` is expanded by run, never selected as such"
    );
}

#[test]
fn selections_that_cannot_run_are_refused_by_name() {
    let e = |v: &[&str]| select(&args(v)).unwrap_err();
    assert_eq!(e(&["--ranks", "0"]), "--ranks must be in 1..=256");
    assert_eq!(
        e(&["--op", "sendrecv", "--ranks", "1"]),
        "sendrecv needs at least 2 ranks"
    );
    assert_eq!(
        e(&["--ranks", "2", "-r", "5"]),
        "--root 5 is out of range for 2 ranks"
    );
    assert_eq!(
        e(&["--ranks", "2", "--nodes", "3"]),
        "--nodes must be in 1..=--ranks"
    );
    assert_eq!(e(&["-f", "1"]), "--step-factor must be at least 2");
    assert_eq!(
        e(&["-b", "2K", "-e", "1K"]),
        "need 0 < --min-bytes <= --max-bytes"
    );
    let s = select(&args(&["--op", "sendrecv", "--ranks", "2"])).expect("sendrecv");
    assert_eq!((s.kind, s.redop), (OpKind::Send, None));
    let s = select(&args(&["-d", "bf16", "-o", "max"])).expect("all_reduce");
    assert_eq!(
        (s.kind, s.dtype, s.redop),
        (OpKind::AllReduce, DType::BF16, Some(RedOp::Max))
    );
}

fn printer(a: &BenchArgs, mb: f64) -> Printer<'_> {
    let sel = select(a).expect("selection");
    Printer {
        a,
        sel,
        mb,
        root_col: if sel.kind.has_root() {
            i64::from(a.root)
        } else {
            -1
        },
    }
}

fn col(mean: f64, med: f64, algbw: f64, busbw: f64, wrong: u64, inplace: bool) -> Col {
    Col {
        mean,
        med,
        algbw,
        busbw,
        wrong,
        inplace,
        phases: Phases::default(),
    }
}

fn text(f: impl FnOnce(&mut Vec<u8>)) -> String {
    let mut out = Vec::new();
    f(&mut out);
    String::from_utf8(out).expect("utf-8")
}

// The expected lines are `commd bench` output (one node, no GPU), the values its numbers.

#[test]
fn the_table_keeps_the_nccl_tests_layout() {
    let a = args(&["--ranks", "2"]);
    let p = printer(&a, 16.02);
    let got = text(|o| {
        p.header(o);
        p.row(
            o,
            8,
            2,
            &[
                col(11.32, 10.39, 0.0, 0.0, 0, false),
                col(9.27, 9.22, 0.0, 0.0, 0, true),
            ],
        );
        let totals = Totals {
            ok: true,
            busbw_sum: 0.1544,
            rows_seen: 2,
            wrong_total: 0,
        };
        p.footer(o, &totals);
    });
    assert_eq!(
            got,
            "\
# commd bench: op all_reduce ranks 2 dtype f32 redop sum memory registered (client processes: 2, nodes: 1)
# memcpy reference: 16.02 GB/s (single thread, 64 MiB)
#                                               out-of-place                           in-place
#         size        count  type  redop  root      time       med   algbw   busbw #wrong      time       med   algbw   busbw #wrong
#          (B)      (elems)                         (us)      (us)  (GB/s)  (GB/s)             (us)      (us)  (GB/s)  (GB/s)       
             8            2   f32    sum    -1     11.32     10.39    0.00    0.00      0      9.27      9.22    0.00    0.00      0
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 0.0772
# verification: all results correct
"
        );
    let totals = Totals {
        ok: false,
        busbw_sum: 1.0,
        rows_seen: 4,
        wrong_total: 3,
    };
    assert_eq!(
        text(|o| p.footer(o, &totals)),
        "\
# Out of bounds values : 3 FAILED
# Avg bus bandwidth    : 0.2500
# verification: WRONG RESULTS
"
    );
    let a = args(&["--op", "broadcast", "-r", "1", "--ranks", "3", "-c", "0"]);
    let totals = Totals {
        ok: true,
        busbw_sum: 0.0804,
        rows_seen: 2,
        wrong_total: 0,
    };
    assert_eq!(
        text(|o| printer(&a, 1.0).footer(o, &totals)),
        "\
# Out of bounds values : N/A (not checked)
# Avg bus bandwidth    : 0.0402
# verification: skipped
"
    );
}

#[test]
fn csv_and_json_rows_keep_their_columns() {
    let a = args(&["--op", "allgather", "--ranks", "3", "--csv"]);
    let p = printer(&a, 1.0);
    let cols = [
        col(780.674, 1524.924, 0.0001, 0.0001, 0, false),
        col(15.669, 16.635, 0.0038, 0.0026, 0, true),
    ];
    let got = text(|o| {
        p.header(o);
        p.row(o, 60, 5, &cols);
        p.footer(o, &Totals::default());
    });
    assert_eq!(
        got,
        "\
op,ranks,nodes,dtype,redop,root,size,count,inplace,time_us,median_us,algbw_gbps,busbw_gbps,wrong
all_gather,3,1,f32,none,-1,60,5,false,780.674,1524.924,0.0001,0.0001,0
all_gather,3,1,f32,none,-1,60,5,true,15.669,16.635,0.0038,0.0026,0
"
    );
    let a = args(&[
        "--op",
        "reduce_scatter",
        "--ranks",
        "3",
        "--json",
        "--memory",
        "plain",
    ]);
    let p = printer(&a, 16.5857296052747);
    let cols = [col(
        2527.3424999999997,
        3171.498,
        0.000023740351772662397,
        0.00001582690118177493,
        0,
        false,
    )];
    let got = text(|o| {
        p.header(o);
        p.row(o, 60, 5, &cols);
        p.footer(o, &Totals::default());
    });
    assert_eq!(
        got,
        r#"{"algbw":0.000023740351772662397,"busbw":0.00001582690118177493,"count":5,"dtype":"f32","inplace":false,"median_us":3171.498,"memcpy_gbps":16.5857296052747,"memory":"plain","nodes":1,"op":"reduce_scatter","phases":{"copy_in_us":0.0,"copy_out_us":0.0,"first_us":0.0,"lookup_us":0.0,"op_us":0.0},"ranks":3,"redop":"sum","size":60,"time_us":2527.3424999999997,"wrong":0}
"#
    );
}

#[test]
fn sizes_read_as_nccl_tests_reads_them() {
    for (s, n) in [
        ("8", 8),
        ("64K", 64 << 10),
        ("64k", 64 << 10),
        ("256M", 256 << 20),
        ("1G", 1 << 30),
        ("1GiB", 1 << 30),
        ("1.5M", 3 << 19),
        (" 2 MB ", 2 << 20),
    ] {
        assert_eq!(parse_size(s), Ok(n), "{s}");
    }
    for bad in ["", "abc", "-1", "1X", "99999999999999999999G"] {
        let e = parse_size(bad).unwrap_err();
        assert!(e.contains("invalid size") && e.contains("1G"), "{bad}: {e}");
    }
}
