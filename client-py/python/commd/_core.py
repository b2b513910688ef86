"""The numpy-level API: sessions, communicators and collectives on numpy arrays.

Data never crosses a socket: an op's inputs and outputs live in shared memory registered with
the daemon. Arrays allocated by :meth:`Client.empty` (or :meth:`Client.zeros`) already live there
and are used in place. Any other array is *staged*: copied into a pooled shared buffer before the
op and copied back into the caller's array (honouring its strides) when the op completes.

Ownership rule (as for NCCL and nonblocking MPI): while an async op is in flight, do not write
its inputs and do not read or write its outputs; :meth:`Handle.wait` ends the op.
"""

from __future__ import annotations

import bisect
import os
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import _native, _settings

__all__ = [
    "Client",
    "Communicator",
    "Handle",
    "connect",
    "dtype_name",
    "REDUCE_OPS",
]

#: Reduction names the daemon understands.
REDUCE_OPS = ("sum", "prod", "min", "max", "avg", "band", "bor", "bxor")
_ALIASES = {"product": "prod", "mean": "avg", "and": "band", "or": "bor", "xor": "bxor"}
_BITWISE = ("band", "bor", "bxor")

_NP_DTYPES = {
    np.dtype(np.float32): "f32",
    np.dtype(np.float64): "f64",
    np.dtype(np.float16): "f16",
    np.dtype(np.int8): "i8",
    np.dtype(np.uint8): "u8",
    np.dtype(np.int32): "i32",
    np.dtype(np.int64): "i64",
    np.dtype(np.uint32): "u32",
    np.dtype(np.uint64): "u64",
}
# fp8 arrays of ml_dtypes (numpy has no fp8 of its own), matched by name so that package stays
# optional; without it, pass uint8 arrays of fp8 codes with dtype="f8e4m3" or "f8e5m2".
_NP_NAMED = {"float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2"}
_FLOATS = ("f32", "f64", "f16", "bf16", "f8e4m3", "f8e5m2")

# Staged regions are placed on this alignment so reductions run on aligned data.
_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def dtype_name(dtype: Any) -> str:
    """The daemon's name for a numpy dtype (bool maps to u8); ValueError if unsupported."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return "u8"
    name = _NP_DTYPES.get(dt) or _NP_NAMED.get(dt.name)
    if name is None:
        raise ValueError(
            f"commd cannot reduce numpy dtype {dt} (supported: float32, float64, float16, "
            "int8, uint8, int32, int64, uint32, uint64, bool, ml_dtypes' float8_e4m3fn and "
            "float8_e5m2; bfloat16 through torch; fp8 codes in uint8 arrays with "
            "dtype='f8e4m3' or 'f8e5m2')"
        )
    return name


def _redop(op: str, dtype: str, is_bool: bool = False) -> str:
    op = _ALIASES.get(op.lower(), op.lower())
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r} (expected one of {', '.join(REDUCE_OPS)})")
    if op in _BITWISE and dtype in _FLOATS:
        raise ValueError(f"bitwise reduction {op} is defined for integer dtypes only (got {dtype})")
    if is_bool:
        # Logical semantics on 0/1 bytes: or-like ops are max, and-like ops are min.
        if op in ("sum", "max", "bor"):
            return "max"
        if op in ("prod", "min", "band"):
            return "min"
        raise ValueError(f"reduction {op} is not defined for bool arrays")
    return op


class _Pool:
    """Shared staging buffers, reused by size class (powers of two from 64 KiB)."""

    def __init__(self, native: _native.Client, keep_bytes: int = 1 << 30) -> None:
        self._native = native
        self._free: dict[int, list[_native.Buffer]] = {}
        self._kept = 0
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()

    @staticmethod
    def _class(n: int) -> int:
        return max(1 << 16, 1 << (max(n, 1) - 1).bit_length())

    def get(self, n: int) -> _native.Buffer:
        size = self._class(n)
        with self._lock:
            lst = self._free.get(size)
            if lst:
                self._kept -= size
                return lst.pop()
        return self._native.alloc(size)

    def put(self, buf: _native.Buffer) -> None:
        size = buf.nbytes
        with self._lock:
            if self._kept + size <= self._keep_bytes:
                self._free.setdefault(size, []).append(buf)
                self._kept += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._kept = 0


class _Registry:
    """Address ranges of user-visible shared buffers, to recognise arrays that live in them."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._entries: dict[int, tuple[int, weakref.ref[_native.Buffer]]] = {}
        self._lock = threading.Lock()

    def add(self, buf: _native.Buffer) -> None:
        addr = buf.address
        with self._lock:
            if addr not in self._entries:
                bisect.insort(self._starts, addr)
            self._entries[addr] = (buf.nbytes, weakref.ref(buf, lambda _r, a=addr: self._drop(a)))

    def _drop(self, addr: int) -> None:
        with self._lock:
            if addr in self._entries and self._entries[addr][1]() is None:
                del self._entries[addr]
                i = bisect.bisect_left(self._starts, addr)
                if i < len(self._starts) and self._starts[i] == addr:
                    self._starts.pop(i)

    def find(self, addr: int, nbytes: int) -> tuple[_native.Buffer, int] | None:
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            start = self._starts[i]
            size, ref = self._entries[start]
        buf = ref()
        if buf is None or addr + nbytes > start + size:
            return None
        return buf, addr - start


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


