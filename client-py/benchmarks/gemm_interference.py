"""How much a background all-reduce slows a GEMM: NCCL vs commd, and commd at pacing caps.

    torchrun --nproc_per_node 4 client-py/benchmarks/gemm_interference.py \\
        [--pacing 0,300,200,100,50,25] [--window 5] [--json out.jsonl]

Every rank runs a bfloat16 8192x8192x8192 matmul loop on its current stream (``--gemm-n``) and,
depending on the case, a background loop of all-reduces (SUM) of a 256 MiB bfloat16 tensor per
rank (``--ar-bytes``, ``--ar-dtype``; bfloat16 like the GEMM and like the gradients of a bf16
training job) on a separate CUDA stream. Cases, in this order:

- ``alone``: the GEMM loop by itself (a);
- ``NCCL``: with the all-reduces on ``dist.new_group(backend="nccl")`` (b);
- ``commd ...``: with the all-reduces on the default ("commd") group, for each cap in
  ``--pacing`` in GB/s (0: uncapped), set with ``commd.torch.set_pacing(gbps)`` (c). Without
  that function (an older commd) the capped cases are skipped with a message;
- ``alone (end)``: the GEMM loop by itself again; "vs alone" divides by the mean of both alone
  runs, and the header of the table gives the drift between them.

Per case: GEMM TFLOP/s (mean over ranks; the minimum is in the JSON) and its ratio to the GEMM
alone; the all-reduce's rate over the same window (ops/s; busbw = algbw * 2(n-1)/n, algbw =
bytes per rank / time per op, as nccl-tests), next to its rate without the GEMM (measured just
before, ``--alone-window`` seconds).

How the two loops are made to overlap on the GPU, and how that is checked:
- One Python thread drives both: it polls CUDA events (never blocking the CPU) and keeps at most
  ``--gemm-depth`` GEMMs queued on the current stream and ``--ar-depth`` all-reduces queued on
  the side stream, so neither stream runs dry while the other works. The all-reduces are issued
  with ``async_op=True`` inside ``torch.cuda.stream(side)`` and followed by ``work.wait()``,
  which makes the side stream (not the CPU) wait for the op, so an event recorded on the side
  stream after it marks the op's end for both backends. PyTorch's side streams, NCCL's and
  commd's communication streams are all non-blocking streams: nothing serializes them with
  the GEMM stream.
- Both loops run for ``--warm`` seconds before the window opens and ``--tail`` seconds after it
  closes; the window's start and end are marked by timing events on both streams at the same
  moment, so each rate is counted over the ops issued between the marks and timed on the GPU.
- Reported checks: ``overlap``, the share of each stream's window during which the other's was
  open (from the events; ~1.0 expected); ``drained``, the polls inside the window that found a
  stream with nothing queued (0 expected: the stream never idled); and ``GEMM+AR``, the sum of
  the two rates relative to each alone: above 1 only if they really ran concurrently (work
  taking turns on the GPU sums to at most 1).

Every rank must issue the same number of all-reduces: at the end of a case the ranks agree on
the largest count over a gloo group (CPU only, no GPU stream involved) and the others issue the
missing few (after the window, so they are not counted).

With ``--redop sum`` (default) the tensor's values grow n-fold per op and soon saturate to
inf/NaN; the reductions run at the same speed on those, but the bits on the wires stop changing.
``--redop avg`` or ``max`` keep the data random (after the first op every rank holds the same
tensor, which then stays put), to check whether that matters to the GEMM (power).

Rank 0 prints progress lines, then a markdown table; ``--json`` appends one JSON line per case.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import bench_common as bc  # noqa: E402

REDOPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


def cap_list(text: str) -> list[float]:
    """``--pacing``: comma-separated GB/s, 0 = uncapped."""
    try:
        caps = [float(s) for s in bc.csv(text)]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--pacing: {e}") from e
    if any(c < 0 for c in caps):
        raise argparse.ArgumentTypeError("--pacing: caps are GB/s >= 0 (0 = uncapped)")
    return caps


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pacing", type=cap_list, default=cap_list("0,300,200,100,50,25"),
                   help="commd cases: pacing caps in GB/s, 0 = uncapped (default "
                        "0,300,200,100,50,25; empty: no commd case)")
    p.add_argument("--no-nccl", dest="nccl", action="store_false", help="skip the NCCL case")
    p.add_argument("--gemm-n", type=int, default=8192, help="GEMM size n (n x n x n, bf16)")
    p.add_argument("--ar-bytes", type=bc.parse_size, default=256 << 20,
                   help="all-reduce tensor per rank (default 256M)")
    p.add_argument("--ar-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--redop", choices=sorted(REDOPS), default="sum")
    p.add_argument("--window", type=float, default=5.0, help="measured seconds per case")
    p.add_argument("--warm", type=float, default=1.0,
                   help="seconds both loops run before the window opens")
    p.add_argument("--tail", type=float, default=0.3,
                   help="seconds both loops keep running after the window closes")
    p.add_argument("--alone-window", type=float, default=2.0,
                   help="seconds to measure each background all-reduce without the GEMM "
                        "(0: skip)")
    p.add_argument("--gemm-warmup", type=float, default=2.0,
                   help="seconds of GEMMs before the first case (clocks and power settle)")
    p.add_argument("--gemm-depth", type=int, default=4, help="GEMMs kept queued")
    p.add_argument("--ar-depth", type=int, default=2, help="all-reduces kept queued")
    p.add_argument("--poll-us", type=float, default=100.0, help="polling interval")
    p.add_argument("--json", default="", help="append one JSON line per case here (rank 0)")
    a = p.parse_args(argv)
    if a.window <= 0 or a.warm < 0 or a.tail < 0 or a.alone_window < 0:
        p.error("--window must be > 0; --warm, --tail, --alone-window >= 0")
    if a.gemm_depth < 1 or a.ar_depth < 1:
        p.error("--gemm-depth and --ar-depth must be at least 1")
    return a


def commd_env() -> dict[str, str]:
    """The COMMD_* settings of this run (the socket left out): which commd variant ran."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith("COMMD_") and k not in ("COMMD_SOCKET", "COMMD_COMMIT")}


