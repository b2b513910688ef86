"""One rank of a torch.distributed job on the "commd" backend, for tests/test_torch.py.

Launched by torchrun, by mpirun, or directly with RANK/WORLD_SIZE/MASTER_* set. Usage:
``torch_worker.py SCENARIO [ARGS...]``. Prints ``PASS rank R`` on success; any failed check
raises (non-zero exit) with the op, dtype and first differing element.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import commd
import commd.torch  # noqa: F401 - registers the backend

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]
R = dist.ReduceOp


def log(msg: str) -> None:
    print(f"[rank {os.environ.get('RANK')}] {msg}", flush=True)


def tol(dt: torch.dtype) -> dict[str, float]:
    if dt in (torch.float16, torch.bfloat16):
        return {"rtol": 2e-2, "atol": 1e-2}
    if dt == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    return {"rtol": 1e-12, "atol": 0.0}


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{name}: got {got.dtype}{list(got.shape)}, "
                             f"want {want.dtype}{list(want.shape)}")
    if got.dtype.is_floating_point or got.is_complex():
        ok = torch.isclose(got.double() if not got.is_complex() else got,
                           want.double() if not want.is_complex() else want,
                           **tol(got.dtype), equal_nan=True)
    else:
        ok = got == want
    if not bool(ok.all()):
        bad = (~ok).flatten().nonzero()[0].item()
        raise AssertionError(f"{name}: element {bad}: got {got.flatten()[bad].item()}, "
                             f"want {want.flatten()[bad].item()} "
                             f"({int((~ok).sum())} of {ok.numel()} differ)")


def data(rank: int, n: int, dt: torch.dtype, salt: int = 0, small: bool = False) -> torch.Tensor:
    """Deterministic per-rank input; `small` keeps products in range for narrow dtypes."""
    i = torch.arange(n, dtype=torch.int64)
    if small:
        v = (i + rank + salt) % 3 + 1
    elif dt.is_floating_point:
        return ((i * 7 + rank * 13 + salt) % 101).to(torch.float64).div(8).to(dt) - rank
    else:
        v = (i * 7 + rank * 13 + salt) % 101
    if dt == torch.bool:
        return (v % 2).bool()
    return v.to(dt)


def gloo_or_none(fn) -> bool:
    """Runs the gloo side; False if gloo does not implement that op/dtype."""
    try:
        fn()
        return True
    except (RuntimeError, ValueError, TypeError) as e:
        msg = str(e)
        if "not supported" in msg.lower() or "unsupported" in msg.lower() \
                or "does not support" in msg \
                or "Invalid" in msg or "Cannot use" in msg or "can't be cast" in msg:
            return False
        raise


def scenario_ops(gloo: dist.ProcessGroup) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    N = 1000  # an odd size on purpose
    checked = {"gloo": 0, "reference": 0}

    def compare(name, run, dt, ref=None, use_gloo=True):
        """run(group) -> tensor or list of tensors; compare commd vs gloo (or the reference)."""
        ours = run(None)
        theirs = None
        if use_gloo and gloo_or_none(lambda: theirs_box.append(run(gloo))):
            theirs = theirs_box.pop()
            checked["gloo"] += 1
        elif ref is not None:
            theirs = ref()
            checked["reference"] += 1
        else:
            raise AssertionError(f"{name}: gloo cannot run it and no reference was given")
        ours_l = ours if isinstance(ours, list) else [ours]
        theirs_l = theirs if isinstance(theirs, list) else [theirs]
        for k, (a, b) in enumerate(zip(ours_l, theirs_l, strict=True)):
            check(f"{name}[{k}] {dt}", a, b)

    theirs_box: list = []

    # all_reduce: every dtype x op; AVG is not in gloo, so it is checked against a reference.
    for dt in DTYPES:
        ops = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG] + ([R.BAND, R.BOR, R.BXOR] if dt in INTS else [])
        for op in ops:
            small = op == R.PRODUCT

            def run(g, dt=dt, op=op, small=small):
                t = data(rank, N, dt, small=small)
                dist.all_reduce(t, op=op, group=g)
                return t

            def ref(dt=dt, op=op, small=small):
                xs = torch.stack([data(r, N, dt, small=small).double() for r in range(n)])
                if op == R.AVG:
                    s = xs.sum(0) / n
                    # Integers: NCCL's definition, the sum wrapped in the dtype, then divided.
                    return s.to(dt) if dt.is_floating_point else torch.div(
                        xs.sum(0).long().to(dt).long(), n, rounding_mode="trunc").to(dt)
                raise AssertionError("reference only for AVG")

            compare(f"all_reduce {op}", run, dt, ref if op == R.AVG else None)

    # bool all_reduce (logical), complex sum, non-contiguous, async + future
    def run_bool(g):
        t = data(rank, N, torch.bool)
        dist.all_reduce(t, op=R.MAX, group=g)
        return t
    compare("all_reduce bool max", run_bool, torch.bool,
            lambda: torch.stack([data(r, N, torch.bool) for r in range(n)]).any(0))

    def run_complex(g):
        t = torch.complex(data(rank, N, torch.float32), data(rank, N, torch.float32, 5))
        dist.all_reduce(t, group=g)
        return t
    compare("all_reduce complex64", run_complex, torch.complex64)

    def run_noncontig(g):
        base = data(rank, 40 * 30, torch.float32).view(40, 30)
        t = base.t()[::2]  # strided view
        dist.all_reduce(t, group=g)
        return base
    def ref_noncontig():
        # gloo reduces the whole storage of a strided view (elements outside it too), so the
        # reference is computed here: only the view's elements are reduced.
        base = data(rank, 40 * 30, torch.float32).view(40, 30)
        total = sum(data(r, 40 * 30, torch.float32).view(40, 30) for r in range(n))
        base.t()[::2] = total.t()[::2]
        return base
    compare("all_reduce non-contiguous", run_noncontig, torch.float32, ref_noncontig,
            use_gloo=False)

    def run_async(g):
        t = data(rank, N, torch.float64)
        w = dist.all_reduce(t, async_op=True, group=g)
        fut = w.get_future()
        got = fut.wait()
        if g is None:  # commd: done once its future is (gloo's Work may lag its future)
            assert w.is_completed()
        w.wait()
        assert w.is_completed()
        return got[0] if isinstance(got, list) else got
    compare("all_reduce async/future", run_async, torch.float64)

    # coalesced all-reduce through the coalescing manager
    def run_coalesced(g):
        ts = [data(rank, 100 + k, torch.float32, salt=k) for k in range(3)]
        group = g or dist.group.WORLD
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, group=g)
        cm.wait()
        return ts
    compare("all_reduce coalesced", run_coalesced, torch.float32)

    # the same with the device named: the backend's own coalescing (startCoalescing /
    # endCoalescing: one Work for the block); gloo has none, so against sums made here
    def run_coalesced_device(g):
        ts = [data(rank, 100 + k, torch.float32, salt=k) for k in range(3)]
        with dist._coalescing_manager(group=g or dist.group.WORLD, device=torch.device("cpu"),
                                      async_ops=True) as cm:
            for t in ts:
                dist.all_reduce(t, group=g)
        cm.wait()
        return ts

    def sums_coalesced():
        return [sum(data(r, 100 + k, torch.float32, salt=k) for r in range(n)) for k in range(3)]
    compare("all_reduce coalesced on a device", run_coalesced_device, torch.float32,
            sums_coalesced, use_gloo=False)

    # ops that are not coalesced into one call (broadcasts) in a device block: each issued,
    # the block's Work waits for all of them
    def run_block_of_broadcasts(g):
        ts = [data(rank, 64, torch.float32, salt=k) for k in range(3)]
        with dist._coalescing_manager(group=g or dist.group.WORLD, device=torch.device("cpu"),
                                      async_ops=True) as cm:
            for k, t in enumerate(ts):
                dist.broadcast(t, src=k % n, group=g, async_op=True)
        cm.wait()
        return ts
    compare("broadcasts in a coalescing block", run_block_of_broadcasts, torch.float32,
            lambda: [data(k % n, 64, torch.float32, salt=k) for k in range(3)], use_gloo=False)

    # batch_isend_irecv: a ring (through the coalescing manager on commd, op by op on gloo)
    def run_batch_ring(g):
        out = torch.zeros(33)
        ops = [dist.P2POp(dist.isend, data(rank, 33, torch.float32), (rank + 1) % n, g),
               dist.P2POp(dist.irecv, out, (rank - 1) % n, g)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return out
    compare("batch_isend_irecv ring", run_batch_ring, torch.float32)

    # the group's sequence number: +1 per collective, +1 per coalesced block, 0 per send/recv
    # (read from the backend: torch 2.11's ProcessGroup answers only for its own backends)
    pg = dist.group.WORLD
    seq = pg._get_backend(torch.device("cpu"))._get_sequence_number_for_group
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 15):
        # torch >= 2.15's group forwards to its backend
        assert pg._get_sequence_number_for_group() == seq()
    s0 = seq()
    t = torch.ones(8)
    dist.all_reduce(t)
    dist.barrier()
    s1 = seq()
    with dist._coalescing_manager(group=pg, device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(t)
        dist.all_reduce(t)
    cm.wait()
    s2 = seq()
    if n > 1:
        peer = rank ^ 1
        if peer < n:
            (dist.send if rank % 2 == 0 else dist.recv)(t, peer)
    s3 = seq()
    assert (s1 - s0, s2 - s1, s3 - s2) == (2, 1, 0), (s0, s1, s2, s3)

    for dt in DTYPES + [torch.bool, torch.complex64]:
        def mk(r, m=N, salt=0, dt=dt):
            if dt == torch.complex64:
                return torch.complex(data(r, m, torch.float32, salt), data(r, m, torch.float32, 1))
            return data(r, m, dt, salt)

        def run_bcast(g, dt=dt):
            t = mk(rank)
            dist.broadcast(t, src=n - 1, group=g)
            return t
        compare("broadcast", run_bcast, dt, lambda: mk(n - 1))

        def run_ag(g, dt=dt):
            outs = [torch.zeros(N, dtype=dt) if dt != torch.bool else torch.zeros(N, dtype=dt)
                    for _ in range(n)]
            dist.all_gather(outs, mk(rank), group=g)
            return outs
        compare("all_gather", run_ag, dt, lambda: [mk(r) for r in range(n)])

        def run_agt(g, dt=dt):
            out = torch.zeros(n * N, dtype=dt)
            dist.all_gather_into_tensor(out, mk(rank), group=g)
            return out
        compare("all_gather_into_tensor", run_agt, dt, lambda: torch.cat([mk(r) for r in range(n)]))

    for dt in DTYPES:
        for op in (R.SUM, R.MAX):
            def run_rs(g, dt=dt, op=op):
                out = torch.zeros(N, dtype=dt)
                dist.reduce_scatter(out, [data(rank, N, dt, salt=j) for j in range(n)], op=op,
                                    group=g)
                return out
            compare(f"reduce_scatter {op}", run_rs, dt)

            def run_rst(g, dt=dt, op=op):
                out = torch.zeros(N, dtype=dt)
                dist.reduce_scatter_tensor(out, data(rank, n * N, dt), op=op, group=g)
                return out
            compare(f"reduce_scatter_tensor {op}", run_rst, dt)

            def run_reduce(g, dt=dt, op=op):
                t = data(rank, N, dt)
                dist.reduce(t, dst=1 % n, op=op, group=g)
                return t if rank == 1 % n else data(rank, N, dt)
            compare(f"reduce {op}", run_reduce, dt)

    # all_to_all_single: even, and uneven splits (rank r sends j+1 rows of 3 to rank j)
    def run_a2a_even(g):
        x = data(rank, n * 6, torch.float32)
        out = torch.zeros_like(x)
        dist.all_to_all_single(out, x, group=g)
        return out
    compare("all_to_all_single even", run_a2a_even, torch.float32)

    def uneven(g):
        in_splits = [j + 1 + rank for j in range(n)]
        out_splits = [rank + 1 + j for j in range(n)]
        x = data(rank, sum(in_splits) * 3, torch.int64).view(-1, 3)
        out = torch.full((sum(out_splits), 3), -1, dtype=torch.int64)
        dist.all_to_all_single(out, x, out_splits, in_splits, group=g)
        return out
    compare("all_to_all_single uneven", uneven, torch.int64)

    def a2a_list(g):
        ins = [data(rank, 2 + j + rank, torch.float64, salt=j) for j in range(n)]
        outs = [torch.zeros(2 + rank + j, dtype=torch.float64) for j in range(n)]
        dist.all_to_all(outs, ins, group=g)
        return outs
    # gloo requires equal sizes here, so uneven lists are checked against a reference.
    compare("all_to_all list uneven", a2a_list, torch.float64,
            lambda: [data(j, 2 + rank + j, torch.float64, salt=rank) for j in range(n)],
            use_gloo=False)

    def a2a_list_even(g):
        ins = [data(rank, 5, torch.int32, salt=j) for j in range(n)]
        outs = [torch.zeros(5, dtype=torch.int32) for _ in range(n)]
        dist.all_to_all(outs, ins, group=g)
        return outs
    compare("all_to_all list", a2a_list_even, torch.int32,
            lambda: [data(j, 5, torch.int32, salt=rank) for j in range(n)])

    # gather / scatter
    def run_gather(g):
        outs = [torch.zeros(N, dtype=torch.int32) for _ in range(n)] if rank == 0 else None
        dist.gather(data(rank, N, torch.int32), outs, dst=0, group=g)
        return outs if rank == 0 else [torch.zeros(1)]
    compare("gather", run_gather, torch.int32)

    def run_scatter(g):
        out = torch.zeros(N, dtype=torch.float32)
        ins = [data(j, N, torch.float32, salt=7) for j in range(n)] if rank == n - 1 else None
        dist.scatter(out, ins, src=n - 1, group=g)
        return out
    compare("scatter", run_scatter, torch.float32)

    # send/recv: a ring, blocking with even/odd ordering, then isend/irecv and batch_isend_irecv
    def run_ring(g):
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        mine = data(rank, N, torch.float32)
        got = torch.zeros(N, dtype=torch.float32)
        if rank % 2 == 0:
            dist.send(mine, nxt, group=g)
            dist.recv(got, prv, group=g)
        else:
            dist.recv(got, prv, group=g)
            dist.send(mine, nxt, group=g)
        got2 = torch.zeros(N, dtype=torch.float32)
        reqs = [dist.isend(mine, nxt, group=g), dist.irecv(got2, prv, group=g)]
        for q in reqs:
            q.wait()
        got3 = torch.zeros(N, dtype=torch.float32)
        ops = [dist.P2POp(dist.isend, mine, nxt, group=g),
               dist.P2POp(dist.irecv, got3, prv, group=g)]
        for q in dist.batch_isend_irecv(ops):
            q.wait()
        return [got, got2, got3]
    compare("send/recv ring", run_ring, torch.float32,
            lambda: [data((rank - 1) % n, N, torch.float32)] * 3)

    dist.barrier()
    dist.barrier(group=gloo)

    # a bitwise op on floats must be a clear error, not garbage
    try:
        dist.all_reduce(torch.ones(4), op=R.BXOR)
    except ValueError as e:
        assert "integer" in str(e), e
    else:
        raise AssertionError("BXOR on float32 did not raise")
    try:
        dist.all_reduce(torch.ones(4, dtype=torch.int16))
    except ValueError as e:
        assert "int16" in str(e), e
    else:
        raise AssertionError("int16 all_reduce did not raise")
    log(f"compared {checked['gloo']} ops with gloo, {checked['reference']} with a reference")


def scenario_ddp(gloo: dist.ProcessGroup, steps: int) -> None:
    rank = dist.get_rank()

    def train(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                        bucket_cap_mb=0.001)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(1234 + rank)
        for _ in range(steps):
            x = torch.randn(8, 16, generator=g)
            y = torch.randn(8, 4, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    ours = train(dist.group.WORLD)
    theirs = train(gloo)
    moved = False
    torch.manual_seed(0)
    init = [p.detach() for p in torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                    torch.nn.Linear(32, 4)).parameters()]
    for k, (a, b, c) in enumerate(zip(ours, theirs, init, strict=True)):
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
            raise AssertionError(f"DDP parameter {k} differs from gloo by "
                                 f"{(a - b).abs().max().item()}")
        moved |= not torch.equal(a, c)
    assert moved, "training did not change the parameters"
    # every rank must hold the same parameters
    flat = torch.cat([p.flatten() for p in ours])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    check("DDP parameters equal across ranks", flat, ref)
    log(f"DDP {steps} steps match gloo")


def scenario_error(kind: str) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    if kind == "kill" and rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "mismatch":
        t = torch.ones(10 if rank == 0 else 20)
    else:
        t = torch.ones(10)
    # torch's Backend.getError (newer torch; the C++ shell answers it): SUCCESS now
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    get_error = getattr(backend, "get_error", None)
    e0 = int(get_error().value) if get_error else None
    t0 = time.monotonic()
    want = commd.MismatchError if kind == "mismatch" else commd.PeerLostError
    try:
        if kind == "kill":
            time.sleep(0.2)  # let the victim die first
            t0 = time.monotonic()
        dist.all_reduce(t)
    except want as e:
        dt = time.monotonic() - t0
        print(f"RAISED {type(e).__name__} after {dt:.3f}s: {e}", flush=True)
        assert isinstance(e, commd.CommError)
        if get_error:
            print(f"ERRORTYPE {e0} {int(get_error().value)}", flush=True)
        os._exit(0)
    except Exception as e:  # noqa: BLE001
        print(f"WRONG {type(e).__name__}: {e}", flush=True)
        os._exit(3)
    print("NO ERROR", flush=True)
    os._exit(4)


def pacing_in_status(comm_id: int) -> int | None:
    """This communicator's GPU pacing cap (bytes/s, None: uncapped) as `commd status` shows it."""
    out = subprocess.run([os.environ["COMMD_BIN"], "status", "--json", "--socket",
                          os.environ["COMMD_SOCKET"]],
                         capture_output=True, text=True, timeout=10, check=True)
    for c in json.loads(out.stdout)["communicator_list"]:
        if c["comm_id"] == comm_id:
            return c["pacing_bytes_per_sec"]
    raise AssertionError(f"communicator {comm_id} is not in commd status: {out.stdout}")


