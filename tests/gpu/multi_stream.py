"""Ops of one communicator issued on several streams that nothing orders (scripts/gpu-check.sh
tests; 2+ ranks, which may share a GPU). FSDP does this: its all-gathers run on its unshard
stream, its reduce-scatters on its post-backward stream, and a job's async all-reduce on the
backend's communication stream. With one ready counter shared by those ops, a later op's write
could land before an earlier one's, and the job would hang.

Each round: on stream A a ~1 ms sleep kernel, then a fill of A's input, then a blocking
all_gather (on A, the current stream); on stream B, issued after A's op, a reduce_scatter that
is ready at once; then an async all_reduce on the current stream. The daemon must not start A's
op before A's stream reaches it (A's result would hold the old contents) and B's op must not be
lost (a hang: the group's timeout is 60 s). Every result is checked.

    torchrun --nproc_per_node 2 tests/gpu/multi_stream.py
    MS_BACKEND=nccl ... (torch's NCCL backend: real NCCL, or commd's library preloaded)
"""

import datetime
import os
import sys

import torch
import torch.distributed as dist

BACKEND = os.environ.get("MS_BACKEND", "commd")
if BACKEND == "commd":
    import commd.torch  # noqa: F401

rank = int(os.environ["RANK"])
dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group(BACKEND, device_id=dev, timeout=datetime.timedelta(seconds=60))
world = dist.get_world_size()
sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
failures = []
rounds = int(os.environ.get("MS_ROUNDS", "40"))
for it in range(rounds):
    n = (1 << 16) * (1 + it % 4)
    xa = torch.full((n,), -1.0, device=dev)
    ga = torch.empty(n * world, device=dev)
    xb = torch.full((n * world,), float(rank + 1 + it), device=dev)
    rb = torch.empty(n, device=dev)
    xc = torch.full((n,), float(rank), device=dev)
    torch.cuda.synchronize()
    with torch.cuda.stream(sa):
        torch.cuda._sleep(1_000_000)  # A's stream reaches its op late
        xa.fill_(float(it * 100 + rank))
        dist.all_gather_into_tensor(ga, xa)
    with torch.cuda.stream(sb):
        dist.reduce_scatter_tensor(rb, xb)
    w = dist.all_reduce(xc, async_op=True)
    w.wait()
    torch.cuda.synchronize()
    want_a = torch.cat([torch.full((n,), float(it * 100 + r), device=dev) for r in range(world)])
    want_b = float(sum(r + 1 + it for r in range(world)))
    want_c = float(sum(range(world)))
    if not torch.equal(ga, want_a):
        stale = (ga == -1.0).sum().item()
        failures.append(f"round {it}: all_gather on stream A wrong ({stale} stale values)")
    if not torch.all(rb == want_b):
        failures.append(f"round {it}: reduce_scatter on stream B wrong")
    if not torch.all(xc == want_c):
        failures.append(f"round {it}: async all_reduce wrong")
    if len(failures) > 5:
        break

dist.barrier()
dist.destroy_process_group()
if failures:
    print(f"rank {rank} ({BACKEND}): {len(failures)} failures:\n  " + "\n  ".join(failures))
    sys.exit(1)
print(f"rank {rank} ({BACKEND}): {rounds} rounds on three unordered streams OK ({world} ranks)")
