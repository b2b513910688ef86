"""One rank (under torchrun, run as another user by tests/gpu/tenancy.py) all-reducing
$TENANCY_TENSORS CUDA tensors of 12 MiB, each its own allocation and so its own registration
with the daemon, kept alive: prints how many went through and the first refusal as JSON."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

import torchrun_env

rank, world, dev = torchrun_env.start()
held: list[torch.Tensor] = []
done, error = 0, None
for i in range(int(os.environ.get("TENANCY_TENSORS", "24"))):
    t = torch.full((3 << 20,), float(i + 1), device=dev)
    held.append(t)
    try:
        dist.all_reduce(t)
        torch.cuda.synchronize()
    except Exception as e:  # the refusal under test
        error = f"{type(e).__name__}: {e}"
        break
    if not bool((t == float((i + 1) * world)).all()):
        error = f"wrong values after all_reduce {i}"
        break
    done += 1
print(json.dumps({"rank": rank, "done": done, "error": error}), flush=True)
os._exit(0)  # the refused communicator is not shut down cleanly on purpose
