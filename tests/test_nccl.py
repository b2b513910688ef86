"""commd's NCCL-compatible library (libnccl.so.2 from nccl/): a C program written against NCCL's
API, run as real processes against a real daemon, with host buffers (the library's host-memory
extension, so it runs without GPUs). GPU runs: scripts/gpu-check.sh nccl."""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, ROOT

LIB = BIN / "libcommd_nccl.so"


@pytest.fixture(scope="module")
def prog(tmp_path_factory):
    """The test program, linked against the library under its NCCL name."""
    d = tmp_path_factory.mktemp("nccl")
    lib = d / "lib"
    lib.mkdir()
    assert LIB.exists(), f"{LIB} is missing: cargo build --release -p commd-nccl"
    os.symlink(LIB, lib / "libnccl.so.2")
    os.symlink("libnccl.so.2", lib / "libnccl.so")
    exe = d / "nccl_host"
    cc = shutil.which("cc") or shutil.which("gcc")
    subprocess.run(
        [cc, "-O1", "-Wall", "-Werror", "-I", str(ROOT / "nccl" / "include"),
         str(ROOT / "tests" / "nccl" / "nccl_host.c"), "-o", str(exe), f"-L{lib}", "-lnccl"],
        check=True,
    )
    return exe, lib


def start(prog, daemon, nranks, mode, work, env=None):
    exe, lib = prog
    e = dict(os.environ, COMMD_SOCKET=str(daemon.socket), LD_LIBRARY_PATH=str(lib), **(env or {}))
    return [
        subprocess.Popen([str(exe), str(r), str(nranks), str(work), mode], env=e,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(nranks)
    ]


def finish(procs, timeout=120):
    out = []
    for p in procs:
        try:
            o, e = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a rank hung")
        out.append((p.returncode, o, e))
    return out


def test_library_is_nccl_by_name_and_exports_what_torch_imports():
    soname = subprocess.run(["readelf", "-d", str(LIB)], capture_output=True, text=True, check=True)
    assert "Library soname: [libnccl.so.2]" in soname.stdout
    nm = subprocess.run(["nm", "-D", "--defined-only", str(LIB)], capture_output=True, text=True,
                        check=True)
    exported = {l.split()[-1] for l in nm.stdout.splitlines() if l.strip()}
    # Every NCCL symbol libtorch_cuda.so of torch 2.15.0 imports (nm -D --undefined-only):
    # a preloaded library missing one would let the real NCCL run with a commd communicator.
    wanted = (ROOT / "nccl" / "torch-2.15.0-imports.txt").read_text().split()
    assert len(wanted) >= 50
    missing = sorted(set(wanted) - exported)
    assert not missing, f"not exported: {missing}"
    # Every nccl*/pnccl* symbol NCCL 2.32.3's libnccl.so.2 exports (the nvidia-nccl-cu13==2.32.3
    # wheel; regenerate with `nm -D --defined-only nvidia/nccl/lib/libnccl.so.2 | awk '{print
    # $NF}' | grep -E '^p?nccl' | sort`): a program linked against it must load.
    nccl232 = (ROOT / "nccl" / "nccl-2.32.3-exports.txt").read_text().split()
    assert len(nccl232) == 193
    missing = sorted(set(nccl232) - exported)
    assert not missing, f"NCCL 2.32.3 exports these, commd does not: {missing}"
    # And everything the header declares.
    header = (ROOT / "nccl" / "include" / "nccl.h").read_text()
    import re
    declared = set(re.findall(r"^(?:ncclResult_t|const char\*)\s+(nccl\w+)\(", header, re.M))
    assert len(declared) > 30 and not declared - exported, sorted(declared - exported)


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_nccl_program_runs_every_op_and_error_path(prog, daemon, tmp_path, nranks):
    res = finish(start(prog, daemon, nranks, "ops", tmp_path))
    for r, (code, out, err) in enumerate(res):
        assert code == 0 and out.strip().endswith("OK"), f"rank {r} exit {code}\n{out}\n{err}"
    # The communicators were ordinary commd communicators, and all are gone.
    st = daemon.wait_status(lambda s: not s.get("communicators"))
    assert not st.get("communicators"), st


def test_dead_rank_is_a_remote_error_not_a_hang(prog, daemon, tmp_path):
    t0 = time.monotonic()
    res = finish(start(prog, daemon, 3, "kill", tmp_path), timeout=60)
    for r, (code, out, err) in enumerate(res):
        assert code == 0, f"rank {r} exit {code}\n{out}\n{err}"
    for code, out, err in res[:2]:
        # The failed op names the lost rank.
        assert "op failed after" in out and "2" in out.split("s:", 1)[1], out
    assert time.monotonic() - t0 < 60


def test_survivors_shrink_without_a_dead_rank_and_recover_from_a_revoke(prog, daemon, tmp_path):
    """ncclCommShrink after a rank's death (with and without NCCL_SHRINK_ABORT), then
    ncclCommRevoke and a shrink of the revoked communicator, and both calls' error paths."""
    res = finish(start(prog, daemon, 3, "shrink", tmp_path), timeout=60)
    for r, (code, out, err) in enumerate(res):
        assert code == 0, f"rank {r} exit {code}\n{out}\n{err}"
    for code, out, err in res[:2]:
        assert "OK" in out, out + err
    assert "shrunk from" in daemon.log()


def test_nccl_debug_prints_init_and_ignored_variables(prog, daemon, tmp_path):
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV", "NCCL_IB_HCA": "mlx5_0",
           "NCCL_ALGO": "allreduce:tree;broadcast:ring", "NCCL_NVLS_ENABLE": "0"}
    res = finish(start(prog, daemon, 2, "ops", tmp_path, env=env))
    for r, (code, out, err) in enumerate(res):
        assert code == 0, f"rank {r}: {err}"
        assert "NCCL INFO commd NCCL-compatible library" in err, err
        assert f"rank {r} nranks 2" in err and "Init COMPLETE" in err, err
        assert "(every local pair) via SHM" in err, err
        # Each variable set, with what commd does with it (nccl/README.md, "NCCL_* variables").
        assert "NCCL_IB_HCA=mlx5_0 not read here: the commd daemon's rdma_device" in err, err
        assert "NCCL_ALGO=allreduce:tree;broadcast:ring ignored: commd runs its own" in err, err
        assert "NCCL_NVLS_ENABLE=0 ignored: commd has no NVLS" in err, err
        assert "NCCL_DEBUG=INFO read" in err, err
        # A communicator config: its name in the INIT line, what commd cannot apply said.
        assert 'ncclConfig_t.commName "nonblocking-test"' in err, err
        assert "NCCL WARN ncclConfig_t maxCTAs=8 not applied" in err, err
        assert "splitShare" not in err, err
        # COLL was not selected: no per-op lines.
        assert "all_reduce: count" not in err
    # The daemon calls the communicator by its commName.
    assert '"nonblocking-test" (id ' in daemon.log() and "named by rank" in daemon.log()


