//! The `bench-worker` side of `commd bench`: one client process, one rank. It joins the
//! communicator, times each size's op out of place and in place, verifies one fresh op, and
//! writes a [`WorkerRow`] per size and placement to stdout for the parent to aggregate.

use std::path::Path;
use std::time::Duration;

use commd_client::OpArgs;
use commd_proto::check::{self, OpSpec};

use super::*;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() { 0.0 } else { v[v.len() / 2] }
}

/// The worker side: one client process, one rank.
/// `socket`: the one `--socket` named, else the client's own resolution (`COMMD_SOCKET`, then
/// this user's default).
pub fn worker(
    socket: Option<PathBuf>,
    uid_hex: &str,
    rank: u32,
    args_json: &str,
) -> Result<(), String> {
    let socket = socket.unwrap_or_else(commd_client::resolve_socket_path);
    let a: BenchArgs = serde_json::from_str(args_json).map_err(|e| e.to_string())?;
    let sel = select(&a)?;
    let uid: Vec<u8> = (0..uid_hex.len() / 2)
        .map(|i| u8::from_str_radix(&uid_hex[2 * i..2 * i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("bad --uid: {e}"))?;
    let mut w = Worker::open(&socket, &uid, rank, &a, sel)?;
    let stdout = std::io::stdout();
    for size in sizes(&a) {
        let (_, count) = geometry(sel.kind, sel.dtype, w.n, size);
        let (iters, warmup) = iters_for(&a, size);
        for inplace in [false, true] {
            let case = w.case(size, count, inplace);
            let row = w.measure(&case, iters, warmup);
            let mut o = stdout.lock();
            let _ = writeln!(o, "{}", serde_json::to_string(&row).unwrap_or_default());
            let _ = o.flush();
            if row.error.is_some() {
                return Ok(());
            }
        }
    }
    // Keep the session open until every rank is done.
    w.comm
        .barrier()
        .map_err(|e| e.to_string())?
        .wait()
        .map_err(|e| e.to_string())?;
    std::thread::sleep(Duration::from_millis(10));
    Ok(())
}

/// One rank of the benchmark: its communicator and buffers, sized for the largest size.
struct Worker<'a> {
    a: &'a BenchArgs,
    sel: Sel,
    rank: u32,
    n: u64,
    /// Element size in bytes.
    es: u64,
    /// The op at the largest size; each size's spec is made from it.
    spec0: OpSpec,
    /// `--memory plain`: the rank's data is in `usend`/`urecv`; `sbuf`/`rbuf` are the staging.
    plain: bool,
    // Dropped in this order: the rank's memory, the buffers, the communicator, the client.
    usend: Vec<u8>,
    urecv: Vec<u8>,
    rbuf: commd_client::Buffer,
    sbuf: commd_client::Buffer,
    comm: commd_client::Communicator,
    _client: Client,
}

/// One size and placement of the op as this rank runs it.
struct Case {
    size: u64,
    count: u64,
    inplace: bool,
    spec: OpSpec,
    /// sendrecv's ring: the rank sent to, and the rank received from.
    next: u32,
    prev: u32,
    /// Where the op reads in the send buffer and writes in the receive buffer.
    send_off: u64,
    recv_off: u64,
    /// What the op reads and writes of the rank's buffers.
    in_bytes: usize,
    out_bytes: usize,
}

impl<'a> Worker<'a> {
    /// Joins the communicator and allocates the buffers.
    fn open(
        socket: &Path,
        uid: &[u8],
        rank: u32,
        a: &'a BenchArgs,
        sel: Sel,
    ) -> Result<Self, String> {
        let client = Client::connect(Some(socket)).map_err(|e| e.to_string())?;
        let comm = client
            .communicator(uid, rank, a.ranks)
            .map_err(|e| e.to_string())?;
        let n = u64::from(a.ranks);
        let es = sel.dtype.size();
        let max_count = geometry(sel.kind, sel.dtype, n, a.max_bytes).1;
        let spec0 = OpSpec {
            kind: sel.kind,
            dtype: sel.dtype,
            redop: sel.redop,
            count: max_count,
            peer: a.root,
            nranks: a.ranks,
            rank,
            seed: 1,
        };
        let send_bytes = (max_count * n * es).max(spec0.send_elems() * es).max(es);
        let recv_bytes = send_bytes;
        let sbuf = client.alloc(send_bytes).map_err(|e| e.to_string())?;
        let rbuf = client.alloc(recv_bytes).map_err(|e| e.to_string())?;
        // `--memory plain`: the rank's data in ordinary memory; sbuf/rbuf become the staging.
        let plain = a.memory == "plain";
        let (usend, urecv) = if plain {
            (
                vec![0u8; commd_proto::num::usize_of(send_bytes)],
                vec![0u8; commd_proto::num::usize_of(recv_bytes)],
            )
        } else {
            (Vec::new(), Vec::new())
        };
        Ok(Self {
            a,
            sel,
            rank,
            n,
            es,
            spec0,
            plain,
            usend,
            urecv,
            rbuf,
            sbuf,
            comm,
            _client: client,
        })
    }

    fn case(&self, size: u64, count: u64, inplace: bool) -> Case {
        let (a, sel, rank, es) = (self.a, self.sel, self.rank, self.es);
        // sendrecv: rank r sends to r+1 and receives from r-1 (a ring), as nccl-tests does.
        let (next, prev) = ((rank + 1) % a.ranks, (rank + a.ranks - 1) % a.ranks);
        let spec = OpSpec {
            count,
            peer: if sel.kind == OpKind::Send {
                prev
            } else {
                a.root
            },
            seed: size ^ u64::from(inplace),
            ..self.spec0
        };
        // In-place layouts as NCCL defines them: all_gather reads, reduce_scatter writes,
        // this rank's slot of the receive buffer.
        let slot = u64::from(rank) * count * es;
        let (send_off, recv_off) = match sel.kind {
            OpKind::AllGather if inplace => (slot, 0),
            OpKind::ReduceScatter if inplace => (0, slot),
            _ => (0, 0),
        };
        // What this size's op reads and writes of the rank's buffers (in place: both in
        // the receive buffer, whose input part the op reads).
        let in_bytes = commd_proto::num::usize_of(
            spec.send_elems()
                .max(if sel.kind == OpKind::Send { count } else { 0 })
                * es,
        );
        let out_bytes = commd_proto::num::usize_of(
            sel.kind
                .recv_elems(count, self.n)
                .unwrap_or(count)
                .max(count)
                * es,
        );
        Case {
            size,
            count,
            inplace,
            spec,
            next,
            prev,
            send_off,
            recv_off,
            in_bytes,
            out_bytes,
        }
    }

    /// Fills the case's input (the receive buffer in place) with its deterministic data;
    /// then, with plain memory, copies both buffers into the rank's own memory. Warm-up, the
    /// timed ops and, unless `--no-check`, one verified op; the row to report.
    fn measure(&mut self, c: &Case, iters: u32, warmup: u32) -> WorkerRow {
        self.fill(c);
        if self.plain {
            self.copy_to_plain();
        }
        let mut times = Vec::with_capacity(iters as usize);
        let mut err = None;
        for _ in 0..warmup {
            if let Err(e) = self.op(c) {
                err = Some(e);
                break;
            }
        }
        let t_all = Instant::now();
        if err.is_none() {
            for _ in 0..iters {
                let t = Instant::now();
                if let Err(e) = self.op(c) {
                    err = Some(e);
                    break;
                }
                times.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        let mean = t_all.elapsed().as_secs_f64() * 1e6 / f64::from(iters.max(1));
        let mut wrong = 0;
        if err.is_none() && self.a.verify() {
            match self.verify(c) {
                Ok(w) => wrong = w,
                Err(e) => err = Some(e),
            }
        }
        WorkerRow {
            rank: self.rank,
            size: c.size,
            inplace: c.inplace,
            mean_us: mean,
            median_us: median(&mut times),
            wrong,
            error: err,
        }
    }

    fn fill(&mut self, c: &Case) {
        let sb = if c.inplace {
            &mut self.rbuf
        } else {
            &mut self.sbuf
        };
        let at = commd_proto::num::usize_of(c.send_off);
        check::fill(
            self.sel.dtype,
            self.sel.redop,
            c.spec.seed,
            self.rank,
            &mut sb.as_mut_slice()[at..],
            c.spec.send_elems().max(if self.sel.kind == OpKind::Send {
                c.count
            } else {
                0
            }),
        );
    }

    /// Copies the buffers into the rank's own memory (plain).
    fn copy_to_plain(&mut self) {
        let (us, ur) = (self.usend.len(), self.urecv.len());
        self.usend.copy_from_slice(&self.sbuf.as_slice()[..us]);
        self.urecv.copy_from_slice(&self.rbuf.as_slice()[..ur]);
    }

    /// One op on the buffers.
    fn run_one(&self, c: &Case) -> Result<(), String> {
        let sel = self.sel;
        let sb = if c.inplace { &self.rbuf } else { &self.sbuf };
        if sel.kind == OpKind::Send {
            let rcv = if c.inplace { &self.sbuf } else { &self.rbuf };
            let s = self
                .comm
                .send((sb, 0), c.count, sel.dtype, c.next)
                .map_err(|e| e.to_string())?;
            let r = self
                .comm
                .recv((rcv, 0), c.count, sel.dtype, c.prev)
                .map_err(|e| e.to_string())?;
            s.wait().map_err(|e| e.to_string())?;
            return r.wait().map_err(|e| e.to_string());
        }
        let args = OpArgs {
            kind: sel.kind,
            dtype: sel.dtype,
            redop: sel.redop,
            count: c.count,
            peer: self.a.root,
            send: Some((sb, c.send_off)),
            recv: Some((&self.rbuf, c.recv_off)),
        };
        self.comm
            .post(args)
            .map_err(|e| e.to_string())?
            .wait()
            .map_err(|e| e.to_string())
    }

    /// One op as the rank sees it. Plain memory: the staging copies in and out are part of
    /// every op, as a client library pays them for memory the daemon cannot reach.
    fn op(&mut self, c: &Case) -> Result<(), String> {
        if !self.plain {
            return self.run_one(c);
        }
        if c.inplace {
            self.rbuf.as_mut_slice()[..c.in_bytes.max(c.out_bytes)]
                .copy_from_slice(&self.urecv[..c.in_bytes.max(c.out_bytes)]);
        } else {
            self.sbuf.as_mut_slice()[..c.in_bytes].copy_from_slice(&self.usend[..c.in_bytes]);
        }
        self.run_one(c)?;
        // The op's output (its slot for an in-place reduce-scatter).
        let at = commd_proto::num::usize_of(c.recv_off);
        self.urecv[at..at + c.out_bytes]
            .copy_from_slice(&self.rbuf.as_slice()[at..at + c.out_bytes]);
        if self.sel.kind == OpKind::Send && c.inplace {
            // The in-place ring receives into the send buffer (see run_one).
            let n = commd_proto::num::usize_of(c.count * self.es);
            self.urecv[..n].copy_from_slice(&self.sbuf.as_slice()[..n]);
        }
        Ok(())
    }

    /// Verifies one fresh op: the elements it got wrong.
    fn verify(&mut self, c: &Case) -> Result<u64, String> {
        self.fill(c);
        if self.plain {
            // The fresh input goes in through the rank's own memory; the staging is
            // cleared so that only the copies of this op can put it there.
            self.copy_to_plain();
            self.sbuf.as_mut_slice().fill(0);
            self.rbuf.as_mut_slice().fill(0);
        }
        self.op(c)?;
        let kind = self.sel.kind;
        // The result as the rank sees it: its own memory when plain.
        let rcv: &[u8] = match (self.plain, kind == OpKind::Send && c.inplace) {
            (true, _) => &self.urecv,
            (false, true) => self.sbuf.as_slice(),
            (false, false) => self.rbuf.as_slice(),
        };
        Ok(if kind == OpKind::Send {
            OpSpec {
                kind: OpKind::Recv,
                ..c.spec
            }
            .count_wrong(rcv)
        } else if c.inplace && kind == OpKind::ReduceScatter {
            c.spec
                .count_wrong(&rcv[commd_proto::num::usize_of(c.recv_off)..])
        } else {
            c.spec.count_wrong(rcv)
        })
    }
}