def gbps_arg(cap: float) -> int | float:
    """A cap as set_pacing gets it: an int when it is whole (300, not 300.0)."""
    return int(cap) if cap == int(cap) else cap


def case_label(backend: str | None, cap: float | None, end: bool = False) -> str:
    if backend is None:
        return "alone (end)" if end else "alone"
    if backend == "nccl":
        return "NCCL"
    return "commd uncapped" if not cap else f"commd {gbps_arg(cap)} GB/s"


@dataclass
class Case:
    label: str
    backend: str | None = None  # None: the GEMM alone; "nccl" or "commd"
    cap: float | None = None  # commd's pacing cap, GB/s (0 = uncapped)
    skipped: str = ""  # why the case did not run


def plan(a: argparse.Namespace) -> list[Case]:
    cases = [Case(case_label(None, None))]
    if a.nccl:
        cases.append(Case(case_label("nccl", None), "nccl"))
    cases += [Case(case_label("commd", c), "commd", c) for c in a.pacing]
    cases.append(Case(case_label(None, None, end=True)))
    return cases


def overlap(x0: float, x1: float, y0: float, y1: float) -> float:
    """How much the windows [x0, x1] and [y0, y1] coincide: their intersection over the longer
    one, i.e. the smaller of "share of x during which y was open" and the converse (1.0: the
    same window; 0.0: disjoint or degenerate)."""
    longer = max(x1 - x0, y1 - y0)
    if longer <= 0:
        return 0.0
    return max(0.0, min(x1, y1) - max(x0, y0)) / longer


def summarize(rows: list[list[float]]) -> dict[str, float]:
    """Rank 0's view of a case from every rank's ``Window.vector()``."""
    cols = list(zip(*rows))

    def mean(i: int) -> float:
        return sum(cols[i]) / len(cols[i])
    return {"gemm_tflops": mean(0), "gemm_tflops_min": min(cols[0]),
            "ar_ops_per_s": mean(1), "ar_ops_per_s_min": min(cols[1]),
            "overlap": min(cols[2]), "gemm_drained": max(cols[3]), "ar_drained": max(cols[4]),
            "gemm_ops": min(cols[5]), "ar_ops": min(cols[6])}


