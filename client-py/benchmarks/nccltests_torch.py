"""nccl-tests' measurement, through torch.distributed: the same sizes, the same buffers, the same
timing loop and the same bandwidth conventions as NVIDIA's nccl-tests (2.19's src/common.cu,
``TimeTest``/``BenchTime``), for any torch backend. Issue 22 asks that nccl-tests through commd's
NCCL-compatible library be within 5% of commd's own torch backend at every size; this puts the
torch backend on nccl-tests' scale, so the two can be compared size by size
(tests/gpu/nccl_vs_torch.py does).

    torchrun --nproc_per_node 2 client-py/benchmarks/nccltests_torch.py --backend commd \\
        --ops all_reduce,all_gather -b 8 -e 1G -f 2 -n 50 -w 10 --json out.jsonl

What is the same as nccl-tests (float32, sum, root 0, ``-a 1``):
- sizes from ``-b`` to ``-e`` times ``-f``; "size" is nccl-tests' printed size (all_gather: the
  output; reduce_scatter and alltoall: the whole input; per-rank counts rounded down to a
  multiple of 4 elements as nccl-tests does). Sizes where that leaves no element are skipped;
- one send and one receive buffer of the largest size, allocated once; every size uses their
  start;
- warm-up: ``-w`` ops at every size from ``-b`` to ``-e`` doubling, before any timing;
- per size: one op and a synchronize, a barrier (on a gloo group beside the one measured, as
  nccl-tests uses MPI's), ``-n`` ops issued back to back, one synchronize; the wall time over
  ``-n``, averaged over the ranks; algbw and busbw by nccl-tests' formulas.

What torch decides: all_reduce, broadcast and reduce are in place (torch has no out-of-place
form), the others out of place; the JSON line says which (``placement``), and the comparison
takes nccl-tests' column of the same kind. sendrecv is nccl-tests' ring (send to rank+1, receive
from rank-1) as one ``batch_isend_irecv``.

Every size is checked once before it is timed (``-c 1``): exact small integers in float32 on
every rank, the op's result compared with the one computed here. A wrong result is printed,
counted in the ``#wrong`` column and the JSON line, and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bench_common as bc  # noqa: E402

OPS = ("all_reduce", "all_gather", "broadcast", "reduce", "reduce_scatter", "alltoall",
       "sendrecv")
IN_PLACE = ("all_reduce", "broadcast", "reduce")
ELT = 4  # float32


def counts(op: str, size: int, n: int) -> tuple[int, int, int]:
    """(send elements, receive elements, nccl-tests' per-rank "count") for nccl-tests' size."""
    count = size // ELT
    align = 16 // ELT
    if op in ("all_gather", "reduce_scatter", "alltoall"):
        base = (count // n) & ~(align - 1)
        if op == "all_gather":
            return base, base * n, base
        if op == "reduce_scatter":
            return base * n, base, base
        return base * n, base * n, base
    return count, count, count


def bus_factor(op: str, n: int) -> tuple[float, float]:
    """(algbw multiplier of count * 4 bytes, busbw factor): nccl-tests' getBw of each op."""
    return {
        "all_reduce": (1.0, 2 * (n - 1) / n),
        "all_gather": (float(n), (n - 1) / n),
        "reduce_scatter": (float(n), (n - 1) / n),
        "alltoall": (float(n), (n - 1) / n),
        "broadcast": (1.0, 1.0),
        "reduce": (1.0, 1.0),
        "sendrecv": (1.0, 1.0),
    }[op]


def pattern(rank: int, elems: int, dev: torch.device) -> torch.Tensor:
    """Small integers (-8..8) that depend on the rank and the position: sums of a few ranks
    stay exact in float32."""
    i = torch.arange(elems, device=dev, dtype=torch.int64)
    return ((i * 7 + rank * 3) % 17 - 8).to(torch.float32)


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.rank, self.n = dist.get_rank(), dist.get_world_size()
        self.cuda = a.device == "cuda"
        self.dev = torch.device("cuda", torch.cuda.current_device()) if self.cuda else \
            torch.device("cpu")
        self.host = dist.new_group(backend="gloo")  # barrier and time averaging, as MPI's
        self.a = a
        elems = a.max_bytes // ELT + 64
        self.send = torch.zeros(elems, dtype=torch.float32, device=self.dev)
        self.recv = torch.zeros(elems, dtype=torch.float32, device=self.dev)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def bufs(self, op: str, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, r, _ = counts(op, size, self.n)
        if op in IN_PLACE:
            return self.recv[:r], self.recv[:r]
        return self.send[:s], self.recv[:r]

    def issue(self, op: str, sb: torch.Tensor, rb: torch.Tensor) -> None:
        if op == "all_reduce":
            dist.all_reduce(rb)
        elif op == "broadcast":
            dist.broadcast(rb, 0)
        elif op == "reduce":
            dist.reduce(rb, 0)
        elif op == "all_gather":
            dist.all_gather_into_tensor(rb, sb)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(rb, sb)
        elif op == "alltoall":
            dist.all_to_all_single(rb, sb)
        elif op == "sendrecv":
            nxt, prv = (self.rank + 1) % self.n, (self.rank - 1) % self.n
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, sb, nxt),
                                              dist.P2POp(dist.irecv, rb, prv)]):
                w.wait()
        else:
            raise ValueError(op)

    def expected(self, op: str, size: int) -> torch.Tensor | None:
        """What this rank's receive buffer must hold after one op on the patterns (None: not
        defined on this rank)."""
        s, r, base = counts(op, size, self.n)
        n, me = self.n, self.rank
        if op == "all_reduce":
            return sum(pattern(k, r, self.dev) for k in range(n))
        if op == "broadcast":
            return pattern(0, r, self.dev)
        if op == "reduce":
            return sum(pattern(k, r, self.dev) for k in range(n)) if me == 0 else None
        if op == "all_gather":
            return torch.cat([pattern(k, base, self.dev) for k in range(n)])
        if op == "reduce_scatter":
            full = sum(pattern(k, s, self.dev) for k in range(n))
            return full[me * base:(me + 1) * base]
        if op == "alltoall":
            return torch.cat([pattern(k, s, self.dev)[me * base:(me + 1) * base]
                              for k in range(n)])
        if op == "sendrecv":
            return pattern((me - 1) % n, r, self.dev)
        raise ValueError(op)

    def check(self, op: str, size: int) -> int:
        """Runs the op once on the patterns; returns the number of wrong elements here."""
        sb, rb = self.bufs(op, size)
        if op in IN_PLACE:
            rb.copy_(pattern(self.rank, rb.numel(), self.dev))
        else:
            sb.copy_(pattern(self.rank, sb.numel(), self.dev))
            rb.fill_(float("nan"))
        self.sync()
        self.issue(op, sb, rb)
        self.sync()
        want = self.expected(op, size)
        if want is None:
            return 0
        wrong = int((rb != want).sum().item())
        if wrong:
            bad = int((rb != want).nonzero()[0].item())
            print(f"rank {self.rank}: {op} at {size} B: {wrong} wrong values, first at "
                  f"{bad}: {rb[bad].item()} instead of {want[bad].item()}", file=sys.stderr,
                  flush=True)
        return wrong

    def time(self, op: str, size: int) -> float:
        """nccl-tests' BenchTime: seconds per op, averaged over the ranks."""
        sb, rb = self.bufs(op, size)
        self.issue(op, sb, rb)
        self.sync()
        dist.barrier(group=self.host)
        t0 = time.perf_counter()
        for _ in range(self.a.iters):
            self.issue(op, sb, rb)
        self.sync()
        dt = torch.tensor([(time.perf_counter() - t0) / self.a.iters], dtype=torch.float64)
        dist.all_reduce(dt, group=self.host)
        return float(dt.item()) / self.n

    def sizes(self, factor: int) -> list[int]:
        out, s = [], self.a.min_bytes
        while s <= self.a.max_bytes:
            out.append(s)
            s *= factor
        return out

    def run(self, op: str, info: dict) -> tuple[list[dict], int]:
        for size in self.sizes(2):  # warm-up, as nccl-tests: every size, doubling
            sb, rb = self.bufs(op, size)
            if rb.numel() and sb.numel():
                for _ in range(self.a.warmup):
                    self.issue(op, sb, rb)
        self.sync()
        rows, bad = [], 0
        alg_mul, bus = bus_factor(op, self.n)
        for size in self.sizes(self.a.factor):
            s, r, base = counts(op, size, self.n)
            if base == 0:
                continue
            if self.a.watchdog > 0:  # a hang prints every thread's stack and ends the run
                faulthandler.dump_traceback_later(self.a.watchdog, exit=True)
            if self.a.progress:
                print(f"rank {self.rank}: {op} {size} B", file=sys.stderr, flush=True)
            wrong = self.check(op, size)
            w = torch.tensor([wrong], dtype=torch.int64)
            dist.all_reduce(w, group=self.host)
            wrong = int(w.item())
            bad += wrong
            sec = self.time(op, size)
            algbw = base * ELT * alg_mul / 1e9 / sec
            rows.append({"bench": "nccltests_torch", "backend": self.a.backend, "op": op,
                         "size": max(s, r) * ELT, "count": base, "type": "float",
                         "placement": "in" if op in IN_PLACE else "out",
                         "time_us": round(sec * 1e6, 2), "algbw": round(algbw, 2),
                         "busbw": round(algbw * bus, 2), "wrong": wrong,
                         "iters": self.a.iters, "warmup": self.a.warmup, **info})
        faulthandler.cancel_dump_traceback_later()
        return rows, bad


