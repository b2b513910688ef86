"""End-to-end test fixtures: the real `commd` binary and real client processes.

`Daemon` starts `commd serve` on a private socket and prints its log when a test fails.
`run_ranks` starts one `commd-testclient` process per rank and returns their JSON results.
Binaries come from `$COMMD_BIN_DIR` (default: target/release).
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(os.environ.get("COMMD_BIN_DIR", ROOT / "target" / "release"))
COMMD = str(BIN / "commd")
TESTCLIENT = str(BIN / "commd-testclient")


class Daemon:
    def __init__(self, tmp_path, *args, env=None, nofile=None):
        self.dir = Path(tmp_path)
        # An fd limit for the daemon (soft and hard): the tenancy tests' derived bounds.
        self.nofile = nofile
        self.socket = self.dir / "commd.sock"
        self.logpath = self.dir / "commd.log"
        self.args = list(args)
        self.env = dict(os.environ, **(env or {}))
        self.env.setdefault("COMMD_DEBUG", "INFO")
        # Tests run daemons side by side: an ephemeral metrics port each (see `metrics_url`).
        self.env.setdefault("COMMD_METRICS_LISTEN", "127.0.0.1:0")
        # Private ephemeral peer port: tests run many daemons side by side.
        self.env.setdefault("COMMD_PEER_LISTEN", "127.0.0.1:0")
        self.proc = None

    def start(self, timeout=10.0):
        self.log_file = open(self.logpath, "ab")
        self.proc = subprocess.Popen(
            [COMMD, "serve", "--socket", str(self.socket), *self.args],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            preexec_fn=self._limits if self.nofile else None,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"commd exited with {self.proc.returncode}:\n{self.log()}")
            if self.socket.exists():
                try:
                    self.status()
                    return self
                except Exception:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"commd did not come up:\n{self.log()}")

    def _limits(self):
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.nofile, self.nofile))

    def log(self):
        try:
            return self.logpath.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def status(self):
        out = subprocess.run(
            [COMMD, "status", "--json", "--socket", str(self.socket)],
            capture_output=True, text=True, timeout=10, check=True,
        )
        return json.loads(out.stdout)

    def wait_status(self, pred, timeout=5.0):
        """Polls `commd status` until pred(status) holds; returns the last status."""
        deadline = time.monotonic() + timeout
        st = self.status()
        while not pred(st) and time.monotonic() < deadline:
            time.sleep(0.05)
            st = self.status()
        return st

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout=10.0):
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"commd did not exit within {timeout}s after {sig}:\n{self.log()}")

    def uid(self):
        out = subprocess.run([TESTCLIENT, "uid", "--socket", str(self.socket)],
                             capture_output=True, text=True, timeout=10)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()


@pytest.fixture
def daemon(tmp_path, request):
    d = Daemon(tmp_path).start()
    yield d
    code = d.stop()
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    if failed:
        print(f"---- commd log ({d.logpath}) ----\n{d.log()}")
    assert code == 0, f"daemon exited with {code}:\n{d.log()}"


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


class Rank:
    """One real client process."""

    def __init__(self, daemon, joins, steps):
        self.cmd = [TESTCLIENT, "run", "--socket", str(daemon.socket), "--steps", json.dumps(steps)]
        for j in joins:
            self.cmd += ["--join", j]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.out = self.err = None
        self.ended = None

    def wait(self, timeout=60):
        try:
            self.out, self.err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.out, self.err = self.proc.communicate()
            raise AssertionError(f"client timed out: {self.cmd}\nstdout:{self.out}\nstderr:{self.err}")
        self.ended = time.monotonic()
        return self

    def results(self):
        rows = [json.loads(l) for l in self.out.splitlines() if l.strip()]
        fatal = [r for r in rows if "fatal" in r]
        assert not fatal, f"client failed: {fatal}\nstderr: {self.err}"
        return [r for r in rows if "step" in r]

    @property
    def code(self):
        return self.proc.returncode


def start_ranks(daemon, nranks, steps, uid=None, op_timeout_ms=None):
    """Starts nranks clients; `steps` is one list for all ranks or a function rank -> list."""
    uid = uid or daemon.uid()
    ranks = []
    for r in range(nranks):
        join = f"{uid}:{r}:{nranks}" + (f":{op_timeout_ms}" if op_timeout_ms else "")
        s = steps(r) if callable(steps) else steps
        ranks.append(Rank(daemon, [join], s))
    return ranks


def run_ranks(daemon, nranks, steps, timeout=120, **kw):
    ranks = start_ranks(daemon, nranks, steps, **kw)
    for r in ranks:
        r.wait(timeout)
    return ranks


def assert_all_pass(ranks):
    for i, r in enumerate(ranks):
        res = r.results()
        bad = [x for x in res if not x["pass"]]
        assert not bad and r.code == 0, f"rank {i} (exit {r.code}): {bad[:5]}\nstderr: {r.err}"
