"""The torch.distributed backend ``"commd"``.

``import commd.torch`` registers it; then ``dist.init_process_group("commd")`` works under
torchrun (``env://``), with any store or init_method, and under mpirun (``RANK``/``WORLD_SIZE``
etc. are filled in from Open MPI's or PMI's variables when torch's are absent). Rank 0 of each
group creates the communicator id and publishes it in the group's store; every rank then joins.

CPU tensors of 1 MiB and up run in place: creating the backend makes commd's allocator torch's
CPU allocator for such tensors (:func:`use_cpu_allocator`; ``COMMD_CPU_ALLOC=0`` keeps torch's),
and the first op on a tensor moves its memory into shared memory the daemon maps. Other CPU
tensors are staged (copied) through shared memory (see ``commd._core``); tensors made by
:func:`empty` live there from the start. CUDA tensors take the stream-ordered GPU
path (``commd._torch_cuda``): ops are ordered after the current stream, ``Work.wait()`` makes
the current stream wait without blocking the CPU, and the daemon moves the data with copy
engines.

torch sees the backend through a small C++ shell (``commd/_c10d.cpp``, built on first use
against the torch in the process and cached; ``python -m commd._c10d`` builds it ahead of time):
torch hands a backend written in Python Works that answer only ``wait()`` and ``get_future()``,
so without the shell ``is_completed()`` would always be False, a receive from any source could
not name its sender, and groups could not be split. Where it cannot be built (no C++ compiler,
ninja or Python headers; or ``COMMD_TORCH_EXT=0``) the backend still works, says so once on
stderr, refuses ``recv(src=None)`` and ``split_group`` with a clear error, and makes
``is_completed()`` answer from the Work's future by patching torch's Work class.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _C10dBackend
from torch._C._distributed_c10d import ReduceOp

from . import _core, _native, _settings
from ._core import Handle
# The backend's parts below this module: its ops' arguments, its Works, its CUDA path, what it
# takes from the job's environment, and its C++ shell.
from ._torch_args import (_check_same, _check_sizes, _check_tensor, _is_cuda, _move_dt, _np,
                          _one, _premul, _reduce_args, _reduce_names, _split_rows, _split_t,
                          _sync, _tag_ignored)
from ._torch_cuda import CudaOps
from ._torch_env import _debug_init, _env_from_launcher
from ._torch_shell import _no_shell, _shell
from ._torch_work import (_CommdWork, _DoneWork, WaitTimeoutError, _dist_error, _join,
                          _seconds)

__all__ = ["CommdBackend", "register", "empty", "set_pacing", "backend", "BACKEND",
           "use_cpu_allocator"]

BACKEND = "commd"


def _base_class() -> type:
    """torch >= 2.12 lets Python subclass c10d's Backend; older releases (2.11 on our GPU
    machines) only ProcessGroup, whose Python trampoline takes the same methods."""
    class _Probe(_C10dBackend):  # type: ignore[misc, valid-type]
        pass

    try:
        _Probe(0, 1)
        return _C10dBackend
    except TypeError:
        return dist.ProcessGroup


class CommdBackend(_base_class()):  # type: ignore[misc]
    """A process group backend whose collectives run in the node's commd daemon."""

    if _base_class() is dist.ProcessGroup:
        # torch < 2.12: the backend *is* the process group (torch uses a ProcessGroup returned
        # by a backend's creator as the group itself). Such a group has no per-device backends,
        # where c10d keeps the group's name, so `group_name` raised "ProcessGroup name not set"
        # and torch's functional collectives (what torch.compile traces) could not resolve it.
        def _set_group_name(self, name: str) -> None:
            self._commd_group_name = name
            super()._set_group_name(name)

        @property
        def group_name(self) -> str:
            name = getattr(self, "_commd_group_name", None)
            if name is None:
                raise RuntimeError("ProcessGroup name not set")
            return name

        # `init_process_group(..., device_id=...)` (DeepSpeed passes one on CUDA) asks the group
        # for its backend of that device and whether it splits: this group is its own backend
        # for both device types it serves, and it does not split (new groups are made anew).
        supports_splitting = False

        def _get_backend(self, device: Any) -> Any:
            kind = torch.device(device).type
            if kind in ("cpu", "cuda"):
                return self
            raise RuntimeError(f"No backend type associated with device type {kind}")

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta | None = None,
                 group_name: str = "", options: Options | None = None,
                 group_desc: str = "") -> None:
        super().__init__(rank, size)
        self._rank = rank
        self._size = size
        self._group_name = group_name
        # Set by _create once torch holds this backend through the C++ shell (commd/_c10d.cpp).
        self._shell = False
        self.client = _core.connect(name=f"torch pid {os.getpid()} rank {rank}")
        o = options or Options()
        self._commd_options = o
        secs = _seconds(timeout)
        self._timeout_s = secs
        op_secs = _seconds(o.op_timeout) if o.op_timeout is not None else secs
        if isinstance(o.op_timeout, (int, float)) and o.op_timeout > 0:
            op_secs = float(o.op_timeout)
        key = "commd/unique_id"
        if rank == 0:
            uid = self.client.unique_id()
            store.set(key, uid)
        else:
            uid = bytes(store.get(key))
        # Per job: COMMD_COMM_SWITCH=off or HOST:PORT of a SwitchML controller (unset: the
        # daemon's `switch` setting) for the inter-node step of all-reduce, and
        # COMMD_COMM_PACING_GBPS, the cap on the daemon's GPU copies (unset: the daemon's
        # `gpu_pacing_gbps`; 0: uncapped).
        pacing = o.pacing_gbps if o.pacing_gbps is not None else _settings.gbps("COMMD_COMM_PACING_GBPS")
        self.comm = self.client.communicator(
            uid, rank, size, op_timeout=op_secs, join_timeout=secs,
            switch=o.switch or _settings.get("COMMD_COMM_SWITCH") or None, pacing_gbps=pacing,
            name=_comm_name(group_name, group_desc))
        self._cuda: CudaOps | None = None
        self._children: dict[tuple[str, tuple[int, ...]], CommdBackend] = {}
        # The group sequence number (see _counted), and how deep each thread is in a
        # collective of this backend.
        self._seq = 0
        self._seq_depth: dict[int, int] = {}
        _debug_init(self, group_name)

    @property
    def gpu(self) -> CudaOps:
        if self._cuda is None:
            self._cuda = CudaOps(self.comm, self._rank, self._size)
        return self._cuda

    def _cuda_check(self, tensors: list[torch.Tensor], what: str) -> None:
        for t in tensors:
            _check_tensor(t, what, cuda=True)

    # -- plumbing ------------------------------------------------------------------------

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def supports_coalescing(self) -> bool:
        return False

    def get_error(self) -> int:
        """torch's ``Backend::getError`` (c10d's ErrorType): 0 (SUCCESS) while the communicator
        works; once the daemon holds it broken, 1 (TIMEOUT) for an op that timed out, 3
        (REMOTE_ERROR) for a lost rank, 2 (COMM_ERROR) for any other failure."""
        f = self.comm.failure()
        if f is None:
            return 0
        return {"timeout": 1, "peer_lost": 3}.get(f[0], 2)

    def shutdown(self) -> None:
        self.comm.close()
        _UNSHELLED.discard(self)

    def abort(self) -> None:
        self.comm.close()
        _UNSHELLED.discard(self)

    def _get_sequence_number_for_group(self) -> int:
        """torch's group sequence number without the C++ shell (see _counted)."""
        return self._seq

    def _set_sequence_number_for_group(self) -> None:
        self._seq = 0

    @staticmethod
    def _work(h: Handle, result: Any, opts: Any = None) -> Any:
        """torch's Work for ``h``. A blocking call (``opts.asyncOp`` false: torch waits at once)
        gets a Work whose ``wait`` runs here, with no thread hop. Async calls get a Work made from
        a future that the progress thread completes, so ``is_completed()``, ``get_future()`` and
        DDP's hooks see progress without anyone calling ``wait``."""
        w = _CommdWork(h, result)
        if opts is None or getattr(opts, "asyncOp", True):
            # Watched at once, so the future (and is_completed) progress with nobody waiting.
            w.get_future()
        return w

    @staticmethod
    def _coalesced_work(works: list[Any]) -> Any:
        """The Work of a coalescing block (the C++ shell's ``endCoalescing``): every op issued
        in it, each already posted."""
        if not works:
            return _DoneWork([])
        return works[0] if len(works) == 1 else _join(list(works), [])

    def _p2p_batch(self, sends: list[tuple[np.ndarray, int]],
                   recvs: list[tuple[np.ndarray, int]]) -> Handle:
        hs: list[Handle] = []
        try:
            for a, peer in sends:
                hs.append(self.comm.send(a, peer, async_op=True))
            for a, peer in recvs:
                hs.append(self.comm.recv(a, peer, async_op=True))
        except BaseException:
            _core.drain(hs)
            raise
        return Handle.all(hs)

    # -- collectives ---------------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        t = _one(tensors, "allreduce")
        if isinstance(t, torch.Tensor) and t.is_sparse:
            return self._sparse_allreduce(t, opts)
        t, op = _premul(t, opts.reduceOp, "allreduce", copy=False)
        if _is_cuda(t):
            dt, red = _reduce_names(t, op, "allreduce")
            return self.gpu.reduce_like("all_reduce", t, dt, red, 0, None, tensors,
                                        _sync(opts))
        a, dt, red = _reduce_args(t, op, "allreduce")
        return self._work(self.comm.all_reduce(a, op=red, dtype=dt, async_op=True), tensors, opts)

    def _gather_rows(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same dtype and trailing shape, any length along dim 0): the
        lengths first, then the rows padded to the longest."""
        n = torch.tensor([t.shape[0]], dtype=torch.int64)
        ns = [torch.empty(1, dtype=torch.int64) for _ in range(self._size)]
        self._allgather_h(ns, n).wait()
        most = max(int(x.item()) for x in ns)
        if most == 0:
            return [t[:0] for _ in ns]
        pad = torch.zeros((most, *t.shape[1:]), dtype=t.dtype)
        pad[: t.shape[0]] = t
        outs = [torch.empty_like(pad) for _ in ns]
        self._allgather_h(outs, pad).wait()
        return [o[: int(k.item())] for o, k in zip(outs, ns)]

    def _sparse_allreduce(self, t: torch.Tensor, opts: Any) -> Any:
        """A sparse COO all-reduce (sum, as gloo's): every rank's indices and values are
        gathered and summed by coalescing; ``t`` then holds the result, as with gloo."""
        if t.is_cuda:
            raise ValueError("commd allreduce: sparse CUDA tensors are not supported (gloo's "
                             "sparse all-reduce is CPU-only too); use a dense tensor")
        if opts.reduceOp != ReduceOp.SUM:
            raise ValueError("commd allreduce: sparse tensors support only ReduceOp.SUM")
        c = t.detach().coalesce()
        idx = self._gather_rows(c.indices().t().contiguous())
        val = self._gather_rows(c.values().contiguous())
        out = torch.sparse_coo_tensor(torch.cat(idx).t(), torch.cat(val), c.shape).coalesce()
        with torch.no_grad():
            t.copy_(out)
        return _CommdWork(Handle.done(), [t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if not tensors:
            return self._work(Handle.done(), tensors, opts)
        op = [_premul(t, opts.reduceOp, "allreduce_coalesced", copy=False)[1]
              for t in tensors][0]
        if _is_cuda(tensors[0]):
            self._cuda_check(tensors, "allreduce_coalesced")
            works = [self.gpu.reduce_like("all_reduce", t, *_reduce_names(
                t, op, "allreduce_coalesced"), 0, None, [t]) for t in tensors]
            return works[-1] if len(works) == 1 else _join(works, tensors)
        args = [_reduce_args(t, op, "allreduce_coalesced") for t in tensors]
        groups: dict[tuple[str, str], list[np.ndarray]] = {}
        for a, dt, red in args:
            groups.setdefault((dt, red), []).append(a)
        hs = [self.comm.all_reduce_coalesced(arrs, op=red, dtype=dt, async_op=True)
              for (dt, red), arrs in groups.items()]
        return self._work(Handle.all(hs), tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        t = _one(tensors, "broadcast")
        if _is_cuda(t):
            return self.gpu.broadcast(t, opts.rootRank, tensors, _sync(opts))
        h = self.comm.broadcast(_np(t, "broadcast"), opts.rootRank, dtype=_move_dt(t),
                                async_op=True)
        return self._work(h, tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        t = _one(tensors, "reduce")
        # Only the root's tensor receives the result: other ranks' stay as they were.
        t, op = _premul(t, opts.reduceOp, "reduce", copy=self._rank != opts.rootRank)
        if _is_cuda(t):
            dt, red = _reduce_names(t, op, "reduce")
            return self.gpu.reduce_like("reduce", t, dt, red, opts.rootRank, None, tensors,
                                        _sync(opts))
        a, dt, red = _reduce_args(t, op, "reduce")
        h = self.comm.reduce(a, opts.rootRank, op=red, dtype=dt, async_op=True)
        return self._work(h, tensors, opts)

    def _allgather_h(self, outs: list[torch.Tensor], t: torch.Tensor) -> Handle:
        if len(outs) != self._size:
            raise ValueError(f"commd allgather: expected {self._size} output tensors, got "
                             f"{len(outs)}")
        for o in outs:
            _check_same(o, t, "allgather")
        return self.comm.all_gather(_np(t, "allgather"), [_np(o, "allgather") for o in outs],
                                    dtype=_move_dt(t), async_op=True)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any) -> Any:
        t = _one(input_tensors, "allgather")
        outs = _one(output_tensors, "allgather")  # type: ignore[arg-type]
        if _is_cuda(t):
            if len(outs) != self._size:
                raise ValueError(f"commd allgather: expected {self._size} output tensors, got "
                                 f"{len(outs)}")
            self._cuda_check(outs, "allgather")
            for o in outs:
                _check_same(o, t, "allgather")
            flat = torch.empty(self._size * t.numel(), dtype=t.dtype, device=t.device)
            return self.gpu.all_gather(flat, t, output_tensors, outs)
        return self._work(self._allgather_h(outs, t), output_tensors, opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any) -> Any:
        # torch's layout: output_lists[r][i] receives rank r's inputs[i].
        if len(output_lists) != self._size or any(len(o) != len(inputs) for o in output_lists):
            raise ValueError(f"commd all_gather_coalesced: expected {self._size} output lists of "
                             f"{len(inputs)} tensors (one list per rank)")
        per_input = [[output_lists[r][i] for r in range(self._size)] for i in range(len(inputs))]
        if inputs and _is_cuda(inputs[0]):
            works = [self.allgather([o], [i], opts) for o, i in zip(per_input, inputs)]
            return works[-1] if len(works) == 1 else _join(works, output_lists)
        hs = [self._allgather_h(o, i) for o, i in zip(per_input, inputs)]
        return self._work(Handle.all(hs), output_lists, opts)

    def _allgather_base_h(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        what = "all_gather_into_tensor"
        _check_sizes(output, input, self._size, what)
        return self.comm.all_gather(_np(input, what), _np(output, what), dtype=_move_dt(input),
                                    async_op=True)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        if _is_cuda(input):
            if not (output.is_cuda and output.dtype == input.dtype and not output.is_sparse
                    and not input.is_sparse and output.numel() == self._size * input.numel()):
                self._cuda_check([output, input], "all_gather_into_tensor")
                _check_sizes(output, input, self._size, "all_gather_into_tensor")
            return self.gpu.all_gather(output, input, [output], sync=_sync(opts))
        return self._work(self._allgather_base_h(output, input), [output], opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any) -> Any:
        # GPU: one stream-ordered op per pair (torch's functional all_gather_tensor and FSDP
        # come here), joined into one Work.
        if inputs and _is_cuda(inputs[0]):
            works = [self._allgather_base(o, i, opts)
                     for o, i in zip(outputs, inputs, strict=True)]
            return works[-1] if len(works) == 1 else _join(works, outputs)
        hs = [self._allgather_base_h(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._work(Handle.all(hs), outputs, opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any) -> Any:
        out = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter")  # type: ignore[arg-type]
        if len(ins) != self._size:
            raise ValueError(f"commd reduce_scatter: expected {self._size} input tensors, got "
                             f"{len(ins)}")
        for i in ins:
            _check_same(i, out, "reduce_scatter")
        op = opts.reduceOp
        scaled = [_premul(i, op, "reduce_scatter", copy=True) for i in ins]
        ins, op = [x for x, _ in scaled], scaled[0][1] if scaled else op
        if _is_cuda(out):
            self._cuda_check(list(ins), "reduce_scatter")
            dt, red = _reduce_names(out, op, "reduce_scatter")
            return self.gpu.reduce_like("reduce_scatter", torch.cat([i.reshape(-1) for i in ins]),
                                        dt, red, 0, out, output_tensors)
        a, dt, red = _reduce_args(out, op, "reduce_scatter")
        h = self.comm.reduce_scatter([_np(i, "reduce_scatter") for i in ins], a, op=red,
                                     dtype=dt, async_op=True)
        return self._work(h, output_tensors, opts)

    def _reduce_scatter_base_h(self, output: torch.Tensor, input: torch.Tensor,
                               op: Any) -> Handle:
        what = "reduce_scatter_tensor"
        _check_sizes(input, output, self._size, what)
        input, op = _premul(input, op, what, copy=True)
        a, dt, red = _reduce_args(output, op, what)
        return self.comm.reduce_scatter(_np(input, what), a, op=red, dtype=dt, async_op=True)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        if _is_cuda(output):
            what = "reduce_scatter_tensor"
            self._cuda_check([input], what)
            _check_sizes(input, output, self._size, what)
            input, op = _premul(input, opts.reduceOp, what, copy=True)
            dt, red = _reduce_names(output, op, what)
            return self.gpu.reduce_like("reduce_scatter", input, dt, red, 0, output, [output],
                                        _sync(opts))
        return self._work(self._reduce_scatter_base_h(output, input, opts.reduceOp), [output],
                          opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any) -> Any:
        if outputs and _is_cuda(outputs[0]):
            works = [self._reduce_scatter_base(o, i, opts)
                     for o, i in zip(outputs, inputs, strict=True)]
            return works[-1] if len(works) == 1 else _join(works, outputs)
        hs = [self._reduce_scatter_base_h(o, i, opts.reduceOp)
              for o, i in zip(outputs, inputs, strict=True)]
        return self._work(Handle.all(hs), outputs, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any) -> Any:
        what = "all_to_all_single"
        if input.dtype != output.dtype:
            raise ValueError(f"commd {what}: input is {input.dtype} but output is {output.dtype}")
        if _is_cuda(input):
            self._cuda_check([output], what)
            if not output_split_sizes and not input_split_sizes:
                if input.numel() != output.numel() or input.numel() % self._size:
                    raise ValueError(
                        f"commd {what}: without split sizes, input and output must have the "
                        f"same number of elements, divisible by {self._size}")
                return self.gpu.all_to_all(output, input, [output], sync=_sync(opts))
            ins = _split_t(input, input_split_sizes, self._size, "input", what)
            outs = _split_t(output, output_split_sizes, self._size, "output", what)
            return self._gpu_alltoallv(ins, outs, [output])
        a, b = _np(input, what), _np(output, what)
        if not output_split_sizes and not input_split_sizes:
            if input.numel() != output.numel() or input.numel() % self._size:
                raise ValueError(
                    f"commd {what}: without split sizes, input and output must have the same "
                    f"number of elements, divisible by {self._size} (got {input.numel()} and "
                    f"{output.numel()})")
            return self._work(self.comm.all_to_all(a, b, dtype=_move_dt(input), async_op=True),
                              [output], opts)
        ins = _split_rows(a, input_split_sizes, self._size, "input", what)
        outs = _split_rows(b, output_split_sizes, self._size, "output", what)
        return self._work(self.comm.all_to_all_v(ins, outs, async_op=True), [output], opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any) -> Any:
        what = "all_to_all"
        if len(output_tensors) != self._size or len(input_tensors) != self._size:
            raise ValueError(f"commd {what}: expected {self._size} input and output tensors")
        if _is_cuda(input_tensors[0]):
            self._cuda_check(list(input_tensors) + list(output_tensors), what)
            return self._gpu_alltoallv(list(input_tensors), list(output_tensors), output_tensors)
        ins = [_np(t, what) for t in input_tensors]
        outs = [_np(t, what) for t in output_tensors]
        return self._work(self.comm.all_to_all_v(ins, outs, async_op=True), output_tensors,
                          opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        _tag_ignored(tag)
        t = _one(tensors, "send")
        if _is_cuda(t):
            return self.gpu.p2p([(t, dst)], [], tensors, group=False)
        return self._work(self.comm.send(_np(t, "send"), dst, async_op=True), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        _tag_ignored(tag)
        t = _one(tensors, "recv")
        if _is_cuda(t):
            return self.gpu.p2p([], [(t, src)], tensors, group=False)
        return self._work(self.comm.recv(_np(t, "recv"), src, async_op=True), tensors)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        """``recv(src=None)``: whichever rank sends to this one first (CPU tensors, ranks of one
        node, as gloo's); the Work's ``_source_rank()`` names the sender."""
        t = _one(tensors, "recv")
        if not self._shell:
            raise ValueError(_no_shell("receiving from any source"))
        if _is_cuda(t):
            raise ValueError("commd recv: receiving from any source takes CPU tensors (as gloo); "
                             "for CUDA tensors name the source rank")
        return self._work(self.comm.recv(_np(t, "recv"), None, async_op=True), tensors)

    def monitored_barrier(self, opts: Any, wait_all_ranks: bool = False) -> None:
        """gloo's monitored barrier: rank 0 waits for every other rank, up to the timeout,
        and names each rank that did not arrive in time ("Rank 2 failed to pass
        monitoredBarrier in 3000 ms"; with ``wait_all_ranks`` every such rank, else the first);
        then it releases the others, which fail in turn if rank 0 never does."""
        secs = _seconds(getattr(opts, "timeout", None)) or self._timeout_s or 1800.0
        ms = int(secs * 1000)
        if self._size == 1:
            return
        flag = np.zeros(1, np.uint8)
        deadline = time.monotonic() + secs
        if self._rank != 0:
            for h in (self.comm.send(flag, 0, async_op=True),
                      self.comm.recv(np.zeros(1, np.uint8), 0, async_op=True)):
                try:
                    h.wait(max(deadline - time.monotonic(), 0.001))
                except TimeoutError:
                    raise WaitTimeoutError(
                        f"[Rank {self._rank}]: timed out in monitoredBarrier after {ms} ms: "
                        "rank 0 did not release it (rank 0 failed or is waiting for another "
                        "rank)") from None
                except _native.CommError as e:
                    raise _dist_error(e) from e
            return
        waits = [(r, self.comm.recv(np.zeros(1, np.uint8), r, async_op=True))
                 for r in range(1, self._size)]
        late: list[int] = []
        for r, h in waits:
            try:
                h.wait(max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                late.append(r)
                if not wait_all_ranks:
                    break
            except _native.CommError as e:
                raise _dist_error(e) from e
        if late:
            who = (f"Rank {late[0]}" if len(late) == 1
                   else "Ranks " + ", ".join(str(r) for r in late))
            raise dist.DistBackendError(
                f"[Rank 0]: {who} failed to pass monitoredBarrier in {ms} ms")
        for r in range(1, self._size):
            self.comm.send(flag, r)

    def split(self, store: Any, ranks: list[int], timeout_s: float,
              group_name: str) -> CommdBackend | None:
        """``split_group``: the backend of this rank's part (its rank there is its position in
        ``ranks``, which are this group's ranks), on a new communicator; None on a rank outside
        ``ranks``. Called by the C++ shell on every rank of this group, with the child's store."""
        if self._rank not in ranks:
            return None
        # One child per new group: a torch that splits the group once per device type (each
        # of this group's backends, which here are one) gets the same child again, not a
        # second communicator rendezvousing through the same store keys.
        key = (group_name, tuple(ranks))
        children = self._children
        if group_name and key in children:
            return children[key]
        child = CommdBackend(store, ranks.index(self._rank), len(ranks),
                             timedelta(seconds=timeout_s) if timeout_s > 0 else None,
                             group_name, options=self._commd_options)
        child._shell = True
        if group_name:
            children[key] = child
        return child

    def set_timeout(self, secs: float) -> None:
        """torch's ``_set_pg_timeout``: the default of monitored barriers and of later splits
        (the daemon's op timeout was fixed when the communicator was made, and says so)."""
        self._timeout_s = secs if secs > 0 else None
        print(f"commd: the group's timeout is now {secs:g} s for monitored barriers and later "
              "groups; its ops keep the op timeout the communicator was made with (set it with "
              "init_process_group's timeout or commd.torch.Options(op_timeout=...))",
              file=sys.stderr, flush=True)

    def barrier(self, opts: Any = None) -> Any:
        return self._work(self.comm.barrier(async_op=True), [], opts)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any) -> Any:
        t = _one(input_tensors, "gather")
        root = opts.rootRank
        gpu = _is_cuda(t)
        if self._rank != root:
            if gpu:
                return self.gpu.p2p([(t, root)], [], [])
            return self._work(self._p2p_batch([(_np(t, "gather"), root)], []), [], opts)
        outs = _one(output_tensors, "gather")  # type: ignore[arg-type]
        if len(outs) != self._size:
            raise ValueError(f"commd gather: expected {self._size} output tensors on the root")
        for o in outs:
            _check_same(o, t, "gather")
        with torch.no_grad():  # a communication result, not a differentiable copy (as gloo)
            outs[root].copy_(t)
        others = [(o, j) for j, o in enumerate(outs) if j != root]
        if not gpu:
            recvs = [(_np(o, "gather"), j) for o, j in others]
            return self._work(self._p2p_batch([], recvs), output_tensors, opts)
        if not others:
            return _DoneWork(output_tensors)
        return self.gpu.p2p([], others, output_tensors)

    def gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:
        """torch 2.15's ``gather_single`` / ``gather_into_tensor``: every rank's ``input`` into
        ``output`` on the root, rank r's at the r-th ``input.numel()`` elements (a gather into
        the rows of the flat output)."""
        if self._rank != opts.rootRank:
            return self.gather([], [input], opts)
        _check_tensor(output, "gather_single", _is_cuda(input))
        if output.dtype != input.dtype or output.numel() != self._size * input.numel():
            raise ValueError(f"commd gather_single: the root's output must hold {self._size} x "
                             f"{input.numel()} elements of {input.dtype}, got {output.numel()} "
                             f"of {output.dtype}")
        if not output.is_contiguous():
            raise ValueError("commd gather_single: the root's output must be contiguous")
        rows = [r.view(input.shape) for r in output.view(self._size, -1).unbind(0)]
        return self.gather([rows], [input], opts)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any) -> Any:
        out = _one(output_tensors, "scatter")
        root = opts.rootRank
        gpu = _is_cuda(out)
        if self._rank != root:
            if gpu:
                return self.gpu.p2p([], [(out, root)], output_tensors)
            return self._work(self._p2p_batch([], [(_np(out, "scatter"), root)]), output_tensors,
                              opts)
        ins = _one(input_tensors, "scatter")  # type: ignore[arg-type]
        if len(ins) != self._size:
            raise ValueError(f"commd scatter: expected {self._size} input tensors on the root")
        for i in ins:
            _check_same(i, out, "scatter")
        with torch.no_grad():  # a communication result, not a differentiable copy (as gloo)
            out.copy_(ins[root])
        others = [(i, j) for j, i in enumerate(ins) if j != root]
        if not gpu:
            sends = [(_np(i, "scatter"), j) for i, j in others]
            return self._work(self._p2p_batch(sends, []), output_tensors, opts)
        if not others:
            return _DoneWork(output_tensors)
        return self.gpu.p2p(others, [], output_tensors)

    def _gpu_alltoallv(self, ins: list[torch.Tensor], outs: list[torch.Tensor],
                       result: Any) -> Any:
        """Uneven all-to-all on GPU tensors: one send/recv group (own block copied locally)."""
        mine, into = ins[self._rank], outs[self._rank]
        if mine.numel() != into.numel():
            # Checked before anything is posted: copy_ would broadcast one row into several.
            raise ValueError(
                f"commd all_to_all: rank {self._rank} sends itself {mine.numel()} elements but "
                f"expects {into.numel()} from itself")
        with torch.no_grad():
            into.copy_(mine.reshape(into.shape))
        sends = [(t, j) for j, t in enumerate(ins) if j != self._rank and t.numel() > 0]
        recvs = [(t, j) for j, t in enumerate(outs) if j != self._rank and t.numel() > 0]
        if not sends and not recvs:
            return _DoneWork(result)
        return self.gpu.p2p(sends, recvs, result)


def _counted(f: Any) -> Any:
    """``f`` (a collective) counted in the backend's group sequence number when torch calls it
    (not when another collective of this backend does)."""
    def collective(self: CommdBackend, *args: Any, **kwargs: Any) -> Any:
        if self._seq_depth.get(threading.get_ident(), 0) == 0:
            self._seq += 1
        d = self._seq_depth
        d[threading.get_ident()] = d.get(threading.get_ident(), 0) + 1
        try:
            return f(self, *args, **kwargs)
        finally:
            d[threading.get_ident()] -= 1
    collective.__name__ = f.__name__
    collective.__doc__ = f.__doc__
    return collective


# The collectives (not send/recv), as NCCL's seqCollective counts them. Without the C++ shell
# (which counts them itself) torch reads the count through `_get_sequence_number_for_group`.
for _name in ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather",
              "allgather_coalesced", "_allgather_base", "allgather_into_tensor_coalesced",
              "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
              "alltoall_base", "alltoall", "barrier", "gather", "gather_single", "scatter"):
    setattr(CommdBackend, _name, _counted(getattr(CommdBackend, _name)))

