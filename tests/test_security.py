"""Security: what a root daemon writes, and where, when other users plant names first.

A root daemon that opened `/dev/shm/commd-cpu-claims` following symlinks would truncate whatever
file an unprivileged user's link named, on every root `commd status`. These tests run the real
daemon as root with the link made by user `nobody`."""

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import COMMD, TESTCLIENT, Daemon, Rank, assert_all_pass, run_ranks, start_ranks

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")


@pytest.fixture
def sticky_dir():
    """A world-writable sticky directory, like /dev/shm and /tmp."""
    d = Path(tempfile.mkdtemp(prefix="commd-sticky-", dir="/tmp"))
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def as_nobody(*cmd):
    out = subprocess.run([*NOBODY, *cmd], capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, out.stderr
    return out


@contextlib.contextmanager
def reachable_daemon(prefix, env=None, nofile=None):
    """A root daemon whose socket directory and `commd` binary user 65534 can reach (mode 0755),
    as a system daemon's are. Yields (daemon, dir, environment for user 65534's commands)."""
    d = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(d, 0o755)
    try:
        for b in (COMMD, TESTCLIENT):
            shutil.copy(b, d / Path(b).name)
            os.chmod(d / Path(b).name, 0o755)
        daemon = Daemon(d, env=env, nofile=nofile).start()
        try:
            yield daemon, d, {k: v for k, v in os.environ.items() if not k.startswith("COMMD_")}
        finally:
            assert daemon.stop() == 0, daemon.log()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_root_status_never_writes_through_a_users_symlink(tmp_path, sticky_dir):
    victim = tmp_path / "victim"
    victim.write_text("root's data\n")
    os.chmod(victim, 0o644)
    planted = sticky_dir / "cpu-claims"
    as_nobody("ln", "-s", str(victim), str(planted))
    assert planted.is_symlink() and planted.lstat().st_uid == 65534
    d = Daemon(tmp_path, env={"COMMD_CPU_CLAIMS": str(planted)}).start()
    try:
        # Before the fix, this root `commd status` emptied the victim.
        st = d.status()
        assert st["cpu_claims"] == []
        assert victim.read_text() == "root's data\n"
        assert "symbolic link" in d.log(), d.log()
    finally:
        assert d.stop() == 0, d.log()
    assert victim.read_text() == "root's data\n"


def test_a_users_hard_link_or_file_is_refused_too(tmp_path, sticky_dir):
    victim = sticky_dir / "victim"
    victim.write_text("root's data\n")
    # A name the user made first (owned by nobody): root must not adopt it.
    theirs = sticky_dir / "theirs"
    as_nobody("touch", str(theirs))
    d = Daemon(tmp_path, env={"COMMD_CPU_CLAIMS": str(theirs)}).start()
    try:
        d.status()
        assert "owned by uid 65534" in d.log(), d.log()
        assert theirs.read_text() == ""
    finally:
        assert d.stop() == 0
    # A hard link to a root file (with protected_hardlinks off a user could make one).
    link = sticky_dir / "hard"
    os.link(victim, link)
    d = Daemon(tmp_path, env={"COMMD_CPU_CLAIMS": str(link)}).start()
    try:
        d.status()
        assert "hard links" in d.log(), d.log()
        assert victim.read_text() == "root's data\n"
    finally:
        assert d.stop() == 0


def test_default_registry_is_in_the_runtime_directory_not_dev_shm(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "COMMD_CPU_CLAIMS"}
    d = Daemon(tmp_path)
    d.env = dict(env, COMMD_DEBUG="INFO", COMMD_METRICS_LISTEN="127.0.0.1:0",
                 COMMD_PEER_LISTEN="127.0.0.1:0")
    d.start()
    try:
        d.status()
        reg = Path("/run/commd/cpu-claims")
        assert reg.exists(), d.log()
        st = reg.lstat()
        assert st.st_uid == 0 and (st.st_mode & 0o022) == 0, oct(st.st_mode)
        assert (reg.parent.stat().st_mode & 0o022) == 0
    finally:
        assert d.stop() == 0


def test_socket_directory_of_another_user_is_refused(tmp_path, sticky_dir):
    theirs = sticky_dir / "sockdir"
    as_nobody("mkdir", "-m", "0777", str(theirs))
    out = subprocess.run([COMMD, "serve", "--socket", str(theirs / "commd.sock")],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    assert "owned by uid 65534" in out.stderr + out.stdout, out.stderr
    assert not (theirs / "commd.sock.lock").exists()
    # A lock-file name planted as a symlink in a sticky directory is refused as well.
    victim = tmp_path / "victim"
    victim.write_text("root's data\n")
    as_nobody("ln", "-s", str(victim), str(sticky_dir / "x.sock.lock"))
    out = subprocess.run([COMMD, "serve", "--socket", str(sticky_dir / "x.sock")],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    assert "symbolic link" in out.stderr + out.stdout, out.stderr
    assert victim.read_text() == "root's data\n"


def test_status_shows_each_user_only_its_own_sessions(tmp_path):
    """Local.Status does not list every user's sessions, pids and job names to any user: a
    user sees its own; root sees all."""
    with reachable_daemon("commd-status-") as (daemon, d, env):
        sock = str(daemon.socket)
        root_job = start_ranks(daemon, 1, [{"sleep_ms": 4000}])
        theirs = subprocess.Popen(
            [*NOBODY, str(d / "commd-testclient"), "run", "--socket", sock, "--steps",
             json.dumps([{"sleep_ms": 4000}])],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(d))
        st = daemon.wait_status(lambda s: s["sessions"] == 2, timeout=10)
        assert st["sessions"] == 2, st
        pids_all = {s["pid"] for s in st["session_list"]}
        assert {root_job[0].proc.pid} <= pids_all and len(pids_all) == 2, st
        out = subprocess.run([*NOBODY, str(d / "commd"), "status", "--json", "--socket", sock],
                             capture_output=True, text=True, timeout=30, env=env, cwd=str(d))
        assert out.returncode == 0, out.stderr
        seen = json.loads(out.stdout)["session_list"]
        assert [s["uid"] for s in seen] == [65534], seen
        assert root_job[0].proc.pid not in {s["pid"] for s in seen}, seen
        for r in root_job:
            r.wait(30)
        theirs.wait(30)


def test_one_uid_cannot_take_every_session(tmp_path):
    """One uid cannot take all 4,096 sessions and lock every other user out: each uid holds at
    most max_sessions_per_uid; others still get in, and `commd status` shows the usage by uid."""
    with reachable_daemon("commd-limits-", {"COMMD_MAX_SESSIONS_PER_UID": "2"}) as (daemon, d, env):
        sock = str(daemon.socket)
        held = [subprocess.Popen([TESTCLIENT, "run", "--socket", sock, "--steps",
                                  json.dumps([{"sleep_ms": 5000}])],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(2)]
        st = daemon.wait_status(lambda s: s["sessions"] == 2, timeout=10)
        assert st["sessions"] == 2, st
        third = subprocess.run([TESTCLIENT, "run", "--socket", sock, "--steps", "[]"],
                               capture_output=True, text=True, timeout=30)
        assert third.returncode != 0
        msg = third.stdout + third.stderr
        assert "uid 0 already has 2 sessions" in msg and "max_sessions_per_uid=2" in msg, msg
        # Another user still gets a session (health opens one and calls Status).
        h = subprocess.run([*NOBODY, str(d / "commd"), "health", "--socket", sock],
                           capture_output=True, text=True, timeout=30, env=env, cwd=str(d))
        assert h.returncode == 0, h.stdout + h.stderr
        text = subprocess.run([COMMD, "status", "--socket", sock], capture_output=True,
                              text=True, timeout=30).stdout
        assert "uid 0: 2 session(s)" in text, text
        for p in held:
            p.wait(30)


def test_unattached_fd_connections_of_one_uid_are_capped(tmp_path):
    """Idle fd-socket connections, a daemon thread each, are capped per uid, not unlimited."""
    import socket as pysocket

    daemon = Daemon(tmp_path).start()
    try:
        fd_path = str(daemon.socket) + ".fd"
        conns = []
        refused = 0
        for _ in range(80):
            c = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_SEQPACKET)
            c.connect(fd_path)
            conns.append(c)
        for c in conns:
            c.settimeout(0.5)
            try:
                msg = c.recv(4096)
                if b"waiting to attach" in msg:
                    refused += 1
            except (TimeoutError, pysocket.timeout):
                pass
        assert refused == 80 - 64, refused
        threads = int(next(l.split()[1] for l in
                           open(f"/proc/{daemon.proc.pid}/status").read().splitlines()
                           if l.startswith("Threads:")))
        assert threads < 64 + 40, threads
        for c in conns:
            c.close()
        # The daemon still serves jobs.
        assert_all_pass(run_ranks(daemon, 2, [{"op": "all_reduce", "dtype": "f32", "count": 8}]))
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_registered_memory_and_communicators_are_limited_per_uid(tmp_path):
    """Memory is charged to the uid that registers it, and one uid's communicators are
    bounded."""

    daemon = Daemon(tmp_path, env={"COMMD_MAX_REGISTERED_BYTES_PER_UID": "1000000",
                                   "COMMD_MAX_COMMS_PER_UID": "1"}).start()
    try:
        # 4 MB of f32 buffers > 1 MB for the uid: refused naming the uid and the key.
        big = run_ranks(daemon, 1, [{"op": "all_reduce", "dtype": "f32", "count": 1000000}])
        msg = big[0].out
        assert big[0].code != 0 and "above its limit of 1000000 bytes" in msg, msg
        assert "max_registered_bytes_per_uid" in msg and "uid 0" in msg, msg
        # Within the limit it works.
        small = run_ranks(daemon, 1, [{"op": "all_reduce", "dtype": "f32", "count": 1000}])
        assert small[0].code == 0, small[0].out
        # Two communicators in one process: the second join is refused.
        two = Rank(daemon, [f"{daemon.uid()}:0:1", f"{daemon.uid()}:0:1"], [])
        two.wait(30)
        assert two.code != 0 and "max_comms_per_uid=1" in two.out + two.err, two.out + two.err
    finally:
        assert daemon.stop() == 0, daemon.log()
