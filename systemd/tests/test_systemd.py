"""Tests of the systemd deployment: the unit passes `systemd-analyze verify` without a single
warning, the install script lays out binary, unit and config, and the daemon started the way the
unit starts it (same ExecStart= flags, same config file, $NOTIFY_SOCKET bound here the way systemd
binds it) reports READY=1 only once it accepts connections and STOPPING=1 on SIGTERM, from its own
pid (what NotifyAccess=main checks). `commd health` is tested with and without a daemon.

systemd itself cannot run here (no systemd as PID 1 in CI containers); docs/deploy.md says how to
check the same on a real host.

Run by scripts/test-deploy; binaries come from $COMMD_BIN_DIR (default target/release).
"""

import os
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("COMMD_BIN_DIR", ROOT / "target" / "release"))
COMMD = str(BIN / "commd")
UNIT = ROOT / "systemd" / "commd.service"
DEFAULT_TOML = ROOT / "systemd" / "commd.toml"


def unit_settings(path=UNIT):
    """(section, key) -> [values] of a unit file (comments and blank lines skipped)."""
    out, section = {}, None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.setdefault((section, key.strip()), []).append(value.strip())
    return out


def exec_start_argv(socket_path, config_path):
    """The unit's ExecStart= argv, with this checkout's binary and a test config."""
    (cmd,) = unit_settings()[("Service", "ExecStart")]
    argv = shlex.split(cmd)
    assert argv[0] == "/usr/local/bin/commd", argv
    assert argv[1:] == ["serve", "--config", "/etc/commd/commd.toml"], argv
    config_path.write_text(
        DEFAULT_TOML.read_text().replace('socket = "/run/commd/commd.sock"', f'socket = "{socket_path}"')
    )
    return [COMMD] + [str(config_path) if a == "/etc/commd/commd.toml" else a for a in argv[1:]]


def verify_root(tmp_path):
    """A root directory with the system's units plus commd installed by scripts/install."""
    root = tmp_path / "root"
    subprocess.run([str(ROOT / "scripts" / "install"), "--root", str(root), "--bin", COMMD],
                   check=True, capture_output=True, text=True, cwd=ROOT)
    system_units = Path("/usr/lib/systemd/system")
    if not system_units.is_dir():
        system_units = Path("/lib/systemd/system")
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    return root


def systemd_analyze_verify(root, unit="commd.service"):
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", f"--root={root}", unit],
                         capture_output=True, text=True, timeout=60)
    return out.returncode, (out.stdout + out.stderr).strip()


def test_unit_verifies_without_any_warning(tmp_path):
    root = verify_root(tmp_path)
    code, output = systemd_analyze_verify(root)
    # verify exits 0 on unknown keys and other warnings: any output at all is a failure.
    assert code == 0 and output == "", f"systemd-analyze verify (exit {code}):\n{output}"


def test_verify_check_catches_unknown_keys(tmp_path):
    """The check above is only worth something if a bad unit makes it fail."""
    root = verify_root(tmp_path)
    unit = root / "etc/systemd/system/commd.service"
    unit.write_text(unit.read_text().replace("NoNewPrivileges=yes", "NoNewPrivileges=yes\nProtectEverything=yes"))
    code, output = systemd_analyze_verify(root)
    assert "Unknown key" in output and "ProtectEverything" in output, (code, output)


def test_unit_settings_the_issue_asks_for():
    s = unit_settings()
    get = lambda k: s.get(("Service", k), [None])[-1]  # noqa: E731
    assert get("Type") == "notify" and get("NotifyAccess") == "main"
    assert get("RuntimeDirectory") == "commd" and get("RuntimeDirectoryMode") == "0755"
    assert get("LimitMEMLOCK") == "infinity"
    assert get("Restart") == "on-failure"
    # Options that would cut the daemon off its GPUs and RDMA devices stay off.
    for key in ("PrivateDevices", "ProtectClock", "DevicePolicy", "DeviceAllow", "MemoryDenyWriteExecute",
                "SystemCallFilter", "DynamicUser", "PrivateUsers"):
        assert ("Service", key) not in s, f"{key}= would break GPU/RDMA access (see the unit's comments)"
    assert "AF_NETLINK" in get("RestrictAddressFamilies")
    assert "CAP_IPC_LOCK" in get("CapabilityBoundingSet")
    assert ("Install", "WantedBy") in s


