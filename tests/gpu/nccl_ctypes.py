"""The NCCL C API through ctypes, as vLLM's pynccl calls it (tests/gpu/nccl_pynccl.py,
tests/gpu/nccl_p2p_mismatch.py): the library, its error check, and a unique id made by rank 0
and broadcast over the default (gloo) process group."""

from __future__ import annotations

import ctypes
import os

import torch
import torch.distributed as dist


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    lib.ncclGetLastError.restype = ctypes.c_char_p
    return lib


def check(lib: ctypes.CDLL, r: int, what: str) -> None:
    if r != 0:
        raise RuntimeError(f"{what}: {lib.ncclGetErrorString(r).decode()}: "
                           f"{lib.ncclGetLastError(None).decode()}")


def unique_id(lib: ctypes.CDLL, rank: int) -> UniqueId:
    uid = UniqueId()
    if rank == 0:
        check(lib, lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    t = torch.tensor(bytearray(bytes(uid.internal)), dtype=torch.uint8)
    dist.broadcast(t, 0)
    ctypes.memmove(ctypes.addressof(uid), bytes(t.tolist()), 128)
    return uid


def job() -> tuple[ctypes.CDLL, torch.device, int, int]:
    """A test rank under torchrun: the library at COMMD_NCCL_LIB, this rank's GPU (ranks may
    share one) made current, and the default (gloo) group for unique ids: (lib, device, rank,
    world size)."""
    lib = load(os.environ["COMMD_NCCL_LIB"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    dist.init_process_group("gloo")
    return lib, dev, dist.get_rank(), dist.get_world_size()
