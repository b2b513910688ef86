"""What the daemon saves each job: communicator start-up time and GPU memory, commd
against NCCL (GPU) or gloo (CPU), in one invocation, on whatever GPUs the machine has.

    python3 client-py/benchmarks/job_start.py [--jobs 5] [--ranks N] [--comms 1,8,64]
                                              [--cpu] [--json out.jsonl]

It starts its own commd daemon (COMMD_BIN, else `commd` on PATH, else target/release/commd) and
runs fresh jobs (one process per rank, the env:// rendezvous torchrun uses) of this same file:

- first collective: wall time from the job's spawn to its first all_reduce completed, per rank
  (the job's time is its slowest rank's), and within that the part in `init_process_group` +
  the first op; median of --jobs fresh jobs. commd twice: with the daemon already running (the
  normal case) and with a daemon started just before the job (its start counted).
- K communicators (`new_group`, K = each of --comms): time to create K groups and run one
  all_reduce in each, after the first collective.
- GPU memory per process attributable to communication: the process's GPU memory (nvidia-smi,
  per pid) after the largest K, minus before `init_process_group` (CUDA context and the test
  tensors included in both); the daemon's own GPU memory (its pid) before and after, divided by
  the number of ranks it serves, reported separately.
- ten short jobs back to back on one daemon (commd, 2 ranks at least): each job's
  first-collective time, the daemon's IPC handle opens during the job, and the daemon's
  resources after the job (sessions, communicators, open handles, RSS, GPU memory) against its
  idle level before the first.

Ranks: one per GPU (NCCL's rule), at most --ranks; with one GPU, commd is also run with two
ranks sharing it (NCCL cannot). --cpu: CPU tensors, gloo vs commd, --ranks ranks (default 4).
Prints a table and, with --json, appends one JSON line per measurement.
"""

from __future__ import annotations

import time

_T_PROC = time.time()  # noqa: E402 - before the imports, which are part of a job's start

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------------------------
# Worker: one rank of one job.
# --------------------------------------------------------------------------------------------

