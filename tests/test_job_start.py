"""client-py/benchmarks/job_start.py on CPU tensors: the start-up benchmark runs commd and gloo
in one invocation, every job's collectives are right, and ten-style short jobs back to back
leave the daemon at its idle level (no session, communicator or open handle left). Real daemons
(the benchmark starts its own) and real torch processes."""

import json
import os
import subprocess
import sys

import torch  # noqa: F401 - the README's test command installs it; a missing torch must fail

from conftest import BIN, ROOT

SCRIPT = str(ROOT / "client-py" / "benchmarks" / "job_start.py")


def test_job_start_cpu(tmp_path):
    out = tmp_path / "jobstart.jsonl"
    env = dict(os.environ, COMMD_BIN=str(BIN / "commd"))
    p = subprocess.run([sys.executable, SCRIPT, "--cpu", "--jobs", "2", "--ranks", "2",
                        "--comms", "1,4", "--back-to-back", "3", "--json", str(out),
                        "--log-dir", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    setups = {(r["backend"], r["setup"]) for r in rows}
    assert {("gloo", "peer"), ("commd", "warm"), ("commd", "cold"),
            ("commd", "back-to-back")} <= setups, setups
    for r in rows:
        if r["setup"] == "back-to-back":
            assert len(r["jobs"]) == 3
            for j in r["jobs"]:
                assert (j["sessions"], j["communicators"], j["ipc_open_now"]) == (0, 0, 0), j
                assert j["first_collective_s"] > 0
            continue
        assert r["correct"], r
        assert r["first_collective_s"] >= r["init_and_first_op_s"] > 0, r
        assert set(r["comms_s"]) == {"1", "4"} and all(v > 0 for v in r["comms_s"].values())
    assert "K=4 s" in p.stdout, p.stdout
