"""GPU copy pacing (a per-communicator cap, daemon/src/pacing.rs) through the Python API, the
torch backend, `commd status` and `commd config`, against the real daemon.

There is no GPU here, so nothing is actually paced: these tests check the control plane (the
creation option and the daemon default, SetCommPacing from any rank, status, the errors). The
pacer's arithmetic (average rate, burst, debt, rate changes) has Rust unit tests."""

import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import commd
from conftest import COMMD, Daemon

GB = 10**9
WORKER = str(Path(__file__).resolve().parent / "torch_worker.py")


def create(daemon, pacings, join_timeout=20):
    """Joins one rank per entry of `pacings` (rank i passes pacing_gbps=pacings[i]), each with
    its own session, concurrently; returns the communicators."""
    uid = commd.Client(str(daemon.socket)).unique_id()
    clients = [commd.Client(str(daemon.socket)) for _ in pacings]
    n = len(pacings)
    with ThreadPoolExecutor(n) as ex:
        futs = [ex.submit(c.communicator, uid, r, n, join_timeout=join_timeout, pacing_gbps=p)
                for r, (c, p) in enumerate(zip(clients, pacings))]
        return [f.result() for f in futs]


def comm_status(daemon, comm_id):
    for c in daemon.status()["communicator_list"]:
        if c["comm_id"] == comm_id:
            return c
    raise AssertionError(f"communicator {comm_id} not in commd status")


def pacing(daemon, comm_id):
    return comm_status(daemon, comm_id)["pacing_bytes_per_sec"]


def status_text(daemon):
    return subprocess.run([COMMD, "status", "--socket", str(daemon.socket)], capture_output=True,
                          text=True, timeout=10, check=True).stdout


def comm_line(daemon, comm_id):
    lines = [l for l in status_text(daemon).splitlines() if l.startswith(f"comm {comm_id} ")]
    assert len(lines) == 1, status_text(daemon)
    return lines[0]


@pytest.fixture
def daemon(tmp_path, request):
    """Per-communicator pacing series (metrics_per_job = on) for the /metrics checks."""
    d = Daemon(tmp_path, env={"COMMD_METRICS_PER_JOB": "on"}).start()
    yield d
    assert d.stop() == 0, d.log()


