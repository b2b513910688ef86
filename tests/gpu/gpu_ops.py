"""GPU test suite (run under torchrun on a GPU machine by scripts/gpu-check.sh).

Every rank runs every op and dtype through the ``commd`` backend and through NCCL on the same
random tensors (odd counts, in and out of place) and compares: exact for integers and data
movement, a tolerance for float reductions (the summation order differs). Then: the IPC handle
cache (one open per allocation across 100 ops and two communicators), a CUDA-stream ordering
check (no CPU sync between a producer kernel and the op), Work.wait() not blocking the CPU, and
more unwaited ops on torch's generic path than the session's ring holds.
Prints one line per check; exits non-zero on any failure.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import commd.torch  # registers the backend
import torchrun_env

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
# COMMD_NODE_SOCKETS=a.sock,b.sock: two daemons on this machine act as two nodes (contiguous
# blocks of ranks), so every op crosses "nodes" through host staging in the daemons.
SOCKS = [s for s in os.environ.get("COMMD_NODE_SOCKETS", "").split(",") if s]
if SOCKS:
    per = -(-world // len(SOCKS))
    os.environ["COMMD_SOCKET"] = SOCKS[min(rank // per, len(SOCKS) - 1)]
local = int(os.environ.get("LOCAL_RANK", rank))
torch.cuda.set_device(local)
dev = torch.device("cuda", local)
dist.init_process_group("commd", device_id=None)
cg = dist.group.WORLD
ng = dist.new_group(backend="nccl")
failures: list[str] = []
checks = 0

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64]
OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
       "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG, "band": dist.ReduceOp.BAND,
       "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}


def say(msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def rand(n: int, dt: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=dev)
    g.manual_seed(seed * 1000 + rank)
    if dt.is_floating_point:
        return torch.randn(n, generator=g, device=dev, dtype=torch.float32).to(dt)
    if dt == torch.uint8:
        return torch.randint(0, 4, (n,), generator=g, device=dev, dtype=dt)
    return torch.randint(-3, 4, (n,), generator=g, device=dev, dtype=dt)


def same(name: str, got: torch.Tensor, want: torch.Tensor, red: bool) -> None:
    global checks
    checks += 1
    if got.dtype.is_floating_point and red:
        tol = {torch.float16: 2e-2, torch.bfloat16: 1.5e-1, torch.float32: 1e-4,
               torch.float64: 1e-9}[got.dtype]
        ok = torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * world, equal_nan=True)
    else:
        ok = torch.equal(got, want)
    if not ok:
        diff = (got.float() - want.float()).abs()
        failures.append(f"{name}: rank {rank} mismatch (max diff {diff.max().item():.3g}, "
                        f"{int((diff > 0).sum())} elements differ)")


def valid(dt: torch.dtype, op: str) -> bool:
    if op in ("band", "bor", "bxor"):
        return not dt.is_floating_point
    if op == "prod" and dt in (torch.float16, torch.bfloat16):
        return True
    return True


def bitwise_ref(t: torch.Tensor, opn: str) -> torch.Tensor:
    """NCCL has no bitwise reductions: gather every rank's input over NCCL, reduce here."""
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t, group=ng)
    acc = parts[0].clone()
    f = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[opn]
    for p in parts[1:]:
        acc = f(acc, p)
    return acc


def both(fn, *args):
    """Runs fn(group, *cloned args) for commd and NCCL; returns the two results."""
    a = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
    b = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
    ra = fn(cg, *a)
    rb = fn(ng, *b)
    torch.cuda.synchronize()
    return ra, rb


