"""The arguments of the ``commd`` torch backend's ops: tensor checks, numpy views of CPU
tensors, the daemon's names for dtypes and reductions (``ReduceOp.PREMUL_SUM`` resolved first),
row splits of uneven all-to-alls, and send/recv tags. They keep no state but the flag of the
tag message, said once per process. Used by ``commd.torch``; does not import it."""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import numpy as np
import torch
from torch._C._distributed_c10d import ReduceOp

from . import _core
from ._torch_cuda import _COMPLEX, _REAL, check_overlap

_REDUCE_DTYPES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.bool: "u8",
}
# Unsigned and fp8 dtypes where this torch has them (fp8: the OCP formats NCCL reduces; the
# "fnuz" variants encode differently and are moved, never reduced).
for _name, _code in (("uint32", "u32"), ("uint64", "u64"), ("float8_e4m3fn", "f8e4m3"),
                     ("float8_e5m2", "f8e5m2")):
    if hasattr(torch, _name):
        _REDUCE_DTYPES[getattr(torch, _name)] = _code

_REDOPS = {
    ReduceOp.RedOpType.SUM: "sum",
    ReduceOp.RedOpType.PRODUCT: "prod",
    ReduceOp.RedOpType.MIN: "min",
    ReduceOp.RedOpType.MAX: "max",
    ReduceOp.RedOpType.AVG: "avg",
    ReduceOp.RedOpType.BAND: "band",
    ReduceOp.RedOpType.BOR: "bor",
    ReduceOp.RedOpType.BXOR: "bxor",
}

# The largest finite value of each fp8 dtype commd reduces.
_FP8_MAX = {getattr(torch, n): m for n, m in (("float8_e4m3fn", 448.0), ("float8_e5m2", 57344.0))
            if hasattr(torch, n)}

# Same-size integer views for dtypes numpy lacks (pure data movement needs only the bytes).
_BYTE_VIEWS = {torch.bfloat16: torch.int16, torch.bool: torch.uint8}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BYTE_VIEWS[getattr(torch, _name)] = torch.uint8


def _check_tensor(t: torch.Tensor, what: str, cuda: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"commd {what}: expected a tensor, got {type(t).__name__}")
    want = "cuda" if cuda else "cpu"
    if t.device.type != want:
        raise ValueError(
            f"commd {what}: tensor on {t.device}, expected {want} like the op's other tensors "
            "(supported: CPU and CUDA tensors, not mixed within one op)")
    if t.is_sparse:
        raise ValueError(f"commd {what}: sparse tensors are not supported")
    check_overlap(t, what)


_TAG_WARNED = False


def _tag_ignored(tag: int) -> None:
    """commd pairs a rank's messages to a peer in order, as NCCL does; gloo pairs them by tag.
    Said once per process when a tag is given, so a program that relies on tags is told."""
    global _TAG_WARNED
    if tag and not _TAG_WARNED:
        _TAG_WARNED = True
        print(f"commd: send/recv tags are ignored (tag {tag}): each receive takes the next "
              "message from its peer in the order they were sent, as with NCCL (gloo matches "
              "tags)", file=sys.stderr, flush=True)


def _is_cuda(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.is_cuda


def _sync(opts: Any) -> bool:
    """Whether torch waits for the op at once (``async_op=False``): such GPU ops run on the
    current stream itself."""
    return not getattr(opts, "asyncOp", True)


_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
              torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16,
              torch.int32: np.int32, torch.int64: np.int64}
for _name, _npt in (("uint16", np.uint16), ("uint32", np.uint32), ("uint64", np.uint64)):
    if hasattr(torch, _name):
        _NP_DTYPES[getattr(torch, _name)] = _npt


def _np(t: torch.Tensor, what: str = "op") -> np.ndarray:
    """A numpy view of ``t`` (no copy, strides kept), with a same-size integer dtype where
    numpy has no equivalent.

    Made over the tensor's memory by address, not with ``Tensor.numpy()``: that marks the
    tensor's storage as never resizable, for good, and FSDP frees its unsharded parameters by
    resizing their storage to 0 after an all-gather ("Trying to resize storage that is not
    resizable"). The view holds a reference to the tensor, so its memory lives as long as the
    view does."""
    _check_tensor(t, what)
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    v = _BYTE_VIEWS.get(t.dtype)
    if v is not None:
        t = t.view(v)
    dt = _NP_DTYPES.get(t.dtype)
    if dt is None:
        raise ValueError(f"commd {what}: unsupported tensor dtype {t.dtype}")
    shape = tuple(t.shape)
    if t.numel() == 0:
        return np.empty(shape, dtype=dt)
    es = t.element_size()
    span = 1 + sum((n - 1) * st for n, st in zip(shape, t.stride()))
    raw = (ctypes.c_char * (span * es)).from_address(t.data_ptr())
    raw.tensor = t  # the view keeps the tensor's memory alive, as Tensor.numpy() does
    base = np.frombuffer(raw, dtype=dt, count=span)
    return np.lib.stride_tricks.as_strided(base, shape=shape,
                                           strides=tuple(st * es for st in t.stride()))


def _reduce_args(t: torch.Tensor, op: Any, what: str) -> tuple[np.ndarray, str, str]:
    """(array, daemon dtype name, daemon reduction name) for a reduction over ``t``."""
    dt, red = _reduce_names(t, op, what)
    return _np(t, what), dt, red


