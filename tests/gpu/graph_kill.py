"""A rank dies while its peers replay a CUDA graph holding commd ops: the survivors' replays
must be released (no hang) within 2 s with the error raised by the next check, naming the lost
rank; later replays of the same graph fail at once, never run with a partner missing. Then a
graph destroyed on every rank releases what its ops held in the daemon: more captures than there
are graph doorbell slots (16384) must all succeed when each graph is destroyed before the next.

Run by `tests/gpu/kill_rank.sh tests/gpu/graph_kill.py`: two ranks without torchrun (which
would tear the survivor down when the victim dies). Exit status: the survivor's.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import commd.torch

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
dist.init_process_group("commd")
failures: list[str] = []
x = torch.ones(1 << 16, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()


def capture(t):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dist.all_reduce(t)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        dist.all_reduce(t)
    return g


# Part 1: slots are released with their graphs (both ranks).
SLOTS = 16384
n_caps = int(os.environ.get("GRAPH_CAPTURES", str(SLOTS + 200)))
t0 = time.perf_counter()
small = torch.ones(256, device="cuda")
for i in range(n_caps):
    g = capture(small)
    if i % 1000 == 0:
        small.fill_(rank + 1)
        g.replay()
        torch.cuda.synchronize()
        want = float(sum(range(1, world + 1)))
        if small[0].item() != want:
            failures.append(f"capture {i}: replay gave {small[0].item()}, want {want}")
    del g
    if i % 256 == 0:
        gc.collect()
        # Let the watchdog (every 100 ms) hand the destroyed graphs' slots back.
        time.sleep(0.15)
if rank == 0:
    print(f"{n_caps} captures, each graph destroyed before the next: "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

# Part 2: the victim dies while the survivor replays. GRAPH_KILL_ELEMS picks the path: the
# default 4 MiB all-reduce takes the daemon's (docs/contracts.md #6); 256 KiB on ranks with a
# GPU each the direct one (docs/contracts.md #7), stopped on the GPU by the daemon's "broken"
# hint.
x = torch.ones(int(os.environ.get("GRAPH_KILL_ELEMS", str(1 << 20))), device="cuda")
g = capture(x)
if rank == 0:
    print(f"part 2: {x.numel() * 4} bytes per all-reduce, path: {commd.torch.graph_path()}",
          flush=True)
for _ in range(5):
    g.replay()
torch.cuda.synchronize()
dist.barrier()
victim = world - 1
if rank == victim:
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)
t = time.perf_counter()
for _ in range(3):
    g.replay()
torch.cuda.synchronize()
released = time.perf_counter() - t
raised = None
try:
    commd.torch.check_graphs()
except Exception as e:  # noqa: BLE001 - inspected
    raised = str(e)
print(f"rank {rank}: replays released {released:.2f} s after the victim's kill (it slept 0.5 s "
      f"first); raised: {str(raised)[:300]}", flush=True)
if released > 2.5:
    failures.append(f"replays took {released:.2f} s to be released (limit 2 s after the kill)")
if raised is None:
    failures.append("no error raised after the peer died")
elif f"rank {victim}" not in raised:
    failures.append(f"the error does not name rank {victim}: {raised[:300]}")
# Later replays fail at once.
t = time.perf_counter()
g.replay()
torch.cuda.synchronize()
again = time.perf_counter() - t
if again > 0.5:
    failures.append(f"a replay after the failure took {again:.2f} s")
try:
    commd.torch.check_graphs()
    failures.append("a replay after the failure raised nothing")
except Exception:  # noqa: BLE001 - expected
    pass
print(f"rank {rank}: {len(failures)} failures", flush=True)
for f in failures:
    print(f"rank {rank}: FAIL {f}", flush=True)
os._exit(1 if failures else 0)