counts = [1, 7, 1000, 1 << 20 | 3]
seed = 0
for dt in DTYPES:
    for n in counts:
        seed += 1
        x = rand(n, dt, seed)
        for opn, op in OPS.items():
            if not valid(dt, opn):
                continue
            if opn == "prod" and n > 1000:
                continue  # products overflow to inf/0 on large random inputs
            if opn == "avg" and not dt.is_floating_point:
                continue  # NCCL has no integer AVG
            if opn in ("band", "bor", "bxor"):
                y = x.clone()
                dist.all_reduce(y, op=op, group=cg)
                want = bitwise_ref(x, opn)
                torch.cuda.synchronize()
                same(f"all_reduce {dt} n={n} {opn}", y, want, False)
                big = rand(n * world, dt, seed + 77)
                out = torch.empty(n, dtype=dt, device=dev)
                dist.reduce_scatter_tensor(out, big, op=op, group=cg)
                want = bitwise_ref(big, opn)[rank * n:(rank + 1) * n]
                torch.cuda.synchronize()
                same(f"reduce_scatter {dt} n={n} {opn}", out, want, False)
                continue
            a, b = both(lambda g, t: (dist.all_reduce(t, op=op, group=g), t)[1], x)
            same(f"all_reduce {dt} n={n} {opn}", a, b, True)
            root = (seed % world)
            a, b = both(lambda g, t: (dist.reduce(t, root, op=op, group=g), t)[1], x)
            if rank == root:
                same(f"reduce {dt} n={n} {opn} root={root}", a, b, True)
            big = rand(n * world, dt, seed + 77)
            def rs(g, t):
                out = torch.empty(n, dtype=dt, device=dev)
                dist.reduce_scatter_tensor(out, t, op=op, group=g)
                return out
            a, b = both(rs, big)
            same(f"reduce_scatter {dt} n={n} {opn}", a, b, True)
        a, b = both(lambda g, t: (dist.broadcast(t, seed % world, group=g), t)[1], x)
        same(f"broadcast {dt} n={n}", a, b, False)
        def ag(g, t):
            out = torch.empty(n * world, dtype=dt, device=dev)
            dist.all_gather_into_tensor(out, t, group=g)
            return out
        a, b = both(ag, x)
        same(f"all_gather {dt} n={n}", a, b, False)
        def ag_list(g, t):
            outs = [torch.empty(n, dtype=dt, device=dev) for _ in range(world)]
            dist.all_gather(outs, t, group=g)
            return torch.cat(outs)
        a, b = both(ag_list, x)
        same(f"all_gather(list) {dt} n={n}", a, b, False)
        big = rand(n * world, dt, seed + 99)
        def a2a(g, t):
            out = torch.empty_like(t)
            dist.all_to_all_single(out, t, group=g)
            return out
        a, b = both(a2a, big)
        same(f"all_to_all {dt} n={n}", a, b, False)
        if world >= 2:
            def p2p(g, t):
                out = torch.zeros_like(t)
                peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
                ops = [dist.P2POp(dist.isend, t, peer_next, group=g),
                       dist.P2POp(dist.irecv, out, peer_prev, group=g)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                return out
            a, b = both(p2p, x)
            same(f"send/recv ring {dt} n={n}", a, b, False)
    say(f"dtype {dt}: done ({checks} checks so far, {len(failures)} failures)")

# Non-contiguous tensors and in-place variants.
x = rand(64 * 33, torch.float32, 5000).view(64, 33)[:, :32]
a, b = both(lambda g, t: (dist.all_reduce(t, group=g), t)[1], x)
same("all_reduce non-contiguous", a, b, True)

# Stream ordering: the producer kernel and the op are queued with no CPU sync between them.
for it in range(20):
    t = torch.empty(1 << 22, device=dev)
    t.fill_(float(rank + it))
    torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the fill is visible... then the op
    t.add_(1.0)
    dist.all_reduce(t, group=cg)
    want = sum(r + it + 1.0 for r in range(world))
    if t[::4096].ne(want).any().item():
        failures.append(f"stream ordering: iteration {it} saw stale data")
        break
checks += 1

# Work.wait() must not block the CPU: queue a long GPU sleep, then an async all_reduce.
t = torch.ones(1 << 20, device=dev)
torch.cuda.synchronize()
torch.cuda._sleep(500_000_000)  # ~0.3-0.5 s of GPU time
t0 = time.perf_counter()
w = dist.all_reduce(t, group=cg, async_op=True)
w.wait()
cpu = time.perf_counter() - t0
torch.cuda.synchronize()
if cpu > 0.1:
    failures.append(f"Work.wait() blocked the CPU for {cpu:.3f} s")
if not torch.all(t == world).item():
    failures.append("all_reduce after a GPU sleep gave wrong data")
checks += 1
say(f"Work.wait() returned after {cpu * 1e3:.2f} ms of CPU time while the GPU was busy")

if SOCKS:
    # Across nodes GPU ops are posted ahead of the streams, so they reach a daemon's net thread
    # while it runs the previous one: it once missed them and slept up to 1 s per op (~200 ms
    # per 1 MiB op). 50 ops take ~50 ms; the bound only catches stalls.
    t = torch.ones(1 << 18, device=dev)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        dist.all_reduce(t, group=cg)
    torch.cuda.synchronize()
    el = time.perf_counter() - t0
    checks += 1
    say(f"50 x 1 MiB all_reduce across nodes: {el * 1e3:.1f} ms")
    if el > 2.5:
        failures.append(f"50 all-reduces across nodes took {el:.2f} s (stalls between ops?)")
    if not torch.all(t == float(world) ** 50).item():
        failures.append("50 chained all-reduces across nodes gave wrong data")

# More ops on torch's generic GPU path (all_gather into a list) than a session's ring has
# entries (1024 by default), none waited for on the CPU: their Works only order streams. If
# their requests stayed counted as in flight, the 1025th call would wait forever in post
# (docs/design.md, "Sessions and the ring").
ring = 1024
t = torch.arange(16, device=dev, dtype=torch.float32) + 1000 * rank
outs = [torch.empty_like(t) for _ in range(world)]
t0 = time.perf_counter()
for _ in range(ring + 100):
    dist.all_gather(outs, t, group=cg)
torch.cuda.synchronize()
el = time.perf_counter() - t0
if not all(torch.equal(o, torch.arange(16, device=dev, dtype=torch.float32) + 1000 * r)
           for r, o in enumerate(outs)):
    failures.append("all_gather(list) after more calls than the ring holds: wrong data")
checks += 1
say(f"{ring + 100} all_gather(list) calls, none waited on the CPU: {el * 1e3:.1f} ms")

# all_to_all_single in place (the generic path: a copy of the input first) and out of place
# (the per-op path), each against what every rank sent.
for inplace in (False, True):
    t = torch.arange(world * 8, device=dev, dtype=torch.float32) + 1000 * rank
    o = t if inplace else torch.empty_like(t)
    dist.all_to_all_single(o, t, group=cg)
    want = torch.cat([torch.arange(rank * 8, rank * 8 + 8, device=dev, dtype=torch.float32)
                      + 1000 * r for r in range(world)])
    torch.cuda.synchronize()
    if not torch.equal(o, want):
        failures.append(f"all_to_all_single {'in place' if inplace else 'out of place'}: "
                        f"wrong data")
    checks += 1

# IPC handle cache: one open per allocation across 100 ops and two communicators.
pg = dist.distributed_c10d._get_default_group()
backend = pg if hasattr(pg, "client") else commd.torch.backend(pg)
client = backend.client._native
st0 = json.loads(client.status_json())
r0 = client.cuda_registration_stats()
# Small eager ops may run as direct ops (docs/design-gpu.md, direct collectives rule 8), which
# never reach the daemon or its cache: then an op past the largest direct one, and past the
# largest one split into direct ops (its share, 1/world of it, past the limit).
n_reg = 1 << 16
if not commd.torch.eager_path(cg).startswith("daemon"):
    n_reg = world * (max(torchrun_env.direct_limit(world), torchrun_env.split_share(world)) // 4) + 1024
t = torch.ones(n_reg, device=dev)
for _ in range(100):
    dist.all_reduce(t, group=cg)
torch.cuda.synchronize()
r1 = client.cuda_registration_stats()
cg2 = dist.new_group(backend="commd")
for _ in range(100):
    dist.all_reduce(t, group=cg2)
torch.cuda.synchronize()
r2 = client.cuda_registration_stats()
st2 = json.loads(client.status_json())
say(f"registrations/hits: start {r0}, after 100 ops {r1}, after 100 on a 2nd communicator {r2}")
say(f"daemon ipc_opens {st0['ipc_opens']} -> {st2['ipc_opens']}, hits {st2['ipc_cache_hits']}, "
    f"open time {st2['ipc_open_us']} us total")
if r1[0] - r0[0] > 1 or r2[0] != r1[0]:
    failures.append(f"registration cache: registrations went {r0[0]} -> {r1[0]} -> {r2[0]} "
                    "(expected at most one new, for the new tensor)")
if r2[1] - r1[1] < 100:
    failures.append(f"registration cache: only {r2[1] - r1[1]} hits in 100 ops")
checks += 1

dist.barrier(group=ng)
for f in failures[:50]:
    print("FAIL", f, flush=True)
print(f"rank {rank}: {checks} checks, {len(failures)} failures", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