def test_cap_set_at_creation_and_by_any_rank_shows_in_status(daemon):
    comms = create(daemon, [2.5, 2.5])
    cid = comms[0].id
    assert comms[1].id == cid
    assert pacing(daemon, cid) == 2_500_000_000
    assert comm_line(daemon, cid).endswith("GPU pacing 2.5 GB/s, held back 0.000 s")
    # One cap per communicator: rank 1 changes it for both ranks.
    comms[1].set_pacing(10)
    assert pacing(daemon, cid) == 10 * GB
    comms[0].set_pacing(0.001)
    assert pacing(daemon, cid) == 1_000_000
    comms[0].set_pacing(None)
    assert pacing(daemon, cid) is None
    assert comm_line(daemon, cid).endswith("GPU pacing uncapped")
    comms[1].set_pacing(7)
    assert pacing(daemon, cid) == 7 * GB
    comms[1].set_pacing(0)
    assert pacing(daemon, cid) is None
    # Nothing ran on a GPU, so nothing was held back.
    assert comm_status(daemon, cid)["pacing_delayed_us"] == 0
    assert "set GPU pacing to 7 GB/s (7000000000 bytes/s) (was uncapped)" in daemon.log()
    # Host ops are not paced and keep working under a cap.
    comms[0].set_pacing(0.5)
    xs = [np.full(1000, r + 1, np.float32) for r in range(2)]
    with ThreadPoolExecutor(2) as ex:
        list(ex.map(lambda r: comms[r].all_reduce(xs[r]), range(2)))
    for x in xs:
        np.testing.assert_array_equal(x, np.full(1000, 3, np.float32))
    # Another communicator keeps its own cap.
    other = create(daemon, [1, 1])
    assert pacing(daemon, other[0].id) == GB
    assert pacing(daemon, cid) == GB // 2
    # /metrics: the cap and the held-back time, per communicator.
    with urllib.request.urlopen(f"http://{daemon.status()['metrics_listen']}/metrics",
                                timeout=10) as r:
        text = r.read().decode()
    for c, cap in ((cid, GB // 2), (other[0].id, GB)):
        labels = f'{{comm="{c}",unique_id="{comm_status(daemon, c)["unique_id"]}"}}'
        assert f"commd_gpu_pacing_bytes_per_second{labels} {cap}\n" in text, text
        assert f"commd_gpu_pacing_delay_seconds_total{labels} 0.0\n" in text, text
    for c in comms + other:
        c.close()


def test_daemon_default_applies_when_a_rank_passes_nothing(tmp_path):
    d = Daemon(tmp_path, env={"COMMD_GPU_PACING_GBPS": "40"}).start()
    try:
        cfg = subprocess.run([COMMD, "config"], env=d.env, capture_output=True, text=True,
                             timeout=10, check=True).stdout
        line = next(l for l in cfg.splitlines() if l.startswith("gpu_pacing_gbps"))
        assert "= 40 " in line and "env COMMD_GPU_PACING_GBPS" in line, line
        comms = create(d, [None, None])
        assert pacing(d, comms[0].id) == 40 * GB
        # Unset counts as the default: it agrees with an explicit 40.
        comms = create(d, [None, 40])
        assert pacing(d, comms[0].id) == 40 * GB
        comms = create(d, [0, 0])
        assert pacing(d, comms[0].id) is None
    except BaseException:
        print(f"---- commd log ----\n{d.log()}")
        raise
    finally:
        code = d.stop()
    assert code == 0, d.log()


def test_ranks_asking_for_different_caps_fail_naming_both(daemon):
    uid = commd.Client(str(daemon.socket)).unique_id()
    c0, c1 = commd.Client(str(daemon.socket)), commd.Client(str(daemon.socket))
    first = {}

    def rank0():
        try:
            first["comm"] = c0.communicator(uid, 0, 2, join_timeout=3, pacing_gbps=1)
        except commd.CommError as e:
            first["error"] = e

    t = threading.Thread(target=rank0)
    t.start()
    daemon.wait_status(lambda s: s["pending_joins"] == 1)
    t0 = time.monotonic()
    with pytest.raises(commd.CommError) as e:
        c1.communicator(uid, 1, 2, join_timeout=3, pacing_gbps=2)
    assert time.monotonic() - t0 < 2, "the mismatch must fail at once, not at the join timeout"
    msg = str(e.value)
    assert "rank 1" in msg and "2 GB/s" in msg and "rank 0" in msg and "1 GB/s" in msg, msg
    assert "same pacing" in msg, msg
    # Rank 0 then times out like any join whose ranks never all arrive, naming rank 1.
    t.join(30)
    assert isinstance(first.get("error"), commd.CommTimeoutError), first
    assert "[1]" in str(first["error"]), first["error"]


@pytest.mark.parametrize("bad", [-1, -0.5, math.nan, math.inf, 1e-7])
def test_bad_values_are_value_errors(daemon, bad):
    c = commd.Client(str(daemon.socket))
    uid = c.unique_id()
    with pytest.raises(ValueError, match="GB/s"):
        c.communicator(uid, 0, 1, pacing_gbps=bad)
    # The refused call did not use up the id: the communicator still forms.
    comm = c.communicator(uid, 0, 1, pacing_gbps=0.25)
    with pytest.raises(ValueError, match="GB/s"):
        comm.set_pacing(bad)
    assert pacing(daemon, comm.id) == GB // 4
    with pytest.raises(TypeError):
        comm.set_pacing("fast")
    comm.close()
    with pytest.raises(commd.AbortedError, match="closed"):
        comm.set_pacing(1)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_env_at_creation_and_set_pacing_per_group(daemon):
    port = str(free_port())
    procs = []
    for r in range(2):
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        env.update(COMMD_SOCKET=str(daemon.socket), COMMD_BIN=COMMD, OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", COMMD_COMM_PACING_GBPS="3", RANK=str(r),
                   WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, WORKER, "pacing", "3"], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=180)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"PASS rank {r}" in out, f"rank {r}:\n{out[-4000:]}"
