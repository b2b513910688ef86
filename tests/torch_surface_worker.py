"""The torch.distributed surface beyond the basic collectives, run the same way on a backend
under test and on gloo (tests/test_torch_surface.py compares them). Each check prints one JSON
line per rank: {"check": NAME, "ok": bool, "error": text}.

    torchrun --nproc_per_node N tests/torch_surface_worker.py BACKEND [CHECK ...]
"""

import json
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import commd.torch  # noqa: F401  (registers "commd")
import commd

CHECKS = {}


def check(f):
    CHECKS[f.__name__] = f
    return f


def drain(world, got):
    """Receives the senders' messages not received yet (named sources), so a failed
    any-source check leaves no send waiting."""
    for src in range(1, world):
        if src not in got:
            dist.recv(torch.zeros(4), src)


@check
def recv_any_source(rank, world):
    if rank == 0:
        got = set()
        try:
            for _ in range(world - 1):
                t = torch.zeros(4)
                src = dist.recv(t)
                assert src is not None and 0 < src < world, src
                assert t.eq(src).all(), (t, src)
                got.add(src)
        except Exception:
            drain(world, got)
            raise
        assert got == set(range(1, world)), got
    else:
        dist.send(torch.full((4,), float(rank)), 0)


@check
def irecv_any_source(rank, world):
    if rank == 0:
        t = torch.zeros(4)
        try:
            w = dist.irecv(t)
            w.wait()
        except Exception:
            drain(world, set())
            raise
        src = w._source_rank()
        assert 0 < src < world and t.eq(src).all(), (src, t)
        drain(world, {src})
    else:
        dist.send(torch.full((4,), float(rank)), 0)


@check
def any_source_then_named(rank, world):
    """A receive from any source, then a receive naming rank 1, and rank 1 sends two messages:
    each receive gets one of them and the sender is named. commd keeps MPI's non-overtaking
    order (the earlier receive takes the earlier message); gloo can hand the named
    receive the first one, so the order is checked on commd only."""
    if rank == 0:
        first, second = torch.zeros(4), torch.zeros(4)
        try:
            w = dist.irecv(first)
        except Exception:
            for _ in range(2):  # rank 1's messages, so a refused receive leaves no send waiting
                dist.recv(second, src=1)
            raise
        dist.recv(second, src=1)
        w.wait()
        assert w._source_rank() == 1, w._source_rank()
        got = sorted([first[0].item(), second[0].item()])
        assert got == [1.0, 11.0] and first.eq(first[0]).all() and second.eq(second[0]).all(), (
            first, second)
        if dist.get_backend() == "commd":
            assert first.eq(1).all() and second.eq(11).all(), (first, second)
    elif rank == 1:
        dist.send(torch.full((4,), 1.0), 0)
        dist.send(torch.full((4,), 11.0), 0)