def _premul(t: torch.Tensor, op: Any, what: str, copy: bool) -> tuple[torch.Tensor, Any]:
    """``ReduceOp.PREMUL_SUM(f)`` as NCCL defines it (FSDP2 uses it for its gradient divide
    factor): every rank's input times ``f``, then summed. Returns the tensor to reduce, ``t``
    scaled in place, or a scaled copy when ``copy`` (an input the op must not change), and SUM;
    any other op comes back as it was."""
    kind = getattr(op, "op", op)
    if kind != ReduceOp.RedOpType.PREMUL_SUM:
        return t, op
    f = getattr(op, "factor", None)
    if f is None:  # torch without ReduceOp.factor: the pickled form is (op, factor)
        f = op.__getstate__()[1]
    if isinstance(f, torch.Tensor):
        if f.numel() != 1:
            raise ValueError(f"commd {what}: PREMUL_SUM needs a one-element factor, got "
                             f"{f.numel()} elements")
        # A 0-dim factor: a [1] one would not broadcast into a 0-dim tensor in place.
        f = f.reshape(()).to(t.device)
    # Checked before the tensor is scaled in place (a refusal then leaves it as it was).
    _reduce_names(t, ReduceOp.SUM, what)
    fp8_max = _FP8_MAX.get(t.dtype)
    if fp8_max is not None:
        # torch has no fp8 arithmetic: the product in float32, rounded once into the fp8 type
        # and saturated to its largest finite value, as NCCL's fp8 PreMulSum stores it (clamp
        # keeps NaNs).
        with torch.no_grad():
            s = torch.mul(t.float(), f).clamp_(-fp8_max, fp8_max).to(t.dtype)
            if not copy:
                s = t.copy_(s)
    elif t.is_complex() or t.is_floating_point():
        with torch.no_grad():
            s = torch.mul(t, f) if copy else t.mul_(f)
    else:
        raise ValueError(f"commd {what}: PREMUL_SUM needs a floating-point tensor, got {t.dtype}")
    return s, ReduceOp.SUM


def _reduce_names(t: torch.Tensor, op: Any, what: str) -> tuple[str, str]:
    """(daemon dtype name, daemon reduction name) for a reduction over ``t``."""
    _check_tensor(t, what, _is_cuda(t))
    kind = getattr(op, "op", op)
    if kind == ReduceOp.RedOpType.PREMUL_SUM:  # (the ops resolve it with _premul first)
        raise ValueError(f"commd {what}: PREMUL_SUM here is an internal error")
    name = _REDOPS.get(kind)
    if name is None:
        raise ValueError(f"commd {what}: unsupported reduction {op}")
    if t.is_complex():
        if name not in ("sum", "avg"):
            raise ValueError(f"commd {what}: reduction {name} is not defined for complex tensors")
        dt = {torch.complex64: "f32", torch.complex128: "f64"}.get(t.dtype)
        if dt is None:
            raise ValueError(f"commd {what}: unsupported tensor dtype {t.dtype}")
        return dt, name
    dt = _REDUCE_DTYPES.get(t.dtype)
    if dt is None:
        raise ValueError(
            f"commd {what}: cannot reduce {t.dtype} tensors (supported: float32, float64, "
            "float16, bfloat16, float8_e4m3fn, float8_e5m2, int8, uint8, int32, int64, uint32, "
            "uint64, bool, complex64/128 for sum/avg)")
    return dt, _core._redop(name, dt, t.dtype == torch.bool)


def _move_dt(t: torch.Tensor) -> str | None:
    """The daemon's dtype name for moving ``t`` (as ``_np(t)`` counts elements), so metrics and
    traces show the tensor's real dtype (the GPU path's names); None (bytes, as u8) where commd
    has no such dtype."""
    return _REAL.get(t.dtype) or _COMPLEX.get(t.dtype)


def _one(tensors: list[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"commd {what}: expected one tensor per process, got {len(tensors)}")
    return tensors[0]


def _split_t(t: torch.Tensor, splits: list[int], n: int, side: str,
             what: str) -> list[torch.Tensor]:
    """Rows of ``t`` split by ``splits`` (equal split when empty)."""
    rows = t.shape[0] if t.dim() > 0 else 0
    if not splits:
        if rows % n:
            raise ValueError(f"commd {what}: {side} has {rows} rows, not divisible by {n}")
        splits = [rows // n] * n
    if len(splits) != n or sum(splits) != rows or any(s < 0 for s in splits):
        raise ValueError(f"commd {what}: {side} split sizes {splits} do not cover {rows} rows "
                         f"in {n} parts")
    return list(torch.split(t, splits, dim=0))


def _check_same(t: torch.Tensor, like: torch.Tensor, what: str) -> None:
    _check_tensor(t, what, _is_cuda(like))
    if t.dtype != like.dtype or t.numel() != like.numel():
        raise ValueError(f"commd {what}: tensor of {t.numel()} x {t.dtype} does not match "
                         f"{like.numel()} x {like.dtype}")


def _check_sizes(big: torch.Tensor, small: torch.Tensor, n: int, what: str) -> None:
    cuda = _is_cuda(big)
    _check_tensor(big, what, cuda)
    _check_tensor(small, what, cuda)
    if big.dtype != small.dtype or big.numel() != n * small.numel():
        raise ValueError(f"commd {what}: expected {n} x {small.numel()} elements of "
                         f"{small.dtype}, got {big.numel()} of {big.dtype}")


def _split_rows(a: np.ndarray, splits: list[int], n: int, side: str,
                what: str) -> list[np.ndarray]:
    rows = a.shape[0] if a.ndim else 1
    if not splits:
        if rows % n:
            raise ValueError(f"commd {what}: {side} has {rows} rows, not divisible by {n}")
        splits = [rows // n] * n
    if len(splits) != n or any(s < 0 for s in splits) or sum(splits) != rows:
        raise ValueError(f"commd {what}: {side} split sizes {list(splits)} must be {n} "
                         f"non-negative numbers summing to {rows}")
    out, off = [], 0
    for s in splits:
        out.append(a[off:off + s])
        off += s
    return out