# -- the two loops -------------------------------------------------------------------------

class Loop:
    """A stream kept busy with one kind of op: at most ``depth`` ops issued and not finished;
    their completion is seen by polling CUDA events, so the CPU never blocks."""

    def __init__(self, stream: torch.cuda.Stream, depth: int, launch: Callable[[], None]) -> None:
        self.stream = stream
        self.depth = depth
        self.launch = launch  # issues one op on the current stream (= self.stream)
        self.pending: deque[torch.cuda.Event] = deque()
        self.spare: list[torch.cuda.Event] = []  # finished events, reused
        self.issued = 0
        self.drained = 0  # polls inside the window that found nothing queued

    def poll(self) -> None:
        while self.pending and self.pending[0].query():
            self.spare.append(self.pending.popleft())

    def top_up(self, counting: bool) -> None:
        self.poll()
        if counting and not self.pending:
            self.drained += 1
        while len(self.pending) < self.depth:
            self.issue()

    def issue(self) -> None:
        with torch.cuda.stream(self.stream):
            self.launch()
            ev = self.spare.pop() if self.spare else torch.cuda.Event()
            ev.record(self.stream)
        self.pending.append(ev)
        self.issued += 1

    def mark(self) -> tuple[torch.cuda.Event, int]:
        """A timing event after everything issued so far, and how many ops that is."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(self.stream)
        return ev, self.issued


def gemm_loop(n: int, dev: torch.device, depth: int) -> Loop:
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=dev, dtype=torch.bfloat16)
    return Loop(torch.cuda.current_stream(), depth, lambda: torch.mm(a, b, out=c))


def all_reduce_loop(x: torch.Tensor, group: Any, op: Any, side: torch.cuda.Stream,
                    depth: int) -> Loop:
    def launch() -> None:
        # Runs inside torch.cuda.stream(side): the op is ordered after the side stream, and
        # wait() makes the side stream (not the CPU) wait for it.
        dist.all_reduce(x, op=op, group=group, async_op=True).wait()
    return Loop(side, depth, launch)


def agree_count(loop: Loop, ctl: Any) -> None:
    """Every rank issues the same number of all-reduces: the largest count over the ranks (on
    the gloo group ``ctl``: CPU only). A rank can be at most ``depth`` ops ahead of another
    (it issues only when one of its own ops, which needs every rank's contribution, finished),
    so at most that many are added, after the window."""
    t = torch.tensor([loop.issued], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctl)
    for _ in range(int(t.item()) - loop.issued):
        loop.issue()


@dataclass
class Window:
    """One rank's measurement of one case."""
    gemm_tflops: float = 0.0
    ar_ops_per_s: float = 0.0
    overlap: float = 1.0
    gemm_drained: int = 0
    ar_drained: int = 0
    gemm_ops: int = 0
    ar_ops: int = 0

    def vector(self) -> list[float]:
        return [self.gemm_tflops, self.ar_ops_per_s, self.overlap, self.gemm_drained,
                self.ar_drained, self.gemm_ops, self.ar_ops]


def run_window(gemm: Loop | None, bg: Loop | None, warm: float, window: float, tail: float,
               poll_s: float, gemm_flops: float, ctl: Any) -> Window:
    """Runs the given loops for ``warm + window + tail`` seconds and measures the window."""
    loops = [lp for lp in (gemm, bg) if lp is not None]
    dist.barrier(group=ctl)  # start together (CPU only)
    torch.cuda.synchronize()
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()  # the device is idle: this fires first, before anything of this case
    for lp in loops:
        lp.drained = 0
    marks: dict[str, list[tuple[torch.cuda.Event, int]]] = {"start": [], "end": []}
    phase = "warm"
    t0 = time.monotonic()
    while True:
        for lp in loops:
            lp.top_up(counting=phase == "window")
        now = time.monotonic() - t0
        if phase == "warm" and now >= warm:
            marks["start"] = [lp.mark() for lp in loops]  # both streams, same moment
            phase = "window"
        elif phase == "window" and now >= warm + window:
            marks["end"] = [lp.mark() for lp in loops]
            phase = "tail"
        elif phase == "tail" and now >= warm + window + tail:
            break
        time.sleep(poll_s)
    if bg is not None:
        agree_count(bg, ctl)
    torch.cuda.synchronize()

    w = Window()
    spans = []
    for lp, (e0, n0), (e1, n1) in zip(loops, marks["start"], marks["end"]):
        ops, ms = n1 - n0, e0.elapsed_time(e1)
        spans.append((ref.elapsed_time(e0), ref.elapsed_time(e1)))
        rate = ops / (ms * 1e-3) if ops and ms > 0 else 0.0
        if lp is gemm:
            w.gemm_tflops, w.gemm_ops, w.gemm_drained = rate * gemm_flops / 1e12, ops, lp.drained
        else:
            w.ar_ops_per_s, w.ar_ops, w.ar_drained = rate, ops, lp.drained
    if len(spans) == 2:
        w.overlap = overlap(*spans[0], *spans[1])
    return w


def spin(loop: Loop, seconds: float, poll_s: float) -> None:
    """Keeps ``loop`` busy for ``seconds`` (warm-up, not measured)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        loop.top_up(counting=False)
        time.sleep(poll_s)
    torch.cuda.synchronize()


def set_cap(set_pacing: Callable[..., Any] | None, cap: float, ctl: Any) -> str:
    """Sets commd's pacing cap on every rank; "" when done, else why not (the same answer on
    every rank, agreed over ``ctl``)."""
    if set_pacing is None:
        if not cap:
            return ""  # uncapped is what a commd without pacing does
        return "commd.torch.set_pacing is not available in this commd build"
    err = ""
    try:
        set_pacing(gbps_arg(cap))
    except Exception as e:  # noqa: BLE001 - reported, and the case is skipped
        err = f"set_pacing({gbps_arg(cap)}) failed: {type(e).__name__}: {e}"
        print(f"rank {dist.get_rank()}: {err}", file=sys.stderr, flush=True)
    ok = torch.tensor([0 if err else 1], dtype=torch.int64)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctl)
    if int(ok.item()) == 1:
        return ""
    return err or f"set_pacing({gbps_arg(cap)}) failed on another rank"


# -- output ---------------------------------------------------------------------------------

COLUMNS = ["case", "GEMM TFLOP/s", "vs alone", "AR ops/s", "AR busbw GB/s",
           "AR busbw alone GB/s", "AR vs alone", "GEMM+AR", "overlap", "drained G/AR"]


def table(results: list[dict[str, Any]], alone_tflops: float) -> list[str]:
    lines = [bc.md_header(COLUMNS, left=1)]
    for r in results:
        if r.get("skipped"):
            lines.append(bc.md_row([r["case"], f"skipped: {r['skipped']}"] +
                                   ["-"] * (len(COLUMNS) - 2)))
            continue
        rel = r["gemm_tflops"] / alone_tflops if alone_tflops else 0.0
        if r["backend"] is None:
            lines.append(bc.md_row([r["case"], f"{r['gemm_tflops']:.0f}", f"{rel:.3f}"] +
                                   ["-"] * 5 + ["-", f"{r['gemm_drained']:.0f}/-"]))
            continue
        ar_rel = r["ar_busbw"] / r["ar_busbw_alone"] if r.get("ar_busbw_alone") else None
        lines.append(bc.md_row([
            r["case"], f"{r['gemm_tflops']:.0f}", f"{rel:.3f}", f"{r['ar_ops_per_s']:.1f}",
            bc.fmt_gbps(r["ar_busbw"]),
            bc.fmt_gbps(r["ar_busbw_alone"]) if r.get("ar_busbw_alone") else "-",
            f"{ar_rel:.3f}" if ar_rel is not None else "-",
            f"{rel + ar_rel:.2f}" if ar_rel is not None else "-",
            f"{r['overlap']:.3f}", f"{r['gemm_drained']:.0f}/{r['ar_drained']:.0f}"]))
    return lines


@dataclass
class Setup:
    """What every case needs: the loops, the groups and the derived constants."""
    a: argparse.Namespace
    world: int
    ctl: Any  # a gloo group: barriers and agreements, CPU only
    gemm: Loop
    backgrounds: dict[str, Loop]  # "nccl" / "commd" -> its all-reduce loop
    set_pacing: Callable[..., Any] | None
    ar_bytes: int
    gemm_flops: float
    poll_s: float

    @property
    def busbw_per_op(self) -> float:
        """GB of bus traffic per all-reduce (nccl-tests: 2(n-1)/n x bytes)."""
        return self.ar_bytes * bc.busbw_factor("all_reduce", self.world) / 1e9


def gather(w: Window, su: Setup) -> dict[str, float]:
    """Every rank's window, summarized (all ranks call it; all get the summary)."""
    mine = torch.tensor(w.vector(), dtype=torch.float64)
    got = [torch.zeros_like(mine) for _ in range(su.world)]
    dist.all_gather(got, mine, group=su.ctl)
    return summarize([t.tolist() for t in got])