def scenario_pacing(gloo: dist.ProcessGroup, created_gbps: float) -> None:
    """COMMD_COMM_PACING_GBPS at creation, then commd.torch.set_pacing from either rank."""
    rank = dist.get_rank()
    backend = commd.torch.backend()
    comm_id = backend.comm.id

    def expect(gbps: float | None) -> None:
        want = None if gbps is None else round(gbps * 1e9)
        got = pacing_in_status(comm_id)
        if got != want:
            raise AssertionError(f"commd status shows pacing {got}, expected {want}")

    expect(created_gbps)
    dist.barrier()
    if rank == 1:
        commd.torch.set_pacing(6.5)
    dist.barrier()
    expect(6.5)
    dist.barrier()
    if rank == 0:
        commd.torch.set_pacing(None, group=dist.group.WORLD)
    dist.barrier()
    expect(None)
    # Both ranks have read "uncapped" before either sets the next cap.
    dist.barrier()
    for bad in (-1.0, float("nan")):
        try:
            commd.torch.set_pacing(bad)
        except ValueError as e:
            assert "GB/s" in str(e), e
        else:
            raise AssertionError(f"set_pacing({bad}) did not raise")
    try:
        commd.torch.set_pacing(1.0, group=gloo)
    except ValueError as e:
        assert "does not use the commd backend" in str(e), e
    else:
        raise AssertionError("set_pacing on a gloo group did not raise")
    # CPU collectives are not paced, and run as before under a cap.
    commd.torch.set_pacing(0.5)
    t = torch.full((1000,), float(rank + 1))
    dist.all_reduce(t)
    check("all_reduce under a cap", t, torch.full((1000,), 3.0))
    dist.barrier()
    expect(0.5)
    log("pacing: creation value, set_pacing from both ranks and errors checked")


