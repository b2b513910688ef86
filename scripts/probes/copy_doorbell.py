#!/usr/bin/env python3
"""Probe: how should the daemon start a send/recv copy and publish its done counter?

Three processes, like commd's send/recv between two GPUs: client A (GPU 0) and client B (GPU 1)
each run a stream that, per op k, writes its ready counter = k and waits for its done counter
>= k (cuStreamWriteValue32 / cuStreamWaitValue32 on a shared host page, as commd's doorbells).
A "daemon" process with its own contexts on both GPUs pushes `size` bytes GPU 0 -> GPU 1 per op
with the copy engine and releases both clients. Modes (how the daemon does one op):

  event  CPU polls both ready counters, cuMemcpyAsync + cuEventRecord, polls cuEventQuery,
         writes both done counters from the CPU (what commd's executor does today)
  write  CPU polls both ready counters, cuMemcpyAsync, then cuStreamWriteValue32 of both done
         counters on the copy's stream: the GPU publishes done right after the copy
  gate   copies pre-issued (a window ahead) behind a cuStreamWaitValue32 on a daemon-owned gate
         word; the CPU polls both ready counters and writes the gate; the stream writes done
  gpu    copies pre-issued behind cuStreamWaitValue32 on the clients' own ready counters; no CPU
  graph  as event, the copy captured once into a CUDA graph and issued with cuGraphLaunch
  streamquery  as event, completion polled with cuStreamQuery (no event)
  pull   as event, the copy issued on the destination GPU (a pull)
  nocopy as event without the copy (an event record alone); cpuonly: no GPU work at all
  client no daemon work: the sender's own stream waits for the receiver's ready, pushes into a
         buffer on the receiver's GPU that its process mapped, and writes the receiver's done
  solo   the daemon's copy alone (no clients): issue cost and latency of three memcpy calls

Prints the GPU time per op seen by client A's stream (events around N ops, all pre-enqueued).
--cpu-costs: CPU time per call of the client's per-op driver calls (one GPU), then exit.
--fused: one kernel per op writes ready and polls done.
--spin: the clients wait for done with a one-warp kernel polling the host word instead of
cuStreamWaitValue32. Only libcuda through ctypes; no torch. Usage: copy_doorbell.py [sizes...] (bytes, default
64Ki 1Mi 16Mi) [--modes event,write,gate,gpu] [--n N] [--spin|--fused] [--cpu-costs].
"""

import ctypes
import mmap
import multiprocessing as mp
import os
import sys
import time

WINDOW = 8
OFF_READY = (0, 64)
OFF_DONE = (128, 192)
OFF_GATE = 256
OFF_START = 320
OFF_ARMED = 384

_cu = None


def cu():
    global _cu
    if _cu is None:
        _cu = ctypes.CDLL("libcuda.so.1")
    return _cu


def ck(r, what):
    if r != 0:
        name = ctypes.c_char_p()
        cu().cuGetErrorName(r, ctypes.byref(name))
        raise RuntimeError(f"{what}: {name.value}")


