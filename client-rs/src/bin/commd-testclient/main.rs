//! commd-testclient: a scriptable client process for the end-to-end tests (`tests/`).
//!
//! `commd-testclient uid --socket S` prints a fresh unique id (hex).
//! `commd-testclient run --socket S --join HEX:RANK:NRANKS[:OP_TIMEOUT_MS[:JOIN_TIMEOUT_MS[:SWITCH]]] ... --steps JSON` joins
//! the communicators, runs the steps, and prints one JSON line per step. Exit status 0 when every
//! step ended as its `expect` said (default "ok"; "error": any failure; "any": either), 1
//! otherwise, 2 on bad usage. `--stop-on-error` ends the run after the first step that did not
//! end "ok".
//!
//! Steps: `{"op": "all_reduce", "dtype": "f32", "count": 1001, "redop": "sum", "root": 0,
//! "peer": 1, "inplace": false, "comm": 0, "seed": 7, "expect": "ok", "bad": null,
//! "check_stride": 1}`, `{"group": [step, ...]}` (post all, then wait all), `{"sleep_ms": 100}`,
//! `{"touch": "/path"}`, `{"fuzz": 100}` (random raw descriptors; each must fail as invalid),
//! `{"destroy": true, "comm": 0}` (destroys that communicator, as `ncclCommDestroy` does, and
//! removes it from the list: later `comm` indices shift down).
//! `{"broken": true, "comm": 0, "sleep_ms": 2000}` waits up to that long for the communicator's
//! "broken" hint (a rank's process lost: `Communicator::is_broken`; the step's message is then
//! the daemon's reason, `Communicator::failure`), `"broken": false` checks it is not set.
//! `{"fail": "why", "comm": 0}` fails the communicator for every rank with a mismatch saying
//! why (`Communicator::fail`, the daemon's `FailCommunicator`; `"fail_status": N` sends status
//! N instead).
//! `"repeat": N` on a step runs it N times.
//! `{"attack": "registrations" | "stage" | "sparse" | "punch", "count": N}` or
//! `{"attack": "ipc", "ipc": "HANDLE:UUID:BYTES"}`: what one user might do to the daemon (the
//! tenancy tests; [`attack`]).

#![deny(unsafe_code)] // allowed only in the modules that say why

mod attack;

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use commd_client::desc::{DType, OpKind, RedOp, SubmitDesc};
use commd_client::{Buffer, Client, CommOptions, Communicator, OpArgs, Pending};
use commd_proto::check::{self, OpSpec};
use commd_proto::num::usize_of;
use serde::Deserialize;
use serde_json::json;

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Uid {
        #[arg(long)]
        socket: PathBuf,
    },
    Run {
        #[arg(long)]
        socket: PathBuf,
        #[arg(long)]
        join: Vec<String>,
        #[arg(long)]
        steps: String,
        /// Stop after the first step that did not end "ok" (chaos runs: a survivor exits at
        /// its first error instead of running its remaining steps against a broken job).
        #[arg(long)]
        stop_on_error: bool,
    },
}

#[derive(Deserialize, Clone, Debug, Default)]
#[serde(deny_unknown_fields)]
struct Step {
    op: Option<String>,
    #[serde(default = "d_dtype")]
    dtype: String,
    #[serde(default)]
    count: u64,
    redop: Option<String>,
    #[serde(default)]
    root: u32,
    #[serde(default)]
    peer: u32,
    #[serde(default)]
    inplace: bool,
    #[serde(default)]
    comm: usize,
    #[serde(default = "d_seed")]
    seed: u64,
    expect: Option<String>,
    bad: Option<String>,
    #[serde(default = "d_stride")]
    check_stride: u64,
    group: Option<Vec<Step>>,
    sleep_ms: Option<u64>,
    touch: Option<String>,
    fuzz: Option<u32>,
    destroy: Option<bool>,
    broken: Option<bool>,
    fail: Option<String>,
    /// With `fail`: the status code sent (default: mismatch).
    fail_status: Option<u32>,
    /// Run this step this many times (load loops without a huge --steps argument).
    repeat: Option<usize>,
    /// A tenancy attack (see [`attack`]), `count` its size.
    attack: Option<String>,
    /// The `ipc` attack's handle: `HANDLE_HEX:DEVICE_UUID_HEX:BYTES`.
    ipc: Option<String>,
}

fn d_dtype() -> String {
    "f32".into()
}
fn d_seed() -> u64 {
    1
}
fn d_stride() -> u64 {
    1
}

