"""vLLM's CUDA platform with commd as its torch.distributed backend and device communicator
(see :mod:`commd.vllm`). Importing it registers the ``"commd"`` backend, so every vLLM worker
that resolves this platform can create commd process groups."""

from __future__ import annotations

import commd.torch  # noqa: F401  (registers the "commd" torch.distributed backend)
from vllm.platforms.cuda import CudaPlatform


class CommdCudaPlatform(CudaPlatform):  # type: ignore[misc, valid-type]
    """CUDA, with vLLM's process groups on the ``"commd"`` backend and
    :class:`~commd.vllm.communicator.CommdCommunicator` for their device ops."""

    dist_backend: str = "commd"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "commd.vllm.communicator.CommdCommunicator"
