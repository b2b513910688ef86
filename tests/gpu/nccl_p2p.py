"""Send/recv through commd's NCCL library with torch's own "nccl" backend (run under torchrun with
LD_PRELOAD=libcommd_nccl.so by scripts/gpu-check.sh p2p, by default, with COMMD_P2P_DIRECT=1 and with it 0).

torch's code decides how the ops reach the library: batch_isend_irecv is one
ncclGroupStart/ncclGroupEnd, a single isend/irecv is an op of its own. Every received value is
checked against what its sender must have sent (a function of sender, receiver, round and
index), so a lost, stale or misplaced message fails, whichever path carried it:
- a ring (send to the next rank, receive from the previous one) in one group, receive listed
  first or send first, 60 rounds on the same buffers (the inboxes' two slots reused);
- a ring of byte messages whose sizes straddle the LL limit (COMMD_P2P_LL_MAX_BYTES, 256 KiB:
  small ones travel as flagged lines, larger ones through the slots), mixed round by round,
  at odd offsets (unaligned buffers) and of odd lengths;
- every pair at once in one group (all-to-all's pattern), odd counts and five dtypes;
- one group with a small (direct) and a large (past COMMD_P2P_DIRECT_MAX_BYTES: the daemon's
  path) message to the same peer, in both orders, and one with two small ones each way;
- single isend/irecv between partners (even ranks send first), then the reverse direction;
- a ring captured into a CUDA graph and replayed with new input, eager rings in between.
Prints one line per failure and a summary; exits non-zero on any failure.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
local = int(os.environ.get("LOCAL_RANK", rank))
# Ranks may share a GPU (COMMD_P2P_DIRECT=shared: scripts/gpu-check.sh p2p on one GPU).
dev = torch.device("cuda", local % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
failures: list[str] = []
checks = 0


def payload(src: int, dst: int, rnd: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    i = torch.arange(n, device=dev, dtype=torch.int64)
    v = (i * 7 + src * 101 + dst * 13 + rnd * 31) % 127
    return v.to(dtype)


def check(what: str, got: torch.Tensor, src: int, rnd: int) -> None:
    global checks
    checks += 1
    want = payload(src, rank, rnd, got.numel(), got.dtype)
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        failures.append(f"{what}: from rank {src} round {rnd}: {bad.numel()} wrong values, "
                        f"first at {bad[0].item()}: {got.flatten()[bad[0]].item()} "
                        f"instead of {want.flatten()[bad[0]].item()}")
        print(f"rank {rank}: FAIL {failures[-1]}", flush=True)


def run(ops: list[dist.P2POp]) -> None:
    for r in dist.batch_isend_irecv(ops):
        r.wait()


# 1. The ring, 60 rounds on the same buffers, recv listed first in odd rounds.
nxt, prv = (rank + 1) % world, (rank - 1) % world
for n, dtype in ((1, torch.float32), (1023, torch.bfloat16), (65537, torch.int32)):
    out = torch.empty(n, device=dev, dtype=dtype)
    for rnd in range(60):
        x = payload(rank, nxt, rnd, n, dtype)
        s = dist.P2POp(dist.isend, x, nxt)
        r = dist.P2POp(dist.irecv, out, prv)
        run([r, s] if rnd % 2 else [s, r])
        check(f"ring n={n} {dtype}", out, prv, rnd)

# 1b. Byte messages around the LL limit, mixed round by round (both protocols on one pair's
#     slots and flags), at odd offsets of larger buffers (unaligned) and of odd lengths.
ll_max = int(os.environ.get("COMMD_P2P_LL_MAX_BYTES", 256 << 10))
sizes = [1, 7, 8, 9, 4095, max(ll_max - 1, 1), max(ll_max, 1), ll_max + 1, ll_max + 4097, 3]
for rnd in range(80):
    n = sizes[(rnd * 7 + rnd // len(sizes)) % len(sizes)]
    off = rnd % 3
    x_all = torch.empty(n + 8, device=dev, dtype=torch.uint8)
    x_all[off:off + n] = payload(rank, nxt, rnd, n, torch.uint8)
    out_all = torch.full((n + 8,), 255, device=dev, dtype=torch.uint8)
    oo = (rnd // 3) % 3
    run([dist.P2POp(dist.isend, x_all[off:off + n], nxt),
         dist.P2POp(dist.irecv, out_all[oo:oo + n], prv)])
    check(f"LL limit n={n} offsets {off}/{oo}", out_all[oo:oo + n], prv, rnd)
    # Nothing written past the message.
    if not bool((out_all[:oo] == 255).all() and (out_all[oo + n:] == 255).all()):
        failures.append(f"LL limit n={n}: bytes written outside the receive buffer")
        print(f"rank {rank}: FAIL {failures[-1]}", flush=True)

# 2. Every pair at once, as all-to-all does.
for n, dtype in ((3, torch.int8), (4097, torch.float16), (250001, torch.float32),
                 (33, torch.int64), (1 << 20, torch.uint8)):
    for rnd in range(3):
        outs = {p: torch.empty(n, device=dev, dtype=dtype) for p in range(world) if p != rank}
        ops = []
        for p in outs:
            ops.append(dist.P2POp(dist.isend, payload(rank, p, rnd, n, dtype), p))
            ops.append(dist.P2POp(dist.irecv, outs[p], p))
        run(ops)
        for p, o in outs.items():
            check(f"all pairs n={n} {dtype}", o, p, rnd)

# 3. Small and large to the same peer in one group, both orders (the large one is past the
#    direct limit: the daemon's path, its sequence apart from the direct one).
big = (int(os.environ.get("COMMD_P2P_DIRECT_MAX_BYTES", 4 << 20)) // 4) + 5
for rnd in range(4):
    small_out = torch.empty(999, device=dev, dtype=torch.float32)
    big_out = torch.empty(big, device=dev, dtype=torch.float32)
    sends = [dist.P2POp(dist.isend, payload(rank, nxt, rnd, 999, torch.float32), nxt),
             dist.P2POp(dist.isend, payload(rank, nxt, rnd + 100, big, torch.float32), nxt)]
    recvs = [dist.P2POp(dist.irecv, small_out, prv), dist.P2POp(dist.irecv, big_out, prv)]
    if rnd % 2:
        sends.reverse()
        recvs.reverse()
    run(recvs + sends if rnd % 3 else sends + recvs)
    check("small beside large", small_out, prv, rnd)
    check("large beside small", big_out, prv, rnd + 100)

# 3b. Two small messages each way to the same peer in one group (one direction of a pair twice:
#     the library posts them one at a time, not in one group kernel).
for rnd in range(6):
    outs = [torch.empty(513 + k, device=dev, dtype=torch.float32) for k in range(2)]
    ops = [dist.P2POp(dist.isend, payload(rank, nxt, rnd * 2 + k, 513 + k, torch.float32), nxt)
           for k in range(2)]
    ops += [dist.P2POp(dist.irecv, outs[k], prv) for k in range(2)]
    run(ops)
    for k in range(2):
        check("two each way", outs[k], prv, rnd * 2 + k)

# 4. Single isend/irecv between partners: even ranks send first, then the other way round.
if world % 2 == 0:
    partner = rank ^ 1
    for rnd in range(20):
        n = 1 + rnd * 4099
        out = torch.empty(n, device=dev, dtype=torch.float32)
        x = payload(rank, partner, rnd, n, torch.float32)
        if rank % 2 == 0:
            dist.send(x, partner)
            dist.recv(out, partner)
        else:
            dist.recv(out, partner)
            dist.send(x, partner)
        check("single send/recv", out, partner, rnd)

# 5. A ring captured into a CUDA graph, replayed with new input each time: captured send/recv
#    are the daemon's persistent ops (a captured group must not become a direct kernel, whose
#    host-counted sequences would repeat at every replay), before and after eager direct ops.
n = 4099
gx = torch.empty(n, device=dev, dtype=torch.float32)
gout = torch.empty(n, device=dev, dtype=torch.float32)
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    gx.copy_(payload(rank, nxt, 1000, n, torch.float32))
    run([dist.P2POp(dist.isend, gx, nxt), dist.P2POp(dist.irecv, gout, prv)])
torch.cuda.current_stream().wait_stream(side)
check("ring before capture", gout, prv, 1000)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    run([dist.P2POp(dist.isend, gx, nxt), dist.P2POp(dist.irecv, gout, prv)])
for rnd in range(1001, 1011):
    gx.copy_(payload(rank, nxt, rnd, n, torch.float32))
    graph.replay()
    torch.cuda.synchronize()
    check("captured ring, replayed", gout, prv, rnd)
    # An eager direct op of the same pairs between replays.
    out = torch.empty(77, device=dev, dtype=torch.float32)
    run([dist.P2POp(dist.isend, payload(rank, nxt, rnd, 77, torch.float32), nxt),
         dist.P2POp(dist.irecv, out, prv)])
    check("eager ring between replays", out, prv, rnd)
del graph

torch.cuda.synchronize()
dist.barrier()
print(f"rank {rank}: {checks} checks, {len(failures)} failures "
      f"(COMMD_P2P_DIRECT={os.environ.get('COMMD_P2P_DIRECT', '')})", flush=True)
dist.destroy_process_group()
sys.exit(1 if failures else 0)
