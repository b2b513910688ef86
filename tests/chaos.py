"""Chaos and soak runners: real daemons, real client processes, seeded and bounded.

    python3 tests/chaos.py chaos --seed 1 --iterations 40 [--max-seconds 600]
    python3 tests/chaos.py soak --seconds 300 [--seed 1]

chaos: each iteration picks a scenario and a victim at random (fixed seed): SIGKILL or SIGSTOP of
one client rank, or SIGKILL or SIGSTOP of one node daemon of a two-node job, at a random moment
of a random sequence of collectives. After each it checks that:
  - no survivor waits past its budget (op/peer/daemon timeout plus slack): no hang;
  - every survivor's failing step carries an error that names what was lost (the rank, the node,
    a timeout naming the rank that never posted, or the daemon that stopped answering);
  - every daemon serves a new job afterwards;
  - every daemon returns to idle: no session, communicator, registration or pending join, and
    its open fds, memfds and threads (outside the control plane's tokio pool, which keeps idle
    blocking threads for 10 s) back at the level measured before the iteration.
soak: jobs of random sizes start, run a few ops and exit back to back on one daemon (sessions
and communicators churning) while RSS, fds and threads are sampled each second; reports the
first, last and largest sample of each and fails if the level after the soak exceeds the level
after warm-up by more than the tolerance (--rss-slack-mb, default 8; fds and threads: exact).

Prints one JSON line per iteration or sample and a summary line; exits non-zero on any
failure. `tests/test_chaos.py` runs a short version of both in the test suite; docs/reliability.md
records longer runs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import TESTCLIENT, Daemon, Rank  # noqa: E402

OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all",
       "barrier"]
OP_TIMEOUT_MS = 3000
PEER_TIMEOUT_MS = 2000
DAEMON_TIMEOUT_MS = 2000
SLACK_S = 6.0

LOST_WORDS = ("lost", "timed out", "never posted", "stopped answering", "exited", "aborted",
              "closed", "shutting down", "peer")


def proc_usage(pid: int) -> dict:
    """fds, memfds, threads (split by name) and RSS of a process."""
    fds = os.listdir(f"/proc/{pid}/fd")
    memfds = 0
    for f in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{f}").startswith("/memfd:"):
                memfds += 1
        except OSError:
            pass
    threads = {"ctl": 0, "other": 0}
    names = []
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            name = Path(f"/proc/{pid}/task/{t}/comm").read_text().strip()
        except OSError:
            continue
        threads["ctl" if name.startswith("commd-ctl") else "other"] += 1
        if not name.startswith("commd-ctl"):
            names.append(name)
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) // 1024
    return {"fds": len(fds), "memfds": memfds, "threads": threads["other"],
            "ctl_threads": threads["ctl"], "rss_mb": rss, "names": sorted(names)}


def idle(d: Daemon, timeout: float = 15.0) -> dict:
    st = d.wait_status(lambda s: s["sessions"] == 0 and s["communicators"] == 0
                       and s["registrations"] == 0 and s["pending_joins"] == 0,
                       timeout=timeout)
    return st


def random_steps(rng: random.Random, n: int) -> list[dict]:
    steps = []
    for _ in range(n):
        op = rng.choice(OPS)
        s = {"op": op, "dtype": rng.choice(["f32", "i32", "bf16"]),
             "count": rng.choice([1, 7, 1000, 65536, 262144]), "expect": "any"}
        if op in ("broadcast", "reduce"):
            s["root"] = 0
        steps.append(s)
    return steps


def start_job(nodes: list[Daemon], placement: list[int], steps, env: dict) -> list[Rank]:
    uid = nodes[placement[0]].uid()
    n = len(placement)
    ranks = []
    for r in range(n):
        rk = Rank.__new__(Rank)
        rk.cmd = [TESTCLIENT, "run", "--stop-on-error", "--socket",
                  str(nodes[placement[r]].socket), "--steps", json.dumps(steps), "--join",
                  f"{uid}:{r}:{n}:{OP_TIMEOUT_MS}:20000"]
        rk.proc = subprocess.Popen(rk.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env=env)
        rk.out = rk.err = rk.ended = None
        ranks.append(rk)
    return ranks


def failing_message(rk: Rank) -> str | None:
    """The message of the first failed step (or a fatal line), None when every step passed."""
    for line in (rk.out or "").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "fatal" in row:
            return str(row["fatal"])
        if row.get("result", "ok") != "ok":
            return row.get("message") or row.get("result")
    return None


class Cluster:
    """Two daemons acting as two nodes (loopback), restartable."""

    def __init__(self, root: Path, env: dict):
        self.root = root
        self.env = env
        self.nodes = [self._daemon(i) for i in range(2)]

    def _daemon(self, i: int) -> Daemon:
        d = self.root / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        return Daemon(d, env=dict(self.env)).start()

    def restart(self, i: int) -> None:
        old = self.nodes[i]
        if old.alive():
            old.proc.kill()
        old.proc.wait(10)
        self.nodes[i] = self._daemon(i)

    def stop(self) -> None:
        for d in self.nodes:
            if d.alive():
                d.send_signal(signal.SIGCONT)
                d.stop()


def chaos(args) -> int:
    rng = random.Random(args.seed)
    env = dict(os.environ, COMMD_PEER_TIMEOUT_MS=str(PEER_TIMEOUT_MS),
               COMMD_DAEMON_TIMEOUT_MS=str(DAEMON_TIMEOUT_MS), COMMD_DEBUG="WARN",
               COMMD_PEER_LISTEN="127.0.0.1:0")
    tmp = Path(tempfile.mkdtemp(prefix="commd-chaos-"))
    cl = Cluster(tmp, env)
    t_start = time.monotonic()
    totals = {"iterations": 0, "kills": 0, "stops": 0, "hangs": 0, "unnamed_errors": 0,
              "leaks": 0, "new_job_failures": 0}
    failures = []
    try:
        # Warm-up: a single-node and a two-node job, so lazily made state (the data-plane
        # thread pool, peer channels) exists before the first baseline is taken.
        for placement in ([0, 0], [0, 1]):
            warm = [{"op": "all_reduce", "dtype": "f32", "count": c} for c in (100, 4 << 20)]
            for r in start_job(cl.nodes, placement, warm, env):
                r.proc.communicate(timeout=60)
        for d in cl.nodes:
            idle(d)
        for it in range(args.iterations):
            if time.monotonic() - t_start > args.max_seconds:
                break
            scenario = rng.choice(["kill_client", "stop_client", "kill_node", "stop_node"])
            multi = scenario.endswith("node") or rng.random() < 0.3
            nranks = rng.choice([2, 3, 4])
            placement = [(r % 2) if multi else 0 for r in range(nranks)]
            before = [proc_usage(d.proc.pid) for d in cl.nodes]
            steps = random_steps(rng, 400)
            ranks = start_job(cl.nodes, placement, steps, env)
            victim_rank = rng.randrange(nranks)
            victim_node = 1
            time.sleep(rng.uniform(0.2, 0.8))
            t_sig = time.monotonic()
            note = {"it": it, "scenario": scenario, "nranks": nranks, "nodes": 2 if multi else 1}
            if scenario == "kill_client":
                ranks[victim_rank].proc.kill()
                totals["kills"] += 1
                survivors = [r for i, r in enumerate(ranks) if i != victim_rank]
                budget = SLACK_S
                note["victim"] = f"rank {victim_rank}"
            elif scenario == "stop_client":
                ranks[victim_rank].proc.send_signal(signal.SIGSTOP)
                totals["stops"] += 1
                survivors = [r for i, r in enumerate(ranks) if i != victim_rank]
                budget = OP_TIMEOUT_MS / 1e3 + SLACK_S
                note["victim"] = f"rank {victim_rank}"
            elif scenario == "kill_node":
                cl.nodes[victim_node].proc.kill()
                totals["kills"] += 1
                survivors = [r for i, r in enumerate(ranks) if placement[i] != victim_node]
                budget = PEER_TIMEOUT_MS / 1e3 + SLACK_S
                note["victim"] = f"node {victim_node}"
            else:
                cl.nodes[victim_node].send_signal(signal.SIGSTOP)
                totals["stops"] += 1
                # Every rank is a survivor here: the other node's ranks see a lost node, the
                # stopped node's own ranks a daemon that stopped answering.
                survivors = list(ranks)
                budget = max(PEER_TIMEOUT_MS, DAEMON_TIMEOUT_MS) / 1e3 + SLACK_S
                note["victim"] = f"node {victim_node}"
            hung = 0
            unnamed = []
            hung_at = []
            for r in survivors:
                left = max(0.1, budget - (time.monotonic() - t_sig))
                try:
                    r.out, r.err = r.proc.communicate(timeout=left)
                except subprocess.TimeoutExpired:
                    hung += 1
                    r.proc.kill()
                    r.out, r.err = r.proc.communicate()
                    i = ranks.index(r)
                    hung_at.append(f"rank {i} on node {placement[i]} after "
                                   f"{len((r.out or '').splitlines())} lines")
                    continue
                msg = failing_message(r)
                # A survivor may finish all its steps before the loss reaches it (the victim
                # was killed after its last op): then nothing is missing.
                if msg is not None and not any(w in msg.lower() for w in LOST_WORDS):
                    unnamed.append(msg[:300])
            note["survivor_s"] = round(time.monotonic() - t_sig, 2)
            # Clean up the victim and any stopped process.
            for r in ranks:
                if r.proc.poll() is None:
                    r.proc.send_signal(signal.SIGCONT)
                    r.proc.kill()
                    r.proc.communicate()
            if scenario in ("kill_node", "stop_node"):
                cl.restart(victim_node)
            leaks = []
            for i, d in enumerate(cl.nodes):
                st = idle(d)
                if (st["sessions"], st["communicators"], st["registrations"],
                        st["pending_joins"]) != (0, 0, 0, 0):
                    leaks.append(f"node {i} not idle: {st['sessions']} sessions, "
                                 f"{st['communicators']} comms, {st['registrations']} regs")
                if scenario.endswith("node") and i == victim_node:
                    continue  # a fresh daemon: nothing to compare with
                after = proc_usage(d.proc.pid)
                for k in ("fds", "memfds", "threads"):
                    if after[k] > before[i][k]:
                        # Give deferred closes a moment, then measure again.
                        time.sleep(1.0)
                        after = proc_usage(d.proc.pid)
                        if after[k] > before[i][k]:
                            extra = ""
                            if k == "threads":
                                extra = f" {before[i]['names']} -> {after['names']}"
                            leaks.append(f"node {i} {k}: {before[i][k]} -> {after[k]}{extra}")
            # Every daemon serves a new job.
            new = start_job(cl.nodes, [0, 1] if multi else [0, 0],
                            [{"op": "all_reduce", "dtype": "f32", "count": 100}], env)
            new_ok = True
            for r in new:
                try:
                    r.out, r.err = r.proc.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.out, r.err = r.proc.communicate()
                new_ok &= r.proc.returncode == 0
            for d in cl.nodes:
                idle(d)
            totals["iterations"] += 1
            totals["hangs"] += hung
            totals["unnamed_errors"] += len(unnamed)
            totals["leaks"] += len(leaks)
            totals["new_job_failures"] += 0 if new_ok else 1
            note.update(hung=hung, hung_at=hung_at, unnamed=unnamed, leaks=leaks,
                        new_job_ok=new_ok)
            print(json.dumps(note), flush=True)
            if hung or unnamed or leaks or not new_ok:
                failures.append(note)
    finally:
        cl.stop()
    totals["seconds"] = round(time.monotonic() - t_start, 1)
    totals["seed"] = args.seed
    print(json.dumps({"summary": "chaos", **totals}), flush=True)
    return 1 if failures else 0


def soak(args) -> int:
    rng = random.Random(args.seed)
    env = dict(os.environ, COMMD_DEBUG="WARN")
    tmp = Path(tempfile.mkdtemp(prefix="commd-soak-"))
    d = Daemon(tmp, env=dict(env)).start()
    samples = []
    jobs = 0
    sessions = 0
    try:
        t0 = time.monotonic()
        last_sample = 0.0
        warm = None
        while time.monotonic() - t0 < args.seconds:
            nranks = rng.choice([1, 2, 3, 4])
            steps = random_steps(rng, rng.randrange(1, 6))
            for s in steps:
                s["expect"] = "ok"
            ranks = start_job([d], [0] * nranks, steps, env)
            for r in ranks:
                r.out, r.err = r.proc.communicate(timeout=60)
                if r.proc.returncode != 0:
                    print(json.dumps({"job_failed": r.out[-500:], "err": r.err[-500:]}))
                    return 1
            jobs += 1
            sessions += nranks
            now = time.monotonic() - t0
            if now - last_sample >= 1.0:
                last_sample = now
                u = proc_usage(d.proc.pid)
                u["t"] = round(now, 1)
                u["jobs"] = jobs
                samples.append(u)
                print(json.dumps(u), flush=True)
                if warm is None and now >= min(10.0, args.seconds / 4):
                    warm = dict(u)
        idle(d)
        time.sleep(1.0)
        end = proc_usage(d.proc.pid)
    finally:
        d.stop()
    warm = warm or samples[0]
    summary = {"summary": "soak", "seconds": args.seconds, "jobs": jobs, "sessions": sessions,
               "first": samples[0], "warm": warm, "end_idle": end,
               "max": {k: max(s[k] for s in samples) for k in ("rss_mb", "fds", "threads")}}
    bad = []
    if end["rss_mb"] > warm["rss_mb"] + args.rss_slack_mb:
        bad.append(f"RSS {warm['rss_mb']} -> {end['rss_mb']} MiB")
    for k in ("fds", "memfds", "threads"):
        if end[k] > samples[0][k]:
            bad.append(f"{k} {samples[0][k]} -> {end[k]}")
    summary["drift"] = bad
    print(json.dumps(summary), flush=True)
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("chaos")
    c.add_argument("--seed", type=int, default=1)
    c.add_argument("--iterations", type=int, default=40)
    c.add_argument("--max-seconds", type=float, default=600)
    s = sub.add_parser("soak")
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--seconds", type=float, default=300)
    s.add_argument("--rss-slack-mb", type=int, default=8)
    a = p.parse_args()
    return chaos(a) if a.cmd == "chaos" else soak(a)


if __name__ == "__main__":
    sys.exit(main())
