#!/usr/bin/env python
"""Acceptance test: facebookresearch/dinov2's own training code (its files unchanged:
setup() -> dinov2.distributed.enable(), SSLMetaArch, its FSDP wrapping, build_optimizer, the body
of do_train) for N steps on synthetic images made by its own augmentation and collate code, a
tiny ViT-S/16 at 112 px. One JSON line per step (the losses); rank 0's records also go to
OUT/accept_losses.rank0.json for scripts/gpu-check.sh dinov2, which runs it on real NCCL and on
commd (NCCL's name with libcommd_nccl.so preloaded, and the "commd" backend name) and compares.

Launch (one process per rank), e.g.
    torchrun --nproc_per_node 2 tests/gpu/dinov2_accept.py --steps 10 --out /tmp/dinov2_out
Env:
    DINOV2_SRC           path holding the dinov2 package (git checkout), prepended to sys.path
    DINOV2_TEST_BACKEND  backend name forced into dinov2.distributed.enable()'s init_process_group
                         (dinov2 hard-codes backend="nccl", dinov2/distributed/__init__.py:264)
    DINOV2_SHARE_GPU=1   all ranks use cuda:0 (sets LOCAL_RANK=0, LOCAL_WORLD_SIZE=1 before enable())
    DINOV2_HANG_S=N      after N seconds, print every thread's Python stack and exit (a hang's
                         where, instead of a silent timeout)
Everything dinov2 does is dinov2's code; the only runtime shims (marked SHIM) work around
dinov2 <-> torch>=2.1 FSDP1 API drift, and (with --cpu) the lack of a GPU.
"""
import argparse
import json
import math
import os
import sys
import tempfile
import time
import warnings
from functools import partial

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=10)
p.add_argument("--out", default=None)
p.add_argument("--cpu", action="store_true", help="local validation on CPU/gloo (not for the GPU test)")
p.add_argument("--no-augment", action="store_true", help="random tensors instead of DataAugmentationDINO on random PIL images")
p.add_argument("--sharding", default="SHARD_GRAD_OP", choices=["SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"])
p.add_argument("--xformers", action="store_true", help="xformers' own attention kernels (needs a build for this torch)")
p.add_argument("opts", nargs="*", help="extra dinov2 config overrides, key=value")
a = p.parse_args()

if os.environ.get("DINOV2_HANG_S"):
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ["DINOV2_HANG_S"]), exit=True)
if os.environ.get("DINOV2_SRC"):
    sys.path.insert(0, os.environ["DINOV2_SRC"])
warnings.filterwarnings("ignore")  # xformers/torch deprecation chatter

import numpy as np
import torch
import torch.distributed as dist

BACKEND = os.environ.get("DINOV2_TEST_BACKEND", "gloo" if a.cpu else "nccl")
if BACKEND == "commd":
    import commd.torch  # noqa: F401  (registers the backend, as a job using it by name does)

# --- backend override: dinov2.distributed.enable() calls dist.init_process_group(backend="nccl")
_orig_init_pg = dist.init_process_group


def _init_pg(*args, **kw):
    kw["backend"] = BACKEND
    return _orig_init_pg(*args, **kw)


dist.init_process_group = _init_pg

# --- several ranks on one GPU: enable() does torch.cuda.set_device(LOCAL_RANK) and FSDP uses device_id=LOCAL_RANK
if os.environ.get("DINOV2_SHARE_GPU") == "1":
    os.environ["LOCAL_RANK"] = "0"
    os.environ["LOCAL_WORLD_SIZE"] = "1"

if a.cpu:  # ---- CPU-only shims (never used on the GPU run)
    torch.Tensor.cuda = lambda self, *x, **k: self  # ssl_meta_arch.py:137-145
    torch.cuda.set_device = lambda *x, **k: None  # distributed/__init__.py:255
    torch.cuda.synchronize = lambda *x, **k: None  # ssl_meta_arch.py:350
    import dinov2.train.ssl_meta_arch as _sma

    _orig_gw = _sma.get_fsdp_wrapper

    def _gw(model_cfg, modules_to_wrap=set()):  # fsdp/__init__.py:49-50: device_id=local_rank, sync_module_states=True
        f = _orig_gw(model_cfg, modules_to_wrap=modules_to_wrap)
        return partial(f.func, *f.args, **{**f.keywords, "device_id": torch.device("cpu"), "sync_module_states": False})

    _sma.get_fsdp_wrapper = _gw

