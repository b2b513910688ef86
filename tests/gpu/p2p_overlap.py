"""Send/recv jobs of one communicator that run at the same time in the daemon's GPU executor
(cuda/executor.rs `beside`), and the ones that must not (scripts/gpu-check.sh tests; 2+ ranks, which may
share a GPU):

1. both directions at once: every rank sends to the next and receives from the previous in one
   `batch_isend_irecv`, sizes from 4 B to 256 MiB, checked element by element;
2. a hazard the executor must order: rank 0 sends `x` on one stream and receives into the same
   `x` on another stream, with nothing ordering the two streams, while rank 1 receives on one and
   sends on the other. The communicator's order (the send first) is the only thing that keeps
   rank 1 from receiving the new data, as it is with NCCL. Repeated with large buffers, where a
   race shows;
3. (3+ ranks) a ring of send/recv groups that the daemon matches out of order: the last rank
   posts late, so each other rank's next groups are matched before the late rank's first, while
   their streams wait at their first group's end for the late rank. The executor must run the
   late rank's jobs queued behind ones that cannot start yet (it once waited for those: a hang
   until the op timeout, as in nccl-tests' sendrecv and gather on 4 GPUs);
4. (4 or 8 ranks) a hypercube all-gather, whose rounds read what earlier rounds received, with
   one rank late: the daemon must run jobs in each rank's program order, not in the order it
   matched them (as nccl-tests' hypercube).

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

# 3. A ring matched out of order: the last rank posts its groups a second late; every group
# receives into a buffer of its own, so nothing orders the groups but their streams.
if world >= 3:
    import time

    rounds, n = 4, 1 << 16
    src = [torch.arange(n, device=dev, dtype=torch.float32) + rank * 1e6 + k for k in range(rounds)]
    outs = [torch.full((n,), -1.0, device=dev) for _ in range(rounds)]
    torch.cuda.synchronize()
    dist.barrier()
    if rank == world - 1:
        time.sleep(1.0)
    for k in range(rounds):
        ops = [dist.P2POp(dist.isend, src[k], nxt), dist.P2POp(dist.irecv, outs[k], prv)]
        # The stream waits here for the round (as at an ncclGroupEnd); the CPU goes on.
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    torch.cuda.synchronize()
    for k in range(rounds):
        want = torch.arange(n, device=dev, dtype=torch.float32) + prv * 1e6 + k
        if not torch.equal(outs[k], want):
            failures.append(f"late ring round {k}: {(outs[k] != want).sum().item()} wrong values")

# 4. (4, 8.. ranks) nccl-tests' hypercube all-gather: round `mask` sends the blocks gathered so far
# (received in earlier rounds, on this rank's stream) to rank ^ mask. Rank 1 posts late, so
# rank 0's round-2 send is matched before rank 1's round-1 send to rank 0 that writes the blocks
# it reads: the executor must run the later-queued job first (its program order on rank 0).
if world >= 4 and world & (world - 1) == 0:
    import time

    n = 1 << 16
    blocks = torch.full((world * n,), -1.0, device=dev)
    blocks[rank * n:(rank + 1) * n] = torch.arange(n, device=dev, dtype=torch.float32) + rank * 1e6
    torch.cuda.synchronize()
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
    mask = 1
    while mask < world:
        s = rank & ~(mask - 1)
        r = s ^ mask
        ops = [dist.P2POp(dist.isend, blocks[s * n:(s + mask) * n], rank ^ mask),
               dist.P2POp(dist.irecv, blocks[r * n:(r + mask) * n], rank ^ mask)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        mask <<= 1
    torch.cuda.synchronize()
    for j in range(world):
        want = torch.arange(n, device=dev, dtype=torch.float32) + j * 1e6
        if not torch.equal(blocks[j * n:(j + 1) * n], want):
            failures.append(f"hypercube: block {j} has {(blocks[j * n:(j + 1) * n] != want).sum().item()} wrong values")

dist.barrier()
dist.destroy_process_group()
if failures:
    print(f"rank {rank}: {len(failures)} failures:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"rank {rank}: p2p overlap OK ({world} ranks)")