def ctx_on(dev_ord):
    ck(cu().cuInit(0), "cuInit")
    dev = ctypes.c_int()
    ck(cu().cuDeviceGet(ctypes.byref(dev), dev_ord), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    ck(cu().cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ck(cu().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


def stream():
    s = ctypes.c_void_p()
    ck(cu().cuStreamCreate(ctypes.byref(s), 1), "cuStreamCreate")  # non-blocking
    return s


def map_page(path):
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    ck(cu().cuMemHostRegister_v2(ctypes.c_void_p(addr), ctypes.c_size_t(4096), 3), "cuMemHostRegister")
    dptr = ctypes.c_uint64()
    ck(cu().cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), ctypes.c_void_p(addr), 0), "cuMemHostGetDevicePointer")
    return m, addr, dptr.value


def word(addr, off):
    return ctypes.c_uint32.from_address(addr + off)


def write_value(s, dptr, v):
    ck(cu().cuStreamWriteValue32_v2(s, ctypes.c_uint64(dptr), ctypes.c_uint32(v), 0), "cuStreamWriteValue32")


def wait_value(s, dptr, v):
    ck(cu().cuStreamWaitValue32_v2(s, ctypes.c_uint64(dptr), ctypes.c_uint32(v), 0), "cuStreamWaitValue32")  # GEQ


SPIN_PTX = b"""
.version 7.8
.target sm_90
.address_size 64
.visible .entry spin(.param .u64 p, .param .u32 v)
{
  .reg .u64 %a;
  .reg .u32 %x, %w, %d;
  .reg .pred %q;
  ld.param.u64 %a, [p];
  ld.param.u32 %w, [v];
LOOP:
  ld.acquire.sys.global.u32 %x, [%a];
  sub.u32 %d, %x, %w;
  setp.lt.s32 %q, %d, 0;
  @%q bra LOOP;
  ret;
}
.visible .entry signal_spin(.param .u64 r, .param .u64 p, .param .u32 v)
{
  .reg .u64 %a, %b;
  .reg .u32 %x, %w, %d, %t;
  .reg .pred %q, %z;
  ld.param.u64 %b, [r];
  ld.param.u64 %a, [p];
  ld.param.u32 %w, [v];
  mov.u32 %t, %tid.x;
  setp.eq.u32 %z, %t, 0;
  @%z st.release.sys.global.u32 [%b], %w;
LOOP:
  ld.acquire.sys.global.u32 %x, [%a];
  sub.u32 %d, %x, %w;
  setp.lt.s32 %q, %d, 0;
  @%q bra LOOP;
  ret;
}
"""


def spin_kernel():
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    ck(cu().cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(SPIN_PTX)), "cuModuleLoadData")
    ck(cu().cuModuleGetFunction(ctypes.byref(fn), mod, b"spin"), "cuModuleGetFunction")
    fused = ctypes.c_void_p()
    ck(cu().cuModuleGetFunction(ctypes.byref(fused), mod, b"signal_spin"), "cuModuleGetFunction")

    def signal_wait(s, rptr, dptr, v):
        r, a, b = ctypes.c_uint64(rptr), ctypes.c_uint64(dptr), ctypes.c_uint32(v)
        params = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.byref(x), ctypes.c_void_p) for x in (r, a, b)])
        ck(cu().cuLaunchKernel(fused, 1, 1, 1, 32, 1, 1, 0, s, params, None), "cuLaunchKernel")

    def wait(s, dptr, v):
        a, b = ctypes.c_uint64(dptr), ctypes.c_uint32(v)
        params = (ctypes.c_void_p * 2)(ctypes.cast(ctypes.byref(a), ctypes.c_void_p), ctypes.cast(ctypes.byref(b), ctypes.c_void_p))
        ck(cu().cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s, params, None), "cuLaunchKernel")

    wait.fused = signal_wait
    return wait


def client(path, side, n, q, spin=False, mode="event", size=0):
    if mode == "client" and side == 0:
        ctx0, ctx1, src, dst = peer_buffers(size)
    else:
        ctx_on(side)
    m, addr, dptr = map_page(path)
    wait_done = spin_kernel() if spin else wait_value
    s = stream()
    e0, e1 = ctypes.c_void_p(), ctypes.c_void_p()
    ck(cu().cuEventCreate(ctypes.byref(e0), 0), "cuEventCreate")
    ck(cu().cuEventCreate(ctypes.byref(e1), 0), "cuEventCreate")
    wait_value(s, dptr + OFF_START, 1)
    ck(cu().cuEventRecord(e0, s), "cuEventRecord")
    for k in range(1, n + 1):
        if mode == "client" and side == 0:
            # The sender's own stream: wait for the receiver's ready, push, release it.
            wait_done(s, dptr + OFF_READY[1], k)
            ck(cu().cuMemcpyAsync(ctypes.c_uint64(dst.value), ctypes.c_uint64(src.value), ctypes.c_size_t(size), s), "cuMemcpyAsync")
            write_value(s, dptr + OFF_DONE[1], k)
            continue
        if spin == "fused":
            wait_done.fused(s, dptr + OFF_READY[side], dptr + OFF_DONE[side], k)
            continue
        write_value(s, dptr + OFF_READY[side], k)
        wait_done(s, dptr + OFF_DONE[side], k)
    ck(cu().cuEventRecord(e1, s), "cuEventRecord")
    word(addr, OFF_ARMED + 4 * side).value = 1
    ck(cu().cuStreamSynchronize(s), "cuStreamSynchronize")
    ms = ctypes.c_float()
    elapsed = getattr(cu(), "cuEventElapsedTime_v2", None) or cu().cuEventElapsedTime
    ck(elapsed(ctypes.byref(ms), e0, e1), "cuEventElapsedTime")
    q.put((side, ms.value * 1e3 / n))


