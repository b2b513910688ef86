"""Stream ordering of the NCCL library's staged and host-memory ops, called by ctypes as vLLM's
pynccl calls it. Any number of ranks (they may share a GPU):

    COMMD_NCCL_LIB=.../libcommd_nccl.so torchrun --nproc_per_node 2 tests/gpu/nccl_streams.py

1. In-place all-to-all on two streams at once, 6 rounds: each op's input is staged (the
   daemon refuses copies whose destination overlaps a source), and the second op's copy into
   the staging must wait until the first op read it. Each buffer's result must be its own
   (with one staging buffer and no ordering between streams, the later copy could overwrite
   the input the earlier op is still sending).
2. An all-reduce of pinned host memory on the NULL stream, right after a copy into it queued
   on that stream behind a long kernel: the op must read the copied values (if the NULL
   stream is not waited for, the op reads what the buffer held before the copy).
3. A failed call inside a group returns its error; the group's valid ops still run, and
   ncclGroupEnd succeeds (it does not repeat the error as NCCL's does: torch's group guard
   would throw from its destructor while the call's exception unwinds, aborting the process).
4. Every collective on a communicator of one rank (each rank split off alone) gives its input
   (a GPU op there must not divide by zero in the direct limits).
5. ncclAllReduceConfig's launchCompletionEvent: recorded on the op's stream (after a long
   kernel queued before the op, the event is not complete right after the call, and is once
   the stream is done), the result right; a second event on the communicator in one group is
   ncclInvalidUsage, as NCCL's.
Exits non-zero on any failure.
"""

import ctypes
import sys

import torch
import torch.distributed as dist

import nccl_ctypes

F32, SUM = 7, 0
lib, dev, rank, world = nccl_ctypes.job()
failures: list[str] = []


def check(r, what):
    nccl_ctypes.check(lib, r, what)


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


