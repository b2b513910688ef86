"""Several daemons on one machine as separate nodes (own sockets, peer ports and node ids), with
real client processes: every collective and dtype across nodes, exactness against a single-node
communicator, cross-node send/recv, rendezvous errors (wrong token, nranks disagreement), and
failures (a killed peer daemon, a cut link in network namespaces) that end in errors naming the
node, never in a hang."""

import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import TESTCLIENT, Daemon, Rank, assert_all_pass
from test_collectives import bitwise_steps, steps_for


def start_nodes(tmp_path, n, env=None, args=()):
    nodes = []
    for i in range(n):
        d = Path(tmp_path) / f"node{i}"
        d.mkdir(parents=True, exist_ok=True)
        nodes.append(Daemon(d, *args, env=env).start())
    return nodes


@pytest.fixture
def nodes3(tmp_path, request):
    env = getattr(request, "param", None) or {}
    ns = start_nodes(tmp_path, 3, env=env)
    yield ns
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for i, d in enumerate(ns):
        code = d.stop()
        if failed:
            print(f"---- node {i} log ----\n{d.log()}")
        assert code in (0, None, -9), f"node {i} exited with {code}:\n{d.log()}"


def place_contiguous(nranks, nnodes):
    per = nranks // nnodes
    return [min(r // per, nnodes - 1) for r in range(nranks)]


def start_multi(nodes, placement, steps, uid=None, op_timeout_ms=None, join_timeout_ms=None):
    """One client process per rank, rank r attached to nodes[placement[r]]'s daemon."""
    n = len(placement)
    uid = uid or nodes[placement[0]].uid()
    ranks = []
    for r in range(n):
        join = f"{uid}:{r}:{n}"
        if op_timeout_ms or join_timeout_ms:
            join += f":{op_timeout_ms or 600000}"
        if join_timeout_ms:
            join += f":{join_timeout_ms}"
        s = steps(r) if callable(steps) else steps
        ranks.append(Rank(nodes[placement[r]], [join], s))
    return ranks


def run_multi(nodes, placement, steps, timeout=180, **kw):
    ranks = start_multi(nodes, placement, steps, **kw)
    for r in ranks:
        r.wait(timeout)
    return ranks


ALGOS = [{"COMMD_NET_ALGO": "oneshot"},
         {"COMMD_NET_ALGO": "chain", "COMMD_NET_CHUNK_BYTES": "4096"},
         {}]


@pytest.mark.parametrize("nodes3", ALGOS, indirect=True, ids=["oneshot", "chain", "auto"])
def test_every_collective_dtype_and_redop_3_nodes_x_2_ranks(nodes3):
    steps = steps_for(6, 1001) + bitwise_steps(6, 333)
    ranks = run_multi(nodes3, place_contiguous(6, 3), steps)
    assert_all_pass(ranks)
    assert len(ranks[5].results()) == len(steps)


@pytest.mark.parametrize("nodes3", [ALGOS[1]], indirect=True, ids=["chain"])
def test_interleaved_placement_and_large_chunked_ops(nodes3):
    # rank r on node r % 3: the rank-ordered chain hops between nodes for every rank.
    placement = [r % 3 for r in range(6)]
    steps = steps_for(6, 257) + [
        {"op": "all_reduce", "dtype": "bf16", "count": 200_003, "redop": "sum", "seed": 5},
        {"op": "reduce", "dtype": "f32", "count": 100_001, "redop": "avg", "root": 4, "seed": 6},
        {"op": "broadcast", "dtype": "i64", "count": 50_001, "root": 5, "seed": 7},
        {"op": "all_reduce", "dtype": "i32", "count": 70_001, "redop": "avg", "seed": 8},
    ]
    assert_all_pass(run_multi(nodes3, placement, steps))


def test_send_recv_across_nodes(nodes3):
    n = 6

    def steps(r):
        nxt, prv = (r + 1) % n, (r - 1) % n
        far = (r + 3) % n
        return [
            {"group": [{"op": "send", "dtype": "i32", "count": 1001, "peer": nxt, "seed": 10 + r},
                       {"op": "recv", "dtype": "i32", "count": 1001, "peer": prv, "seed": 10 + prv}]},
            {"group": [{"op": "recv", "dtype": "f64", "count": 300_001, "peer": far, "seed": 20 + far},
                       {"op": "send", "dtype": "f64", "count": 300_001, "peer": far, "seed": 20 + r}]},
            {"op": "all_reduce", "dtype": "f32", "count": 11},
        ]

    assert_all_pass(run_multi(nodes3, place_contiguous(6, 3), steps))


CTX = mp.get_context("fork")


def _py_ranks(sockets, placement, fn, timeout=120):
    import commd
    n = len(placement)
    uid = commd.Client(str(sockets[placement[0]])).unique_id()
    q = CTX.Queue()

    def body(rank):
        try:
            c = commd.connect(str(sockets[placement[rank]]))
            comm = c.communicator(uid, rank, n, op_timeout=60)
            q.put((rank, fn(comm, rank, n)))
        except BaseException as e:  # noqa: BLE001 - reported to the test
            q.put((rank, f"ERR {type(e).__name__}: {e}"))

    procs = [CTX.Process(target=body, args=(r,)) for r in range(n)]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        rank, val = q.get(timeout=max(0.1, deadline - time.monotonic()))
        out[rank] = val
    for p in procs:
        p.join(10)
    assert len(out) == n, sorted(out)
    for r in range(n):
        assert not isinstance(out[r], str), out[r]
    return [out[r] for r in range(n)]


def _random_ops(comm, rank, n):
    rng = np.random.default_rng(1000 + rank)
    res = []
    for dt, count in (("float32", 100_003), ("float64", 777), ("float16", 5001), ("float32", 33)):
        for op in ("sum", "avg", "prod", "min"):
            x = rng.standard_normal(count).astype(dt)
            res.append(comm.all_reduce(x.copy(), op=op).tobytes())
    # Large enough for the chain's default 1 MiB chunks to be split over the daemon's data-plane
    # threads, with accumulators wider than the elements (f32 for f16), and an integer avg whose
    # sums wrap (NCCL's definition: wrapped in the dtype, then divided).
    for dt, count, op in (("float32", 1_000_003, "sum"), ("float16", 700_001, "sum"),
                          ("int32", 300_001, "avg")):
        if dt == "int32":
            x = rng.integers(-(10**9), 10**9, count, dtype=np.int32)
        else:
            x = rng.standard_normal(count).astype(dt)
        res.append(comm.all_reduce(x, op=op).tobytes())
        x = rng.standard_normal(count * n).astype(dt)
        out = np.empty(count, dtype=dt)
        comm.reduce_scatter(x, out, op="sum")
        res.append(out.tobytes())
    return res


def test_results_are_bitwise_identical_to_a_single_node_communicator(tmp_path):
    # Random floats (not the small integers of the test client): reduction order matters, and
    # the inter-node algorithms must reproduce the single-node order exactly.
    single = start_nodes(tmp_path / "single", 1)
    try:
        want = _py_ranks([single[0].socket], [0] * 6, _random_ops)
    finally:
        single[0].stop()
    # The default algorithm and chunk with 4 data-plane threads: each chain chunk is split.
    for env in ALGOS[:2] + [{"COMMD_WORKERS": "4"}]:
        ns = start_nodes(tmp_path / env.get("COMMD_NET_ALGO", "auto"), 3, env=env)
        try:
            got = _py_ranks([d.socket for d in ns], place_contiguous(6, 3), _random_ops)
            got2 = _py_ranks([d.socket for d in ns], [r % 3 for r in range(6)], _random_ops)
        finally:
            for d in ns:
                d.stop()
        for r in range(6):
            for i, (a, b, c) in enumerate(zip(want[r], got[r], got2[r])):
                assert a == b, f"{env}: rank {r} result {i} differs from single-node (contiguous)"
                assert a == c, f"{env}: rank {r} result {i} differs from single-node (interleaved)"


def _hex_with_token(uid_hex, token_hex):
    return uid_hex[:16] + token_hex + uid_hex[48:]


def test_wrong_token_is_rejected_and_logged(nodes3):
    uid = nodes3[0].uid()
    forged = _hex_with_token(uid, "ab" * 16)
    r = Rank(nodes3[1], [f"{forged}:1:2"], [{"op": "barrier"}]).wait(30)
    assert r.code == 2, (r.out, r.err)
    fatal = json.loads(r.out.splitlines()[0])["fatal"]
    assert "not known to the root daemon" in fatal and "refused" in fatal, fatal
    assert "rejected a join of rank 1" in nodes3[0].log()


def test_nranks_disagreement_across_nodes_is_refused(nodes3):
    uid = nodes3[0].uid()
    a = Rank(nodes3[0], [f"{uid}:0:2:600000:5000"], [{"op": "barrier"}])
    time.sleep(0.3)
    b = Rank(nodes3[1], [f"{uid}:1:3:600000:5000"], [{"op": "barrier"}])
    b.wait(30)
    fatal = json.loads(b.out.splitlines()[0])["fatal"]
    assert "nranks=3" in fatal and "nranks=2" in fatal, fatal
    a.wait(30)
    assert a.code == 2
    assert "rank(s) [1]" in json.loads(a.out.splitlines()[0])["fatal"]


def test_mismatched_collective_across_nodes_fails_everywhere(nodes3):
    def steps(r):
        count = 1002 if r >= 4 else 1001
        return [{"op": "all_reduce", "dtype": "f32", "count": 11},
                {"op": "all_reduce", "dtype": "f32", "count": count, "expect": "error"}]

    ranks = run_multi(nodes3, place_contiguous(6, 3), steps, timeout=30)
    for i, r in enumerate(ranks):
        res = r.results()
        assert res[1]["result"] != "ok", (i, res)
        assert "count=1002" in res[1]["message"] or "1002" in res[1]["message"], (i, res[1])


def test_killed_peer_daemon_fails_every_rank_naming_the_node(nodes3):
    def steps(r):
        return [{"op": "all_reduce", "dtype": "f32", "count": 1000}] + [
            {"op": "all_reduce", "dtype": "f32", "count": 100_000, "expect": "any"}] * 200

    ranks = start_multi(nodes3, place_contiguous(6, 3), steps)
    time.sleep(1.5)
    nodes3[2].proc.kill()
    killed = time.monotonic()
    for r in ranks:
        r.wait(30)
    for i, r in enumerate(ranks[:4]):
        assert r.ended - killed < 5.0, f"rank {i} took {r.ended - killed:.1f}s"
        res = r.results()
        errs = [x for x in res if x["result"] != "ok"]
        assert errs, res[-3:]
        assert "node 2" in errs[0]["message"] and "ranks 4,5" in errs[0]["message"], errs[0]
    # the surviving daemons keep serving new communicators
    assert_all_pass(run_multi(nodes3[:2], [0, 0, 1, 1], [{"op": "all_reduce", "dtype": "i32", "count": 99}]))


def test_rank_killed_on_one_node_fails_the_other_nodes_fast(nodes3):
    def steps(r):
        if r == 5:
            return [{"op": "all_reduce", "dtype": "f32", "count": 10}, {"sleep_ms": 60000}]
        return [{"op": "all_reduce", "dtype": "f32", "count": 10},
                {"op": "all_reduce", "dtype": "f32", "count": 10, "expect": "any"}]

    ranks = start_multi(nodes3, place_contiguous(6, 3), steps)
    time.sleep(1.5)
    ranks[5].proc.kill()
    killed = time.monotonic()
    for r in ranks[:5]:
        r.wait(20)
        assert r.ended - killed < 3.0
        msg = r.results()[1]["message"]
        assert "rank 5" in msg and "lost" in msg, msg


def test_two_communicators_over_the_same_nodes_reuse_and_keep_running(nodes3):
    # Sequential communicators between the same daemons (pooled connections), then two at once.
    for _ in range(3):
        assert_all_pass(run_multi(nodes3, place_contiguous(6, 3), [{"op": "all_reduce", "dtype": "f32", "count": 999}]))
    a = start_multi(nodes3, place_contiguous(6, 3), steps_for(6, 17)[:40])
    b = start_multi(nodes3, [2, 2, 1, 1, 0, 0], steps_for(6, 29)[:40])
    for r in a + b:
        r.wait(120)
    assert_all_pass(a)
    assert_all_pass(b)


# ---- network namespaces: separate network stacks joined by veth pairs --------------------

def _sh(*cmd, check=True):
    return subprocess.run(list(cmd), capture_output=True, text=True, check=check)


@pytest.fixture
def netns_pair(tmp_path):
    if os.geteuid() != 0 or shutil.which("ip") is None:
        if os.environ.get("COMMD_REQUIRE_ALL"):
            pytest.fail("network namespace tests need root and iproute2")
        pytest.skip("needs root and iproute2")
    tag = f"{os.getpid() % 10000}"
    ns = [f"cmd{tag}a", f"cmd{tag}b"]
    dev = [f"cv{tag}a", f"cv{tag}b"]
    ips = ["10.213.0.1", "10.213.0.2"]
    for n in ns:
        _sh("ip", "netns", "add", n)
    try:
        _sh("ip", "link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for i in range(2):
            _sh("ip", "link", "set", dev[i], "netns", ns[i])
            _sh("ip", "-n", ns[i], "addr", "add", f"{ips[i]}/24", "dev", dev[i])
            _sh("ip", "-n", ns[i], "link", "set", dev[i], "up")
            _sh("ip", "-n", ns[i], "link", "set", "lo", "up")
        yield ns, dev, ips
    finally:
        for n in ns:
            _sh("ip", "netns", "del", n, check=False)


class NsDaemon(Daemon):
    """A daemon in a network namespace (its Unix socket is still reachable from the host)."""

    def __init__(self, tmp_path, netns, ip, **kw):
        super().__init__(tmp_path, "--set", f"peer_listen={ip}:7400", **kw)
        self.netns = netns

    def start(self, timeout=10.0):
        import conftest
        orig = conftest.COMMD
        self.log_file = open(self.logpath, "ab")
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, orig, "serve", "--socket", str(self.socket), *self.args],
            stdout=self.log_file, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.socket.exists():
                try:
                    self.status()
                    return self
                except Exception:  # noqa: BLE001
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"commd did not come up:\n{self.log()}")


def test_netns_nodes_exact_under_delay_and_loss_then_cut_link_errors(netns_pair, tmp_path):
    ns, dev, ips = netns_pair
    env = {"COMMD_PEER_TIMEOUT_MS": "3000"}
    nodes = []
    for i in range(2):
        d = tmp_path / f"ns{i}"
        d.mkdir()
        nodes.append(NsDaemon(d, ns[i], ips[i], env=env).start())
    try:
        # Delay and loss on node 0's side of the link: tc netem where the kernel has it, else
        # (the CI kernel) 2% of TCP segments dropped at random by nftables in both namespaces.
        netem = _sh("ip", "netns", "exec", ns[0], "tc", "qdisc", "add", "dev", dev[0], "root", "netem",
                    "delay", "3ms", "loss", "1%", check=False)
        injected = "netem delay 3ms loss 1%" if netem.returncode == 0 else None
        if injected is None and shutil.which("nft"):
            for n in ns:
                _sh("ip", "netns", "exec", n, "nft", "add", "table", "inet", "commdtest")
                _sh("ip", "netns", "exec", n, "nft", "add", "chain", "inet", "commdtest", "out",
                    "{ type filter hook output priority 0; }")
                _sh("ip", "netns", "exec", n, "nft", "add", "rule", "inet", "commdtest", "out",
                    "meta", "l4proto", "tcp", "numgen", "random", "mod", "100", "<", "2", "counter", "drop")
            injected = "nftables: 2% of TCP segments dropped each way"
        if injected is None and os.environ.get("COMMD_REQUIRE_ALL"):
            pytest.fail(f"no way to inject loss here (netem: {netem.stderr.strip()}; no nft)")
        steps = steps_for(4, 1001)[:96] + [
            {"op": "all_reduce", "dtype": "f32", "count": 1_000_001, "redop": "sum", "seed": 3},
            {"op": "all_gather", "dtype": "i32", "count": 300_001, "seed": 4},
        ]
        assert_all_pass(run_multi(nodes, [0, 0, 1, 1], steps, timeout=300))
        print(f"loss injected: {injected}")
        if injected and injected.startswith("nft"):
            rules = _sh("ip", "netns", "exec", ns[0], "nft", "list", "chain", "inet", "commdtest", "out").stdout
            dropped = [int(w) for line in rules.splitlines() if "counter" in line
                       for a, w in zip(line.split(), line.split()[1:]) if a == "packets"]
            print(f"segments dropped by node 0's rule: {dropped}")
            assert dropped and dropped[0] > 0, rules
        # Cut the link mid-run: every rank fails naming the other node, within the peer timeout.
        def cut_steps(r):
            return [{"op": "all_reduce", "dtype": "f32", "count": 100}] + [
                {"op": "all_reduce", "dtype": "f32", "count": 100_000, "expect": "any"}] * 400
        ranks = start_multi(nodes, [0, 0, 1, 1], cut_steps)
        time.sleep(1.5)
        _sh("ip", "-n", ns[0], "link", "set", dev[0], "down")
        cut = time.monotonic()
        for r in ranks:
            r.wait(30)
        for i, r in enumerate(ranks):
            res = r.results()
            firsterr = next(x for x in res if x["result"] != "ok")
            # The op in flight at the cut started before it: its duration bounds the detection time.
            assert firsterr["ms"] < 5000, f"rank {i}: first error after {firsterr['ms']:.0f} ms: {firsterr}"
            assert r.ended - cut < 20.0, f"rank {i} took {r.ended - cut:.1f}s"
            errs = [x for x in r.results() if x["result"] != "ok"]
            assert errs, i
            other = 1 if i < 2 else 0
            assert f"node {other}" in errs[0]["message"], errs[0]
    finally:
        for d in nodes:
            d.stop()


# ---- mutual TLS on the peer service ------------------------------------------------------

def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_ca(d, name):
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _make_cert(d, ca, name):
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    (Path(d) / f"{name}.ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=d)


def test_mutual_tls_peer_service(tmp_path):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed to generate the test CA")
    pki = tmp_path / "pki"
    pki.mkdir()
    _make_ca(pki, "ca")
    _make_ca(pki, "rogueca")
    for n in ("a", "b"):
        _make_cert(pki, "ca", n)
    _make_cert(pki, "rogueca", "rogue")

    def tls_env(name, ca="ca"):
        return {"COMMD_PEER_TLS_CERT": str(pki / f"{name}.pem"), "COMMD_PEER_TLS_KEY": str(pki / f"{name}.key"),
                "COMMD_PEER_TLS_CA": str(pki / f"{ca}.pem")}

    root = start_nodes(tmp_path / "a", 1, env=tls_env("a"))[0]
    good = start_nodes(tmp_path / "b", 1, env=tls_env("b"))[0]
    plain = start_nodes(tmp_path / "p", 1)[0]
    rogue = start_nodes(tmp_path / "r", 1, env=tls_env("rogue", ca="ca"))[0]
    try:
        assert "peer service requires mutual TLS" in root.log()
        assert_all_pass(run_multi([root, good], [0, 0, 1, 1],
                                  [{"op": "all_reduce", "dtype": "f32", "count": 100_001, "redop": "sum"},
                                   {"op": "all_gather", "dtype": "i32", "count": 77}]))
        # A daemon without TLS, and one whose certificate another CA signed, cannot join.
        for d in (plain, rogue):
            uid = root.uid()
            a = Rank(root, [f"{uid}:0:2:600000:4000"], [{"op": "barrier"}])
            b = Rank(d, [f"{uid}:1:2:600000:4000"], [{"op": "barrier"}]).wait(30)
            a.wait(30)
            assert b.code == 2, (b.out, b.err)
            fatal = json.loads(b.out.splitlines()[0])["fatal"]
            assert "root daemon" in fatal, fatal
            assert a.code == 2
    finally:
        for d in (root, good, plain, rogue):
            d.stop()


@pytest.mark.parametrize("check", ["on", "off"])
def test_a_join_announcing_another_ip_is_refused_by_the_root(tmp_path, check):
    # A holder of a valid token could make the root's peers dial any address it announced.
    # Node b listens and advertises 127.0.0.9 but dials the root at 127.0.0.1 from 127.0.0.1:
    # the root refuses it unless peer_addr_check=off.
    a = Daemon(tmp_path / "a", env={"COMMD_PEER_LISTEN": "127.0.0.1:0",
                                    "COMMD_PEER_ADDR_CHECK": check})
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    b = Daemon(tmp_path / "b", env={"COMMD_PEER_LISTEN": "127.0.0.9:0"})
    nodes = [a.start(), b.start()]
    try:
        steps = [{"op": "all_reduce", "dtype": "f32", "count": 100,
                  "expect": "ok" if check == "off" else "any"}]
        ranks = run_multi(nodes, [0, 1], steps, timeout=60, join_timeout_ms=5000)
        if check == "off":
            assert_all_pass(ranks)
        else:
            out = ranks[1].out + ranks[1].err
            assert ranks[1].code != 0, out
            assert "not on the IP the join came from (127.0.0.1)" in out, out
            assert "127.0.0.9" in out and "peer_addr_check=off" in out, out
            assert "refused a join" in a.log(), a.log()
    finally:
        for d in nodes:
            d.stop()