struct Prepared<'c> {
    spec: OpSpec,
    send: Option<Buffer>,
    recv: Option<Buffer>,
    recv_off: u64,
    comm: &'c Communicator,
    args: StepArgs,
}

#[derive(Clone, Copy)]
struct StepArgs {
    send_off: u64,
    recv_off: u64,
    bad: Option<Bad>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Bad {
    OutOfBounds,
    Misaligned,
    UnknownMem,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err("odd hex length".into());
    }
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Uid { socket } => match Client::connect(Some(&socket)).and_then(|c| c.unique_id()) {
            Ok(u) => {
                println!("{}", hex(&u));
                0
            }
            Err(e) => {
                eprintln!("commd-testclient: {e}");
                1
            }
        },
        Cmd::Run {
            socket,
            join,
            steps,
            stop_on_error,
        } => match run(socket, join, &steps, stop_on_error) {
            Ok(all_ok) => i32::from(!all_ok),
            Err(e) => {
                println!("{}", json!({"fatal": e}));
                eprintln!("commd-testclient: {e}");
                2
            }
        },
    };
    std::process::exit(code);
}

fn run(
    socket: PathBuf,
    joins: Vec<String>,
    steps: &str,
    stop_on_error: bool,
) -> Result<bool, String> {
    let steps: Vec<Step> = serde_json::from_str(steps).map_err(|e| format!("bad --steps: {e}"))?;
    let steps: Vec<Step> = steps
        .into_iter()
        .flat_map(|s| {
            let n = s.repeat.unwrap_or(1);
            std::iter::repeat_n(s, n)
        })
        .collect();
    let client = Client::connect(Some(&socket)).map_err(|e| e.to_string())?;
    let mut comms = Vec::new();
    for j in &joins {
        let parts: Vec<&str> = j.split(':').collect();
        if parts.len() < 3 {
            return Err(format!("bad --join {j}"));
        }
        let uid = unhex(parts[0])?;
        let rank: u32 = parts[1].parse().map_err(|_| "bad rank")?;
        let nranks: u32 = parts[2].parse().map_err(|_| "bad nranks")?;
        let op_timeout = parts
            .get(3)
            .and_then(|t| t.parse().ok())
            .map(Duration::from_millis);
        let join_timeout = parts
            .get(4)
            .and_then(|t| t.parse().ok())
            .map(Duration::from_millis)
            .unwrap_or(Duration::from_secs(30));
        let c = client
            .communicator_with(
                &uid,
                rank,
                nranks,
                CommOptions {
                    op_timeout,
                    join_timeout: Some(join_timeout),
                    // Everything after the 5th field: "off" or a controller HOST:PORT.
                    switch: (parts.len() > 5).then(|| parts[5..].join(":")),
                    ..Default::default()
                },
            )
            .map_err(|e| format!("join {}: {e}", parts[1]))?;
        comms.push(c);
    }
    println!(
        "{}",
        json!({"joined": comms.len(), "session": client.session_id()})
    );
    let mut all_ok = true;
    let mut comms = comms;
    for (i, step) in steps.iter().enumerate() {
        let t0 = Instant::now();
        let results: Vec<(String, u64, String)> = if let Some(want) = step.broken {
            let Some(c) = comms.get(step.comm) else {
                return Err(format!("no communicator {}", step.comm));
            };
            let until = Instant::now() + Duration::from_millis(step.sleep_ms.unwrap_or(0));
            let mut got = c.is_broken();
            while want && !got && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
                got = c.is_broken();
            }
            if got && want {
                // The daemon's reason (GetCommFailure) is there once the hint is: it is the
                // step's message.
                match c.failure() {
                    Ok(Some((st, why))) => vec![("ok".into(), 0, format!("status {st}: {why}"))],
                    Ok(None) => vec![(
                        "error".into(),
                        0,
                        "is_broken() but the daemon has no reason (GetCommFailure)".into(),
                    )],
                    Err(e) => vec![("error".into(), 0, e.to_string())],
                }
            } else if got == want {
                vec![("ok".into(), 0, String::new())]
            } else {
                vec![(
                    "error".into(),
                    0,
                    format!("is_broken() is {got}, expected {want}"),
                )]
            }
        } else if let Some(why) = &step.fail {
            let Some(c) = comms.get(step.comm) else {
                return Err(format!("no communicator {}", step.comm));
            };
            let st = step
                .fail_status
                .unwrap_or(commd_client::desc::status::MISMATCH);
            let (k, m) = outcome(c.fail(st, why));
            vec![(k, 0, m)]
        } else if let Some(ms) = step.sleep_ms {
            std::thread::sleep(Duration::from_millis(ms));
            vec![("ok".into(), 0, String::new())]
        } else if let Some(p) = &step.touch {
            std::fs::write(p, b"").map_err(|e| e.to_string())?;
            vec![("ok".into(), 0, String::new())]
        } else if step.destroy == Some(true) {
            if step.comm < comms.len() {
                drop(comms.remove(step.comm));
                vec![("ok".into(), 0, String::new())]
            } else {
                vec![("error".into(), 0, format!("no communicator {}", step.comm))]
            }
        } else if let Some(n) = step.fuzz {
            fuzz(&client, &comms, n)
        } else if let Some(kind) = &step.attack {
            vec![attack::run(
                &client,
                &comms,
                kind,
                step.count,
                step.ipc.as_deref(),
            )]
        } else if let Some(g) = &step.group {
            run_group(&client, &comms, g)?
        } else {
            run_group(&client, &comms, std::slice::from_ref(step))?
        };
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let steps_in: Vec<&Step> = match &step.group {
            Some(g) => g.iter().collect(),
            None => vec![step],
        };
        for (j, (res, wrong, msg)) in results.iter().enumerate() {
            let want = steps_in
                .get(j)
                .and_then(|s| s.expect.clone())
                .unwrap_or_else(|| "ok".into());
            let ok =
                *wrong == 0 && (res == &want || (want == "error" && res != "ok") || want == "any");
            all_ok &= ok;
            println!(
                "{}",
                json!({"step": i, "sub": j, "op": steps_in.get(j).and_then(|s| s.op.clone()), "result": res, "expect": want, "wrong": wrong, "message": msg, "ms": ms, "pass": ok})
            );
        }
        let _ = std::io::stdout().flush();
        if stop_on_error && results.iter().any(|(res, _, _)| res != "ok") {
            break;
        }
    }
    Ok(all_ok)
}

