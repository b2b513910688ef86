"""GPU ops captured into CUDA graphs run correctly on every replay (docs/contracts.md #6).
torchrun, any number of ranks from 2, on any number of GPUs from 1 (ranks share GPUs when there
are fewer GPUs than ranks).

Without persistent ops, `dist.all_reduce(t)` inside `torch.cuda.graph(g)` would be accepted and
its replays would return stale data with no error. Here every GPU op and dtype of the backend,
through both of its paths (the native fast path and the general path: list outputs, send/recv
groups, async ops on the communication stream), is captured into its own graph; then every graph
is replayed many times, interleaved with each other and with eager ops on the same communicator,
with *new input data before every replay*, and each replay's outputs must equal the same op run
eagerly on the same inputs (bitwise: the same kernels run). A stale replay (one that skipped the
daemon) leaves the previous replay's result and fails. Also: many ops in one graph, a reduction
large enough for several scratch rounds, an all-reduce, broadcasts and reduces split into direct
ops (past the direct limit, each share within it; a reduce whose share is not runs in chunks: on
2 ranks direct reduces of at most the limit, on 3+ splits in the largest shares), graphs
replayed from two different streams, and a rank whose capture differs from its peers' (mismatch:
the first replay releases every rank and the next commd call raises the daemon's reason, naming
the fields; no hang, no wrong result taken as good).
Exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import commd.torch
import torchrun_env

rank, world, dev = torchrun_env.start()
assert world >= 2, "run with at least 2 ranks"
REPLAYS = int(os.environ.get("GRAPH_REPLAYS", "20"))
n = 1 << 14
failures: list[str] = []
peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world


def fill(ts: list[torch.Tensor], k: int) -> None:
    """New input data for replay ``k``: differs per rank, replay and element."""
    for j, t in enumerate(ts):
        v = torch.arange(t.numel(), device=dev, dtype=torch.float64)
        v = (v % 13) + (rank + 1) * 3 + k * 7 + j
        if t.dtype.is_floating_point:
            v = v / 4
        t.copy_(v.reshape(t.shape).to(t.dtype))


class Case:
    """One op: its inputs (refilled before each replay), outputs (compared), and ``run``,
    which issues the op on the given tensors."""

    def __init__(self, name, ins, outs, run):
        self.name, self.ins, self.outs, self.run = name, ins, outs, run

    def eager_reference(self, k: int) -> list[torch.Tensor]:
        ins = [torch.empty_like(t) for t in self.ins]
        fill(ins, k)
        outs = [torch.empty_like(t) for t in self.outs]
        # Outputs that are also inputs (in place) share storage in the case: map them.
        mapping = {id(a): b for a, b in zip(self.ins, ins)}
        outs = [mapping.get(id(o), b) for o, b in zip(self.outs, outs)]
        self.run(ins, outs)
        return [o.clone() for o in outs]


def cases() -> list[Case]:
    cs = []
    dts = [torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64]
    for dt in dts:
        x = torch.empty(n, device=dev, dtype=dt)
        cs.append(Case(f"all_reduce sum {dt}", [x], [x], lambda i, o: dist.all_reduce(i[0])))
    for op in [dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT]:
        x = torch.empty(n, device=dev)
        cs.append(Case(f"all_reduce {op}", [x], [x],
                       lambda i, o, op=op: dist.all_reduce(i[0], op=op)))
    x = torch.empty(n, device=dev)
    cs.append(Case("all_reduce async", [x], [x],
                   lambda i, o: dist.all_reduce(i[0], async_op=True).wait()))
    # Several scratch rounds (phases) per op: 8 Mi floats.
    big = torch.empty(8 << 20, device=dev)
    cs.append(Case("all_reduce 32 MiB", [big], [big], lambda i, o: dist.all_reduce(i[0])))
    # Past the direct limit with a share (1/world) within it: split into direct ops (a
    # reduce-scatter, an all-gather and, for the elements left over, an all-reduce).
    limit = torchrun_env.direct_limit(world, "COMMD_GRAPH_DIRECT_MAX_BYTES")
    split = torch.empty(world * (limit // 4) - 3, device=dev)
    cs.append(Case("all_reduce split into direct ops", [split], [split],
                   lambda i, o: dist.all_reduce(i[0])))
    # The largest shares (on 3+ ranks past the limit: 8 MiB on 4 ranks, a 32 MiB op).
    share = torchrun_env.split_share(world, "COMMD_GRAPH_DIRECT_MAX_BYTES")
    if share > limit:
        top = world * (share // 4)
        x = torch.empty(top - 3, device=dev)
        cs.append(Case("all_reduce split in the largest shares", [x], [x],
                       lambda i, o: dist.all_reduce(i[0])))
        x = torch.empty(top, device=dev)
        cs.append(Case(f"broadcast split in the largest shares, root {world - 1}", [x], [x],
                       lambda i, o: dist.broadcast(i[0], src=world - 1)))
        x = torch.empty(top + 1, device=dev)
        cs.append(Case(f"reduce split in the largest shares, root {world - 1}", [x], [x],
                       lambda i, o: dist.reduce(i[0], dst=world - 1)))
        # Past them a reduce runs in chunks, each split in the largest shares.
        x = torch.empty(2 * top + 7, device=dev)
        cs.append(Case("reduce in chunks of splits, root 1", [x], [x],
                       lambda i, o: dist.reduce(i[0], dst=1)))
    # Broadcast and reduce split the same way (a scatter from the root or a gather to it).
    for root in {0, world - 1}:
        x = torch.empty(world * (limit // 4) + 5, device=dev)
        cs.append(Case(f"broadcast split into direct ops, root {root}", [x], [x],
                       lambda i, o, root=root: dist.broadcast(i[0], src=root)))
        x = torch.empty(world * (limit // 2), device=dev, dtype=torch.bfloat16)
        cs.append(Case(f"reduce split into direct ops, root {root}", [x], [x],
                       lambda i, o, root=root: dist.reduce(i[0], dst=root)))
        # 3 x the limit and a bit: on 2 ranks direct reduces of the limit and a short last one.
        x = torch.empty(3 * (limit // 4) + 7, device=dev)
        cs.append(Case(f"reduce past the limit, root {root}", [x], [x],
                       lambda i, o, root=root: dist.reduce(i[0], dst=root)))
    for dt in [torch.float32, torch.bfloat16]:
        x = torch.empty(n, device=dev, dtype=dt)
        cs.append(Case(f"reduce {dt}", [x], [x], lambda i, o: dist.reduce(i[0], dst=0)))
        x = torch.empty(n, device=dev, dtype=dt)
        cs.append(Case(f"broadcast {dt}", [x], [x], lambda i, o: dist.broadcast(i[0], src=1)))
        x = torch.empty(n, device=dev, dtype=dt)
        y = torch.empty(n * world, device=dev, dtype=dt)
        cs.append(Case(f"all_gather_into_tensor {dt}", [x], [y],
                       lambda i, o: dist.all_gather_into_tensor(o[0], i[0])))
        x = torch.empty(n * world, device=dev, dtype=dt)
        y = torch.empty(n, device=dev, dtype=dt)
        cs.append(Case(f"reduce_scatter_tensor {dt}", [x], [y],
                       lambda i, o: dist.reduce_scatter_tensor(o[0], i[0])))
        x = torch.empty(n * world, device=dev, dtype=dt)
        y = torch.empty(n * world, device=dev, dtype=dt)
        cs.append(Case(f"all_to_all_single {dt}", [x], [y],
                       lambda i, o: dist.all_to_all_single(o[0], i[0])))
    x = torch.empty(n, device=dev)
    ys = [torch.empty(n, device=dev) for _ in range(world)]
    cs.append(Case("all_gather (list, general path)", [x], ys,
                   lambda i, o: dist.all_gather(o, i[0])))
    x = torch.empty(n, device=dev)
    r = torch.empty(n, device=dev)
    cs.append(Case("send/recv (batch_isend_irecv)", [x], [r], lambda i, o: [
        q.wait() for q in dist.batch_isend_irecv([
            dist.P2POp(dist.isend, i[0], peer_next), dist.P2POp(dist.irecv, o[0], peer_prev)])]))
    # torch's functional collectives (what torch.compile traces), out of place.
    import torch.distributed._functional_collectives as funcol
    x = torch.empty(n, device=dev)
    y = torch.empty(n, device=dev)
    cs.append(Case("functional all_reduce", [x], [y], lambda i, o: o[0].copy_(
        funcol.all_reduce(i[0], "sum", dist.group.WORLD))))
    # Many ops in one graph.
    xs = [torch.empty(4096 * (j + 1), device=dev) for j in range(10)]
    cs.append(Case("10 all_reduces in one graph", xs, xs,
                   lambda i, o: [dist.all_reduce(t) for t in i]))
    return cs


def warm(fn) -> None:
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize()


cs = cases()
graphs = []
for c in cs:
    fill(c.ins, 0)
    warm(lambda c=c: c.run(c.ins, c.outs))
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            c.run(c.ins, c.outs)
    except Exception as e:  # noqa: BLE001 - reported
        failures.append(f"{c.name}: capture failed: {e!r}")
        g = None
    graphs.append(g)
torch.cuda.synchronize()
# With a GPU per rank the captured all-reduces up to COMMD_GRAPH_DIRECT_MAX_BYTES run as direct
# ops (docs/contracts.md #7), with ranks sharing a GPU through the daemon
# (docs/contracts.md #6): the path is checked so a run meant for one cannot pass on the other.
path = commd.torch.graph_path()
gpu_each = torch.cuda.device_count() >= world
mode = os.environ.get("COMMD_GRAPH_DIRECT", "auto")
direct_on = mode not in ("0", "off")
if (path == "direct") != ((gpu_each or mode == "shared") and direct_on):
    failures.append(f"captured all-reduces took the path {path!r} with {torch.cuda.device_count()} "
                    f"GPU(s) for {world} ranks (COMMD_GRAPH_DIRECT={os.environ.get('COMMD_GRAPH_DIRECT')})")
if rank == 0:
    print(f"captured {sum(g is not None for g in graphs)}/{len(cs)} graphs; all-reduce path: "
          f"{path}", flush=True)

side = torch.cuda.Stream(device=dev)
t0 = time.perf_counter()
checked = 0
for k in range(1, REPLAYS + 1):
    # Every graph once per round, in an order that changes per round (the same on every rank),
    # with an eager op between graphs, and every third replay from a side stream.
    order = list(range(len(cs)))
    order = order[k % len(order):] + order[:k % len(order)]
    for idx in order:
        c, g = cs[idx], graphs[idx]
        if g is None:
            continue
        fill(c.ins, k)
        if (k + idx) % 3 == 0:
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                g.replay()
            torch.cuda.current_stream(dev).wait_stream(side)
        else:
            g.replay()
        got = [o.clone() for o in c.outs]
        want = c.eager_reference(k)
        torch.cuda.synchronize()
        for j, (a, b) in enumerate(zip(got, want)):
            if not torch.equal(a, b):
                bad = (a != b).nonzero()
                i0 = bad[0].tolist() if len(bad) else []
                failures.append(
                    f"{c.name}: replay {k}, output {j}: {len(bad)} elements differ from the "
                    f"eager result (first at {i0}: {a[tuple(i0)].item()} vs {b[tuple(i0)].item()})")
                break
        checked += 1
    if len(failures) > 20:
        break
dt = time.perf_counter() - t0
if rank == 0:
    print(f"{checked} replays checked against eager results in {dt:.1f} s", flush=True)

# A rank that captured a different op than its peers: the daemon matches the captures as they
# are posted and fails them as a mismatch. The capture may already raise (when the daemon's
# answer arrives before the capture ends); otherwise the first replay releases every rank's
# stream at once and the next check (or GPU op) raises the mismatch with its fields.
x = torch.ones(n * (2 if rank == 0 else 1), device=dev)
g = torch.cuda.CUDAGraph()
raised = None
released = 0.0
try:
    with torch.cuda.graph(g):
        dist.all_reduce(x)
except Exception as e:  # noqa: BLE001 - inspected
    raised = "at capture: " + str(e)
if raised is None:
    t = time.perf_counter()
    g.replay()
    torch.cuda.synchronize()
    released = time.perf_counter() - t
    try:
        commd.torch.check_graphs()
    except Exception as e:  # noqa: BLE001 - inspected
        raised = "after the replay: " + str(e)
if raised is None:
    failures.append("mismatched capture: no error raised")
elif "mismatch" not in raised or "count" not in raised:
    failures.append(f"mismatched capture: unclear error: {raised[:300]}")
elif rank == 0 or rank == 1:
    print(f"rank {rank}: mismatch released in {released * 1e3:.1f} ms, raised {raised[:260]}...",
          flush=True)
if released > 2.0:
    failures.append(f"mismatched capture: the replay took {released:.1f} s to be released")
del g
# The ranks are still in step: an eager op gives the right answer.
a = torch.full((n,), float(rank + 1), device=dev)
dist.all_reduce(a)
torch.cuda.synchronize()
want = float(sum(range(1, world + 1)))
if not bool((a == want).all()):
    failures.append(f"eager all_reduce after the mismatch gave {a[0].item()}, want {want}")

print(f"rank {rank}: {len(failures)} failures", flush=True)
for f in failures[:30]:
    print(f"rank {rank}: FAIL {f}", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
