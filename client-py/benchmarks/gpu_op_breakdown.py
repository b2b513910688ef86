"""Where the time of one GPU op goes: commd (fast path and general path) vs NCCL, same run.

    torchrun --nproc_per_node 2 client-py/benchmarks/gpu_op_breakdown.py --op sendrecv
    torchrun --nproc_per_node 4 client-py/benchmarks/gpu_op_breakdown.py --op all_gather

Per size and variant (``nccl``; ``commd``: the native fast path; ``commd-py``: the general
Python path, ``commd._torch_cuda.FAST = False``):
- ``cpu us``: the CPU time to issue one op in a steady loop (eager torch.distributed calls);
- ``wall us``: the time per op of that loop including the final synchronize (what
  gpu_vs_nccl.py reports);
- ``gpu us``: the GPU's time per op when the CPU is far ahead: every rank's stream first sleeps
  (``torch.cuda._sleep``) while the CPU queues ``--queued`` ops behind it, then CUDA events time
  the queued ops on the GPU alone (doorbells, daemon, copies, stream hops), with no issue cost.
Then rank 0 profiles ``--profile`` ops of each commd variant with cProfile (top functions by
own time, in ``--out``/profile-*.txt) and times the Python pieces of the general path.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commd.torch  # noqa: E402,F401
from commd import _torch_cuda  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="sendrecv", choices=["sendrecv", "all_gather", "all_reduce"])
    p.add_argument("--sizes", default=str(64 << 10) + "," + str(1 << 20) + "," + str(16 << 20))
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--queued", type=int, default=100)
    p.add_argument("--profile", type=int, default=500)
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    return p.parse_args()


def main() -> None:
    a = parse()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("commd")
    groups = {"commd": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}
    nccl = groups["nccl"]
    sizes = [int(s) for s in a.sizes.split(",")]
    if rank == 0:
        print(f"# {a.op}, {world} GPUs, {torch.cuda.get_device_name()}, torch "
              f"{torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"{'bytes':>10} {'variant':>9} | {'cpu us':>7} {'wall us':>8} {'gpu us':>7}")
    rows = []
    for nbytes in sizes:
        n = max(nbytes // 4, world)
        n -= n % world
        x = torch.randn(n, device=dev)
        out = torch.empty(n * (world if a.op == "all_gather" else 1), device=dev)

        for variant in ("nccl", "commd", "commd-py"):
            g = groups["nccl" if variant == "nccl" else "commd"]
            _torch_cuda.FAST = variant != "commd-py"

            def op(g=g) -> None:
                if a.op == "sendrecv":
                    if rank == 0:
                        dist.send(x, 1, group=g)
                    elif rank == 1:
                        dist.recv(out, 0, group=g)
                elif a.op == "all_gather":
                    dist.all_gather_into_tensor(out, x, group=g)
                else:
                    dist.all_reduce(x, group=g)

            for _ in range(5):
                op()
            torch.cuda.synchronize()
            dist.barrier(group=nccl)
            t0 = time.perf_counter()
            for _ in range(a.iters):
                op()
            cpu = (time.perf_counter() - t0) / a.iters
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / a.iters
            # GPU alone: the streams sleep while the CPU queues the ops.
            dist.barrier(group=nccl)
            torch.cuda.synchronize()
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(int(60e6))  # ~30 ms at ~2 GHz
            e0.record()
            t1 = time.perf_counter()
            for _ in range(a.queued):
                op()
            queued_cpu = time.perf_counter() - t1
            e1.record()
            torch.cuda.synchronize()
            gpu_ms = e0.elapsed_time(e1)
            gpu = gpu_ms / 1e3 / a.queued
            ahead = queued_cpu < 0.02  # the CPU queued everything while the streams slept
            v = torch.tensor([cpu, wall, gpu], device=dev)
            dist.all_reduce(v, op=dist.ReduceOp.MAX, group=nccl)
            cpu, wall, gpu = v.tolist()
            if rank == 0:
                flag = "" if ahead else " (CPU not ahead: gpu us is an upper bound)"
                print(f"{nbytes:>10} {variant:>9} | {cpu * 1e6:>7.1f} {wall * 1e6:>8.1f} "
                      f"{gpu * 1e6:>7.1f}{flag}", flush=True)
                rows.append({"op": a.op, "gpus": world, "bytes": nbytes, "variant": variant,
                             "cpu_us": cpu * 1e6, "wall_us": wall * 1e6, "gpu_us": gpu * 1e6})
    _torch_cuda.FAST = True

    # cProfile of the issue path (smallest size), rank 0's view; every rank runs the ops.
    x = torch.randn(max(sizes[0] // 4, world) // world * world, device=dev)
    out = torch.empty(x.numel() * (world if a.op == "all_gather" else 1), device=dev)
    for variant in ("commd", "commd-py"):
        _torch_cuda.FAST = variant == "commd"

        def op2() -> None:
            if a.op == "sendrecv":
                if rank == 0:
                    dist.send(x, 1)
                elif rank == 1:
                    dist.recv(out, 0)
            elif a.op == "all_gather":
                dist.all_gather_into_tensor(out, x)
            else:
                dist.all_reduce(x)

        for _ in range(5):
            op2()
        torch.cuda.synchronize()
        dist.barrier(group=nccl)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.profile):
            op2()
        prof.disable()
        torch.cuda.synchronize()
        if rank == 0:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
            with open(os.path.join(a.out, f"profile-{a.op}-{variant}.txt"), "w") as f:
                f.write(buf.getvalue())
            lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()]
            print(f"# cProfile, {variant}, {a.profile} ops (rank 0), top by own time:")
            start = next((i for i, ln in enumerate(lines) if "ncalls" in ln), 0)
            for ln in lines[start:start + 11]:
                print("  " + ln[:150])
    _torch_cuda.FAST = True

    if rank == 0:  # the Python pieces of the general path, on their own
        s = torch.cuda.Stream()
        cur = torch.cuda.current_stream()
        t = x

        def clock(what: str, f, k: int = 2000) -> None:
            f()
            t0 = time.perf_counter()
            for _ in range(k):
                f()
            us = (time.perf_counter() - t0) / k * 1e6
            print(f"  {what:<44} {us:7.2f} us")
            rows.append({"piece": what, "us": us})

        print("# Python pieces (rank 0)")
        clock("torch._C._cuda_getCurrentRawStream", lambda: _torch_cuda._raw_stream(local))
        clock("torch.cuda.current_stream()", lambda: torch.cuda.current_stream(dev))
        clock("stream.wait_stream(current)", lambda: s.wait_stream(cur))
        clock("torch.cuda.Event() + record", lambda: torch.cuda.Event().record(s))
        def enter_device() -> None:
            with torch.cuda.device(dev):
                pass

        clock("with torch.cuda.device(dev)", enter_device)
        clock("tensor.record_stream(s)", lambda: t.record_stream(s))
        clock("FastCudaWork(...) (c10d Work subclass)",
              lambda: _torch_cuda.FastCudaWork(None, local, None))
        clock("data_ptr+get_device+numel+is_contiguous",
              lambda: (t.data_ptr(), t.get_device(), t.numel(), t.is_contiguous()))
        torch.cuda.synchronize()
        with open(os.path.join(a.out, f"breakdown-{a.op}.jsonl"), "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.barrier(group=nccl)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
