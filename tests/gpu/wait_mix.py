"""Stream ordering when one stream mixes both ways of waiting for done (torchrun, any number of
GPUs from 1; scripts/gpu-check.sh).

With `COMMD_GPU_WAIT=auto` (the default) ops below 2 MiB wait with `cuStreamWaitValue32` and
larger ones with the polling kernel (client-rs/src/gpu/wait.rs). Here small and large ops
alternate on one stream with no CPU sync between them: each op's input is written by a kernel
just before it, and its output is consumed by a kernel just after it. A wait that let the stream
go on before the daemon's copies landed, or a producer that the daemon's copy overtook, shows up
as a wrong value. Collectives only (all_gather_into_tensor, out of place, and all_reduce), so one
GPU is enough (world 1: the daemon still copies input to output); with 2 or more ranks a
send/recv ring runs too. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import torchrun_env

rank, world, dev = torchrun_env.start()
print(f"rank {rank}: COMMD_GPU_WAIT={os.environ.get('COMMD_GPU_WAIT', '') or 'auto'}", flush=True)

# Elements (f32): below and above the 2 MiB switch, alternating.
sizes = [4096, 4 << 20, 16384, 1 << 20, 1000, 3, 512 << 10]
rounds = 6
pending = []
for r in range(rounds):
    for i, n in enumerate(sizes):
        tag = float(r * 100 + i + 1)
        x = torch.empty(n, device=dev)
        x.fill_(tag + rank)                       # producer kernel right before the op
        out = torch.empty(n * world, device=dev)
        dist.all_gather_into_tensor(out, x)
        y = out * 2                               # consumer kernel right after
        a = torch.full((n,), tag, device=dev)
        a.add_(rank)
        dist.all_reduce(a)
        z = a + 1
        got = [y, z]
        if world > 1:
            s = torch.full((n,), tag * 3 + rank, device=dev)
            rcv = torch.empty(n, device=dev)
            peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, peer_next),
                                           dist.P2POp(dist.irecv, rcv, peer_prev)])
            for q in reqs:
                q.wait()
            got.append(rcv - 0.5)
        pending.append((r, i, n, got))
torch.cuda.synchronize()

failures = 0
checks = 0
for r, i, n, got in pending:
    tag = float(r * 100 + i + 1)
    want_y = torch.cat([torch.full((n,), (tag + k) * 2, device=dev) for k in range(world)])
    want_z = torch.full((n,), tag * world + sum(range(world)) + 1, device=dev)
    wants = [want_y, want_z]
    if world > 1:
        wants.append(torch.full((n,), tag * 3 + (rank - 1) % world - 0.5, device=dev))
    for name, g, w in zip(("all_gather", "all_reduce", "sendrecv"), got, wants):
        checks += 1
        bad = int((g != w).sum().item())
        if bad:
            failures += 1
            j = int((g != w).nonzero()[0].item())
            print(f"rank {rank}: round {r} {name} of {n} elements: {bad} wrong, first at {j}: "
                  f"{g[j].item()} vs {w[j].item()}", flush=True)
print(f"rank {rank}: {checks} checks, {failures} failures", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