def measure_case(case: Case, su: Setup) -> dict[str, Any]:
    """Runs one case on this rank (every rank calls it) and returns its record."""
    a = su.a
    rec: dict[str, Any] = {"case": case.label, "backend": case.backend, "pacing_gbps": case.cap}
    if case.backend == "commd":
        case.skipped = set_cap(su.set_pacing, case.cap or 0.0, su.ctl)
    if case.skipped:
        return {**rec, "skipped": case.skipped}
    bg = su.backgrounds[case.backend] if case.backend else None
    if bg is not None and a.alone_window > 0:  # the all-reduce without the GEMM, for reference
        w = run_window(None, bg, min(a.warm, 0.5), a.alone_window, 0.1, su.poll_s,
                       su.gemm_flops, su.ctl)
        alone = gather(w, su)
        rec["ar_ops_per_s_alone"] = alone["ar_ops_per_s"]
        rec["ar_busbw_alone"] = alone["ar_ops_per_s"] * su.busbw_per_op
    w = run_window(su.gemm, bg, a.warm, a.window, a.tail, su.poll_s, su.gemm_flops, su.ctl)
    rec.update(gather(w, su))
    if bg is not None:
        rec["ar_algbw"] = rec["ar_ops_per_s"] * su.ar_bytes / 1e9
        rec["ar_busbw"] = rec["ar_ops_per_s"] * su.busbw_per_op
    return rec