@check
def any_source_is_completed(rank, world):
    """is_completed() of a pending receive from any source is False until a rank sends, then
    True; the sender is named."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        t = torch.zeros(4)
        try:
            w = dist.irecv(t)
        except Exception:
            store.set("surface/any_posted", "1")
            dist.recv(t, src=world - 1)  # so a refused receive leaves no send waiting
            raise
        early = w.is_completed()
        store.set("surface/any_posted", "1")
        w.wait()
        assert not early, "completed before any rank sent"
        assert w.is_completed() and w._source_rank() == world - 1, w._source_rank()
        assert t.eq(world - 1).all(), t
    elif rank == world - 1:
        store.wait(["surface/any_posted"], timedelta(seconds=60))
        dist.send(torch.full((4,), float(rank)), 0)


@check
def all_gather_coalesced(rank, world):
    ins = [torch.full((3,), float(rank)), torch.full((2, 2), 10.0 + rank)]
    outs = [[torch.empty(3), torch.empty(2, 2)] for _ in range(world)]
    dist.all_gather_coalesced(outs, ins)
    for r in range(world):
        assert outs[r][0].eq(r).all() and outs[r][1].eq(10 + r).all(), outs


@check
def all_reduce_coalesced(rank, world):
    ts = [torch.full((3,), float(rank)), torch.full((5,), 1.0)]
    dist.all_reduce_coalesced(ts)
    assert ts[0].eq(world * (world - 1) / 2).all() and ts[1].eq(world).all(), ts


@check
def object_collectives(rank, world):
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
    assert [o["rank"] for o in objs] == list(range(world))
    lst = [{"a": 1}, [2, 3]] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [{"a": 1}, [2, 3]]
    out = [None]
    dist.scatter_object_list(out, [r * 7 for r in range(world)] if rank == 0 else None, src=0)
    assert out[0] == rank * 7
    g = [None] * world if rank == 0 else None
    dist.gather_object(rank + 100, g, dst=0)
    if rank == 0:
        assert g == [r + 100 for r in range(world)], g


@check
def monitored_barrier(rank, world):
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)


@check
def monitored_barrier_names_late_ranks(rank, world):
    """Only rank 0 enters: it must fail after the timeout naming every other rank (with
    wait_all_ranks), in gloo's words. Runs last (the other ranks' state is left as is)."""
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.wait(["surface/mb_done"], timedelta(seconds=120))
        return
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=2), wait_all_ranks=True)
    except RuntimeError as e:
        text = str(e)
        late = ", ".join(str(r) for r in range(1, world))
        assert "failed to pass monitoredBarrier" in text and late in text, text
    else:
        raise AssertionError("monitored_barrier passed with ranks missing")
    finally:
        store.set("surface/mb_done", "1")


@check
def pg_allreduce_without_options(rank, world):
    pg = dist.distributed_c10d._get_default_group()
    t = torch.ones(4)
    w = pg.allreduce([t])
    w.wait()
    assert t.eq(world).all(), t
    t2 = torch.ones(2)
    fut = pg.allreduce([t2]).get_future()
    res = fut.wait()
    assert res[0].eq(world).all(), res
    b = torch.full((2,), float(rank))
    pg.broadcast([b]).wait()
    assert b.eq(0).all()


@check
def empty_tensors(rank, world):
    """Zero-element tensors in every collective (DeepSpeed's ZeRO-3 broadcasts an empty list
    tensor on its first step): each completes, and the group still works after them."""
    e = lambda: torch.zeros(0, dtype=torch.int64)  # noqa: E731
    dist.broadcast(e(), 0)
    dist.all_reduce(e())
    dist.reduce(e(), 0)
    dist.all_gather_into_tensor(e(), e())
    dist.all_gather([e() for _ in range(world)], e())
    dist.reduce_scatter_tensor(e(), e())
    dist.all_to_all_single(e(), e())
    dist.all_to_all_single(e(), e(), [0] * world, [0] * world)
    dist.all_reduce(e(), async_op=True).wait()
    reqs = [dist.P2POp(dist.isend, e(), (rank + 1) % world),
            dist.P2POp(dist.irecv, e(), (rank - 1) % world)]
    for r in dist.batch_isend_irecv(reqs):
        r.wait()
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    assert t.eq(world * (world + 1) / 2).all(), t


@check
def storage_stays_resizable(rank, world):
    """FSDP all-gathers into chunks of its unsharded parameter, then frees it by resizing its
    storage to 0 (dinov2's training step does this every step): a backend must not pin the
    storage of the tensors it touches."""
    full = torch.zeros(4 * world)
    dist.all_gather(list(torch.chunk(full, world)), torch.full((4,), float(rank)))
    assert torch.equal(full, torch.arange(world).repeat_interleave(4).float()), full
    full.untyped_storage().resize_(0)
    x = torch.ones(3)
    dist.all_reduce(x)
    dist.broadcast(x, 0)
    x.untyped_storage().resize_(0)


@check
def sparse_all_reduce(rank, world):
    i = torch.tensor([[rank % 3], [0]])
    v = torch.tensor([float(rank + 1)])
    s = torch.sparse_coo_tensor(i, v, (3, 2))
    dist.all_reduce(s)
    dense = torch.zeros(3, 2)
    for r in range(world):
        dense[r % 3, 0] += r + 1
    assert torch.equal(s.to_dense(), dense), s.to_dense()


@check
def subgroup_destroy(rank, world):
    for _ in range(3):
        g = dist.new_group(list(range(world)))
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        assert t.eq(world).all()
        dist.destroy_process_group(g)
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.eq(world).all()


@check
def split_group(rank, world):
    dist.barrier()
    ranks = [list(range(0, world, 2)), list(range(1, world, 2))]
    g = dist.split_group(split_ranks=[r for r in ranks if r])
    mine = ranks[rank % 2]
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    assert t.item() == len(mine), (t, mine)


@check
def options_object(rank, world):
    """commd.torch.Options as pg_options: per-group settings that reach the daemon."""
    if dist.get_backend() != "commd":
        return  # gloo takes its own Options type
    import os
    import subprocess
    g = dist.new_group(list(range(world)), pg_options=commd.torch.Options(pacing_gbps=7))
    t = torch.ones(8)
    dist.all_reduce(t, group=g)
    assert t.eq(world).all()
    comm_id = commd.torch.backend(g).comm.id
    out = subprocess.run([os.environ["COMMD_BIN"], "status", "--json", "--socket",
                          os.environ["COMMD_SOCKET"]], capture_output=True, text=True, check=True)
    caps = {c["comm_id"]: c["pacing_bytes_per_sec"]
            for c in json.loads(out.stdout)["communicator_list"]}
    assert caps.get(comm_id) == 7 * 10**9, (comm_id, caps)
    try:
        commd.torch.Options(pacing_gbps=-1)
    except ValueError as e:
        assert "pacing_gbps must be >= 0" in str(e), e
    else:
        raise AssertionError("a negative pacing was accepted")
    try:
        dist.new_group(list(range(world)), pg_options=object())
    except TypeError as e:
        assert "commd.torch.Options" in str(e), e
    else:
        raise AssertionError("a foreign pg_options was accepted")


@check
def is_completed_untouched(rank, world):
    """Importing commd.torch leaves torch's own Work class as it was."""
    assert not getattr(dist.distributed_c10d.Work.is_completed, "_commd_patched", False)


def reinit(prefix, rank, world, **kw):
    """destroy_process_group, then init_process_group with the same backend on the launcher's
    store again, under a new prefix (the first group's keys are still there)."""
    import os
    backend = dist.get_backend()
    dist.destroy_process_group()
    store = dist.PrefixStore(prefix, dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
        timeout=timedelta(seconds=60)))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60), **kw)


