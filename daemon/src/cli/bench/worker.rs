//! The `bench-worker` side of `commd bench`: one client process, one rank. It joins the
//! communicator, times each size's op out of place and in place, verifies one fresh op, and
//! writes a [`WorkerRow`] per size and placement to stdout for the parent to aggregate.

use std::path::Path;
use std::time::Duration;

use commd_client::hostmem::{self, OwnedBlock};
use commd_client::{Buffer, OpArgs};
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
    /// Where the rank's data is: `sbuf`/`rbuf` (registered), or `usend`/`urecv` (plain:
    /// `sbuf`/`rbuf` are the staging; allocator: the ops run on the blocks themselves).
    mem: Memory,
    // Dropped in this order: the rank's memory, the buffers, the communicator, the client.
    usend: RankMem,
    urecv: RankMem,
    rbuf: commd_client::Buffer,
    sbuf: commd_client::Buffer,
    comm: commd_client::Communicator,
    _client: Client,
}

/// `--memory`: where a rank's data lives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Memory {
    Registered,
    Plain,
    Allocator,
}

/// The rank's own memory (`--memory plain` or `allocator`; empty when registered).
enum RankMem {
    /// Ordinary process memory, staged around every op.
    Plain(Vec<u8>),
    /// A block of commd's CPU allocator: the first op moves it into shared memory and
    /// registers it, later ops run on it in place.
    Block(OwnedBlock),
}

impl RankMem {
    fn as_slice(&self) -> &[u8] {
        match self {
            Self::Plain(v) => v,
            Self::Block(b) => b.as_slice(),
        }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        match self {
            Self::Plain(v) => v,
            Self::Block(b) => b.as_mut_slice(),
        }
    }
}

/// Where one op's time went (us).
#[derive(Default, Clone, Copy)]
struct OpTimes {
    copy_in: f64,
    lookup: f64,
    op: f64,
    copy_out: f64,
}

