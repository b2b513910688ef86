"""commd vs NCCL on GPU tensors, side by side in one run (torchrun, one process per GPU).

    torchrun --nproc_per_node 2 client-py/benchmarks/gpu_vs_nccl.py --op sendrecv
    torchrun --nproc_per_node 4 client-py/benchmarks/gpu_vs_nccl.py --op all_gather

Eager torch.distributed calls on the same tensors; per size: warm-up, then ``iters`` calls timed
by wall clock around a synchronize (the GPU work of all calls included), and the CPU time to
issue them (before the synchronize). Prints a table: time per op, algbw, busbw and issue time for
each backend, and the commd/NCCL busbw ratio. NVLink multicast stays off.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commd.torch  # noqa: E402,F401

SIZES = [64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--op", default="sendrecv",
                   choices=["sendrecv", "all_gather", "all_reduce", "broadcast", "all_to_all",
                            "reduce_scatter"])
    p.add_argument("--sizes", default="", help="comma-separated bytes (default 64K..1G)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default="", help="append one JSON line per size here (rank 0)")
    return p.parse_args()


def main() -> None:
    a = parse()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("commd")
    groups = {"commd": dist.group.WORLD, "nccl": dist.new_group(backend="nccl")}
    dt = getattr(torch, a.dtype)
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else SIZES
    if rank == 0:
        print(f"# {a.op}, {world} GPUs, {a.dtype}, {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"{'bytes':>12} | {'nccl us':>9} {'algbw':>7} {'busbw':>7} {'cpu us':>7} | "
              f"{'commd us':>9} {'algbw':>7} {'busbw':>7} {'cpu us':>7} | {'ratio':>5}")
    for nbytes in sizes:
        n = max(nbytes // torch.tensor([], dtype=dt).element_size(), world)
        n -= n % world
        res = {}
        for name in ("nccl", "commd"):
            g = groups[name]
            x = torch.randn(n, device=dev).to(dt)
            out = torch.empty(n * (world if a.op == "all_gather" else 1), device=dev, dtype=dt)
            small = torch.empty(n // world, device=dev, dtype=dt)

            def op() -> None:
                if a.op == "sendrecv":
                    if rank == 0:
                        dist.send(x, 1, group=g)
                    elif rank == 1:
                        dist.recv(out, 0, group=g)
                elif a.op == "all_gather":
                    dist.all_gather_into_tensor(out, x, group=g)
                elif a.op == "all_reduce":
                    dist.all_reduce(x, group=g)
                elif a.op == "broadcast":
                    dist.broadcast(x, 0, group=g)
                elif a.op == "all_to_all":
                    dist.all_to_all_single(out, x, group=g)
                elif a.op == "reduce_scatter":
                    dist.reduce_scatter_tensor(small, x, group=g)

            iters = max(5, min(200, (2 << 30) // max(nbytes, 1)))
            for _ in range(3):
                op()
            torch.cuda.synchronize()
            dist.barrier(group=groups["nccl"])
            t0 = time.perf_counter()
            for _ in range(iters):
                op()
            cpu_s = (time.perf_counter() - t0) / iters  # issuing alone (the GPU may lag)
            torch.cuda.synchronize()
            dt_s = (time.perf_counter() - t0) / iters
            t = torch.tensor([dt_s], device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["nccl"])
            dt_s = t.item()
            size = n * x.element_size()
            algbw = size / dt_s / 1e9
            factor = {"sendrecv": 1.0, "broadcast": 1.0, "all_reduce": 2 * (world - 1) / world,
                      "all_gather": (world - 1), "all_to_all": (world - 1) / world,
                      "reduce_scatter": (world - 1) / world}[a.op]
            res[name] = (dt_s * 1e6, algbw, algbw * factor, cpu_s * 1e6)
        if rank == 0:
            nu, na, nb, nc = res["nccl"]
            cu, ca, cb, cc = res["commd"]
            print(f"{nbytes:>12} | {nu:>9.1f} {na:>7.1f} {nb:>7.1f} {nc:>7.1f} | {cu:>9.1f} "
                  f"{ca:>7.1f} {cb:>7.1f} {cc:>7.1f} | {cb / nb:>5.2f}", flush=True)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps({"op": a.op, "gpus": world, "bytes": nbytes,
                                        "dtype": a.dtype, "nccl_us": nu, "nccl_busbw": nb,
                                        "nccl_cpu_us": nc, "commd_us": cu, "commd_busbw": cb,
                                        "commd_cpu_us": cc}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
