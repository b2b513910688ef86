"""Observability through the real binary: /metrics over HTTP, `commd status` on a stuck op, OTLP
trace export to a receiver started here, `commd stat -l` under load, the admin service's uid
rule, and the init log lines (JSON, subsystem filter)."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import COMMD, TESTCLIENT, Daemon, assert_all_pass, run_ranks, start_ranks

SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def metrics_url(daemon):
    addr = daemon.status()["metrics_listen"]
    assert addr, "the daemon serves no /metrics"
    return f"http://{addr}/metrics"


def scrape(url):
    """{(name, frozenset(labels.items())): value} from a real HTTP GET."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/openmetrics-text"), r.headers
        text = r.read().decode()
    assert text.rstrip().endswith("# EOF"), text[-200:]
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = SAMPLE.match(line)
        assert m, f"unparsable sample line: {line!r}"
        labels = frozenset(LABEL.findall(m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())), 0.0)


def commd(*args, **kw):
    return subprocess.run([COMMD, *args], capture_output=True, text=True, timeout=60, **kw)


def test_metrics_pass_promtool_in_both_formats(daemon):
    """`promtool check metrics` (Prometheus' own linter, from scripts/test) accepts /metrics in
    the text format 0.0.4 a client gets when its Accept asks for it, with every series the
    OpenMetrics scrape has; an Accept that lists OpenMetrics gets OpenMetrics."""
    promtool = os.environ.get("PROMTOOL") or shutil.which("promtool")
    assert promtool and os.access(promtool, os.X_OK), (
        "promtool is needed (scripts/test extracts it to target/promtool; or set PROMTOOL)")
    assert_all_pass(run_ranks(daemon, 2, [{"op": "all_reduce", "dtype": "f32", "count": 64}]))
    url = metrics_url(daemon)
    req = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4"), r.headers
        text = r.read().decode()
    assert "# EOF" not in text and "# UNIT" not in text, text[-500:]
    p = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    names = {m.group(1) for m in map(SAMPLE.match, text.splitlines()) if m}
    om = {k[0] for k in scrape(url)}
    assert om <= names, sorted(om - names)
    assert "# TYPE commd_ops_total counter" in text, text[:2000]
    prom = urllib.request.Request(url, headers={
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"})
    with urllib.request.urlopen(prom, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text"), r.headers


def test_metrics_counters_add_up_to_the_bytes_moved(daemon):
    url = metrics_url(daemon)
    before = scrape(url)
    nranks, n_ar, count = 3, 7, 1000
    steps = [{"op": "all_reduce", "dtype": "f32", "count": count} for _ in range(n_ar)]
    steps += [{"op": "broadcast", "dtype": "i32", "count": 500, "root": 1} for _ in range(2)]
    assert_all_pass(run_ranks(daemon, nranks, steps))
    # A mismatch: both ranks' ops fail, counted by kind.
    bad = run_ranks(daemon, 2, lambda r: [{"op": "all_reduce", "count": 10 + r, "expect": "mismatch"}])
    assert_all_pass(bad)
    daemon.wait_status(lambda s: s["sessions"] == 0)
    after = scrape(url)

    def d(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    ar = dict(op="all_reduce", dtype="f32", transport="shm")
    bc = dict(op="broadcast", dtype="i32", transport="shm")
    assert d("commd_ops_total", **ar) == n_ar * nranks
    assert d("commd_op_bytes_total", **ar) == n_ar * nranks * count * 4
    assert d("commd_ops_total", **bc) == 2 * nranks
    assert d("commd_op_bytes_total", **bc) == 2 * nranks * 500 * 4
    assert d("commd_op_duration_seconds_count", op="all_reduce", transport="shm") == n_ar * nranks
    assert d("commd_op_duration_seconds_sum", op="all_reduce", transport="shm") > 0
    assert d("commd_op_errors_total", op="all_reduce", kind="mismatch") == 2
    # The shared-memory link: an all-reduce reads every rank's input and writes every rank's
    # output; a broadcast reads the root's buffer once per rank and writes every rank's.
    moved = n_ar * nranks * count * 4 + 2 * nranks * 500 * 4
    shm = dict(link="shm", kind="shm", peer="local", nic="-")
    assert d("commd_link_bytes_total", direction="rx", **shm) == moved
    assert d("commd_link_bytes_total", direction="tx", **shm) == moved
    assert d("commd_link_packets_total", direction="rx", **shm) == (n_ar + 2) * nranks
    assert d("commd_sessions_opened_total") >= 5
    assert d("commd_communicators_formed_total") == 2
    assert value(after, "commd_sessions") == 0
    assert value(after, "commd_build_info", version=daemon.status()["daemon_version"]) == 1


def test_status_shows_a_stuck_op_and_the_missing_rank(daemon):
    # Ranks 0 and 1 post an all-reduce; rank 2 never does (it sleeps until it is killed).
    steps = lambda r: ([{"sleep_ms": 120000}] if r == 2 else
                       [{"op": "all_reduce", "count": 100, "expect": "peer_lost"}])
    ranks = start_ranks(daemon, 3, steps, op_timeout_ms=120000)
    try:
        def stuck(s):
            return any(c["oldest"] and c["oldest"]["missing"] == [2] and c["oldest"]["age_ms"] >= 1000
                       for c in s.get("communicator_list", []))
        st = daemon.wait_status(stuck, timeout=30)
        assert stuck(st), json.dumps(st, indent=1)
        (c,) = st["communicator_list"]
        o = c["oldest"]
        assert (o["op"], o["seq"], o["posted"], o["p2p"]) == ("all_reduce", 0, [0, 1], False), o
        assert c["pending_ops"] == 2 and c["nranks"] == 3
        by_rank = {k["rank"]: k for k in c["ranks"]}
        assert by_rank[2]["pid"] == ranks[2].proc.pid
        assert by_rank[2]["collectives_posted"] == 0 and by_rank[0]["collectives_posted"] == 1
        assert by_rank[0]["oldest_pending"] == "all_reduce seq 0"
        out = commd("status", "--socket", str(daemon.socket))
        assert out.returncode == 0, out.stderr
        assert "STUCK all_reduce seq 0" in out.stdout, out.stdout
        assert f"posted by ranks 0,1; waiting for rank 2 (pid {ranks[2].proc.pid})" in out.stdout, out.stdout
        m = scrape(metrics_url(daemon))
        assert value(m, "commd_pending_ops") == 2
        assert value(m, "commd_oldest_pending_op_seconds") >= 1.0
    finally:
        ranks[2].proc.kill()
        for r in ranks:
            r.wait(60)
    assert_all_pass(ranks[:2])


class _Receiver(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server API
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.got.append((self.path, self.headers.get("Content-Type", ""), body))
        reply = b"{}" if "json" in self.headers.get("Content-Type", "") else b""
        self.send_response(200)
        self.send_header("Content-Type", self.headers.get("Content-Type", "application/x-protobuf"))
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args):
        pass


@pytest.fixture
def otlp_receiver():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    srv.got = []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()


def _attrs(span):
    out = {}
    for a in span.get("attributes", []):
        v = a["value"]
        out[a["key"]] = next(iter(v.values())) if v else None
    return out


def _spans(got):
    spans = []
    for _, _, body in got:
        doc = json.loads(body)
        for rs in doc.get("resourceSpans", []):
            res = _attrs(rs.get("resource", {}))
            for ss in rs.get("scopeSpans", []):
                for s in ss.get("spans", []):
                    spans.append((res, s["name"], _attrs(s)))
    return spans


def _poll(pred, timeout=20.0):
    import time
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


def test_otlp_http_json_export_reaches_a_receiver(tmp_path, otlp_receiver):
    port = otlp_receiver.server_address[1]
    d = Daemon(tmp_path, env={"COMMD_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                              "COMMD_OTLP_PROTOCOL": "http/json",
                              "OTEL_BSP_SCHEDULE_DELAY": "100"}).start()
    try:
        st = d.status()
        assert st["otlp_endpoint"] == f"http://127.0.0.1:{port}"
        assert_all_pass(run_ranks(d, 2, [{"op": "all_reduce", "dtype": "f32", "count": 256}] * 3))

        def ops():
            return [a for _, name, a in _spans(otlp_receiver.got) if name == "all_reduce"]
        assert _poll(lambda: len(ops()) >= 3), f"spans received: {_spans(otlp_receiver.got)}"
    finally:
        assert d.stop() == 0, d.log()
    assert {p for p, _, _ in otlp_receiver.got} == {"/v1/traces"}
    spans = _spans(otlp_receiver.got)
    got = sorted((a for _, name, a in spans if name == "all_reduce"), key=lambda a: int(a["seq"]))
    assert [int(a["seq"]) for a in got] == [0, 1, 2], got
    for a in got:
        assert int(a["bytes"]) == 1024 and int(a["count"]) == 256 and int(a["nranks"]) == 2, a
        assert (a["transport"], a["algorithm"], a["status"], a["dtype"]) == ("shm", "direct", "ok", "f32"), a
        assert int(a["last_rank"]) in (0, 1) and int(a["wait_us"]) >= 0
    names = [name for _, name, _ in spans]
    # Communicator init, and the sessions (ended when the clients left or at shutdown).
    assert "comm_init" in names and names.count("session") >= 2, names
    (init,) = [a for _, name, a in spans if name == "comm_init"]
    assert int(init["nranks"]) == 2 and int(init["nodes"]) == 1
    res = spans[0][0]
    assert res["service.name"] == "commd" and res["service.version"] == st["daemon_version"], res


def test_otlp_http_protobuf_export(tmp_path, otlp_receiver):
    port = otlp_receiver.server_address[1]
    d = Daemon(tmp_path, env={"COMMD_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                              "COMMD_OTLP_PROTOCOL": "http/protobuf",
                              "OTEL_BSP_SCHEDULE_DELAY": "100"}).start()
    try:
        assert_all_pass(run_ranks(d, 2, [{"op": "all_gather", "dtype": "u8", "count": 64}]))
        assert _poll(lambda: any(b"all_gather" in body for _, _, body in otlp_receiver.got))
    finally:
        assert d.stop() == 0, d.log()
    path, ctype, body = next(g for g in otlp_receiver.got if b"all_gather" in g[2])
    assert path == "/v1/traces" and ctype == "application/x-protobuf"
    assert b"commd" in body and b"transport" in body and b"shm" in body


def test_no_endpoint_exports_nothing_and_says_so(daemon):
    assert daemon.status()["otlp_endpoint"] == ""
    assert "trace export: off" in daemon.log()


def test_stat_links_under_load(daemon):
    count, nranks = 65536, 2
    per_op = nranks * count * 4          # bytes read (and written) per all-reduce
    load = start_ranks(daemon, nranks, [{"op": "all_reduce", "dtype": "f32", "count": count,
                                          "check_stride": 4096, "repeat": 100000}])
    try:
        url = metrics_url(daemon)
        shm_rx = dict(link="shm", kind="shm", peer="local", nic="-", direction="rx")
        base = value(scrape(url), "commd_link_bytes_total", **shm_rx)
        assert _poll(lambda: value(scrape(url), "commd_link_bytes_total", **shm_rx) > base), \
            "load never started"
        out = commd("stat", "-l", "--json", "--count", "3", "--interval", "0.3", "--socket", str(daemon.socket))
        assert out.returncode == 0, out.stderr
        rows = [json.loads(l) for l in out.stdout.splitlines()]
        samples, (totals,) = rows[:-1], [r["totals"] for r in rows[-1:]]
        assert [s["sample"] for s in samples] == [1, 2, 3]
        moving = 0
        for s in samples:
            (shm,) = [l for l in s["links"] if l["name"] == "shm"]
            assert shm["rx_bytes"] % per_op == 0 and shm["tx_bytes"] % per_op == 0, shm
            assert abs(shm["rx_bytes_per_s"] * s["interval_s"] - shm["rx_bytes"]) < 1.0, s
            moving += shm["rx_bytes"] > 0
        assert moving >= 2, samples
        (t,) = [l for l in totals["links"] if l["name"] == "shm"]
        assert t["rx_bytes"] == sum(l["rx_bytes"] for s in samples for l in s["links"] if l["name"] == "shm")
        assert totals["samples"] == 3 and totals["seconds"] >= 0.8
        text = commd("stat", "-l", "-c", "1", "-i", "0.2", "--socket", str(daemon.socket))
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert any(l.split()[:1] == ["LINK"] and "RX B/s" in l for l in lines), text.stdout
        shm_rows = [l for l in lines if l.startswith("shm ")]
        assert len(shm_rows) == 2 and re.search(r"\d+(\.\d+)? [KMG]?B", shm_rows[0]), text.stdout
        assert any(l.startswith("-- totals over") for l in lines), text.stdout
    finally:
        for r in load:
            r.proc.kill()
            r.proc.communicate()


def test_another_uid_sees_its_own_jobs_and_no_node_wide_counters():
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        if os.environ.get("COMMD_REQUIRE_ALL"):
            pytest.fail("needs root and setpriv to run a client as another uid")
        pytest.skip("needs root and setpriv to run a client as another uid")
    # A directory every user can reach: a root daemon's socket is then open to all (mode 0666),
    # so what refuses uid 65534 below is the admin service's uid check, not file permissions.
    d = Path(tempfile.mkdtemp(prefix="commd-admin-"))
    os.chmod(d, 0o755)
    binary = d / "commd"
    shutil.copy(COMMD, binary)
    os.chmod(binary, 0o755)
    daemon = Daemon(d).start()
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(binary)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    try:
        sock = str(daemon.socket)
        run = lambda *a: subprocess.run([*nobody, *a, "--socket", sock], capture_output=True,
                                        text=True, timeout=60, env=env, cwd=str(d))
        # The job API serves that uid: the socket is reachable.
        h = run("health")
        assert h.returncode == 0, h.stderr
        s = run("stat", "-l", "--count", "1")
        assert s.returncode == 1, (s.stdout, s.stderr)
        assert "permission denied" in s.stderr and "uid 65534" in s.stderr, s.stderr
        # `commd status` shows that user its own jobs, and no one else's: a communicator of
        # root's and one of uid 65534's are open.
        import commd as api
        mine = api.connect(sock)
        root_comm = mine.communicator(mine.unique_id(), 0, 1)
        client = d / "commd-testclient"
        shutil.copy(TESTCLIENT, client)
        os.chmod(client, 0o755)
        holder = subprocess.Popen(
            [*nobody[:-1], str(client), "run", "--socket", sock, "--join",
             f"{daemon.uid()}:0:1", "--steps", json.dumps([{"sleep_ms": 20000}])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(d))
        deadline = time.monotonic() + 20
        theirs = None
        while theirs is None and time.monotonic() < deadline:
            everyone = json.loads(commd("status", "--json", "--socket", sock).stdout)
            others = [c["comm_id"] for c in everyone["communicator_list"] if c["comm_id"] != root_comm.id]
            theirs = others[0] if others else None
            time.sleep(0.05)
        assert theirs is not None, holder.communicate(timeout=30)
        st = run("status", "--json")
        assert st.returncode == 0, st.stderr
        j = json.loads(st.stdout)
        ids = [c["comm_id"] for c in j["communicator_list"]]
        assert ids == [theirs], (ids, root_comm.id)
        assert all(x["uid"] == 65534 for x in j["session_list"]), j["session_list"]
        everyone = json.loads(commd("status", "--json", "--socket", sock).stdout)
        assert {theirs, root_comm.id} <= {c["comm_id"] for c in everyone["communicator_list"]}
        holder.kill()
        holder.wait(timeout=30)
        del root_comm, mine
        # Root is admitted.
        ok = commd("stat", "-l", "--count", "1", "--interval", "0.1", "--socket", sock)
        assert ok.returncode == 0, ok.stderr
    finally:
        code = daemon.stop()
        log = daemon.log()
        shutil.rmtree(d, ignore_errors=True)
    assert code == 0, log


def test_init_logs_json_with_the_transport_of_each_path(tmp_path):
    d = Daemon(tmp_path, env={"COMMD_DEBUG": "INFO", "COMMD_DEBUG_SUBSYS": "INIT",
                              "COMMD_LOG_FORMAT": "json"}).start()
    try:
        assert_all_pass(run_ranks(d, 3, [{"op": "all_reduce", "count": 8}]))
    finally:
        assert d.stop() == 0, d.log()
    lines = [json.loads(l) for l in d.log().splitlines() if l.strip()]
    assert lines, "no log lines"
    (init,) = [l for l in lines if "init done" in l.get("message", "")]
    assert (init["nranks"], init["nodes"], init["local_ranks"]) == (3, 1, 3), init
    assert init["level"] == "INFO" and init["target"] == "commd::init"
    (path,) = [l for l in lines if l.get("transport") == "SHM"]
    assert path["path"] == "0-2 (every local pair)" and "shared memory" in path["reason"], path
    assert path["message"].endswith(f"via SHM: {path['reason']}")
    # COMMD_DEBUG_SUBSYS=INIT: other subsystems log warnings only.
    assert not [l for l in lines if l["target"] == "commd::session"], lines


def test_observability_config_is_validated_and_metrics_can_be_off(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
    for key, val, why in [("COMMD_METRICS_LISTEN", "localhost", "IP:PORT"),
                          ("COMMD_OTLP_ENDPOINT", "https://c:4318", "TLS is not supported"),
                          ("COMMD_OTLP_PROTOCOL", "thrift", "grpc, http/protobuf or http/json"),
                          ("COMMD_OTLP_SAMPLE_RATIO", "2", "from 0 to 1"),
                          ("COMMD_LOG_FORMAT", "xml", "text or json")]:
        out = commd("config", env={**env, key: val})
        assert out.returncode == 2 and key in out.stderr and why in out.stderr, (key, out.stderr)
    out = commd("config", env=env)
    assert re.search(r"^metrics_listen\s+= 127\.0\.0\.1:9464 ", out.stdout, re.M), out.stdout
    d = Daemon(tmp_path, env={"COMMD_METRICS_LISTEN": "off"}).start()
    try:
        assert d.status()["metrics_listen"] == ""
        assert "metrics: off" in d.log()
    finally:
        assert d.stop() == 0


def test_multinode_ops_and_tcp_links_are_counted(tmp_path):
    from test_multinode import place_contiguous, run_multi, start_nodes
    nodes = start_nodes(tmp_path, 2)
    try:
        n_ops, count = 5, 1000
        assert_all_pass(run_multi(nodes, place_contiguous(4, 2),
                                  [{"op": "all_reduce", "dtype": "f32", "count": count}] * n_ops))
        urls = [metrics_url(d) for d in nodes]
        for url in urls:
            m = scrape(url)
            # Two local ranks per node, each counting its ops.
            assert value(m, "commd_ops_total", op="all_reduce", dtype="f32", transport="tcp") == 2 * n_ops
            assert value(m, "commd_op_bytes_total", op="all_reduce", dtype="f32", transport="tcp") == \
                2 * n_ops * count * 4

        def tcp(m, direction):
            rows = [(dict(k[1]), v) for k, v in m.items()
                    if k[0] == "commd_link_bytes_total" and dict(k[1]).get("kind") == "tcp"
                    and dict(k[1])["direction"] == direction]
            assert len(rows) == 1, rows
            return rows[0]

        # What one daemon wrote to the other, the other read (once the wire is quiet).
        def balanced():
            a, b = scrape(urls[0]), scrape(urls[1])
            return tcp(a, "tx")[1] == tcp(b, "rx")[1] and tcp(b, "tx")[1] == tcp(a, "rx")[1]
        assert _poll(balanced), (scrape(urls[0]), scrape(urls[1]))
        labels, sent = tcp(scrape(urls[0]), "tx")
        assert sent >= n_ops * count * 4, sent     # at least each op's partial result
        assert labels["link"] == f"tcp:{labels['peer']}" and labels["nic"] == "127.0.0.1"
        out = commd("stat", "-l", "-c", "1", "-i", "0.1", "--socket", str(nodes[0].socket))
        assert out.returncode == 0 and any(l.startswith("tcp:") for l in out.stdout.splitlines()), out.stdout
        log = nodes[0].log()
        assert "nranks 4, nodes 2, local ranks 0-1" in log, log
        assert "via TCP" in log
    finally:
        for d in nodes:
            assert d.stop() == 0, d.log()


def test_metric_labels_stay_bounded_unless_asked_for(daemon, tmp_path):
    """By default no series is labelled with a session, pid or communicator (a scrape's series
    would grow with every job): ring figures are summed; `metrics_per_job = on` brings the
    per-session and per-communicator series back."""
    import commd as api
    url = metrics_url(daemon)
    churn = {"session", "pid", "comm", "unique_id"}
    one = api.connect(str(daemon.socket))
    s1 = scrape(url)
    # A second session from another process (one process shares one session).
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, commd; c = commd.connect(sys.argv[1]); "
         "m = c.communicator(c.unique_id(), 0, 1); print('ready', flush=True); sys.stdin.read()",
         str(daemon.socket)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "ready"
    s2 = scrape(url)
    holder.stdin.close()
    holder.wait(timeout=30)
    for s in (s1, s2):
        labelled = [k for k in s if churn & {n for n, _ in k[1]}]
        assert not labelled, labelled[:5]
    # The standard process series.
    import time
    assert abs(value(s1, "process_start_time_seconds") - time.time()) < 600, s1
    assert value(s1, "process_open_fds") > 3 and value(s1, "process_threads") >= 2
    assert value(s1, "process_resident_memory_bytes") > 1 << 20
    assert ("process_cpu_seconds_total", frozenset()) in s1
    per = value(s1, "commd_ring_entries", queue="sq")
    assert per > 0 and value(s2, "commd_ring_entries", queue="sq") == 2 * per, (per, s2)
    assert value(s2, "commd_gpu_paced_communicators") == 0
    del one
    (tmp_path / "perjob").mkdir()
    d = Daemon(tmp_path / "perjob", env={"COMMD_METRICS_PER_JOB": "on"}).start()
    try:
        c = api.connect(str(d.socket))
        s = scrape(metrics_url(d))
        rows = [k for k in s if k[0] == "commd_ring_entries" and dict(k[1]).get("session")]
        assert len(rows) == 2 and all(dict(k[1])["pid"] == str(os.getpid()) for k in rows), rows
        del c
    finally:
        assert d.stop() == 0
