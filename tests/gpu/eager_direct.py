"""Eager collectives as direct ops (docs/design-gpu.md, direct collectives rule 8,
COMMD_EAGER_DIRECT=auto, or =shared with ranks sharing GPUs): right results, every op's own
outcome, no hang. torchrun, 2+ ranks; scripts/gpu-check.sh runs it with the setting on (it is
off by default).

1. Every op the direct kernel runs (all-reduce sum/max/min/avg, all-gather, reduce-scatter,
   all-to-all, broadcast and reduce from every root) in f32, bf16, f16, i32 and u8 (the copies), at sizes
   from 1 element to the direct limit and just past it (the daemon's path), async and blocking,
   against references computed here from every rank's known inputs (integer-valued, so every
   sum is exact in any order; avg with a tolerance).
2. The group says its small ops run direct (``commd.torch.eager_path``).
3. One communicator's ops on two streams with no CPU sync between them, direct and daemon ops
   mixed, each ordered after the one before (the windows' epochs need it): right results.
4. A mismatch (rank 0 one count, the others another, both under the limit) on a group of its
   own: every rank's op raises a mismatch naming the count, at once, and no rank hangs; the
   group's next direct op fails too (poisoned), and the default group is untouched.
   Also broadcasts whose roots differ, each rank's root the next rank (forwarded broadcasts,
   ``COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES``, must not wait on each other in a cycle).
5. Works complete: ``is_completed()`` becomes true without ``wait()``.
6. All-reduces, broadcasts and reduces past the limit split into direct ops
   (``COMMD_DIRECT_SPLIT_MAX_BYTES``: a reduce-scatter or a scatter from the root, then an
   all-gather or a gather to the root, and the same op on a count's remainder modulo the
   ranks): right results from just past the limit to world x the largest share (and a share
   one element past it: the daemon's path), every reduction, every root (a non-root's
   reduce input left as it was), async and blocking, on two streams; and mismatches, on groups
   of their own, raised on every rank: counts that differ only in the remainder, a split
   all-reduce against a reduce-scatter that other ranks posted, split broadcasts and reduces
   whose roots differ, a split reduce against a split broadcast, a split broadcast against a
   split all-reduce.
7. A reduce whose share is past that runs in chunks, the last one marked: on 2 ranks direct
   reduces of at most the limit each, on 3+ splits in the largest shares: right results from
   every root at the sizes of 6 that reach it, and mismatches raised on every rank: counts with
   another number of chunks (a rank must not pair a peer's extra chunk with its next op) and
   counts that differ only in the last chunk.
8. One rank's op on the daemon's path where the others run it as a direct op (an all-gather
   count past the push limit against one under it, by LL lines and by flags), and ops issued
   in different orders across the two paths: the direct rank is told at once, by the others'
   daemon marks (``kernels::direct::MARK_OFF``), with a mismatch naming the daemon's path,
   not at the op timeout; it then fails the communicator in the daemon (FailCommunicator, from
   its watchdog or next call), so the others' op on the daemon's path fails at once too, with
   rank 0's words, not at the group's op timeout.
Exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

import commd.torch
import torchrun_env

rank, world, dev = torchrun_env.start()
assert world >= 2, "run with at least 2 ranks"
failures: list[str] = []
LIMIT = torchrun_env.direct_limit(world)
SHARE = torchrun_env.split_share(world)
PUSH = torchrun_env.push_limit(world)


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float = 0.0) -> None:
    g, w = got.double().cpu(), want.double().cpu()
    ok = torch.allclose(g, w, rtol=tol, atol=tol) if tol else torch.equal(g, w)
    if not ok:
        bad = (g - w).abs().argmax().item() if g.shape == w.shape else -1
        failures.append(f"{name}: wrong result (first bad index {bad}: got "
                        f"{g.flatten()[bad].item() if bad >= 0 else g.shape}, want "
                        f"{w.flatten()[bad].item() if bad >= 0 else w.shape})")


def data(r: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``r``'s input: small integers, exact in every dtype and in any sum order."""
    v = (torch.arange(n, device=dev, dtype=torch.int64) * 7 + r * 5 + salt) % 9
    return v.to(dtype)


def all_in(n: int, dtype: torch.dtype, salt: int = 0) -> list[torch.Tensor]:
    return [data(r, n, dtype, salt) for r in range(world)]


