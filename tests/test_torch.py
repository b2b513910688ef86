"""The torch.distributed backend "commd" in real multi-process jobs (torchrun, mpirun, or plain
processes with torch's env:// variables), against the real daemon, compared with gloo."""

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import torch  # noqa: F401 - the README's test command installs it; a missing torch must fail

WORKER = str(Path(__file__).resolve().parent / "torch_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(daemon, **extra):
    env = dict(os.environ)
    env.update(COMMD_SOCKET=str(daemon.socket), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(extra)
    return env


def torchrun(daemon, nproc, *args, timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", WORKER, *args]
    p = subprocess.run(cmd, env=job_env(daemon), capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"torchrun failed ({p.returncode}):\n{out[-6000:]}"
    for r in range(nproc):
        assert f"PASS rank {r}" in out, out[-6000:]
    return out


def spawn(daemon, nranks, *args):
    """Starts ranks as plain processes (no launcher that would kill survivors)."""
    port = str(free_port())
    procs = []
    for r in range(nranks):
        env = job_env(daemon, RANK=str(r), WORLD_SIZE=str(nranks), LOCAL_RANK=str(r),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, WORKER, *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def test_metrics_count_data_movement_under_the_tensor_dtype(daemon):
    """A bf16 broadcast is counted as bf16 in the daemon's metrics (it was u8: bytes)."""
    def scrape():
        addr = daemon.status()["metrics_listen"]
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            return r.read().decode()

    torchrun(daemon, 2, "dtypes")
    # The group's communicator is called by torch's name for the group in the daemon's logs
    # (and so in its errors) and in `commd status`.
    assert '"default_pg (torch group 0)" (id ' in daemon.log() or \
        '"torch group 0" (id ' in daemon.log(), daemon.log()[-3000:]
    text = scrape()
    # Bytes as the daemon counts them: each rank's count (per-rank block for all_gather and
    # all_to_all) times the element size, summed over the 2 ranks.
    for op, dt, nbytes in [("broadcast", "bf16", 2 * 8 * 2), ("all_gather", "i64", 2 * 5 * 8),
                           ("all_to_all", "f16", 2 * 4 * 2)]:
        want = f'commd_op_bytes_total{{op="{op}",dtype="{dt}",transport="shm"}} '
        line = [ln for ln in text.splitlines() if ln.startswith(want)]
        assert line, f"no {want!r} series:\n" + "\n".join(
            ln for ln in text.splitlines() if ln.startswith("commd_op_bytes_total"))
        assert float(line[0].split()[-1]) == nbytes, line
    assert 'commd_op_bytes_total{op="broadcast",dtype="u8"' not in text


@pytest.mark.parametrize("nproc", [2, 3])
def test_fp8_and_unsigned_reductions_match_torch_references(daemon, nproc):
    torchrun(daemon, nproc, "typed")


@pytest.mark.parametrize("nproc", [2, 3])
def test_premul_sum_scales_before_summing(daemon, nproc):
    """ReduceOp.PREMUL_SUM, which gloo lacks and FSDP2 uses: checked against its definition."""
    torchrun(daemon, nproc, "premul")


@pytest.mark.parametrize("nproc", [2, 4])
def test_every_op_and_dtype_matches_gloo(daemon, nproc):
    out = torchrun(daemon, nproc, "ops")
    assert "compared" in out and "ops with gloo" in out


@pytest.mark.parametrize("mode", ["on", "off", "nocache"])
def test_large_cpu_tensors_run_in_place_and_fork_safely(daemon, mode):
    """commd's CPU allocator: ops on large ordinary tensors (every op kind, views, out of place,
    a reused block, after a fork whose child writes the tensor) equal gloo's and run in place;
    with COMMD_CPU_ALLOC=0 the allocator is unused and results are the same; with no cache of
    freed blocks, their registrations are dropped."""
    extra = {"on": {}, "off": {"COMMD_CPU_ALLOC": "0"}, "nocache": {"COMMD_CPU_CACHE_MIB": "0"}}[mode]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3",
           f"--master_port={free_port()}", WORKER, "cpu_alloc", mode]
    p = subprocess.run(cmd, env=job_env(daemon, **extra), capture_output=True, text=True,
                       timeout=600)
    out = p.stdout + p.stderr
    # The first rank's failure is the cause; the others then report it as a lost peer.
    first = [ln for ln in out.splitlines() if "Error" in ln and "PeerLost" not in ln][:5]
    assert p.returncode == 0, "\n".join(first) + "\n" + out[-6000:]
    for r in range(3):
        assert f"PASS rank {r}" in out, out[-6000:]
    assert f"cpu_alloc {mode}: results equal gloo's" in out, out[-6000:]


def test_exit_with_futures_in_flight_ends_cleanly(daemon):
    """A job that exits while commd's progress thread still completes futures of its ops exits
    0: Python must not kill the daemon thread while torch's C++ frees a tensor on it (the
    process would end in std::terminate). Five jobs, each racing its exit."""
    for i in range(5):
        procs = spawn(daemon, 2, "exit_futures", "300")
        outs = [p.communicate(timeout=300)[0] for p in procs]
        for r, (p, out) in enumerate(zip(procs, outs)):
            assert p.returncode == 0, f"job {i} rank {r} exited {p.returncode}:\n{out[-3000:]}"
            assert "terminate called" not in out, out[-3000:]
            assert f"PASS rank {r}" in out, out[-3000:]


@pytest.mark.parametrize("nproc", [2, 4])
def test_ddp_20_steps_match_gloo(daemon, nproc):
    out = torchrun(daemon, nproc, "ddp", "20")
    assert "DDP 20 steps match gloo" in out


@pytest.mark.parametrize("kind,exc", [("mismatch", "MismatchError"), ("kill", "PeerLostError")])
def test_errors_raise_in_every_surviving_rank_within_5s(daemon, kind, exc):
    n = 3
    procs = spawn(daemon, n, f"error-{kind}")
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out))
    survivors = outs[:-1] if kind == "kill" else outs
    if kind == "kill":
        assert outs[-1][0] == -9, outs[-1]
    for code, out in survivors:
        assert code == 0, out[-3000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RAISED"))
        assert line.startswith(f"RAISED {exc} "), line
        secs = float(line.split(" after ")[1].split("s:")[0])
        assert secs < 5.0, line
        if kind == "mismatch":
            # the message names what differs and which ranks
            assert "count" in line and "rank" in line, line
        else:
            assert "rank 2" in line, line
        # torch's Backend.getError: SUCCESS before; REMOTE_ERROR (3) once a rank is lost; a
        # mismatch fails that op only (the daemon keeps the communicator working): SUCCESS
        # (torch without getError prints no such line)
        err = [ln for ln in out.splitlines() if ln.startswith("ERRORTYPE")]
        if hasattr(torch._C._distributed_c10d.Backend, "get_error"):
            assert err == [f"ERRORTYPE 0 {0 if kind == 'mismatch' else 3}"], out[-3000:]


@pytest.mark.skipif(shutil.which("mpirun") is None and not os.environ.get("COMMD_REQUIRE_ALL"),
                    reason="mpirun not installed")
def test_init_under_mpirun(daemon):
    """mpirun sets only OMPI_* variables; `import commd.torch` fills in torch's env://."""
    n = 2
    env = job_env(daemon)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
           "-x", "COMMD_SOCKET", "-x", "OMP_NUM_THREADS", "-x", "PYTHONUNBUFFERED",
           sys.executable, WORKER, "ddp", "3"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for r in range(n):
        assert f"PASS rank {r}" in out, out[-6000:]


def test_daemon_unavailable_names_socket_and_fix(tmp_path):
    missing = tmp_path / "nope.sock"
    code = (
        "import commd, torch.distributed as dist, commd.torch\n"
        "try:\n"
        f"    commd.Client({str(missing)!r})\n"
        "except commd.DaemonUnavailableError as e:\n"
        "    print('OK', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("OK "), p.stdout + p.stderr
    assert str(missing) in p.stdout and "commd serve" in p.stdout, p.stdout


def test_init_process_group_without_daemon_fails_fast(tmp_path):
    """No daemon: init_process_group("commd") raises DaemonUnavailableError, not a hang."""
    env = dict(os.environ, COMMD_SOCKET=str(tmp_path / "none.sock"), RANK="0", WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    code = (
        "import time, commd, commd.torch, torch.distributed as dist\n"
        "t = time.monotonic()\n"
        "try:\n"
        "    dist.init_process_group('commd')\n"
        "except commd.DaemonUnavailableError as e:\n"
        "    print('OK', round(time.monotonic() - t, 3), e)\n"
    )
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("OK "), p.stdout + p.stderr[-3000:]
    assert float(p.stdout.split()[1]) < 5.0, p.stdout
    assert time.monotonic() - t0 < 60


def test_backend_found_by_name_alone(daemon):
    """No `import commd`: torch finds the backend through the package's entry point."""
    env = job_env(daemon, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(free_port()))
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "dist.init_process_group('commd')\n"
        "assert 'commd' not in sys.argv\n"
        "t = torch.arange(4.0); dist.all_reduce(t)\n"
        "print(dist.get_backend(), t.tolist())\n"
    )
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    import inspect

    import torch.distributed.distributed_c10d as c10d
    if "torch.distributed.backends" not in inspect.getsource(c10d):
        # A torch that loads no backend entry points (2.11): the name alone is torch's
        # "Unknown backend", and `import commd.torch` first is the way (README, torch face).
        assert p.returncode != 0 and "Unknown backend type commd" in p.stderr, p.stderr[-3000:]
        code = "import commd.torch\n" + code.replace("assert 'commd' not in sys.argv\n", "")
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip() == "commd [0.0, 1.0, 2.0, 3.0]", p.stdout


BENCH = Path(__file__).resolve().parent.parent / "client-py" / "benchmarks" / "nccltests_torch.py"
VS = Path(__file__).resolve().parent / "gpu" / "nccl_vs_torch.py"


def test_nccltests_harness_checks_every_op_on_the_commd_backend(daemon, tmp_path):
    """client-py/benchmarks/nccltests_torch.py (the torch side of nccl-tests), on CPU
    tensors here: every op at every size checked against the values it computes, 3 ranks."""
    out = tmp_path / "rows.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3",
           f"--master_port={free_port()}", str(BENCH), "--backend", "commd", "--device", "cpu",
           "-b", "8", "-e", "64K", "-f", "8", "-n", "3", "-w", "1", "--watchdog", "60",
           "--json", str(out)]
    p = subprocess.run(cmd, env=job_env(daemon), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    assert '{"wrong_total": 0}' in p.stdout, p.stdout[-3000:]
    import json
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ops = {r["op"] for r in rows}
    assert ops == {"all_reduce", "all_gather", "broadcast", "reduce", "reduce_scatter",
                   "alltoall", "sendrecv"}, ops
    for r in rows:
        assert r["wrong"] == 0 and r["time_us"] > 0 and r["size"] > 0, r
    # nccl-tests' sizes: all_gather's is the output, each rank's share rounded down to 4
    # elements (3 ranks: 32 KiB -> 3 x 2728 floats).
    ag = {r["size"]: r["count"] for r in rows if r["op"] == "all_gather"}
    assert ag[32736] == 2728, ag


DDP_BENCH = BENCH.parent / "ddp_overlap.py"


def test_ddp_step_benchmark_on_cpu_matches_gloo(daemon, tmp_path):
    """client-py/benchmarks/ddp_overlap.py --device cpu: a DDP step on commd and on gloo from
    the same seed and data; the run fails when the two replicas' losses part."""
    out = tmp_path / "ddp.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(DDP_BENCH), "--device", "cpu", "--layers", "1",
           "--dim", "64", "--heads", "4", "--vocab", "256", "--batch", "2", "--seq", "16",
           "--steps", "4", "--warmup", "1", "--block", "2", "--loss-rtol", "1e-4",
           "--json", str(out)]
    p = subprocess.run(cmd, env=job_env(daemon), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    import json
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["ok"] and row["peer"] == "gloo" and row["device"] == "cpu", row
    assert len(row["losses_commd"]) == 5 and row["loss_rel_diff"] <= 1e-4, row
    assert row["losses_commd"][0] != row["losses_commd"][-1], row  # the model trained
    assert all(v > 0 for v in row["median_ms"].values()), row


def test_ddp_timeline_benchmark_times_every_bucket_of_both_backends(daemon, tmp_path):
    """client-py/benchmarks/ddp_timeline.py: each bucket's all-reduce, issued and done within
    its step, the same buckets on gloo and on commd, on every rank."""
    out = tmp_path / "timeline.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(BENCH.parent / "ddp_timeline.py"), "--device",
           "cpu", "--layers", "2", "--dim", "64", "--heads", "4", "--vocab", "256", "--batch",
           "2", "--seq", "16", "--steps", "3", "--warmup", "1", "--json", str(out)]
    p = subprocess.run(cmd, env=job_env(daemon), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    import json
    rows = {r["backend"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["commd", "gloo"], rows
    sizes = {}
    for name, r in rows.items():
        assert len(r["step_ms"]) == 2 and r["buckets"], r
        for b in r["buckets"]:
            assert 0 <= b["issued_ms"] <= b["last_issued_ms"], (name, b)
            assert b["issued_ms"] <= b["done_ms"] <= max(r["step_ms"]), (name, b)
        sizes[name] = sorted(b["bytes"] for b in r["buckets"])
    assert sizes["commd"] == sizes["gloo"] and sum(sizes["gloo"]) > 0, sizes


def test_ddp_step_benchmark_refuses_bad_arguments_by_name():
    for args, says in [(["--threads", "-1"], "--threads"), (["--device", "tpu"], "--device"),
                       (["--dim", "30", "--heads", "4"], "--dim")]:
        p = subprocess.run([sys.executable, str(DDP_BENCH), *args], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and says in p.stderr, (args, p.stderr[-2000:])


def _nccltests_log(path, rows):
    """A log in nccl-tests' table format: (size, out-of-place us, in-place us, wrong)."""
    lines = ["# nccl-tests version 2.19.6", "#       size         count      type   redop    root"
             "     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong"]
    for size, oop, ip, wrong in rows:
        lines.append(f"{size:>12} {size // 4:>13}     float     sum      -1 {oop:>8.2f}    0.00"
                     f"    0.00 {wrong:>7} {ip:>8.2f}    0.00    0.00 {wrong:>7}")
    lines.append("# Out of bounds values : 0 OK")
    path.write_text("\n".join(lines) + "\n")


def _torch_rows(path, op, rows):
    import json
    path.write_text("".join(json.dumps({"op": op, "size": s, "time_us": t, "wrong": 0}) + "\n"
                            for s, t in rows))


def _vs(tmp_path, lib, torch_commd, nccl=((8, 5.0, 5.0, 0), (1 << 20, 50.0, 50.0, 0)),
        torch_nccl=((8, 30.0), (1 << 20, 60.0))):
    d = tmp_path / "vs"
    d.mkdir(exist_ok=True)
    _nccltests_log(d / "vs-all_reduce-commd-r1.log", lib)
    _nccltests_log(d / "vs-all_reduce-nccl-r1.log", nccl)
    _torch_rows(d / "vs-torch-commd-r1.jsonl", "all_reduce", torch_commd)
    _torch_rows(d / "vs-torch-nccl-r1.jsonl", "all_reduce", torch_nccl)
    (d / "vs-torch-commd-r1.log").write_text("not nccl-tests' output\n")
    return subprocess.run([sys.executable, str(VS), str(d)], capture_output=True, text=True,
                          timeout=60)


def test_library_vs_torch_comparison_flags_each_miss(tmp_path):
    """tests/gpu/nccl_vs_torch.py: all_reduce is compared in place; 5% over the torch backend
    is a miss, and so is a library slower than NCCL where the torch backend is not."""
    ok = _vs(tmp_path, lib=((8, 99.0, 9.0, 0), (1 << 20, 99.0, 40.0, 0)),
             torch_commd=((8, 40.0), (1 << 20, 42.0)))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "2 of 2 sizes" in ok.stdout, ok.stdout
    slow = _vs(tmp_path, lib=((8, 1.0, 9.0, 0), (1 << 20, 1.0, 44.2, 0)),
               torch_commd=((8, 40.0), (1 << 20, 42.0)))
    assert slow.returncode == 1, slow.stdout + slow.stderr
    assert "MISS: all_reduce 1 MiB: library 44.2 us vs torch backend 42.0 us" in slow.stdout
    below = _vs(tmp_path, lib=((8, 9.0, 9.0, 0), (1 << 20, 55.0, 55.0, 0)),
                torch_commd=((8, 40.0), (1 << 20, 58.0)))
    assert below.returncode == 1 and "torch backend at NCCL" in below.stdout, below.stdout
    wrong = _vs(tmp_path, lib=((8, 9.0, 9.0, 3), (1 << 20, 40.0, 40.0, 0)),
                torch_commd=((8, 40.0), (1 << 20, 42.0)))
    assert wrong.returncode == 2 and "6 wrong values" in wrong.stdout, wrong.stdout


def test_library_vs_torch_comparison_says_when_a_miss_is_inside_nccls_spread(tmp_path):
    """A library slower than NCCL's best round but not than its worst is still a miss of the
    goal, said to be inside NCCL's own spread; one slower than every NCCL round is not."""
    d = tmp_path / "vs"
    d.mkdir()
    _nccltests_log(d / "vs-all_reduce-nccl-r2.log", ((8, 6.0, 6.0, 0), (1 << 20, 52.0, 52.0, 0)))
    p = _vs(tmp_path, lib=((8, 9.0, 5.5, 0), (1 << 20, 60.0, 60.0, 0)),
            torch_commd=((8, 40.0), (1 << 20, 58.0)), torch_nccl=((8, 45.0), (1 << 20, 60.0)))
    assert p.returncode == 1, p.stdout + p.stderr
    small = [m for m in p.stdout.splitlines() if m.startswith("MISS: all_reduce 8 B")]
    large = [m for m in p.stdout.splitlines() if m.startswith("MISS: all_reduce 1 MiB")]
    assert small and "inside NCCL's own spread over the rounds (its worst 6.0 us)" in small[0], \
        p.stdout
    assert large and "spread" not in large[0], p.stdout
    assert "2 sizes where the torch backend is at NCCL and the library is not; at 1 of them" \
        in p.stdout, p.stdout


def test_nccltests_harness_refuses_bad_arguments_by_name():
    for args, want in ((["--ops", "all_reduce,bogus"], "unknown op 'bogus'"),
                       (["-f", "1"], "need -f >= 2"),
                       (["-b", "2M", "-e", "1M"], "1 <= -b <= -e"),
                       (["-e", "lots"], "not a size: 'lots'")):
        p = subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True,
                           timeout=120, cwd=BENCH.parent)
        assert p.returncode == 2 and want in p.stderr, (args, p.returncode, p.stderr[-2000:])


def test_library_vs_torch_comparison_without_results_says_so(tmp_path):
    p = subprocess.run([sys.executable, str(VS), str(tmp_path)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "no vs-*.log or vs-torch-*.jsonl" in p.stderr, p.stderr


def test_library_vs_torch_comparison_shows_a_base_library(tmp_path):
    """A second build of the library (nccl.sh's VS_BASE_LIB) gets its own column and the
    library's ratio to it; the goals stay the four routes'."""
    d = tmp_path / "vs"
    d.mkdir()
    _nccltests_log(d / "vs-all_reduce-base-r1.log", ((8, 20.0, 12.0, 0), (1 << 20, 99.0, 80.0, 0)))
    _nccltests_log(d / "vs-all_reduce-base-r2.log", ((8, 20.0, 10.0, 0), (1 << 20, 99.0, 88.0, 0)))
    p = _vs(tmp_path, lib=((8, 9.0, 4.0, 0), (1 << 20, 40.0, 40.0, 0)),
            torch_commd=((8, 40.0), (1 << 20, 42.0)))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "| base library | lib/base |" in p.stdout, p.stdout
    # best of the base's rounds: 10 us at 8 B (in place), 80 us at 1 MiB
    assert "| 10.0 | 0.40 |" in p.stdout and "| 80.0 | 0.50 |" in p.stdout, p.stdout
    wrong = tmp_path / "vs" / "vs-all_reduce-base-r3.log"
    _nccltests_log(wrong, ((8, 20.0, 10.0, 2),))
    p = _vs(tmp_path, lib=((8, 9.0, 4.0, 0), (1 << 20, 40.0, 40.0, 0)),
            torch_commd=((8, 40.0), (1 << 20, 42.0)))
    assert p.returncode == 2 and "vs-all_reduce-base-r3.log: 4 wrong values" in p.stdout, p.stdout
