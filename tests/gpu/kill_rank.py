"""A rank dies: the others must get an error naming it, and their GPU streams must not hang.

Run by tests/gpu/kill_rank.sh (two ranks without torchrun, which would tear the survivor down as
soon as the victim dies). After a healthy op, the victim is SIGKILLed before it posts the next
all-reduce, while the survivor's all-reduce is posted and its stream waits for the victim: the
survivor's op must fail with an error naming rank 1, and its stream must be released.

(Killing the victim *after* it posted is not a deterministic failure: the driver runs work
already queued on a dead process's streams to its end before the process is gone - seen on
H200s with a 3 s stream sleep before the op, SIGKILL included - so that op completes, with the
victim's data, and the survivor correctly sees no error. The check below covers that case too:
if the op completes, its result must be right.)
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import commd.torch  # noqa: F401

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
# COMMD_NODE_SOCKETS=a.sock,b.sock: the ranks on two daemons acting as nodes (host staging).
SOCKS = [s for s in os.environ.get("COMMD_NODE_SOCKETS", "").split(",") if s]
if SOCKS:
    os.environ["COMMD_SOCKET"] = SOCKS[min(rank * len(SOCKS) // world, len(SOCKS) - 1)]
# Ranks share the GPUs there are (one GPU: all of them on it).
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
dist.init_process_group("commd")
# KILL_RANK_ELEMS: a small op takes the eager direct path under COMMD_EAGER_DIRECT=auto.
t = torch.ones(int(os.environ.get("KILL_RANK_ELEMS", 1 << 24)), device="cuda")
dist.all_reduce(t)  # a healthy op first
torch.cuda.synchronize()
ok_first = bool(torch.all(t == world).item())
victim = world - 1
if rank == victim:
    time.sleep(1.0)  # the survivor posts and waits meanwhile
    os.kill(os.getpid(), signal.SIGKILL)
t.fill_(1.0)
w = dist.all_reduce(t, async_op=True)
w.wait()
t0 = time.perf_counter()
torch.cuda.synchronize()  # must not hang: the daemon releases the stream on failure
sync_s = time.perf_counter() - t0
deadline = time.time() + 20
while not w.is_completed() and time.time() < deadline:
    time.sleep(0.01)
err = None
if w.is_completed():
    # The op's error, as wait() raises it (Work.exception() of the C++ shell's Work returns a
    # std::exception_ptr that Python cannot convert).
    try:
        w.wait()
    except Exception as e:  # noqa: BLE001 - whatever the backend raised is the finding
        err = e
ok = ok_first and err is not None and f"rank {victim}" in str(err)
print(f"rank {rank}: stream released after {sync_s:.3f} s; error: {err!r}", flush=True)
print(("PASS" if ok else "FAIL") + f" kill_rank rank {rank}", flush=True)
os._exit(0 if ok else 1)
