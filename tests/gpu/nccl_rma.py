"""Memory windows and one-sided ops of the NCCL library (NCCL 2.29's ncclCommWindowRegister,
ncclPutSignal, ncclSignal, ncclWaitSignal), called by ctypes as a program built against NCCL
2.32 calls them. Any number of ranks >= 2 (they may share a GPU):

    COMMD_NCCL_LIB=.../libcommd_nccl.so torchrun --nproc_per_node 2 tests/gpu/nccl_rma.py

1. Ping-pong (NCCL's own example): rank 0 waits, then puts; rank 1 puts, then waits; 20 rounds,
   each round's values new; the values checked after each wait, on the GPU, before the host
   syncs (a wait that passes early reads the previous round's values).
2. All-to-all by puts: every rank puts its block for each peer at offset rank x block into the
   peer's window (a group of puts), then waits for one signal from every rank; each block checked.
3. Barrier by signals (NCCL's example): ncclSignal to every rank in a group, then one wait for
   all; and counts: 3 signals from each peer waited for by one descriptor of opCnt 3.
4. A put behind a long kernel on the sender's stream: the receiver's wait holds its stream
   until the data lands (the result checked on the receiver's stream, after the wait).
   Then a put behind a long kernel on one stream and a put and 1100 signals on another: the
   receiver's wait for two signals passes only after both puts landed (issue order).
5. The window's user pointer; windows registered in a group; puts into the second of two
   windows at an offset, leaving the rest of the window untouched.
6. Refused as NCCL refuses: sigIdx, ctx or flags not 0 (ncclInvalidArgument); a put past the
   end of the peer's window (ncclInvalidArgument); a put captured into a CUDA graph
   (ncclInvalidUsage, the capture still usable); a stale window handle.
Exits non-zero on any failure.
"""

import ctypes
import sys

import torch
import torch.distributed as dist

import nccl_ctypes

F32, I32 = 7, 2
lib, dev, rank, world = nccl_ctypes.job()
failures: list[str] = []


class WaitDesc(ctypes.Structure):
    _fields_ = [("opCnt", ctypes.c_int), ("peer", ctypes.c_int), ("sigIdx", ctypes.c_int),
                ("ctx", ctypes.c_int)]


def check(r, what):
    nccl_ctypes.check(lib, r, what)


def expect(code, r, what, text):
    msg = lib.ncclGetLastError(None).decode()
    if r != code or text not in msg:
        failures.append(f"{what}: got {r} ({msg!r}), want {code} with {text!r}")


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def sp(s):
    return ctypes.c_void_p(s.cuda_stream)


lib.ncclPutSignal.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
lib.ncclSignal.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint,
                           ctypes.c_void_p, ctypes.c_void_p]
lib.ncclWaitSignal.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
lib.ncclCommWindowRegister.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.c_void_p, ctypes.c_int]
lib.ncclCommWindowDeregister.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
lib.ncclWinGetUserPtr.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
lib.ncclMemAlloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
lib.ncclMemFree.argtypes = [ctypes.c_void_p]

uid = nccl_ctypes.unique_id(lib, rank)
comm = ctypes.c_void_p()
check(lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
stream = torch.cuda.Stream()


def mem_alloc(nbytes):
    """ncclMemAlloc'd memory as a float32 tensor (the window memory NCCL's examples use)."""
    p = ctypes.c_void_p()
    check(lib.ncclMemAlloc(ctypes.byref(p), nbytes), "ncclMemAlloc")
    return p


def as_tensor(p, n):
    """A float32 tensor view of device memory at `p` (n elements), without owning it."""
    class _Cuda:
        __cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (p.value, False),
                                    "version": 2}
    return torch.as_tensor(_Cuda(), device=dev)


def register(p, nbytes):
    w = ctypes.c_void_p()
    check(lib.ncclCommWindowRegister(comm, p, nbytes, ctypes.byref(w), 1),
          "ncclCommWindowRegister")
    return w


def wait(descs, s):
    arr = (WaitDesc * len(descs))(*[WaitDesc(c, p, 0, 0) for p, c in descs])
    check(lib.ncclWaitSignal(len(descs), arr, comm, sp(s)), "ncclWaitSignal")


n = 1 << 16  # floats per block: 256 KiB
win_mem = mem_alloc(world * n * 4)
win_buf = as_tensor(win_mem, world * n)
win_buf.fill_(-1.0)
src = torch.empty(world * n, device=dev)
torch.cuda.synchronize()
win = register(win_mem, world * n * 4)

