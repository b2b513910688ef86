"""commd: client for the node-level commd communication daemon.

Quick start (numpy)::

    import commd, numpy as np
    client = commd.connect()               # $COMMD_SOCKET or the per-user default socket
    uid = client.unique_id()               # on one rank; hand the 128 bytes to the others
    comm = client.communicator(uid, rank, nranks)
    x = np.ones(1024, np.float32)
    comm.all_reduce(x)                      # in place; async_op=True returns a Handle

PyTorch: ``import commd.torch`` and ``dist.init_process_group("commd")``.

Errors are :class:`CommError` subclasses: :class:`MismatchError`, :class:`PeerLostError`,
:class:`CommTimeoutError`, :class:`DaemonUnavailableError` (names the socket it tried and how to
start the daemon), :class:`DaemonLostError`, :class:`AbortedError` (and its
:class:`RevokedError`: a rank revoked the communicator), :class:`ShutdownError`,
:class:`InvalidOpError`, :class:`UnsupportedError` (what commd cannot do correctly yet, e.g. a GPU op
captured on a communicator that spans nodes: refused, never run wrongly).
"""

from . import _native
from ._core import (
    REDUCE_OPS,
    Client,
    Communicator,
    Handle,
    connect,
    dtype_name,
    use_numpy_allocator,
)
from ._native import (
    AbortedError,
    CommError,
    CommTimeoutError,
    DaemonLostError,
    DaemonUnavailableError,
    InvalidOpError,
    MismatchError,
    PeerLostError,
    RevokedError,
    ShutdownError,
    UnsupportedError,
    default_socket,
)

__version__ = _native.version()

__all__ = [
    "REDUCE_OPS",
    "AbortedError",
    "Client",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "DaemonLostError",
    "DaemonUnavailableError",
    "Handle",
    "InvalidOpError",
    "MismatchError",
    "PeerLostError",
    "RevokedError",
    "ShutdownError",
    "UnsupportedError",
    "connect",
    "default_socket",
    "dtype_name",
    "use_numpy_allocator",
]
