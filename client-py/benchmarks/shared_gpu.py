"""Ranks sharing one GPU (commd allows it, NCCL does not): per-op time of all_reduce and
all_gather, float32, for the wait mode in effect (COMMD_GPU_WAIT, default auto). Run under
torchrun with more ranks than GPUs, once per mode to compare, e.g.

    torchrun --standalone --nproc_per_node 2 client-py/benchmarks/shared_gpu.py
    COMMD_GPU_WAIT=memop torchrun --standalone --nproc_per_node 2 client-py/benchmarks/shared_gpu.py

Each size: 5 warm-up ops, then the median of 7 timings of 20 ops (CUDA events on the current
stream; the ops are blocking collectives, as DDP issues them). Results are checked against the
expected sums. Rank 0 prints one line per (op, size) and, with --json, appends JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests", "gpu"))
import torchrun_env  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--sizes", default="64K,1M,4M,16M")
p.add_argument("--json")
a = p.parse_args()


def parse(s: str) -> int:
    m = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * m[s[-1]] if s[-1] in m else int(s)


rank, world, dev = torchrun_env.start()
mode = os.environ.get("COMMD_GPU_WAIT", "") or "auto"
for op in ("all_reduce", "all_gather"):
    for size in [parse(x) for x in a.sizes.split(",")]:
        n = size // 4
        x = torch.full((n,), float(rank + 1), device=dev)
        out = torch.empty(n * world, device=dev)

        def once():
            if op == "all_reduce":
                x.fill_(float(rank + 1))
                dist.all_reduce(x)
            else:
                dist.all_gather_into_tensor(out, x)

        for _ in range(5):
            once()
        torch.cuda.synchronize()
        times = []
        for _ in range(7):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                once()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 20 * 1e3)
        ok = bool((x == float(sum(range(1, world + 1)))).all()) if op == "all_reduce" else \
            bool((out.view(world, n)[:, 0] == torch.arange(1, world + 1, device=dev,
                                                          dtype=out.dtype)).all())
        med = statistics.median(times)
        if rank == 0:
            print(f"{op:11s} {size:>10d} B  {world} ranks on {torch.cuda.device_count()} GPU(s)  "
                  f"wait={mode:6s} {med:9.1f} us/op  correct={ok}", flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps({"op": op, "bytes": size, "ranks": world,
                                        "gpus": torch.cuda.device_count(), "gpu_wait": mode,
                                        "us_per_op": med, "correct": ok,
                                        "commit": os.environ.get("COMMD_COMMIT", "")}) + "\n")
dist.destroy_process_group()