# 1. Ping-pong between ranks 0 and 1.
if rank < 2:
    peer = 1 - rank
    ok = torch.ones((), dtype=torch.bool, device=dev)
    for rnd in range(20):
        with torch.cuda.stream(stream):
            src[:n].fill_(1000.0 * rnd + rank)
            if rank == 0:
                wait([(peer, 1)], stream)
                ok &= torch.all(win_buf[:n] == 1000.0 * rnd + peer)
                check(lib.ncclPutSignal(ptr(src), n, F32, peer, win, 0, 0, 0, 0, comm, sp(stream)),
                      "ncclPutSignal")
            else:
                check(lib.ncclPutSignal(ptr(src), n, F32, peer, win, 0, 0, 0, 0, comm, sp(stream)),
                      "ncclPutSignal")
                wait([(peer, 1)], stream)
                ok &= torch.all(win_buf[:n] == 1000.0 * rnd + peer)
    stream.synchronize()
    if not bool(ok):
        failures.append("ping-pong: a wait passed before its put's data was there")
    print(f"rank {rank}: ping-pong 20 rounds: {'ok' if bool(ok) else 'FAILED'}", flush=True)
dist.barrier()

# 2. All-to-all by puts.
with torch.cuda.stream(stream):
    for p in range(world):
        src[p * n:(p + 1) * n] = 100.0 * rank + p
    check(lib.ncclGroupStart(), "ncclGroupStart")
    for p in range(world):
        check(lib.ncclPutSignal(ctypes.c_void_p(src.data_ptr() + p * n * 4), n, F32, p, win,
                                rank * n * 4, 0, 0, 0, comm, sp(stream)), "ncclPutSignal a2a")
    check(lib.ncclGroupEnd(), "ncclGroupEnd")
    wait([(p, 1) for p in range(world)], stream)
    got = win_buf.clone()
stream.synchronize()
for p in range(world):
    blk = got[p * n:(p + 1) * n]
    if not torch.all(blk == 100.0 * p + rank):
        failures.append(f"all-to-all by puts: block from {p} holds {blk.unique()[:4].tolist()}")
print(f"rank {rank}: all-to-all by puts: {'ok' if not failures else 'FAILED'}", flush=True)

# 3. Barrier by signals, and counts.
with torch.cuda.stream(stream):
    check(lib.ncclGroupStart(), "ncclGroupStart")
    for p in range(world):
        check(lib.ncclSignal(p, 0, 0, 0, comm, sp(stream)), "ncclSignal")
    check(lib.ncclGroupEnd(), "ncclGroupEnd")
    wait([(p, 1) for p in range(world)], stream)
    for _ in range(3):
        for p in range(world):
            check(lib.ncclSignal(p, 0, 0, 0, comm, sp(stream)), "ncclSignal x3")
    wait([(p, 3) for p in range(world)], stream)
stream.synchronize()
print(f"rank {rank}: barrier and counted signals: ok", flush=True)
dist.barrier()

# 4. A put behind a long kernel: the receiver's wait holds its stream until the data lands.
if rank < 2:
    peer = 1 - rank
    with torch.cuda.stream(stream):
        if rank == 1:
            a = torch.randn(4096, 4096, device=dev)
            for _ in range(20):
                a = a @ a
                a /= a.norm()
            src[:n].fill_(7.5)
            src[:n] += 0 * a[0, 0]  # the data depends on the long work
            check(lib.ncclPutSignal(ptr(src), n, F32, peer, win, 0, 0, 0, 0, comm, sp(stream)),
                  "ncclPutSignal late")
        else:
            wait([(peer, 1)], stream)
            late_ok = torch.all(win_buf[:n] == 7.5)
    stream.synchronize()
    if rank == 0 and not bool(late_ok):
        failures.append("late put: the wait passed before the data landed")
    print(f"rank {rank}: put behind a long kernel: ok", flush=True)
dist.barrier()

# 4b. A communicator's one-sided ops run in issue order across streams: a put behind a long
# kernel on one stream, then a put and 1100 signals on a second, idle stream (more than the
# 1024 staging words). The receiver's wait for the first two signals passes only once both
# puts' data landed (the second stream's signal alone would count 2 if it ran first).
if rank < 2:
    peer = 1 - rank
    stream2 = torch.cuda.Stream()
    src2 = torch.full((n,), 9.5, device=dev)
    torch.cuda.synchronize()
    if rank == 1:
        with torch.cuda.stream(stream):
            a = torch.randn(4096, 4096, device=dev)
            for _ in range(20):
                a = a @ a
                a /= a.norm()
            src[:n].fill_(8.5)
            src[:n] += 0 * a[0, 0]
            check(lib.ncclPutSignal(ptr(src), n, F32, peer, win, 0, 0, 0, 0, comm, sp(stream)),
                  "ncclPutSignal stream 1")
        check(lib.ncclPutSignal(ptr(src2), n, F32, peer, win, n * 4, 0, 0, 0, comm,
                                sp(stream2)), "ncclPutSignal stream 2")
        for _ in range(1100):
            check(lib.ncclSignal(peer, 0, 0, 0, comm, sp(stream2)), "ncclSignal stream 2")
    else:
        with torch.cuda.stream(stream):
            wait([(peer, 2)], stream)
            order_ok = torch.all(win_buf[:n] == 8.5) & torch.all(win_buf[n:2 * n] == 9.5)
            wait([(peer, 1100)], stream)
    stream.synchronize()
    stream2.synchronize()
    if rank == 0 and not bool(order_ok):
        failures.append("two streams: the wait passed before the first stream's put landed")
    print(f"rank {rank}: one-sided ops on two streams in issue order: "
          f"{'ok' if rank == 1 or bool(order_ok) else 'FAILED'}", flush=True)