# torch >= 2.12 calls these names; older releases the underscored/base ones above.
CommdBackend.all_gather_single = CommdBackend._allgather_base  # type: ignore[attr-defined]
CommdBackend.all_gather_single_coalesced = (  # type: ignore[attr-defined]
    CommdBackend.allgather_into_tensor_coalesced)
CommdBackend.reduce_scatter_single = CommdBackend._reduce_scatter_base  # type: ignore[attr-defined]
CommdBackend.reduce_scatter_single_coalesced = (  # type: ignore[attr-defined]
    CommdBackend.reduce_scatter_tensor_coalesced)
CommdBackend.all_to_all_single = CommdBackend.alltoall_base  # type: ignore[attr-defined]


def set_pacing(gbps: float | None, group: Any = None) -> None:
    """Caps the bandwidth of the commd daemon's GPU copies for the process group ``group``
    (default: the default group) at ``gbps`` GB/s (1e9 bytes/s); None or 0: uncapped; otherwise
    at least 0.001. Use it to keep background collectives (e.g. gradient all-reduces overlapping
    the backward pass) from slowing the job's compute. It applies to every rank of the group on
    this node from the next copy phase on, so calling it on one rank per node is enough (calling
    it on every rank is fine). The cap at creation comes from ``COMMD_COMM_PACING_GBPS`` (unset:
    the daemon's ``gpu_pacing_gbps``). CPU tensors are not paced. Raises ValueError for
    negative or NaN values or a group that does not use the commd backend; does nothing on a
    rank that is not a member of ``group``, like torch's collectives."""
    for b in _backends(group, "set_pacing"):
        b.comm.set_pacing(gbps)


