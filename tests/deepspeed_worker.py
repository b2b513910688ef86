"""One rank of a DeepSpeed training job, unchanged DeepSpeed code on CPU (its CPU accelerator;
`--cuda`: its CUDA accelerator, a GPU per local rank, for scripts/gpu-check.sh deepspeed),
for tests/test_deepspeed.py: `deepspeed.init_distributed(dist_backend=BACKEND)`, a small model
under `deepspeed.initialize` with the given ZeRO stage, a fixed number of steps on data that
depends only on the rank and step, then rank 0 writes the per-step losses and the full
parameters (gathered from their shards under ZeRO-3) as JSON.

    torchrun --nproc_per_node N tests/deepspeed_worker.py BACKEND STAGE OUT.json [--ga K] [--bf16]
        [--cuda] [--steps N] [--hidden H] [--batch B] [--bucket ELEMENTS]
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cuda" if "--cuda" in sys.argv else "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import commd.torch  # noqa: E402,F401  (registers the "commd" backend)
import deepspeed  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("backend")
    p.add_argument("stage", type=int)
    p.add_argument("out")
    p.add_argument("--ga", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bucket", type=int, default=2000)
    p.add_argument("--cuda", action="store_true")
    a = p.parse_args()
    device = torch.device("cpu")
    if a.cuda:
        # Ranks past the GPU count share GPUs (commd allows that; NCCL refuses it).
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)

    deepspeed.init_distributed(dist_backend=a.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == a.backend, dist.get_backend()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, a.hidden), torch.nn.ReLU(), torch.nn.Linear(a.hidden, a.hidden),
        torch.nn.ReLU(), torch.nn.Linear(a.hidden, 4))
    config = {
        "train_micro_batch_size_per_gpu": a.batch,
        "gradient_accumulation_steps": a.ga,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": a.stage, "reduce_bucket_size": a.bucket,
                              "allgather_bucket_size": a.bucket},
        "bf16": {"enabled": a.bf16},
        "steps_per_print": 1000,
    }
    if a.stage == 3:
        config["zero_optimization"].update(stage3_param_persistence_threshold=0,
                                           stage3_prefetch_bucket_size=a.bucket // 2)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    dtype = torch.bfloat16 if a.bf16 else torch.float32
    losses, times = [], []
    for step in range(a.steps):
        dist.barrier()
        if a.cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for micro in range(a.ga):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            x = torch.randn(a.batch, 32, generator=g).to(device, dtype)
            y = torch.randn(a.batch, 4, generator=g).to(device, dtype)
            loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
            engine.backward(loss)
            engine.step()
        if a.cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        l = loss.detach().float().clone()
        dist.all_reduce(l)
        losses.append(l.item() / world)
    params = []
    for prm in engine.module.parameters():
        with deepspeed.zero.GatheredParameters([prm], enabled=a.stage == 3):
            params.append(prm.detach().float().flatten().clone())
    flat = torch.cat(params)
    first = flat.clone()
    dist.broadcast(first, 0)
    assert torch.equal(first, flat), "ranks' parameters differ"
    if rank == 0:
        # Large models keep their parameters in a file of their own beside the JSON.
        big = flat.numel() > 2_000_000
        if big:
            torch.save(flat.cpu(), a.out + ".pt")
        with open(a.out, "w") as f:
            steady = sorted(times[2:] or times)
            json.dump({"backend": a.backend, "stage": a.stage, "world": world, "losses": losses,
                       "params": None if big else flat.cpu().tolist(),
                       "params_file": a.out + ".pt" if big else None,
                       "step_ms": 1e3 * steady[len(steady) // 2],
                       "step_ms_all": [1e3 * t for t in times], "numel": flat.numel()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
