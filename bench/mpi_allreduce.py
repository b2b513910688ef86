"""Peer baseline for `commd bench` on host memory: MPI_Allreduce (OpenMPI, shared-memory
transport) with the same sizes, ranks and timing rule (mean over iterations, slowest rank).

    mpirun --allow-run-as-root --oversubscribe -np 4 python3 bench/mpi_allreduce.py --min-bytes 8 --max-bytes 256M

busbw = algbw * 2(n-1)/n, as in nccl-tests and `commd bench`.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI


def size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--min-bytes", type=size, default=8)
    ap.add_argument("--max-bytes", type=size, default=256 << 20)
    ap.add_argument("--step-factor", type=int, default=2)
    a = ap.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    if rank == 0:
        print(f"# MPI_Allreduce f32 sum, {n} ranks, {MPI.Get_library_version().splitlines()[0]}")
        print(f"# {'size':>12} {'count':>12} {'time(us)':>10} {'med(us)':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>6}")
    s = a.min_bytes
    while s <= a.max_bytes:
        count = max(s // 4, 1)
        send = np.full(count, rank + 1, dtype=np.float32)
        recv = np.empty(count, dtype=np.float32)
        iters = int(min(max((2 << 30) // max(s, 1), 5), 1000))
        for _ in range(max(iters // 5, 2)):
            comm.Allreduce(send, recv, op=MPI.SUM)
        times = []
        comm.Barrier()
        t_all = time.perf_counter()
        for _ in range(iters):
            t = time.perf_counter()
            comm.Allreduce(send, recv, op=MPI.SUM)
            times.append(time.perf_counter() - t)
        mean = (time.perf_counter() - t_all) / iters * 1e6
        med = sorted(times)[len(times) // 2] * 1e6
        wrong = int(np.count_nonzero(recv != n * (n + 1) / 2))
        mean, med, wrong = comm.allreduce(mean, op=MPI.MAX), comm.allreduce(med, op=MPI.MAX), comm.allreduce(wrong)
        if rank == 0:
            algbw = count * 4 / (mean * 1e-6) / 1e9
            print(f"  {count * 4:>12} {count:>12} {mean:>10.2f} {med:>10.2f} {algbw:>8.2f} {algbw * 2 * (n - 1) / n:>8.2f} {wrong:>6}")
        s *= a.step_factor


if __name__ == "__main__":
    main()