def size_arg(text: str) -> int:
    try:
        return bc.parse_size(text)
    except ValueError as e:  # argparse prints an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="commd", help="torch backend to measure (commd, nccl)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    p.add_argument("-b", "--min-bytes", default="8", type=size_arg)
    p.add_argument("-e", "--max-bytes", default="1G", type=size_arg)
    p.add_argument("-f", "--factor", default=2, type=int)
    p.add_argument("-n", "--iters", default=20, type=int)
    p.add_argument("-w", "--warmup", default=5, type=int)
    p.add_argument("--json", default="", help="append one JSON line per op and size here")
    p.add_argument("--watchdog", default=300, type=float,
                   help="seconds one size may take before every thread's stack is printed "
                        "and the run ends (0: never)")
    p.add_argument("--progress", action="store_true", help="each rank names each size on stderr")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: the same on CPU tensors (a check of this script without a GPU)")
    a = p.parse_args()
    ops = bc.csv(a.ops)
    for op in ops:
        if op not in OPS:
            p.error(f"unknown op {op!r}: expected some of {', '.join(OPS)}")
    if a.factor < 2 or a.iters < 1 or a.warmup < 0 or a.min_bytes < 1 or a.min_bytes > a.max_bytes:
        p.error("need -f >= 2, -n >= 1, -w >= 0 and 1 <= -b <= -e")

    rank = int(os.environ["RANK"])
    if a.backend == "commd":
        import commd.torch  # noqa: F401  (registers the backend)
    if a.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
        torch.cuda.set_device(local)
        dist.init_process_group(a.backend, device_id=torch.device("cuda", local))
    else:
        dist.init_process_group(a.backend)
    b = Bench(a)
    info = bc.run_info(b.n) if b.cuda else {"gpus": 0, "commit": bc.commit()}
    bad = 0
    for op in ops:
        rows, wrong = b.run(op, info)
        bad += wrong
        if rank == 0:
            where = "in place" if op in IN_PLACE else "out of place"
            print(f"# {op} on {a.backend}, {b.n} ranks, float32 ({where}), -n {a.iters} "
                  f"-w {a.warmup}")
            print(f"# {'size':>12} {'count':>12} {'time(us)':>10} {'algbw':>8} {'busbw':>8} "
                  f"{'#wrong':>6}")
            for r in rows:
                print(f"  {r['size']:>12} {r['count']:>12} {r['time_us']:>10.2f} "
                      f"{r['algbw']:>8.2f} {r['busbw']:>8.2f} {r['wrong']:>6}", flush=True)
            bc.append_jsonl(a.json, rows)
    dist.barrier(group=b.host)
    dist.destroy_process_group()
    if rank == 0:
        print(json.dumps({"wrong_total": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