@check
def destroy_and_reinit(rank, world):
    """destroy_process_group, then init_process_group again in the same process: the new
    default group works (and the checks after this one run on it)."""
    reinit("reinit", rank, world)
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    assert t.eq(sum(range(world))).all(), t


@check
def new_group_bound_device(rank, world):
    """init_process_group(device_id=...) (DeepSpeed passes one), then new_group() of rank 0
    alone: torch has the other ranks call the parent backend's perform_nocolor_split (NCCL's
    collective split needs every rank). They must go on, not die (commd makes a new group as a
    new communicator of its members); rank 0 uses the group, then every rank the world.
    gloo fails this in torch 2.15 (ProcessGroupGloo has no perform_nocolor_split): checked on
    commd only (tests/test_torch_surface.py)."""
    reinit("bound", rank, world, device_id=torch.device("cpu", 0))
    g = dist.new_group([0])
    if rank == 0:
        t = torch.full((4,), 3.0)
        dist.all_reduce(t, group=g)
        assert t.eq(3.0).all(), t
    else:
        assert g == dist.GroupMember.NON_GROUP_MEMBER, g
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    assert t.eq(sum(range(world))).all(), t


@check
def futures_complete_out_of_order(rank, world):
    """An async op's future completes while an earlier op (of another group) still waits:
    rank 0 posts a receive from rank 1, then waits on the future of an all-reduce of a second
    group, and only then tells rank 1 (through the store) to send what the receive waits for.
    (commd's progress thread once waited on its ops in the order they were watched: the future
    waited for the receive, which waited for the future: a deadlock until the op timeout.)"""
    g = dist.new_group([0, 1])
    store = dist.distributed_c10d._get_default_store()
    t = torch.ones(4)
    if rank == 0:
        sub = torch.zeros(4)
        r = dist.irecv(sub, src=1)
        f = dist.all_reduce(t, group=g, async_op=True).get_future()
        f.wait()
        assert t.eq(2).all(), t
        store.set("surface/future_done", "1")
        r.wait()
        assert sub.eq(7).all(), sub
    elif rank == 1:
        dist.all_reduce(t, group=g)
        store.get("surface/future_done")
        dist.send(torch.full((4,), 7.0), 0)
    dist.destroy_process_group(g)


@check
def future_done_when_wait_returns(rank, world):
    """Once Work.wait() returns, the Work's future is done with the op's result, as gloo's is,
    whether the future was taken before the wait or after it."""
    for i in range(20):
        t = torch.full((1024,), float(rank + i))
        w = dist.all_reduce(t, async_op=True)
        before = w.get_future() if i % 2 == 0 else None
        w.wait()
        f = before if before is not None else w.get_future()
        assert f.done(), f"try {i}: the future was not done when wait() returned"
        want = float(sum(range(world)) + world * i)
        assert f.value()[0].eq(want).all(), (i, f.value()[0][:4], want)