fn outcome(r: commd_client::Result<()>) -> (String, String) {
    match r {
        Ok(()) => ("ok".into(), String::new()),
        Err(e) => (
            e.op_kind()
                .map(|k| k.name().to_string())
                .unwrap_or_else(|| "client_error".into()),
            e.to_string(),
        ),
    }
}

fn prepare<'c>(
    client: &Client,
    comms: &'c [Communicator],
    s: &Step,
) -> Result<Prepared<'c>, String> {
    let comm = comms
        .get(s.comm)
        .ok_or_else(|| format!("no communicator {}", s.comm))?;
    let op = s.op.clone().ok_or("step without op")?;
    let kind = OpKind::parse(&op).ok_or_else(|| format!("unknown op {op}"))?;
    let dtype = DType::parse(&s.dtype).ok_or_else(|| format!("unknown dtype {}", s.dtype))?;
    let redop = if kind.reduces() {
        Some(RedOp::parse(s.redop.as_deref().unwrap_or("sum")).ok_or("unknown redop")?)
    } else {
        None
    };
    let (rank, n) = (comm.rank(), comm.nranks());
    let peer = if kind.is_p2p() { s.peer } else { s.root };
    let spec = OpSpec {
        kind,
        dtype,
        redop,
        count: s.count,
        peer,
        nranks: n,
        rank,
        seed: s.seed,
    };
    let es = dtype.size();
    let bad = match s.bad.as_deref() {
        None => None,
        Some("oob") => Some(Bad::OutOfBounds),
        Some("misaligned") => Some(Bad::Misaligned),
        Some("unknown_mem") => Some(Bad::UnknownMem),
        Some(b) => return Err(format!("unknown bad kind {b}")),
    };
    // The sender of a send fills with its own rank's values; the receiver checks against the peer's.
    let send_elems = if kind == OpKind::Send {
        s.count
    } else {
        spec.send_elems()
    };
    let recv_elems = spec.recv_elems();
    let alloc = |elems: u64| -> Result<Option<Buffer>, String> {
        if elems == 0 {
            Ok(None)
        } else {
            client
                .alloc(elems * es)
                .map(Some)
                .map_err(|e| e.to_string())
        }
    };
    let mut args = StepArgs {
        send_off: 0,
        recv_off: 0,
        bad,
    };
    let (mut send, recv, recv_off);
    if s.inplace && send_elems > 0 && recv_elems > 0 {
        // NCCL's in-place layouts.
        let big = send_elems.max(recv_elems);
        let mut b = alloc(big)?.ok_or("empty")?;
        match kind {
            OpKind::AllGather => args.send_off = u64::from(rank) * s.count * es,
            OpKind::ReduceScatter => args.recv_off = u64::from(rank) * s.count * es,
            _ => {}
        }
        let so = usize_of(args.send_off);
        check::fill(
            dtype,
            redop,
            s.seed,
            rank,
            &mut b.as_mut_slice()[so..],
            send_elems,
        );
        recv_off = args.recv_off;
        send = None;
        recv = Some(b);
    } else {
        send = alloc(send_elems)?;
        if let Some(b) = send.as_mut() {
            check::fill(dtype, redop, s.seed, rank, b.as_mut_slice(), send_elems);
        }
        recv = alloc(recv_elems)?;
        recv_off = 0;
    }
    Ok(Prepared {
        spec,
        send,
        recv,
        recv_off,
        comm,
        args,
    })
}