def peer_buffers(size):
    """`size` bytes on GPU 1 (dst) and GPU 0 (src), GPU 0's context current with access to GPU 1."""
    ctx_on(1)
    dst = ctypes.c_uint64()
    ck(cu().cuMemAlloc_v2(ctypes.byref(dst), ctypes.c_size_t(size)), "cuMemAlloc dst")
    ctx0 = ctx_on(0)
    src = ctypes.c_uint64()
    ck(cu().cuMemAlloc_v2(ctypes.byref(src), ctypes.c_size_t(size)), "cuMemAlloc src")
    ctx1 = ctypes.c_void_p()
    dev1 = ctypes.c_int()
    ck(cu().cuDeviceGet(ctypes.byref(dev1), 1), "cuDeviceGet")
    ck(cu().cuDevicePrimaryCtxRetain(ctypes.byref(ctx1), dev1), "retain 1")
    r = cu().cuCtxEnablePeerAccess(ctx1, 0)
    if r not in (0, 704):  # 704: already enabled
        ck(r, "cuCtxEnablePeerAccess")
    return ctx0, ctx1, src, dst


def daemon(path, mode, size, n, q):
    if mode == "client":  # the sender's stream does it all; only start the clients
        m = mmap.mmap(os.open(path, os.O_RDWR), 4096)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        while word(addr, OFF_ARMED).value == 0 or word(addr, OFF_ARMED + 4).value == 0:
            time.sleep(0.001)
        word(addr, OFF_START).value = 1
        q.put(("daemon", float("nan")))
        q.put(("spans", [0.0, 0.0, 0.0]))
        return
    ctx0, ctx1, src, dst = peer_buffers(size)
    m, addr, dptr = map_page(path)
    s_pull = None
    if mode == "pull":  # the copy on the destination GPU's stream (a pull)
        ck(cu().cuCtxSetCurrent(ctx1), "cuCtxSetCurrent")
        r = cu().cuCtxEnablePeerAccess(ctx0, 0)
        if r not in (0, 704):
            ck(r, "cuCtxEnablePeerAccess")
        s_pull = stream()
        ev = ctypes.c_void_p()
        ck(cu().cuEventCreate(ctypes.byref(ev), 2), "cuEventCreate")
        ck(cu().cuCtxSetCurrent(ctx0), "cuCtxSetCurrent")
    s = stream()
    if mode != "pull":
        ev = ctypes.c_void_p()
        ck(cu().cuEventCreate(ctypes.byref(ev), 2), "cuEventCreate")  # disable timing
    ready = [word(addr, o) for o in OFF_READY]
    done = [word(addr, o) for o in OFF_DONE]
    gate = word(addr, OFF_GATE)

    gexec = None
    if mode == "graph":  # the copy captured once into a graph, launched per op
        g = ctypes.c_void_p()
        gexec = ctypes.c_void_p()
        ck(cu().cuStreamBeginCapture_v2(s_graph := stream(), 2), "cuStreamBeginCapture")
        ck(cu().cuMemcpyAsync(ctypes.c_uint64(dst.value), ctypes.c_uint64(src.value), ctypes.c_size_t(size), s_graph), "cuMemcpyAsync(capture)")
        ck(cu().cuStreamEndCapture(s_graph, ctypes.byref(g)), "cuStreamEndCapture")
        ck(cu().cuGraphInstantiateWithFlags(ctypes.byref(gexec), g, ctypes.c_ulonglong(0)), "cuGraphInstantiate")

    def copy():
        if mode in ("nocopy", "cpuonly"):
            return
        if gexec is not None:
            ck(cu().cuGraphLaunch(gexec, s), "cuGraphLaunch")
            return
        ck(cu().cuMemcpyAsync(ctypes.c_uint64(dst.value), ctypes.c_uint64(src.value), ctypes.c_size_t(size), s_pull if mode == "pull" else s), "cuMemcpyAsync")

    def publish_gpu(k):
        for o in OFF_DONE:
            write_value(s, dptr + o, k)

    def enqueue(k):
        if mode == "gate":
            wait_value(s, dptr + OFF_GATE, k)
        else:
            for o in OFF_READY:
                wait_value(s, dptr + o, k)
        copy()
        publish_gpu(k)

    def spin_ready(k):
        while ready[0].value < k or ready[1].value < k:
            pass

    # Warm the copy path once.
    copy()
    ck(cu().cuStreamSynchronize(s), "cuStreamSynchronize")
    if mode in ("gate", "gpu"):
        for k in range(1, min(n, WINDOW) + 1):
            enqueue(k)
    # Release the clients once both have queued everything.
    while word(addr, OFF_ARMED).value == 0 or word(addr, OFF_ARMED + 4).value == 0:
        time.sleep(0.001)
    word(addr, OFF_START).value = 1
    spans = [0.0, 0.0, 0.0]
    t_done = 0.0
    t = time.perf_counter()
    for k in range(1, n + 1):
        if mode == "gpu":
            while done[0].value < k:
                pass
            if k + WINDOW <= n:
                enqueue(k + WINDOW)
            continue
        spin_ready(k)
        if mode == "gate":
            gate.value = k
            if k + WINDOW <= n:
                enqueue(k + WINDOW)
        elif mode == "write":
            copy()
            publish_gpu(k)
        else:
            t1 = time.perf_counter()
            copy()
            if mode in ("event", "nocopy", "pull", "graph"):
                ck(cu().cuEventRecord(ev, s_pull if mode == "pull" else s), "cuEventRecord")
            t2 = time.perf_counter()
            while mode != "cpuonly":
                r = cu().cuStreamQuery(s) if mode == "streamquery" else cu().cuEventQuery(ev)
                if r == 0:
                    break
                if r != 600:  # not ready
                    ck(r, "cuEventQuery")
            t3 = time.perf_counter()
            done[0].value = k
            done[1].value = k
            if k > 1:
                spans[0] += t1 - t_done
            spans[1] += t2 - t1
            spans[2] += t3 - t2
            t_done = t3
    ck(cu().cuStreamSynchronize(s), "cuStreamSynchronize")
    q.put(("daemon", (time.perf_counter() - t) * 1e6 / n))
    q.put(("spans", [x * 1e6 / n for x in spans]))


