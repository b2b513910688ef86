"""Tenancy: one user cannot take the node's communication away from the others.

Each test runs one attack as user 65534 (`nobody`) against a real root daemon, bounded in count
and time, with a victim probe beside it: root opens a session and all-reduces 4 KiB, and runs
`commd health`. The probe must succeed every time, the health latency stay within 3x its idle
median, and what the daemon holds for the attacker (maps, fds, RSS) stay within that uid's
bounds and go back to idle when it exits (docs/reliability.md, "Tenancy")."""

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import pytest

from conftest import COMMD, TESTCLIENT, Daemon, assert_all_pass, run_ranks
from test_security import NOBODY, reachable_daemon

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")

PROBE_STEPS = [{"op": "all_reduce", "dtype": "f32", "count": 1024}]


def health_ms(daemon):
    t = time.monotonic()
    out = subprocess.run([COMMD, "health", "--socket", str(daemon.socket)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    return (time.monotonic() - t) * 1e3


def idle_health(daemon, n=7):
    return statistics.median(health_ms(daemon) for _ in range(n))


def record(**figures):
    """Appends the running test's figures as a JSON line to $COMMD_TENANCY_FIGURES, when set
    (the figures in docs/reliability.md, "Tenancy")."""
    path = os.environ.get("COMMD_TENANCY_FIGURES")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split("::")[-1].split(" ")[0]
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **figures}) + "\n")


def probe(daemon, idle_ms):
    """The victim: a session with a 4 KiB all-reduce, and health within 3x its idle median."""
    t = time.monotonic()
    assert_all_pass(run_ranks(daemon, 1, PROBE_STEPS, timeout=60))
    victim_s = time.monotonic() - t
    times = [health_ms(daemon) for _ in range(5)]
    assert statistics.median(times) <= 3 * idle_ms + 5, (times, idle_ms)
    record(idle_health_ms=round(idle_ms, 2), attacked_health_ms=round(statistics.median(times), 2),
           victim_session_and_all_reduce_s=round(victim_s, 3))
    return times


def maps(daemon):
    return len(Path(f"/proc/{daemon.proc.pid}/maps").read_text().splitlines())


def fds(daemon):
    return len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))


def rss_kib(daemon):
    for l in Path(f"/proc/{daemon.proc.pid}/status").read_text().splitlines():
        if l.startswith("VmRSS:"):
            return int(l.split()[1])
    raise AssertionError("no VmRSS")


def cpu_s(daemon):
    f = Path(f"/proc/{daemon.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def attacker(d, sock, env, steps, join=False):
    """A client process of user 65534 running `steps` (with a 1-rank communicator if `join`)."""
    cmd = [*NOBODY, str(d / "commd-testclient"), "run", "--socket", sock, "--steps",
           json.dumps(steps)]
    if join:
        uid = subprocess.run([*NOBODY, str(d / "commd-testclient"), "uid", "--socket", sock],
                             capture_output=True, text=True, timeout=30, env=env, cwd=str(d))
        assert uid.returncode == 0, uid.stderr
        cmd += ["--join", f"{uid.stdout.strip()}:0:1"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(d))


def first_results(p, n, timeout=60):
    """The first `n` step lines of a running attacker (it keeps its session afterwards)."""
    lines = []
    deadline = time.monotonic() + timeout
    while len(lines) < n and time.monotonic() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        r = json.loads(line)
        if "step" in r:
            lines.append(r)
    assert len(lines) == n, (lines, p.stderr.read() if p.poll() is not None else "")
    return lines


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.05)
    return pred()


