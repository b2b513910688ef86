"""Issue 22's performance check, from the files of tests/gpu/nccl.sh's ``vstorch`` part: nccl-tests
through commd's NCCL-compatible library against commd's own torch backend measured the same way
(client-py/benchmarks/nccltests_torch.py), size by size, with real NCCL through both harnesses
in the same run.

    python3 tests/gpu/nccl_vs_torch.py OUTDIR [--md table.md] [--json rows.jsonl]

Reads ``OUTDIR/vs-<op>-<nccl|commd>-r<round>.log`` (nccl-tests' own output) and
``OUTDIR/vs-torch-<commd|nccl>-r<round>.jsonl``. Each route's time at a size is its best over
the rounds (the spread is printed). For every op and size:
- ``lib/torch``: the library's time over the torch backend's; the goal is at most 1.05 (the
  library as fast as the backend, within 5%);
- where the torch backend is at least as fast as NCCL through torch, the library must be at
  least as fast as NCCL through nccl-tests (``vs NCCL``). A miss of it still counts when the
  library's best is no slower than NCCL's worst round; the line says so (rounds of one build
  differ from one another on one machine).
all_reduce, broadcast and reduce are compared in place (torch has only that form), the rest out
of place. Exit status: 0 when both goals hold at every size all four routes measured, 1 when one
does not (each miss is listed), 2 when no size has all four or a run reported wrong values or
printed no rows (sizes a route lacks are listed as gaps).

``vs-<op>-base-r<round>.log`` (nccl.sh's ``VS_BASE_LIB``: nccl-tests through another build of
the library, e.g. the last commit's, in the same rounds) add a ``base`` column and the
library's time over it (``lib/base``): a change measured against what it replaces on the same
machine. The goals do not use it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
from collections import defaultdict

IN_PLACE = ("all_reduce", "broadcast", "reduce")
ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+\w+\s+\w+\s+-?\d+\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)"
                 r"\s+(\S+)\s+(\S+)\s+(\S+)\s+(\S+)\s*$")
LOG = re.compile(r"vs-(?P<op>[a-z_]+)-(?P<who>nccl|commd|base)-r(?P<round>\d+)\.log$")
ROUTE = {"commd": "lib", "nccl": "nccl", "base": "base"}
TORCH = re.compile(r"vs-torch-(?P<who>commd|nccl)-r(?P<round>\d+)\.jsonl$")


def parse_nccltests(path: str, op: str) -> tuple[dict[int, float], int]:
    """{size: us} of the column torch is compared with, and the wrong values reported."""
    times, wrong = {}, 0
    with open(path, errors="replace") as f:
        for line in f:
            m = ROW.match(line)
            if not m:
                continue
            size = int(m.group(1))
            if size == 0:  # a size too small for every rank to get an element
                continue
            oop_t, oop_w, ip_t, ip_w = m.group(3), m.group(6), m.group(7), m.group(10)
            t = ip_t if op in IN_PLACE else oop_t
            for w in (oop_w, ip_w):
                if w.isdigit():
                    wrong += int(w)
            try:
                times[size] = float(t)
            except ValueError:
                pass
    return times, wrong


def load(out: str) -> tuple[dict, list[str]]:
    """{(route, op): {size: [us per round]}} with routes lib, nccl, torch-commd, torch-nccl."""
    data: dict = defaultdict(lambda: defaultdict(list))
    problems = []
    for path in sorted(glob.glob(os.path.join(out, "vs-*.log"))):
        m = LOG.search(path)
        if not m or m["op"] == "torch":  # vs-torch-*.log: the torch harness's own output
            continue
        route = ROUTE[m["who"]]
        times, wrong = parse_nccltests(path, m["op"])
        if wrong:
            problems.append(f"{os.path.basename(path)}: {wrong} wrong values")
        if not times:
            problems.append(f"{os.path.basename(path)}: no result rows (the run failed?)")
        for size, t in times.items():
            data[(route, m["op"])][size].append(t)
    for path in sorted(glob.glob(os.path.join(out, "vs-torch-*.jsonl"))):
        m = TORCH.search(path)
        if not m:
            continue
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("wrong"):
                    problems.append(f"{os.path.basename(path)}: {r['op']} {r['size']} B: "
                                    f"{r['wrong']} wrong values")
                data[(f"torch-{m['who']}", r["op"])][int(r["size"])].append(float(r["time_us"]))
    return data, problems


def human(n: int) -> str:
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} B"


def compare(data: dict, tol: float = 0.05) -> tuple[list[dict], list[str], list[str]]:
    """One row per (op, size) that every route measured; the misses of either goal; and the
    (op, size) pairs a route lacks."""
    rows, misses, gaps = [], [], []
    ops = sorted({op for (_, op) in data})
    for op in ops:
        routes = {r: data.get((r, op), {}) for r in ("lib", "torch-commd", "nccl", "torch-nccl")}
        sizes = sorted(set().union(*[set(v) for v in routes.values()]))
        for size in sizes:
            have = {r: min(v[size]) for r, v in routes.items() if v.get(size)}
            if len(have) < 4:
                gaps.append(f"{op} {human(size)}: no {', '.join(sorted(set(routes) - set(have)))}")
                continue
            spread = {r: (max(v[size]) / min(v[size]) - 1) for r, v in routes.items()}
            ratio = have["lib"] / have["torch-commd"]
            within = ratio <= 1 + tol
            torch_at_nccl = have["torch-commd"] <= have["torch-nccl"]
            lib_at_nccl = have["lib"] <= have["nccl"]
            row = {"op": op, "size": size, "lib_us": have["lib"],
                   "torch_commd_us": have["torch-commd"], "nccl_us": have["nccl"],
                   "torch_nccl_us": have["torch-nccl"], "lib_over_torch": round(ratio, 3),
                   "within_5pct": within, "torch_at_least_nccl": torch_at_nccl,
                   "lib_at_least_nccl": lib_at_nccl,
                   "spread": {r: round(s, 3) for r, s in spread.items()}}
            base = data.get(("base", op), {}).get(size)
            if base:
                row["base_us"] = min(base)
                row["lib_over_base"] = round(have["lib"] / min(base), 3)
            rows.append(row)
            if not within:
                misses.append(f"{op} {human(size)}: library {have['lib']:.1f} us vs torch backend "
                              f"{have['torch-commd']:.1f} us ({ratio:.2f}x)")
            if torch_at_nccl and not lib_at_nccl:
                # Still a miss; said when NCCL's own rounds spread past the library's best.
                worst = max(routes["nccl"][size])
                row["lib_inside_nccl_spread"] = have["lib"] <= worst
                noise = (f"; inside NCCL's own spread over the rounds (its worst {worst:.1f} us)"
                         if row["lib_inside_nccl_spread"] else "")
                misses.append(f"{op} {human(size)}: torch backend at NCCL ({have['torch-commd']:.1f}"
                              f" vs {have['torch-nccl']:.1f} us) but the library is not "
                              f"({have['lib']:.1f} vs {have['nccl']:.1f} us){noise}")
    return rows, misses, gaps


def table(rows: list[dict]) -> str:
    base = any("base_us" in r for r in rows)
    out = ["| op | size | library | torch backend | lib/torch | NCCL (nccl-tests) | NCCL (torch) |"
           + (" base library | lib/base |" if base else ""),
           "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if base else "")]
    for r in rows:
        mark = "" if r["within_5pct"] else " **x**"
        if r["torch_at_least_nccl"] and not r["lib_at_least_nccl"]:
            mark += " **<NCCL**"
        line = (f"| {r['op']} | {human(r['size'])} | {r['lib_us']:.1f} | "
                f"{r['torch_commd_us']:.1f} | {r['lib_over_torch']:.2f}{mark} | "
                f"{r['nccl_us']:.1f} | {r['torch_nccl_us']:.1f} |")
        if base:
            line += (f" {r['base_us']:.1f} | {r['lib_over_base']:.2f} |" if "base_us" in r
                     else " | |")
        out.append(line)
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--md", default="")
    p.add_argument("--json", default="")
    p.add_argument("--tol", type=float, default=0.05)
    a = p.parse_args()
    data, problems = load(a.out)
    if not data:
        print(f"no vs-*.log or vs-torch-*.jsonl in {a.out}", file=sys.stderr)
        return 2
    rows, misses, gaps = compare(data, a.tol)
    md = table(rows)
    print(md)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md + "\n")
    if a.json:
        with open(a.json, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    within = sum(r["within_5pct"] for r in rows)
    print(f"\n{within} of {len(rows)} sizes with the library within {a.tol:.0%} of the torch "
          f"backend (or faster)")
    under = [r for r in rows if r["torch_at_least_nccl"] and not r["lib_at_least_nccl"]]
    inside = sum(r["lib_inside_nccl_spread"] for r in under)
    print(f"{len(under)} sizes where the torch backend is at NCCL and the library is not; "
          f"at {inside} of them the library's best is inside NCCL's own spread over the rounds")
    for m in misses:
        print("MISS:", m)
    for g in gaps:
        print("GAP:", g)
    for pr in problems:
        print("PROBLEM:", pr)
    if problems or not rows:
        return 2
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