def backend(group: Any = None) -> CommdBackend:
    """The commd backend object of ``group`` (default: the default group): its ``comm`` is the
    group's commd communicator (``comm.id`` as ``commd status`` shows it). torch's own
    ``group._get_backend(device)`` returns the C++ shell that torch holds. ValueError for a group
    that does not use commd or a rank outside it."""
    found = _backends(group, "backend")
    if not found:
        raise ValueError("commd.torch.backend: this rank is not a member of the group")
    return found[0]


def _backends(group: Any, what: str) -> list[CommdBackend]:
    """The commd backends of ``group`` (default: the default group); none on a rank that is
    not a member. ValueError for a group that does not use commd."""
    if group is None:
        group = dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return []
    backends: list[CommdBackend] = []
    if isinstance(group, CommdBackend):
        backends.append(group)
    else:
        for dev in ("cpu", "cuda"):
            try:
                b = group._get_backend(torch.device(dev))
            except RuntimeError:  # no backend for that device type
                continue
            b = _impl_of(b)
            if isinstance(b, CommdBackend) and all(b is not x for x in backends):
                backends.append(b)
    if not backends:
        raise ValueError(f"commd.torch.{what}: this process group does not use the commd "
                         "backend (init_process_group(\"commd\") or new_group(backend=\"commd\"))")
    return backends