dist.barrier()

# 5. The user pointer, windows registered in a group, a put at an offset of the second window.
out = ctypes.c_void_p()
check(lib.ncclWinGetUserPtr(comm, win, ctypes.byref(out)), "ncclWinGetUserPtr")
if out.value != win_mem.value:
    failures.append(f"ncclWinGetUserPtr gave {out.value:#x}, want {win_mem.value:#x}")
m1, m2 = mem_alloc(n * 4), mem_alloc(2 * n * 4)
b2 = as_tensor(m2, 2 * n)
b2.fill_(-3.0)
torch.cuda.synchronize()
w1, w2 = ctypes.c_void_p(), ctypes.c_void_p()
check(lib.ncclGroupStart(), "ncclGroupStart")
check(lib.ncclCommWindowRegister(comm, m1, n * 4, ctypes.byref(w1), 0), "register w1")
check(lib.ncclCommWindowRegister(comm, m2, 2 * n * 4, ctypes.byref(w2), 0), "register w2")
check(lib.ncclGroupEnd(), "ncclGroupEnd (windows)")
nxt = (rank + 1) % world
prv = (rank - 1) % world
with torch.cuda.stream(stream):
    src[:n // 2].fill_(42.0 + rank)
    check(lib.ncclPutSignal(ptr(src), n // 2, F32, nxt, w2, n * 4, 0, 0, 0, comm, sp(stream)),
          "ncclPutSignal w2")
    wait([(prv, 1)], stream)
    g2 = b2.clone()
stream.synchronize()
want = torch.full((2 * n,), -3.0, device=dev)
want[n:n + n // 2] = 42.0 + prv
if not torch.equal(g2, want):
    failures.append("put at an offset of the second window: wrong values or bytes outside it "
                    "changed")
print(f"rank {rank}: windows in a group, put at an offset: ok", flush=True)
dist.barrier()

# 6. Refusals.
INVALID_ARGUMENT, INVALID_USAGE = 4, 5
expect(INVALID_ARGUMENT, lib.ncclSignal(nxt, 1, 0, 0, comm, sp(stream)), "sigIdx 1",
       "signal index 1")
expect(INVALID_ARGUMENT, lib.ncclSignal(nxt, 0, 2, 0, comm, sp(stream)), "ctx 2", "context 2")
expect(INVALID_ARGUMENT, lib.ncclSignal(nxt, 0, 0, 4, comm, sp(stream)), "flags 4", "flags 4")
expect(INVALID_ARGUMENT, lib.ncclSignal(world, 0, 0, 0, comm, sp(stream)), "peer out of range",
       "not a rank")
expect(INVALID_ARGUMENT, lib.ncclPutSignal(ptr(src), n + 1, F32, nxt, w1, 0, 0, 0, 0, comm,
                                           sp(stream)), "put past the window", "past the end")
g = torch.cuda.CUDAGraph()
s2 = torch.cuda.Stream()
with torch.cuda.stream(s2):
    g.capture_begin()
    r = lib.ncclSignal(nxt, 0, 0, 0, comm, sp(s2))
    msg = lib.ncclGetLastError(None).decode()
    g.capture_end()
if r != INVALID_USAGE or "CUDA graphs" not in msg:
    failures.append(f"captured signal: got {r} ({msg!r}), want ncclInvalidUsage")
check(lib.ncclCommWindowDeregister(comm, w1), "ncclCommWindowDeregister w1")
expect(INVALID_ARGUMENT, lib.ncclPutSignal(ptr(src), 1, F32, nxt, w1, 0, 0, 0, 0, comm,
                                           sp(stream)), "stale window", "not a live window")
dist.barrier()
check(lib.ncclCommWindowDeregister(comm, w2), "ncclCommWindowDeregister w2")
check(lib.ncclCommWindowDeregister(comm, win), "ncclCommWindowDeregister")
print(f"rank {rank}: refusals: {'ok' if not failures else 'FAILED'}", flush=True)
check(lib.ncclCommDestroy(comm), "ncclCommDestroy")
for p in (win_mem, m1, m2):
    check(lib.ncclMemFree(p), "ncclMemFree")

for f in failures:
    print(f"rank {rank}: FAIL {f}", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(1 if failures else 0)
