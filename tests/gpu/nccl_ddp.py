"""A torch DDP job that names the "nccl" backend, unchanged, for a run with commd's libnccl.so.2
preloaded (`commd exec --` or LD_PRELOAD) and a reference run on another backend:

    torchrun --nproc_per_node 2 tests/gpu/nccl_ddp.py nccl OUT.json
    torchrun --nproc_per_node 2 tests/gpu/nccl_ddp.py gloo REF.json
    python3 tests/gpu/nccl_ddp.py --compare OUT.json REF.json

Ranks share GPUs round-robin (two ranks on one GPU is fine through commd; real NCCL refuses
it). Besides the DDP steps, each rank runs the c10d calls that reach other NCCL entry points
(broadcast, all_gather_into_tensor, reduce_scatter_tensor, batch_isend_irecv groups, a
new_group, barrier) and checks their results; rank 0 writes the per-step losses and a parameter
digest as JSON.
"""

import json
import os
import sys
import time


def compare(a_path, b_path):
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    worst = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a["losses"], b["losses"]))
    pw = max(abs(x - y) for x, y in zip(a["params_head"], b["params_head"]))
    print(f"{a['backend']} vs {b['backend']}: {len(a['losses'])} steps, largest relative loss "
          f"difference {worst:.3g}, parameter digest {a['param_sum']:.9g} vs {b['param_sum']:.9g}, "
          f"largest difference in the first parameters {pw:.3g}; step time "
          f"{a['step_ms']:.2f} vs {b['step_ms']:.2f} ms")
    assert len(a["losses"]) == len(b["losses"])
    assert worst <= 1e-5 and pw <= 1e-5, "the runs diverged"


def main(backend, out):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()

    if backend != "gloo":  # the reference backend lacks some of these for CUDA tensors
        other_calls(torch, dist, dev, rank, world)
    train(torch, dist, F, DDP, dev, rank, world, backend, out)


def other_calls(torch, dist, dev, rank, world):
    """The c10d calls other than DDP's all-reduce, each checked."""
    t = torch.full((1000,), float(rank), device=dev) if rank == 0 else torch.zeros(1000, device=dev)
    dist.broadcast(t, 0)
    assert t.eq(0).all()
    mine = torch.arange(8, device=dev, dtype=torch.float32) + 100 * rank
    gathered = torch.empty(8 * world, device=dev)
    dist.all_gather_into_tensor(gathered, mine)
    want = torch.cat([torch.arange(8, device=dev, dtype=torch.float32) + 100 * r for r in range(world)])
    assert torch.equal(gathered, want), gathered
    rs_in = torch.arange(4 * world, device=dev, dtype=torch.float32)
    rs_out = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(rs_out, rs_in)
    assert torch.equal(rs_out, world * torch.arange(4 * rank, 4 * rank + 4, device=dev, dtype=torch.float32))
    right, left = (rank + 1) % world, (rank - 1) % world
    sbuf = torch.full((256,), float(rank), device=dev)
    rbuf = torch.empty(256, device=dev)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, sbuf, right), dist.P2POp(dist.irecv, rbuf, left)]):
        w.wait()
    assert rbuf.eq(left).all()
    if dist.get_backend() == "nccl":
        # ReduceOp.PREMUL_SUM (FSDP2's gradient divide): ncclRedOpCreatePreMulSum with a host
        # scalar (a Python float) and with a device scalar (a one-element tensor).
        pm = torch.full((16,), float(rank + 1), device=dev)
        dist.all_reduce(pm, op=dist._make_nccl_premul_sum(0.5))
        assert torch.equal(pm, torch.full_like(pm, 0.5 * world * (world + 1) / 2)), pm
        scale = torch.tensor([2.0], device=dev)
        dist.reduce_scatter_tensor(rs_out, rs_in, op=dist._make_nccl_premul_sum(scale))
        want = 2 * world * torch.arange(4 * rank, 4 * rank + 4, device=dev, dtype=torch.float32)
        assert torch.equal(rs_out, want), rs_out
    sub = dist.new_group(list(range(world)))
    one = torch.ones(3, device=dev)
    dist.all_reduce(one, group=sub)
    assert one.eq(world).all()
    dist.barrier()


def train(torch, dist, F, DDP, dev, rank, world, backend, out):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
        torch.nn.Linear(512, 10)).to(dev)
    ddp = DDP(model, device_ids=[dev.index], bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1234 + rank)
    losses, times = [], []
    for step in range(40):
        x = torch.randn(64, 64, generator=g).to(dev)
        y = torch.randint(0, 10, (64,), generator=g).to(dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        l = loss.detach().clone()
        dist.all_reduce(l)
        losses.append(l.item() / world)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    first = params.clone()
    dist.broadcast(first, 0)
    assert torch.equal(first, params), "ranks' parameters differ"
    if rank == 0:
        times.sort()
        json.dump({"backend": backend, "world": world, "losses": losses,
                   "param_sum": params.double().sum().item(),
                   "params_head": params[:16].tolist(),
                   "step_ms": 1e3 * times[len(times) // 2]}, open(out, "w"))
        print(f"{backend}: {world} ranks, final loss {losses[-1]:.6f}, median step "
              f"{1e3 * times[len(times) // 2]:.2f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1], sys.argv[2])
