"""Large GPU broadcasts (the daemon's pipelined chain from 32 MiB on 3+ ranks), run under
torchrun on a GPU machine: every root, odd sizes, several dtypes, against the known pattern;
then the time per broadcast against NCCL on the same tensors where each rank has its own GPU.

    torchrun --nproc_per_node 4 tests/gpu/broadcast_chain.py
    BCAST_SHARE_GPU=1 torchrun --nproc_per_node 3 tests/gpu/broadcast_chain.py   # one GPU

With more ranks than GPUs, rank r uses GPU r mod the GPU count (no NCCL comparison then).

Prints one line per check and a timing table on rank 0; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import commd.torch  # noqa: F401  (registers the backend)

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
ngpu = torch.cuda.device_count()
share = os.environ.get("BCAST_SHARE_GPU") == "1" or world > ngpu
local = 0 if os.environ.get("BCAST_SHARE_GPU") == "1" else int(
    os.environ.get("LOCAL_RANK", rank)) % ngpu
torch.cuda.set_device(local)
dev = torch.device("cuda", local)
dist.init_process_group("commd")
nccl = None if share else dist.new_group(backend="nccl")
failures = 0
checks = 0


def pattern(n: int, dtype: torch.dtype, root: int) -> torch.Tensor:
    i = torch.arange(n, device=dev, dtype=torch.int64)
    return ((i * 7 + root * 131) % 251).to(dtype)


for nbytes in (32 << 20, (96 << 20) + 6, 256 << 20, 1 << 30):
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        if nbytes >= (256 << 20) and dtype != torch.float32:
            continue
        n = nbytes // torch.empty((), dtype=dtype).element_size()
        for root in range(world):
            want = pattern(n, dtype, root)
            t = want.clone() if rank == root else torch.full((n,), 3, device=dev, dtype=dtype)
            dist.broadcast(t, root)
            torch.cuda.synchronize()
            checks += 1
            if not torch.equal(t, want):
                bad = (t != want).nonzero()[0].item()
                failures += 1
                print(f"FAIL rank {rank}: broadcast {nbytes} B {dtype} root {root}: element "
                      f"{bad} is {t[bad].item()}, want {want[bad].item()}", flush=True)
            del t, want
        torch.cuda.empty_cache()

print(f"rank {rank}: {checks} checks, {failures} failures", flush=True)
rows = []
for nbytes in (32 << 20, 128 << 20, 512 << 20, 1 << 30):
    t = torch.zeros(nbytes // 4, device=dev)
    row = [nbytes]
    for g in ([None, nccl] if nccl is not None else [None]):
        for _ in range(3):
            dist.broadcast(t, 0, group=g)
        torch.cuda.synchronize()
        dist.barrier()
        iters = 20
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.broadcast(t, 0, group=g)
        torch.cuda.synchronize()
        row.append((time.perf_counter() - t0) / iters * 1e6)
    rows.append(row)
    del t
if rank == 0:
    print(f"# broadcast f32 from rank 0, {world} ranks, us per op (20 back to back)"
          + ("" if nccl is not None else f", ranks sharing {min(world, ngpu)} GPU(s)"))
    for r in rows:
        extra = f"  NCCL {r[2]:10.1f}  commd/NCCL {r[1] / r[2]:.2f}" if len(r) > 2 else ""
        print(f"{r[0]:>12}  commd {r[1]:10.1f}{extra}", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(1 if failures else 0)