def run(mode, size, n, spin=False):
    path = f"/dev/shm/commd-probe-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    c = mp.get_context("spawn")
    q = c.Queue()
    ps = [c.Process(target=daemon, args=(path, mode, size, n, q))]
    ps += [c.Process(target=client, args=(path, side, n, q, spin, mode, size)) for side in (0, 1)]
    for p in ps:
        p.start()
    got = {}
    try:
        for _ in range(4):
            k, v = q.get(timeout=60)
            got[k] = v
    finally:
        for p in ps:
            p.join(10)
            if p.is_alive():
                p.kill()
        os.unlink(path)
    return got


def solo(size, n):
    """The daemon's copy alone: issue, event, poll, per op (no clients, no doorbells)."""
    ctx0, ctx1, src, dst = peer_buffers(size)
    s = stream()
    ev = ctypes.c_void_p()
    ck(cu().cuEventCreate(ctypes.byref(ev), 2), "cuEventCreate")
    d, sr, sz = ctypes.c_uint64(dst.value), ctypes.c_uint64(src.value), ctypes.c_size_t(size)
    variants = {
        "cuMemcpyAsync": lambda: cu().cuMemcpyAsync(d, sr, sz, s),
        "cuMemcpyDtoDAsync": lambda: cu().cuMemcpyDtoDAsync_v2(d, sr, sz, s),
        "cuMemcpyPeerAsync": lambda: cu().cuMemcpyPeerAsync(d, ctx1, sr, ctx0, sz, s),
    }
    for name, f in variants.items():
        issue = wait = 0.0
        for k in range(n + 10):
            t1 = time.perf_counter()
            ck(f(), name)
            ck(cu().cuEventRecord(ev, s), "cuEventRecord")
            t2 = time.perf_counter()
            while cu().cuEventQuery(ev) != 0:
                pass
            t3 = time.perf_counter()
            if k >= 10:
                issue += t2 - t1
                wait += t3 - t2
        print(f"  solo {size:>10} {name}: issue+record {issue * 1e6 / n:.2f} us, issue-to-event-seen {wait * 1e6 / n:.2f} us per copy", flush=True)


