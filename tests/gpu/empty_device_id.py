"""What DeepSpeed does on CUDA before its first step, with the "commd" backend
(scripts/gpu-check.sh tests and deepspeed): `init_process_group(..., device_id=...)` (torch
asks the group for its backend of that device), a `new_group` after it (of every rank, and of
rank 0 alone: the others call perform_nocolor_split), and collectives on
zero-element CUDA tensors (ZeRO-3 broadcasts an empty list on its first step), synchronous and
async, then ops with data to check that the communicator is intact. Ranks may share a GPU.

    torchrun --nproc_per_node 2 tests/gpu/empty_device_id.py
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
sub = dist.new_group(list(range(world)))
failures = []
# A group of rank 0 alone: torch has the other ranks call the bound device's backend's
# perform_nocolor_split; they must go on (not die of an AttributeError).
solo = dist.new_group([0])
if rank == 0:
    # Every op on a group of one (DeepSpeed's groups of one rank when a parallel degree is 1;
    # before, a GPU op there panicked dividing by zero in the direct limits).
    one = torch.full((4,), 3.0, device=dev)
    dist.all_reduce(one, group=solo)
    dist.broadcast(one, 0, group=solo)
    dist.reduce(one, 0, group=solo)
    g1 = torch.empty(4, device=dev)
    dist.all_gather_into_tensor(g1, one, group=solo)
    r1 = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(r1, one, group=solo)
    a1 = torch.empty(4, device=dev)
    dist.all_to_all_single(a1, one, group=solo)
    lst = [torch.empty(4, device=dev)]
    dist.all_gather(lst, one, group=solo)
    w = dist.all_reduce(one, group=solo, async_op=True)
    w.wait()
    dist.barrier(group=solo)
    torch.cuda.synchronize()
    for name, x in (("all_reduce", one), ("all_gather", g1), ("reduce_scatter", r1),
                    ("all_to_all", a1), ("all_gather list", lst[0])):
        if not x.eq(3.0).all():
            failures.append(f"{name} on a group of rank 0 alone: {x.tolist()}")
elif solo != dist.GroupMember.NON_GROUP_MEMBER:
    failures.append(f"rank {rank} outside new_group([0]) got {solo}")
# split_group from the bound default group (torch splits its backends; the "commd" one serves
# both device types and must make each child once): even and odd ranks.
if hasattr(dist, "split_group"):
    halves = [list(range(0, world, 2)), list(range(1, world, 2))]
    sg = dist.split_group(split_ranks=[h for h in halves if h])
    mine = halves[rank % 2]
    v = torch.full((8,), float(rank), device=dev)
    dist.all_reduce(v, group=sg)
    c = torch.full((8,), 1.0)
    dist.all_reduce(c, group=sg)
    torch.cuda.synchronize()
    if not v.eq(float(sum(mine))).all() or not c.eq(float(len(mine))).all():
        failures.append(f"split_group: GPU {v.tolist()[:2]}, CPU {c.tolist()[:2]}, ranks {mine}")


def e(dt=torch.int64):
    return torch.zeros(0, dtype=dt, device=dev)


for g in (None, sub):
    for async_op in (False, True):
        works = [
            dist.broadcast(e(), 0, group=g, async_op=async_op),
            dist.all_reduce(e(torch.float32), group=g, async_op=async_op),
            dist.reduce(e(), 0, group=g, async_op=async_op),
            dist.all_gather_into_tensor(e(), e(), group=g, async_op=async_op),
            dist.all_gather([e() for _ in range(world)], e(), group=g, async_op=async_op),
            dist.reduce_scatter_tensor(e(), e(), group=g, async_op=async_op),
            dist.all_to_all_single(e(), e(), group=g, async_op=async_op),
        ]
        for w in works:
            if w is not None:
                w.wait()
reqs = [dist.P2POp(dist.isend, e(), (rank + 1) % world),
        dist.P2POp(dist.irecv, e(), (rank - 1) % world),
        dist.P2POp(dist.isend, torch.full((5,), float(rank), device=dev), (rank + 1) % world)]
got = torch.zeros(5, device=dev)
reqs.append(dist.P2POp(dist.irecv, got, (rank - 1) % world))
for r in dist.batch_isend_irecv(reqs):
    r.wait()
torch.cuda.synchronize()
if not got.eq(float((rank - 1) % world)).all():
    failures.append(f"send/recv beside empty ones: got {got.tolist()}")
for g in (None, sub):
    t = torch.full((1000,), float(rank + 1), device=dev)
    dist.all_reduce(t, group=g)
    lst = torch.tensor([7, 8, 9] if rank == 0 else [-1, -1, -1], device=dev)
    dist.broadcast(lst, 0, group=g)
    torch.cuda.synchronize()
    if not t.eq(world * (world + 1) / 2).all():
        failures.append(f"all_reduce after empty ops: {t[:4].tolist()}")
    if lst.tolist() != [7, 8, 9]:
        failures.append(f"broadcast after empty ops: {lst.tolist()}")
for f in failures:
    print("FAIL", f, flush=True)
print(f"rank {rank}: empty tensors and device_id: {len(failures)} failures", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