def check_graphs(group: Any = None) -> None:
    """Raises the failure of a replay of a GPU op captured into a CUDA graph on ``group``
    (default: the default group) since the last check: a replay that failed (a peer lost, a
    rank that captured different ops, a peer's graph destroyed) releases every rank's stream
    at once with the results of that replay invalid, and the reason is raised here or by the
    group's next GPU op, whichever comes first. Cheap when nothing failed (one memory load)."""
    for b in _backends(group, "check_graphs"):
        b.comm._native.cuda_graph_check()


def graph_path(group: Any = None) -> str:
    """How collectives captured into CUDA graphs run on ``group``: ``"direct"`` (all-reduce,
    all-gather, reduce-scatter, broadcast and reduce up to ``COMMD_GRAPH_DIRECT_MAX_BYTES`` are
    one kernel of the graph each, with no daemon work per replay: ranks with a GPU each, peer
    access between them; docs/design-gpu.md, direct collectives), ``"daemon: <why not direct>"`` (every
    replay through the daemon's executor, persistent ops), or ``"undecided"`` before the first
    capture on the group."""
    return _backends(group, "graph_path")[0].comm._native.cuda_graph_path()


def eager_path(group: Any = None) -> str:
    """How small eager GPU collectives run on ``group``: ``"direct"`` (unless
    ``COMMD_EAGER_DIRECT=0``, all-reduce, all-gather, reduce-scatter, broadcast and reduce up
    to ``COMMD_EAGER_DIRECT_MAX_BYTES`` are one kernel each, with no daemon round trip: ranks
    with a GPU each, peer access between them; docs/design-gpu.md, direct collectives rule 8),
    ``"daemon: <why not direct>"``, or ``"undecided"`` before the first such op on the group."""
    return _backends(group, "eager_path")[0].comm._native.cuda_eager_path()


