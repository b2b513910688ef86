"""Send/recv across the direct limit through commd's NCCL library, called by ctypes as vLLM's
pynccl calls it (COMMD_P2P_DIRECT on; =shared where the ranks share a GPU). 2 ranks:

    COMMD_NCCL_LIB=.../libcommd_nccl.so COMMD_P2P_DIRECT=shared \
        torchrun --nproc_per_node 2 tests/gpu/nccl_p2p_mismatch.py

A message of at most COMMD_P2P_DIRECT_MAX_BYTES is a direct op, a larger one takes the daemon's
path, and each path pairs its own messages in order. The k-th receive takes the k-th message
(as NCCL pairs them) only where both ranks put the same messages on each path in the same order;
each direct op's signature carries the daemon-path ops before it (docs/design-gpu.md, send/recv
rule 3), so a receive whose sender's count differs fails as a mismatch.

1. The same messages on both ranks, small and large interleaved (and in groups), 6 rounds:
   right data, no error; and a group whose direct ops run as one kernel on one rank and one
   at a time on the other (ops on two streams): right data, no error.
2. Rank 0 sends a small message and then a large one; rank 1 receives a large one and then a
   small one (each rank's sizes per position differ: the program's error). Rank 1's small
   receive fails at once, as a mismatch naming both ranks' daemon-path counts, and its buffer
   is left as it was. (Without the check, each message would land in the receive of its size,
   in the other order, and no error would be raised anywhere.)
3. Rank 0 sends a large message and then a small one; rank 1 receives a small one and then a
   large one, each on one stream: rank 0's stream waits in the daemon for rank 1's large
   receive, which waits behind its small one, which waits for rank 0's small send. Rank 1's
   direct receive reads rank 0's daemon mark and fails at once, and both ranks raise within
   10 s (not at the op timeout).
4. Rank 0 sends three small messages; rank 1 receives a large one first: rank 0's third send
   waits for the first one's ack, reads rank 1's daemon mark and fails at once, and fails the
   communicator, so that rank 1's receive waiting on the daemon's path fails too, with rank
   0's words; both within 10 s.
Exits non-zero on any failure.
"""

import ctypes
import os
import sys
import time

import torch
import torch.distributed as dist

import nccl_ctypes

F32 = 7
lib, dev, rank, world = nccl_ctypes.job()
assert world == 2, "run with 2 ranks"
peer = 1 - rank
failures: list[str] = []
SMALL = 1000
BIG = int(os.environ.get("COMMD_P2P_DIRECT_MAX_BYTES", 4 << 20)) // 4 + 5


def check(r, what):
    nccl_ctypes.check(lib, r, what)


def new_comm():
    uid = nccl_ctypes.unique_id(lib, rank)
    comm = ctypes.c_void_p()
    check(lib.ncclCommInitRank(ctypes.byref(comm), world, uid, rank), "ncclCommInitRank")
    return comm


def stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def send(comm, x, s=None):
    check(lib.ncclSend(ctypes.c_void_p(x.data_ptr()), ctypes.c_size_t(x.numel()), F32, peer,
                       comm, s or stream()), "ncclSend")


def recv(comm, y, s=None):
    check(lib.ncclRecv(ctypes.c_void_p(y.data_ptr()), ctypes.c_size_t(y.numel()), F32, peer,
                       comm, s or stream()), "ncclRecv")


def payload(src, rnd, n):
    return ((torch.arange(n, device=dev, dtype=torch.int64) * 7 + src * 101 + rnd * 31) % 127).float()


def async_error(comm):
    err = ctypes.c_int(-1)
    check(lib.ncclCommGetAsyncError(comm, ctypes.byref(err)), "ncclCommGetAsyncError")
    return err.value, (lib.ncclGetLastError(comm) or b"").decode()


# 1. The same messages on both ranks: small and large interleaved, alone and in groups.
comm = new_comm()
for rnd in range(6):
    sizes = [SMALL, BIG, SMALL + 1, BIG + 1] if rnd % 2 else [BIG, SMALL, BIG + 1, SMALL + 1]
    outs = [torch.full((n,), -1.0, device=dev) for n in sizes]
    grouped = rnd >= 3
    for i, n in enumerate(sizes):
        # Rank 0 sends first, rank 1 receives first; in groups both at once.
        if grouped:
            check(lib.ncclGroupStart(), "ncclGroupStart")
        for op in ((send, recv) if rank == 0 else (recv, send)):
            if op is send:
                send(comm, payload(rank, rnd * 10 + i, n))
            else:
                recv(comm, outs[i])
        if grouped:
            check(lib.ncclGroupEnd(), "ncclGroupEnd")
    torch.cuda.synchronize()
    for i, (n, o) in enumerate(zip(sizes, outs)):
        if not torch.equal(o, payload(peer, rnd * 10 + i, n)):
            failures.append(f"same messages, round {rnd}, message {i} ({n} floats): wrong data")
    err, msg = async_error(comm)
    if err != 0:
        failures.append(f"same messages, round {rnd}: an error was raised: {msg}")

