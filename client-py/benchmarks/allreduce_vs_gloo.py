"""All-reduce through torch.distributed: the "commd" backend vs "gloo", in one invocation.

Starts N ranks (default 4) on this host; every rank runs the same f32 sizes (4 KiB .. 64 MiB)
on a commd group and on a gloo group, alternating per size so both see the same machine state.
Rank 0 prints one table: median latency, algorithm and bus bandwidth (nccl-tests convention:
busbw = algbw * 2 (n-1) / n) for both, and the ratio. Results are checked (sum of known inputs).

    python client-py/benchmarks/allreduce_vs_gloo.py [--nranks 4] [--socket PATH]
        [--min-bytes 4096] [--max-bytes 67108864] [--iters N] [--staged] [--registered]
        [--breakdown] [--json FILE]

Needs a running daemon (``commd serve``) or ``--start-daemon PATH_TO_COMMD``. With
``--nodes K`` (and ``--start-daemon``) it starts K daemons on this host as separate nodes (own
sockets, peer ports on loopback) and spreads the ranks over them in contiguous blocks, so commd's
inter-node path (TCP between daemons) runs against gloo with the same processes on loopback.
The "commd" column is ordinary torch tensors (``torch.empty``): with commd's CPU allocator
(installed by the backend unless ``COMMD_CPU_ALLOC=0``; it needs the backend's C++ shell) those
of 1 MiB and up run in place; the first line of the report says whether it was in place.
``--staged`` also measures commd on tensors over private anonymous memory (``mmap``), which no
commd allocator serves, so every op copies them through shared memory (what ordinary tensors
cost without the allocator). ``--registered`` also measures tensors allocated in commd shared
memory (``commd.torch.empty``).

``--breakdown`` adds, per size and commd column: the first op on a fresh tensor (for ordinary
tensors it moves the allocation into shared memory and registers it), minor page faults per op
in the rank and in the daemon(s) (all ranks' ops together; daemons started by this script
only), and for staged tensors the time of one staging copy (the op copies in and out).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def sizes(lo: int, hi: int) -> list[int]:
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 4 if s < (1 << 20) else 2
    return out


def iters_for(nbytes: int, base: int) -> int:
    if base:
        return base
    if nbytes <= 64 << 10:
        return 200
    if nbytes <= 1 << 20:
        return 50
    if nbytes <= 16 << 20:
        return 12
    return 6


def minor_faults(pid: int | None = None) -> int:
    """Minor page faults so far of this process (``pid`` None) or of process ``pid``."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # /proc/PID/stat: field 10 is minflt; the command name (field 2) may hold spaces.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


def daemon_pids() -> list[int]:
    return [int(p) for p in os.environ.get("COMMD_BENCH_DAEMON_PIDS", "").split(",") if p]


def tensor_for(memory: str, count: int, keep: list):
    """A fresh f32 tensor of ``count`` elements in the given memory."""
    import torch

    import commd.torch as ct
    if memory == "registered":
        return ct.empty(count)
    if memory == "staged":
        # Private anonymous pages: no commd allocator serves them, so every op is staged.
        m = mmap.mmap(-1, count * 4)
        keep.append(m)
        return torch.frombuffer(m, dtype=torch.float32)
    return torch.empty(count)


