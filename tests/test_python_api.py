"""The numpy-level Python API (package `commd`) against the real daemon, in real processes."""

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import commd
from conftest import COMMD

CTX = mp.get_context("fork")


def _ranks(daemon, n, fn, *args, timeout=60):
    """Runs fn(comm, client, rank, n, *args) in n forked processes; returns their results."""
    uid = commd.Client(str(daemon.socket)).unique_id()
    q = CTX.Queue()

    def body(rank):
        try:
            c = commd.connect(str(daemon.socket))
            comm = c.communicator(uid, rank, n, op_timeout=30)
            q.put((rank, "ok", fn(comm, c, rank, n, *args)))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            q.put((rank, "err", f"{type(e).__name__}: {e}"))

    procs = [CTX.Process(target=body, args=(r,)) for r in range(n)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        try:
            rank, status, val = q.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - queue.Empty
            break
        out[rank] = (status, val)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
    assert len(out) == n, f"only ranks {sorted(out)} reported within {timeout}s"
    return [out[r] for r in range(n)]


def _ok(results):
    for r, (status, val) in enumerate(results):
        assert status == "ok", f"rank {r}: {val}"
    return [v for _, v in results]


def data(rank, n, dtype, salt=0):
    i = np.arange(n)
    v = (i * 7 + rank * 13 + salt) % 101
    return v.astype(dtype)


def _collectives(comm, c, rank, n):
    res = {}
    # staged, in place, every numpy dtype the daemon reduces
    for dt in (np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.int64):
        x = data(rank, 1001, dt)
        comm.all_reduce(x)
        res[f"sum {np.dtype(dt).name}"] = x
    x = data(rank, 333, np.int32)
    comm.all_reduce(x, op="bxor")
    res["bxor"] = x
    # zero-copy shared arrays, out of place, async
    a = c.empty(5000, np.float32)
    a[:] = data(rank, 5000, np.float32)
    b = c.zeros(5000, np.float32)
    h = comm.all_reduce(a, b, op="max", async_op=True)
    assert isinstance(h, commd.Handle)
    res["max shared"] = h.wait()
    assert h.is_completed()
    # non-contiguous arrays keep their untouched elements
    base = data(rank, 60, np.float64).reshape(6, 10)
    comm.all_reduce(base[:, ::3])
    res["strided"] = base
    res["bcast"] = comm.broadcast(data(rank, 77, np.int64), root=n - 1)
    res["gather"] = comm.all_gather(data(rank, 10, np.int16))
    out = np.zeros(10, np.float32)
    res["rs"] = comm.reduce_scatter(data(rank, 10 * n, np.float32), out)
    res["reduce"] = comm.reduce(data(rank, 50, np.int32), root=0, op="min")
    res["a2a"] = comm.all_to_all(data(rank, 4 * n, np.int32))
    ins = [data(rank, j + 1, np.float64, salt=j) for j in range(n)]
    outs = [np.zeros(rank + 1) for _ in range(n)]
    res["a2av"] = comm.all_to_all_v(ins, outs)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    got = np.zeros(9, np.uint8)
    hs = [comm.send(data(rank, 9, np.uint8), nxt, async_op=True),
          comm.recv(got, prv, async_op=True)]
    for h in hs:
        h.wait()
    res["ring"] = got
    comm.barrier()
    return res


def test_numpy_collectives_match_numpy_references(daemon):
    n = 3
    got = _ok(_ranks(daemon, n, _collectives))
    for rank, res in enumerate(got):
        for dt in (np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.int64):
            want = sum(data(r, 1001, dt).astype(np.int64) for r in range(n))
            want = want.astype(dt)  # wraps like the daemon for narrow ints
            np.testing.assert_array_equal(res[f"sum {np.dtype(dt).name}"], want)
        bx = data(0, 333, np.int32) ^ data(1, 333, np.int32) ^ data(2, 333, np.int32)
        np.testing.assert_array_equal(res["bxor"], bx)
        np.testing.assert_array_equal(res["max shared"],
                                      np.maximum.reduce([data(r, 5000, np.float32)
                                                         for r in range(n)]))
        strided = data(rank, 60, np.float64).reshape(6, 10)
        strided[:, ::3] = sum(data(r, 60, np.float64).reshape(6, 10) for r in range(n))[:, ::3]
        np.testing.assert_array_equal(res["strided"], strided)
        np.testing.assert_array_equal(res["bcast"], data(n - 1, 77, np.int64))
        np.testing.assert_array_equal(res["gather"], np.stack([data(r, 10, np.int16)
                                                               for r in range(n)]))
        full = sum(data(r, 10 * n, np.float32) for r in range(n))
        np.testing.assert_array_equal(res["rs"], full[rank * 10:(rank + 1) * 10])
        if rank == 0:
            np.testing.assert_array_equal(res["reduce"], np.minimum.reduce(
                [data(r, 50, np.int32) for r in range(n)]))
        else:
            np.testing.assert_array_equal(res["reduce"], data(rank, 50, np.int32))
        a2a = np.concatenate([data(j, 4 * n, np.int32)[rank * 4:(rank + 1) * 4]
                              for j in range(n)])
        np.testing.assert_array_equal(res["a2a"], a2a)
        for j in range(n):
            np.testing.assert_array_equal(res["a2av"][j], data(j, rank + 1, np.float64, salt=rank))
        np.testing.assert_array_equal(res["ring"], data((rank - 1) % n, 9, np.uint8))


def _large_plain(comm, c, rank, n):
    """Ordinary numpy arrays of 1 MiB and up: made by commd's allocator (connect() installs it
    as numpy's handler), so ops run on them in place after the first moves them."""
    from commd import _native
    from numpy._core import _multiarray_umath as mu

    m = (1 << 18) + 5  # 1 MiB of f32 and a bit
    x = data(rank, m, np.float32)
    assert mu.get_handler_name(x) == "commd", mu.get_handler_name(x)
    res = {"sum": comm.all_reduce(x).copy()}
    res["gather"] = comm.all_gather(data(rank, m, np.int32))  # out of place: two blocks
    res["rs"] = comm.reduce_scatter(data(rank, m * n, np.float64), np.empty(m))
    res["bcast"] = comm.broadcast(data(rank, m, np.int64), root=1)
    s1 = _native.host_blocks()
    for _ in range(3):
        comm.all_reduce(x)  # the same array again: nothing moved or registered
    s2 = _native.host_blocks()
    res["again"] = x
    res["stats"] = (s1, s2)
    return res


def test_ordinary_numpy_arrays_run_in_place_with_right_results(daemon):
    n = 3
    m = (1 << 18) + 5
    got = _ok(_ranks(daemon, n, _large_plain))
    total = sum(data(r, m, np.float32) for r in range(n))
    for rank, res in enumerate(got):
        np.testing.assert_array_equal(res["sum"], total)
        np.testing.assert_array_equal(res["again"], total * n ** 3)
        np.testing.assert_array_equal(res["gather"], np.stack([data(r, m, np.int32)
                                                               for r in range(n)]))
        full = sum(data(r, m * n, np.float64) for r in range(n))
        np.testing.assert_array_equal(res["rs"], full[rank * m:(rank + 1) * m])
        np.testing.assert_array_equal(res["bcast"], data(1, m, np.int64))
        s1, s2 = res["stats"]
        assert s1["moved"] >= 4 and s1["registered"] >= 4, s1
        assert (s2["moved"], s2["registered"]) == (s1["moved"], s1["registered"]), (s1, s2)


def _my_registrations(socket):
    from conftest import COMMD
    out = subprocess.run([COMMD, "status", "--json", "--socket", socket], capture_output=True,
                         text=True, timeout=10, check=True)
    mine = [x for x in json.loads(out.stdout)["session_list"] if x["pid"] == os.getpid()]
    return sum(x["registrations"] for x in mine), sum(x["mapped_bytes"] for x in mine)


def _cache_given_back(comm, c, rank, n, socket):
    """Freed moved blocks stay registered in the cache; releasing it (what memory pressure
    does) unmaps them here and in the daemon, and a fresh mapping that fails releases it too."""
    import resource
    from commd import _native
    m = 1 << 20  # 4 MiB of f32
    x = data(rank, m, np.float32)
    comm.all_reduce(x)  # moved into shared memory and registered
    first = x.copy()
    del x  # freed: cached, still registered
    comm.barrier()
    cached = _native.host_blocks()["cached_bytes"]
    regs_cached = _my_registrations(socket)
    given = _native.host_blocks_release()
    comm.barrier()  # a new op lets the daemon drop what was deregistered
    after = _native.host_blocks()
    regs_released = _my_registrations(socket)
    # Again, then a fresh mapping refused (address-space limit) while the cache holds 4 MiB:
    # the allocation must still succeed, from the cache's memory given back.
    y = data(rank, m, np.float32)
    comm.all_reduce(y)
    del y
    before_limit = _native.host_blocks()["released_bytes"]
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize:")) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 20), resource.RLIM_INFINITY))
    try:
        z = np.full(3 << 18, 5, np.int32)  # 3 MiB: another page count than the cached block
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    from numpy._core import _multiarray_umath as mu
    threads = set()
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/comm") as f:
            threads.add(f.read().strip())
    return {"watcher": "commd-mempress" in threads, "first": first, "cached": cached, "given": given, "after": after,
            "regs": (regs_cached, regs_released), "z_ok": bool((z == 5).all()),
            "z_handler": mu.get_handler_name(z),
            "released_by_limit": _native.host_blocks()["released_bytes"] - before_limit}


def test_the_allocator_gives_its_cache_back(daemon):
    n = 2
    m = 1 << 20
    got = _ok(_ranks(daemon, n, _cache_given_back, str(daemon.socket)))
    total = sum(data(r, m, np.float32) for r in range(n))
    for res in got:
        np.testing.assert_array_equal(res["first"], total)
        assert res["cached"] >= 4 << 20, res
        assert res["given"] >= 4 << 20 and res["after"]["cached_bytes"] == 0, res
        (regs_c, bytes_c), (regs_r, bytes_r) = res["regs"]
        assert regs_r < regs_c and bytes_r <= bytes_c - (4 << 20), res["regs"]
        assert res["z_ok"] and res["z_handler"] == "commd", res
        assert res["released_by_limit"] >= 4 << 20, res
        assert res["watcher"] == _psi_trigger_allowed(), res


def _psi_trigger_allowed():
    """Whether this kernel lets a process watch memory stalls (what the allocator's watcher
    thread needs)."""
    try:
        fd = os.open("/proc/pressure/memory", os.O_RDWR | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, b"some 100000 2000000\0")
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _dropped_handle(comm, c, rank, n):
    """A receive into an ordinary (allocator-made) array whose handle and array are dropped
    before the data arrives: the array's memory must not go to a new array meanwhile."""
    m = 1 << 19  # 2 MiB of f32
    if rank == 0:
        x = np.zeros(m, np.float32)
        comm.recv(x, 1, async_op=True)  # the handle is dropped at once
        del x
        y = np.full(m, 7.0, np.float32)  # same size: the freed block would be reused
        time.sleep(1.5)  # rank 1 sends after 0.5 s
        comm.barrier()  # a new op: dropped handles of completed ops are let go
        return int(np.count_nonzero(y != 7.0))
    if rank == 1:
        time.sleep(0.5)
        comm.send(np.full(m, 3.0, np.float32), 0)
        comm.barrier()
    return 0


def test_bad_allocator_settings_are_refused_with_their_name():
    env = dict(os.environ, COMMD_CPU_ALLOC_MIN="lots")
    p = subprocess.run([sys.executable, "-c", "import commd; commd.use_numpy_allocator()"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "COMMD_CPU_ALLOC_MIN='lots' is not a byte count" in p.stderr, \
        p.stderr
    env = dict(os.environ, COMMD_CPU_CACHE_MIB="x")
    code = ("import numpy as np, commd; commd.use_numpy_allocator(1 << 20); "
            "a = np.ones(1 << 20); del a; print('ok')")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr
    assert "COMMD_CPU_CACHE_MIB=\"x\" is not a whole number of MiB" in p.stderr, p.stderr


def test_a_dropped_handle_keeps_its_arrays_until_the_op_is_done(daemon):
    got = _ok(_ranks(daemon, 2, _dropped_handle))
    assert got[0] == 0, f"{got[0]} elements of a new array were written by a dropped receive"


def _mismatch(comm, c, rank, n):
    x = np.ones(10 if rank == 0 else 12, np.float32)
    t0 = time.monotonic()
    try:
        comm.all_reduce(x)
    except commd.MismatchError as e:
        return ("MismatchError", time.monotonic() - t0, str(e))
    return ("no error", 0, "")


def _any_source(comm, c, rank, n):
    """Ranks 1..n-1 send two messages each (value 10 * rank + k) to rank 0, which posts a
    receive from any source, a receive naming rank 2, then receives from any source for the
    rest."""
    if rank != 0:
        for k in range(2):
            comm.send(np.full(3, 10 * rank + k, np.int32), 0)
        return None
    bufs = [np.zeros(3, np.int32) for _ in range(2 * (n - 1))]
    hs = [comm.recv(bufs[0], None, async_op=True), comm.recv(bufs[1], 2, async_op=True)]
    hs += [comm.recv(b, None, async_op=True) for b in bufs[2:]]
    for h in hs:
        h.wait()
    return [(h.source(), b.tolist()) for h, b in zip(hs, bufs)]


def _many_unwaited(comm, c, rank, n, ops):
    """``ops`` async all-reduces posted before any is waited for (each handle held), then
    waited for newest first; returns how many came out wrong."""
    xs = [np.full(64, float(rank + 1 + i), np.float32) for i in range(ops)]
    hs = [comm.all_reduce(x, async_op=True) for x in xs]
    for h in reversed(hs):
        h.wait()
    want = [sum(float(r + 1 + i) for r in range(n)) for i in range(ops)]
    return sum(int(np.count_nonzero(x != w)) for x, w in zip(xs, want))


def test_more_ops_waited_late_than_the_ring_holds(tmp_path):
    """Five times as many ops in flight and unwaited as the session's rings have entries: a
    completion read off the ring waits for its request without taking ring room, so posting
    goes on (otherwise a process with ring_entries unwaited ops would wait in `post` forever,
    which would hang torch's all_to_all_single on GPUs after about 1000 calls)."""
    from conftest import Daemon
    d = Daemon(tmp_path, "--set", "ring_entries=8").start()
    try:
        assert _ok(_ranks(d, 2, _many_unwaited, 40, timeout=60)) == [0, 0]
    finally:
        assert d.stop() == 0, d.log()


def test_recv_from_any_source_names_the_sender_and_keeps_pair_order(daemon):
    n = 4
    got = _ok(_ranks(daemon, n, _any_source))[0]
    named = got.pop(1)
    assert named[0] is None and named[1] in ([20] * 3, [21] * 3), named
    msgs = [named[1][0]]
    for src, vals in got:
        assert src is not None and 1 <= src < n, got
        assert vals == [vals[0]] * 3 and vals[0] // 10 == src, (src, vals)
        msgs.append(vals[0])
    assert sorted(msgs) == sorted(10 * r + k for r in range(1, n) for k in range(2)), msgs
    # Per sender, the receives (in the order posted) took its messages in the order sent.
    order = [got[0][1][0], named[1][0]] + [v[0] for _, v in got[1:]]
    for r in range(1, n):
        mine = [m % 10 for m in order if m // 10 == r]
        assert mine == [0, 1], (r, order)


REPORT_FAILURE = r"""
import os, sys, time, numpy as np, commd
sock, uid, rank = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3])
comm = commd.connect(sock).communicator(uid, rank, 2, op_timeout=30)
comm.barrier()
if rank == 1:
    comm.recv(np.zeros(4), 0)
    time.sleep(1)
    os._exit(0)  # gone with rank 0's second op in flight: it fails (peer lost)
good = comm.send(np.ones(4), 1, async_op=True)
good.report_failure("the send")
bad = comm.recv(np.zeros(4), 1, async_op=True)
bad.report_failure("the recv")
print("posted", flush=True)
time.sleep(4)
"""


def test_report_failure_prints_a_failed_op_with_nobody_waiting(daemon, tmp_path):
    """Handle.report_failure (what GPU ops behind stream-completed futures use): a thread of
    the native library waits for the op and prints its error at once, with no Python call."""
    script = tmp_path / "report.py"
    script.write_text(REPORT_FAILURE)
    uid = commd.Client(str(daemon.socket)).unique_id().hex()
    procs = [subprocess.Popen([sys.executable, str(script), str(daemon.socket), uid, str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    out, err = procs[0].communicate(timeout=60)
    procs[1].communicate(timeout=60)
    assert "posted" in out, err
    lines = [ln for ln in err.splitlines() if ln.startswith("commd: ERROR:")]
    assert len(lines) == 1 and "the recv: " in lines[0] and "lost" in lines[0], err


def test_mismatch_raises_mismatch_error_on_every_rank(daemon):
    for kind, secs, msg in _ok(_ranks(daemon, 3, _mismatch)):
        assert kind == "MismatchError", msg
        assert secs < 5
        assert "count" in msg and "rank 0" in msg, msg
        assert isinstance(commd.MismatchError("x"), commd.CommError)


def _victim(comm, c, rank, n):
    comm.barrier()
    if rank == n - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        comm.all_reduce(np.ones(4))
    except commd.PeerLostError as e:
        return ("PeerLostError", time.monotonic() - t0, str(e))
    return ("no error", 0, "")


def test_killed_rank_gives_peer_lost_in_survivors(daemon):
    uid = commd.Client(str(daemon.socket)).unique_id()
    n = 3
    q = CTX.Queue()

    def body(rank):
        c = commd.connect(str(daemon.socket))
        comm = c.communicator(uid, rank, n)
        q.put((rank, _victim(comm, c, rank, n)))

    procs = [CTX.Process(target=body, args=(r,)) for r in range(n)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=60) for _ in range(n - 1))
    for p in procs:
        p.join(10)
    assert procs[-1].exitcode == -signal.SIGKILL
    for r in range(n - 1):
        kind, secs, msg = got[r]
        assert kind == "PeerLostError", msg
        assert secs < 5 and f"rank {n - 1}" in msg, msg


def test_daemon_unavailable_error_names_socket_and_how_to_start(tmp_path):
    path = tmp_path / "missing.sock"
    with pytest.raises(commd.DaemonUnavailableError) as ei:
        commd.Client(str(path))
    msg = str(ei.value)
    assert str(path) in msg and "commd serve" in msg, msg
    assert isinstance(ei.value, commd.CommError)


def test_bad_arguments_are_value_errors_not_crashes(daemon):
    c = commd.Client(str(daemon.socket))
    uid = c.unique_id()
    with pytest.raises(ValueError, match="out of range"):
        c.communicator(uid, 3, 2)
    comm = c.communicator(c.unique_id(), 0, 1)
    with pytest.raises(ValueError, match="unknown reduction"):
        comm.all_reduce(np.ones(3), op="median")
    with pytest.raises(ValueError, match="integer dtypes only"):
        comm.all_reduce(np.ones(3), op="band")
    with pytest.raises(ValueError, match="cannot reduce numpy dtype"):
        comm.all_reduce(np.ones(3, np.complex64))
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(np.ones(3), root=5)
    with pytest.raises(ValueError, match="timeout"):
        c.communicator(c.unique_id(), 0, 1, op_timeout=-1)
    # the native layer refuses unknown names too
    with pytest.raises(ValueError, match="unknown op"):
        comm._native.post("allreduce_typo", "f32", 1)
    with pytest.raises(ValueError, match="unsupported dtype"):
        comm._native.post("all_reduce", "f128", 1)
    # a 1-rank communicator still works after all those refusals
    x = np.arange(5, dtype=np.float32)
    comm.all_reduce(x)
    np.testing.assert_array_equal(x, np.arange(5, dtype=np.float32))
    comm.close()
    with pytest.raises(commd.AbortedError):
        comm.all_reduce(x)


def test_out_of_bounds_descriptor_is_refused_by_the_daemon(daemon):
    c = commd.Client(str(daemon.socket))
    comm = c.communicator(c.unique_id(), 0, 1)
    buf = c.alloc(64)
    with pytest.raises(commd.InvalidOpError, match="bounds|outside|exceeds|past"):
        comm._native.post("all_reduce", "f32", 1000, (buf, 0), (buf, 0), "sum").wait(10)


def test_a_shared_buffer_has_its_pages_from_the_client_before_any_op(daemon):
    # The client allocates every page of a buffer (charged to it), so no op makes the daemon
    # allocate pages of a user's buffer: the memfd behind the mapping is fully allocated before
    # any write (its blocks, read through /proc/self/map_files).
    c = commd.Client(str(daemon.socket))
    buf = c.alloc(8 << 20)
    a = np.frombuffer(buf, dtype=np.uint8)
    addr = a.ctypes.data
    maps = [ln.split()[0] for ln in open("/proc/self/maps")]
    rng = next(r for r in maps if int(r.split("-")[0], 16) <= addr < int(r.split("-")[1], 16))
    st = os.stat(f"/proc/self/map_files/{rng}")
    assert st.st_size == a.nbytes
    assert st.st_blocks * 512 >= a.nbytes, f"{st.st_blocks * 512} of {a.nbytes} bytes allocated"
    assert not a.any()  # and zero-filled, as before


def test_invalid_recv_from_any_source_fails_alone_at_once(daemon):
    """A receive from any source owes no rank its error: an invalid one fails now, alone,
    instead of waiting to take (and fail) some sender's message."""
    c = commd.Client(str(daemon.socket))
    comm = c.communicator(c.unique_id(), 0, 1)
    buf = c.alloc(64)
    req = comm._native.post("recv", "u8", 1000, None, (buf, 0), None, 0xFFFFFFFF)
    with pytest.raises(commd.InvalidOpError, match="recv from any source on rank 0: .*(bounds|outside|exceeds|past)"):
        req.wait(10)


def test_fork_child_gets_its_own_session(daemon):
    """A session inherited through fork() is refused in the child (with a clear message), and
    connect() in the child makes a new one; the parent's session is unharmed."""
    parent = commd.connect(str(daemon.socket))
    code = (
        "import os, sys, commd\n"
        f"p = commd.connect({str(daemon.socket)!r})\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        p.unique_id()\n"
        "        os._exit(3)\n"
        "    except ValueError as e:\n"
        "        assert 'fork' in str(e), e\n"
        f"    c = commd.connect({str(daemon.socket)!r})\n"
        "    assert c is not p and c.session_id != p.session_id\n"
        "    c.communicator(c.unique_id(), 0, 1).all_reduce(__import__('numpy').ones(2))\n"
        "    os._exit(0)\n"
        "_, st = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(st) == 0, st\n"
        "p.communicator(p.unique_id(), 0, 1).barrier()\n"
        "print('OK')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "OK", r.stdout + r.stderr
    assert parent.unique_id()


def test_wait_timeout_and_interrupt_leave_the_op_running(daemon):
    c = commd.Client(str(daemon.socket))
    uid = c.unique_id()
    other = commd.Client(str(daemon.socket))
    import threading

    box = {}
    t = threading.Thread(target=lambda: box.setdefault("c", other.communicator(uid, 1, 2)))
    t.start()
    comm = c.communicator(uid, 0, 2)
    t.join()
    x = np.ones(8, np.float32)
    h = comm.all_reduce(x, async_op=True)
    with pytest.raises(TimeoutError):
        h.wait(timeout=0.2)
    assert not h.is_completed()
    y = np.full(8, 2, np.float32)
    box["c"].all_reduce(y)
    h.wait(timeout=10)
    np.testing.assert_array_equal(x, np.full(8, 3, np.float32))
    np.testing.assert_array_equal(y, np.full(8, 3, np.float32))


def _shares(comm, c, rank, n):
    return comm.ranks_share_a_process


def test_ranks_in_one_process_are_told_so_alike(daemon):
    """The daemon tells every rank whether two ranks of the communicator are one process: the
    client keeps such communicators' eager GPU ops off the direct path (docs/contracts.md #7),
    whose setup would block a thread that drives several ranks."""
    import threading

    # Two processes, one rank each; then three ranks of which two are threads of this process.
    assert _ok(_ranks(daemon, 2, _shares)) == [False, False]
    uid = commd.Client(str(daemon.socket)).unique_id()
    got, errs = {}, []

    def join(rank):
        try:
            # A session of its own (not commd.connect(): the test process keeps no default
            # session or allocator behind).
            c = commd.Client(str(daemon.socket))
            got[rank] = c.communicator(uid, rank, 3, op_timeout=30).ranks_share_a_process
        except BaseException as e:  # noqa: BLE001 - reported below
            errs.append(f"rank {rank}: {e}")

    def other():
        # Rank 2 in a process of its own.
        c = commd.Client(str(daemon.socket))
        comm = c.communicator(uid, 2, 3, op_timeout=30)
        os._exit(0 if comm.ranks_share_a_process else 3)

    child = CTX.Process(target=other)
    child.start()
    ts = [threading.Thread(target=join, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    child.join(60)
    assert not errs, errs
    assert got == {0: True, 1: True}
    assert child.exitcode == 0, "the rank in its own process was not told that two others share one"


def _eager_path(comm, c, rank, n, setting):
    # Read once per process, at the first GPU op or question: set here, in the forked rank.
    if setting is not None:
        os.environ["COMMD_EAGER_DIRECT"] = setting
    return comm._native.cuda_eager_path()


@pytest.mark.parametrize("setting, want", [
    (None, "undecided"),
    ("0", "daemon: COMMD_EAGER_DIRECT is off"),
    ("auto", "undecided"),
    ("bogus", 'daemon: COMMD_EAGER_DIRECT="bogus": expected auto/on'),
])
def test_eager_direct_setting_is_said(daemon, setting, want):
    """Eager direct ops (docs/design-gpu.md, direct collectives rule 8) are on unless turned
    off; on, the path is decided at the first GPU op; a bad value is said with its name (and
    GPU ops then fail with it rather than guess)."""
    for got in _ok(_ranks(daemon, 2, _eager_path, setting)):
        assert got.startswith(want), got


def test_communicator_reports_the_nodes_it_spans(tmp_path):
    # Two daemons as two nodes: a communicator over both says 2 (its GPU ops are host-staged),
    # one within a node says 1; the data still adds up across the nodes.
    from conftest import Daemon

    for i in range(2):
        (tmp_path / f"n{i}").mkdir()
    nodes = [Daemon(tmp_path / f"n{i}").start() for i in range(2)]
    try:
        uid = commd.Client(str(nodes[0].socket)).unique_id()
        q = CTX.Queue()

        def body(rank):
            try:
                c = commd.connect(str(nodes[rank].socket))
                comm = c.communicator(uid, rank, 2, op_timeout=30)
                x = np.full(1001, rank + 1.0, dtype=np.float32)
                comm.all_reduce(x)
                solo = c.communicator(c.unique_id(), 0, 1)
                try:  # a receive from any source is for ranks of one node: refused, clearly
                    comm.recv(np.zeros(1), None)
                    any_src = "accepted"
                except commd.CommError as e:
                    any_src = "spans 2 nodes; name the source rank" in str(e)
                q.put((rank, comm.nodes, solo.nodes, float(x[0]), float(x[-1]), any_src))
            except BaseException as e:  # noqa: BLE001 - reported to the test
                q.put((rank, f"{type(e).__name__}: {e}", None, None, None, None))

        procs = [CTX.Process(target=body, args=(r,)) for r in range(2)]
        for p in procs:
            p.start()
        got = sorted(q.get(timeout=60) for _ in procs)
        for p in procs:
            p.join(10)
        assert got == [(0, 2, 1, 3.0, 3.0, True), (1, 2, 1, 3.0, 3.0, True)], got
    finally:
        for d in nodes:
            d.stop()


# ---- fp8 (E4M3, E5M2) and unsigned 32/64-bit reductions against numpy references ----

FP8 = {"f8e4m3": (3, 7, 0x7E, False), "f8e5m2": (2, 15, 0x7B, True)}  # mbits, bias, max, inf


def fp8_values(kind):
    """The value of every code (float64), from the format's definition."""
    mbits, bias, max_code, has_inf = FP8[kind]
    out = np.empty(256)
    for c in range(256):
        mag, sign = c & 0x7F, -1.0 if c & 0x80 else 1.0
        e, m = mag >> mbits, mag & ((1 << mbits) - 1)
        if (has_inf and mag > max_code + 1) or (not has_inf and mag == 0x7F):
            out[c] = np.nan
        elif has_inf and mag == max_code + 1:
            out[c] = sign * np.inf
        elif e == 0:
            out[c] = sign * m * 2.0 ** (1 - bias - mbits)
        else:
            out[c] = sign * (1 + m / (1 << mbits)) * 2.0 ** (e - bias)
    return out


def fp8_encode(kind, x):
    """float32 values to codes: the nearest finite code (ties to the even code), saturated at
    the largest finite value, NaN to a NaN code; found by search over every code, not by bits."""
    _, _, max_code, _ = FP8[kind]
    vals = fp8_values(kind)[: max_code + 1]  # 0 .. largest, all finite and non-negative
    x = np.asarray(x, np.float64)
    mag = np.minimum(np.abs(x), vals[-1])
    d = np.abs(mag[:, None] - vals[None, :])
    tie = d == d.min(axis=1, keepdims=True)
    even = tie & (np.arange(max_code + 1) % 2 == 0)[None, :]
    code = np.where(even.any(axis=1), even.argmax(axis=1), tie.argmax(axis=1)).astype(np.uint8)
    code |= np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(x), 0x7F, code).astype(np.uint8)


def fp8_reference(kind, op, inputs):
    """What NCCL defines: decoded, accumulated in float32 in rank order, stored saturated."""
    vals = fp8_values(kind).astype(np.float32)
    a = vals[inputs[0]]
    for codes in inputs[1:]:
        b = vals[codes]
        with np.errstate(all="ignore"):
            a = {"sum": lambda: a + b, "avg": lambda: a + b, "prod": lambda: a * b,
                 "min": lambda: np.where(b < a, b, a), "max": lambda: np.where(b > a, b, a)}[op]()
    if op == "avg":
        with np.errstate(all="ignore"):
            a = a / np.float32(len(inputs))
    return fp8_encode(kind, a)


def test_fp8_reference_encoder_knows_the_formats():
    v = fp8_values("f8e4m3")
    assert v[0x38] == 1.0 and v[0x7E] == 448.0 and v[0x01] == 2.0 ** -9 and np.isnan(v[0x7F])
    w = fp8_values("f8e5m2")
    assert w[0x3C] == 1.0 and w[0x7B] == 57344.0 and w[0x7C] == np.inf and np.isnan(w[0x7D])
    got = fp8_encode("f8e4m3", np.array([1.0, 1.0625, 1.1875, 500.0, -np.inf, -0.0, 2.0 ** -11],
                                        np.float32))
    # 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): even 0x38; 1.1875 between 0x39
    # and 0x3A: even 0x3A; beyond 448 saturates; -0 keeps its sign; 2^-11 rounds to +0.
    assert list(got) == [0x38, 0x38, 0x3A, 0x7E, 0xFE, 0x80, 0x00]


def _typed_reductions(comm, c, rank, n, length):
    rng = np.random.default_rng(1000 + rank)
    res = {}
    for kind in FP8:
        for op in ("sum", "prod", "min", "max", "avg"):
            x = rng.integers(0, 256, length, dtype=np.uint8)
            x[:4] = [0x7F, 0x38, 0xB8, 0x00]  # NaN, 1.0, -1.0, 0 in both formats
            out = np.zeros_like(x)
            comm.all_reduce(x, out, op=op, dtype=kind)
            res[f"{kind} {op}"] = out
    for dt in (np.uint32, np.uint64):
        for op in ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor"):
            x = rng.integers(0, np.iinfo(dt).max, length, dtype=dt, endpoint=True)
            comm.all_reduce(x, op=op)
            res[f"{np.dtype(dt).name} {op}"] = x
    return res


def test_fp8_and_unsigned_reductions_match_numpy_references(daemon):
    """fp8 codes over the whole range (NaN, infinities, subnormals, sums and products that
    overflow) and unsigned integers over the whole range (above the signed maximum, so a signed
    min/max/avg would differ), every op, 3 ranks, against numpy."""
    n, length = 3, 4099
    got = _ok(_ranks(daemon, n, _typed_reductions, length))
    # Each rank's inputs, drawn again in the same order as the ranks drew them.
    inputs = {}
    for r in range(n):
        rng = np.random.default_rng(1000 + r)
        for kind in FP8:
            for op in ("sum", "prod", "min", "max", "avg"):
                x = rng.integers(0, 256, length, dtype=np.uint8)
                x[:4] = [0x7F, 0x38, 0xB8, 0x00]
                inputs.setdefault(f"{kind} {op}", []).append(x)
        for dt in (np.uint32, np.uint64):
            for op in ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor"):
                x = rng.integers(0, np.iinfo(dt).max, length, dtype=dt, endpoint=True)
                inputs.setdefault(f"{np.dtype(dt).name} {op}", []).append(x)
    for key, ins in inputs.items():
        kind, op = key.split()
        if kind in FP8:
            want = fp8_reference(kind, op, ins)
            nan = np.isnan(fp8_values(kind)[want])
            saturated = np.count_nonzero((want & 0x7F) == FP8[kind][2])
            # The hard cases are in the data: a NaN, and sums and products past the largest value.
            assert nan[0] and (saturated > 0 or op not in ("sum", "prod")), (key, saturated)
        else:
            dt = ins[0].dtype
            if op == "avg":
                # NCCL's definition: the sum wrapped in the dtype, then divided.
                want = np.add.reduce(np.stack(ins), dtype=dt) // dt.type(n)
            else:
                f = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum,
                     "band": np.bitwise_and, "bor": np.bitwise_or, "bxor": np.bitwise_xor}[op]
                want = f.reduce(np.stack(ins), dtype=dt)  # wrapping in the dtype itself
            nan = np.zeros(length, bool)
            big = np.count_nonzero(ins[0] > np.iinfo(dt).max // 2)
            assert big > length // 4, key  # values a signed compare would take as negative
        for rank, res in enumerate(got):
            g = res[key]
            if kind in FP8:
                g_nan = np.isnan(fp8_values(kind)[g])
                np.testing.assert_array_equal(g_nan, nan, err_msg=f"rank {rank} {key}: NaNs")
                bad = np.flatnonzero(~nan & (g != want))
            else:
                bad = np.flatnonzero(g != want)
            assert bad.size == 0, (
                f"rank {rank} {key}: {bad.size} wrong, first at {bad[0]}: got {g[bad[0]]:#x} "
                f"want {want[bad[0]]:#x} from {[int(x[bad[0]]) for x in ins]}")


def test_a_communicators_name_is_in_status_and_its_label(daemon):
    """The label is how the daemon's logs and errors call a communicator."""
    uid = commd.Client(str(daemon.socket)).unique_id()
    c = commd.connect(str(daemon.socket))
    for bad in ("x" * 129, "tab\there"):
        with pytest.raises(Exception, match="not allowed"):
            c.communicator(uid, 0, 1, name=bad)
    comm = c.communicator(c.unique_id(), 0, 1, name="train dp")
    st = daemon.status()
    names = [x["name"] for x in st["communicator_list"]]
    assert "train dp" in names, st["communicator_list"]
    label = [x["label"] for x in st["communicator_list"] if x["name"] == "train dp"][0]
    assert label.startswith("comm ") and '"train dp" (id ' in label, label
    out = subprocess.run([COMMD, "status", "--socket", str(daemon.socket)],
                         capture_output=True, text=True, timeout=30)
    assert '"train dp"' in out.stdout, out.stdout
    assert "named by rank 0" in daemon.log()