def empty(*size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A CPU tensor in commd shared memory: collectives on it skip the staging copies."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    n = 1
    for s in size:
        n *= int(s)
    itemsize = torch.empty((), dtype=dtype).element_size()
    buf = _core.connect().alloc(max(n * itemsize, 1))
    return torch.frombuffer(buf, dtype=dtype, count=n).view(size)


class Options:
    """Per-group settings of the ``"commd"`` backend, passed as ``pg_options`` to
    ``init_process_group`` or ``new_group``. A field left None falls back to the environment
    (``COMMD_COMM_SWITCH``, ``COMMD_COMM_PACING_GBPS``) and then to the daemon's settings.

    - ``pacing_gbps``: cap on the daemon's GPU copies for this group on this node (0: uncapped);
    - ``switch``: ``"off"`` or a SwitchML controller ``HOST:PORT`` for the inter-node step;
    - ``op_timeout``: per-op timeout (timedelta or seconds; default: the group's timeout).
    """

    def __init__(self, *, pacing_gbps: float | None = None, switch: str | None = None,
                 op_timeout: Any = None) -> None:
        if pacing_gbps is not None and pacing_gbps < 0:
            raise ValueError(f"commd Options: pacing_gbps must be >= 0, got {pacing_gbps}")
        self.pacing_gbps = pacing_gbps
        self.switch = switch
        self.op_timeout = op_timeout

    def __repr__(self) -> str:
        return (f"commd.torch.Options(pacing_gbps={self.pacing_gbps!r}, switch={self.switch!r}, "
                f"op_timeout={self.op_timeout!r})")


class _BackendOptions(_C10dBackend.Options):  # type: ignore[misc, valid-type]
    """torch's ``Backend.Options`` for a "commd" backend (its ``options`` property, read by
    torch 2.11's ``split_group``), which ``copy.deepcopy`` can copy (torch's own cannot)."""

    def __deepcopy__(self, memo: Any) -> _BackendOptions:
        o = _BackendOptions(self.backend, self._timeout)
        o.group_name = self.group_name
        return o


def _backend_options(timeout_s: float) -> _BackendOptions:
    return _BackendOptions(BACKEND, timedelta(seconds=timeout_s))


def _comm_name(group_name: str, group_desc: str) -> str:
    """What `commd status`, the daemon's logs and its errors call the group's communicator:
    torch's description of the group where it has one, and torch's name for it."""
    name = f"torch group {group_name}" if group_name else "torch group"
    if group_desc and group_desc not in ("undefined", group_name):
        name = f"{group_desc} ({name})"
    return name[:128]


def _group_desc(opts: Any) -> str:
    try:
        return str(opts.process_group.group_desc)
    except Exception:  # noqa: BLE001 - torch without it, or a group not yet described
        return ""


# The backends torch holds without the C++ shell, kept alive until their shutdown: torch's
# trampoline answers from the Python object, which nothing else keeps once torch wraps the
# backend (TORCH_DISTRIBUTED_DEBUG=DETAIL's ProcessGroupWrapper holds the C++ side only; the
# Python side then died and every call fell to c10d's "getBackendName is not implemented").
_UNSHELLED: set[CommdBackend] = set()


def _create(opts: Any, backend_options: Any = None) -> Any:
    if backend_options is not None and not isinstance(backend_options, Options):
        raise TypeError(f"the commd backend takes commd.torch.Options as pg_options, got "
                        f"{type(backend_options).__name__}")
    b = CommdBackend(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                     str(opts.group_id), options=backend_options, group_desc=_group_desc(opts))
    shell = _shell()
    if shell is None:
        _UNSHELLED.add(b)
        return b
    if _settings.flag("COMMD_CPU_ALLOC", True):
        use_cpu_allocator()
    b._shell = True
    return shell.wrap(b, opts.group_rank, opts.group_size, b._timeout_s or 0.0)


def use_cpu_allocator(min_bytes: int | None = None) -> bool:
    """Makes commd's allocator torch's CPU allocator for allocations of at least ``min_bytes``
    (default ``COMMD_CPU_ALLOC_MIN``, else 1 MiB), so collectives on such tensors run in place
    in the daemon instead of being copied through shared memory. Creating the backend calls it
    (unless ``COMMD_CPU_ALLOC=0``); call it earlier to cover tensors made before
    ``init_process_group`` (a model built first). Tensors that already exist are not changed.

    What it does: such allocations are whole pages owned by commd (freed ones of the same size
    are reused, up to ``COMMD_CPU_CACHE_MIB``, default 256); the first op on one copies it into
    a memfd mapped at the same address and registered with the daemon. So during a tensor's
    *first* op, do not write to its storage (not even outside the op's range) from another
    thread. A forked child gets private copies of such tensors (the parent waits until they
    are made). Returns True when the allocator is in place; False when it cannot be (no C++
    shell, or another CPU allocator installed at a higher priority), with the reason on stderr
    once."""
    if min_bytes is None:
        min_bytes = _settings.size("COMMD_CPU_ALLOC_MIN", 1 << 20)
    min_bytes = max(int(min_bytes), 1)
    from . import _c10d
    mod = _c10d.load(quiet=True)
    if mod is None:
        ok, why = False, f"the C++ shell is missing: {_c10d.why_not()}"
    else:
        a, f = _native.host_allocator()
        ok = bool(mod.install_cpu_allocator(a, f, min_bytes))
        why = "another CPU allocator was installed at a higher priority"
    if ok:
        _core._blocks_installed(min_bytes)
    elif not getattr(use_cpu_allocator, "_said", False):
        use_cpu_allocator._said = True  # type: ignore[attr-defined]
        print(f"commd: CPU tensors stay staged (copied) for collectives: {why}",
              file=sys.stderr, flush=True)
    return ok


def _impl_of(b: Any) -> Any:
    """The commd.torch.CommdBackend behind a torch Backend object (itself when not shelled)."""
    if isinstance(b, CommdBackend):
        return b
    from . import _c10d
    mod = _c10d.load(quiet=True)
    return mod.impl_of(b) if mod is not None else None


def register() -> None:
    """Registers the ``"commd"`` backend with torch.distributed (idempotent)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])


_env_from_launcher()
register()

# Re-exported so `except commd.torch.PeerLostError` reads naturally next to torch code.
CommError = _native.CommError
MismatchError = _native.MismatchError
PeerLostError = _native.PeerLostError
CommTimeoutError = _native.CommTimeoutError
DaemonUnavailableError = _native.DaemonUnavailableError
