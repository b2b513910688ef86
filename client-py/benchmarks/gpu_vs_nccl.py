"""commd vs NCCL on GPU tensors, side by side in one run (torchrun, one process per GPU).

    torchrun --nproc_per_node 2 client-py/benchmarks/gpu_vs_nccl.py --op sendrecv
    torchrun --nproc_per_node 4 client-py/benchmarks/gpu_vs_nccl.py --op all_gather
    torchrun --nproc_per_node 4 client-py/benchmarks/gpu_vs_nccl.py \\
        --op all_reduce,reduce_scatter --dtypes float32,bfloat16 [--algo rsag] --json out.jsonl

The default process group is "commd"; NCCL is a ``dist.new_group(backend="nccl")`` in the same
processes. Eager torch.distributed calls; NVLink multicast stays off. For every op, dtype and
size (NCCL then commd, alternating per size so both see the same machine state):

1. Correctness, once: both backends run the op on copies of the same deterministic random
   input, and commd's result must equal NCCL's: bitwise for data movement, and for sums within
   ``bench_common.sum_tolerance_factor(dtype, n) * sum_r |x_r|`` per element (the rounding of
   two correct summation orders; a relative bound, so bfloat16 passes and a wrong result does
   not). A mismatch is printed loudly by the rank that saw it, marked in the table and the JSON
   line, and makes the exit status 1 (after all sizes ran).
2. Timing, per backend on the same tensors: one untimed call, ``--warmup`` calls timed to
   estimate the time per op, then ``iters`` calls (about ``--budget`` seconds, between
   ``--min-iters`` and ``--max-iters``; every rank runs the same number), timed by wall clock
   from before the first call to after ``torch.cuda.synchronize()``, max over ranks. "us" is
   that time per op; "cpu us" the time to issue one call (before the synchronize). all_reduce
   is timed in place, as torch offers it: the values grow n-fold per call and saturate to
   inf/NaN, which changes neither backend's speed.

``--algo auto|oneshot|rsag`` sets ``COMMD_ALLREDUCE_ALGO`` before the first commd op (the client
library reads it once, at the first op); the value in effect is recorded in the output either
way. Rank 0 prints a markdown table per (op, dtype) and, with ``--json``, appends one JSON line
per size.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Callable

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bench_common as bc  # noqa: E402

OPS = ("sendrecv", "all_gather", "all_reduce", "broadcast", "all_to_all", "reduce_scatter")
REDUCING = ("all_reduce", "reduce_scatter")
IN_PLACE = ("all_reduce", "broadcast")  # the input tensor is also the result

# Default sizes: 64 KiB .. 1 GiB (x4) for the data-movement ops (as before); 8 KiB .. 1 GiB
# for the reductions (x4 to 32 MiB, then x2 through the bandwidth-bound range).
SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]
REDUCE_SIZES = [8 << 10, 32 << 10, 128 << 10, 512 << 10, 2 << 20, 8 << 20, 32 << 20, 64 << 20,
                128 << 20, 256 << 20, 512 << 20, 1 << 30]

# What "bytes" means, per op (printed in the header and stored in every JSON line).
BYTES_DEF = {
    "sendrecv": "bytes = the message rank 0 sends to rank 1",
    "all_gather": "bytes = each rank's input (all_gather_into_tensor; the output is n x bytes)",
    "all_reduce": "bytes = each rank's tensor, reduced in place (SUM)",
    "broadcast": "bytes = the tensor broadcast from rank 0",
    "all_to_all": "bytes = each rank's input and output (all_to_all_single)",
    "reduce_scatter": ("bytes = each rank's full input (reduce_scatter_tensor, SUM); each rank's "
                       "output is bytes/n"),
}

ALGO_ENV = "COMMD_ALLREDUCE_ALGO"


def op_list(text: str) -> list[str]:
    """``--op``: one op or a comma-separated list."""
    ops = bc.csv(text)
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise argparse.ArgumentTypeError(f"unknown op {', '.join(bad) or text!r}; expected one "
                                         f"or more of {', '.join(OPS)}")
    return ops


def dtype_list(text: str) -> list[torch.dtype]:
    """``--dtypes``: torch dtype names, comma-separated."""
    out = []
    for name in bc.csv(text):
        dt = getattr(torch, name, None)
        if not isinstance(dt, torch.dtype):
            raise argparse.ArgumentTypeError(f"not a torch dtype: {name!r}")
        out.append(dt)
    if not out:
        raise argparse.ArgumentTypeError("no dtype given")
    return out


def size_list(text: str) -> list[int]:
    try:
        return bc.parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--op", type=op_list, default=["sendrecv"],
                   help=f"one or more (comma-separated) of {', '.join(OPS)}")
    p.add_argument("--sizes", type=size_list, default=None,
                   help="comma-separated sizes in bytes, K/M/G allowed (default: 8K..1G for "
                        "all_reduce and reduce_scatter, 64K..1G for the others)")
    p.add_argument("--dtypes", "--dtype", dest="dtypes", type=dtype_list,
                   default=[torch.float32], help="comma-separated torch dtypes (default float32)")
    p.add_argument("--algo", choices=["auto", "oneshot", "rsag"], default=None,
                   help=f"sets {ALGO_ENV} for commd's GPU all-reduce (default: leave the "
                        "environment as it is)")
    p.add_argument("--warmup", type=int, default=5, help="warm-up calls per size and backend, "
                   "also used to estimate the time per op (default 5)")
    p.add_argument("--budget", type=float, default=0.4,
                   help="seconds of timed calls per size and backend (default 0.4)")
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=5000)
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the correctness check against NCCL")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default="", help="append one JSON line per size here (rank 0)")
    a = p.parse_args(argv)
    if a.warmup < 1:
        p.error("--warmup must be at least 1 (it also estimates the time per op)")
    if a.min_iters < 1 or a.max_iters < a.min_iters:
        p.error("need 1 <= --min-iters <= --max-iters")
    return a


def sizes_for(op: str, given: list[int] | None) -> list[int]:
    if given:
        return given
    return REDUCE_SIZES if op in REDUCING else SIZES


def numel_for(nbytes: int, dt: torch.dtype, world: int) -> int:
    """Elements of the per-rank input: ``nbytes`` worth, at least one per rank and a multiple
    of ``world`` (reduce_scatter and all_to_all split it in ``world`` equal parts)."""
    es = torch.empty((), dtype=dt).element_size()
    n = max(nbytes // es, world)
    return n - n % world


def out_numel(op: str, n: int, world: int) -> int:
    return {"all_gather": n * world, "reduce_scatter": n // world}.get(op, n)


def issue(op: str, g: object, x: torch.Tensor, out: torch.Tensor, rank: int) -> None:
    """One eager call of ``op`` on group ``g`` (``x``: the per-rank input, ``out``: the output;
    all_reduce and broadcast work on ``x`` in place)."""
    if op == "sendrecv":
        if rank == 0:
            dist.send(x, 1, group=g)
        elif rank == 1:
            dist.recv(out, 0, group=g)
    elif op == "all_gather":
        dist.all_gather_into_tensor(out, x, group=g)
    elif op == "all_reduce":
        dist.all_reduce(x, group=g)
    elif op == "broadcast":
        dist.broadcast(x, 0, group=g)
    elif op == "all_to_all":
        dist.all_to_all_single(out, x, group=g)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(out, x, group=g)
    else:  # pragma: no cover - parse() only lets OPS through
        raise ValueError(op)


def result_of(op: str, x: torch.Tensor, out: torch.Tensor, rank: int) -> torch.Tensor | None:
    """The tensor holding this rank's result of ``op`` (None: the rank has none)."""
    if op == "sendrecv":
        return out if rank == 1 else None
    return x if op in IN_PLACE else out


