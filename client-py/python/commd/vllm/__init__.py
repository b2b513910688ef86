"""commd for vLLM: a platform plugin whose device communicator runs vLLM's collectives through
the node's commd daemon (tensor-parallel all-reduce in CUDA graphs included).

Off unless asked for: installing commd never changes a vLLM deployment by itself. Turn it on in
the environment of the vLLM server (its workers inherit it)::

    COMMD_VLLM=1 vllm serve MODEL --tensor-parallel-size 2

vLLM finds :func:`platform_plugin` through the ``vllm.platform_plugins`` entry point; with
``COMMD_VLLM=1`` it names :class:`commd.vllm.platform.CommdCudaPlatform`, vLLM's CUDA platform with
``dist_backend = "commd"`` and :class:`commd.vllm.communicator.CommdCommunicator` as its device
communicator. An out-of-tree platform wins over vLLM's built-in CUDA one; another out-of-tree
platform plugin active at the same time is an error in vLLM (``VLLM_PLUGINS`` picks plugins by
name). Supported: vLLM 0.33 (checked in CI against vllm==0.33.0's own classes).

This module is imported by vLLM's plugin loader in every process, GPU or not: it imports neither
torch nor vLLM.
"""

from __future__ import annotations

from .. import _settings

ENV = "COMMD_VLLM"
PLATFORM = "commd.vllm.platform.CommdCudaPlatform"

_ON = ("1", "on", "true", "yes")
_OFF = ("", "0", "off", "false", "no")


def enabled() -> bool:
    """Whether ``COMMD_VLLM`` asks for the commd platform (ValueError for an unknown value)."""
    v = _settings.get(ENV).lower()
    if v in _ON:
        return True
    if v in _OFF:
        return False
    raise ValueError(f"{ENV}={_settings.raw(ENV)!r}: expected 1 (use commd for vLLM's "
                     "collectives) or 0 (vLLM's own)")


def platform_plugin() -> str | None:
    """The ``vllm.platform_plugins`` entry point: commd's platform class, or None (vLLM then
    picks its own platform) when ``COMMD_VLLM`` is not set."""
    return PLATFORM if enabled() else None