# Set when commd's CPU allocator serves allocations of at least this size in this process
# (commd.torch.use_cpu_allocator): Client.locate then looks arrays up in its blocks too.
_blocks_in_use = False
_blocks_min_bytes = 1 << 20


def use_numpy_allocator(min_bytes: int | None = None) -> bool:
    """Makes commd's allocator numpy's data allocator (NEP 49) for arrays of at least
    ``min_bytes`` (default ``COMMD_CPU_ALLOC_MIN``, else 1 MiB) made from now on in this thread
    (numpy keeps its handler per thread and context), so ops on them run in place. ``connect()``
    calls it unless ``COMMD_CPU_ALLOC=0``. Arrays keep the allocator that made them. The rules
    of :func:`commd.torch.use_cpu_allocator` apply (first op, fork). Returns False where numpy
    has no handler API (numpy < 1.22)."""
    import ctypes

    if min_bytes is None:
        min_bytes = _settings.size("COMMD_CPU_ALLOC_MIN", 1 << 20)
    min_bytes = max(int(min_bytes), 1)
    try:
        try:
            from numpy._core import _multiarray_umath as mu
        except ImportError:
            from numpy.core import _multiarray_umath as mu  # type: ignore[no-redef]
        if not hasattr(mu, "get_handler_name"):
            return False
        get = ctypes.pythonapi.PyCapsule_GetPointer
        get.restype = ctypes.c_void_p
        get.argtypes = [ctypes.py_object, ctypes.c_char_p]
        table = ctypes.cast(get(mu._ARRAY_API, None), ctypes.POINTER(ctypes.c_void_p))
        # PyDataMem_SetHandler is entry 304 of numpy's C API table (numpy >= 1.22); the GIL is
        # held through the call (PYFUNCTYPE).
        set_handler = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(table[304])
        set_handler(_native.numpy_mem_handler(min_bytes))
        ok = mu.get_handler_name() == "commd"
    except (AttributeError, ImportError, ValueError):
        return False
    if ok:
        _blocks_installed(min_bytes)
    return ok


def _blocks_installed(min_bytes: int) -> None:
    global _blocks_in_use, _blocks_min_bytes
    # The smallest size ever served: blocks made under an earlier, lower minimum still exist.
    _blocks_min_bytes = min(_blocks_min_bytes, min_bytes) if _blocks_in_use else min_bytes
    _blocks_in_use = True


# The peer of a receive from any source (commd_client::ANY_SOURCE).
_ANY_SOURCE = 0xFFFFFFFF

# Handles dropped before their op completed, with the arrays the op uses: the daemon may still
# read or write those arrays' memory, so it must not be freed (and handed to a new array by an
# allocator) until the op is done. Swept at every new op.
_orphans: list[tuple[list[Any], Any]] = []
_orphans_lock = threading.Lock()


def _sweep_orphans() -> None:
    with _orphans_lock:
        if not _orphans:
            return
        keep = []
        for reqs, arrays in _orphans:
            try:
                done = all(r.test() for r in reqs)
            except Exception:  # noqa: BLE001 - a failed op is done too
                done = True
            if not done:
                keep.append((reqs, arrays))
        _orphans[:] = keep