def scenario_dtypes() -> None:
    """Data movement on a few dtypes (tests/test_torch.py reads the daemon's metrics after it:
    each op must be counted under the tensor's own dtype, not as bytes)."""
    rank = dist.get_rank()
    n = dist.get_world_size()
    b = torch.full((8,), float(rank), dtype=torch.bfloat16)
    dist.broadcast(b, 0)
    check("broadcast bf16", b, torch.zeros(8, dtype=torch.bfloat16))
    x = torch.arange(5, dtype=torch.int64) + 10 * rank
    out = torch.empty(5 * n, dtype=torch.int64)
    dist.all_gather_into_tensor(out, x)
    check("all_gather i64", out, torch.cat([torch.arange(5) + 10 * r for r in range(n)]))
    h = torch.full((4 * n,), float(rank), dtype=torch.float16)
    got = torch.empty_like(h)
    dist.all_to_all_single(got, h)
    check("all_to_all f16", got, torch.arange(n, dtype=torch.float16).repeat_interleave(4))
    log("dtypes: broadcast bf16, all_gather i64, all_to_all f16")


def scenario_premul() -> None:
    """ReduceOp.PREMUL_SUM (FSDP2's gradient divide factor): sum over ranks of factor * x, with
    a Python or a tensor factor; inputs an op must not change stay unchanged."""
    rank, n = dist.get_rank(), dist.get_world_size()
    x = lambda r: torch.arange(6, dtype=torch.float32) + 10 * r  # noqa: E731
    want = 0.25 * sum(x(r) for r in range(n))
    t = x(rank)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.25))
    check("all_reduce premul 0.25", t, want)
    t = x(rank)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.25])), async_op=True).wait()
    check("all_reduce premul tensor factor", t, want)
    big = torch.cat([x(rank) + r for r in range(n)])
    keep = big.clone()
    out = torch.empty(6)
    dist.reduce_scatter_tensor(out, big, op=dist._make_nccl_premul_sum(0.5))
    check("reduce_scatter_tensor premul", out, 0.5 * sum(x(r) + rank for r in range(n)))
    check("reduce_scatter_tensor premul leaves its input", big, keep)
    t = x(rank)
    dist.reduce(t, 0, op=dist._make_nccl_premul_sum(2.0))
    check("reduce premul", t, 2.0 * sum(x(r) for r in range(n)) if rank == 0 else x(rank))
    ts = [x(rank), x(rank)[:3].clone()]
    dist.all_reduce_coalesced(ts, op=dist._make_nccl_premul_sum(0.25))
    check("all_reduce_coalesced premul", ts[1], want[:3])
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.int64), op=dist._make_nccl_premul_sum(0.5))
        raise AssertionError("PREMUL_SUM on an int64 tensor did not raise")
    except ValueError as e:
        assert "floating-point" in str(e), e
    dist.barrier()
    log("premul: all_reduce, reduce_scatter_tensor, reduce, coalesced, int64 refused")


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def fp8_ref(ins: list[torch.Tensor], op: str, dt: torch.dtype) -> torch.Tensor:
    """NCCL's fp8 reduction with torch's own conversions: float32 in rank order, then rounded
    to the dtype and saturated at its largest finite value (clamp keeps NaNs)."""
    a = ins[0].float()
    for b in ins[1:]:
        b = b.float()
        a = {"sum": a + b, "avg": a + b, "prod": a * b, "min": torch.where(b < a, b, a),
             "max": torch.where(b > a, b, a)}[op]
    if op == "avg":
        a = a / len(ins)
    return a.clamp(-FP8_MAX[dt], FP8_MAX[dt]).to(dt)