if not a.xformers:  # ---- SHIM 3: attention through torch's SDPA instead of xformers' kernels
    # The xformers wheel carried to the GPU machines has no CUDA kernels for their torch (2.11:
    # "xFormers wasn't build with CUDA support"), and none run on CPU. dinov2 still
    # imports xformers (ssl_meta_arch.py requires it); only its attention call is replaced, with
    # the same math (softmax(QK^T/sqrt(d))V) on torch's own kernels.
    import dinov2.layers.attention as _dattn

    def _mea_sdpa(q, k, v, attn_bias=None, **kw):
        B, M, H, K = q.shape
        m = attn_bias.materialize((B, H, M, k.shape[1]), dtype=q.dtype, device=q.device) if attn_bias is not None else None
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=m
        )
        return o.transpose(1, 2)

    _dattn.memory_efficient_attention = _mea_sdpa

import dinov2.distributed as distributed
import dinov2.fsdp
from dinov2.data import DataAugmentationDINO, MaskingGenerator, collate_data_and_cast
from dinov2.train.ssl_meta_arch import SSLMetaArch
from dinov2.train.train import apply_optim_scheduler, build_optimizer, build_schedulers
from dinov2.utils.config import setup

# --- SHIM 1: dinov2/fsdp/__init__.py:65-69 uses FSDP1 internals of torch 2.0 (x._handles, _reshard(x, list, list));
#     torch>=2.1 has x._handle and _reshard(state, handle, free: bool). Same semantics, new API:
from torch.distributed.fsdp._runtime_utils import _reshard


def _free_if_fsdp(x):
    if dinov2.fsdp.is_sharded_fsdp(x) and x._handle is not None:
        _reshard(x, x._handle, True)


dinov2.fsdp.free_if_fsdp = _free_if_fsdp  # reshard_fsdp_model() looks it up in dinov2.fsdp's globals

# ---------------- config: dinov2's own setup() (OmegaConf merge, enable(), logging, seeds, lr scaling)
TINY = [
    "student.arch=vit_small",  # smallest predefined arch (384-d, 12 blocks, 6 heads, ~22M params)
    "student.patch_size=16",
    "student.block_chunks=4",  # as in configs/train/vitl16_short.yaml -> 4 FSDP units per backbone
    "student.drop_path_rate=0.0",  # >0 routes through xformers triton index_select_cat/scaled_index_add
    "crops.global_crops_size=112",  # 7x7 patches
    "crops.local_crops_size=48",  # 3x3 patches
    "crops.local_crops_number=2",
    "dino.head_n_prototypes=4096",
    "ibot.head_n_prototypes=4096",
    "dino.head_hidden_dim=512",
    "ibot.head_hidden_dim=512",
    "dino.head_bottleneck_dim=128",
    "ibot.head_bottleneck_dim=128",
    "train.batch_size_per_gpu=8",
    "train.num_workers=0",
    "train.OFFICIAL_EPOCH_LENGTH=10",
    "optim.epochs=10",
    "optim.warmup_epochs=1",
    "teacher.warmup_teacher_temp_epochs=1",
    "optim.freeze_last_layer_epochs=0",
    "evaluation.eval_period_iterations=0",
]
for who in ("student", "teacher"):
    for k in ("backbone", "dino_head", "ibot_head"):
        TINY.append(f"compute_precision.{who}.{k}.sharding_strategy={a.sharding}")
        if a.cpu:
            for d in ("param_dtype", "reduce_dtype", "buffer_dtype"):
                TINY.append(f"compute_precision.{who}.{k}.mixed_precision.{d}=fp32")
if a.cpu:
    TINY.append("compute_precision.grad_scaler=false")

src_dir = os.path.dirname(os.path.dirname(os.path.abspath(dinov2.__file__)))
out = a.out or tempfile.mkdtemp(prefix="dinov2_accept_")
args = argparse.Namespace(
    config_file=os.path.join(src_dir, "dinov2", "configs", "train", "vitl16_short.yaml"),
    opts=TINY + list(a.opts),
    output_dir=out,
    seed=0,
)
cfg = setup(args)  # -> dinov2.distributed.enable(overwrite=True) -> init_process_group(BACKEND); fix_random_seeds(rank)
rank, world = distributed.get_global_rank(), distributed.get_global_size()
assert world == int(os.environ["WORLD_SIZE"])

# ---------------- model / FSDP / optimizer: dinov2's own code (train.py:300-301, 141-148)
model = SSLMetaArch(cfg)
if not a.cpu:
    model = model.to(torch.device("cuda"))
