"""DDP training step with communication overlapped: "commd" vs NCCL (GPU) or gloo (CPU), the
same model and data.

    torchrun --nproc_per_node 4 client-py/benchmarks/ddp_overlap.py \\
        [--layers 8] [--dim 1024] [--batch 8] [--seq 1024] [--steps 30] [--json out.jsonl]
    torchrun --nproc_per_node 4 client-py/benchmarks/ddp_overlap.py --device cpu \\
        --layers 4 --dim 1024 --vocab 8192 --batch 1 --seq 32 --steps 10

``--device cpu``: the model on the CPU in fp32 (no autocast), the peer is gloo, steps are timed
with the wall clock, and each rank runs torch with ``--threads`` threads (default: the
machine's cores divided among the local ranks). The gradient buckets are ordinary tensors, so
commd runs them in place through its CPU allocator.

A decoder-style transformer built from ``torch.nn`` (``--layers`` pre-norm
``TransformerEncoderLayer``s of width ``--dim``, 4x MLP, causal mask, token embedding and a tied
output head), fp32 parameters under bf16 autocast, wrapped in
``torch.nn.parallel.DistributedDataParallel`` with its default gradient buckets (25 MiB), so
bucket all-reduces run during the backward pass beside its GEMMs (the goal: a DDP step with
communication overlapped, no slower than on NCCL). Two replicas of the model start from
the same seed: one wrapped on the default ("commd") group, one on ``dist.new_group(backend=
"nccl")``; each step feeds both the same batch (different per rank), and the steps alternate
between the two in blocks of ``--block`` so clocks and power drift affect both alike.

Reported (rank 0): median and mean step time per backend (CUDA events around forward, backward
and SGD step; ``--warmup`` steps not counted), the same step of a third replica with no
communication at all (the compute floor: what overlap can at best hide), the ratio commd/NCCL, the gradient bytes
all-reduced per step, and the largest relative loss difference between the two replicas over
the steps (the reductions may sum in a different order, so bf16-level differences are
expected; the run fails if it exceeds ``--loss-rtol``). ``--json`` appends one line.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import bench_common as bc  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30, help="measured steps per backend")
    p.add_argument("--warmup", type=int, default=5, help="uncounted steps per backend first")
    p.add_argument("--block", type=int, default=5, help="steps per backend before switching")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--loss-rtol", type=float, default=0.02,
                   help="largest relative loss difference between the backends that passes")
    p.add_argument("--json", default="", help="append one JSON line here (rank 0)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: vs NCCL, bf16 autocast; cpu: vs gloo, fp32")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank on --device cpu (0: cores / local ranks)")
    a = p.parse_args(argv)
    if min(a.layers, a.dim, a.batch, a.seq, a.steps, a.block) < 1 or a.warmup < 0:
        p.error("sizes and counts must be positive")
    if a.threads < 0:
        p.error("--threads must be 0 (automatic) or more")
    if a.dim % a.heads:
        p.error("--dim must be a multiple of --heads")
    return a


class Clock:
    """A step's time: CUDA events on the GPU, the wall clock on the CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        if cuda:
            self.start, self.end = (torch.cuda.Event(enable_timing=True),
                                    torch.cuda.Event(enable_timing=True))
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def ms(self) -> float:
        if not self.cuda:
            return (time.perf_counter() - self.t0) * 1e3
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end)