def check_fp8(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, except that a NaN matches any NaN (its sign is not specified)."""
    g, w = got.view(torch.uint8), want.view(torch.uint8)
    nan_g, nan_w = got.float().isnan(), want.float().isnan()
    bad = ((g != w) & ~(nan_g & nan_w)).nonzero()
    if bad.numel():
        i = bad[0].item()
        raise AssertionError(f"{name}: element {i}: got {g[i].item():#x}, want {w[i].item():#x} "
                             f"({bad.numel()} of {g.numel()} differ)")


def scenario_typed(device: str) -> None:
    """fp8 (float8_e4m3fn, float8_e5m2) and uint32/uint64 reductions, as torch's fp8 training
    and NCCL run them: every op over codes of the whole range (NaN, infinities, overflow), the
    fp8 PREMUL_SUM, a reduce_scatter and an all_gather, against references made here on the
    CPU. ``device`` "cuda": the tensors on the rank's GPU (ranks may share one), which runs the
    GPU reduction kernels, with a 4 Mi-element all-reduce beside the small ones."""
    rank, n = dist.get_rank(), dist.get_world_size()
    if device == "cuda":
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    ops = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN,
           "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}

    def codes(r: int, dt: torch.dtype, k: int, salt: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(7919 * r + salt)
        return torch.randint(0, 256, (k,), generator=g, dtype=torch.uint8).view(dt)

    sizes = [2053, 4 << 20] if dev.type == "cuda" else [2053]
    for dt in FP8_MAX:
        for k in sizes:
            for salt, (name, op) in enumerate(ops.items()):
                t = codes(rank, dt, k, salt).to(dev)
                dist.all_reduce(t, op=op)
                check_fp8(f"all_reduce {dt} {name} x{k}", t.cpu(),
                          fp8_ref([codes(r, dt, k, salt) for r in range(n)], name, dt))
        t = codes(rank, dt, 1031, 99).to(dev)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
        scaled = [fp8_ref([codes(r, dt, 1031, 99).float().mul(0.5).clamp(
            -FP8_MAX[dt], FP8_MAX[dt]).to(dt)], "sum", dt) for r in range(n)]
        check_fp8(f"all_reduce {dt} premul 0.5", t.cpu(), fp8_ref(scaled, "sum", dt))
        big = codes(rank, dt, 64 * n, 123).to(dev)
        out = torch.empty(64, dtype=dt, device=dev)
        dist.reduce_scatter_tensor(out, big)
        full = fp8_ref([codes(r, dt, 64 * n, 123) for r in range(n)], "sum", dt)
        check_fp8(f"reduce_scatter_tensor {dt}", out.cpu(), full[rank * 64:(rank + 1) * 64])
        gathered = torch.empty(33 * n, dtype=dt, device=dev)
        dist.all_gather_into_tensor(gathered, codes(rank, dt, 33, 5).to(dev))
        check_fp8(f"all_gather_into_tensor {dt}", gathered.cpu(),
                  torch.cat([codes(r, dt, 33, 5) for r in range(n)]))
    for dt, npt in ((torch.uint32, np.uint32), (torch.uint64, np.uint64)):
        def ints(r: int, salt: int) -> np.ndarray:
            return np.random.default_rng(31 * r + salt).integers(
                0, np.iinfo(npt).max, 1000, dtype=npt, endpoint=True)
        for salt, (name, op) in enumerate(ops.items()):
            t = torch.from_numpy(ints(rank, salt)).to(dev)
            assert t.dtype == dt
            dist.all_reduce(t, op=op)
            t = t.cpu()
            ins = [ints(r, salt) for r in range(n)]
            if name == "avg":
                # NCCL's definition: the sum wrapped in the dtype, then divided.
                want = np.add.reduce(np.stack(ins), dtype=npt) // npt(n)
            else:
                f = {"sum": np.add, "prod": np.multiply, "min": np.minimum,
                     "max": np.maximum}[name]
                want = f.reduce(np.stack(ins), dtype=npt)
            bad = np.flatnonzero(t.numpy() != want)
            assert bad.size == 0, f"all_reduce {dt} {name}: {bad.size} wrong, first {bad[0]}"
    log(f"typed on {dev}: fp8 e4m3/e5m2 every op, premul, reduce_scatter, all_gather; "
        "uint32/uint64 every op")


def scenario_cpu_alloc(gloo: dist.ProcessGroup, mode: str) -> None:
    """Large ordinary CPU tensors: with commd's CPU allocator (mode "on") every op runs in place
    on the tensor's own memory, moved into shared memory by its first op and registered once;
    results equal gloo's. Mode "off" (COMMD_CPU_ALLOC=0): the allocator is not used at all and
    results are the same."""
    from commd import _native

    rank, n = dist.get_rank(), dist.get_world_size()
    N = (1 << 20) + 3  # 4 MiB of f32 and a bit: not a whole number of pages
    stats = _native.host_blocks

    def both(name, run, dt=torch.float32):
        ours, theirs = run(None), run(gloo)
        ours_l = ours if isinstance(ours, list) else [ours]
        theirs_l = theirs if isinstance(theirs, list) else [theirs]
        for k, (a, b) in enumerate(zip(ours_l, theirs_l, strict=True)):
            check(f"{name}[{k}]", a, b)

    def ar(g, op=R.SUM, dt=torch.float32):
        t = data(rank, N, dt)
        dist.all_reduce(t, op=op, group=g)
        return t

    for dt in (torch.float32, torch.bfloat16, torch.int64):
        both(f"all_reduce {dt}", lambda g, dt=dt: ar(g, dt=dt), dt)
    both("all_reduce max", lambda g: ar(g, R.MAX))

    def bc(g):
        t = data(rank, N, torch.float32)
        dist.broadcast(t, 1 % n, group=g)
        return t
    both("broadcast", bc)

    def ag(g):  # out of place: input and output are two blocks
        inp = data(rank, N, torch.float32)
        out = torch.empty(n * N)
        dist.all_gather_into_tensor(out, inp, group=g)
        return out
    both("all_gather_into_tensor", ag)

    def rs(g):
        inp = data(rank, n * N, torch.float32)
        out = torch.empty(N)
        dist.reduce_scatter_tensor(out, inp, group=g)
        return out
    if gloo_or_none(lambda: rs(gloo)):
        both("reduce_scatter_tensor", rs)

    def a2a(g):
        inp = data(rank, n * N, torch.float32)
        out = torch.empty(n * N)
        dist.all_to_all_single(out, inp, group=g)
        return out
    both("all_to_all_single", a2a)

    def view(g):  # an op on a view at an offset inside a larger block
        big = data(rank, 3 * N, torch.float32)
        dist.all_reduce(big[N + 5:2 * N + 5], group=g)
        return big
    both("all_reduce of a view", view)

    def p2p(g):
        t = data(rank, N, torch.float32) if rank == 0 else torch.zeros(N)
        if rank == 0:
            dist.send(t, 1, group=g)
        elif rank == 1:
            dist.recv(t, 0, group=g)
        return t
    both("send/recv", p2p)

    s0 = stats()
    if mode == "off":
        if s0["allocs"] != 0:
            raise AssertionError(f"COMMD_CPU_ALLOC=0, yet commd's allocator served tensors: {s0}")
        log(f"cpu_alloc off: results equal gloo's, allocator unused {s0}")
        return
    if s0["moved"] < 5 or s0["registered"] < 5:
        raise AssertionError(f"ops on large tensors did not run in place: {s0}")
    if mode == "nocache":
        # COMMD_CPU_CACHE_MIB=0: every freed block is unmapped and its registration dropped
        # (by the helper thread), so the daemon's registrations do not grow with the loop.
        def regs() -> int:
            dist.barrier(group=gloo)
            time.sleep(0.5)  # the helper thread's deregistrations
            r = commd.connect().status()["registrations"]
            dist.barrier(group=gloo)
            return r
        r0 = regs()
        for i in range(10):
            t = torch.ones(N + 4096 * i)  # a new page count every time
            dist.all_reduce(t)
            check(f"all_reduce {i}", t, torch.full((N + 4096 * i,), float(n)))
            del t
        r1 = regs()
        if r1 - r0 > 3 * n:
            raise AssertionError(f"registrations grew from {r0} to {r1} over 10 freed tensors "
                                 f"per rank: freed blocks were not deregistered")
        log(f"cpu_alloc nocache: results equal gloo's, registrations {r0} -> {r1}")
        return

    # A steady loop: the same tensor again, then a new tensor of the same size (a reused block)
    # costs no move and no registration.
    x = data(rank, N, torch.float32)
    dist.all_reduce(x)
    s1 = stats()
    for _ in range(3):
        dist.all_reduce(x)
    s_same = stats()
    if (s_same["moved"], s_same["registered"]) != (s1["moved"], s1["registered"]):
        raise AssertionError(f"the same tensor again moved or registered again: {s1} -> {s_same}")
    del x
    y = torch.empty(N)
    y.fill_(rank + 1)
    dist.all_reduce(y)
    check("all_reduce of a reused block", y, torch.full((N,), float(n * (n + 1) // 2)))
    s2 = stats()
    # The new tensor reuses a cached block; at most one of them may be one not registered yet.
    if (s2["moved"] - s1["moved"] > 1 or s2["registered"] - s1["registered"] > 1
            or s2["reused"] <= s1["reused"]):
        raise AssertionError(f"a steady loop moved or registered again: {s1} -> {s2}")

    # fork: the child gets the tensor as it was at the fork, private; neither sees the other's
    # later writes.
    if rank == 0:
        before = y.clone()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(w)
                os.read(r, 1)  # the parent has written y by now
                if not torch.equal(y, before):
                    log("child: the parent's write after the fork shows in the child")
                    code = 3
                y.fill_(-1.0)
                if stats()["fork_copies"] < 1:
                    code = 4
            except BaseException as e:  # noqa: BLE001 - reported by the exit code
                log(f"child: {e!r}")
                code = 5
            os._exit(code)
        os.close(r)
        y.fill_(7.0)
        os.write(w, b"x")
        os.close(w)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise AssertionError(f"forked child failed: exit {os.waitstatus_to_exitcode(status)}")
        check("parent after the child wrote", y, torch.full((N,), 7.0))
    dist.barrier()
    y.fill_(rank + 1)
    dist.all_reduce(y)
    check("all_reduce after a fork", y, torch.full((N,), float(n * (n + 1) // 2)))
    log(f"cpu_alloc on: results equal gloo's, in place {stats()}")


def scenario_exit_futures(gloo: dist.ProcessGroup, n: int) -> None:
    """Ops whose futures nobody waits on (commd's progress thread completes them, as for DDP's
    reducer), still in flight when the process exits: the exit must not kill that thread while
    it is in torch's C++ (the process would end in std::terminate, SIGABRT)."""
    futs = []
    for i in range(n):
        t = torch.full((4096,), float(i))
        work = dist.all_reduce(t, async_op=True)
        futs.append(work.get_future().then(lambda f: f.value()[0].sum()))
    dist.barrier(group=gloo)  # both ranks exit together, the ops still completing
    log(f"exit_futures: {n} ops issued, exiting with their futures pending")


def main() -> None:
    scenario = sys.argv[1]
    dist.init_process_group("commd", timeout=timedelta(seconds=60))
    assert dist.get_backend() == "commd", dist.get_backend()
    if scenario.startswith("error-"):
        scenario_error(scenario.split("-", 1)[1])
        return
    gloo = dist.new_group(backend="gloo")
    if scenario == "ops":
        scenario_ops(gloo)
    elif scenario == "ddp":
        scenario_ddp(gloo, int(sys.argv[2]) if len(sys.argv) > 2 else 20)
    elif scenario == "pacing":
        scenario_pacing(gloo, float(sys.argv[2]))
    elif scenario == "dtypes":
        scenario_dtypes()
    elif scenario == "premul":
        scenario_premul()
    elif scenario == "typed":
        scenario_typed(sys.argv[2] if len(sys.argv) > 2 else "cpu")
    elif scenario == "cpu_alloc":
        scenario_cpu_alloc(gloo, sys.argv[2])
    elif scenario == "exit_futures":
        scenario_exit_futures(gloo, int(sys.argv[2]))
        print(f"PASS rank {os.environ['RANK']}", flush=True)
        return  # no barrier and no destroy: the interpreter exits with the ops in flight
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    dist.barrier()
    dist.destroy_process_group()
    print(f"PASS rank {os.environ['RANK']}", flush=True)


if __name__ == "__main__":
    main()