fn post<'b>(p: &'b Prepared<'_>) -> commd_client::Result<Pending<'b>> {
    let s = &p.spec;
    let send_buf = p.send.as_ref().or(p
        .recv
        .as_ref()
        .filter(|_| p.send.is_none() && s.send_elems() > 0));
    let send = send_buf.map(|b| (b, p.args.send_off));
    let recv = p
        .recv
        .as_ref()
        .filter(|_| s.recv_elems() > 0)
        .map(|b| (b, p.args.recv_off));
    let send = if s.kind == OpKind::Send {
        p.send.as_ref().map(|b| (b, 0))
    } else {
        send
    };
    p.comm.post(OpArgs {
        kind: s.kind,
        dtype: s.dtype,
        redop: s.redop,
        count: s.count,
        peer: s.peer,
        send,
        recv,
    })
}

#[allow(unsafe_code)] // posts raw descriptors that name this process's own buffers
fn run_group(
    client: &Client,
    comms: &[Communicator],
    steps: &[Step],
) -> Result<Vec<(String, u64, String)>, String> {
    // A step whose buffers cannot even be set up (e.g. the daemon is gone) reports a client error.
    let mut early: Vec<Option<(String, String)>> = Vec::new();
    let mut prepared: Vec<Prepared> = Vec::new();
    for s in steps {
        match prepare(client, comms, s) {
            Ok(p) => {
                prepared.push(p);
                early.push(None);
            }
            Err(e) => early.push(Some(("client_error".into(), e))),
        }
    }
    if early.iter().any(Option::is_some) {
        return Ok(early
            .into_iter()
            .map(|e| {
                e.map(|(r, m)| (r, 0, m))
                    .unwrap_or(("skipped".into(), 0, String::new()))
            })
            .collect());
    }
    // Post everything, then wait in order.
    enum Posted<'b> {
        Typed(Pending<'b>),
        Raw(u64),
        Failed(String, String),
    }
    let mut posted = Vec::new();
    for p in &prepared {
        if p.args.bad.is_some() {
            let s = &p.spec;
            let send = p.send.as_ref().or(p.recv.as_ref());
            let recv = p.recv.as_ref().or(p.send.as_ref());
            let (sb, so) = send
                .map(|b| (b.mem_id(), p.args.send_off))
                .unwrap_or((0, 0));
            let (rb, ro) = recv.map(|b| (b.mem_id(), p.recv_off)).unwrap_or((0, 0));
            let mut d = SubmitDesc {
                opcode: s.kind.code(),
                dtype: s.dtype.code(),
                redop: s.redop.map(|r| r.code()).unwrap_or(0),
                peer: s.peer,
                count: s.count,
                send_mem: sb,
                recv_mem: rb,
                send_off: so,
                recv_off: ro,
                ..Default::default()
            };
            match p.args.bad {
                Some(Bad::OutOfBounds) => {
                    d.recv_off += 1 << 20;
                    d.send_off += 1 << 20;
                }
                Some(Bad::Misaligned) => {
                    d.recv_off += 1;
                    d.send_off += 1;
                }
                Some(Bad::UnknownMem) => {
                    d.recv_mem = 9999;
                    d.send_mem = 9999;
                }
                None => {}
            }
            // SAFETY: the descriptor names only this step's own buffers, which this process does
            // not touch until the op completes (waited below).
            match unsafe { p.comm.post_raw(d) } {
                Ok(ud) => posted.push(Posted::Raw(ud)),
                Err(e) => {
                    let (r, m) = outcome(Err(e));
                    posted.push(Posted::Failed(r, m));
                }
            }
        } else {
            match post(p) {
                Ok(pd) => posted.push(Posted::Typed(pd)),
                Err(e) => {
                    let (r, m) = outcome(Err(e));
                    posted.push(Posted::Failed(r, m));
                }
            }
        }
    }
    let mut out = Vec::new();
    for (p, po) in prepared.iter().zip(posted) {
        let (res, msg) = match po {
            Posted::Typed(pd) => outcome(pd.wait()),
            Posted::Raw(ud) => outcome(client.wait(ud)),
            Posted::Failed(r, m) => (r, m),
        };
        let mut wrong = 0;
        if res == "ok" && p.spec.recv_elems() > 0 && p.args.bad.is_none() {
            let rb = p.recv.as_ref().ok_or("no recv buffer")?;
            let bytes = &rb.as_slice()[usize_of(p.recv_off)..];
            wrong = p.spec.count_wrong_strided(bytes, steps_stride(steps, p));
        }
        out.push((res, wrong, msg));
    }
    Ok(out)
}