def cpu_costs(n=4000):
    """CPU time per call of what a client enqueues per op (one GPU; counters already satisfied)."""
    ctx_on(0)
    path = f"/dev/shm/commd-probe-cpu-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    m, addr, dptr = map_page(path)
    s = stream()
    spin = spin_kernel()
    cur = ctypes.c_void_p()
    sctx = ctypes.c_void_p()
    cid = ctypes.c_ulonglong()
    calls = {
        "cuStreamWriteValue32": lambda: write_value(s, dptr, 0),
        "cuStreamWaitValue32": lambda: wait_value(s, dptr + 64, 0),
        "cuLaunchKernel(spin)": lambda: spin(s, dptr + 64, 0),
        "cuCtxGetCurrent": lambda: cu().cuCtxGetCurrent(ctypes.byref(cur)),
        "cuStreamGetCtx": lambda: cu().cuStreamGetCtx(s, ctypes.byref(sctx)),
        "cuCtxGetId": lambda: cu().cuCtxGetId(cur, ctypes.byref(cid)),
        "ctypes no-op (cuDriverGetVersion)": lambda: cu().cuDriverGetVersion(ctypes.byref(cid)),
    }
    for name, f in calls.items():
        for _ in range(200):
            f()
        ck(cu().cuStreamSynchronize(s), "sync")
        dt = 0.0
        for _ in range(n // 250):  # in batches: a full launch queue would make the CPU wait
            t = time.perf_counter()
            for _ in range(250):
                f()
            dt += time.perf_counter() - t
            ck(cu().cuStreamSynchronize(s), "sync")
        print(f"  cpu {name}: {dt * 1e6 / (n // 250 * 250):.2f} us per call", flush=True)
    os.unlink(path)


def main():
    args = sys.argv[1:]
    if "--cpu-costs" in args:
        cpu_costs()
        return
    modes = ["event", "write", "gate", "gpu"]
    n = 200
    sizes = []
    spin = "fused" if "--fused" in args else "--spin" in args
    args = [a for a in args if a not in ("--spin", "--fused")]
    i = 0
    while i < len(args):
        if args[i] == "--modes":
            modes = args[i + 1].split(",")
            i += 2
        elif args[i] == "--n":
            n = int(args[i + 1])
            i += 2
        else:
            sizes.append(int(args[i]))
            i += 1
    sizes = sizes or [64 << 10, 1 << 20, 16 << 20]
    if "solo" in modes:
        modes.remove("solo")
        c = mp.get_context("spawn")
        for size in sizes:
            p = c.Process(target=solo, args=(size, n))
            p.start()
            p.join(60)
    print(f"{'mode':>6} {'bytes':>10} {'us/op A':>9} {'us/op B':>9} {'GB/s':>7} {'daemon wall us/op':>18}", flush=True)
    for size in sizes:
        for mode in modes:
            for rep in range(2):
                try:
                    got = run(mode, size, n, spin)
                except Exception as e:  # keep going: one mode failing says something too
                    print(f"{mode:>6} {size:>10} FAILED {e}", flush=True)
                    continue
                a = got.get(0, float("nan"))
                sp = got.get("spans") or [0.0, 0.0, 0.0]
                extra = f"  [ready seen after done {sp[0]:.2f}, issue {sp[1]:.2f}, until event {sp[2]:.2f}]" if mode not in ("gate", "gpu", "write") else ""
                print(f"{mode:>6} {size:>10} {a:9.2f} {got.get(1, float('nan')):9.2f} {size / a / 1e3:7.1f} {got.get('daemon', float('nan')):18.2f}{extra}", flush=True)


if __name__ == "__main__":
    main()