fn us_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
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
        // `--memory plain|allocator`: the rank's data in its own memory; with plain, sbuf/rbuf
        // become the staging.
        let mem = match a.memory.as_str() {
            "plain" => Memory::Plain,
            "allocator" => Memory::Allocator,
            _ => Memory::Registered,
        };
        let own = |bytes: u64| -> Result<RankMem, String> {
            let n = commd_proto::num::usize_of(bytes);
            Ok(match mem {
                Memory::Registered => RankMem::Plain(Vec::new()),
                Memory::Plain => RankMem::Plain(vec![0u8; n]),
                Memory::Allocator => RankMem::Block(OwnedBlock::new(n).ok_or_else(|| {
                    format!("commd's CPU allocator could not give a block of {n} bytes")
                })?),
            })
        };
        let (usend, urecv) = (own(send_bytes)?, own(recv_bytes)?);
        Ok(Self {
            a,
            sel,
            rank,
            n,
            es,
            spec0,
            mem,
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
    /// then, with the rank's own memory, copies both buffers into it. Warm-up, the timed ops
    /// and, unless `--no-check`, one verified op; the row to report, with where the time went.
    fn measure(&mut self, c: &Case, iters: u32, warmup: u32) -> WorkerRow {
        self.fill(c);
        if self.mem != Memory::Registered {
            self.copy_to_own();
        }
        let mut times = Vec::with_capacity(iters as usize);
        let mut parts = Vec::with_capacity(iters as usize);
        let mut first = None;
        let mut err = None;
        for _ in 0..warmup {
            let t = Instant::now();
            if let Err(e) = self.op(c) {
                err = Some(e);
                break;
            }
            first.get_or_insert(us_since(t));
        }
        let t_all = Instant::now();
        if err.is_none() {
            for _ in 0..iters {
                let t = Instant::now();
                match self.op(c) {
                    Ok(p) => parts.push(p),
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                }
                let us = us_since(t);
                first.get_or_insert(us);
                times.push(us);
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
        let part = |f: fn(&OpTimes) -> f64| median(&mut parts.iter().map(f).collect::<Vec<_>>());
        let phases = Phases {
            first_us: first.unwrap_or(0.0),
            copy_in_us: part(|p| p.copy_in),
            lookup_us: part(|p| p.lookup),
            op_us: part(|p| p.op),
            copy_out_us: part(|p| p.copy_out),
        };
        WorkerRow {
            rank: self.rank,
            size: c.size,
            inplace: c.inplace,
            mean_us: mean,
            median_us: median(&mut times),
            wrong,
            error: err,
            phases,
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

    /// Copies the buffers into the rank's own memory (plain, allocator).
    fn copy_to_own(&mut self) {
        let us = self.usend.as_slice().len();
        let ur = self.urecv.as_slice().len();
        self.usend
            .as_mut_slice()
            .copy_from_slice(&self.sbuf.as_slice()[..us]);
        self.urecv
            .as_mut_slice()
            .copy_from_slice(&self.rbuf.as_slice()[..ur]);
    }

    /// One op on the buffers `sbuf` and `rbuf` (the registered ones, or the registrations of
    /// the rank's allocator blocks).
    fn run_one(&self, c: &Case, sbuf: &Buffer, rbuf: &Buffer) -> Result<(), String> {
        let sel = self.sel;
        let sb = if c.inplace { rbuf } else { sbuf };
        if sel.kind == OpKind::Send {
            let rcv = if c.inplace { sbuf } else { rbuf };
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
            recv: Some((rbuf, c.recv_off)),
        };
        self.comm
            .post(args)
            .map_err(|e| e.to_string())?
            .wait()
            .map_err(|e| e.to_string())
    }

    /// One op as the rank sees it, and where its time went. Plain memory: the staging copies
    /// in and out are part of every op, as a client library pays them for memory the daemon
    /// cannot reach. Allocator memory: the lookup of each block's registration (the first op
    /// moves the blocks into shared memory and registers them), then the op in place.
    fn op(&mut self, c: &Case) -> Result<OpTimes, String> {
        let mut t = OpTimes::default();
        match self.mem {
            Memory::Registered => {
                let t0 = Instant::now();
                self.run_one(c, &self.sbuf, &self.rbuf)?;
                t.op = us_since(t0);
            }
            Memory::Allocator => {
                let t0 = Instant::now();
                let (sb, rb) = self.adopted()?;
                t.lookup = us_since(t0);
                let t0 = Instant::now();
                self.run_one(c, &sb, &rb)?;
                t.op = us_since(t0);
            }
            Memory::Plain => {
                let t0 = Instant::now();
                self.copy_in(c);
                t.copy_in = us_since(t0);
                let t0 = Instant::now();
                self.run_one(c, &self.sbuf, &self.rbuf)?;
                t.op = us_since(t0);
                let t0 = Instant::now();
                self.copy_out(c);
                t.copy_out = us_since(t0);
            }
        }
        Ok(t)
    }

    /// The registrations of the rank's two allocator blocks (made by the first op).
    fn adopted(&self) -> Result<(std::sync::Arc<Buffer>, std::sync::Arc<Buffer>), String> {
        let reg = |m: &RankMem| -> Result<std::sync::Arc<Buffer>, String> {
            let RankMem::Block(b) = m else {
                return Err("allocator memory without a block (internal error)".into());
            };
            match hostmem::adopt(&self._client, b.addr(), b.as_slice().len()) {
                Some((buf, 0)) => Ok(buf),
                Some((_, off)) => Err(format!(
                    "a block's registration starts {off} bytes before it (internal error)"
                )),
                None => Err(
                    "commd's CPU allocator block could not be registered with the daemon \
                     (see the message above)"
                        .into(),
                ),
            }
        };
        Ok((reg(&self.usend)?, reg(&self.urecv)?))
    }

    /// Plain memory: the op's input into the staging.
    fn copy_in(&mut self, c: &Case) {
        if c.inplace {
            let n = c.in_bytes.max(c.out_bytes);
            self.rbuf.as_mut_slice()[..n].copy_from_slice(&self.urecv.as_slice()[..n]);
        } else {
            self.sbuf.as_mut_slice()[..c.in_bytes]
                .copy_from_slice(&self.usend.as_slice()[..c.in_bytes]);
        }
    }

    /// Plain memory: the op's output (its slot for an in-place reduce-scatter) out of the
    /// staging.
    fn copy_out(&mut self, c: &Case) {
        let at = commd_proto::num::usize_of(c.recv_off);
        self.urecv.as_mut_slice()[at..at + c.out_bytes]
            .copy_from_slice(&self.rbuf.as_slice()[at..at + c.out_bytes]);
        if self.sel.kind == OpKind::Send && c.inplace {
            // The in-place ring receives into the send buffer (see run_one).
            let n = commd_proto::num::usize_of(c.count * self.es);
            self.urecv.as_mut_slice()[..n].copy_from_slice(&self.sbuf.as_slice()[..n]);
        }
    }

    /// Verifies one fresh op: the elements it got wrong.
    fn verify(&mut self, c: &Case) -> Result<u64, String> {
        self.fill(c);
        if self.mem != Memory::Registered {
            // The fresh input goes in through the rank's own memory; the registered buffers
            // are cleared so that only this op can put the result there.
            self.copy_to_own();
            self.sbuf.as_mut_slice().fill(0);
            self.rbuf.as_mut_slice().fill(0);
        }
        self.op(c)?;
        let kind = self.sel.kind;
        // The result as the rank sees it: its own memory when plain or allocator (where the
        // in-place ring receives into the send block, as in run_one).
        let ring_in_place = kind == OpKind::Send && c.inplace;
        let rcv: &[u8] = match (self.mem, ring_in_place) {
            (Memory::Plain, _) => self.urecv.as_slice(),
            (Memory::Allocator, true) => self.usend.as_slice(),
            (Memory::Allocator, false) => self.urecv.as_slice(),
            (Memory::Registered, true) => self.sbuf.as_slice(),
            (Memory::Registered, false) => self.rbuf.as_slice(),
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
