"""Switch sessions end to end: real daemons acting as nodes, a real `commd switch` (the software
SwitchML switch), real client processes. Each node's switch workers send from their own
loopback IP (127.0.0.x), as separate hosts would, so the switch tells them apart by address
exactly like a Tofino does."""

import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import COMMD, Daemon, Rank, assert_all_pass
from test_multinode import place_contiguous, run_multi, start_multi


class Switch:
    def __init__(self, tmp_path, *args, env=None):
        self.log = Path(tmp_path) / "switch.log"
        self.f = open(self.log, "w")
        # The same CPU claim registry as the test's daemons (a host-wide file in production).
        env = {**os.environ, "COMMD_CPU_CLAIMS": str(Path(tmp_path) / "claims"),
               "COMMD_DEBUG": "INFO", **(env or {})}
        self.proc = subprocess.Popen(
            [COMMD, "switch", "--listen", "127.0.0.1:0", "--data", "127.0.0.1:0",
             "--metrics", "127.0.0.1:0", *args],
            stdout=subprocess.PIPE, stderr=self.f, text=True, env=env)
        line = self.proc.stdout.readline()
        m = re.search(r"controller (\S+) data (\S+) metrics (\S+)", line)
        assert m, f"commd switch printed {line!r}; log: {self.log.read_text()}"
        self.controller, self.data, self.metrics_addr = m.groups()

    def metrics(self):
        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=5) as r:
            return r.read().decode()

    def counter(self, name, **labels):
        total = 0
        for line in self.metrics().splitlines():
            if not line.startswith(name + "_total"):
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += int(line.rsplit(" ", 1)[1])
        return total

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def switch_nodes(tmp_path, n, controller, claims, extra=None):
    nodes = []
    for i in range(n):
        d = Path(tmp_path) / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        env = {"COMMD_SWITCH": controller, "COMMD_SWITCH_BIND": f"127.0.0.{20 + i}",
               "COMMD_CPU_CLAIMS": str(claims), "COMMD_PEER_TIMEOUT_MS": "2000"}
        env.update(extra or {})
        nodes.append(Daemon(d, env=env).start())
    return nodes


@pytest.fixture
def sw(tmp_path, request):
    args = getattr(request, "param", ())
    s = Switch(tmp_path, *args)
    yield s
    assert s.stop() in (0, -15), s.log.read_text()


def stop_all(nodes, failed=False):
    for i, d in enumerate(nodes):
        d.stop(signal.SIGKILL) if failed else d.stop()
        if failed:
            print(f"---- node {i} log ----\n{d.log()}")


def switch_steps(count_list, seed0=1):
    steps = []
    seed = seed0
    for count in count_list:
        for dt, red in (("i32", "sum"), ("f32", "sum"), ("f32", "avg")):
            for inplace in (False, True):
                seed += 1
                steps.append({"op": "all_reduce", "dtype": dt, "count": count, "redop": red,
                              "inplace": inplace, "seed": seed})
    return steps


def comm_switch(node):
    comms = node.status()["communicator_list"]
    return [c["switch"] for c in comms]


@pytest.mark.parametrize("nnodes,per", [(2, 1), (3, 2), (4, 1)])
def test_all_reduce_through_the_switch_exact_int32_bounded_float32(tmp_path, sw, nnodes, per):
    claims = tmp_path / "claims"
    nodes = switch_nodes(tmp_path, nnodes, sw.controller, claims)
    ok = False
    try:
        n = nnodes * per
        steps = switch_steps([1, 7, 1001, 100_003]) + [{"op": "barrier"}]
        # The barrier keeps the communicator alive while we read its switch state.
        ranks = start_multi(nodes, place_contiguous(n, nnodes), steps)
        for r in ranks:
            r.wait(180)
        assert_all_pass(ranks)
        assert len(ranks[0].results()) == len(steps)
        ok = True
    finally:
        if not ok:
            print(sw.log.read_text())
        stop_all(nodes, failed=not ok)
    # Every all-reduce went through the switch: one session of nnodes workers.
    assert sw.counter("commd_switch_completions") > 0
    for w in range(nnodes):
        assert sw.counter("commd_switch_worker_packets", worker=w) > 0
    logs = [d.log() for d in nodes]
    assert all("switch session via" in l for l in logs), logs[0]