@check
def gather_single_into_flat_output(rank, world):
    """torch 2.15's gather_single: every rank's tensor into one flat tensor on the root."""
    if not hasattr(dist, "gather_single"):
        return
    t = torch.full((2, 3), float(rank))
    out = torch.full((world * 6,), -1.0) if rank == 1 else None
    dist.gather_single(t, out, dst=1)
    if rank == 1:
        want = torch.cat([torch.full((6,), float(r)) for r in range(world)])
        assert torch.equal(out, want), out


@check
def backend_options_copyable(rank, world):
    """torch 2.11's split_group deep-copies the parent backend's `options` (ProcessGroupNCCL
    has them; the "commd" backend had none, and torch's Backend.Options cannot be copied).
    Checked on commd only (the property is what torch 2.11 reads; gloo's is gloo's)."""
    import copy
    b = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    o = copy.deepcopy(b.options)
    assert o.backend == "commd" and o._timeout.total_seconds() == 60, (o.backend, o._timeout)
    from torch._C._distributed_c10d import Backend
    assert isinstance(o, Backend.Options), type(o).__mro__


@check
def overlapping_output_refused(rank, world):
    """An output whose elements share memory (an expand()ed view) is refused before anything
    is posted, as NCCL refuses it (gloo writes it, the last write winning: checked on commd
    only); the group works after."""
    out = torch.zeros(1, 4).expand(world, 4)
    try:
        dist.all_gather_into_tensor(out, torch.full((1, 4), float(rank)))
    except ValueError as e:
        assert "overlap in memory" in str(e), e
    else:
        raise AssertionError("an expanded output was accepted")
    t = torch.full((4,), float(rank))
    dist.all_reduce(t)
    assert t.eq(sum(range(world))).all(), t


@check
def premul_sum_zero_dim(rank, world):
    """PREMUL_SUM on a 0-dim tensor with a one-element factor tensor (NCCL accepts it; gloo has
    no PREMUL_SUM: checked on commd only)."""
    t = torch.tensor(float(rank + 1))
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.5])))
    assert t.item() == 0.5 * sum(range(1, world + 1)), t


@check
def async_wait_timeout(rank, world):
    t = torch.ones(1024)
    w = dist.all_reduce(t, async_op=True)
    assert w.wait(timeout=timedelta(seconds=30))
    assert t.eq(world).all()


@check
def all_gather_object_subgroup_debug_levels(rank, world):
    """torch's test_all_gather_object_subgroup: under TORCH_DISTRIBUTED_DEBUG=DETAIL (torch
    wraps a new group's backend in its ProcessGroupWrapper, which checks each collective across
    ranks), then OFF and INFO, all_gather_object on a new group of every rank. Without the C++
    shell the wrapper held commd's backend but nothing kept its Python side alive: every call
    failed with c10d's "getBackendName is not implemented"."""
    import os
    objs = [{"key1": 3, "key2": 4, "key3": {"nested": True}}, "foo",
            [1, 2, True, "string", [4, 5, "nested"]]]
    old = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    try:
        for lvl in ("DETAIL", "OFF", "INFO"):
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = lvl
            dist.set_debug_level_from_env()
            g = dist.new_group(backend=dist.get_backend())
            out = [None] * world
            dist.all_gather_object(out, objs[rank % len(objs)], group=g)
            assert out == [objs[i % len(objs)] for i in range(world)], (lvl, out)
            dist.destroy_process_group(g)
    finally:
        if old is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = old
        dist.set_debug_level_from_env()


@check
def barrier_timeout_wording(rank, world):
    """torch's own barrier-timeout test (distributed_test.py, _test_barrier_timeout): only rank
    0 of a group with a 1 s timeout enters a barrier, which must fail after the timeout with an
    error matching torch's regex " (Timed out|closed|timeout) "."""
    import re
    import time
    g = dist.new_group(timeout=timedelta(seconds=1))
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        t0 = time.time()
        try:
            dist.barrier(group=g)
        except Exception as e:  # noqa: BLE001
            assert re.search(" (Timed out|closed|timeout) ", str(e)), str(e)
            assert time.time() - t0 >= 0.9, time.time() - t0
        else:
            raise AssertionError("a barrier only rank 0 entered passed")
        finally:
            store.set("surface/barrier_timeout_done", "1")
    else:
        store.wait(["surface/barrier_timeout_done"], timedelta(seconds=120))


