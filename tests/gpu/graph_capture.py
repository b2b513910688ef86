"""GPU ops under CUDA graph capture are refused with a clear error, never captured wrongly
(DESIGN.md contract 6; issue 28). torchrun, any number of ranks from 2, on any number of GPUs
from 1 (ranks share GPUs when there are fewer GPUs than ranks).

Before this check, `dist.all_reduce(t)` inside `torch.cuda.graph(g)` was accepted, and replays
returned stale data with no error (8.0 where 16.0 was right after three replays). Now every GPU
op the backend has, through both of its paths (the native fast path and the general path), and
the wait of a send/recv group, raise `commd.UnsupportedError` at capture; nothing is enqueued or
posted, so the capture ends cleanly and the ranks stay in step: an eager op after each refusal
must give the right answer. A replay of whatever was captured must not change any tensor.
Exits non-zero on any failure.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import commd
import torchrun_env

rank, world, dev = torchrun_env.start()
assert world >= 2, "run with at least 2 ranks"
n = 1 << 16
failures = []


def chain(e: BaseException):
    while e is not None:
        yield e
        e = e.__cause__ or e.__context__


def ops():
    """(name, fn) for every GPU op, each allocating its tensors up front (outside capture)."""
    x = torch.full((n,), float(rank + 1), device=dev)
    big = torch.empty(n * world, device=dev)
    out = torch.empty(n, device=dev)
    lst = [torch.empty(n, device=dev) for _ in range(world)]
    peer_next, peer_prev = (rank + 1) % world, (rank - 1) % world
    rcv = torch.empty(n, device=dev)
    return [
        ("all_reduce", lambda: dist.all_reduce(x)),
        ("all_reduce async", lambda: dist.all_reduce(x, async_op=True).wait()),
        ("all_reduce bf16", lambda: dist.all_reduce(x.to(torch.bfloat16))),
        ("reduce", lambda: dist.reduce(x, dst=0)),
        ("broadcast", lambda: dist.broadcast(x, src=0)),
        ("all_gather_into_tensor", lambda: dist.all_gather_into_tensor(big, x)),
        ("all_gather (list)", lambda: dist.all_gather(lst, x)),
        ("reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(out, big)),
        ("all_to_all_single", lambda: dist.all_to_all_single(big.clone(), big)),
        ("send/recv group", lambda: [q.wait() for q in dist.batch_isend_irecv([
            dist.P2POp(dist.isend, x, peer_next), dist.P2POp(dist.irecv, rcv, peer_prev)])]),
    ], (x, big, out, rcv)


def eager_check(tag: str) -> None:
    """An eager all_reduce right after: the ranks are still in step and nothing stale is
    pending in the daemon."""
    a = torch.full((n,), float(rank + 1), device=dev)
    dist.all_reduce(a)
    torch.cuda.synchronize()
    want = float(sum(range(1, world + 1)))
    if not bool((a == want).all()):
        failures.append(f"{tag}: eager all_reduce after the refusal gave {a[0].item()}, want {want}")


for name, fn in ops()[0]:
    # Warm up on a side stream first, as torch.cuda.graph users must (allocations, kernels).
    s = torch.cuda.Stream(device=dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream(dev).wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    err = None
    try:
        with torch.cuda.graph(g):
            fn()
    except Exception as e:  # noqa: BLE001 - the chain is inspected below
        err = e
    if torch.cuda.is_current_stream_capturing():
        failures.append(f"{name}: the stream is still capturing after the refusal")
    refused = [e for e in chain(err)] if err is not None else []
    hit = [e for e in refused if isinstance(e, commd.UnsupportedError)]
    if not hit:
        failures.append(f"{name}: captured without commd.UnsupportedError (got {err!r})")
    elif "CUDA graph" not in str(hit[0]) or "refused" not in str(hit[0]):
        failures.append(f"{name}: unclear message: {hit[0]}")
    elif rank == 0:
        print(f"{name}: refused: {str(hit[0])[:160]}...", flush=True)
    eager_check(name)

# A graph captured with an eager op's work around it replays without touching commd state:
# a capture that refuses must leave nothing that a replay could run.
x = torch.full((n,), float(rank + 1), device=dev)
g = torch.cuda.CUDAGraph()
try:
    with torch.cuda.graph(g):
        x.mul_(2)
        dist.all_reduce(x)
except Exception:  # noqa: BLE001
    pass
else:
    failures.append("mul + all_reduce: captured without error")
eager_check("after the mixed capture")

print(f"rank {rank}: {len(failures)} failures", flush=True)
for f in failures:
    print(f"rank {rank}: FAIL {f}", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