def test_drops_duplicates_and_reordering_leave_results_unchanged(tmp_path):
    s = Switch(tmp_path, "--drop", "0.01", "--dup", "0.01", "--reorder", "0.01", "--seed", "3")
    nodes = switch_nodes(tmp_path, 3, s.controller, tmp_path / "claims",
                         {"COMMD_SWITCH_TIMEOUT_MS": "3"})
    ok = False
    try:
        steps = switch_steps([300_007, 5]) * 2
        ranks = run_multi(nodes, [0, 1, 2], steps, timeout=240)
        assert_all_pass(ranks)
        ok = True
    finally:
        if not ok:
            print(s.metrics())
        stop_all(nodes, failed=not ok)
    assert s.counter("commd_switch_injected", fault="drop") > 0
    assert s.counter("commd_switch_injected", fault="dup") > 0
    assert s.counter("commd_switch_injected", fault="reorder") > 0
    # Lost packets were recovered by retransmission, which the switch saw as duplicates.
    assert s.counter("commd_switch_worker_duplicates") > 0
    s.stop()


def test_a_dead_worker_node_fails_the_others_with_an_error_not_a_hang(tmp_path, sw):
    nodes = switch_nodes(tmp_path, 3, sw.controller, tmp_path / "claims")
    try:
        steps = [{"op": "all_reduce", "dtype": "i32", "count": 500_003, "redop": "sum",
                  "seed": k, "inplace": True} for k in range(150)]
        ranks = start_multi(nodes, [0, 1, 2], steps, op_timeout_ms=60000)
        # Let it get going through the switch, then kill node 2's daemon.
        nodes[0].wait_status(lambda st: any("ops" in c["switch"] and " 0 ops" not in c["switch"]
                                            for c in st["communicator_list"]), timeout=30)
        t0 = time.monotonic()
        nodes[2].send_signal(signal.SIGKILL)
        for r in ranks[:2]:
            r.wait(120)
        for r in ranks[:2]:
            res = r.results()
            failed = [x for x in res if x["result"] != "ok"]
            assert failed, f"rank survived a dead node: {res[-1]}"
            msg = failed[0]["message"]
            assert "node 2" in msg, msg
            # The op in flight fails within the peer timeout (2 s here), not the op timeout.
            assert failed[0]["ms"] < 15000, failed[0]
        ranks[2].wait(30)
    finally:
        stop_all(nodes)


def test_two_concurrent_sessions_do_not_interfere(tmp_path, sw):
    nodes = switch_nodes(tmp_path, 2, sw.controller, tmp_path / "claims")
    ok = False
    try:
        a = start_multi(nodes, [0, 1], switch_steps([100_003, 33], seed0=100))
        b = start_multi(nodes, [0, 1], switch_steps([77_777, 9], seed0=200))
        for r in a + b:
            r.wait(180)
        assert_all_pass(a + b)
        ok = True
    finally:
        stop_all(nodes, failed=not ok)
    assert sw.metrics().count('commd_switch_worker_packets_total{session=') == 4, sw.metrics()


def test_unreachable_switch_falls_back_to_tcp_with_the_reason_logged(tmp_path):
    # Nothing listens on this port.
    import socket
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    nodes = switch_nodes(tmp_path, 2, dead, tmp_path / "claims")
    try:
        steps = switch_steps([1001]) + [{"op": "all_reduce", "dtype": "f64", "count": 5,
                                         "redop": "sum"}, {"op": "barrier"}]
        ranks = run_multi(nodes, [0, 1], steps)
        assert_all_pass(ranks)
        for d in nodes:
            assert "switch session not used" in d.log() and dead in d.log(), d.log()
    finally:
        stop_all(nodes)


