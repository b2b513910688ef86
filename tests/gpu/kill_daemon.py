"""A daemon killed while a GPU op waits on its doorbell: the job's stream is released, not
wedged, and the next commd call raises (docs/contracts.md #5, done by the client's watchdog for
a daemon that can no longer do it). torchrun with 2 ranks on any number of GPUs from 1;
COMMD_TEST_DAEMON_PID names the daemon to kill. Exits non-zero on a failure.

Rank 1 never posts its second all_reduce, so rank 0's stream waits on the doorbell; rank 0 then
SIGKILLs the daemon and synchronizes its device: before the watchdog that synchronize never
returned.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

import torchrun_env

rank, world, dev = torchrun_env.start()
pid = int(os.environ["COMMD_TEST_DAEMON_PID"])
x = torch.ones(1 << 20, device=dev)
dist.all_reduce(x)
torch.cuda.synchronize()
ok = bool((x == world).all())
if rank == 1:
    time.sleep(8)  # never posts the second op; its session dies with the daemon
    os._exit(0)
failures = [] if ok else ["first all_reduce wrong"]
dist.all_reduce(x)  # rank 1 never joins it: the stream waits on the doorbell
ev = torch.cuda.Event()
ev.record()
time.sleep(0.5)
if ev.query():
    print("rank 0: FAIL the stream did not wait for the unmatched all_reduce", flush=True)
    os._exit(1)
os.kill(pid, signal.SIGKILL)
t0 = time.monotonic()
done = threading.Event()


def sync():
    torch.cuda.synchronize()
    done.set()


threading.Thread(target=sync, daemon=True).start()
if not done.wait(20):
    print("rank 0: FAIL the stream stayed blocked 20 s after the daemon was killed", flush=True)
    os._exit(1)
print(f"rank 0: stream released {time.monotonic() - t0:.2f} s after the daemon was killed",
      flush=True)
try:
    dist.all_reduce(x)
    torch.cuda.synchronize()
    failures.append("an op after the daemon died did not raise")
except Exception as e:  # noqa: BLE001
    print(f"rank 0: next op raised {type(e).__name__}: {str(e)[:200]}", flush=True)
print(f"rank 0: {len(failures)} failures {failures}", flush=True)
os._exit(1 if failures else 0)