def make_input(n: int, dt: torch.dtype, dev: torch.device, seed: int) -> torch.Tensor:
    """Deterministic random data (a different stream per rank and case, via ``seed``)."""
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    if dt.is_floating_point:
        return torch.randn(n, generator=g, device=dev, dtype=torch.float32).to(dt)
    if dt == torch.bool:
        return torch.randint(0, 2, (n,), generator=g, device=dev).bool()
    lo, hi = (0, 8) if dt == torch.uint8 else (-8, 8)
    return torch.randint(lo, hi, (n,), generator=g, device=dev, dtype=dt)


def compare(got: torch.Tensor, want: torch.Tensor,
            tol: torch.Tensor | None) -> tuple[int, float, int]:
    """(elements out of tolerance, max |got - want| / tol, first bad index or -1).

    ``tol`` None: bitwise equality (data movement, integers); the ratio is then 0 or inf.
    Otherwise per-element absolute tolerances (NaN anywhere counts as out of tolerance)."""
    if tol is None:
        bad = got != want
        nbad = int(bad.sum())
        return nbad, (float("inf") if nbad else 0.0), _first(bad) if nbad else -1
    wide = torch.float64 if got.dtype == torch.float64 else torch.float32
    err = (got.to(wide) - want.to(wide)).abs()
    bad = ~(err <= tol)  # catches NaN too
    nbad = int(bad.sum())
    first = _first(bad) if nbad else -1
    ratio = float((err / tol.clamp_min(torch.finfo(wide).tiny)).nan_to_num(float("inf")).max())
    return nbad, ratio, first


