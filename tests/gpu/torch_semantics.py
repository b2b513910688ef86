"""What torch's "commd" backend must do on GPU tensors as ProcessGroupNCCL does, beyond the
values of the ops (2 ranks; they may share a GPU):

    torchrun --nproc_per_node 2 tests/gpu/torch_semantics.py

1. all_reduce_coalesced(async_op=True)'s future is CUDA-aware: its wait() orders the caller's
   stream after every op (a plain joined future of several GPU ops would complete at once: the
   stream would read the tensors before the ops wrote them).
2. An uneven all_to_all_single whose own block differs in size between input and output is
   refused before anything is posted (copy_ would broadcast one row into three); the next
   all_to_all_single works.
3. Work.wait(timeout) of a GPU op waits on the CPU and raises torch's timeout error when the
   timeout passes first (rather than return at once); a later wait() completes the op.
4. An output whose elements overlap (an expand()ed view) is refused before anything is posted.
5. Coalescing on the GPU (`_coalescing_manager(device=cuda)`: the backend's startCoalescing /
   endCoalescing), all-reduces and a batch_isend_irecv ring through it: the block's Work orders
   the stream after every op; the group's sequence number counts the block once.
Exits non-zero on any failure.
"""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import commd.torch  # noqa: F401  (registers the backend)

local = int(os.environ.get("LOCAL_RANK", "0"))
dev = torch.device("cuda", local % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("commd", timeout=datetime.timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
assert world == 2, "run with 2 ranks"
failures: list[str] = []


def note(ok: bool, what: str) -> None:
    print(f"rank {rank}: {what}: {'ok' if ok else 'FAIL'}", flush=True)
    if not ok:
        failures.append(what)


# 1. The joined future of coalesced GPU ops.
n = 16 << 20  # 64 MiB per tensor: the ops take long enough to be caught unfinished
bad = 0
for it in range(5):
    ts = [torch.full((n,), float(rank + 1 + it), device=dev) for _ in range(2)]
    torch.cuda.synchronize()
    dist.barrier()
    fut = dist.all_reduce_coalesced(ts, async_op=True)
    fut = fut.get_future() if hasattr(fut, "get_future") else fut
    fut.wait()
    # Read on the current stream right away: ordered after the ops only if the future is.
    got = [t[::4096].clone() for t in ts]
    torch.cuda.synchronize()
    want = float(sum(r + 1 + it for r in range(world)))
    bad += sum(int(not torch.all(g == want)) for g in got)
note(bad == 0, f"all_reduce_coalesced future orders the stream ({bad} stale reads in 10)")

# 2. Uneven all-to-all with this rank's own block differing in size.
x = torch.arange(2 * 8, device=dev, dtype=torch.float32).view(2, 8)
out = torch.full((4, 8), -1.0, device=dev)
splits_out = [3, 1] if rank == 0 else [1, 3]
try:
    dist.all_to_all_single(out, x, output_split_sizes=splits_out, input_split_sizes=[1, 1])
    note(False, "uneven all_to_all_single with a mismatched own block raised nothing")
except ValueError as e:
    note("sends itself 8 elements but expects 24" in str(e) and bool(torch.all(out == -1.0)),
         f"uneven all_to_all_single refused before posting ({e})")
y = torch.arange(2 * 8, device=dev, dtype=torch.float32).view(2, 8) + 100 * rank
got = torch.empty_like(y)
dist.all_to_all_single(got, y)
torch.cuda.synchronize()
want = torch.stack([torch.arange(8, device=dev, dtype=torch.float32) + 8 * rank + 100 * p
                    for p in range(world)])
note(torch.equal(got, want), "all_to_all_single after the refusal")

# 3. Work.wait(timeout) of a GPU op.
dist.barrier()
t = torch.full((1 << 20,), float(rank + 1), device=dev)
if rank == 0:
    w = dist.all_reduce(t, async_op=True)
    t0 = time.monotonic()
    try:
        w.wait(timeout=datetime.timedelta(milliseconds=500))
        note(False, "wait(timeout=0.5 s) returned while the peer had not posted its op")
    except Exception as e:  # noqa: BLE001
        el = time.monotonic() - t0
        note(isinstance(e, RuntimeError) and "timed out" in str(e).lower() and 0.4 < el < 2.5,
             f"wait(timeout=0.5 s) raised {type(e).__name__} after {el:.2f} s: {e}")
    w.wait()
else:
    time.sleep(3)
    dist.all_reduce(t)
torch.cuda.synchronize()
note(bool(torch.all(t == 3.0)), "the op completes after the timed-out wait")

# 4. An overlapping output.
o = torch.zeros(1, 8, device=dev).expand(world, 8)
try:
    dist.all_gather_into_tensor(o, torch.ones(1, 8, device=dev))
    note(False, "an expand()ed output was accepted")
except ValueError as e:
    note("overlap in memory" in str(e), f"an expand()ed output refused ({e})")
s = torch.full((8,), float(rank), device=dev)
dist.all_reduce(s)
torch.cuda.synchronize()
note(bool(torch.all(s == 1.0)), "all_reduce after the refusal")

# 5. Coalescing on the GPU.
pg = dist.group.WORLD
ts = [torch.full((1 << 18,), float(rank + k), device=dev) for k in range(3)]
seq = pg._get_backend(dev)._get_sequence_number_for_group  # (torch 2.11: not on the group)
s0 = seq()
with dist._coalescing_manager(group=pg, device=dev, async_ops=True) as cm:
    for x in ts:
        dist.all_reduce(x)
cm.wait()
torch.cuda.synchronize()
s1 = seq()
note(all(bool(torch.all(x == float(2 * k + 1))) for k, x in enumerate(ts)) and s1 - s0 == 1,
     f"coalesced all-reduces on the GPU (sequence {s0} -> {s1})")
out = torch.zeros(1 << 16, device=dev)
ops = [dist.P2POp(dist.isend, torch.full((1 << 16,), float(rank + 10), device=dev),
                  (rank + 1) % world),
       dist.P2POp(dist.irecv, out, (rank - 1) % world)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
torch.cuda.synchronize()
note(bool(torch.all(out == float((rank - 1) % world + 10))), "batch_isend_irecv ring on the GPU")

print(f"rank {rank}: {'PASS' if not failures else 'FAIL'} ({len(failures)} failures)", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