def progress(rec: dict[str, Any]) -> str:
    if rec.get("skipped"):
        return f"{rec['case']}: skipped ({rec['skipped']})"
    msg = f"{rec['case']}: GEMM {rec['gemm_tflops']:.0f} TFLOP/s"
    if rec["backend"] is not None:
        alone = (f" (alone {rec['ar_busbw_alone']:.1f})" if "ar_busbw_alone" in rec else "")
        msg += (f", all-reduce {rec['ar_ops_per_s']:.1f} ops/s = {rec['ar_busbw']:.1f} GB/s "
                f"busbw{alone}, overlap {rec['overlap']:.3f}, drained "
                f"{rec['gemm_drained']:.0f}/{rec['ar_drained']:.0f}")
    return msg


def report(results: list[dict[str, Any]], su: Setup, info: dict[str, Any]) -> None:
    """Rank 0: the relative numbers, the markdown table and the JSON lines."""
    a = su.a
    alone = [r["gemm_tflops"] for r in results if r["backend"] is None and not r.get("skipped")]
    alone_tflops = sum(alone) / len(alone) if alone else 0.0
    for r in results:
        if not r.get("skipped"):
            r["gemm_rel"] = r["gemm_tflops"] / alone_tflops if alone_tflops else 0.0
            if r.get("ar_busbw_alone"):
                r["ar_rel"] = r["ar_busbw"] / r["ar_busbw_alone"]
    drift = (alone[-1] / alone[0] - 1) * 100 if len(alone) == 2 and alone[0] else 0.0
    print(f"\n### GEMM under a background all-reduce, {su.world} GPUs\n\n"
          f"GEMM alone: {' then '.join(f'{v:.0f}' for v in alone)} TFLOP/s (drift "
          f"{drift:+.1f}%); 'vs alone' is relative to their mean. 'AR': the background "
          f"all-reduce, {bc.human_bytes(su.ar_bytes)} {a.ar_dtype} per rank.\n")
    print("\n".join(table(results, alone_tflops)), flush=True)
    common = {"bench": "gemm_interference", "commd_env": commd_env(),
              "gemm_n": a.gemm_n, "ar_bytes": su.ar_bytes,
              "ar_dtype": a.ar_dtype, "redop": a.redop, "window_s": a.window,
              "alone_window_s": a.alone_window, "gemm_depth": a.gemm_depth,
              "ar_depth": a.ar_depth, "gemm_alone_tflops": alone_tflops,
              "busbw_def": bc.BUSBW_DEF["all_reduce"],
              **{k: info[k] for k in ("date", "gpu", "gpus", "torch", "nccl", "commit", "nvls")}}
    bc.append_jsonl(a.json, [{**common, **r} for r in results])


