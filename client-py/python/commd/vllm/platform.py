"""vLLM's CUDA platform with commd as its torch.distributed backend and device communicator
(see :mod:`commd.vllm`). Importing it registers the ``"commd"`` backend, so every vLLM worker
that resolves this platform can create commd process groups."""

from __future__ import annotations

import logging
from typing import Any

import commd.torch  # noqa: F401  (registers the "commd" torch.distributed backend)
from vllm.platforms.cuda import CudaPlatform

logger = logging.getLogger("commd.vllm")

# vLLM's compile passes that replace its tensor-parallel collectives with kernels of their own
# (FlashInfer's or AITER's fused all-reduce + RMSNorm: on by default from -O2 on Hopper and
# Blackwell with FlashInfer installed), which would bypass commd.
_BYPASSING_PASSES = ("fuse_allreduce_rms",)


def keep_collectives_on_commd(vllm_config: Any) -> list[str]:
    """Turns off the compile passes that would replace vLLM's collectives with kernels that do
    not run on commd; returns the ones that were on (each logged)."""
    pc = vllm_config.compilation_config.pass_config
    off = [name for name in _BYPASSING_PASSES if getattr(pc, name, False)]
    for name in off:
        setattr(pc, name, False)
        logger.warning(
            "commd: vLLM's compile pass %s is turned off: it replaces the tensor-parallel "
            "all-reduce with a kernel of its own, and with COMMD_VLLM=1 every collective runs "
            "on commd", name)
    return off


class CommdCudaPlatform(CudaPlatform):  # type: ignore[misc, valid-type]
    """CUDA, with vLLM's process groups on the ``"commd"`` backend and
    :class:`~commd.vllm.communicator.CommdCommunicator` for their device ops."""

    dist_backend: str = "commd"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "commd.vllm.communicator.CommdCommunicator"

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        super().check_and_update_config(vllm_config)
        keep_collectives_on_commd(vllm_config)

    @classmethod
    def stateless_init_device_torch_dist_pg(cls, backend: str, prefix_store: Any,
                                            group_rank: int, group_size: int,
                                            timeout: Any) -> Any:
        # vLLM's CUDA platform builds NCCL here whatever `backend` says (elastic expert
        # parallelism's groups): refused by name rather than NCCL under commd's platform.
        raise NotImplementedError(
            "commd's vLLM platform: a stateless device process group (vLLM's elastic expert "
            "parallelism) would be NCCL's, not commd's: not supported with COMMD_VLLM=1")
