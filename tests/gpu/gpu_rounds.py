"""GPU reductions in many rounds, and back-to-back without a CPU sync (torchrun; scripts/gpu-check.sh).

Run against a daemon with a small scratch (`--set gpu_scratch_slot_bytes=65536`) so that ordinary
sizes need many rounds: the daemon then fills one scratch buffer while the client's kernel still
reduces the other, and issues a round's copies one phase ahead. What can go wrong there is a
copy landing in a buffer that a kernel still reads, or a round's result pushed out before it is
reduced: both show up as wrong numbers, so every result is compared with NCCL's on the same
inputs. `COMMD_ALLREDUCE_ALGO` (auto, oneshot, rsag) picks the all-reduce algorithm for the
whole process; the script says which one ran. Exits non-zero on any mismatch.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import torchrun_env

rank, world, dev = torchrun_env.start()
cg = dist.group.WORLD
ng = dist.new_group(backend="nccl")
failures: list[str] = []
checks = 0
algo = os.environ.get("COMMD_ALLREDUCE_ALGO", "auto")


def rand(n: int, dt: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=dev)
    g.manual_seed(seed * 7919 + rank)
    if dt.is_floating_point:
        return torch.randn(n, generator=g, device=dev, dtype=torch.float32).to(dt)
    return torch.randint(-1000, 1000, (n,), generator=g, device=dev, dtype=dt)


def same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    global checks
    checks += 1
    if got.dtype.is_floating_point:
        tol = {torch.bfloat16: 1.5e-1, torch.float16: 2e-2}.get(got.dtype, 1e-4)
        bad = ~torch.isclose(got.float(), want.float(), rtol=tol, atol=tol)
    else:
        bad = got != want
    nbad = int(bad.sum().item())
    if nbad:
        i = int(bad.nonzero()[0].item())
        failures.append(f"{name}: {nbad} of {got.numel()} differ, first at {i}: "
                        f"{got[i].item()} vs {want[i].item()}")


# Element counts: below one slot, exactly at round boundaries, many rounds, odd.
slot_elems_f32 = 65536 // 4
counts = [1, 1000, slot_elems_f32 - 1, slot_elems_f32 * world, slot_elems_f32 * world + 1,
          1 << 20 | 5, (3 << 20) + 7]
seed = 0
for dt in (torch.float32, torch.bfloat16, torch.int32):
    for n in counts:
        for opn, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX),
                        ("avg", dist.ReduceOp.AVG)):
            if opn == "avg" and not dt.is_floating_point:
                continue
            seed += 1
            x = rand(n, dt, seed)
            # in place
            a, b = x.clone(), x.clone()
            dist.all_reduce(a, op=op, group=cg)
            dist.all_reduce(b, op=op, group=ng)
            # out of place (reduce_scatter / reduce) on the same inputs
            big = rand(n * world, dt, seed + 1)
            ra, rb = torch.empty(n, dtype=dt, device=dev), torch.empty(n, dtype=dt, device=dev)
            dist.reduce_scatter_tensor(ra, big, op=op, group=cg)
            dist.reduce_scatter_tensor(rb, big, op=op, group=ng)
            root = seed % world
            ca, cb = x.clone(), x.clone()
            dist.reduce(ca, root, op=op, group=cg)
            dist.reduce(cb, root, op=op, group=ng)
            torch.cuda.synchronize()
            same(f"all_reduce {dt} n={n} {opn}", a, b)
            same(f"reduce_scatter {dt} n={n} {opn}", ra, rb)
            if rank == root:
                same(f"reduce {dt} n={n} {opn} root={root}", ca, cb)
    if rank == 0:
        print(f"{dt}: {checks} checks, {len(failures)} failures", flush=True)

# Back to back: 24 all-reduces of different tensors queued with no sync between them (each op's
# first rounds reuse the scratch the previous op's last kernels read), then all compared.
for n in (slot_elems_f32 * world * 3 + 11, 70_001, 5):
    xs = [rand(n, torch.float32, 10_000 + i) for i in range(24)]
    mine = [x.clone() for x in xs]
    ref = [x.clone() for x in xs]
    for t in mine:
        dist.all_reduce(t, group=cg)
    for t in ref:
        dist.all_reduce(t, group=ng)
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(mine, ref)):
        same(f"back-to-back all_reduce #{i} n={n}", a, b)
    # async ops on the communication stream, waited at the end
    mine = [x.clone() for x in xs]
    works = [dist.all_reduce(t, group=cg, async_op=True) for t in mine]
    for w in works:
        w.wait()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(mine, ref)):
        same(f"back-to-back async all_reduce #{i} n={n}", a, b)

dist.barrier(group=ng)
for f in failures[:50]:
    print("FAIL", f, flush=True)
print(f"rank {rank} (algo {algo}): {checks} checks, {len(failures)} failures", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