model.prepare_for_distributed_training()  # FSDP1 wrap, sync_module_states=True (broadcast from rank 0)
# --- SHIM 2: ssl_meta_arch.py:348-354 reads FSDP1 ._streams (torch 2.0 only). Skip that one-time stream sharing
model.need_to_synchronize_fsdp_streams = False
model.train()
fp16_scaler = model.fp16_scaler
optimizer = build_optimizer(cfg, model.get_params_groups())
lr_s, wd_s, mom_s, tt_s, lll_s = build_schedulers(cfg)

# ---------------- data: dinov2's DataAugmentationDINO + MaskingGenerator + collate_data_and_cast (train.py:167-190)
img, ps = cfg.crops.global_crops_size, cfg.student.patch_size
mask_generator = MaskingGenerator(input_size=(img // ps, img // ps), max_num_patches=0.5 * img // ps * img // ps)
collate_fn = partial(
    collate_data_and_cast,
    mask_ratio_tuple=cfg.ibot.mask_ratio_min_max,
    mask_probability=cfg.ibot.mask_sample_probability,
    n_tokens=(img // ps) ** 2,
    mask_generator=mask_generator,
    dtype=torch.half,  # train.py:136
)
rng = np.random.default_rng(1234 + rank)
if a.no_augment:
    def make_sample():
        return ({"global_crops": [torch.from_numpy(rng.standard_normal((3, img, img), dtype=np.float32)) for _ in range(2)],
                 "local_crops": [torch.from_numpy(rng.standard_normal((3, cfg.crops.local_crops_size, cfg.crops.local_crops_size), dtype=np.float32))
                                 for _ in range(cfg.crops.local_crops_number)]}, ())
else:
    from PIL import Image

    transform = DataAugmentationDINO(
        cfg.crops.global_crops_scale, cfg.crops.local_crops_scale, cfg.crops.local_crops_number,
        global_crops_size=cfg.crops.global_crops_size, local_crops_size=cfg.crops.local_crops_size,
    )

    def make_sample():  # what make_dataset(transform=..., target_transform=lambda _: ()) yields
        return (transform(Image.fromarray(rng.integers(0, 256, (160, 160, 3), dtype=np.uint8))), ())

# ---------------- training steps: body of do_train (train.py:229-283)
records = []
for it in range(a.steps):
    data = collate_fn([make_sample() for _ in range(cfg.train.batch_size_per_gpu)])
    lr, wd, mom, teacher_temp, last_layer_lr = lr_s[it], wd_s[it], mom_s[it], tt_s[it], lll_s[it]
    apply_optim_scheduler(optimizer, lr, wd, last_layer_lr)
    if not a.cpu:
        torch.cuda.synchronize()
    t0 = time.time()
    optimizer.zero_grad(set_to_none=True)
    loss_dict = model.forward_backward(data, teacher_temp=teacher_temp)
    if fp16_scaler is not None:
        if cfg.optim.clip_grad:
            fp16_scaler.unscale_(optimizer)
            for v in model.student.values():
                v.clip_grad_norm_(cfg.optim.clip_grad)
        fp16_scaler.step(optimizer)
        fp16_scaler.update()
    else:
        if cfg.optim.clip_grad:
            for v in model.student.values():
                v.clip_grad_norm_(cfg.optim.clip_grad)
        optimizer.step()
    model.update_teacher(mom)
    if world > 1:
        for v in loss_dict.values():
            torch.distributed.all_reduce(v)
    loss_red = {k: v.item() / world for k, v in loss_dict.items()}
    if not a.cpu:
        torch.cuda.synchronize()
    dt = time.time() - t0
    total = sum(loss_red.values())
    rec = dict(step=it, total_loss=total, step_time_s=dt, **loss_red)
    if fp16_scaler is not None:
        rec["grad_scale"] = float(fp16_scaler.get_scale())
    records.append(rec)
    print(json.dumps(rec), flush=True)  # dinov2 restricts print() to rank 0 (distributed/__init__.py:74-87)
    if math.isnan(total):
        raise AssertionError("NaN loss")

with open(os.path.join(out, f"accept_losses.rank{rank}.json"), "w") as f:
    json.dump(records, f)
dist.barrier()
dist.destroy_process_group()
print(f"OK rank {rank}/{world}: {a.steps} steps, backend={BACKEND}, out={out}", force=True)
