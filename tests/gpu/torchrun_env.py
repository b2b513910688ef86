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


def direct_limit(world: int, var: str = "COMMD_EAGER_DIRECT_MAX_BYTES") -> int:
    """The largest direct all-reduce, broadcast or reduce in bytes per rank: ``var`` when set
    (``COMMD_EAGER_DIRECT_MAX_BYTES`` or ``COMMD_GRAPH_DIRECT_MAX_BYTES``), else the library's
    default (``direct::default_max_bytes``: 16 MiB on 2 ranks, else the power of two at most
    8 MiB / (world - 1), 4 MiB at most)."""
    if int(os.environ.get(var, "0") or 0):
        return int(os.environ[var])
    if world == 2:
        return 16 << 20
    return min(4 << 20, 1 << ((8 << 20) // (world - 1)).bit_length() - 1)


def split_share(world: int, var: str = "COMMD_EAGER_DIRECT_MAX_BYTES") -> int:
    """The largest share (bytes per rank) of an all-reduce, broadcast or reduce split into
    direct ops past the direct limit: ``var`` when set (every limit), else the library's default
    (``direct::default_share_bytes``: 8 MiB on 2 ranks, else the power of two at most
    32 MiB / world)."""
    if int(os.environ.get(var, "0") or 0):
        return int(os.environ[var])
    if world == 2:
        return 8 << 20
    return 1 << ((32 << 20) // world).bit_length() - 1


def push_limit(world: int, var: str = "COMMD_EAGER_DIRECT_MAX_BYTES") -> int:
    """The largest direct all-gather, all-to-all or reduce-scatter, bytes per rank and peer:
    ``var`` when set (every limit), else the library's default (``direct::default_push_bytes``:
    the power of two at most 24 MiB / (world - 1) and 8 MiB; a reduce-scatter takes the larger
    of it and ``direct_limit``, the same on 2 ranks)."""
    if int(os.environ.get(var, "0") or 0):
        return int(os.environ[var])
    return 1 << min(8 << 20, (24 << 20) // (world - 1)).bit_length() - 1
