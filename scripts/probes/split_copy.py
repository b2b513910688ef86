#!/usr/bin/env python3
"""Probe: can one GPU0 -> GPU1 transfer beat a single copy-engine push by splitting it?

One process, torch, two GPUs. Per size, each way moves `size` bytes from a buffer on GPU 0 to
a buffer on GPU 1, `n` times back to back; both streams join after every transfer (event
waits both ways), so every way pays the same join. Wall clock over the n transfers after a
synchronize, best of `reps`. Ways:

  push        one copy on a stream of GPU 0 (what commd's executor does)
  pull        one copy on a stream of GPU 1
  push2       two halves on two streams of GPU 0
  mix:F       fraction F pushed on GPU 0's stream, the rest pulled on GPU 1's stream, at once

Usage: split_copy.py [--sizes 16Mi,64Mi,1Gi] [--fracs 0.5,0.6,0.7,0.8] [--n 50] [--reps 3]
"""

import argparse
import ctypes
import glob
import os
import time

import torch

UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}


def parse_size(text: str) -> int:
    for suffix, mult in UNITS.items():
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * mult
    return int(text)


def cudart() -> ctypes.CDLL:
    """The CUDA runtime torch uses (its primary contexts); copies go through it, not copy_,
    because torch always issues a cross-device copy on the source device (a push)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            pass
    base = os.path.dirname(torch.__file__)
    for path in glob.glob(os.path.join(base, "..", "nvidia", "*", "lib", "libcudart.so*")):
        return ctypes.CDLL(path)
    raise SystemExit("libcudart not found")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1Mi,4Mi,16Mi,64Mi,1Gi")
    p.add_argument("--fracs", default="0.5,0.6,0.65,0.7,0.75,0.8")
    p.add_argument("--n", type=int, default=50)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    s0 = torch.cuda.Stream(d0)
    s0b = torch.cuda.Stream(d0)
    s1 = torch.cuda.Stream(d1)
    rt = cudart()
    for dev, peer in ((0, 1), (1, 0)):
        rt.cudaSetDevice(dev)
        rc = rt.cudaDeviceEnablePeerAccess(peer, 0)
        if rc not in (0, 704):  # 704: already enabled
            raise SystemExit(f"cudaDeviceEnablePeerAccess({dev}->{peer}) = {rc}")
    rt.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                   ctypes.c_int, ctypes.c_void_p]
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"p2p {torch.cuda.can_device_access_peer(0, 1)}")
    print("| bytes | way | us per transfer | GB/s |")
    print("|---:|---|---:|---:|")
    for size in [parse_size(s) for s in a.sizes.split(",")]:
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=d0)
        dst = torch.empty(size, dtype=torch.uint8, device=d1)
        ways: list[tuple[str, list[tuple[torch.cuda.Stream, int, int]]]] = [
            ("push", [(s0, 0, size)]),
            ("pull", [(s1, 0, size)]),
            ("push2", [(s0, 0, size // 2), (s0b, size // 2, size)]),
        ]
        for f in [float(x) for x in a.fracs.split(",")]:
            cut = (int(size * f) // 4096) * 4096
            ways.append((f"mix:{f}", [(s0, 0, cut), (s1, cut, size)]))
        for name, parts in ways:
            streams = [st for st, _, _ in parts]
            best = float("inf")
            for _ in range(a.reps):
                dst.zero_()
                torch.cuda.synchronize(d0)
                torch.cuda.synchronize(d1)
                t0 = time.perf_counter()
                for _ in range(a.n):
                    for st, lo, hi in parts:
                        rc = rt.cudaMemcpyAsync(dst.data_ptr() + lo, src.data_ptr() + lo,
                                                hi - lo, 4, st.cuda_stream)  # cudaMemcpyDefault
                        if rc:
                            raise SystemExit(f"cudaMemcpyAsync = {rc}")
                    # join: every stream waits for every other one's copy
                    evs = []
                    for st in streams:
                        ev = torch.cuda.Event()
                        ev.record(st)
                        evs.append(ev)
                    for st in streams:
                        for ev in evs:
                            st.wait_event(ev)
                torch.cuda.synchronize(d0)
                torch.cuda.synchronize(d1)
                best = min(best, (time.perf_counter() - t0) / a.n)
            if not torch.equal(dst.cpu(), src.cpu()):
                raise SystemExit(f"{name} {size}: data mismatch")
            print(f"| {size} | {name} | {best * 1e6:.1f} | {size / best / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