def test_registrations_of_one_uid_cannot_fill_the_daemons_memory_maps():
    """Five processes of one user registering 4 KiB memfds until refused: they stop at the uid's
    share of the map budget (max_registrations_per_uid, a quarter of vm.max_map_count less a
    reserve), and another user's sessions keep working."""
    max_maps = int(Path("/proc/sys/vm/max_map_count").read_text())
    with reachable_daemon("commd-tenancy-maps-") as (daemon, d, env):
        sock = str(daemon.socket)
        idle_ms, idle_maps = idle_health(daemon), maps(daemon)
        t0 = time.monotonic()
        procs = [attacker(d, sock, env, [{"attack": "registrations", "count": 5000},
                                         {"sleep_ms": 30000}]) for _ in range(5)]
        try:
            res = [first_results(p, 1, timeout=120)[0] for p in procs]
            refused = [r for r in res if r["result"] == "refused"]
            assert refused, res
            msg = refused[0]["message"]
            assert "uid 65534 holds" in msg and "max_registrations_per_uid=" in msg, msg
            cap = int(msg.split("max_registrations_per_uid=")[1].split(")")[0])
            got = sum(int(r["message"].split()[1]) for r in res)
            assert got == cap, (got, cap, res)
            reserve = max(max_maps // 8, 8192)
            assert cap <= (max_maps - reserve) // 4 + 1, (cap, max_maps)
            held = maps(daemon)
            assert held <= idle_maps + cap + 200 and held < max_maps - reserve, (held, idle_maps)
            record(max_map_count=max_maps, cap=cap, registered=got, idle_maps=idle_maps,
                   maps_held=held, attack_s=round(time.monotonic() - t0, 2))
            probe(daemon, idle_ms)
        finally:
            for p in procs:
                p.kill()
                p.wait(30)
        assert wait_for(lambda: maps(daemon) <= idle_maps + 50), (maps(daemon), idle_maps)


def test_staged_fds_and_connections_of_one_uid_leave_fds_for_the_others():
    """A daemon with 4096 fds: one user's processes staging fds they never register and
    holding control-socket connections open stop at the uid's bounds (derived from the fd limit),
    staged fds expire, the daemon does not spin, and another user's sessions keep working."""
    env_d = {"COMMD_STAGED_FD_TIMEOUT_MS": "3000"}
    with reachable_daemon("commd-tenancy-fds-", env_d, nofile=4096) as (daemon, d, env):
        sock = str(daemon.socket)
        idle_ms, idle_fds = idle_health(daemon), fds(daemon)
        stagers = [attacker(d, sock, env, [{"attack": "stage", "count": 300},
                                           {"sleep_ms": 30000}]) for _ in range(4)]
        holder = None
        try:
            res = [first_results(p, 1)[0] for p in stagers]
        except BaseException:
            for p in stagers:
                p.kill()
            raise
        # Then connections up to the uid's cap and beyond (the stagers hold theirs already).
        holder = subprocess.Popen(
            [*NOBODY, "python3", "-c",
             "import socket,sys,time\n"
             "cs=[]\n"
             "for _ in range(2000):\n"
             "    c=socket.socket(socket.AF_UNIX); c.connect(sys.argv[1]); cs.append(c)\n"
             "print(len(cs), flush=True); time.sleep(30)\n", sock],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(d))
        try:
            staged = sum(int(r["message"].split()[1]) for r in res)
            msgs = " | ".join(r["message"] for r in res)
            # fd budget 4096 - 512 = 3584: 896 staged for all users, 224 for one uid.
            assert staged == 224, msgs
            assert "max_staged_fds_per_uid=224" in msgs, msgs
            assert holder.stdout.readline().strip() == "2000", holder.stderr.read()
            # Connections over the uid's 448 were closed at accept (with a limited WARN).
            assert wait_for(lambda: fds(daemon) < idle_fds + 224 + 448 + 4 * 4 + 64), fds(daemon)
            record(staged=staged, fds_idle=idle_fds, fds_held=fds(daemon))
            c0 = cpu_s(daemon)
            probe(daemon, idle_ms)
            time.sleep(1)
            assert cpu_s(daemon) - c0 < 1.5, "the daemon spun under the attack"
            # The staged fds expire (3 s) while the attacker's sessions stay.
            assert wait_for(lambda: fds(daemon) < idle_fds + 448 + 4 * 4 + 64, timeout=10), fds(daemon)
            assert all(p.poll() is None for p in stagers)
        finally:
            for p in [*stagers, holder]:
                p.kill()
                p.wait(30)
        assert wait_for(lambda: fds(daemon) <= idle_fds + 4, timeout=15), (fds(daemon), idle_fds)
        log = daemon.log()
        limited = [l for l in log.splitlines() if "max_connections_per_uid" in l]
        assert 1 <= len(limited) <= 5, limited[:10]


def test_an_op_over_holes_is_refused_and_the_daemon_allocates_nothing():
    """A sparse 1 GiB registration and a buffer with a hole punched after registering: the
    all-reduce over them is refused with a clear error, and the daemon's RSS does not grow."""
    with reachable_daemon("commd-tenancy-holes-") as (daemon, d, env):
        sock = str(daemon.socket)
        idle_ms, rss0 = idle_health(daemon), rss_kib(daemon)
        p = attacker(d, sock, env, [{"attack": "sparse", "count": 1 << 30},
                                    {"attack": "punch", "count": 64 << 20},
                                    {"sleep_ms": 20000}], join=True)
        try:
            sparse, punched = first_results(p, 2)
            for r in (sparse, punched):
                assert r["result"] == "refused", r
                assert "not in memory" in r["message"] and "does not fault in" in r["message"], r
            assert rss_kib(daemon) - rss0 < 32 << 10, (rss_kib(daemon), rss0)
            record(rss_idle_kib=rss0, rss_after_kib=rss_kib(daemon))
            probe(daemon, idle_ms)
        finally:
            p.kill()
            p.wait(30)


def test_pending_joins_count_against_the_communicator_limit(tmp_path):
    """Joins that never form hold rank tables as long as the join timeout: they count against
    max_comms_per_uid, and a claimed 65,536 ranks cost one slot, not 65,536."""
    daemon = Daemon(tmp_path, env={"COMMD_MAX_COMMS_PER_UID": "2"}).start()
    try:
        waiting = [subprocess.Popen(
            [TESTCLIENT, "run", "--socket", str(daemon.socket), "--join",
             f"{daemon.uid()}:0:65536:1000:8000", "--steps", "[]"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        st = daemon.wait_status(lambda s: s.get("pending_joins", 0) == 2, timeout=10)
        assert st.get("pending_joins") == 2, st
        third = subprocess.run(
            [TESTCLIENT, "run", "--socket", str(daemon.socket), "--join",
             f"{daemon.uid()}:0:2:1000:8000", "--steps", "[]"],
            capture_output=True, text=True, timeout=30)
        msg = third.stdout + third.stderr
        assert third.returncode != 0 and "max_comms_per_uid=2" in msg, msg
        for w in waiting:
            w.kill()
            w.wait(30)
        # Once those sessions are gone, the uid joins again.
        assert_all_pass(run_ranks(daemon, 1, PROBE_STEPS))
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_a_client_stopped_mid_op_does_not_stall_another_user():
    """A process of one user SIGSTOPped while its 2-rank communicator waits on it: the other
    user's sessions and health are unaffected."""
    with reachable_daemon("commd-tenancy-stop-") as (daemon, d, env):
        sock = str(daemon.socket)
        idle_ms = idle_health(daemon)
        uid = subprocess.run([*NOBODY, str(d / "commd-testclient"), "uid", "--socket", sock],
                             capture_output=True, text=True, timeout=30, env=env,
                             cwd=str(d)).stdout.strip()
        steps = [{"op": "all_reduce", "dtype": "f32", "count": 1 << 20, "repeat": 200}]
        ranks = [subprocess.Popen(
            [*NOBODY, str(d / "commd-testclient"), "run", "--socket", sock, "--join",
             f"{uid}:{r}:2:60000", "--steps", json.dumps(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(d))
            for r in range(2)]
        try:
            time.sleep(1.0)
            ranks[0].send_signal(19)  # SIGSTOP
            time.sleep(0.5)
            probe(daemon, idle_ms)
        finally:
            for p in ranks:
                p.kill()
                p.wait(30)


def test_root_refuses_a_config_file_another_user_owns_or_can_write(tmp_path):
    """`commd serve --config F` as root reads F only when root owns it and no one else can
    write it (a user's file could otherwise set the daemon's socket, limits and peers)."""
    d = tmp_path / "etc"
    d.mkdir(mode=0o755)
    f = d / "commd.toml"
    f.write_text("workers = 2\n")
    os.chmod(f, 0o644)

    def config():
        return subprocess.run([COMMD, "config", "--config", str(f)], capture_output=True,
                              text=True, timeout=30)

    ok = config()
    assert ok.returncode == 0 and "workers" in ok.stdout, ok.stderr
    os.chmod(f, 0o666)
    bad = config()
    assert bad.returncode != 0 and "writable by users other than its owner" in bad.stderr, bad.stderr
    os.chmod(f, 0o644)
    os.chown(f, 65534, 65534)
    bad = config()
    assert bad.returncode != 0 and "owned by uid 65534" in bad.stderr, bad.stderr
    # A Kubernetes ConfigMap's layout: a root-owned link to the file in `..data`.
    os.chown(f, 0, 0)
    data = d / "..data"
    data.mkdir(mode=0o755)
    f.rename(data / "commd.toml")
    f.symlink_to("..data/commd.toml")
    ok = config()
    assert ok.returncode == 0 and "workers" in ok.stdout, ok.stderr


def test_garbage_connections_grow_the_log_by_a_bounded_amount(tmp_path):
    """400 garbage connections to each of the control socket, the fd socket, the peer port and
    the data port: the log grows by a few WARN lines per call site and a suppressed count, not a
    line per connection; the daemon does not spin, and another session works after."""
    import re
    import socket as pysocket

    daemon = Daemon(tmp_path).start()
    try:
        m = re.search(r"peer service on (\S+):(\d+), .* data listener (\S+):(\d+)", daemon.log())
        assert m, daemon.log()
        peer, data = (m[1], int(m[2])), (m[3], int(m[4]))
        size0, cpu0 = daemon.logpath.stat().st_size, cpu_s(daemon)

        def garbage(family, kind, addr, payload):
            c = pysocket.socket(family, kind)
            c.settimeout(1)
            try:
                c.connect(addr)
                c.sendall(payload)
                c.shutdown(pysocket.SHUT_WR)
                c.recv(4096)
            except OSError:
                pass
            c.close()

        junk = b"GARBAGE!" * 16
        for _ in range(400):
            garbage(pysocket.AF_UNIX, pysocket.SOCK_STREAM, str(daemon.socket), junk)
            garbage(pysocket.AF_UNIX, pysocket.SOCK_SEQPACKET, str(daemon.socket) + ".fd", junk)
            garbage(pysocket.AF_INET, pysocket.SOCK_STREAM, peer, junk)
            garbage(pysocket.AF_INET, pysocket.SOCK_STREAM, data, junk)
        assert wait_for(lambda: "suppressed" in daemon.log(), timeout=15), daemon.log()[-3000:]
        grown = daemon.logpath.stat().st_size - size0
        lines = daemon.log().splitlines()
        warns = [l for l in lines if " WARN " in l]
        record(connections=1600, log_bytes=grown, warn_lines=len(warns),
               daemon_cpu_s=round(cpu_s(daemon) - cpu0, 2))
        # 1,600 connections; at most 5 lines per call site per 10 s, and a summary each.
        assert len(warns) <= 40 and grown <= 16384, (grown, warns)
        assert any("fd socket:" in l for l in warns), warns
        assert cpu_s(daemon) - cpu0 < 20, "the daemon spun on garbage"
        assert_all_pass(run_ranks(daemon, 1, PROBE_STEPS))
    finally:
        assert daemon.stop() == 0, daemon.log()


def fill_as_nobody(fs):
    """User `nobody` takes every byte, then every inode, of the filesystem at `fs`."""
    out = subprocess.run(
        [*NOBODY, "sh", "-c",
         f"d=$(mktemp -d {fs}/fill.XXXXXX); dd if=/dev/zero of=$d/big bs=4k 2>/dev/null; "
         f"i=0; while touch $d/$i 2>/dev/null; do i=$((i+1)); done; df -i {fs}; df {fs}"],
        capture_output=True, text=True, timeout=60)
    assert out.stdout.count("100%") == 2, out.stdout + out.stderr


def test_a_full_tmp_and_socket_directory_leave_the_daemon_serving(tmp_path):
    """The daemon's socket directory and TMPDIR on one small tmpfs that user `nobody` fills,
    bytes and inodes (as anyone can fill /tmp, where a non-root daemon keeps its socket and CPU
    claim registry). The daemon keeps serving new sessions, ops and health; a `commd switch`
    started on the full filesystem records its claim or runs unpinned saying why, and the claim
    already in the registry survives (it is never truncated before the write); a daemon that cannot bind its
    socket there says so and exits."""
    from test_switch import Switch

    import tempfile
    # Reachable by `nobody` (pytest's tmp_path is private to root).
    fs = Path(tempfile.mkdtemp(prefix="commd-fullfs-", dir="/tmp"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,nr_inodes=64,mode=1777", "tmpfs",
                    str(fs)], check=True)
    switches = []
    try:
        run = fs / "run"
        run.mkdir(mode=0o755)
        claims = run / "claims"  # Switch(run)'s registry
        env = {"TMPDIR": str(fs), "COMMD_CPU_CLAIMS": str(claims)}
        daemon = Daemon(run, env=env).start()
        try:
            idle = idle_health(daemon)
            switches.append(Switch(run, env={"TMPDIR": str(fs)}))
            assert wait_for(lambda: claims.exists() and claims.read_text().strip())
            before = claims.read_text()
            fill_as_nobody(fs)
            # (Its log on another filesystem.)
            switches.append(Switch(tmp_path, env=env))
            log = lambda: switches[1].log.read_text()
            assert wait_for(lambda: "data plane thread" in log()), log()
            line = next(l for l in log().splitlines() if "data plane thread" in l)
            after = claims.read_text()
            if "unpinned" in line:
                # Growing the file failed, or no core was left: said so, the old claim kept.
                assert "No space left" in line or "already claimed" in line, line
                assert after == before, (before, after)
            else:
                # The row fitted in the file's allocated page: both claims are there.
                assert after.startswith(before) and len(after.splitlines()) == 2, (before, after)
            for _ in range(3):
                probe(daemon, idle)
            assert daemon.status()["sessions"] == 0
            assert "panicked" not in daemon.log()
        finally:
            assert daemon.stop() == 0, daemon.log()
        # Its socket files gone, the inodes are taken again: a clear refusal naming the path.
        fill_as_nobody(fs)
        out = subprocess.run([COMMD, "serve", "--socket", str(run / "other.sock")],
                             capture_output=True, text=True, timeout=30,
                             env=dict(os.environ, **env))
        assert out.returncode != 0
        assert "other.sock" in out.stderr and "No space left" in out.stderr, out.stderr
    finally:
        for s in switches:
            s.stop()
        subprocess.run(["umount", "-l", str(fs)])
        fs.rmdir()
