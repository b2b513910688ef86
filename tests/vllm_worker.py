"""One rank of a vLLM-shaped job on CPU tensors for tests/test_vllm.py, run with the vLLM venv's
Python: vLLM's own `init_distributed_environment` and `initialize_model_parallel` (tensor
parallel over all ranks) on the "commd" backend, then commd's vLLM communicator built on vLLM's
tensor-parallel groups and driven through every op it has, each checked against its definition.
Prints "PASS rank R" at the end.

    torchrun --nproc_per_node N tests/vllm_worker.py
"""

import os
import sys

import torch
import torch.distributed as dist

import commd.torch  # noqa: F401  (as the commd platform module does in vLLM's workers)
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import parallel_state as ps
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator

from commd.vllm.communicator import CommdCommunicator

rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
failures = []


def check(name, got, want):
    if not torch.equal(got, want):
        failures.append(f"{name}: got {got.tolist()}, want {want.tolist()}")


with set_current_vllm_config(VllmConfig()):
    ps.init_distributed_environment(world_size=n, rank=rank, local_rank=rank, backend="commd")
    ps.initialize_model_parallel(tensor_model_parallel_size=n)
    tp = ps.get_tp_group()
    assert dist.get_backend(tp.device_group) == "commd", dist.get_backend(tp.device_group)
    c = CommdCommunicator(cpu_group=tp.cpu_group, device=torch.device("cpu"),
                          device_group=tp.device_group, unique_name="tp:0")
    assert isinstance(c, CudaCommunicator)
    assert c.pynccl_comm is None and c.ca_comm is None and c.fi_pcie_ipc_ar_comm is None

    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank
    want_sum = sum(torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * r for r in range(n))
    keep = x.clone()
    check("all_reduce", c.all_reduce(x), want_sum)
    check("all_reduce leaves its input", x, keep)
    check("all_gather dim -1", c.all_gather(x, dim=-1),
          torch.cat([keep - 100 * rank + 100 * r for r in range(n)], dim=-1))
    check("all_gather dim 0", c.all_gather(x, dim=0),
          torch.cat([keep - 100 * rank + 100 * r for r in range(n)], dim=0))
    big = torch.arange(4 * n, dtype=torch.float32).reshape(n * 2, 2) + rank
    want_rs = sum(torch.arange(4 * n, dtype=torch.float32).reshape(n * 2, 2) + r for r in range(n))
    check("reduce_scatter dim 0", c.reduce_scatter(big, dim=0), want_rs[2 * rank: 2 * rank + 2])
    # 3 dims, the last one scattered (vLLM's own moves axis 0 to dim instead: on 3+ dims it
    # scattered another axis, and returned another shape).
    cube = torch.arange(2 * 3 * 2 * n, dtype=torch.float32).reshape(2, 3, 2 * n) * (rank + 1)
    want_cube = torch.arange(2 * 3 * 2 * n, dtype=torch.float32).reshape(2, 3, 2 * n) * sum(
        r + 1 for r in range(n))
    check("reduce_scatter 3-D dim -1", c.reduce_scatter(cube, dim=-1),
          want_cube[:, :, 2 * rank: 2 * rank + 2])
    # The uneven path, 3 dims, the last one (rank r gets r + 1 of its elements).
    usz = [r + 1 for r in range(n)]
    u0 = sum(usz[:rank])
    ucube = torch.arange(2 * 3 * sum(usz), dtype=torch.float32).reshape(2, 3, sum(usz))
    check("reduce_scatterv 3-D dim -1", c.reduce_scatterv(ucube * (rank + 1), dim=-1, sizes=usz),
          (ucube * sum(r + 1 for r in range(n)))[:, :, u0: u0 + usz[rank]])
    # Uneven sizes: rank r has r + 1 rows.
    sizes = [r + 1 for r in range(n)]
    mine = torch.full((sizes[rank], 2), float(rank))
    check("all_gatherv", c.all_gatherv(mine, dim=0, sizes=sizes),
          torch.cat([torch.full((s, 2), float(r)) for r, s in enumerate(sizes)]))
    outs = c.all_gatherv([mine, mine + 10], dim=0, sizes=sizes)
    check("all_gatherv list", outs[1],
          torch.cat([torch.full((s, 2), float(r + 10)) for r, s in enumerate(sizes)]))
    rows = torch.arange(sum(sizes) * 2, dtype=torch.float32).reshape(sum(sizes), 2) * (rank + 1)
    total = torch.arange(sum(sizes) * 2, dtype=torch.float32).reshape(sum(sizes), 2) * sum(
        r + 1 for r in range(n))
    start = sum(sizes[:rank])
    check("reduce_scatterv", c.reduce_scatterv(rows, dim=0, sizes=sizes),
          total[start: start + sizes[rank]])
    out = torch.empty(sizes[rank], 2)
    c.reduce_scatterv_into_output(rows, out, dim=0, sizes=sizes)
    check("reduce_scatterv_into_output", out, total[start: start + sizes[rank]])
    # An output of another shape is refused (copy_ would broadcast one row into all of them).
    try:
        c.reduce_scatterv_into_output(rows, torch.empty(max(sizes) + 1, 2), dim=0, sizes=sizes)
        failures.append("reduce_scatterv_into_output took an output of another shape")
    except ValueError as e:
        if "output of shape" not in str(e):
            failures.append(f"reduce_scatterv_into_output's refusal: {e}")
    g = c.gather(torch.tensor([float(rank)]), dst=0, dim=0)
    if rank == 0:
        check("gather", g, torch.arange(n, dtype=torch.float32))
    elif g is not None:
        failures.append("gather returned a tensor off the destination")
    b = torch.full((3,), float(rank))
    check("broadcast", c.broadcast(b, src=n - 1), torch.full((3,), float(n - 1)))
    if rank == 0:
        c.send(torch.tensor([7.0, 8.0]), dst=n - 1)
    elif rank == n - 1:
        check("send/recv", c.recv(torch.Size([2]), torch.float32, src=0), torch.tensor([7.0, 8.0]))

    class Op:  # vLLM's P2P op shape: op, tensor, group_peer
        def __init__(self, op, tensor, group_peer):
            self.op, self.tensor, self.group_peer = op, tensor, group_peer

    got = torch.zeros(4)
    c.batch_isend_irecv([Op(dist.isend, torch.full((4,), float(rank)), (rank + 1) % n),
                         Op(dist.irecv, got, (rank - 1) % n)])
    check("batch_isend_irecv", got, torch.full((4,), float((rank - 1) % n)))
    # vLLM's graph_capture accepts the communicator (its isinstance check), then needs CUDA.
    tp.device_communicator = c
    try:
        with tp.graph_capture(ps.GraphCaptureContext(stream=None)):
            pass
    except AssertionError as e:
        failures.append(f"graph_capture refused the communicator: {e!r}")
    except Exception:  # noqa: BLE001 - no CUDA here: what comes after the check fails
        pass
    # MoE dispatch/combine (use_all2all: DP > 1 or expert parallelism): vLLM's default
    # all-gather/reduce-scatter manager, on this communicator's ops; other backends refused by
    # name.
    from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager
    ep = CommdCommunicator(cpu_group=tp.cpu_group, device=torch.device("cpu"),
                           device_group=tp.device_group, unique_name="ep:0", use_all2all=True)
    if not isinstance(ep.all2all_manager, AgRsAll2AllManager):
        failures.append(f"use_all2all built {ep.all2all_manager!r}")
    ep.destroy()
    cfg = VllmConfig()
    cfg.parallel_config.all2all_backend = "deepep_low_latency"
    with set_current_vllm_config(cfg):
        try:
            CommdCommunicator(cpu_group=tp.cpu_group, device=torch.device("cpu"),
                              device_group=tp.device_group, unique_name="ep:1",
                              use_all2all=True)
            failures.append("all2all_backend deepep_low_latency was accepted")
        except NotImplementedError as e:
            if "deepep_low_latency" not in str(e):
                failures.append(f"the all2all_backend refusal does not name it: {e}")
    # A process checkpoint cannot take the daemon session along: refused, not a silent no-op.
    try:
        c.checkpoint_prepare()
        failures.append("checkpoint_prepare did nothing")
    except NotImplementedError:
        pass
    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()

for f in failures:
    print("FAIL", f, flush=True)
if failures:
    sys.exit(1)
print(f"PASS rank {rank}", flush=True)
