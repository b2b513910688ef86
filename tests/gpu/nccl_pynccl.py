"""vLLM's pynccl route on commd: the NCCL C API called through ctypes exactly as vLLM's
`PyNcclCommunicator` does (unique id broadcast over a gloo group, ncclCommInitRank, ops on
torch's current stream), eager and captured into a CUDA graph that is replayed with new data.

    COMMD_NCCL_LIB=.../libnccl.so.2 torchrun --nproc_per_node 2 tests/gpu/nccl_pynccl.py [--json F]

Checks every replay's results and prints the replay time per op (10 all-reduces of 8 KiB to
512 KiB per graph).
"""

import ctypes
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import nccl_ctypes


def main():
    lib = nccl_ctypes.load(os.environ["COMMD_NCCL_LIB"])

    def check(r, what):
        nccl_ctypes.check(lib, r, what)

    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    uid = nccl_ctypes.unique_id(lib, rank)
    comm = ctypes.c_void_p()
    v = ctypes.c_int()
    check(lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    with torch.cuda.device(dev):
        check(lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")

    def all_reduce(x, y, stream):
        check(lib.ncclAllReduce(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                                ctypes.c_size_t(x.numel()), 7, 0, comm,
                                ctypes.c_void_p(stream.cuda_stream)), "ncclAllReduce")

    # Eager, on the current stream.
    x = torch.full((4096,), float(rank + 1), device=dev)
    y = torch.empty_like(x)
    all_reduce(x, y, torch.cuda.current_stream())
    torch.cuda.synchronize()
    assert y.eq(world * (world + 1) / 2).all(), y[:4]

    # Captured: ten all-reduces, like one decode step's layers.
    sizes = [2048 << (i % 7) for i in range(10)]  # 8 KiB .. 512 KiB of float32
    xs = [torch.zeros(n, device=dev) for n in sizes]
    ys = [torch.empty_like(a) for a in xs]
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream(device=dev)
    with torch.cuda.graph(g, stream=s):
        for a, b in zip(xs, ys):
            all_reduce(a, b, torch.cuda.current_stream())
    replays = 60
    for rep in range(replays):
        for i, a in enumerate(xs):
            a.fill_(float(rank + rep + i))
        g.replay()
        torch.cuda.synchronize()
        for i, b in enumerate(ys):
            want = world * (rep + i) + world * (world - 1) / 2
            if not b.eq(want).all():
                raise AssertionError(f"replay {rep} op {i}: {b[:4].tolist()} != {want}")
    # Replay time: 200 replays back to back.
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        g.replay()
    torch.cuda.synchronize()
    per_op_us = (time.perf_counter() - t0) / 200 / len(xs) * 1e6
    err = ctypes.c_int(-1)
    check(lib.ncclCommGetAsyncError(comm, ctypes.byref(err)), "ncclCommGetAsyncError")
    assert err.value == 0, err.value
    del g
    check(lib.ncclCommDestroy(comm), "ncclCommDestroy")
    if rank == 0:
        row = {"test": "pynccl_graph", "world": world, "replays_checked": replays,
               "ops_per_graph": len(xs), "replay_us_per_op": round(per_op_us, 2),
               "nccl_version": v.value, "gpu": torch.cuda.get_device_name(dev)}
        print(json.dumps(row))
        if "--json" in sys.argv:
            with open(sys.argv[sys.argv.index("--json") + 1], "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
