"""Helpers shared by the GPU benchmarks of this folder (``gpu_vs_nccl.py``,
``gemm_interference.py``): size parsing, the nccl-tests bandwidth conventions, iteration counts
from a time budget, run metadata, markdown rows and JSON lines.

It imports torch but neither commd nor CUDA state at import time, so every helper can be
checked on a machine without a GPU. The benchmarks import it as a sibling module (torchrun puts
the script's folder first on ``sys.path``).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def node_socket(rank: int, world: int) -> str | None:
    """Several daemons on one machine acting as nodes: ``COMMD_NODE_SOCKETS=a.sock,b.sock``
    puts ranks ``0 .. world/2 - 1`` on the first daemon, the rest on the second (contiguous
    blocks), by setting ``COMMD_SOCKET`` before commd connects. Returns the socket chosen."""
    socks = [s for s in os.environ.get("COMMD_NODE_SOCKETS", "").split(",") if s]
    if not socks:
        return None
    per = -(-world // len(socks))
    os.environ["COMMD_SOCKET"] = socks[min(rank // per, len(socks) - 1)]
    return os.environ["COMMD_SOCKET"]


def parse_size(text: str) -> int:
    """Bytes from ``4096``, ``8K``, ``8KiB``, ``2M``, ``1G`` (binary units, case-insensitive)."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 4096, 8K, 2MiB, 1G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes (see :func:`parse_size`); empty items are skipped."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def csv(text: str) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]``."""
    return [s.strip() for s in text.split(",") if s.strip()]


def human_bytes(n: int) -> str:
    """``8192`` -> ``"8 KiB"``; sizes that are not whole units keep one decimal."""
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            v = n / unit
            return f"{v:.0f} {name}" if v == int(v) else f"{v:.1f} {name}"
    return f"{n} B"


def fmt_gbps(v: float) -> str:
    """GB/s with two decimals below 10 (small messages), one above."""
    return f"{v:.2f}" if v < 10 else f"{v:.1f}"


# -- nccl-tests bandwidth conventions ------------------------------------------------------
# algbw = bytes / time, busbw = algbw * factor. "bytes" is the per-rank input tensor of the op
# (for all_gather that is nccl-tests' per-rank share of the output: its algbw is world x ours,
# its busbw the same). The factors make busbw comparable with the hardware's link bandwidth.

def busbw_factor(op: str, world: int) -> float:
    """nccl-tests' bus bandwidth factor of ``op`` on ``world`` ranks (algbw from the per-rank
    input; for reduce_scatter that is the full input, as nccl-tests counts it)."""
    n = world
    factors = {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": float(n - 1),
        "all_to_all": (n - 1) / n,
        "broadcast": 1.0,
        "sendrecv": 1.0,
    }
    if op not in factors:
        raise ValueError(f"no bus bandwidth convention for {op!r}")
    return factors[op]


BUSBW_DEF = {
    "all_reduce": "busbw = algbw * 2(n-1)/n, algbw = bytes / time",
    "reduce_scatter": ("busbw = algbw * (n-1)/n, algbw = bytes / time with bytes = the full "
                       "input (nccl-tests)"),
    "all_gather": ("busbw = algbw * (n-1), algbw = per-rank input / time (nccl-tests' algbw "
                   "uses the output, n x this; busbw is the same)"),
    "all_to_all": "busbw = algbw * (n-1)/n, algbw = bytes / time",
    "broadcast": "busbw = algbw = bytes / time",
    "sendrecv": "busbw = algbw = bytes / time",
}


def iters_for(est_s: float, budget_s: float, lo: int, hi: int) -> int:
    """Timed iterations for an op estimated at ``est_s`` seconds: about ``budget_s`` worth,
    clamped to ``[lo, hi]`` (``lo`` wins over ``hi``). Every rank must pass the same ``est_s``
    (agree on it first): the ranks of a collective must run the same number of calls."""
    if est_s <= 0 or est_s != est_s:  # zero, negative or NaN: no estimate, take the most
        n = hi
    else:
        n = int(budget_s / est_s)
    return max(lo, min(hi, n))


# -- floating-point tolerance of a reduction ------------------------------------------------

def unit_roundoff(dt: torch.dtype) -> float:
    """u = 2^-p for a dtype with p significand bits (round to nearest): the largest relative
    error of one rounding. 0 for integer dtypes (exact)."""
    if not dt.is_floating_point:
        return 0.0
    return float(torch.finfo(dt).eps) / 2


def sum_tolerance_factor(dt: torch.dtype, world: int) -> float:
    """k such that two correct sums of the same ``world`` inputs differ by at most
    ``k * sum_r |x_r|`` per element. Each is a sum of ``world`` terms in some order (ring,
    tree, one-shot; in the dtype or wider), rounded into the dtype: at most (world - 1)
    roundings on the way plus one at the end, each at most u times a partial sum, and every
    partial sum is at most sum |x_r|. So each is within world * u * sum |x_r| of the exact sum,
    and two of them within twice that (+1% for second-order terms)."""
    return 2.0 * world * unit_roundoff(dt) * 1.01


# -- run metadata and output ----------------------------------------------------------------

def commit() -> str:
    """The commit under test: ``COMMD_COMMIT`` (set by scripts/gpu-check.sh, which knows the
    checkout even where the copy on a GPU machine has no .git), else ``git rev-parse``."""
    c = os.environ.get("COMMD_COMMIT", "").strip()
    if c:
        return c
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def run_info(world: int) -> dict[str, Any]:
    """What a result row needs besides the numbers (docs/benchmarks.md: date, machine, commit,
    versions). Call after ``torch.cuda.set_device``."""
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a torch without NCCL still gets a row
        nccl = "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": torch.cuda.get_device_name(),
        "gpus": world,
        "torch": torch.__version__,
        "nccl": nccl,
        "commit": commit(),
        "nvls": os.environ.get("NCCL_NVLS_ENABLE", "(unset)"),
    }


def run_info_cpu(world: int) -> dict[str, Any]:
    """``run_info`` for a CPU benchmark: the processor instead of the GPU and NCCL."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ranks": world,
        "torch": torch.__version__,
        "commit": commit(),
    }