# 1b. One group, whose direct ops run as one kernel on rank 0 and one at a time on rank 1 (its
#     ops on two streams): rank 0 {send large, send small, receive small}, rank 1 {receive
#     large, receive small, send small on another stream}. Each rank posts the group's direct
#     ops before its daemon-path ones, so the counts agree: right data, no error.
side = torch.cuda.Stream()
for rnd in range(4):
    big_in = torch.full((BIG,), -1.0, device=dev)
    small_in = torch.full((SMALL,), -1.0, device=dev)
    big_x, small_x = payload(rank, 800 + rnd, BIG), payload(rank, 900 + rnd, SMALL)
    torch.cuda.synchronize()
    check(lib.ncclGroupStart(), "ncclGroupStart")
    if rank == 0:
        send(comm, big_x)
        send(comm, small_x)
        recv(comm, small_in)
    else:
        recv(comm, big_in)
        recv(comm, small_in)
        send(comm, small_x, ctypes.c_void_p(side.cuda_stream))
    check(lib.ncclGroupEnd(), "ncclGroupEnd")
    torch.cuda.synchronize()
    if not torch.equal(small_in, payload(peer, 900 + rnd, SMALL)):
        failures.append(f"a group, kernel on one rank only, round {rnd}: wrong small message")
    if rank == 1 and not torch.equal(big_in, payload(0, 800 + rnd, BIG)):
        failures.append(f"a group, kernel on one rank only, round {rnd}: wrong large message")
    err, msg = async_error(comm)
    if err != 0:
        failures.append(f"a group, kernel on one rank only, round {rnd}: an error: {msg}")
        break
check(lib.ncclCommDestroy(comm), "ncclCommDestroy")

# 2. Rank 0: small then large; rank 1: large then small.
comm = new_comm()
small_in = torch.full((SMALL,), -1.0, device=dev)
big_in = torch.full((BIG,), -1.0, device=dev)
dist.barrier()
t0 = time.time()
if rank == 0:
    send(comm, payload(0, 500, SMALL))
    send(comm, payload(0, 501, BIG))
else:
    recv(comm, big_in)
    recv(comm, small_in)
torch.cuda.synchronize()
took = time.time() - t0
err, msg = async_error(comm)
if rank == 1:
    if err == 0:
        failures.append("small then large against large then small: no error on rank 1")
    elif "daemon's path before it" not in msg or "mismatch" not in msg:
        failures.append(f"the error does not name the daemon-path counts: {msg}")
    if not small_in.eq(-1.0).all():
        failures.append("the small receive took the peer's message all the same")
    if took > 10:
        failures.append(f"the mismatch took {took:.1f} s to surface")
    print(f"rank 1: {msg}", flush=True)
check(lib.ncclCommAbort(comm), "ncclCommAbort")


def both_fail(what, post, naming):
    """`post(comm)` on a new communicator: both ranks must raise within 10 s, the rank
    `naming` names with an error that names the daemon's path."""
    comm = new_comm()
    dist.barrier()
    t0 = time.time()
    post(comm)
    torch.cuda.synchronize()
    took = time.time() - t0
    err, msg = async_error(comm)
    if err == 0:
        failures.append(f"{what}: no error on rank {rank}")
    elif rank in naming and "daemon's path" not in msg:
        failures.append(f"{what}: rank {rank}'s error does not name the daemon's path: {msg}")
    if took > 10:
        failures.append(f"{what}: rank {rank} was told after {took:.1f} s")
    print(f"rank {rank}: {what}: {took:.2f} s: {msg}", flush=True)
    check(lib.ncclCommAbort(comm), "ncclCommAbort")


def large_then_small(comm):
    if rank == 0:
        send(comm, payload(0, 600, BIG))
        send(comm, payload(0, 601, SMALL))
    else:
        recv(comm, torch.empty(SMALL, device=dev))
        recv(comm, torch.empty(BIG, device=dev))


def three_small_against_large(comm):
    if rank == 0:
        for i in range(3):
            send(comm, payload(0, 700 + i, SMALL))
    else:
        recv(comm, torch.empty(BIG, device=dev))
        for _ in range(2):
            recv(comm, torch.empty(SMALL, device=dev))


both_fail("large then small against small then large, one stream each", large_then_small, (1,))
both_fail("three small sends against a large receive first", three_small_against_large, (0, 1))

dist.barrier()
for f in failures:
    print(f"rank {rank}: FAIL {f}", flush=True)
print(("PASS" if not failures else "FAIL") + f" nccl_p2p_mismatch rank {rank}", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
