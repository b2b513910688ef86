"""The Works and futures of commd's torch backend, CPU and CUDA alike: torch's ``Work`` over a
commd ``Handle`` (its errors raised as torch's ``DistBackendError``), the progress thread that
completes futures nobody waits on, a Work with nothing to wait for, and several GPU Works
joined as one.

Below both ``commd.torch`` (the backend) and ``commd._torch_cuda`` (its CUDA path); imports
neither."""

from __future__ import annotations

import atexit
import queue
import threading
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work as _Work
from torch.futures import Future

from . import _native
from ._core import Handle


def _seconds(timeout: Any) -> float | None:
    if timeout is None:
        return None
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout) / 1000.0
    return s if s > 0 else None


# How long the progress thread waits on its oldest op before it looks at the others.
_PROGRESS_SLICE_S = 0.002


class _Progress:
    """Completes futures of ops nobody waits on directly (DDP's reducer, get_future().then).

    The thread is a daemon (a pending op must not keep the process alive), and it is stopped at
    interpreter exit, before Python kills daemon threads: one killed while it completes a torch
    future (torch releases the GIL there and takes it back in a destructor) ends the process in
    ``std::terminate``."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Handle, Future, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopping = False

    def watch(self, h: Handle, fut: Future, value: Any) -> None:
        with self._lock:
            if self._stopping:
                return  # the interpreter is exiting: nobody is left to read the future
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="commd-progress",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.stop)
        self._q.put((h, fut, value))

    def stop(self, timeout: float = 5.0) -> None:
        """Stops the thread after the round it is in (futures still pending stay incomplete:
        the process is exiting)."""
        with self._lock:
            self._stopping = True
            t = self._thread
        if t is not None:
            self._q.put(None)
            t.join(timeout)

    def _run(self) -> None:
        # Every watched op completes its future when it is done, whatever the order: one that
        # never ends (a receive nobody sends to, until its op timeout) must not hold back the
        # futures of the others (DDP's reducer waits on them). The thread sleeps in the native
        # wait of the oldest, a few ms at a time, and looks at the rest between.
        pending: list[tuple[Handle, Future, Any]] = []
        while not self._stopping:
            got = [self._q.get()] if not pending else []
            while True:
                try:
                    got.append(self._q.get_nowait())
                except queue.Empty:
                    break
            pending.extend(item for item in got if item is not None)
            still = []
            for item in pending:
                if self._stopping:
                    return
                if item[0].is_completed():
                    self._finish(*item)
                else:
                    still.append(item)
            pending = still
            if pending:
                try:
                    pending[0][0].wait(_PROGRESS_SLICE_S)
                except BaseException:  # noqa: BLE001 - a timeout, or its error: seen next round
                    pass

    @staticmethod
    def _finish(h: Handle, fut: Future, value: Any) -> None:
        _settle(h, fut, value)


_progress = _Progress()

# Completes a future once, whoever comes first: the progress thread, or the wait() of its Work
# (so the future is done when wait() returns, as gloo's). Reentrant: a callback that runs
# inside set_result may wait on another Work.
_settle_lock = threading.RLock()


def _settle(h: Handle, fut: Future, value: Any) -> None:
    """Completes ``fut`` with ``value``, or with the error of ``h`` (a completed op), unless
    it is done already."""
    with _settle_lock:
        if fut.done():
            return
        e = h.exception()
        if e is None:
            fut.set_result(value)
        else:
            fut.set_exception(_dist_error(e))


_DIST_KINDS: dict[type, type] = {}


def _dist_error(e: BaseException) -> BaseException:
    """``e`` (a commd error) as an instance of a class that is both its commd class and
    torch's ``DistBackendError`` (a ``RuntimeError``), so callers' ``except`` clauses written for
    torch's backends keep working; other exceptions are returned unchanged."""
    if not isinstance(e, _native.CommError) or isinstance(e, dist.DistBackendError):
        return e
    cls = type(e)
    kind = _DIST_KINDS.get(cls)
    if kind is None:
        # A timeout is also Python's TimeoutError, so `except TimeoutError` catches it too.
        extra = (TimeoutError,) if issubclass(cls, _native.CommTimeoutError) else ()
        kind = type(cls.__name__, (cls, dist.DistBackendError, *extra),
                    {"__module__": "commd.torch"})
        _DIST_KINDS[cls] = kind
    args = e.args
    if (issubclass(cls, _native.CommTimeoutError) and args and isinstance(args[0], str)
            and " Timed out " not in args[0]):
        # Worded as gloo's and NCCL's timeouts: torch's tests and tools match
        # " (Timed out|closed|timeout) " in a timed-out op's error.
        args = (f"commd: Timed out waiting for the op: {args[0]}", *args[1:])
    out = kind(*args)
    out.__cause__ = e.__cause__
    return out