def test_default_config_is_accepted_and_matches_the_unit():
    out = subprocess.run([COMMD, "config", "--config", str(DEFAULT_TOML)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("socket "))
    assert "/run/commd/commd.sock" in line and "file " in line, line
    # The socket lives in the unit's RuntimeDirectory.
    assert unit_settings()[("Service", "RuntimeDirectory")] == ["commd"]


def test_install_script_layout_and_prefix(tmp_path):
    root = tmp_path / "r"
    out = subprocess.run([str(ROOT / "scripts" / "install"), "--root", str(root), "--prefix", "/opt/commd",
                          "--bin", COMMD], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    binary = root / "opt/commd/bin/commd"
    assert binary.is_file() and os.access(binary, os.X_OK)
    # Shipped stripped, the debug info beside it and linked for debuggers.
    debug = root / "opt/commd/bin/.debug/commd.debug"
    assert debug.is_file() and binary.stat().st_size < os.path.getsize(COMMD) / 2, out.stdout
    sections = subprocess.run(["readelf", "-S", str(binary)], capture_output=True, text=True).stdout
    assert ".gnu_debuglink" in sections and ".debug_info" not in sections
    unit = (root / "etc/systemd/system/commd.service").read_text()
    assert "ExecStart=/opt/commd/bin/commd serve --config /etc/commd/commd.toml" in unit
    assert (root / "etc/commd/commd.toml").read_text() == DEFAULT_TOML.read_text()
    # The NCCL-compatible library (built beside the binary by scripts/test) in a folder of its
    # own, found by the installed `commd exec`.
    libdir = root / "opt/commd/lib/commd"
    assert (libdir / "libcommd_nccl.so").is_file(), out.stdout
    assert os.readlink(libdir / "libnccl.so.2") == "libcommd_nccl.so"
    env = {k: v for k, v in os.environ.items() if k not in ("COMMD_NCCL_LIB", "LD_PRELOAD")}
    ex = subprocess.run([str(binary), "exec", "--socket", "/run/x.sock", "--", "env"],
                        capture_output=True, text=True, env=env)
    assert ex.returncode == 0, ex.stderr
    lines = dict(l.split("=", 1) for l in ex.stdout.splitlines() if "=" in l)
    assert lines["LD_PRELOAD"] == str((libdir / "libnccl.so.2").resolve()), lines.get("LD_PRELOAD")
    assert lines["VLLM_NCCL_SO_PATH"] == lines["LD_PRELOAD"] and lines["COMMD_SOCKET"] == "/run/x.sock"
    # A second install keeps the admin's config and puts the default beside it.
    (root / "etc/commd/commd.toml").write_text('socket = "/run/commd/commd.sock"\nop_timeout_ms = 5000\n')
    out = subprocess.run([str(ROOT / "scripts" / "install"), "--root", str(root), "--prefix", "/opt/commd",
                          "--bin", COMMD], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "op_timeout_ms = 5000" in (root / "etc/commd/commd.toml").read_text()
    assert (root / "etc/commd/commd.toml.default").read_text() == DEFAULT_TOML.read_text()
    bad = subprocess.run([str(ROOT / "scripts" / "install"), "--prefix", "relative"], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode == 2 and "absolute" in bad.stderr


class NotifySocket:
    """The service manager's end of $NOTIFY_SOCKET: a datagram socket that receives the sender's
    credentials (SO_PASSCRED), as systemd's does."""

    def __init__(self, address):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(address)
        self.env_value = address if isinstance(address, str) else "@" + address[1:].decode()

    def recv(self, timeout):
        """(assignments dict, sender pid) or None on timeout."""
        self.sock.settimeout(timeout)
        try:
            data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(12))
        except socket.timeout:
            return None
        pid = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid, _uid, _gid = struct.unpack("iII", payload[:12])
        fields = dict(line.split("=", 1) for line in data.decode().splitlines() if line)
        return fields, pid

    def close(self):
        self.sock.close()


def can_connect(path, kind=socket.SOCK_STREAM):
    s = socket.socket(socket.AF_UNIX, kind)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def health(sock_path, timeout_ms=5000):
    return subprocess.run([COMMD, "health", "--socket", str(sock_path), "--timeout-ms", str(timeout_ms)],
                          capture_output=True, text=True, timeout=30)


def start_like_the_unit(tmp_path, notify):
    sock_path = tmp_path / "run" / "commd.sock"
    argv = exec_start_argv(sock_path, tmp_path / "commd.toml")
    env = dict(os.environ, NOTIFY_SOCKET=notify.env_value)
    env.pop("COMMD_SOCKET", None)
    log = open(tmp_path / "commd.log", "wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, sock_path


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_ready_only_once_serving_then_stopping_on_sigterm(tmp_path, kind):
    if kind == "path":
        notify = NotifySocket(str(tmp_path / "notify"))
    else:
        notify = NotifySocket(b"\0" + f"commd-test-notify-{os.getpid()}-{time.monotonic_ns()}".encode())
    proc, sock_path = start_like_the_unit(tmp_path, notify)
    try:
        msg = notify.recv(timeout=20)
        assert msg is not None, "no notification within 20 s:\n" + (tmp_path / "commd.log").read_text()
        fields, pid = msg
        assert fields.get("READY") == "1", fields
        # At READY=1 both sockets accept connections: a client started now must not fail.
        assert can_connect(sock_path), "READY=1 arrived before the gRPC socket accepted connections"
        assert can_connect(str(sock_path) + ".fd", socket.SOCK_SEQPACKET), "READY=1 arrived before the fd socket accepted connections"
        assert pid == proc.pid, f"notification came from pid {pid}, not the daemon's {proc.pid} (NotifyAccess=main)"
        assert str(sock_path) in fields.get("STATUS", ""), fields
        h = health(sock_path)
        assert h.returncode == 0, h
        assert h.stdout.startswith("commd healthy:") and f"pid {proc.pid}" in h.stdout, h.stdout
        assert len(h.stdout.strip().splitlines()) == 1, h.stdout

        proc.send_signal(signal.SIGTERM)
        msg = notify.recv(timeout=10)
        assert msg is not None and msg[0].get("STOPPING") == "1", msg
        assert "SIGTERM" in msg[0].get("STATUS", ""), msg
        assert proc.wait(timeout=15) == 0
        assert not sock_path.exists(), "socket left behind"
        assert notify.recv(timeout=0.2) is None, "unexpected notification after STOPPING=1"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def test_watchdog_pings_while_serving(tmp_path):
    """WatchdogSec=: with $WATCHDOG_USEC set, WATCHDOG=1 arrives every half interval while the
    daemon serves, and none after it begins to stop."""
    notify = NotifySocket(str(tmp_path / "notify"))
    sock_path = tmp_path / "run" / "commd.sock"
    env = dict(os.environ, NOTIFY_SOCKET=notify.env_value, WATCHDOG_USEC="400000")
    env.pop("COMMD_SOCKET", None)
    env.pop("WATCHDOG_PID", None)
    log = open(tmp_path / "commd.log", "wb")
    proc = subprocess.Popen(exec_start_argv(sock_path, tmp_path / "commd.toml"), env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        assert notify.recv(timeout=20)[0].get("READY") == "1"
        pings = []
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:
            m = notify.recv(timeout=1)
            assert m is not None, "no WATCHDOG=1 within 1 s"
            assert m[0] == {"WATCHDOG": "1"} and m[1] == proc.pid, m
            pings.append(time.monotonic())
        assert len(pings) >= 4, pings
        proc.send_signal(signal.SIGTERM)
        msg = notify.recv(timeout=10)
        while msg is not None and msg[0].get("WATCHDOG"):
            msg = notify.recv(timeout=10)
        assert msg is not None and msg[0].get("STOPPING") == "1", msg
        assert proc.wait(timeout=15) == 0
        assert notify.recv(timeout=0.5) is None, "a ping after STOPPING=1"
    finally:
        if proc.poll() is None:
            proc.kill()
        notify.close()


def test_ready_waits_for_the_sockets(tmp_path):
    """While another daemon holds the socket, the new one must not report READY (it exits 3)."""
    first_notify = NotifySocket(str(tmp_path / "n1"))
    first, sock_path = start_like_the_unit(tmp_path, first_notify)
    second_notify = NotifySocket(str(tmp_path / "n2"))
    try:
        assert first_notify.recv(timeout=20)[0]["READY"] == "1"
        env = dict(os.environ, NOTIFY_SOCKET=second_notify.env_value)
        out = subprocess.run(exec_start_argv(sock_path, tmp_path / "second.toml"), env=env,
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 3 and "already serves" in out.stderr, out
        assert second_notify.recv(timeout=0.5) is None, "a daemon that never served sent READY=1"
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=15) == 0
        first_notify.close()
        second_notify.close()


def test_bad_config_exits_2_without_ready(tmp_path):
    notify = NotifySocket(str(tmp_path / "n"))
    cfg = tmp_path / "bad.toml"
    cfg.write_text('socket = "/tmp/x.sock"\nno_such_key = 1\n')
    env = dict(os.environ, NOTIFY_SOCKET=notify.env_value)
    out = subprocess.run([COMMD, "serve", "--config", str(cfg)], env=env, capture_output=True, text=True,
                         timeout=30)
    try:
        # Exit 2 is in the unit's RestartPreventExitStatus=: systemd will not loop on it.
        assert out.returncode == 2 and "no_such_key" in out.stderr, out
        assert unit_settings()[("Service", "RestartPreventExitStatus")] == ["2"]
        assert notify.recv(timeout=0.3) is None
    finally:
        notify.close()


def test_embedded_daemon_does_not_notify(tmp_path):
    """`commd bench` runs a daemon inside itself; under a service manager it must not claim READY."""
    notify = NotifySocket(str(tmp_path / "n"))
    env = dict(os.environ, NOTIFY_SOCKET=notify.env_value, TMPDIR=str(tmp_path))
    env.pop("COMMD_SOCKET", None)
    out = subprocess.run([COMMD, "bench", "--ranks", "2", "--min-bytes", "8", "--max-bytes", "64"], env=env,
                         capture_output=True, text=True, timeout=120)
    try:
        assert out.returncode == 0, out
        assert notify.recv(timeout=0.3) is None
    finally:
        notify.close()


def test_health_without_a_daemon(tmp_path):
    h = health(tmp_path / "none.sock", timeout_ms=3000)
    assert h.returncode == 1, h
    assert h.stdout == ""
    assert "unhealthy" in h.stderr and str(tmp_path / "none.sock") in h.stderr and "commd serve" in h.stderr, h.stderr


def test_health_of_a_hung_daemon_times_out(tmp_path):
    """A socket that accepts but never answers (a stopped daemon, SIGSTOP) fails within the limit."""
    notify = NotifySocket(str(tmp_path / "n"))
    proc, sock_path = start_like_the_unit(tmp_path, notify)
    try:
        assert notify.recv(timeout=20)[0]["READY"] == "1"
        proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        h = health(sock_path, timeout_ms=1000)
        assert h.returncode == 1 and "no answer" in h.stderr and "within 1000 ms" in h.stderr, h
        assert time.monotonic() - t0 < 10
        proc.send_signal(signal.SIGCONT)
        assert health(sock_path).returncode == 0
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        notify.close()