class Handle:
    """An op in flight. ``wait()`` completes it (and copies staged results back)."""

    def __init__(
        self,
        requests: Sequence[_native.Request],
        finish: Callable[[], None] | None = None,
        release: Callable[[], None] | None = None,
        result: Any = None,
        orphan: bool = True,
    ) -> None:
        """``orphan``: a handle dropped before its op completed keeps the op's arrays alive
        (in ``_orphans``) until a later op sees it done, because the daemon may still read or
        write their memory. False for GPU ops: their tensors are recorded on the op's stream
        (torch's allocator reuses them only after the stream passed the op) and their requests
        are let go at once (a dropped request's completion is discarded), so nothing waits for a
        sweep that only host ops make."""
        self._requests = list(requests)
        self._orphan = orphan
        self._finish = finish
        self._release = release
        self._result = result
        self._keep: Any = None  # the arrays the op uses, kept alive until it completes
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._source: int | None = None

    def _complete(self) -> None:
        # Called with the lock held once every request finished (or one failed).
        self._source = next((s for s in (getattr(r, "source", None) for r in self._requests)
                             if s is not None), None)
        try:
            if self._error is None and self._finish is not None:
                self._finish()
        except BaseException as e:  # noqa: BLE001 - kept and re-raised to every waiter
            self._error = e
        finally:
            self._done = True
            self._requests = []
            self._keep = None
            self._finish = None
            if self._release is not None:
                self._release()
                self._release = None

    def __del__(self) -> None:
        reqs = getattr(self, "_requests", None)
        if reqs and not getattr(self, "_done", True) and getattr(self, "_orphan", True):
            try:
                with _orphans_lock:
                    _orphans.append((reqs, (getattr(self, "_keep", None),
                                            getattr(self, "_result", None))))
            except Exception:  # noqa: BLE001 - interpreter shutdown: nothing is reused now
                pass

    def wait(self, timeout: float | None = None) -> Any:
        """Waits for the op (``timeout`` seconds; None: until done). Returns the op's result
        (the output array where the op has one). Raises the op's error, or TimeoutError when
        ``timeout`` passes first (the op keeps running)."""
        with self._lock:
            if self._done:
                if self._error is not None:
                    raise self._error
                return self._result
            requests = list(self._requests)
        # Blocked outside the lock: another thread (torch's progress thread) may wait for the
        # same op with no limit, and a caller's timed wait must still end on time.
        error: BaseException | None = None
        try:
            for r in requests:
                if not r.wait(timeout):
                    raise TimeoutError(f"commd op still running after {timeout} s")
        except _native.CommError as e:
            error = e
        with self._lock:
            if not self._done:
                self._error = error
                self._complete()
            if self._error is not None:
                raise self._error
            return self._result

    def is_completed(self) -> bool:
        """True once the op finished (successfully or not); never blocks."""
        with self._lock:
            if self._done:
                return True
            try:
                if not all(r.test() for r in self._requests):
                    return False
            except _native.CommError as e:
                self._error = e
            self._complete()
            return True

    test = is_completed

    def exception(self) -> BaseException | None:
        """The op's error once completed, else None."""
        with self._lock:
            return self._error

    def report_failure(self, what: str) -> None:
        """Prints the op's error on stderr once it fails ("commd: ERROR: {what}: {error}"),
        from a thread of the native library (no Python thread waits); nothing if it succeeds.
        For ops whose outcome nothing else waits for."""
        with self._lock:
            if not self._done:
                for r in self._requests:
                    r.report_failure(what)
                return
            e = self._error
        if e is not None:
            print(f"commd: ERROR: {what}: {e}", file=sys.stderr, flush=True)

    def source(self) -> int | None:
        """The rank a receive from any source (``recv(x, None)``) received from, once it
        completed; None before that and for every other op."""
        with self._lock:
            return self._source

    @staticmethod
    def done(result: Any = None) -> Handle:
        h = Handle([], None, None, result)
        h._done = True
        return h

    @staticmethod
    def all(handles: Sequence[Handle], result: Any = None) -> Handle:
        """One handle for several: waits for each in order."""

        def finish() -> None:
            for h in handles:
                h.wait()

        reqs: list[_native.Request] = []
        for h in handles:
            reqs.extend(h._requests)
        return Handle(reqs, finish, None, result)