def md_header(cols: Sequence[str], left: int = 0) -> str:
    """A markdown table header; the first ``left`` columns are left-aligned, the rest right."""
    align = ["---" if i < left else "---:" for i in range(len(cols))]
    return md_row(cols) + "\n" + md_row(align)


def md_row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def append_jsonl(path: str, records: Iterable[dict[str, Any]]) -> None:
    """Appends one JSON object per line to ``path`` (nothing when ``path`` is empty)."""
    if not path:
        return
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=False) + "\n")


def start_vs_nccl(script: str) -> tuple[int, int, torch.device, dict[str, Any], dict[str, Any],
                                        Callable[..., None]]:
    """The torchrun setup of a commd-vs-NCCL GPU benchmark: one GPU per local rank, the default
    group on "commd" and a NCCL group beside it. Returns (rank, world, device, {"commd": group,
    "nccl": group}, run_info, say), ``say`` printing on rank 0 only."""
    import commd.torch  # noqa: F401  (registers the backend)
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise SystemExit(f"{script} needs at least 2 ranks (torchrun --nproc_per_node 2 or "
                         "more)")
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dist.init_process_group("commd")
    groups = {"commd": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}

    return rank, world, torch.device("cuda", local), groups, run_info(world), _say(rank)


def _say(rank: int) -> Callable[..., None]:
    """print on rank 0 only."""
    def say(*m: Any) -> None:
        if rank == 0:
            print(*m, flush=True)
    return say


def start_vs_gloo(script: str, threads: int = 0) -> tuple[int, int, torch.device,
                                                           dict[str, Any], dict[str, Any],
                                                           Callable[..., None]]:
    """The CPU counterpart of ``start_vs_nccl``: the default group on "commd", a gloo group
    beside it, and ``threads`` torch threads per rank (0: the cores shared out among the local
    ranks)."""
    import commd.torch  # noqa: F401  (registers the backend)
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world < 2:
        raise SystemExit(f"{script} needs at least 2 ranks")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // local_world))
    dist.init_process_group("commd")
    groups = {"commd": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    return rank, world, torch.device("cpu"), groups, run_info_cpu(world), _say(rank)

