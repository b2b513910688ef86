"""GPU tenancy (docs/reliability.md section 10), one GPU, run as root: user `nobody`
attacks a root daemon whose `max_registrations_per_uid` is 16.

1. Registration count: nobody's job all-reduces 24 CUDA tensors, each its own allocation; the
   17th registration is refused naming the uid, the key and its value, and the 16 before it
   gave the right values. When the job exits the daemon holds none of its registrations, and
   root's job of the same shape runs all 24 (root is bounded by its own count, 16, too: it runs
   12).
2. Another process's IPC handle: a root process exports a CUDA IPC handle and keeps it alive;
   nobody's session sends it to the daemon and is refused, the message naming the exporting
   process. The same handle with nobody's own pid written where the driver keeps the exporter's
   is refused too: the driver would open it (it checks neither that pid nor the uid, recorded
   here by nobody opening both handles itself), so the daemon also requires that the session's
   process holds the GPU's device open, which the test client (no CUDA context) does not.
Exits non-zero on any failure; prints one JSON line per check.
Usage: tests/gpu/tenancy.py COMMD COMMD_TESTCLIENT
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMD, TESTCLIENT = (os.path.abspath(p) for p in sys.argv[1:3])
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
HERE = Path(__file__).resolve().parent
failures: list[str] = []


def check(name: str, ok: bool, **info) -> None:
    print(json.dumps({"check": name, "pass": ok, **info}), flush=True)
    if not ok:
        failures.append(name)


EXPORTER = r'''
import ctypes, json, os, sys
cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    assert r == 0, f"{what}: {r}"
ck(cu.cuInit(0), "cuInit")
dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx")
ck(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
p = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(p), 4 << 20), "cuMemAlloc")
h = (ctypes.c_char * 64)(); ck(cu.cuIpcGetMemHandle(h, p), "cuIpcGetMemHandle")
u = (ctypes.c_char * 16)(); ck(cu.cuDeviceGetUuid_v2(u, dev), "cuDeviceGetUuid")
print(json.dumps({"pid": os.getpid(), "handle": bytes(h).hex(), "uuid": bytes(u).hex()}), flush=True)
sys.stdin.read()
'''


OPENER = r'''
import ctypes, os, sys
cu = ctypes.CDLL("libcuda.so.1")
class H(ctypes.Structure):
    _fields_ = [("r", ctypes.c_char * 64)]
assert cu.cuInit(0) == 0
dev = ctypes.c_int(); assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0
ctx = ctypes.c_void_p(); assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert cu.cuCtxSetCurrent(ctx) == 0
raw = bytearray(bytes.fromhex(sys.argv[1]))
if sys.argv[2] == "1":
    raw[8:12] = os.getpid().to_bytes(4, "little")
cu.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), H, ctypes.c_uint]
p = ctypes.c_uint64()
r = cu.cuIpcOpenMemHandle_v2(ctypes.byref(p), H.from_buffer_copy(bytes(raw)), 1)
print("opened" if r == 0 else f"refused: CUresult {r}")
'''


def main() -> None:
    d = Path(tempfile.mkdtemp(prefix="commd-gpu-tenancy-", dir="/tmp"))
    os.chmod(d, 0o755)  # nobody reaches the socket
    sock = str(d / "commd.sock")
    log = open(d / "commd.log", "w")
    daemon = subprocess.Popen(
        [COMMD, "serve", "--socket", sock, "--set", "max_registrations_per_uid=16"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, COMMD_DEBUG="INFO"))
    try:
        for _ in range(100):
            if os.path.exists(sock):
                break
            time.sleep(0.1)
        env = dict(os.environ, COMMD_SOCKET=sock, COMMD_EAGER_DIRECT="0",
                   PYTHONPATH=f"{HERE}:{os.environ.get('PYTHONPATH', '')}")
        registrations(sock, env)
        foreign_handle(sock, env)
    finally:
        daemon.terminate()
        daemon.wait(15)
        tail = (d / "commd.log").read_text(errors="replace")[-4000:]
        if failures:
            print(tail)
    if failures:
        print(f"FAILED: {failures}")
        sys.exit(1)


def status(sock: str) -> dict:
    out = subprocess.run([COMMD, "status", "--json", "--socket", sock], capture_output=True,
                         text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def job(env: dict, as_nobody: bool, port: int) -> dict:
    home = tempfile.mkdtemp(prefix="commd-tenancy-home-")
    os.chmod(home, 0o777)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
           "--master_port", str(port), str(HERE / "tenancy_worker.py")]
    out = subprocess.run([*NOBODY, *cmd] if as_nobody else cmd, capture_output=True, text=True,
                         timeout=300, env=dict(env, HOME=home), cwd=home)
    line = [l for l in out.stdout.splitlines() if l.startswith("{")]
    return json.loads(line[-1]) if line else {"done": -1, "error": out.stdout[-2000:] + out.stderr[-3000:]}


def registrations(sock: str, env: dict) -> None:
    r = job(env, True, 29561)
    err = r.get("error") or ""
    check("nobody's registrations stop at its count",
          r["done"] == 16 and "uid 65534" in err and "max_registrations_per_uid=16" in err,
          result=r)
    st = status(sock)
    check("nobody's registrations are gone with its job", st["registrations"] == 0,
          registrations=st["registrations"], sessions=st["sessions"])
    r = job(dict(env, TENANCY_TENSORS="12"), False, 29562)
    check("root's job beside it runs", r["done"] == 12 and not r["error"], result=r)


def foreign_handle(sock: str, env: dict) -> None:
    exp = subprocess.Popen([sys.executable, "-c", EXPORTER], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True)
    try:
        e = json.loads(exp.stdout.readline())
        for name, handle, want in [
            ("another process's handle is refused by the daemon", e["handle"],
             f"process {e['pid']} exported"),
            # Bytes 8..12 hold the exporter's pid on this driver (daemon/src/cuda/exporter.rs):
            # nobody's own pid there passes the daemon's check; the driver must refuse it.
            ("the handle with the attacker's pid written in is refused: no GPU open",
             e["handle"][:16] + "@pid" + e["handle"][24:], "does not hold that GPU's device open"),
        ]:
            steps = [{"attack": "ipc", "ipc": f"{handle}:{e['uuid']}:{4 << 20}"}]
            out = subprocess.run([*NOBODY, TESTCLIENT, "run", "--socket", sock, "--steps",
                                  json.dumps(steps)], capture_output=True, text=True,
                                 timeout=60, cwd="/tmp")
            res = [json.loads(l) for l in out.stdout.splitlines() if '"step"' in l]
            msg = res[0]["message"] if res else out.stderr[-2000:]
            check(name, bool(res) and res[0]["result"] == "refused" and want in msg,
                  message=msg)
        # What the driver itself does for nobody (a GPU-holding process): the daemon gives no
        # process more than this.
        for rewrite in (False, True):
            out = subprocess.run([*NOBODY, sys.executable, "-c", OPENER, e["handle"],
                                  "1" if rewrite else "0"], capture_output=True, text=True,
                                 timeout=60, cwd="/tmp")
            print(json.dumps({"driver_opens_for_nobody": out.stdout.strip() or out.stderr[-500:],
                              "pid_rewritten": rewrite}), flush=True)
    finally:
        exp.stdin.close()
        exp.wait(30)


if __name__ == "__main__":
    main()