def main() -> None:
    a = parse()
    import commd.torch  # set_pacing below

    rank, world, dev, groups, info, say = bc.start_vs_nccl("gemm_interference.py")

    # The GEMM operands and the background tensor (the same for both backends).
    ar_dt = getattr(torch, a.ar_dtype)
    es = torch.empty((), dtype=ar_dt).element_size()
    ar_bytes = a.ar_bytes // es * es
    x = torch.randn(ar_bytes // es, device=dev, dtype=torch.float32).to(ar_dt)
    side = torch.cuda.Stream()
    su = Setup(a=a, world=world, ctl=dist.new_group(backend="gloo"),
               gemm=gemm_loop(a.gemm_n, dev, a.gemm_depth),
               backgrounds={k: all_reduce_loop(x, g, REDOPS[a.redop], side, a.ar_depth)
                            for k, g in groups.items()},
               set_pacing=getattr(commd.torch, "set_pacing", None), ar_bytes=ar_bytes,
               gemm_flops=2.0 * a.gemm_n ** 3, poll_s=a.poll_us * 1e-6)

    say(f"# GEMM interference: {world} x {info['gpu']}; torch {info['torch']}; NCCL "
        f"{info['nccl']}; commit {info['commit']}; {info['date']}; "
        f"NCCL_NVLS_ENABLE={info['nvls']}; commd settings {commd_env() or 'default'}")
    say(f"# GEMM: bf16 {a.gemm_n}^3 matmul on the current stream, {a.gemm_depth} queued. "
        f"Background: all_reduce({a.redop.upper()}) of {bc.human_bytes(ar_bytes)} {a.ar_dtype} "
        f"per rank on a side stream, async_op=True, {a.ar_depth} queued. Per case: "
        f"{a.warm} s warm, {a.window} s window, {a.tail} s tail; background alone: "
        f"{a.alone_window} s. busbw = algbw * 2(n-1)/n.")
    if su.set_pacing is None and any(c > 0 for c in a.pacing):
        say("# commd.torch.set_pacing is not available in this commd build: the capped commd "
            "cases are skipped")

    # First calls on both groups (NCCL's communicator, commd's registrations), GEMM clocks.
    for g in groups.values():
        for _ in range(3):
            dist.all_reduce(x, op=REDOPS[a.redop], group=g)
        torch.cuda.synchronize()
    spin(su.gemm, a.gemm_warmup, su.poll_s)

    t_start = time.monotonic()
    results = []
    cases = plan(a)
    for case in cases:
        t_case = time.monotonic()
        results.append(measure_case(case, su))
        say(f"[{time.monotonic() - t_start:6.1f} s] {progress(results[-1])} "
            f"({time.monotonic() - t_case:.1f} s)")
    if su.set_pacing is not None and any(c.cap for c in cases if not c.skipped):
        set_cap(su.set_pacing, 0.0, su.ctl)  # leave the communicator uncapped
    if rank == 0:
        report(results, su, info)
    dist.barrier(group=su.ctl)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
