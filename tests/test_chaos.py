"""Short, seeded runs of the chaos and soak runners (tests/chaos.py) in the test suite: clients
and node daemons killed and stopped at random points of random ops, then no hang, errors that
name what was lost, a daemon that serves the next job and returns to idle with nothing leaked;
and sessions/communicators churning with RSS, fds and threads flat. Longer runs: docs/reliability.md."""

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(*args, timeout):
    out = subprocess.run([sys.executable, str(HERE / "chaos.py"), *args], capture_output=True,
                         text=True, timeout=timeout, env=dict(os.environ))
    lines = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    summary = [l for l in lines if "summary" in l]
    assert summary, out.stdout[-3000:] + out.stderr[-3000:]
    return out.returncode, summary[-1], lines


def test_chaos_kills_and_stops_leave_no_hang_no_leak():
    code, s, lines = run("chaos", "--seed", "7", "--iterations", "12", "--max-seconds", "240",
                         timeout=400)
    bad = [l for l in lines if l.get("hung") or l.get("unnamed") or l.get("leaks")
           or l.get("new_job_ok") is False]
    assert code == 0 and not bad, (s, bad)
    assert s["iterations"] >= 8 and s["kills"] + s["stops"] == s["iterations"], s
    assert (s["hangs"], s["unnamed_errors"], s["leaks"], s["new_job_failures"]) == (0, 0, 0, 0)


def test_soak_keeps_rss_fds_and_threads_flat():
    code, s, _ = run("soak", "--seconds", "20", "--seed", "3", timeout=200)
    assert code == 0 and s["drift"] == [], s
    assert s["jobs"] > 50, s
