"""commd's vLLM plugin (client-py/python/commd/vllm) against vLLM 0.33's own code, on CPU: vLLM's
plugin loader finds the entry point and resolves the platform only when COMMD_VLLM=1; the
platform class and the communicator satisfy vLLM's classes; vLLM's parallel_state builds its
groups on the "commd" backend and commd's communicator runs every op on them (real daemon, real
ranks). Runs with the Python of a venv holding vLLM (scripts/test makes target/vllm-venv; or
COMMD_VLLM_PYTHON). The GPU side (CUDA graphs, vLLM's own engine) is scripts/gpu-check.sh's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_torch import free_port, job_env

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = os.environ.get("COMMD_VLLM_PYTHON", str(ROOT / "target" / "vllm-venv" / "bin" / "python"))
WORKER = str(Path(__file__).resolve().parent / "vllm_worker.py")


@pytest.fixture(scope="module")
def vpy():
    if not os.path.exists(VLLM_PY):
        msg = f"no vLLM venv at {VLLM_PY} (scripts/test makes it)"
        if os.environ.get("COMMD_REQUIRE_ALL") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return VLLM_PY


def py(vpy, code, **env):
    e = dict(os.environ)
    e.pop("COMMD_VLLM", None)
    e.update(env)
    return subprocess.run([vpy, "-c", code], capture_output=True, text=True, timeout=300, env=e)


RESOLVE = ("from vllm.platforms import resolve_current_platform_cls_qualname as r; "
           "print('PLATFORM', r())")


def platform_of(out):
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("PLATFORM ")]
    assert out.returncode == 0 and lines, out.stdout + out.stderr
    return lines[-1].split(" ", 1)[1]


def test_vllm_plugin_loader_picks_commd_only_when_asked(vpy):
    assert platform_of(py(vpy, RESOLVE, COMMD_VLLM="1")) == "commd.vllm.platform.CommdCudaPlatform"
    assert not platform_of(py(vpy, RESOLVE)).startswith("commd"), "active without COMMD_VLLM"
    assert not platform_of(py(vpy, RESOLVE, COMMD_VLLM="0")).startswith("commd")
    # VLLM_PLUGINS filters by entry-point name: "commd" is the name.
    assert platform_of(py(vpy, RESOLVE, COMMD_VLLM="1", VLLM_PLUGINS="commd")).startswith("commd")
    assert not platform_of(py(vpy, RESOLVE, COMMD_VLLM="1", VLLM_PLUGINS="other")).startswith("commd")
    # A value that is neither on nor off: not active, and vLLM logs commd's reason.
    out = py(vpy, RESOLVE, COMMD_VLLM="maybe")
    assert not platform_of(out).startswith("commd")
    assert "COMMD_VLLM='maybe'" in out.stdout + out.stderr, out.stdout + out.stderr


# vllm.platforms.cuda loads vLLM's CUDA extension, which needs libcuda (absent here): a stand-in
# module lets the platform class be imported and checked against vLLM's classes.
CLASSES = """
import sys, types
sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
from vllm.platforms.cuda import CudaPlatformBase
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
from commd.vllm.platform import CommdCudaPlatform
from commd.vllm.communicator import CommdCommunicator
import torch.distributed as dist
assert issubclass(CommdCudaPlatform, CudaPlatformBase), CommdCudaPlatform.__mro__
assert CommdCudaPlatform.dist_backend == "commd"
assert dist.is_backend_available("commd")
cls = resolve_obj_by_qualname(CommdCudaPlatform.get_device_communicator_cls())
assert cls is CommdCommunicator and issubclass(cls, CudaCommunicator)
# vLLM's fused all-reduce + RMSNorm pass (FlashInfer's kernel, on by default from -O2 on Hopper)
# would replace the TP all-reduce: the platform's config hook turns it off.
import types
from vllm.config.compilation import PassConfig
from commd.vllm.platform import keep_collectives_on_commd
assert "check_and_update_config" in vars(CommdCudaPlatform)
pc = PassConfig(fuse_allreduce_rms=True)
cfg = types.SimpleNamespace(compilation_config=types.SimpleNamespace(pass_config=pc))
assert keep_collectives_on_commd(cfg) == ["fuse_allreduce_rms"], pc
assert pc.fuse_allreduce_rms is False
assert keep_collectives_on_commd(cfg) == []
# vLLM's stateless device groups (elastic EP) would be NCCL's: refused by name.
try:
    CommdCudaPlatform.stateless_init_device_torch_dist_pg("commd", None, 0, 1, None)
    raise AssertionError("a stateless device group was made")
except NotImplementedError as e:
    assert "elastic expert parallelism" in str(e), e
print("CLASSES OK")
"""


def test_platform_class_is_vllms_cuda_platform_on_commd(vpy):
    out = py(vpy, CLASSES)
    assert out.returncode == 0 and "CLASSES OK" in out.stdout, out.stdout + out.stderr[-3000:]


CONTRACT = """
import inspect
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
from vllm.distributed.device_communicators.cuda_communicator import CudaCommunicator
from commd.vllm.communicator import CommdCommunicator
bad = []
names = {n for c in (DeviceCommunicatorBase, CudaCommunicator) for n, v in vars(c).items()
         if callable(v) and (not n.startswith("_") or n == "__init__")}
for n in sorted(names):
    if n not in vars(CommdCommunicator):
        if n in vars(CudaCommunicator):
            bad.append(f"{n}: CudaCommunicator's own (PyNCCL/custom paths) would run")
        continue
    if getattr(vars(CommdCommunicator)[n], "_commd_refused", False):
        bad.append(f"{n}: not implemented (refused at run time)")
        continue
    ours = inspect.signature(getattr(CommdCommunicator, n))
    ref = inspect.signature(getattr(CudaCommunicator, n))
    if [p.kind for p in ours.parameters.values()][1:] == [inspect.Parameter.VAR_POSITIONAL,
                                                           inspect.Parameter.VAR_KEYWORD]:
        continue
    if list(ours.parameters) != list(ref.parameters):
        bad.append(f"{n}{ours} differs from vLLM's {n}{ref}")
print("\\n".join(bad) or "CONTRACT OK")
"""


def test_communicator_overrides_every_vllm_path_with_vllms_signatures(vpy):
    out = py(vpy, CONTRACT)
    assert out.returncode == 0 and "CONTRACT OK" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("nproc", [2, 3])
def test_vllm_parallel_state_drives_commd_communicator(daemon, vpy, nproc):
    cmd = [vpy, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", WORKER]
    # vLLM's CPU platform (its config needs a device type; VLLM_TARGET_DEVICE=cpu skips the
    # plugins): the groups' backend is the one passed to init_distributed_environment, "commd".
    p = subprocess.run(cmd, env=job_env(daemon, VLLM_TARGET_DEVICE="cpu"), capture_output=True,
                       text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-6000:]
    for r in range(nproc):
        assert f"PASS rank {r}" in out, out[-6000:]