def test_per_communicator_option_and_unsupported_dtype(tmp_path, sw):
    # The daemons default to no switch; the communicator asks for it at creation.
    nodes = switch_nodes(tmp_path, 2, "off", tmp_path / "claims")
    try:
        uid = nodes[0].uid()
        steps = switch_steps([999]) + [
            {"op": "all_reduce", "dtype": "f64", "count": 5, "redop": "sum"},
            {"op": "all_reduce", "dtype": "i32", "count": 5, "redop": "max"},
            {"op": "barrier"}]
        ranks = [Rank(nodes[r], [f"{uid}:{r}:2:60000:30000:{sw.controller}"], steps)
                 for r in range(2)]
        for r in ranks:
            r.wait(120)
        assert_all_pass(ranks)
        for d in nodes:
            log = d.log()
            assert f"switch session via {sw.controller}" in log, log
            assert "the switch aggregates int32 sums and float32 sums/averages, not f64/sum" in log
        # And "off" per communicator keeps it on TCP even when the daemon default is a switch.
    finally:
        stop_all(nodes)
    nodes = switch_nodes(tmp_path / "b", 2, sw.controller, tmp_path / "claims")
    try:
        uid = nodes[0].uid()
        ranks = [Rank(nodes[r], [f"{uid}:{r}:2:60000:30000:off"], switch_steps([99]))
                 for r in range(2)]
        for r in ranks:
            r.wait(120)
        assert_all_pass(ranks)
        assert all("switch session via" not in d.log() for d in nodes)
    finally:
        stop_all(nodes)


def test_mismatched_counts_across_nodes_fail_instead_of_mixing(tmp_path, sw):
    nodes = switch_nodes(tmp_path, 2, sw.controller, tmp_path / "claims")
    try:
        def steps(r):
            return [{"op": "all_reduce", "dtype": "i32", "count": 1000 + r, "redop": "sum",
                     "expect": "error"}]
        ranks = run_multi(nodes, [0, 1], steps, op_timeout_ms=20000)
        for r in ranks:
            res = r.results()
            assert res[0]["result"] != "ok", res
            assert "mismatch" in res[0]["message"].lower(), res
    finally:
        stop_all(nodes)


def test_polling_threads_of_different_daemons_never_share_a_core(tmp_path, sw):
    claims = tmp_path / "claims"
    nodes = switch_nodes(tmp_path, 2, sw.controller, claims,
                         {"COMMD_SWITCH_THREADS": "2"})
    try:
        steps = switch_steps([5000]) + [{"op": "barrier"}, {"sleep_ms": 1500}]
        ranks = start_multi(nodes, [0, 1], steps)
        st = [d.wait_status(lambda s: any("thread 1" in c["switch"]
                                          for c in s["communicator_list"]), timeout=30)
              for d in nodes]
        for r in ranks:
            r.wait(120)
        assert_all_pass(ranks)
        claims_seen = st[0]["cpu_claims"]
        cores = [int(re.match(r"core (\d+):", c).group(1)) for c in claims_seen]
        assert len(cores) == len(set(cores)), claims_seen
        # 2 daemons x 2 threads: on a host with fewer free cores some threads stay unpinned,
        # and say why.
        text = " ".join(c["switch"] for s in st for c in s["communicator_list"])
        pinned = len(re.findall(r"thread \d+ core \d+", text))
        unpinned = len(re.findall(r"thread \d+ unpinned \(", text))
        assert pinned + unpinned == 4, text
        assert pinned == len([c for c in claims_seen if "switch_session" in c]), (text, claims_seen)
        for d in nodes:
            assert "data-plane threads on" in d.log()
    finally:
        stop_all(nodes)