class Client:
    """A session with the local commd daemon."""

    def __init__(self, socket: str | None = None, name: str | None = None) -> None:
        self._pid = os.getpid()
        self._native = _native.Client(socket, name)
        self._pool = _Pool(self._native)
        self._registry = _Registry()

    @property
    def socket(self) -> str:
        return self._native.socket

    @property
    def session_id(self) -> int:
        return self._native.session_id

    def unique_id(self) -> bytes:
        """A fresh communicator id: create it on one rank and hand it to all of them."""
        return self._native.unique_id()

    def communicator(
        self,
        unique_id: bytes,
        rank: int,
        nranks: int,
        *,
        op_timeout: float | None = None,
        join_timeout: float | None = None,
        switch: str | None = None,
        pacing_gbps: float | None = None,
        name: str | None = None,
    ) -> Communicator:
        """Joins ``unique_id`` as ``rank`` of ``nranks`` (blocks until every rank joined).
        Timeouts in seconds; None takes the daemon's defaults. ``switch``: ``"off"`` or a
        SwitchML controller ``"HOST:PORT"`` for the inter-node step of all-reduce (None: the
        daemon's ``switch`` setting).

        ``pacing_gbps``: a cap, in GB/s (1e9 bytes/s), on the bandwidth the daemon's GPU copies
        for this communicator use on this node, so that its collectives leave room for compute
        (full-rate copies slow a concurrent GEMM). None: the daemon's ``gpu_pacing_gbps``
        setting (uncapped unless configured); 0: uncapped; otherwise at least 0.001 (1 MB/s).
        Every rank on a node must ask for the same cap (None counts as the daemon's default),
        else this raises :class:`CommError` naming both values. Negative or NaN values raise
        ValueError. Host (numpy) ops are not paced. Change it later with
        :meth:`Communicator.set_pacing`.

        ``name``: shown in ``commd status``, logs and errors beside the communicator's id (at
        most 128 bytes of printable text); the first rank on a node to give one names it."""
        c = self._native.communicator(
            bytes(unique_id), rank, nranks, op_timeout, join_timeout, switch, pacing_gbps, name
        )
        return Communicator(self, c)

    def empty(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """An array in shared memory: ops on it need no staging copy."""
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) if not isinstance(shape, int) else shape
        buf = self.alloc(max(n * dt.itemsize, 1))
        return np.frombuffer(buf, dtype=dt, count=n).reshape(shape)

    def zeros(self, shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
        """Like :meth:`empty`; shared memory starts zero-filled."""
        return self.empty(shape, dtype)

    def alloc(self, nbytes: int) -> _native.Buffer:
        """A raw shared buffer (buffer protocol), recognised by ops as zero-copy memory."""
        buf = self._native.alloc(nbytes)
        self._registry.add(buf)
        return buf

    def locate(self, a: np.ndarray) -> tuple[_native.Buffer, int] | None:
        """(buffer, byte offset) if ``a`` is a C-contiguous array inside a shared buffer, or
        inside a block of commd's CPU allocator (see :func:`commd.torch.use_cpu_allocator`),
        which this moves into shared memory on its first op."""
        if a.nbytes == 0 or not a.flags.c_contiguous:
            return None
        found = self._registry.find(_address(a), a.nbytes)
        if found is None and _blocks_in_use and a.nbytes >= _blocks_min_bytes:
            found = self._native.adopt(_address(a), a.nbytes)
        return found

    def status(self) -> dict[str, Any]:
        import json

        return json.loads(self._native.status_json())


_default: Client | None = None
_default_lock = threading.Lock()
# Sessions inherited through fork(): they belong to the parent (its runtime, its session), so
# the child never uses them and never drops them (dropping would end the parent's session).
_inherited: list[Any] = []


def _after_fork_in_child() -> None:
    global _default, _default_lock, _orphans, _orphans_lock
    if _default is not None:
        _inherited.append(_default)
    _default = None
    _default_lock = threading.Lock()
    # The parent's dropped handles: its ops, never touched here (kept, like its sessions).
    _inherited.append(_orphans)
    _orphans = []
    _orphans_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def connect(socket: str | None = None, name: str | None = None) -> Client:
    """The process-wide session (created on first use). With ``socket`` given and different
    from the current session's, a new session is created and becomes the default. A child
    process made by fork() gets its own session on first use."""
    global _default
    with _default_lock:
        if _default is None or (socket is not None and socket != _default.socket):
            _default = Client(socket, name)
            if _settings.flag("COMMD_CPU_ALLOC", True):
                use_numpy_allocator()
        return _default


class _Stage:
    """The memory of one op: each side either points into a shared buffer (zero copy) or into
    a leased staging buffer; staged inputs are copied in now, staged outputs on completion."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.lease: _native.Buffer | None = None

    def release(self) -> None:
        if self.lease is not None:
            self.client._pool.put(self.lease)
            self.lease = None


def _flat_bytes(arrays: Sequence[np.ndarray]) -> int:
    return sum(a.nbytes for a in arrays)


def _copy_in(buf: _native.Buffer, off: int, arrays: Sequence[np.ndarray]) -> None:
    mv = memoryview(buf)
    for a in arrays:
        if a.nbytes:
            dst = np.frombuffer(mv, dtype=a.dtype, count=a.size, offset=off).reshape(a.shape)
            np.copyto(dst, a, casting="no")
        off += a.nbytes


def _copy_out(buf: _native.Buffer, off: int, arrays: Sequence[np.ndarray]) -> None:
    mv = memoryview(buf)
    for a in arrays:
        if a.nbytes:
            src = np.frombuffer(mv, dtype=a.dtype, count=a.size, offset=off).reshape(a.shape)
            np.copyto(a, src, casting="no")
        off += a.nbytes


class Communicator:
    """A communicator over numpy arrays. Ops are in place unless ``out`` is given; with
    ``async_op=True`` they return a :class:`Handle`, else they block and return the result."""

    def __init__(self, client: Client, native: _native.Communicator) -> None:
        self.client = client
        self._native = native
        self.rank: int = native.rank
        self.nranks: int = native.nranks
        self._lock = threading.Lock()

    size = property(lambda self: self.nranks)

    @property
    def id(self) -> int:
        return self._native.id

    @property
    def paths(self) -> list[str]:
        """How this communicator's data moves on this node, one line per path, as the daemon
        described it at init (empty for one rank)."""
        return list(self._native.paths)

    @property
    def ranks_share_a_process(self) -> bool:
        """Whether two of this communicator's ranks on this node are one process (threads of
        it), as the daemon said at init: eager GPU ops then never run as direct ops
        (docs/contracts.md #7), whose setup blocks a rank until every rank takes part."""
        return bool(self._native.ranks_share_a_process)

    @property
    def nodes(self) -> int:
        """Nodes (daemons) this communicator spans; above 1 its GPU ops are staged through host
        memory by the daemons (see docs/multinode.md)."""
        return self._native.nodes

    def failure(self) -> tuple[str, str] | None:
        """Why the daemon holds this communicator broken for good, as ``(status, reason)``
        (status: ``"peer_lost"``, ``"timeout"``, ``"mismatch"``, ``"aborted"``, ``"revoked"``,
        ``"shutdown"``, ``"invalid"`` or ``"internal"``); None while it works. Asks the
        daemon (one round trip). A closed communicator is ``("aborted", ...)``."""
        try:
            return self._native.failure()
        except _native.AbortedError as e:
            return ("aborted", str(e))

    def close(self) -> None:
        """Destroys the communicator (other ranks' later ops fail with PeerLostError)."""
        self._native.close()

    def revoke(self, reason: str = "") -> None:
        """Revokes the communicator for every rank: their queued and later ops fail with
        :class:`RevokedError`, which names this rank and ``reason``. It can still be shrunk."""
        self._native.revoke(reason)

    def shrink(
        self,
        exclude: list[int],
        *,
        abort: bool = False,
        op_timeout: float | None = None,
        join_timeout: float | None = None,
        name: str | None = None,
    ) -> Communicator:
        """A child communicator without the ranks in ``exclude`` (dead, or leaving), the
        others renumbered in order, as NCCL's ``ncclCommShrink`` does. The daemons make it from
        this communicator's membership: no unique id to share, no rendezvous. Every surviving
        rank calls it with the same list (else every one of them gets :class:`ValueError`
        naming the lists); an excluded rank must not call it. This communicator may be broken
        (a rank died, it was revoked); it stays valid as a parent until closed. With
        ``abort=True`` it is revoked first (pending ops fail on every rank); else this rank's
        pending ops on it finish first. Times in seconds (None: the parent's op timeout, the
        daemon's join timeout); ``name`` defaults to the parent's."""
        native = self._native.shrink(
            [int(r) for r in exclude],
            abort=abort,
            op_timeout=op_timeout,
            join_timeout=join_timeout,
            name=name,
        )
        return Communicator(self.client, native)

    def set_pacing(self, gbps: float | None) -> None:
        """Caps the bandwidth of the daemon's GPU copies for this communicator at ``gbps`` GB/s
        (1e9 bytes/s); None or 0: uncapped; otherwise at least 0.001 (1 MB/s). Any rank may
        call it; it applies to every rank of the communicator on this node (the daemon holds
        one cap per communicator and node) from its next copy phase on, and ``commd status``
        shows it. Negative or NaN values raise ValueError; a value the daemon refuses raises
        :class:`CommError` with its reason."""
        self._native.set_pacing(gbps)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<commd.Communicator rank {self.rank}/{self.nranks}>"

    # -- the generic staged op ----------------------------------------------------------

    def _run(
        self,
        kind: str,
        dtype: str,
        count: int,
        ins: Sequence[np.ndarray],
        outs: Sequence[np.ndarray],
        *,
        redop: str | None = None,
        peer: int = 0,
        in_off: int | None = None,
        region: int | None = None,
        out_off: int = 0,
        async_op: bool = False,
        result: Any = None,
    ) -> Any:
        """Posts one op. ``ins`` are concatenated into the send region, ``outs`` are filled
        from the recv region. With ``in_off`` given the op runs in place in one staged region
        of ``region`` bytes: inputs at ``in_off``, outputs read from ``out_off`` (NCCL's
        in-place layouts)."""
        _sweep_orphans()
        sbytes, rbytes = _flat_bytes(ins), _flat_bytes(outs)
        stage = _Stage(self.client)
        send = recv = None
        finish: Callable[[], None] | None = None
        zs = self.client.locate(ins[0]) if len(ins) == 1 else None
        zr = self.client.locate(outs[0]) if len(outs) == 1 else None
        if in_off is not None and zs is not None and zr is not None:
            # Both sides are shared memory already (in place or not, one buffer or two): no
            # staging at all.
            send, recv = zs, zr
        elif in_off is not None:
            size = region if region is not None else max(sbytes, rbytes)
            stage.lease = self.client._pool.get(size)
            _copy_in(stage.lease, in_off, ins)
            send, recv = (stage.lease, in_off), (stage.lease, out_off)
            if outs:
                finish = self._copier(stage.lease, out_off, outs)
        else:
            need = (0 if (zs or not ins) else _align(sbytes)) + (0 if (zr or not outs) else rbytes)
            if (ins and zs is None) or (outs and zr is None):  # (empty arrays: a 0-byte lease)
                stage.lease = self.client._pool.get(need)
            off = 0
            if ins:
                if zs is None:
                    assert stage.lease is not None
                    _copy_in(stage.lease, 0, ins)
                    send = (stage.lease, 0)
                    off = _align(sbytes)
                else:
                    send = zs
            if outs:
                if zr is None:
                    assert stage.lease is not None
                    recv = (stage.lease, off)
                    finish = self._copier(stage.lease, off, outs)
                else:
                    recv = zr
        try:
            req = self._native.post(kind, dtype, count, send, recv, redop, peer)
        except BaseException:
            stage.release()
            raise
        h = Handle([req], finish, stage.release, result)
        h._keep = (ins, outs)
        return h if async_op else h.wait()

    @staticmethod
    def _copier(buf: _native.Buffer, off: int, outs: Sequence[np.ndarray]) -> Callable[[], None]:
        return lambda: _copy_out(buf, off, outs)

    def _check_root(self, root: int, what: str) -> None:
        if not 0 <= root < self.nranks:
            raise ValueError(f"{what} {root} is out of range for {self.nranks} ranks")

    # -- collectives ---------------------------------------------------------------------

    def all_reduce(
        self,
        x: np.ndarray,
        out: np.ndarray | None = None,
        op: str = "sum",
        *,
        dtype: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduces ``x`` over all ranks into ``out`` (default: ``x`` itself). Returns ``out``."""
        out = x if out is None else out
        _same(x, out, "all_reduce")
        dt = dtype or dtype_name(x.dtype)
        red = _redop(op, dt, x.dtype == np.bool_)
        if out is x or self.client.locate(x) is None or self.client.locate(out) is None:
            return self._run("all_reduce", dt, x.size, [x], [out], redop=red, in_off=0,
                             async_op=async_op, result=out)
        return self._run("all_reduce", dt, x.size, [x], [out], redop=red, async_op=async_op,
                         result=out)

    def all_reduce_coalesced(self, xs: Sequence[np.ndarray], op: str = "sum", *,
                             dtype: str | None = None, async_op: bool = False) -> Any:
        """All-reduces several arrays of one dtype in place, as one op."""
        if not xs:
            raise ValueError("all_reduce_coalesced needs at least one array")
        dt = dtype or dtype_name(xs[0].dtype)
        if dtype is None and any(dtype_name(x.dtype) != dt for x in xs):
            raise ValueError("all_reduce_coalesced: arrays must share one dtype")
        red = _redop(op, dt, xs[0].dtype == np.bool_)
        count = sum(x.size for x in xs)
        return self._run("all_reduce", dt, count, list(xs), list(xs), redop=red, in_off=0,
                         async_op=async_op, result=list(xs))

    def broadcast(self, x: np.ndarray, root: int = 0, *, dtype: str | None = None,
                  async_op: bool = False) -> Any:
        """Copies root's ``x`` into every rank's ``x``."""
        self._check_root(root, "root")
        dt = dtype or "u8"
        count = x.size if dtype else x.nbytes
        return self._run("broadcast", dt, count, [x] if self.rank == root else [], [x],
                         peer=root, in_off=0, async_op=async_op, result=x)

    def reduce(self, x: np.ndarray, root: int = 0, out: np.ndarray | None = None,
               op: str = "sum", *, dtype: str | None = None, async_op: bool = False) -> Any:
        """Reduces every rank's ``x`` into root's ``out`` (default: root's ``x``)."""
        self._check_root(root, "root")
        out = x if out is None else out
        _same(x, out, "reduce")
        dt = dtype or dtype_name(x.dtype)
        red = _redop(op, dt, x.dtype == np.bool_)
        outs = [out] if self.rank == root else []
        return self._run("reduce", dt, x.size, [x], outs, redop=red, peer=root, in_off=0,
                         region=x.nbytes, async_op=async_op, result=out)

    def all_gather(self, x: np.ndarray, out: np.ndarray | Sequence[np.ndarray] | None = None,
                   *, dtype: str | None = None, async_op: bool = False) -> Any:
        """Gathers every rank's ``x``: ``out`` is an array of ``nranks * x.size`` elements (or a
        list of ``nranks`` arrays like ``x``); default: a new array of shape (nranks, *x.shape)."""
        if out is None:
            out = np.empty((self.nranks, *x.shape), dtype=x.dtype)
        outs = _split_out(out, self.nranks, x, "all_gather")
        dt = dtype or "u8"
        count = x.size if dtype else x.nbytes
        return self._run("all_gather", dt, count, [x], outs, in_off=self.rank * x.nbytes,
                         region=x.nbytes * self.nranks, async_op=async_op, result=out)

    def reduce_scatter(self, x: np.ndarray | Sequence[np.ndarray], out: np.ndarray,
                       op: str = "sum", *, dtype: str | None = None,
                       async_op: bool = False) -> Any:
        """Reduces ``x`` (``nranks * out.size`` elements, or a list of ``nranks`` arrays like
        ``out``) over all ranks; rank r receives block r in ``out``."""
        ins = _split_out(x, self.nranks, out, "reduce_scatter")
        dt = dtype or dtype_name(out.dtype)
        red = _redop(op, dt, out.dtype == np.bool_)
        return self._run("reduce_scatter", dt, out.size, ins, [out], redop=red, in_off=0,
                         region=out.nbytes * self.nranks, out_off=self.rank * out.nbytes,
                         async_op=async_op, result=out)

    def all_to_all(self, x: np.ndarray, out: np.ndarray | None = None, *,
                   dtype: str | None = None, async_op: bool = False) -> Any:
        """Block j of rank i's ``x`` goes to block i of rank j's ``out`` (equal blocks)."""
        out = np.empty_like(x) if out is None else out
        if x.nbytes != out.nbytes or x.nbytes % self.nranks:
            raise ValueError(
                f"all_to_all needs equal input and output sizes divisible by {self.nranks} "
                f"ranks (got {x.nbytes} and {out.nbytes} bytes); use all_to_all_v for uneven "
                "splits")
        dt = dtype or "u8"
        count = (x.size if dtype else x.nbytes) // self.nranks
        return self._run("all_to_all", dt, count, [x], [out], async_op=async_op, result=out)

    def all_to_all_v(self, ins: Sequence[np.ndarray], outs: Sequence[np.ndarray], *,
                     async_op: bool = False) -> Any:
        """Uneven all-to-all: ``ins[j]`` goes to rank j, ``outs[j]`` comes from rank j (any
        sizes, as long as each pair agrees). Built from grouped sends and receives."""
        if len(ins) != self.nranks or len(outs) != self.nranks:
            raise ValueError(f"all_to_all_v needs {self.nranks} inputs and outputs")
        handles: list[Handle] = []
        try:
            for j in range(self.nranks):
                if j == self.rank:
                    continue
                if ins[j].nbytes:
                    handles.append(self._run("send", "u8", ins[j].nbytes, [ins[j]], [],
                                             peer=j, async_op=True))
                if outs[j].nbytes:
                    handles.append(self._run("recv", "u8", outs[j].nbytes, [], [outs[j]],
                                             peer=j, async_op=True))
            if outs[self.rank].nbytes != ins[self.rank].nbytes:
                raise ValueError(
                    f"all_to_all_v: rank {self.rank} sends itself {ins[self.rank].nbytes} bytes "
                    f"but expects {outs[self.rank].nbytes}")
            np.copyto(outs[self.rank], ins[self.rank].reshape(outs[self.rank].shape),
                      casting="no")
        except BaseException:
            drain(handles)
            raise
        h = Handle.all(handles, list(outs))
        return h if async_op else h.wait()

    def send(self, x: np.ndarray, peer: int, *, async_op: bool = False) -> Any:
        """Sends ``x`` to ``peer`` (matched in order with peer's recv from this rank)."""
        self._check_root(peer, "peer")
        return self._run("send", "u8", x.nbytes, [x], [], peer=peer, async_op=async_op)

    def recv(self, x: np.ndarray, peer: int | None, *, async_op: bool = False) -> Any:
        """Receives into ``x`` from ``peer``. ``peer=None`` receives from whichever rank sends
        to this one first (communicators on one node only): with ``async_op=True`` the Handle's
        ``source()`` then names the sender. It takes that sender's next message, as a receive
        naming it would, and receives posted after it get the messages after it."""
        if peer is None:
            return self._run("recv", "u8", x.nbytes, [], [x], peer=_ANY_SOURCE,
                             async_op=async_op, result=x)
        self._check_root(peer, "peer")
        return self._run("recv", "u8", x.nbytes, [], [x], peer=peer, async_op=async_op,
                         result=x)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Returns once every rank entered the barrier."""
        h = Handle([self._native.post("barrier", "u8", 0)])
        return h if async_op else h.wait()


def drain(handles: Sequence[Handle]) -> None:
    """Waits for every handle, ignoring their errors: after a later post failed, the ops already
    posted must finish before their buffers go back to the pool."""
    for h in handles:
        try:
            h.wait()
        except BaseException:  # noqa: BLE001 - the caller reports the error that stopped it
            pass


def _same(x: np.ndarray, out: np.ndarray, what: str) -> None:
    if x.dtype != out.dtype or x.size != out.size:
        raise ValueError(f"{what}: out must match x ({x.size} x {x.dtype}), got "
                         f"{out.size} x {out.dtype}")


def _split_out(buf: np.ndarray | Sequence[np.ndarray], n: int, like: np.ndarray,
               what: str) -> list[np.ndarray]:
    """``buf`` as ``n`` blocks of ``like``'s size and dtype."""
    if isinstance(buf, np.ndarray):
        if buf.dtype != like.dtype or buf.size != n * like.size:
            raise ValueError(f"{what}: expected {n} x {like.size} elements of {like.dtype}, "
                             f"got {buf.size} of {buf.dtype}")
        return [buf]
    blocks = list(buf)
    if len(blocks) != n or any(b.dtype != like.dtype or b.size != like.size for b in blocks):
        raise ValueError(f"{what}: expected {n} arrays of {like.size} x {like.dtype}")
    return blocks
