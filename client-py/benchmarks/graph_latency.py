"""Per-op latency of all_reduce captured into a CUDA graph (10 ops per graph, as in NCCL's
graph-latency figures in shared/baselines.md) against the same 10 ops issued eagerly, for the
backend given (commd, or nccl for the peer figures: one GPU per rank). Run under torchrun:

    torchrun --standalone --nproc_per_node 2 client-py/benchmarks/graph_latency.py --backend commd
    torchrun --standalone --nproc_per_node 2 client-py/benchmarks/graph_latency.py --backend nccl

Sizes 8 KiB .. 512 KiB (float32). Each size: the graph is replayed 5 times to warm up, then
the median of 7 timings of 20 replays (CUDA events around the replays, divided by 10 ops per
replay); eager: the median of 7 timings of 20 x 10 blocking ops. Every graph's result is
checked after the timings (inputs refilled before each replay would add a kernel per op, so
the timed loop replays on the previous result and the check uses a fresh replay). Rank 0
prints one line per size and, with --json, appends JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--backend", default="commd")
p.add_argument("--sizes", default="8K,16K,32K,64K,128K,256K,512K")
p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
p.add_argument("--op", default="all_reduce",
               choices=["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"])
p.add_argument("--ops", type=int, default=10)
p.add_argument("--json")
a = p.parse_args()


def parse(s: str) -> int:
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)


rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
torch.cuda.set_device(local)
dev = torch.device("cuda", local)
if a.backend == "commd":
    import commd.torch  # noqa: F401
dist.init_process_group(a.backend)


def timed(fn, reps: int = 20, trials: int = 7) -> float:
    """Median seconds of ``reps`` calls of ``fn`` (CUDA events on the current stream)."""
    ts = []
    for _ in range(trials):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3 / reps)
    return statistics.median(ts)


bad = []
dtype = getattr(torch, a.dtype)
for size in [parse(x) for x in a.sizes.split(",")]:
    n = size // torch.empty((), dtype=dtype).element_size()
    xs = [torch.full((n,), float(rank + 1), device=dev, dtype=dtype) for _ in range(a.ops)]
    # Per op, `size` bytes per rank: all_gather's output and reduce_scatter's input are world x.
    big = [torch.empty(n * world, device=dev, dtype=dtype) for _ in range(a.ops)]

    def ops():
        for x, y in zip(xs, big):
            if a.op == "all_reduce":
                dist.all_reduce(x)
            elif a.op == "all_gather":
                dist.all_gather_into_tensor(y, x)
            elif a.op == "reduce_scatter":
                dist.reduce_scatter_tensor(x, y)
            elif a.op == "broadcast":
                dist.broadcast(x, src=0)
            else:
                dist.reduce(x, dst=0)

    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        ops()
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ops()
    # How commd ran the captured ops (docs/contracts.md #6: through the daemon, or #7: direct).
    path = commd.torch.graph_path() if a.backend == "commd" else "-"
    eager_path = commd.torch.eager_path() if a.backend == "commd" else "-"
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    graph_s = timed(g.replay) / a.ops
    eager_s = timed(ops) / a.ops
    # Correctness: fresh inputs, one replay, against what the op must give.
    for x, y in zip(xs, big):
        x.fill_(float(rank + 1))
        y.fill_(float(rank + 1))
    g.replay()
    torch.cuda.synchronize()
    total = float(sum(range(1, world + 1)))
    if a.op in ("all_reduce", "reduce_scatter") or (a.op == "reduce" and rank == 0):
        ok = all(bool((x == total).all()) for x in xs)
    elif a.op == "all_gather":
        want = torch.arange(1, world + 1, device=dev, dtype=dtype).repeat_interleave(n)
        ok = all(torch.equal(y, want) for y in big)
    elif a.op == "broadcast":
        ok = all(bool((x == 1.0).all()) for x in xs)
    else:
        ok = all(bool((x == rank + 1).all()) for x in xs)
    if not ok:
        bad.append(size)
    del g
    if rank == 0:
        r = {"bench": "graph_latency", "backend": a.backend, "ranks": world,
             "gpus": torch.cuda.device_count(), "op": a.op, "bytes": size, "ops_per_graph": a.ops,
             "graph_us": round(graph_s * 1e6, 2), "eager_us": round(eager_s * 1e6, 2),
             "correct": size not in bad, "dtype": a.dtype, "path": path,
             "direct_max_bytes": os.environ.get("COMMD_GRAPH_DIRECT_MAX_BYTES"),
             "direct_blocks": os.environ.get("COMMD_GRAPH_DIRECT_BLOCKS"),
             "eager_direct": os.environ.get("COMMD_EAGER_DIRECT", "0"), "eager_path": eager_path}
        print(f"{a.backend} {world} ranks on {r['gpus']} GPU(s) {a.op} {size // 1024:>4} KiB: "
              f"graph {r['graph_us']:7.1f} us/op, eager {r['eager_us']:7.1f} us/op"
              f"{'' if r['correct'] else '  WRONG RESULT'} [{path[:60]}; eager {eager_path[:40]}]",
              flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(r) + "\n")
dist.destroy_process_group()
sys.exit(1 if bad else 0)