class Decoder(nn.Module):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.emb = nn.Embedding(a.vocab, a.dim)
        nn.init.normal_(self.emb.weight, std=0.02)
        layer = nn.TransformerEncoderLayer(a.dim, a.heads, 4 * a.dim, dropout=0.0,
                                           activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, a.layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(a.dim)
        self.seq = a.seq

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(self.seq, device=tokens.device)
        h = self.blocks(self.emb(tokens), mask=mask, is_causal=True)
        return self.norm(h) @ self.emb.weight.t()


def main() -> None:
    a = parse()
    cuda = a.device == "cuda"
    if cuda:
        rank, world, dev, groups, info, say = bc.start_vs_nccl("ddp_overlap.py")
    else:
        rank, world, dev, groups, info, say = bc.start_vs_gloo("ddp_overlap.py", a.threads)
    peer = "nccl" if cuda else "gloo"

    models, opts = {}, {}
    for name, pg in groups.items():
        torch.manual_seed(1234)
        m = Decoder(a).to(dev)
        models[name] = DDP(m, device_ids=[dev.index] if cuda else None, process_group=pg)
        opts[name] = torch.optim.SGD(models[name].parameters(), lr=a.lr)
    # The same step with no communication at all (a plain module): the compute floor.
    torch.manual_seed(1234)
    models["compute only"] = Decoder(a).to(dev)
    opts["compute only"] = torch.optim.SGD(models["compute only"].parameters(), lr=a.lr)
    runs = list(models)
    n_params = sum(p.numel() for p in models["commd"].parameters())
    grad_bytes = 4 * n_params
    where = (f"{world} x {info['gpu']}; torch {info['torch']}; NCCL {info['nccl']}" if cuda else
             f"{world} ranks on {info['cpu']} ({os.cpu_count()} cores, {torch.get_num_threads()} "
             f"threads per rank); torch {info['torch']}")
    say(f"# DDP overlap: {where}; commit {info['commit']}; {info['date']}; model {a.layers} "
        f"layers x {a.dim}, {n_params / 1e6:.1f}M parameters ({bc.human_bytes(grad_bytes)} of "
        f"fp32 gradients per step); batch {a.batch} x {a.seq} tokens per rank; "
        f"{'bf16 autocast' if cuda else 'fp32'}")

    gen = torch.Generator(device=dev).manual_seed(99 + rank)
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    total = a.warmup + a.steps
    done = {k: 0 for k in runs}
    batches: list[torch.Tensor] = []
    while min(done.values()) < total:
        for name in runs:
            for _ in range(a.block):
                i = done[name]
                if i >= total:
                    break
                if i == len(batches):
                    batches.append(torch.randint(0, a.vocab, (a.batch, a.seq), device=dev,
                                                 generator=gen))
                tok = batches[i]
                m, opt = models[name], opts[name]
                clock = Clock(cuda)
                with torch.autocast(a.device, dtype=torch.bfloat16, enabled=cuda):
                    logits = m(tok)
                    loss = nn.functional.cross_entropy(
                        logits[:, :-1].reshape(-1, a.vocab).float(),
                        tok[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                if i >= a.warmup:
                    times[name].append(clock.ms())
                losses[name].append(float(loss.detach()))
                done[name] += 1
    # The ranks' mean loss per step, so the comparison covers every rank's data.
    lt = torch.tensor([losses["commd"], losses[peer]], device=dev, dtype=torch.float64)
    dist.all_reduce(lt, group=groups[peer])
    lt /= world
    diff = max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(lt[0].tolist(), lt[1].tolist()))
    ms = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    say("| backend | median ms/step | mean ms/step | first loss | last loss |")
    say("|---|---:|---:|---:|---:|")
    for j, k in enumerate(groups):
        say(f"| {k} | {ms[k]:.2f} | {mean[k]:.2f} | {lt[j][0]:.4f} | {lt[j][-1]:.4f} |")
    k = "compute only"
    say(f"| {k} (no all-reduce) | {ms[k]:.2f} | {mean[k]:.2f} | - | - |")
    ratio = ms["commd"] / ms[peer]
    say(f"commd/{peer} step time (median): {ratio:.3f}; largest relative loss difference "
        f"{diff:.2e} (limit {a.loss_rtol:g})")
    ok = diff <= a.loss_rtol
    if rank == 0 and a.json:
        bc.append_jsonl(a.json, [{
            "bench": "ddp_overlap", "world": world, "layers": a.layers, "dim": a.dim,
            "params": n_params, "grad_bytes": grad_bytes, "batch": a.batch, "seq": a.seq,
            "steps": a.steps, "device": a.device, "peer": peer, "median_ms": ms,
            "mean_ms": mean, "ratio": ratio, "loss_rel_diff": diff,
            "losses_commd": lt[0].tolist(), f"losses_{peer}": lt[1].tolist(), "ok": ok,
            **info}])
    dist.barrier(group=groups[peer])
    dist.destroy_process_group()
    if not ok:
        say(f"FAIL: the losses differ by {diff:.2e} (more than {a.loss_rtol:g})")
        sys.exit(1)


if __name__ == "__main__":
    main()