def gpu_mem_mib(pid: int) -> float | None:
    """GPU memory used by process ``pid`` (MiB, all GPUs), from nvidia-smi; None if not listed
    (e.g. another PID namespace)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    total, seen = 0.0, False
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0] == str(pid):
            seen = True
            try:
                total += float(parts[1])
            except ValueError:
                pass
    return total if seen else None


def worker() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t_spawn = float(os.environ["JOB_T0"])
    backend = os.environ["JOB_BACKEND"]
    cpu = os.environ.get("JOB_CPU") == "1"
    comms = [int(k) for k in os.environ.get("JOB_COMMS", "").split(",") if k]
    import torch
    import torch.distributed as dist
    t_import = time.time()
    if backend == "commd":
        import commd.torch  # noqa: F401
    dev = torch.device("cpu")
    if not cpu:
        ngpu = torch.cuda.device_count()
        local = int(os.environ.get("LOCAL_RANK", rank)) % ngpu
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        torch.ones(1, device=dev)  # the CUDA context, before anything is timed
        torch.cuda.synchronize()
    x = torch.ones(1 << 16, device=dev)
    mem0 = None if cpu else gpu_mem_mib(os.getpid())
    t0 = time.time()
    dist.init_process_group(backend)
    dist.all_reduce(x)
    if not cpu:
        torch.cuda.synchronize()
    t_first = time.time()
    ok = bool((x == world).all().item())
    r = {"rank": rank, "world": world, "backend": backend, "pid": os.getpid(),
         "import_s": t_import - _T_PROC, "to_first_s": t_first - t_spawn,
         "init_first_s": t_first - t0, "first_ok": ok, "comms": {}}
    groups = []
    for k in comms:
        dist.barrier()
        t = time.time()
        gs = [dist.new_group(list(range(world))) for _ in range(k)]
        for g in gs:
            y = torch.ones(1 << 10, device=dev)
            dist.all_reduce(y, group=g)
            if not cpu:
                torch.cuda.synchronize()
            ok = ok and bool((y == world).all().item())
        r["comms"][str(k)] = time.time() - t
        groups.append(gs)
    r["comms_ok"] = ok
    if not cpu:
        torch.cuda.synchronize()
        r["mem_before_mib"] = mem0
        r["mem_after_mib"] = gpu_mem_mib(os.getpid())
        dpid = os.environ.get("JOB_DAEMON_PID")
        if dpid and rank == 0:
            r["daemon_mem_after_mib"] = gpu_mem_mib(int(dpid))
    dist.barrier()
    for gs in groups:
        for g in gs:
            dist.destroy_process_group(g)
    dist.destroy_process_group()
    print("JOBSTAT " + json.dumps(r), flush=True)


# --------------------------------------------------------------------------------------------
# Orchestrator.
# --------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commd_bin() -> str:
    for c in (os.environ.get("COMMD_BIN"), shutil.which("commd"),
              os.path.join(HERE, "..", "..", "target", "release", "commd"),
              os.path.join(HERE, "..", "..", ".gpu", "commd")):
        if c and os.path.exists(c):
            return c
    sys.exit("job_start: no commd binary (set COMMD_BIN or build target/release/commd)")


class Daemon:
    def __init__(self, log_dir: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="commd-jobstart-")
        self.sock = os.path.join(self.dir, "commd.sock")
        self.log = open(os.path.join(log_dir, f"daemon-{os.path.basename(self.dir)}.log"), "w")
        self.t_start = time.time()
        self.p = subprocess.Popen([commd_bin(), "serve", "--socket", self.sock, "--set",
                                   "metrics_listen=off"], stdout=self.log, stderr=self.log)
        for _ in range(600):
            if os.path.exists(self.sock):
                break
            time.sleep(0.01)
        else:
            sys.exit("job_start: the daemon did not start (see its log)")

    def status(self) -> dict:
        out = subprocess.run([commd_bin(), "status", "--json", "--socket", self.sock],
                             capture_output=True, text=True, timeout=30).stdout
        try:
            return json.loads(out)
        except json.JSONDecodeError:
            return {}

    def rss_mib(self) -> float:
        with open(f"/proc/{self.p.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        self.p.terminate()
        self.p.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def run_job(backend: str, ranks: int, comms: list[int], cpu: bool, daemon: Daemon | None,
            t0: float | None = None) -> list[dict]:
    port = free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(ranks), JOB_BACKEND=backend, JOB_CPU="1" if cpu else "0",
               JOB_COMMS=",".join(map(str, comms)), JOB_WORKER="1",
               NCCL_NVLS_ENABLE="0", OMP_NUM_THREADS="1")
    if daemon is not None:
        env["COMMD_SOCKET"] = daemon.sock
        env["JOB_DAEMON_PID"] = str(daemon.p.pid)
    env["JOB_T0"] = repr(t0 if t0 is not None else time.time())
    procs = [subprocess.Popen([sys.executable, __file__], env=dict(env, RANK=str(r),
                                                                   LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(ranks)]
    res = []
    for p in procs:
        out, err = p.communicate(timeout=900)
        if p.returncode != 0:
            sys.stderr.write(err[-3000:])
            sys.exit(f"job_start: a {backend} rank failed (exit {p.returncode})")
        for line in out.splitlines():
            if line.startswith("JOBSTAT "):
                res.append(json.loads(line[8:]))
    return res


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=5, help="fresh jobs per setup (median)")
    ap.add_argument("--ranks", type=int, default=0,
                    help="ranks per job (default: one per GPU; --cpu: 4)")
    ap.add_argument("--comms", default="1,8,64", help="communicator counts K")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors: gloo vs commd")
    ap.add_argument("--back-to-back", type=int, default=10,
                    help="short jobs in a row on one daemon")
    ap.add_argument("--json", help="append JSON lines here")
    ap.add_argument("--log-dir", default=tempfile.gettempdir())
    a = ap.parse_args()
    comms = [int(k) for k in a.comms.split(",") if k]
    import torch
    ngpu = 0 if a.cpu else torch.cuda.device_count()
    if not a.cpu and ngpu == 0:
        sys.exit("job_start: no GPU; use --cpu")
    peer = "gloo" if a.cpu else "nccl"
    ranks = a.ranks or (4 if a.cpu else ngpu)
    if not a.cpu:
        ranks = min(ranks, ngpu)
    commit = os.environ.get("COMMD_COMMIT", "")
    rows: list[dict] = []

    def emit(r: dict) -> None:
        r.update(bench="job_start", commit=commit, gpus=ngpu, date=time.strftime("%Y-%m-%d"),
                 gpu_name=torch.cuda.get_device_name(0) if ngpu else "cpu")
        rows.append(r)
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(r) + "\n")

    def setups():
        yield peer, ranks, "peer"
        yield "commd", ranks, "warm"
        yield "commd", ranks, "cold"
        if not a.cpu and ngpu == 1:
            yield "commd", 2, "warm, 2 ranks sharing the GPU"

    daemon = Daemon(a.log_dir)
    try:
        for backend, n, how in setups():
            firsts, inits, per_k = [], [], {str(k): [] for k in comms}
            mems, dmem, ok = [], [], True
            for j in range(a.jobs):
                d, t0 = daemon, None
                if how == "cold":
                    t0 = time.time()
                    d = Daemon(a.log_dir)
                dmem0 = gpu_mem_mib(d.p.pid) if (backend == "commd" and ngpu) else None
                res = run_job(backend, n, comms if j == 0 else [], a.cpu,
                              d if backend == "commd" else None, t0)
                if how == "cold":
                    d.stop()
                firsts.append(max(r["to_first_s"] for r in res))
                inits.append(max(r["init_first_s"] for r in res))
                ok = ok and all(r["first_ok"] and r.get("comms_ok", True) for r in res)
                if j == 0:
                    for k in per_k:
                        per_k[k] = [max(r["comms"][k] for r in res)]
                    for r in res:
                        before, after = r.get("mem_before_mib"), r.get("mem_after_mib")
                        if before is not None and after is not None:
                            mems.append(after - before)
                        if r.get("daemon_mem_after_mib") is not None and dmem0 is not None:
                            dmem.append((r["daemon_mem_after_mib"] - dmem0) / n)
            emit({"backend": backend, "setup": how, "ranks": n,
                  "first_collective_s": med(firsts), "init_and_first_op_s": med(inits),
                  "first_collective_all_s": firsts,
                  "comms_s": {k: v[0] for k, v in per_k.items() if v},
                  "gpu_mem_per_process_mib": med(mems) if mems else None,
                  "daemon_gpu_mem_per_rank_mib": med(dmem) if dmem else None,
                  "correct": ok})
        # Ten short jobs back to back on one (fresh) daemon: with two ranks at least (ranks
        # sharing a GPU on a one-GPU machine), so that they register memory and reduce.
        b2b = max(ranks, 2)
        d = Daemon(a.log_dir)
        try:
            idle = d.status()
            base = {"sessions": idle.get("sessions", 0),
                    "communicators": idle.get("communicators", 0),
                    "ipc_open_now": idle.get("ipc_open_now", 0), "rss_mib": d.rss_mib(),
                    "gpu_mib": gpu_mem_mib(d.p.pid) if ngpu else None}
            jobs = []
            for j in range(a.back_to_back):
                s0 = d.status()
                res = run_job("commd", b2b, [], a.cpu, d)
                time.sleep(0.2)  # the daemon ends sessions when their processes exit
                s1 = d.status()
                jobs.append({"first_collective_s": max(r["to_first_s"] for r in res),
                             "ipc_opens": s1.get("ipc_opens", 0) - s0.get("ipc_opens", 0),
                             "sessions": s1.get("sessions", 0),
                             "communicators": s1.get("communicators", 0),
                             "ipc_open_now": s1.get("ipc_open_now", 0),
                             "rss_mib": round(d.rss_mib(), 1),
                             "gpu_mib": gpu_mem_mib(d.p.pid) if ngpu else None})
            emit({"backend": "commd", "setup": "back-to-back", "ranks": b2b, "idle": base,
                  "jobs": jobs})
        finally:
            d.stop()
    finally:
        daemon.stop()
    print_table(rows, comms)


def print_table(rows: list[dict], comms: list[int]) -> None:
    ks = [str(k) for k in comms]
    print(f"{'backend':8} {'setup':34} {'ranks':>5} {'first op s':>10} {'init+op s':>9} "
          + " ".join(f"{'K=' + k + ' s':>9}" for k in ks)
          + f" {'GPU MiB/proc':>12} {'daemon MiB/rank':>15}")
    for r in rows:
        if r["setup"] == "back-to-back":
            continue
        cs = " ".join(f"{r['comms_s'].get(k, float('nan')):9.3f}" for k in ks)
        gm = r["gpu_mem_per_process_mib"]
        dm = r["daemon_gpu_mem_per_rank_mib"]
        print(f"{r['backend']:8} {r['setup']:34} {r['ranks']:5d} {r['first_collective_s']:10.3f} "
              f"{r['init_and_first_op_s']:9.3f} {cs} "
              f"{'-' if gm is None else f'{gm:.0f}':>12} {'-' if dm is None else f'{dm:.0f}':>15}"
              f"{'' if r['correct'] else '  WRONG RESULT'}")
    for r in rows:
        if r["setup"] != "back-to-back":
            continue
        i = r["idle"]
        print(f"\n{len(r['jobs'])} jobs back to back on one daemon ({r['ranks']} ranks each); "
              f"idle: sessions {i['sessions']}, communicators {i['communicators']}, open handles "
              f"{i['ipc_open_now']}, RSS {i['rss_mib']:.1f} MiB, GPU {i['gpu_mib']} MiB")
        for n, j in enumerate(r["jobs"]):
            print(f"  job {n}: first op {j['first_collective_s']:.3f} s, handle opens "
                  f"{j['ipc_opens']}, after: sessions {j['sessions']}, communicators "
                  f"{j['communicators']}, open handles {j['ipc_open_now']}, "
                  f"RSS {j['rss_mib']} MiB, "
                  f"GPU {j['gpu_mib']} MiB")


if __name__ == "__main__":
    if os.environ.get("JOB_WORKER") == "1":
        worker()
    else:
        main()