@check
def timeout_error_is_torch_kind(rank, world):
    """A receive nobody sends to, with a short per-op timeout: the error must be one torch
    callers catch (DistError / RuntimeError) and say it timed out. The other ranks stay
    connected until rank 0 is done (a key in the job's store, not a guessed sleep)."""
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.wait(["surface/timeout_done"], timedelta(seconds=120))
        return
    try:
        w = dist.irecv(torch.zeros(1), src=1, tag=77)
        try:
            w.wait(timeout=timedelta(seconds=1))
        except Exception as e:  # noqa: BLE001
            assert isinstance(e, RuntimeError), type(e).__mro__
            if dist.get_backend() == "commd":  # also Python's TimeoutError
                assert isinstance(e, TimeoutError), type(e).__mro__
            assert "timed out" in str(e).lower() or "timeout" in str(e).lower(), str(e)
            return
        raise AssertionError("no timeout")
    finally:
        store.set("surface/timeout_done", "1")


@check
def completion_and_abort_hooks(rank, world):
    """torch's hook APIs, which ProcessGroupNCCL has and gloo does not: the completion hook gets
    every op's WorkInfo (its type and sequence number), sync and async ops alike; on torch >=
    2.15 an abort hook runs when the group is aborted, and supports_abort_hooks says so."""
    import threading
    import time
    pg = dist.distributed_c10d._get_default_group()
    got, lock = [], threading.Lock()

    def hook(info):
        with lock:
            got.append((str(info.op_type), info.seq))

    pg._register_on_completion_hook(hook)
    t = torch.ones(8)
    dist.all_reduce(t)
    dist.broadcast(t, 0)
    dist.all_reduce(t, async_op=True).wait()
    # The three ops above are the group's last three collectives: each reported once, with
    # its type, in sequence order (hooks may come in any order, and for ops before them).
    def ours():
        with lock:
            return sorted((x for x in got if "ALLREDUCE" in x[0] or "BROADCAST" in x[0]),
                          key=lambda x: x[1])[-3:]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len({q for _, q in ours()}) < 3:
        time.sleep(0.01)
    last = ours()
    assert [k.split(".")[-1] for k, _ in last] == ["ALLREDUCE", "BROADCAST", "ALLREDUCE"], got
    assert last[0][1] < last[1][1] < last[2][1], got
    if not hasattr(pg, "register_abort_hook"):  # torch < 2.15: no abort hook API
        return
    g = dist.new_group(list(range(world)))
    assert g.supports_abort_hooks, "commd's backend says it has no abort hooks"
    ran = []
    g.register_abort_hook(7, lambda: ran.append(1))
    g.register_abort_hook(8, lambda: ran.append(2))
    g.unregister_abort_hook(8)
    dist.all_reduce(torch.ones(4), group=g)
    g.abort()
    assert ran == [1], ran
    # An op that fails with the communicator broken runs them too, before its error reaches
    # the caller: rank 0 times out alone.
    g2 = dist.new_group(list(range(world)), timeout=timedelta(seconds=1))
    failed = []
    g2.register_abort_hook(1, lambda: failed.append(1))
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(4), group=g2)
        except Exception:  # noqa: BLE001 - the timeout, whatever torch wraps it in
            pass
        else:
            raise AssertionError("an all_reduce on rank 0 alone did not time out")
        assert failed, "the abort hook did not run when the op timed out"
    dist.barrier()
    g2.abort()


def main():
    backend = sys.argv[1]
    names = sys.argv[2:] or list(CHECKS)
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    for name in names:
        try:
            CHECKS[name](rank, world)
            row = {"check": name, "ok": True, "rank": rank}
        except Exception as e:  # noqa: BLE001
            row = {"check": name, "ok": False, "rank": rank,
                   "error": f"{type(e).__name__}: {e}"[:600],
                   "where": traceback.format_exc()[-600:]}
        # One write per line: ranks share the pipe, and print() writes the newline apart.
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()
        if name in ("timeout_error_is_torch_kind", "monitored_barrier_names_late_ranks"):
            # A timed-out op may leave the group unusable (gloo aborts it): stop here.
            break
        dist.barrier()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


if __name__ == "__main__":
    main()
