"""A torch-only replica of vLLM's tensor-parallel decode step under CUDA graphs (the vLLM wheel,
89 MB of CUDA extension, does not travel to the GPU machines): per batch size, one graph holding
LAYERS row-parallel linear layers, each a bf16 GEMM of this rank's shard followed by the
tensor-parallel all-reduce of the partial sums (what vLLM's `RowParallelLinear` does), captured
as vLLM captures one graph per decode batch size. Every replay gets new input data (copied into
the graph's static input, as vLLM's model runner does) and its output must equal the same step
run eagerly on the same input; then replay and eager step times.

    torchrun --nproc_per_node 2 tests/gpu/vllm_decode.py --backend commd [--json FILE]
    torchrun --nproc_per_node 2 tests/gpu/vllm_decode.py --backend nccl

commd must match eager bit for bit (the captured all-reduce runs the eager path's reduction
order); NCCL's graph and eager runs may pick different algorithms, so its check allows bf16
rounding (reported, not failed on). Exits non-zero on a wrong commd result.
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
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--layers", type=int, default=16)
p.add_argument("--batches", default="1,8,64,256")
p.add_argument("--replays", type=int, default=10)
p.add_argument("--json")
a = p.parse_args()

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
torch.cuda.set_device(local)
dev = torch.device("cuda", local)
if a.backend == "commd":
    import commd.torch
dist.init_process_group(a.backend)
H, L = a.hidden, a.layers
assert H % world == 0
shard = H // world
g = torch.Generator(device=dev).manual_seed(1234 + rank)
# This rank's shard of each layer's weight (rows `shard` of the input dimension), small values so
# 16 layers of bf16 stay finite.
ws = [(torch.randn(shard, H, device=dev, generator=g, dtype=torch.float32) / H ** 0.5)
      .to(torch.bfloat16) for _ in range(L)]


def step(x: torch.Tensor) -> torch.Tensor:
    """One decode step's tensor-parallel part: per layer, this rank's shard of the input times
    its weight shard, all-reduced (the row-parallel linear's output), then the next layer."""
    for w in ws:
        part = x[:, rank * shard:(rank + 1) * shard] @ w
        dist.all_reduce(part)
        x = part
    return x


def timed(fn, reps: int = 20, trials: int = 5) -> float:
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


failures = []
path = "-"
for b in [int(x) for x in a.batches.split(",")]:
    static_in = torch.zeros(b, H, device=dev, dtype=torch.bfloat16)
    # Warm up on a side stream, then capture (as torch.cuda.graph users do).
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        step(static_in)
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_in)
    if a.backend == "commd":
        path = commd.torch.graph_path()
    worst = 0.0
    for k in range(a.replays):
        gen = torch.Generator(device=dev).manual_seed(1000 * b + k)
        x = torch.randn(b, H, device=dev, generator=gen).to(torch.bfloat16)
        static_in.copy_(x)
        graph.replay()
        got = static_out.clone()
        want = step(x)
        torch.cuda.synchronize()
        if not torch.equal(got, want):
            diff = (got.float() - want.float()).abs().max().item()
            worst = max(worst, diff / max(want.float().abs().max().item(), 1e-30))
            if a.backend == "commd":
                failures.append(f"batch {b}, replay {k}: the replay differs from the eager step "
                                f"(max relative difference {worst:.3g})")
    graph_s = timed(graph.replay)
    eager_s = timed(lambda: step(static_in))
    if rank == 0:
        r = {"bench": "vllm_decode", "backend": a.backend, "ranks": world,
             "gpus": torch.cuda.device_count(), "batch": b, "hidden": H, "layers": L,
             "allreduce_bytes": b * H * 2, "graph_step_us": round(graph_s * 1e6, 1),
             "eager_step_us": round(eager_s * 1e6, 1), "replays_checked": a.replays,
             "max_rel_diff_vs_eager": worst, "path": path}
        print(f"{a.backend} TP={world} batch {b:>4} ({b * H * 2 // 1024} KiB all-reduces): "
              f"graph step {r['graph_step_us']:8.1f} us, eager {r['eager_step_us']:8.1f} us, "
              f"{a.replays} replays vs eager: max rel diff {worst:.3g} [{path[:50]}]", flush=True)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(r) + "\n")
    del graph
print(f"rank {rank}: {len(failures)} failures", flush=True)
for f in failures[:10]:
    print(f"rank {rank}: FAIL {f}", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
