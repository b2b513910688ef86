"""A rank's communicators on one GPU share the daemon's scratch: their reductions must still be
right when they run at the same time. torchrun, 2+ ranks, any number of GPUs.

Eight process groups over all ranks; on two streams at once, each group runs all_reduce,
reduce_scatter and reduce of sizes from 4 KiB to 32 MiB (several scratch rounds), async,
with inputs that differ per group, rank and round; every result is checked. Then the same under
one CUDA graph capturing ops of four groups. Exits non-zero on any wrong result.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import torchrun_env

rank, world, dev = torchrun_env.start()
groups = [dist.new_group(list(range(world))) for _ in range(8)]
streams = [torch.cuda.Stream(device=dev) for _ in range(2)]
sizes = [1 << 10, 1 << 16, 1 << 20, 8 << 20]
failures: list[str] = []


def val(g: int, r: int, k: int) -> float:
    return float((g + 1) * 3 + (r + 1) * 5 + k)


for k in range(4):
    pend = []
    for gi, g in enumerate(groups):
        s = streams[gi % 2]
        n = sizes[(gi + k) % len(sizes)]
        with torch.cuda.stream(s):
            x = torch.full((n,), val(gi, rank, k), device=dev)
            rs_in = torch.full((n * world,), val(gi, rank, k), device=dev)
            rs_out = torch.empty(n, device=dev)
            red = torch.full((n,), val(gi, rank, k), device=dev)
            w = [dist.all_reduce(x, group=g, async_op=True),
                 dist.reduce_scatter_tensor(rs_out, rs_in, group=g, async_op=True),
                 dist.reduce(red, dst=0, group=g, async_op=True)]
        pend.append((gi, n, x, rs_out, red, w))
    for gi, n, x, rs_out, red, w in pend:
        for h in w:
            h.wait()
    torch.cuda.synchronize()
    for gi, n, x, rs_out, red, w in pend:
        want = sum(val(gi, r, k) for r in range(world))
        for name, t, check in (("all_reduce", x, True), ("reduce_scatter", rs_out, True),
                               ("reduce", red, rank == 0)):
            if check and not bool((t == want).all()):
                failures.append(f"round {k} group {gi} {name} {n} elems: got {t[0].item()} "
                                f"(and {int((t != want).sum())} wrong), want {want}")

# Captured: ops of four groups in one graph, replayed with new inputs.
xs = [torch.empty(1 << 18, device=dev) for _ in range(4)]
for gi, x in enumerate(xs):
    x.fill_(val(gi, rank, 0))
s = torch.cuda.Stream(device=dev)
s.wait_stream(torch.cuda.current_stream(dev))
with torch.cuda.stream(s):
    for gi, x in enumerate(xs):
        dist.all_reduce(x, group=groups[gi])
torch.cuda.current_stream(dev).wait_stream(s)
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    for gi, x in enumerate(xs):
        dist.all_reduce(x, group=groups[gi])
for k in range(1, 6):
    for gi, x in enumerate(xs):
        x.fill_(val(gi, rank, k))
    graph.replay()
    torch.cuda.synchronize()
    for gi, x in enumerate(xs):
        want = sum(val(gi, r, k) for r in range(world))
        if not bool((x == want).all()):
            failures.append(f"replay {k} group {gi}: got {x[0].item()}, want {want}")
print(f"rank {rank}: {len(failures)} failures", flush=True)
for f in failures[:20]:
    print(f"rank {rank}: FAIL {f}", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