def reduce_ref(ins: list[torch.Tensor], op: str) -> torch.Tensor:
    s = torch.stack([t.double() for t in ins])
    return {"sum": s.sum(0), "max": s.max(0).values, "min": s.min(0).values,
            "avg": s.sum(0) / world}[op]


OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
       "avg": dist.ReduceOp.AVG}


def sizes(es: int) -> list[int]:
    """Elements: tiny, odd, mid, the largest direct op, and one past it (the daemon's path, or a
    split); the same for an all-gather or all-to-all where its limit differs."""
    most, push = LIMIT // es, PUSH // es
    return sorted({1, 3, 1000, 4097, most // 2 + 1, most, most + 1, push, push + 1})


def case_all(dtype: torch.dtype, n: int, async_op: bool, salt: int) -> None:
    tag = f"{dtype} n={n} async={async_op}"
    ins = all_in(n, dtype, salt)
    for name, op in OPS.items():
        if name == "avg" and not dtype.is_floating_point:
            continue
        t = ins[rank].clone()
        w = dist.all_reduce(t, op=op, async_op=async_op)
        if async_op:
            w.wait()
        tol = 1e-2 if name == "avg" else 0.0
        check(f"all_reduce {name} {tag}", t, reduce_ref(ins, name).to(dtype), tol)
    # all-gather and reduce-scatter (chunks of n elements each)
    out = torch.empty(world * n, device=dev, dtype=dtype)
    w = dist.all_gather_into_tensor(out, ins[rank], async_op=async_op)
    if async_op:
        w.wait()
    check(f"all_gather {tag}", out, torch.cat(ins))
    big = all_in(world * n, dtype, salt + 1)
    rs = torch.empty(n, device=dev, dtype=dtype)
    w = dist.reduce_scatter_tensor(rs, big[rank], async_op=async_op)
    if async_op:
        w.wait()
    check(f"reduce_scatter {tag}", rs, reduce_ref(big, "sum")[rank * n:(rank + 1) * n].to(dtype))
    # all-to-all: chunk r of every rank's input to rank r (chunks of n elements), out of place
    # (the per-op path) and in place (torch's generic path: a copy of the input first)
    a2a = torch.empty(world * n, device=dev, dtype=dtype)
    w = dist.all_to_all_single(a2a, big[rank], async_op=async_op)
    if async_op:
        w.wait()
    a2a_want = torch.cat([b[rank * n:(rank + 1) * n] for b in big])
    check(f"all_to_all {tag}", a2a, a2a_want)
    a2a = big[rank].clone()
    w = dist.all_to_all_single(a2a, a2a, async_op=async_op)
    if async_op:
        w.wait()
    check(f"all_to_all in place {tag}", a2a, a2a_want)
    rooted_all(ins, dtype, async_op, tag)


def rooted_all(ins: list[torch.Tensor], dtype: torch.dtype, async_op: bool, tag: str,
               reductions: tuple[str, ...] = ("sum",)) -> None:
    """Broadcast and reduce (each of ``reductions``) of every rank's ``ins`` from every root:
    right results, and a reduce's non-root keeps its input."""
    n = ins[rank].numel()
    for root in range(world):
        b = ins[rank].clone() if rank == root else torch.zeros(n, device=dev, dtype=dtype)
        w = dist.broadcast(b, src=root, async_op=async_op)
        if async_op:
            w.wait()
        check(f"broadcast root {root} {tag}", b, ins[root])
        for name in reductions:
            t = ins[rank].clone()
            w = dist.reduce(t, dst=root, op=OPS[name], async_op=async_op)
            if async_op:
                w.wait()
            want = reduce_ref(ins, name).to(dtype) if rank == root else ins[rank]
            check(f"reduce {name} root {root} {tag}", t, want)


# 1. every op, dtype and size
salt = 0
for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
    for n in sizes(torch.empty((), dtype=dtype).element_size()):
        for async_op in (True, False):
            salt += 1
            case_all(dtype, n, async_op, salt)
for n in (1, 4097, LIMIT, LIMIT + 1):  # u8: copies only
    ins = all_in(n, torch.uint8, 3)
    out = torch.empty(world * n, device=dev, dtype=torch.uint8)
    dist.all_gather_into_tensor(out, ins[rank])
    check(f"all_gather u8 n={n}", out, torch.cat(ins))
torch.cuda.synchronize()

# 2. the path
path = commd.torch.eager_path()
want_direct = os.environ.get("EAGER_DIRECT_EXPECT", "direct")
if not path.startswith(want_direct):
    failures.append(f"eager path is {path!r}, expected {want_direct!r}")

# 3. two streams, no CPU sync between ops, direct and daemon-path ops mixed
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
# f32 elements: direct, then the daemon's path (an all-reduce past the limit is split into
# direct ops while its share, 1/world of it, is within the limit: this one's is not)
small, large = 4096, world * (max(LIMIT, SHARE) // 4 + 1024)


def two_streams(what: str, counts: list[int], salt: int, on_s1) -> None:
    """All-reduces of ``counts`` f32 elements, op i on s1 where ``on_s1(i)`` else on s2, no
    CPU sync between them: right results."""
    ts = [data(rank, n, torch.float32, salt + i) for i, n in enumerate(counts)]
    wants = [reduce_ref(all_in(n, torch.float32, salt + i), "sum").float()
             for i, n in enumerate(counts)]
    torch.cuda.synchronize()
    for i, x in enumerate(ts):
        # Blocking calls run on the current stream itself (async ones would all go to the
        # backend's communication stream): the communicator's ops alternate between streams.
        with torch.cuda.stream(s1 if on_s1(i) else s2):
            dist.all_reduce(x)
    torch.cuda.synchronize()
    for i, (x, w) in enumerate(zip(ts, wants)):
        check(f"{what} op {i}", x, w)


two_streams("two streams", [small if i % 3 else large for i in range(40)], 100,
            lambda i: i % 2)

# 5. completion without wait()
x = data(rank, 1024, torch.float32, 7)
w = dist.all_reduce(x, async_op=True)
deadline = time.time() + 30
while not w.is_completed() and time.time() < deadline:
    time.sleep(0.001)
if not w.is_completed():
    failures.append("an async direct all_reduce never reported completion without wait()")
w.wait()
check("completion", x, reduce_ref(all_in(1024, torch.float32, 7), "sum").float())

# 6. all-reduces split into direct ops (past the limit, up to world x the largest share, which
# on 3+ ranks is past the limit; on 2 ranks the sizes from world x the limit are chunked, 7)
most = LIMIT // 4  # f32 elements of the largest direct op
top = max(most, SHARE // 4)
split_sizes = sorted({most + 1, 2 * most, 2 * most + 3, world * most, world * top - 1,
                      world * top, world * top + 1, world * (top + 1)})
for n in split_sizes:
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for name, op in OPS.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            if dtype != torch.float32 and name in ("max", "min"):
                continue
            for async_op in (True, False):
                salt += 1
                ins = all_in(n, dtype, salt)
                t = ins[rank].clone()
                w = dist.all_reduce(t, op=op, async_op=async_op)
                if async_op:
                    w.wait()
                check(f"split all_reduce {name} {dtype} n={n} async={async_op}", t,
                      reduce_ref(ins, name).to(dtype), 1e-2 if name == "avg" else 0.0)
# split broadcasts and reduces from every root (a reduce's non-root keeps its input)
for n in split_sizes:
    for dtype in (torch.float32, torch.bfloat16):
        for async_op in (True, False):
            salt += 1
            rooted_all(all_in(n, dtype, salt), dtype, async_op,
                       f"(split) {dtype} n={n} async={async_op}",
                       ("sum", "max") if dtype == torch.float32 else ("sum",))
# split ones and direct ones mixed on two streams
two_streams("split, two streams", [(world * most - 5) if i % 2 else 3000 for i in range(12)],
            300, lambda i: i % 3)


def post_then_next(g, post) -> Exception | None:
    """Runs ``post(g)`` and then the group's next two ops, each to the end on the GPU: the
    error raised, if any. A direct op's failure is raised by the communicator's next call, so
    the second op raises the first's failure, the third the second's (a rank whose ops all
    paired right may still find the group failed by a peer)."""
    try:
        post(g)
        torch.cuda.synchronize()
        for _ in range(2):
            dist.all_reduce(torch.ones(16, device=dev), group=g)
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the error is the finding
        return e
    return None


def mismatch_everywhere(what: str, post, naming: str = "") -> None:
    """``post(group)`` posts mismatched ops on a new group: every rank must raise a mismatch
    (whose message names ``naming``) within 60 s, from the op itself or the group's next one."""
    if want_direct != "direct" and naming == "last part":
        # Every op on the daemon's path (ranks sharing a GPU under auto): nothing is split, so
        # the daemon's mismatch names the counts that differ.
        naming = "count"
    g = dist.new_group(list(range(world)))
    t0 = time.time()
    err = post_then_next(g, post)
    # A rank that reads a peer's flag late may find the peer's next op there, which did not run
    # since the mismatch (ranks sharing a GPU, time-sliced): it is told that the peer's op
    # failed, and the peer's own error names the mismatch.
    peer_failed = "reported that its own op failed" in str(err)
    if err is None:
        failures.append(f"{what}: nothing raised")
    elif not peer_failed and ("mismatch" not in str(err).lower() or naming not in str(err)):
        failures.append(f"{what}: the error is not a mismatch naming {naming!r}: {err}")
    if time.time() - t0 > 60:
        failures.append(f"{what}: took {time.time() - t0:.1f} s to surface")


# counts that differ only in the remainder modulo the ranks
mismatch_everywhere("split all_reduces whose counts differ by one", lambda g: dist.all_reduce(
    data(rank, world * most + (1 if rank == 0 else 0), torch.float32), group=g))


def ar_against_rs(g) -> None:
    if rank == 0:
        dist.all_reduce(data(rank, world * most, torch.float32), group=g)
    else:
        out = torch.empty(most, device=dev, dtype=torch.float32)
        dist.reduce_scatter_tensor(out, data(rank, world * most, torch.float32), group=g)


mismatch_everywhere("a split all_reduce against a reduce_scatter", ar_against_rs)
big = world * most
mismatch_everywhere("split broadcasts whose roots differ", lambda g: dist.broadcast(
    data(rank, big, torch.float32), src=0 if rank == 0 else 1, group=g), naming="root")
mismatch_everywhere("split reduces whose roots differ", lambda g: dist.reduce(
    data(rank, big, torch.float32), dst=0 if rank == 0 else 1, group=g), naming="root")
mismatch_everywhere("a split reduce against a split broadcast", lambda g: (
    dist.reduce if rank == 0 else dist.broadcast)(data(rank, big, torch.float32), 0, group=g))
mismatch_everywhere("a split broadcast against a split all_reduce", lambda g: dist.broadcast(
    data(rank, big, torch.float32), src=0, group=g) if rank == 0 else dist.all_reduce(
    data(rank, big, torch.float32), group=g))

# 7. reduces in chunks past the split: on 2 ranks direct reduces of at most the limit (a share
# past the split's limit), on 3+ splits in the largest shares (world x the share each); the f32
# sizes of 6 that reach them are checked from every root there.
chunk = most if world == 2 else world * top
fewer, more = (3, 4) if world == 2 else (2, 3)
# Rank 0's last chunk meets the others' next one, unmarked: the error names the last part
# (without the mark the others' extra chunk would pair with rank 0's next op).
mismatch_everywhere(f"reduces in {fewer} chunks against {more}", lambda g: dist.reduce(
    data(rank, (fewer if rank == 0 else more) * chunk, torch.float32), dst=0, group=g),
    naming="last part")
mismatch_everywhere("reduces in chunks whose last chunks differ", lambda g: dist.reduce(
    data(rank, chunk + 2 * world + (5 if rank == 0 else 7), torch.float32), dst=1, group=g),
    naming="count")
# After them a reduce in chunks on the default group is still right.
ins = all_in(2 * chunk + 11, torch.float32, 41)
t = ins[rank].clone()
dist.reduce(t, dst=1)
torch.cuda.synchronize()
if rank == 1:
    check("reduce in chunks after the mismatches", t, reduce_ref(ins, "sum").float())

# 4. mismatch on a group of its own: the first op on it (it sets up the group's windows) with
# counts that differ. Its Work may raise at once (the kernel already finished), else the
# group's next call raises.
mismatch_everywhere("a mismatched direct all_reduce", lambda g: dist.all_reduce(
    data(rank, 4096 if rank == 0 else 2048, torch.float32), group=g), naming="count")
# Broadcasts whose roots differ, each rank's root the next rank: forwarded broadcasts
# (COMMD_DIRECT_BCAST_FORWARD_MIN_BYTES) wait for their root before flagging, so each rank waits
# on one that waits in turn; their early signatures must turn that into a mismatch at once.
mismatch_everywhere("broadcasts whose roots differ, each rank's the next", lambda g: dist.broadcast(
    data(rank, 16384, torch.float32), src=(rank + 1) % world, group=g), naming="root")
# Ops of at most 4 KiB move by LL lines (COMMD_DIRECT_LL_MAX_BYTES): counts that differ there,
# and a count there against one past it (one rank moves the op by lines, the other by flags).
mismatch_everywhere("a mismatched all_reduce by LL lines", lambda g: dist.all_reduce(
    data(rank, 512 if rank == 0 else 256, torch.float32), group=g), naming="count")
mismatch_everywhere("an all_reduce by LL lines against one by flags", lambda g: dist.all_reduce(
    data(rank, 512 if rank == 0 else 4096, torch.float32), group=g))


# 8. The daemon's path against a direct op (docs/design-gpu.md, direct collectives rule 8, the
# daemon mark).
def told_of_the_daemon_path(what: str, post, timeout_s: int = 60) -> None:
    """``post(group)`` sends rank 0's op to the direct path and the others' to the daemon's
    (or orders them differently): rank 0 must raise a mismatch naming the daemon's path, from
    the op or the group's next call, and fail the communicator in the daemon, so that the
    others' op (waiting there for rank 0's, which never comes) raises rank 0's words; every
    rank well before the group's op timeout, which would otherwise end the others' wait."""
    g = dist.new_group(list(range(world)), pg_options=commd.torch.Options(op_timeout=timeout_s))
    # The group's eager windows, set up by a first direct op on every rank.
    dist.all_reduce(torch.ones(16, device=dev), group=g)
    torch.cuda.synchronize()
    t0 = time.time()
    err = post_then_next(g, post)
    torch.cuda.synchronize()
    took = time.time() - t0
    if err is None:
        failures.append(f"{what}: nothing raised on rank {rank}")
    elif want_direct != "direct":
        # Every op on the daemon's path: the daemon itself tells every rank of the mismatch.
        if "mismatch" not in str(err).lower():
            failures.append(f"{what}: rank {rank}'s error is not a mismatch: {err}")
    elif "daemon's path" not in str(err) or "mismatch" not in str(err).lower():
        failures.append(f"{what}: rank {rank}'s error does not name the daemon's path: {err}")
    elif rank != 0 and "rank 0" not in str(err):
        failures.append(f"{what}: rank {rank}'s error does not name rank 0: {err}")
    if took > timeout_s / 6:
        failures.append(f"{what}: rank {rank} was told after {took:.1f} s (op timeout {timeout_s} s)")


def gather(g, count: int) -> None:
    out = torch.empty(world * count, device=dev, dtype=torch.float32)
    dist.all_gather_into_tensor(out, data(rank, count, torch.float32), group=g)


past_push = PUSH // 4 + 16
for small, how in ((1024, "by LL lines"), (65536, "by flags")):
    what = f"an all_gather under the push limit {how} against one past it"
    told_of_the_daemon_path(
        what, lambda g, small=small: gather(g, small if rank == 0 else past_push))


def other_order(g) -> None:
    # Rank 0: a direct all_reduce, then an all_gather on the daemon's path; the others the
    # same two the other way round.
    ar = lambda: dist.all_reduce(data(rank, 256, torch.float32), group=g)  # noqa: E731
    ag = lambda: gather(g, past_push)  # noqa: E731
    for f in ((ar, ag) if rank == 0 else (ag, ar)):
        f()


told_of_the_daemon_path("a direct op and a daemon-path op issued in different orders", other_order)

# The default group still works.
y = data(rank, 2048, torch.float32, 9)
dist.all_reduce(y)
check("default group after a mismatch on another", y,
      reduce_ref(all_in(2048, torch.float32, 9), "sum").float())
torch.cuda.synchronize()

print(f"rank {rank}: eager path {path!r}; {len(failures)} failure(s)", flush=True)
for f in failures[:20]:
    print(f"rank {rank}: FAIL {f}", flush=True)
print(("PASS" if not failures else "FAIL") + f" eager_direct rank {rank}", flush=True)
sys.stdout.flush()
os._exit(0 if not failures else 1)
