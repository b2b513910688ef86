"""What the ``commd`` torch backend takes from the job's environment at start and reports to
it: torch's ``env://`` variables filled in from mpirun's (Open MPI, PMI) when they are absent,
and the ``COMMD_DEBUG=INFO`` report of each rank's communicator at init (as ``NCCL_DEBUG=INFO``).
Used by ``commd.torch``; imports no other part of the backend."""

from __future__ import annotations

import os
import sys
import threading
import zlib
from typing import Any

from . import _settings


def _debug_level() -> int:
    """COMMD_DEBUG in the job (as NCCL_DEBUG): 0 quiet, 1 WARN, 2 INFO and above."""
    v = _settings.get("COMMD_DEBUG").upper()
    return {"WARN": 1, "WARNING": 1, "ERROR": 1, "INFO": 2, "DEBUG": 2, "TRACE": 2}.get(v, 0)


def _debug_subsys_init() -> bool:
    v = _settings.get("COMMD_DEBUG_SUBSYS").upper()
    if not v or v == "ALL":
        return True
    names = {s.strip() for s in v.lstrip("^").split(",")}
    return ("INIT" in names) != v.startswith("^")


def _debug_init(b: Any, group_name: str) -> None:
    """Under COMMD_DEBUG=INFO, each rank prints its communicator and the daemon's paths for
    it, as NCCL_DEBUG=INFO does at init."""
    if _debug_level() < 2 or not _debug_subsys_init():
        return
    import socket

    head = f"{socket.gethostname()}:{os.getpid()}:{threading.get_native_id()} commd INFO"
    c = b.comm
    # "comm N" in decimal, as the daemon's errors, logs and `commd status` spell it.
    lines = [f"{head} group {group_name or '(default)'} rank {b._rank} nranks {b._size}: commd "
             f"communicator comm {c.id}, {c.nodes} node(s), daemon {b.client.socket} - Init COMPLETE"]
    lines += [f"{head} comm {c.id}: {p}" for p in c.paths]
    print("\n".join(lines), file=sys.stderr, flush=True)


def _env_from_launcher() -> None:
    """Fills torch's env:// variables from mpirun (Open MPI, or PMI) when they are absent."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return
    for rank, size, lrank, lsize in (
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ):
        if rank in env and size in env:
            env.setdefault("RANK", env[rank])
            env.setdefault("WORLD_SIZE", env[size])
            if lrank in env:
                env.setdefault("LOCAL_RANK", env[lrank])
            if lsize in env:
                env.setdefault("LOCAL_WORLD_SIZE", env[lsize])
            single_node = env.get(lsize) == env[size]
            if single_node:
                env.setdefault("MASTER_ADDR", "127.0.0.1")
            # Every rank derives the same port from the job's id, below Linux's default
            # ephemeral range (32768-60999): a port in that range can be taken by any outgoing
            # connection on rank 0's host (EADDRINUSE).
            job = (env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
                   or env.get("OMPI_MCA_orte_ess_jobid") or env.get("PMI_ID_JOB") or "")
            if job and "MASTER_PORT" not in env:
                env["MASTER_PORT"] = str(_MPI_PORT_LOW + zlib.crc32(job.encode())
                                         % (_MPI_PORT_END - _MPI_PORT_LOW))
            return


# The MASTER_PORT range derived from an MPI job's id (``_env_from_launcher``): 20000-32767, below
# Linux's default ephemeral ports. A job that needs another sets MASTER_PORT itself.
_MPI_PORT_LOW = 20000
_MPI_PORT_END = 32768