class WaitTimeoutError(dist.DistBackendError, TimeoutError):
    """``Work.wait(timeout)`` ran out first (the op keeps running): torch's DistBackendError,
    worded "Timed out" as gloo's, and Python's TimeoutError."""

    __module__ = "commd.torch"  # its public home (re-exported there)


def _wait_handle(h: Handle, secs: float | None, what: str) -> None:
    """Waits for ``h`` (at most ``secs``): its error as torch's kind, or ``WaitTimeoutError``
    when the time passes first."""
    try:
        h.wait(secs)
    except TimeoutError:
        raise WaitTimeoutError(
            f"commd: Timed out waiting {(secs or 0) * 1000:.0f} ms for {what} to complete (it "
            "keeps running; a later wait() can still complete it)") from None
    except _native.CommError as e:
        raise _dist_error(e) from e


class _CommdWork(_Work):
    """torch's Work over a commd Handle. Errors are raised as torch's ``DistBackendError``
    (kept as their commd class too); a ``wait(timeout)`` that passes first raises one saying
    "Timed out", as gloo's Works do."""

    def __init__(self, handle: Handle, result: Any) -> None:
        super().__init__()
        self._h = handle
        self._result = result
        self._fut: Future | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: Any = None) -> bool:
        try:
            _wait_handle(self._h, _seconds(timeout), "the op")
        finally:
            # The op ended (done or failed, not a wait that ran out first): its future too.
            fut = self._fut
            if fut is not None and self._h.is_completed():
                _settle(self._h, fut, _flat_tensors(self._result))
        return True

    def is_completed(self) -> bool:
        return self._h.is_completed()

    def is_success(self) -> bool:
        return self._h.is_completed() and self._h.exception() is None

    def source_rank(self) -> int | None:
        """The sender of a receive from any source, once it completed (the C++ shell's
        ``Work::sourceRank``, torch's ``Work._source_rank()``)."""
        return self._h.source()

    def exception(self) -> Any:
        return self._h.exception()

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> Future:
        with self._lock:
            if self._fut is None:
                self._fut = Future()
                if self._h.is_completed():
                    _settle(self._h, self._fut, _flat_tensors(self._result))
                else:
                    _progress.watch(self._h, self._fut, _flat_tensors(self._result))
            return self._fut


def _flat_tensors(result: Any) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    out: list[torch.Tensor] = []
    for r in result or []:
        out.extend(_flat_tensors(r))
    return out


class _DoneWork(_Work):
    """A Work with nothing to wait for (the op was local)."""

    def __init__(self, result: Any) -> None:
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> Any:
        return self._result

    def get_future(self) -> Future:
        f: Future = Future()
        f.set_result(_flat_tensors(self._result))
        return f


class _JoinWork(_Work):
    """Several GPU Works as one."""

    def __init__(self, works: list[Any], result: Any) -> None:
        super().__init__()
        self._works = works
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def result(self) -> Any:
        return self._result

    def get_future(self) -> Future:
        """Completed once every op's future is; CUDA-aware as theirs are (GPU ops' futures are
        completed at once on their streams): the joined future's completion is recorded on a
        side stream after it waited for every op's, so its ``wait()`` and callbacks order the
        caller's stream after all the ops, not only the CPU."""
        futs = [w.get_future() for w in self._works]
        value = _flat_tensors(self._result)
        dev = next((t.device for t in value if t.is_cuda), None)
        if dev is not None and torch.cuda.is_current_stream_capturing():
            dev = None  # captured ops' futures are plain ones (FastCudaWork)
        out: Future = Future(devices=[dev]) if dev is not None else Future()
        lock = threading.Lock()
        left = [len(futs)]

        def done(_: Any) -> None:
            with lock:
                left[0] -= 1
                if left[0] > 0 or out.done():
                    return
                for f in futs:
                    try:
                        f.value()
                    except BaseException as e:  # noqa: BLE001
                        out.set_exception(e)
                        return
                if dev is None:
                    out.set_result(value)
                    return
                with torch.cuda.device(dev), torch.cuda.stream(_side_stream(dev)):
                    for f in futs:
                        f.wait()  # the side stream waits for the op's recorded completion
                    out.set_result(value)

        for f in futs:
            f.add_done_callback(done)
        return out


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(dev: torch.device) -> torch.cuda.Stream:
    """A stream of ``dev`` that joined futures record their completion on."""
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    s = _SIDE.get(i)
    if s is None:
        s = _SIDE[i] = torch.cuda.Stream(device=i)
    return s


def _join(works: list[Any], result: Any) -> Any:
    return _JoinWork(works, result)
