"""The torch.distributed surface that DeepSpeed, dinov2 and older c10d code touch beyond the
basic collectives (tests/torch_surface_worker.py), on "commd" and on gloo in the same test: every
check gloo passes, commd must pass."""

import json
import subprocess
import sys
from pathlib import Path

import torch
from conftest import COMMD
from test_torch import free_port, job_env

WORKER = str(Path(__file__).resolve().parent / "torch_surface_worker.py")

# recv from any source, monitored_barrier, split_group and an untouched Work class need the
# backend's C++ shell (commd/_c10d.cpp), which the test command builds; each is checked against
# gloo like every other check. Without the shell they fail clearly (test_without_the_shell_...).

# Checks that leave the group unusable for the next one: each runs alone.
ALONE = ("timeout_error_is_torch_kind", "monitored_barrier_names_late_ranks",
         "barrier_timeout_wording")
# Checks gloo itself fails (a torch bug, or an API gloo lacks, named in each check's doc): commd
# must pass them.
COMMD_ONLY = ("new_group_bound_device", "overlapping_output_refused", "premul_sum_zero_dim",
              "backend_options_copyable", "gather_single_into_flat_output",
              "completion_and_abort_hooks")
# Checks torch itself refuses on older releases before any backend runs, with its text and the
# backends it refuses them for (each must fail that way there): torch 2.11's split_group needs
# a device bound to the default group, its monitored_barrier runs on gloo alone, and its
# init_process_group binds accelerators only.
OLD_TORCH = tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 12)
TORCH_REFUSES = {
    "split_group": ("No device associated with the default pg", ("gloo", "commd")),
    "monitored_barrier": ("only implemented for GLOO backend", ("commd",)),
    "monitored_barrier_names_late_ranks": ("only implemented for GLOO backend", ("commd",)),
    # (binds the CPU as the group's device, which torch 2.11 refuses in init_process_group)
    "new_group_bound_device": ("device_id parameter must be an accelerator", ("commd",)),
} if OLD_TORCH else {}


def run(daemon, backend, nproc, checks, **env):
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", WORKER, backend, *checks]
    p = subprocess.run(cmd, env=job_env(daemon, COMMD_BIN=COMMD, **env), capture_output=True,
                       text=True, timeout=300)
    rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    return p, {(r["check"], r["rank"]): r for r in rows}


def test_commd_passes_what_gloo_passes(daemon):
    sys.path.insert(0, str(Path(WORKER).parent))
    import torch_surface_worker as w
    checks = [c for c in w.CHECKS if c not in ALONE and c not in COMMD_ONLY]
    nproc = 3
    for backend in ("gloo", "commd"):
        for batch in (checks, *([c] for c in ALONE)):
            check_batch(daemon, backend, nproc, batch)
    # A check torch refuses may leave no group for the next: those run alone.
    check_batch(daemon, "commd", nproc, [c for c in COMMD_ONLY if c not in TORCH_REFUSES])
    for c in (c for c in COMMD_ONLY if c in TORCH_REFUSES):
        check_batch(daemon, "commd", nproc, [c])


def check_batch(daemon, backend, nproc, checks):
    p, rows = run(daemon, backend, nproc, checks)
    for c in checks:
        refused = backend in TORCH_REFUSES.get(c, ("", ()))[1]
        if refused:  # torch's refusal on some rank (a rank that never calls the API passes)
            assert any(not row["ok"] and TORCH_REFUSES[c][0] in row["error"]
                       for (cc, _), row in rows.items() if cc == c), (backend, c, rows)
        for r in range(nproc):
            row = rows.get((c, r))
            assert row is not None, f"{backend}: no result for {c} on rank {r}\n{p.stderr[-3000:]}"
            if refused:
                assert row["ok"] or TORCH_REFUSES[c][0] in row["error"], (backend, row)
            elif backend == "gloo":
                assert row["ok"], f"gloo fails {c}: {row}"
            else:
                assert row["ok"], f"commd fails {c} where gloo passes: {row}"


def test_without_the_shell_what_needs_it_fails_clearly(daemon):
    """COMMD_TORCH_EXT=0 (as where the C++ shell cannot be built): the backend still runs, says
    why once, and what needs the shell fails with a clear error instead of a wrong answer."""
    needs = {
        "recv_any_source": "needs the backend's C++ shell",
        "irecv_any_source": "needs the backend's C++ shell",
        "split_group": TORCH_REFUSES.get("split_group", ("does not support splitting",))[0],
        "is_completed_untouched": "AssertionError",
    }
    works = ["all_reduce_coalesced", "async_wait_timeout", "all_gather_object_subgroup_debug_levels",
             "future_done_when_wait_returns"]
    works += [] if "monitored_barrier" in TORCH_REFUSES else ["monitored_barrier"]
    cmd_env = dict(COMMD_TORCH_EXT="0")
    p, rows = run(daemon, "commd", 2, [*needs, *works], **cmd_env)
    for check, text in needs.items():
        got = [rows.get((check, r)) for r in range(2)]
        assert any(g and not g["ok"] and text in g["error"] for g in got), (
            f"{check}: expected a clear failure containing {text!r}, got {got}\n"
            f"{p.stderr[-2000:]}")
    for check in works:
        got = [rows.get((check, r)) for r in range(2)]
        assert all(g and g["ok"] for g in got), (check, got, p.stderr[-2000:])
    assert p.stderr.count("runs without its C++ shell (switched off by COMMD_TORCH_EXT=0)") == 2


def test_commd_debug_info_prints_the_communicator_and_its_paths(daemon):
    """COMMD_DEBUG=INFO in the job, as NCCL_DEBUG=INFO: each rank prints its commd communicator
    and the daemon's description of its paths."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", WORKER, "commd", "async_wait_timeout"]
    p = subprocess.run(cmd, env=job_env(daemon, COMMD_DEBUG="INFO", COMMD_DEBUG_SUBSYS="INIT"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for r in range(2):
        assert f"rank {r} nranks 2: commd communicator comm " in p.stderr, p.stderr[-3000:]
    # One spelling of communicator ids: decimal, as in the daemon's errors and `commd status`.
    import re
    assert re.search(r"commd communicator comm \d+, ", p.stderr), p.stderr[-3000:]
    assert "comm 0x" not in p.stderr, p.stderr[-3000:]
    assert "Init COMPLETE" in p.stderr and "(every local pair) via SHM" in p.stderr, p.stderr[-3000:]
    quiet = subprocess.run(cmd, env=job_env(daemon), capture_output=True, text=True, timeout=300)
    assert quiet.returncode == 0 and "Init COMPLETE" not in quiet.stderr