uid = nccl_ctypes.unique_id(lib, rank)
comm = ctypes.c_void_p()
check(lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")

# 1. In-place all-to-all on two streams.
n = 4 << 20  # floats per peer: 16 MiB each
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
for rnd in range(6):
    a = torch.empty(world * n, device=dev)
    b = torch.empty(world * n, device=dev)
    for p in range(world):
        a[p * n:(p + 1) * n] = 1000.0 * rank + p + 0.25
        b[p * n:(p + 1) * n] = -1000.0 * rank - p - 0.5
    torch.cuda.synchronize()
    dist.barrier()
    check(lib.ncclAlltoAll(ptr(a), ptr(a), ctypes.c_size_t(n), F32, comm,
                           ctypes.c_void_p(s1.cuda_stream)), "ncclAlltoAll a")
    check(lib.ncclAlltoAll(ptr(b), ptr(b), ctypes.c_size_t(n), F32, comm,
                           ctypes.c_void_p(s2.cuda_stream)), "ncclAlltoAll b")
    torch.cuda.synchronize()
    for p in range(world):
        wa, wb = 1000.0 * p + rank + 0.25, -1000.0 * p - rank - 0.5
        ga, gb = a[p * n:(p + 1) * n], b[p * n:(p + 1) * n]
        if not (torch.all(ga == wa) and torch.all(gb == wb)):
            failures.append(f"round {rnd}: in-place all-to-all block from {p}: a has "
                            f"{ga.unique()[:4].tolist()} (want {wa}), b has "
                            f"{gb.unique()[:4].tolist()} (want {wb})")
print(f"rank {rank}: in-place all-to-all on two streams, 6 rounds: "
      f"{'ok' if not failures else 'FAILED'}", flush=True)

# 2. Pinned host memory on the NULL stream, after a copy queued behind a long kernel.
m = 1 << 20
src = torch.full((m,), float(rank + 1), device=dev)
host = torch.zeros(m, pin_memory=True)
out = torch.zeros(m, pin_memory=True)
torch.cuda.synchronize()
dist.barrier()
with torch.cuda.stream(torch.cuda.default_stream(dev)):
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time on the NULL stream
    host.copy_(src, non_blocking=True)
check(lib.ncclAllReduce(ptr(host), ptr(out), ctypes.c_size_t(m), F32, SUM, comm,
                        ctypes.c_void_p(0)), "ncclAllReduce pinned")
want = float(world * (world + 1) // 2)
if not torch.all(out == want):
    failures.append(f"pinned all-reduce on the NULL stream: {out.unique()[:4].tolist()}, "
                    f"want {want}")
print(f"rank {rank}: pinned memory on the NULL stream: "
      f"{'ok' if torch.all(out == want) else 'FAILED'}", flush=True)

# 3. A failed call inside a group.
x = torch.full((16,), float(rank), device=dev)
stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
check(lib.ncclGroupStart(), "ncclGroupStart")
check(lib.ncclAllReduce(ptr(x), ptr(x), ctypes.c_size_t(16), F32, SUM, comm, stream),
      "ncclAllReduce in the group")
bad = lib.ncclAllReduce(ptr(x), ptr(x), ctypes.c_size_t(16), 42, SUM, comm, stream)
msg = lib.ncclGetLastError(None).decode()
end = lib.ncclGroupEnd()
torch.cuda.synchronize()
if bad != 4 or end != 0 or "data type 42" not in msg:
    failures.append(f"group with a failed call: call {bad}, ncclGroupEnd {end}: {msg!r}")
if not torch.all(x == float(world * (world - 1) // 2)):
    failures.append(f"the group's valid all-reduce gave {x.unique().tolist()}")

# 4. A communicator of one rank (ncclCommSplit with each rank its own color): every collective.
solo = ctypes.c_void_p()
check(lib.ncclCommSplit(comm, rank, 0, ctypes.byref(solo), None), "ncclCommSplit")
v = torch.full((64,), float(rank + 2), device=dev)
o = torch.zeros(64, device=dev)
s0 = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
c64 = ctypes.c_size_t(64)
calls = [
    ("ncclAllReduce", lambda: lib.ncclAllReduce(ptr(v), ptr(o), c64, F32, SUM, solo, s0)),
    ("ncclBroadcast", lambda: lib.ncclBroadcast(ptr(v), ptr(o), c64, F32, 0, solo, s0)),
    ("ncclReduce", lambda: lib.ncclReduce(ptr(v), ptr(o), c64, F32, SUM, 0, solo, s0)),
    ("ncclAllGather", lambda: lib.ncclAllGather(ptr(v), ptr(o), c64, F32, solo, s0)),
    ("ncclReduceScatter", lambda: lib.ncclReduceScatter(ptr(v), ptr(o), c64, F32, SUM, solo,
                                                        s0)),
    ("ncclAlltoAll", lambda: lib.ncclAlltoAll(ptr(v), ptr(o), c64, F32, solo, s0)),
]
for name, call in calls:
    o.zero_()
    r = call()
    torch.cuda.synchronize()
    if r != 0 or not torch.all(o == float(rank + 2)):
        failures.append(f"{name} on a communicator of one rank: result {r} "
                        f"({lib.ncclGetLastError(None).decode()}), {o.unique()[:4].tolist()}")
print(f"rank {rank}: every collective on a communicator of one rank: "
      f"{'ok' if not any('one rank' in f for f in failures) else 'FAILED'}", flush=True)
check(lib.ncclCommDestroy(solo), "ncclCommDestroy(solo)")

# 5. The launch-completion event of a per-collective config.
class CollConfig(ctypes.Structure):
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("ext", ctypes.c_void_p), ("minCTAs", ctypes.c_int), ("maxCTAs", ctypes.c_int),
                ("nvlsCTAs", ctypes.c_int), ("cgaClusterSize", ctypes.c_int),
                ("algSelection", ctypes.c_char_p), ("forceAlgSelection", ctypes.c_int),
                ("CTAPolicy", ctypes.c_int), ("userProfilerTag", ctypes.c_uint64),
                ("launchCompletionEvent", ctypes.c_void_p)]


UNDEF = -(2 ** 31)
ev = torch.cuda.Event()  # no timing, as NCCL asks
ev.record()
torch.cuda.synchronize()
cfg = CollConfig(ctypes.sizeof(CollConfig), 0xCAFEBEEF, 23200, None, UNDEF, UNDEF, UNDEF, UNDEF,
                 None, 1, UNDEF, 0, ctypes.c_void_p(ev.cuda_event))
y = torch.full((1 << 20,), float(rank + 1), device=dev)
s5 = torch.cuda.Stream()
torch.cuda.synchronize()
dist.barrier()
with torch.cuda.stream(s5):
    torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the op
r5 = lib.ncclAllReduceConfig(ptr(y), ptr(y), ctypes.c_size_t(1 << 20), F32, SUM, comm,
                             ctypes.c_void_p(s5.cuda_stream), ctypes.byref(cfg))
early = ev.query()
torch.cuda.synchronize()
late = ev.query()
want5 = float(world * (world + 1) // 2)
if r5 != 0 or early or not late or not torch.all(y == want5):
    failures.append(f"ncclAllReduceConfig with a launch event: result {r5} "
                    f"({lib.ncclGetLastError(None).decode()}), event done right after the call "
                    f"{early} (want False), after the stream {late} (want True), "
                    f"values {y.unique()[:4].tolist()} (want {want5})")
check(lib.ncclGroupStart(), "ncclGroupStart")
g1 = lib.ncclAllReduceConfig(ptr(y), ptr(y), ctypes.c_size_t(16), F32, SUM, comm, s0,
                             ctypes.byref(cfg))
g2 = lib.ncclAllReduceConfig(ptr(y), ptr(y), ctypes.c_size_t(16), F32, SUM, comm, s0,
                             ctypes.byref(cfg))
msg2 = lib.ncclGetLastError(None).decode()
g3 = lib.ncclGroupEnd()
torch.cuda.synchronize()
if g1 != 0 or g2 != 5 or g3 != 0 or "one launch-completion event" not in msg2:
    failures.append(f"two launch events in one group: calls {g1}, {g2}, ncclGroupEnd {g3}: "
                    f"{msg2!r}")
print(f"rank {rank}: launchCompletionEvent: "
      f"{'ok' if not any('launch event' in f for f in failures) else 'FAILED'}", flush=True)

check(lib.ncclCommDestroy(comm), "ncclCommDestroy")
for f in failures:
    print(f"rank {rank}: FAIL {f}", flush=True)
print(f"rank {rank}: {'PASS' if not failures else 'FAIL'}", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
