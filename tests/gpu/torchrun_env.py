"""The start shared by the GPU test scripts run under torchrun: bind this rank's GPU and join
the default process group with the commd backend. With more ranks than GPUs, ranks share GPUs
(local rank modulo the GPU count): commd allows that, NCCL does not."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import commd.torch  # noqa: F401  (registers the backend)


def start() -> tuple[int, int, torch.device]:
    """(rank, world size, this rank's device), after ``init_process_group("commd")``."""
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(local)
    dist.init_process_group("commd")
    return rank, world, torch.device("cuda", local)
