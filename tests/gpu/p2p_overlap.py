"""Send/recv jobs of one communicator that run at the same time in the daemon's GPU executor
(cuda/executor.rs `beside`), and the ones that must not (scripts/gpu-check.sh tests; 2+ ranks, which may
share a GPU):

1. both directions at once: every rank sends to the next and receives from the previous in one
   `batch_isend_irecv`, sizes from 4 B to 256 MiB, checked element by element;
2. a hazard the executor must order: rank 0 sends `x` on one stream and receives into the same
   `x` on another stream, with nothing ordering the two streams, while rank 1 receives on one and
   sends on the other. The communicator's order (the send first) is the only thing that keeps
   rank 1 from receiving the new data, as it is with NCCL. Repeated with large buffers, where a
   race shows.

    torchrun --nproc_per_node 2 tests/gpu/p2p_overlap.py
"""

import os
import sys

import torch
import torch.distributed as dist

import commd.torch  # noqa: F401

rank = int(os.environ["RANK"])
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("commd", device_id=dev)
world = dist.get_world_size()
nxt, prv = (rank + 1) % world, (rank - 1) % world
failures = []

# 1. Both directions at once.
for n in (1, 1000, 1 << 20, 16 << 20, 64 << 20):
    src = torch.arange(n, device=dev, dtype=torch.float32) + rank * 1e6
    out = torch.full((n,), -1.0, device=dev)
    for _ in range(3):
        ops = [dist.P2POp(dist.isend, src, nxt), dist.P2POp(dist.irecv, out, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        torch.cuda.synchronize()
        want = torch.arange(n, device=dev, dtype=torch.float32) + prv * 1e6
        if not torch.equal(out, want):
            bad = (out != want).nonzero()[:3].flatten().tolist()
            failures.append(f"ring n={n}: wrong at {bad}")
            break

# 2. A write-after-read hazard across unordered streams: the send of x must finish reading before
# the receive into x writes it.
if world >= 2 and rank < 2:
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    peer = 1 - rank
    for n in (1 << 20, 64 << 20):
        for it in range(4):
            old = torch.full((n,), 1000.0 + it, device=dev)
            new = torch.full((n,), -7.0 - it, device=dev)
            x = old.clone() if rank == 0 else torch.zeros(n, device=dev)
            torch.cuda.synchronize()
            if rank == 0:
                with torch.cuda.stream(s1):
                    w1 = dist.isend(x, peer)
                with torch.cuda.stream(s2):
                    w2 = dist.irecv(x, peer)
            else:
                with torch.cuda.stream(s1):
                    w1 = dist.irecv(x, peer)
                with torch.cuda.stream(s2):
                    w2 = dist.isend(new, peer)
            w1.wait()
            w2.wait()
            torch.cuda.synchronize()
            want = new if rank == 0 else old
            if not torch.equal(x, want):
                wrong = (x != want).sum().item()
                failures.append(f"hazard n={n} round {it}: rank {rank} has {wrong} wrong values")
                break

dist.barrier()
dist.destroy_process_group()
if failures:
    print(f"rank {rank}: {len(failures)} failures:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"rank {rank}: p2p overlap OK ({world} ranks)")
