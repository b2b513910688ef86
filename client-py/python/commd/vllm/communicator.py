"""vLLM's device communicator on commd (see :mod:`commd.vllm`).

It subclasses vLLM's ``CudaCommunicator`` because ``GroupCoordinator.graph_capture()`` asserts
that class, but not its construction: vLLM's own paths (PyNCCL, custom all-reduce, symmetric
memory, FlashInfer) stay unbuilt, so no op silently takes NCCL or a path commd does not know.
Every op goes through ``torch.distributed`` on the group's device group, a ``"commd"`` process
group: stream-ordered GPU ops, and CUDA-graph capturable (a captured op becomes a persistent
commd op that runs on every replay with no CPU work per replay; a lost rank or daemon fails the
replay with commd's error naming the rank, never a hang or a stale result).

How each vLLM op maps, chosen once and logged at the first use of each op:
- ``all_reduce``: an out-of-place commd all-reduce (vLLM's custom ops are declared out of place);
- ``all_gather``, ``reduce_scatter``, ``gather``, ``send``, ``recv``, ``broadcast``: vLLM's
  generic ``torch.distributed`` forms on the commd group;
- ``all_gatherv`` (uneven sizes): a commd all-gather of inputs padded to the largest size, then the
  rows of each rank; ``reduce_scatterv`` (uneven sizes): a commd all-reduce, then this rank's rows
  (more bytes than NCCL's reduce-scatter, never a wrong result);
- ``batch_isend_irecv``: ``torch.distributed.batch_isend_irecv`` on the commd group.
MoE dispatch/combine (``use_all2all``: data parallelism > 1, or expert parallelism) with
``all2all_backend`` ``allgather_reducescatter`` (vLLM's default) or ``naive``: vLLM's own
all-gather/reduce-scatter manager, whose ops are the ``all_gatherv``/``reduce_scatterv`` above;
any other backend (DeepEP, FlashInfer, Mori, ...: their own kernels and transports) raises at
construction, naming it. A vLLM method this class does not know (another vLLM version than the
0.33 it follows) raises NotImplementedError instead of running vLLM's PyNCCL path.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

# vLLM's all-to-all backends that commd can run: vLLM's manager built on all_gatherv and
# reduce_scatterv (this class's).
_AGRS = ("allgather_reducescatter", "naive")

logger = logging.getLogger("commd.vllm")

# vLLM's own communicators, read by vLLM code outside the class (graph_capture reads ca_comm and
# fi_pcie_ipc_ar_comm): present and None.
_VLLM_PATHS = ("pynccl_comm", "ca_comm", "qr_comm", "symm_mem_comm", "fi_ar_comm",
               "fi_pcie_ipc_ar_comm", "aiter_ar_comm")
_VLLM_FLAGS = ("use_custom_allreduce", "use_torch_symm_mem", "use_flashinfer_allreduce",
               "use_flashinfer_pcie_ipc_allreduce", "use_aiter_allreduce", "use_aiter_ag_rs")


class CommdCommunicator(CudaCommunicator):  # type: ignore[misc, valid-type]
    """vLLM's device communicator with every op on the commd daemon."""

    def __init__(self, cpu_group: Any, device: torch.device | None = None,
                 device_group: Any = None, unique_name: str = "",
                 global_ranks: list[int] | None = None, global_world_size: int | None = None,
                 tcp_store_group: Any = None, use_all2all: bool = False) -> None:
        DeviceCommunicatorBase.__init__(
            self, cpu_group, device, device_group, unique_name,
            global_ranks=global_ranks, global_world_size=global_world_size,
            use_all2all=use_all2all)
        if self.use_all2all:
            if self.all2all_backend not in _AGRS:
                raise NotImplementedError(
                    f"commd's vLLM communicator ({unique_name}): all2all_backend="
                    f"{self.all2all_backend!r} runs its own kernels and transports, not "
                    f"commd's; use all2all_backend='allgather_reducescatter' (vLLM's default) "
                    "or run without COMMD_VLLM=1 (MoE dispatch and combine are used when "
                    "data_parallel_size > 1 or with expert parallelism)")
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

            self.all2all_manager = AgRsAll2AllManager(self.cpu_group, tcp_store_group)
        for name in _VLLM_PATHS:
            setattr(self, name, None)
        for name in _VLLM_FLAGS:
            setattr(self, name, False)
        self._logged: set[str] = set()
        if device_group is not None and dist.get_backend(device_group) != "commd":
            raise ValueError(
                f"commd's vLLM communicator ({unique_name}): the device group uses the "
                f"{dist.get_backend(device_group)!r} backend, not 'commd' (was commd.torch "
                "imported before init_distributed_environment?)")

    def _once(self, op: str, how: str) -> None:
        if op not in self._logged:
            self._logged.add(op)
            logger.info("commd vLLM %s: %s on %s (%d ranks)", self.unique_name, op, how,
                        self.world_size)

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        self._once("all_reduce", "an out-of-place commd all-reduce")
        out = input_.clone()
        dist.all_reduce(out, group=self.device_group)
        return out

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._once("all_gather", "commd all_gather_into_tensor")
        return DeviceCommunicatorBase.all_gather(self, input_, dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self._once("reduce_scatter", "commd reduce_scatter_tensor")
        # The scattered axis moved to the front and back (vLLM's own moves axis 0 to `dim`
        # instead, the same thing for 2-D tensors only: on 3+ dims it scattered another axis).
        if dim < 0:
            dim += input_.dim()
        rows = input_.movedim(dim, 0).contiguous()
        if rows.shape[0] % self.world_size:
            raise ValueError(f"commd reduce_scatter: dim {dim} has {rows.shape[0]} elements, "
                             f"not divisible by {self.world_size} ranks")
        out = rows.new_empty((rows.shape[0] // self.world_size, *rows.shape[1:]))
        dist.reduce_scatter_tensor(out, rows, group=self.device_group)
        return out.movedim(0, dim).contiguous()

    def all_gatherv(self, input_: torch.Tensor | list[torch.Tensor], dim: int = 0,
                    sizes: list[int] | None = None) -> torch.Tensor | list[torch.Tensor]:
        if dim != 0:
            raise NotImplementedError("commd all_gatherv: only dim 0 (as vLLM's own)")
        if sizes is not None and len(sizes) != self.world_size:
            raise ValueError(f"commd all_gatherv: {len(sizes)} sizes for {self.world_size} ranks")
        if sizes is not None and all(s == sizes[0] for s in sizes):
            sizes = None
        if isinstance(input_, torch.Tensor):
            return self._all_gatherv_one(input_, sizes)
        return [self._all_gatherv_one(t, sizes) for t in input_]

    def _all_gatherv_one(self, t: torch.Tensor, sizes: list[int] | None) -> torch.Tensor:
        if sizes is None:
            return DeviceCommunicatorBase.all_gather(self, t, 0)
        if t.shape[0] != sizes[self.rank_in_group]:
            raise ValueError(f"commd all_gatherv: this rank's input has {t.shape[0]} rows, "
                             f"sizes says {sizes[self.rank_in_group]}")
        self._once("all_gatherv", "a commd all-gather of inputs padded to the largest size")
        most = max(sizes)
        pad = t.new_zeros((most, *t.shape[1:]))
        pad[: t.shape[0]] = t
        out = t.new_empty((most * self.world_size, *t.shape[1:]))
        dist.all_gather_into_tensor(out, pad, group=self.device_group)
        return torch.cat([out[r * most: r * most + n] for r, n in enumerate(sizes)])

    def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1,
                        sizes: list[int] | None = None) -> torch.Tensor:
        return self._reduce_scatterv(input_, dim, sizes)

    def reduce_scatterv_into_output(self, input_: torch.Tensor, output: torch.Tensor,
                                    dim: int = -1, sizes: list[int] | None = None
                                    ) -> torch.Tensor:
        return _into(output, self._reduce_scatterv(input_, dim, sizes), "reduce_scatterv")

    def _reduce_scatterv(self, input_: torch.Tensor, dim: int, sizes: list[int] | None,
                         output: torch.Tensor | None = None) -> torch.Tensor:
        if sizes is not None and len(sizes) != self.world_size:
            raise ValueError(f"commd reduce_scatterv: {len(sizes)} sizes for "
                             f"{self.world_size} ranks")
        if sizes is None or all(s == sizes[0] for s in sizes):
            out = self.reduce_scatter(input_, dim)
            return out if output is None else _into(output, out, "reduce_scatterv")
        if dim < 0:
            dim += input_.dim()
        rows = input_.movedim(dim, 0).contiguous()
        if rows.shape[0] != sum(sizes):
            raise ValueError(f"commd reduce_scatterv: input has {rows.shape[0]} rows along "
                             f"dim {dim}, sizes sum to {sum(sizes)}")
        self._once("reduce_scatterv", "a commd all-reduce, then this rank's rows")
        summed = rows.clone()
        dist.all_reduce(summed, group=self.device_group)
        start = sum(sizes[: self.rank_in_group])
        mine = summed[start: start + sizes[self.rank_in_group]]
        mine = mine.movedim(0, dim).contiguous()
        return mine if output is None else _into(output, mine, "reduce_scatterv")

    def custom_all_gather(self, input_: torch.Tensor) -> torch.Tensor | None:
        return None  # (vLLM's custom all-reduce is not built: callers take all_gather)

    def custom_reduce_scatter(self, input_: torch.Tensor) -> torch.Tensor | None:
        return None

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        return DeviceCommunicatorBase.gather(self, input_, dst, dim)

    def send(self, tensor: torch.Tensor, dst: int | None = None) -> None:
        DeviceCommunicatorBase.send(self, tensor, dst)

    def recv(self, size: torch.Size, dtype: torch.dtype, src: int | None = None) -> torch.Tensor:
        return DeviceCommunicatorBase.recv(self, size, dtype, src)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return DeviceCommunicatorBase.broadcast(self, tensor, src)

    def batch_isend_irecv(self, p2p_ops: list) -> None:
        """vLLM's P2P ops (``op``: ``torch.distributed.isend``/``irecv``, ``tensor``,
        ``group_peer``: the rank within this group) as one commd send/recv group."""
        ops = [dist.P2POp(o.op, o.tensor, group=self.device_group, group_peer=o.group_peer)
               for o in p2p_ops]
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    # -- MoE dispatch/combine: vLLM's all-gather/reduce-scatter manager where there is one,
    # else vLLM's pass-through forms ----------------------------------------------------

    def _moe(self, name: str) -> Any:
        owner = CudaCommunicator if self.all2all_manager is not None else DeviceCommunicatorBase
        return getattr(owner, name)

    def dispatch_router_logits(self, *args: Any, **kw: Any) -> Any:
        return self._moe("dispatch_router_logits")(self, *args, **kw)

    def dispatch(self, *args: Any, **kw: Any) -> Any:
        return self._moe("dispatch")(self, *args, **kw)

    def combine(self, *args: Any, **kw: Any) -> Any:
        return self._moe("combine")(self, *args, **kw)

    def allocate_combine_input(self, *args: Any, **kw: Any) -> Any:
        return self._moe("allocate_combine_input")(self, *args, **kw)

    def combine_into_output(self, *args: Any, **kw: Any) -> Any:
        return self._moe("combine_into_output")(self, *args, **kw)

    def get_symmetric_memory_buffer(self, *args: Any, **kw: Any) -> Any:
        return None

    def suspend(self) -> None:
        pass  # nothing of the process's to release: the daemon owns commd's scratch

    def resume(self) -> None:
        pass

    def checkpoint_prepare(self) -> None:
        raise NotImplementedError(
            f"commd's vLLM communicator ({self.unique_name}): a process checkpoint is not "
            "supported: the process's session with the commd daemon (its shared-memory ring "
            "and its GPU mappings) cannot be saved and restored with it")

    def checkpoint_restore(self) -> None:
        self.checkpoint_prepare()

    def destroy(self) -> None:
        if self.all2all_manager is not None:
            self.all2all_manager.destroy()
            self.all2all_manager = None


def _into(output: torch.Tensor, result: torch.Tensor, what: str) -> torch.Tensor:
    """``output.copy_(result)`` for outputs of the result's shape only (``copy_`` would
    broadcast one row into many)."""
    if output.shape != result.shape:
        raise ValueError(f"commd {what}: output of shape {tuple(output.shape)} for a result of "
                         f"shape {tuple(result.shape)}")
    return output.copy_(result)


def _refuse(name: str) -> Any:
    def refused(self: Any, *args: Any, **kw: Any) -> Any:
        import vllm

        raise NotImplementedError(
            f"commd's vLLM communicator has no {name} (vLLM {vllm.__version__}; commd's plugin "
            "follows vLLM 0.33): vLLM's own would run its PyNCCL path, which commd does not build")

    refused.__name__ = name
    refused._commd_refused = True  # type: ignore[attr-defined]  (tests/test_vllm.py's contract)
    return refused


# A method of vLLM's CudaCommunicator this class does not override (another vLLM version)
# raises, naming it, instead of running vLLM's PyNCCL code with no PyNCCL communicator.
for _name, _v in list(vars(CudaCommunicator).items()):
    if callable(_v) and not _name.startswith("_") and _name not in vars(CommdCommunicator):
        setattr(CommdCommunicator, _name, _refuse(_name))