def _first(mask: torch.Tensor) -> int:
    """Index of the first True in a 1-d bool tensor (argmax returns the first maximum)."""
    return int(mask.to(torch.uint8).argmax())


class Bench:
    """One process's side of the benchmark: the groups, the arguments and the results."""

    def __init__(self, a: argparse.Namespace, rank: int, world: int, dev: torch.device) -> None:
        self.a = a
        self.rank = rank
        self.world = world
        self.dev = dev
        self.groups = {"commd": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}
        self.sync = self.groups["nccl"]  # bookkeeping (agreeing on numbers) goes over NCCL
        self.mismatches: list[str] = []

    def agree_max(self, values: list[float]) -> list[float]:
        """The element-wise maximum of ``values`` over all ranks (every rank calls it)."""
        t = torch.tensor(values, dtype=torch.float64, device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.sync)
        return t.tolist()

    # -- correctness ---------------------------------------------------------------------

    def check(self, op: str, dt: torch.dtype, nbytes: int, x0: torch.Tensor,
              bufs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> tuple[str, float]:
        """Runs ``op`` once per backend on its own copy of ``x0`` (``bufs[name]``: that copy
        and the output) and compares commd's result with NCCL's on every rank. Returns
        ("ok" | "MISMATCH", the worst error over tolerance of all ranks)."""
        for name in ("nccl", "commd"):
            x, out = bufs[name]
            issue(op, self.groups[name], x, out, self.rank)
            torch.cuda.synchronize()
        want = result_of(op, *bufs["nccl"], self.rank)
        got = result_of(op, *bufs["commd"], self.rank)
        tol = None
        if op in REDUCING and dt.is_floating_point:
            # sum_r |x_r| per output element, in float32 (float64 for float64), over NCCL.
            wide = torch.float64 if dt == torch.float64 else torch.float32
            mag = x0.abs().to(wide)
            dist.all_reduce(mag, group=self.sync)
            if op == "reduce_scatter":
                m = mag.numel() // self.world
                mag = mag[self.rank * m:(self.rank + 1) * m]
            tol = mag * bc.sum_tolerance_factor(dt, self.world)
        nbad, ratio, first = (0, 0.0, -1) if got is None else compare(got, want, tol)
        if nbad:
            t = "bitwise" if tol is None else f"{float(tol[first]):.3g}"
            msg = (f"!!! MISMATCH {op} {_dt(dt)} {bc.human_bytes(nbytes)} rank {self.rank}: "
                   f"{nbad} of {got.numel()} elements differ from NCCL's; first at [{first}]: "
                   f"commd {float(got[first]):.6g} NCCL {float(want[first]):.6g} "
                   f"(tolerance {t})")
            print(msg, file=sys.stderr, flush=True)
        worst_bad, worst_ratio = self.agree_max([float(nbad), ratio])
        if worst_bad > 0:
            self.mismatches.append(f"{op} {_dt(dt)} {bc.human_bytes(nbytes)}")
            return "MISMATCH", worst_ratio
        return "ok", worst_ratio

    # -- timing --------------------------------------------------------------------------

    def measure(self, fn: Callable[[], None]) -> dict[str, float]:
        """Times ``fn`` (one eager call of the op): see the module docs."""
        a = self.a
        fn()  # untimed: first-use costs (registration, connection set-up) stay out
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(a.warmup):
            fn()
        torch.cuda.synchronize()
        est = self.agree_max([(time.perf_counter() - t0) / a.warmup])[0]
        iters = bc.iters_for(est, a.budget, a.min_iters, a.max_iters)
        dist.barrier(group=self.sync)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        cpu_s = (time.perf_counter() - t0) / iters  # issuing alone (the GPU may lag)
        torch.cuda.synchronize()
        wall_s = (time.perf_counter() - t0) / iters
        wall_s, cpu_s = self.agree_max([wall_s, cpu_s])
        return {"us": wall_s * 1e6, "cpu_us": cpu_s * 1e6, "iters": iters}

    def one_size(self, op: str, dt: torch.dtype, nbytes: int, case: int) -> dict:
        """Check and time ``op`` at one size on both backends; the row's numbers."""
        n = numel_for(nbytes, dt, self.world)
        x0 = make_input(n, dt, self.dev, self.a.seed * 1_000_003 + case * 1009 + self.rank)
        m = out_numel(op, n, self.world)
        # NCCL and commd each get their own copy for the check; both are then timed on
        # commd's copy (the same tensors; commd has registered them during the check).
        names = ("nccl", "commd") if self.a.check else ("commd",)
        bufs = {k: (x0.clone(), torch.empty(m, device=self.dev, dtype=dt)) for k in names}
        check, ratio = ("-", 0.0)
        if self.a.check:
            check, ratio = self.check(op, dt, nbytes, x0, bufs)
            del bufs["nccl"]
        del x0
        x, out = bufs["commd"]
        row: dict = {"check": check, "check_err_over_tol": ratio}
        size = n * x.element_size()
        for name in ("nccl", "commd"):
            g = self.groups[name]
            r = self.measure(lambda g=g: issue(op, g, x, out, self.rank))
            algbw = size / (r["us"] * 1e-6) / 1e9
            row[name] = {**r, "algbw": algbw, "busbw": algbw * bc.busbw_factor(op, self.world)}
        return row


def _dt(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def algo_in_effect() -> str:
    v = os.environ.get(ALGO_ENV, "").strip()
    return v if v else "auto (unset)"


COLUMNS = ["bytes", "NCCL us", "NCCL algbw", "NCCL busbw", "NCCL cpu us", "commd us",
           "commd algbw", "commd busbw", "commd cpu us", "ratio", "iters NCCL/commd", "check"]


def table_row(nbytes: int, row: dict) -> str:
    nc, cm = row["nccl"], row["commd"]
    check = "**MISMATCH**" if row["check"] == "MISMATCH" else row["check"]
    return bc.md_row([
        bc.human_bytes(nbytes),
        f"{nc['us']:.1f}", bc.fmt_gbps(nc["algbw"]), bc.fmt_gbps(nc["busbw"]),
        f"{nc['cpu_us']:.1f}",
        f"{cm['us']:.1f}", bc.fmt_gbps(cm["algbw"]), bc.fmt_gbps(cm["busbw"]),
        f"{cm['cpu_us']:.1f}",
        f"{cm['busbw'] / nc['busbw']:.2f}", f"{nc['iters']}/{cm['iters']}", check])


def json_record(info: dict, op: str, dt: torch.dtype, nbytes: int, row: dict) -> dict:
    nc, cm = row["nccl"], row["commd"]
    return {
        "bench": "gpu_vs_nccl", "op": op, "gpus": info["gpus"], "bytes": nbytes,
        "dtype": _dt(dt),
        # the keys earlier versions wrote
        "nccl_us": nc["us"], "nccl_busbw": nc["busbw"], "nccl_cpu_us": nc["cpu_us"],
        "commd_us": cm["us"], "commd_busbw": cm["busbw"], "commd_cpu_us": cm["cpu_us"],
        # added with the all-reduce/reduce-scatter benchmarks
        "nccl_algbw": nc["algbw"], "nccl_iters": nc["iters"],
        "commd_algbw": cm["algbw"], "commd_iters": cm["iters"],
        "ratio": cm["busbw"] / nc["busbw"],
        "check": row["check"],
        # max |commd - NCCL| / tolerance (0 when bitwise equal; null when not bitwise equal)
        "check_err_over_tol": (row["check_err_over_tol"]
                               if math.isfinite(row["check_err_over_tol"]) else None),
        "algo": algo_in_effect(),
        "oneshot_max_bytes": os.environ.get("COMMD_ONESHOT_MAX_BYTES", ""),
        "gpu_wait": os.environ.get("COMMD_GPU_WAIT", "") or "auto",
        "bytes_def": BYTES_DEF[op], "busbw_def": bc.BUSBW_DEF[op],
        **{k: info[k] for k in ("date", "gpu", "torch", "nccl", "commit", "nvls")},
    }


def print_header(a: argparse.Namespace, info: dict) -> None:
    ops = a.op
    print(f"# commd vs NCCL: {', '.join(ops)}; {', '.join(_dt(d) for d in a.dtypes)}; "
          f"{info['gpus']} x {info['gpu']}; torch {info['torch']}; NCCL {info['nccl']}; "
          f"commit {info['commit']}; {info['date']}")
    src = " (--algo)" if a.algo else ""
    print(f"# {ALGO_ENV}={algo_in_effect()}{src}; COMMD_GPU_WAIT="
          f"{os.environ.get('COMMD_GPU_WAIT', '') or 'auto'}; NCCL_NVLS_ENABLE={info['nvls']}")
    for op in ops:
        print(f"# {op}: {BYTES_DEF[op]}; {bc.BUSBW_DEF[op]}")
    print("# us: wall time per op over `iters` eager calls, from before the first to after "
          "torch.cuda.synchronize(), max over ranks; cpu us: time to issue one call (it "
          "includes waiting for room when the GPU's queue is full, so it nears us when the GPU "
          "is the bottleneck). "
          f"Per size and backend: 1 untimed call, {a.warmup} warm-ups, then ~{a.budget} s of "
          f"calls ({a.min_iters}..{a.max_iters}).")
    print("# ratio = commd busbw / NCCL busbw = NCCL us / commd us (same bytes): > 1 means "
          "commd is faster.")
    if a.check:
        print("# check: commd's result vs NCCL's on the same input, once per size: bitwise for "
              "data movement and integers; sums within 2.02 * n * u(dtype) * sum_r |x_r| "
              "per element.", flush=True)


def main() -> None:
    a = parse()
    if a.algo:  # before the first commd op: the client library reads it once, then
        os.environ[ALGO_ENV] = a.algo
    import commd.torch  # noqa: F401  (registers the backend)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    bc.node_socket(rank, world)  # COMMD_NODE_SOCKETS: daemons as nodes (host staging)
    dist.init_process_group("commd")
    if "sendrecv" in a.op and world < 2:
        raise SystemExit("sendrecv needs at least 2 ranks")
    b = Bench(a, rank, world, dev)
    info = bc.run_info(world)
    if rank == 0:
        print_header(a, info)
    case = 0
    for op in a.op:
        for dt in a.dtypes:
            if rank == 0:
                print(f"\n### {op}, {_dt(dt)}, {world} GPUs\n\n"
                      f"{bc.md_header(COLUMNS)}", flush=True)
            for nbytes in sizes_for(op, a.sizes):
                case += 1
                row = b.one_size(op, dt, nbytes, case)
                if rank == 0:
                    print(table_row(nbytes, row), flush=True)
                    bc.append_jsonl(a.json, [json_record(info, op, dt, nbytes, row)])
    dist.barrier(group=b.sync)
    dist.destroy_process_group()
    if b.mismatches:
        if rank == 0:
            print(f"\n!!! commd's results differ from NCCL's: {'; '.join(b.mismatches)}",
                  flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
