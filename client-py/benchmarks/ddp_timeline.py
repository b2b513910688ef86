"""Per-bucket timeline of DDP steps on CPU, gloo then "commd", on the model of ddp_overlap.py
(whose arguments it takes). For the median step of every rank: when each gradient bucket's
all-reduce was issued (on rank 0, and on the last rank to issue it) and when it was done (rank
0), counted from the step's start, and when backward returned. A step that waits on
communication shows buckets done long after their last rank issued them; one bound by compute
or by skew between ranks shows them done soon after.

    torchrun --nproc_per_node 4 client-py/benchmarks/ddp_timeline.py --device cpu --threads 4 \\
        --layers 4 --dim 1024 --vocab 8192 --batch 1 --seq 32 --steps 6 --warmup 3

With --json, rank 0 appends one line per backend (the same numbers).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import bench_common as bc  # noqa: E402
import ddp_overlap as dd  # noqa: E402


def timed_hook(pg: Any, world: int, events: list) -> Any:
    """DDP's all-reduce-and-average of a bucket on `pg`, noting (bucket, issued, done, bytes)."""
    # (no annotations: DDP checks a hook's, and wants dist.GradBucket objects there)
    def hook(_state, bucket):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        buf = bucket.buffer()
        fut = dist.all_reduce(buf, group=pg, async_op=True).get_future()

        def done(_f: torch.futures.Future) -> torch.Tensor:
            events.append((bucket.index(), t, time.perf_counter(), buf.numel() * buf.element_size()))
            return buf.div_(world)
        return fut.then(done)
    return hook


def run(a: Any, pg: Any, world: int, tokens: torch.Tensor, barrier: Any) -> dict:
    """The median step of this rank on `pg`: its times (ms) and its buckets' timeline."""
    events: list = []
    m = DDP(dd.Decoder(a), process_group=pg)
    m.register_comm_hook(None, timed_hook(pg, world, events))
    opt = torch.optim.SGD(m.parameters(), lr=a.lr)
    steps = []
    for s in range(a.warmup + a.steps):
        events.clear()
        dist.barrier(group=barrier)
        t0 = time.perf_counter()
        m(tokens).float().square().mean().backward()
        tb = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        te = time.perf_counter()
        if s >= a.warmup:
            buckets = [{"bucket": i, "issued_ms": (ti - t0) * 1e3, "done_ms": (tc - t0) * 1e3,
                        "bytes": nb} for i, ti, tc, nb in sorted(events, key=lambda e: e[1])]
            steps.append({"step_ms": (te - t0) * 1e3, "backward_ms": (tb - t0) * 1e3,
                          "buckets": buckets})
    return sorted(steps, key=lambda x: x["step_ms"])[len(steps) // 2]


def report(name: str, every: list[dict]) -> dict:
    first = every[0]
    out = {"backend": name, "step_ms": [e["step_ms"] for e in every],
           "backward_ms": [e["backward_ms"] for e in every], "buckets": []}
    print(f"{name}: median step per rank " + " ".join(f"{x:.0f}" for x in out["step_ms"])
          + " ms; backward returned " + " ".join(f"{x:.0f}" for x in out["backward_ms"]))
    for k, b in enumerate(first["buckets"]):
        last = max(e["buckets"][k]["issued_ms"] for e in every if len(e["buckets"]) > k)
        row = dict(b, last_issued_ms=last)
        out["buckets"].append(row)
        print(f"   bucket {b['bucket']} {b['bytes'] / 2**20:6.1f} MiB: issued {b['issued_ms']:7.1f} "
              f"(last rank {last:7.1f}), done {b['done_ms']:7.1f} ms (rank 0)")
    return out


def main() -> None:
    a = dd.parse(sys.argv[1:])
    if a.device != "cpu":
        raise SystemExit("ddp_timeline.py runs on CPU (--device cpu)")
    rank, world, _dev, groups, _info, _say = bc.start_vs_gloo("ddp_timeline.py", a.threads)
    torch.manual_seed(0)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq))
    # gloo first: the first model built runs its first steps slower, whichever backend it uses.
    for name in ("gloo", "commd"):
        mine = run(a, groups[name], world, tokens, groups["gloo"])
        every: list = [None] * world
        dist.all_gather_object(every, mine, group=groups["gloo"])
        if rank == 0:
            out = report(name, every)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(dict(out, bench="ddp_timeline", world=world)) + "\n")
    dist.barrier(group=groups["gloo"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
