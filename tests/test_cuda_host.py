"""The CUDA data path on a host without a GPU (CI): the daemon starts, reports CUDA unavailable
with the reason, keeps serving host memory, and GPU requests fail with clear errors, not hangs."""

import json
import subprocess

import numpy as np
import pytest

import commd
from conftest import COMMD, run_ranks, assert_all_pass


def has_libcuda() -> bool:
    import ctypes.util
    return ctypes.util.find_library("cuda") is not None


pytestmark = pytest.mark.skipif(has_libcuda(), reason="this host has libcuda: see scripts/gpu-check.sh")


def test_topo_reports_cuda_unavailable_and_host_ops_still_work(daemon):
    out = subprocess.run([COMMD, "topo", "--socket", str(daemon.socket)], capture_output=True,
                         text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert "CUDA: unavailable (libcuda.so not found" in out.stdout, out.stdout
    assert "host memory only" in out.stdout
    j = json.loads(subprocess.run([COMMD, "topo", "--json", "--socket", str(daemon.socket)],
                                  capture_output=True, text=True, timeout=10, check=True).stdout)
    assert j["cuda_available"] is False and j["gpus"] == [] and "libcuda" in j["cuda_reason"]
    assert j["source"] == "daemon"
    # The data links the text lists under "Links" (host shared memory here).
    assert any(l["kind"] == "shm" for l in j["data_links"]), j["data_links"]
    assert_all_pass(run_ranks(daemon, 2, [{"op": "all_reduce", "dtype": "f32", "count": 1001}]))


def test_topo_without_a_daemon_probes_the_host_and_says_so(tmp_path):
    out = subprocess.run([COMMD, "topo", "--socket", str(tmp_path / "none.sock")],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    assert "no daemon answered" in out.stdout and "none.sock" in out.stdout, out.stdout
    assert "probed this host directly" in out.stdout
    assert "CUDA: unavailable (libcuda.so not found" in out.stdout, out.stdout
    j = json.loads(subprocess.run([COMMD, "topo", "--json", "--socket", str(tmp_path / "none.sock")],
                                  capture_output=True, text=True, timeout=10, check=True).stdout)
    assert j["source"] == "host probe" and j["cuda_available"] is False, j


def test_gpu_op_without_cuda_is_a_clear_error(daemon):
    c = commd.connect(str(daemon.socket))
    comm = c.communicator(c.unique_id(), 0, 1)
    with pytest.raises(ValueError, match="CUDA is not available in this process"):
        comm._native.post_cuda("all_reduce", "f32", 16, 0, send=1 << 40, recv=1 << 40,
                               redop="sum")
    st = json.loads(c._native.status_json())
    assert st["cuda_available"] is False and "libcuda" in st["cuda_reason"]
    assert st["ipc_opens"] == 0 and st["gpu_ops"] == 0
    # The session still works for host memory afterwards.
    a = np.arange(8, dtype=np.float32)
    comm.all_reduce(a)
    assert np.array_equal(a, np.arange(8, dtype=np.float32))


def test_cuda_op_fast_path_without_cuda_is_a_clear_error(daemon):
    """The torch backend's one-call GPU path: codes round-trip, bad codes and a missing driver
    are clear errors, and nothing stays kept alive for an op that was never posted."""
    from commd import _native

    c = commd.connect(str(daemon.socket))
    comm = c.communicator(c.unique_id(), 0, 1)
    code = _native.Communicator.cuda_code("all_gather", "f32")
    assert code != _native.Communicator.cuda_code("all_gather", "f32", order_after=False)
    assert code != _native.Communicator.cuda_code("all_reduce", "f32", "sum")
    with pytest.raises(ValueError, match="unknown op"):
        _native.Communicator.cuda_code("gather_all", "f32")
    with pytest.raises(ValueError, match="invalid cuda_op code"):
        comm._native.cuda_op(0xffff, 0, 16, (1 << 40, 1 << 40, 0, 0), None)
    keep = object()
    with pytest.raises(ValueError, match="CUDA is not available in this process"):
        comm._native.cuda_op(code, 0, 16, (1 << 40, 1 << 41, 0, 0), keep)
    assert comm._native.cuda_stash_len() == (0, 0)
    st = json.loads(c._native.status_json())
    assert st["ipc_opens"] == 0 and st["gpu_ops"] == 0