fn steps_stride(steps: &[Step], p: &Prepared<'_>) -> u64 {
    steps
        .iter()
        .find(|s| s.count == p.spec.count)
        .map(|s| s.check_stride.max(1))
        .unwrap_or(1)
}

/// Posts `n` random descriptors on a communicator-less path; each must come back invalid.
#[allow(unsafe_code)] // posts raw descriptors that name this process's own buffers
fn fuzz(client: &Client, comms: &[Communicator], n: u32) -> Vec<(String, u64, String)> {
    let Some(comm) = comms.first() else {
        return vec![(
            "client_error".into(),
            0,
            "fuzz needs a communicator to post through".into(),
        )];
    };
    let mut seed = 0x1234_5678_9abc_def0u64 ^ u64::from(std::process::id());
    let mut rnd = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut bad = 0u64;
    let mut last = String::new();
    for _ in 0..n {
        let w = [rnd(), rnd(), rnd(), rnd(), rnd(), rnd(), rnd()];
        // Truncation is the point: the fields are cut from random words.
        #[allow(clippy::cast_possible_truncation)]
        let mut d = SubmitDesc {
            opcode: (w[0] % 12) as u16,
            dtype: (w[0] >> 16) as u8 % 10,
            redop: (w[0] >> 24) as u8 % 10,
            flags: if w[1] % 4 == 0 { w[1] as u32 } else { 0 },
            peer: (w[1] >> 32) as u32 % 8,
            count: if w[2] % 2 == 0 { w[2] } else { w[2] % 100_000 },
            send_mem: (w[3] % 4) as u32,
            recv_mem: ((w[3] >> 8) % 4) as u32,
            send_off: if w[4] % 2 == 0 { w[4] } else { w[4] % 100_000 },
            recv_off: if w[5] % 2 == 0 { w[5] } else { w[5] % 100_000 },
            ticket: if w[6] % 8 == 0 { w[6] } else { 0 },
            ..Default::default()
        };
        // Collectives would wait for other ranks: keep only shapes that must fail validation
        // locally (p2p with out-of-range peers never match; everything else names no memory).
        if OpKind::from_code(d.opcode).is_some_and(|k| !k.is_p2p()) {
            d.send_mem += 1000;
            d.recv_mem += 1000;
            d.count = d.count.max(1);
            if d.opcode == OpKind::Barrier.code() {
                // A ticket above 2^32 is invalid whatever the flags say.
                d.ticket = u64::MAX;
            }
        } else if OpKind::from_code(d.opcode).is_some() {
            d.peer += 1000;
        }
        // SAFETY: the descriptor names no memory this process registered.
        let r = unsafe { comm.post_raw(d) }.and_then(|ud| client.wait(ud));
        match r {
            Err(e) if e.op_kind() == Some(commd_client::OpErrorKind::Invalid) => {
                last = e.to_string()
            }
            Err(e) => {
                bad += 1;
                last = format!("unexpected error: {e}");
            }
            Ok(()) => {
                bad += 1;
                last = format!("random descriptor {d:?} was accepted");
            }
        }
    }
    vec![(
        if bad == 0 {
            "ok".into()
        } else {
            "fuzz_accepted".into()
        },
        bad,
        last,
    )]
}