def staging_copy_us(x, ct) -> float:
    """One copy of ``x`` into commd shared memory (a staged op does one in and one out)."""
    import numpy as np
    dst = ct.empty(x.numel())
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(dst.numpy(), x.numpy())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    import commd.torch as ct

    torch.set_num_threads(1)
    dist.init_process_group("commd")
    rank, n = dist.get_rank(), dist.get_world_size()
    # Whether ordinary tensors are commd's (in place) or staged: the backend installed the
    # allocator if it could (a second call only reports it).
    args.allocator = os.environ.get("COMMD_CPU_ALLOC", "1") != "0" and bool(ct.use_cpu_allocator())
    gloo = dist.new_group(backend="gloo")
    world = dist.group.WORLD
    pids = daemon_pids() if rank == 0 else []
    rows = []
    keep: list = []
    for nbytes in sizes(args.min_bytes, args.max_bytes):
        count = nbytes // 4
        iters = iters_for(nbytes, args.iters)
        variants = [("gloo", gloo, "plain"), ("commd", world, "plain")]
        if args.staged:
            variants.append(("commd-staged", world, "staged"))
        if args.registered:
            variants.append(("commd-registered", world, "registered"))
        row: dict = {"bytes": nbytes, "iters": iters}
        for name, group, memory in variants:
            x = tensor_for(memory, count, keep)
            x.fill_(rank + 1)
            dist.barrier(group=group)
            # The first op on a fresh tensor (and a correctness check: after k in-place sums
            # the value is known).
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            first = time.perf_counter() - t0
            want = n * (n + 1) / 2
            if not torch.all(x == want):
                raise SystemExit(f"{name} {nbytes} B: wrong result {x[:4]} (want {want})")
            times = []
            faults = 0
            dfaults = [minor_faults(p) for p in pids]
            for _ in range(iters):
                x.fill_(1.0)
                dist.barrier(group=group)
                f0 = minor_faults()
                t0 = time.perf_counter()
                dist.all_reduce(x, group=group)
                times.append(time.perf_counter() - t0)
                faults += minor_faults() - f0
            dfaults = [minor_faults(p) - d for p, d in zip(pids, dfaults)]
            if not torch.all(x == n):
                raise SystemExit(f"{name} {nbytes} B: wrong result after timing")
            # every rank's time counts: the op is done when the slowest rank is done
            t = torch.tensor(times + [first], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
            med = statistics.median(t.tolist()[:-1])
            alg = nbytes / med / 1e9
            row[name] = {"median_us": med * 1e6, "algbw": alg, "busbw": alg * 2 * (n - 1) / n,
                         "first_us": t.tolist()[-1] * 1e6, "rank_faults_per_op": faults / iters,
                         "daemon_faults_per_op": (sum(dfaults) / iters) if pids else None}
            if memory == "staged" and args.breakdown:
                row[name]["copy_us"] = staging_copy_us(x, ct)
        rows.append(row)
    if rank == 0:
        # Reference: one process copying 32 MiB (the machine's memory speed during this run).
        a = np.ones(8 << 20, np.float32)
        b = np.empty_like(a)
        ts = []
        for _ in range(8):
            t0 = time.perf_counter()
            np.copyto(b, a)
            ts.append(time.perf_counter() - t0)
        args.memcpy_gbs = a.nbytes / statistics.median(ts) / 1e9
        report(rows, n, args)
    dist.barrier(group=gloo)
    dist.destroy_process_group()


def report(rows: list[dict], n: int, args: argparse.Namespace) -> None:
    cols = (["gloo", "commd"] + (["commd-staged"] if args.staged else [])
            + (["commd-registered"] if args.registered else []))
    print(f"# all_reduce f32, {n} ranks on {args.nodes} commd node(s), torch.distributed; median "
          f"over iterations of the slowest rank; busbw = algbw*2(n-1)/n")
    how = ("in place (commd's CPU allocator)" if args.allocator
           else "staged (commd's CPU allocator is not installed; see the message above)")
    print(f"# ordinary tensors (the commd column) ran {how}")
    hdr = f"{'bytes':>10} {'iters':>5}"
    for c in cols:
        hdr += f" | {c + ' us':>14} {c[:5] + ' busbw':>12}"
    hdr += " | commd/gloo busbw"
    print(f"# memcpy 32 MiB in one process (median): {args.memcpy_gbs:.2f} GB/s")
    print(hdr)
    for r in rows:
        line = f"{r['bytes']:>10} {r['iters']:>5}"
        for c in cols:
            line += f" | {r[c]['median_us']:>14.1f} {r[c]['busbw']:>10.3f}GB"
        line += f" | {r['commd']['busbw'] / r['gloo']['busbw']:>8.2f}x"
        print(line, flush=True)
    if args.breakdown:
        print("# breakdown: first op on a fresh tensor (us, slowest rank), minor page faults per op "
              "(rank 0; daemon: all ranks' ops), one staging copy (us, rank 0)")
        print(f"{'bytes':>10} {'column':>17} {'median us':>10} {'first us':>10} "
              f"{'rank flt/op':>11} {'daemon flt/op':>13} {'copy us':>9}")
        for r in rows:
            for c in cols[1:]:
                v = r[c]
                d = v["daemon_faults_per_op"]
                print(f"{r['bytes']:>10} {c:>17} {v['median_us']:>10.1f} {v['first_us']:>10.1f} "
                      f"{v['rank_faults_per_op']:>11.1f} {'-' if d is None else f'{d:.1f}':>13} "
                      f"{v.get('copy_us', float('nan')):>9.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"nranks": n, "memcpy_gbs": args.memcpy_gbs,
                                               "allocator": args.allocator, "rows": rows},
                                              indent=1))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nranks", type=int, default=4)
    ap.add_argument("--socket", help="daemon socket (default: $COMMD_SOCKET or the per-user one)")
    ap.add_argument("--start-daemon", metavar="COMMD", help="start this commd binary for the run")
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=64 << 20)
    ap.add_argument("--iters", type=int, default=0, help="iterations per size (0: by size)")
    ap.add_argument("--staged", action="store_true",
                    help="also tensors over private mmap memory (staged: copied for every op)")
    ap.add_argument("--registered", action="store_true",
                    help="also tensors from commd.torch.empty (commd shared memory)")
    ap.add_argument("--breakdown", action="store_true",
                    help="also first-op time, page faults per op (rank, daemon), staging copy time")
    ap.add_argument("--nodes", type=int, default=1, help="daemons as separate nodes (needs --start-daemon)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    daemons = []
    sockets = []
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.nranks))
    if args.nodes > 1 and not args.start_daemon:
        raise SystemExit("--nodes > 1 needs --start-daemon PATH_TO_COMMD")
    if args.start_daemon:
        tmp = tempfile.mkdtemp(prefix="commd-bench-")
        for i in range(args.nodes):
            sock = os.path.join(tmp, f"node{i}.sock")
            daemons.append(subprocess.Popen(
                [args.start_daemon, "serve", "--socket", sock, "--set", "peer_listen=127.0.0.1:0"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            sockets.append(sock)
        env["COMMD_BENCH_DAEMON_PIDS"] = ",".join(str(d.pid) for d in daemons)
        for sock in sockets:
            for _ in range(200):
                if os.path.exists(sock):
                    break
                time.sleep(0.05)
    elif args.socket:
        sockets = [args.socket]
    fwd = [a for a in sys.argv[1:] if a != "--start-daemon" and a != args.start_daemon]

    def rank_env(r: int) -> dict:
        e = dict(env, RANK=str(r), LOCAL_RANK=str(r))
        if sockets:
            e["COMMD_SOCKET"] = sockets[r * len(sockets) // args.nranks]
        return e

    procs = [subprocess.Popen([sys.executable, __file__, "--rank-main", *fwd], env=rank_env(r))
             for r in range(args.nranks)]
    code = 0
    for p in procs:
        code |= p.wait()
    for d in daemons:
        d.terminate()
        d.wait()
    sys.exit(code)


if __name__ == "__main__":
    main()