def test_an_nccl_algo_value_nccl_refuses_fails_init_by_name(prog, daemon, tmp_path):
    # NCCL's init refuses what its grammar does not parse; so does commd's.
    res = finish(start(prog, daemon, 1, "ops", tmp_path, env={"NCCL_ALGO": "allreduce:rings"}))
    code, _, err = res[0]
    assert code == 1, err
    assert "ncclCommInitRank" in err and "-> 5" in err, err
    assert 'NCCL_ALGO="allreduce:rings" is not valid' in err and '"rings"' in err, err


def test_no_daemon_is_a_clear_system_error(prog, tmp_path):
    exe, lib = prog
    e = dict(os.environ, COMMD_SOCKET=str(tmp_path / "none.sock"), LD_LIBRARY_PATH=str(lib))
    p = subprocess.run([str(exe), "0", "1", str(tmp_path), "ops"], env=e, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1
    assert "ncclGetUniqueId" in p.stderr and "-> 2" in p.stderr, p.stderr
    assert "cannot reach the commd daemon" in p.stderr, p.stderr


def test_commd_exec_is_the_only_switch_a_job_needs(prog, daemon, tmp_path):
    """An NCCL program run under `commd exec --`: no library path, no COMMD_SOCKET of its own;
    the preloaded library answers its `NEEDED libnccl.so.2`."""
    from conftest import COMMD
    exe, _ = prog
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD", "COMMD_SOCKET", "COMMD_NCCL_LIB")}
    procs = [
        subprocess.Popen([COMMD, "exec", "--socket", str(daemon.socket), "--nccl-lib", str(LIB),
                          "--", str(exe), str(r), "2", str(tmp_path), "ops"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    for r, (code, out, err) in enumerate(finish(procs)):
        assert code == 0 and out.strip().endswith("OK"), f"rank {r} exit {code}\n{out}\n{err}"
    bad = subprocess.run([COMMD, "exec", "--nccl-lib", str(tmp_path / "nope.so"), "--", "true"],
                         capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "nope.so" in bad.stderr, bad.stderr
    missing = subprocess.run([COMMD, "exec", "--nccl-lib", str(LIB), "--", str(tmp_path / "no-such")],
                             capture_output=True, text=True, env=env)
    assert missing.returncode == 127 and "cannot run" in missing.stderr, missing.stderr
