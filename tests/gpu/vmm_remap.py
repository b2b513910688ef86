"""cuMem memory (PyTorch's expandable segments): registration by POSIX-fd export, tensors that
span many pieces, and pieces the allocator unmaps and maps again (torchrun, 1 or more GPUs;
scripts/gpu-check.sh runs it with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True).

1. Ops on tensors from 4 KB to 200 MiB (a 200 MiB tensor spans ten 20 MiB pieces) give the
   right values: all_gather_into_tensor and all_reduce, plus a send/recv ring with 2 or more
   ranks.
2. Steady state: 20 more rounds on the same tensors register nothing new.
3. Remap: the tensors are freed and `torch.cuda.empty_cache()` unmaps their pieces; new tensors
   land at the same addresses on new physical memory. If the daemon kept the old pieces, its
   copies would go to memory the client no longer sees: the values would be the old ones.
Exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import commd.torch  # noqa: E402

import torchrun_env

rank, world, dev = torchrun_env.start()
conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
failures: list[str] = []
checks = 0


def say(msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def client():  # the native client of the default group's commd backend
    pg = dist.distributed_c10d._get_default_group()
    backend = pg if hasattr(pg, "client") else commd.torch.backend(pg)
    return backend.client._native


SIZES = [1000, 1 << 20, 5 << 20, 50 << 20]  # f32 elements: 4 KB ... 200 MiB


def tensors(tag: float) -> list[tuple[torch.Tensor, ...]]:
    """Per size: the input, the all_gather output, the all_reduce buffer, send and recv."""
    out = []
    for n in SIZES:
        x = torch.arange(n, device=dev, dtype=torch.float32).remainder_(1024).add_(tag + rank)
        g = torch.empty(n * world, device=dev)
        a = torch.empty(n, device=dev)
        s = torch.full((n,), tag * 3 + rank, device=dev)
        rcv = torch.full((n,), -1.0, device=dev)
        out.append((x, g, a, s, rcv))
    return out


def run(ts, tag: float, what: str) -> None:
    """One round of ops on `ts` (only these tensors reach commd), each result checked."""
    global checks
    for (x, g, a, s, rcv), n in zip(ts, SIZES):
        dist.all_gather_into_tensor(g, x)
        a.copy_(x)
        dist.all_reduce(a)
        if world > 1:
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, (rank + 1) % world),
                                           dist.P2POp(dist.irecv, rcv, (rank - 1) % world)])
            for q in reqs:
                q.wait()
        base = torch.arange(n, device=dev, dtype=torch.float32).remainder_(1024)
        for r in range(world):
            checks += 1
            if not torch.equal(g[r * n:(r + 1) * n], base + tag + r):
                failures.append(f"{what}: all_gather of {n * 4} bytes, block of rank {r} wrong")
        checks += 1
        want = base * world + sum(tag + r for r in range(world))
        if not torch.equal(a, want):
            failures.append(f"{what}: all_reduce of {n * 4} bytes wrong")
        if world > 1:
            checks += 1
            prev = (rank - 1) % world
            if not torch.equal(rcv, torch.full_like(rcv, tag * 3 + prev)):
                failures.append(f"{what}: recv of {n * 4} bytes from rank {prev} wrong "
                                f"(first value {rcv[0].item()}, want {tag * 3 + prev})")
    torch.cuda.synchronize()


say(f"world {world}, PYTORCH_CUDA_ALLOC_CONF={conf!r}")
c = client()
ts = tensors(1.0)
ptrs = [t[0].data_ptr() for t in ts]
run(ts, 1.0, "first use")
r1 = c.cuda_registration_stats()
st1 = json.loads(c.status_json())
for i in range(20):
    run(ts, 1.0, f"steady round {i}")
r2 = c.cuda_registration_stats()
st2 = json.loads(c.status_json())
say(f"registrations/hits after first use {r1}, after 20 rounds {r2}; daemon opens "
    f"{st1['ipc_opens']} -> {st2['ipc_opens']}")
checks += 1
if r2[0] != r1[0] or st2["ipc_opens"] != st1["ipc_opens"]:
    failures.append(f"steady state registered again: client {r1[0]} -> {r2[0]}, daemon opens "
                    f"{st1['ipc_opens']} -> {st2['ipc_opens']}")

# Remap: free everything, give the pieces back to the driver, allocate again.
del ts
torch.cuda.synchronize()
torch.cuda.empty_cache()
ts = tensors(7.0)
same = sum(t[0].data_ptr() in ptrs for t in ts)
say(f"after empty_cache: {same} of {len(ts)} inputs at a previously registered address")
run(ts, 7.0, "after remap")
r3 = c.cuda_registration_stats()
say(f"registrations/hits after the remap {r3}")
if "expandable_segments:True" in conf:
    checks += 1
    if r3[0] <= r2[0]:
        failures.append("after empty_cache the new pieces were not registered again "
                        f"({r2[0]} -> {r3[0]} registrations)")

dist.barrier()
for f in failures[:40]:
    print(f"rank {rank} FAIL {f}", flush=True)
print(f"rank {rank}: {checks} checks, {len(failures)} failures", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
