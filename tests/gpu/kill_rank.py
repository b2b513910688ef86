"""A rank dies mid-op: the others must get an error naming it, and their GPU streams must not
hang (run under torchrun by scripts/gpu-check.sh; the last rank exits right after posting)."""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import commd.torch  # noqa: F401

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
dist.init_process_group("commd")
t = torch.ones(1 << 24, device="cuda")
dist.all_reduce(t)  # a healthy op first
torch.cuda.synchronize()
victim = world - 1
if rank == victim:
    # The stream is busy (~3 s) so the op is posted but not ready when the process dies, and the
    # process is SIGKILLed: no teardown of its own. (os._exit after a ~1 s sleep raced: the op
    # then sometimes ran to its end, with the victim's data, before the daemon saw the exit.)
    torch.cuda._sleep(6_000_000_000)
    dist.all_reduce(t, async_op=True)
    os.kill(os.getpid(), signal.SIGKILL)
w = dist.all_reduce(t, async_op=True)
w.wait()
t0 = time.perf_counter()
torch.cuda.synchronize()  # must not hang: the daemon releases the stream on failure
sync_s = time.perf_counter() - t0
deadline = time.time() + 20
while not w.is_completed() and time.time() < deadline:
    time.sleep(0.01)
err = w.exception() if w.is_completed() else None
ok = err is not None and f"rank {victim}" in str(err)
print(f"rank {rank}: stream released after {sync_s:.3f} s; error: {err!r}", flush=True)
print(("PASS" if ok else "FAIL") + f" kill_rank rank {rank}", flush=True)
os._exit(0 if ok else 1)
