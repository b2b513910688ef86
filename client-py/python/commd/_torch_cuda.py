"""CUDA tensors for the ``commd`` torch backend: stream-ordered ops without CPU blocking.

Each op runs on the backend's communication stream for the tensors' device: that stream first
waits for the caller's current stream (so the op sees everything queued before the call), then
the commd client library enqueues the doorbell protocol on it (the daemon moves data with copy
engines; reductions run as kernels in this process, on that stream). ``Work.wait()`` makes the
caller's current stream wait for the communication stream, like NCCL: the CPU never blocks.
Tensors are recorded on the communication stream and kept referenced until the daemon reports the
op done, so the caching allocator cannot hand their memory out early.

The common cases (contiguous tensors: send, recv, all_gather_into_tensor, all_reduce, reduce,
broadcast, reduce_scatter_tensor) take a fast path: one native call (``Communicator.cuda_op``)
posts the op, enqueues its doorbells, and keeps the tensors referenced until the daemon reports
the op done (no ``record_stream``, no torch events, no Python-side bookkeeping per op):
- async collectives run on the communication stream, ordered after the current stream and
  followed by a done event (both enqueued natively); ``Work.wait()`` makes the current stream
  wait for that event;
- blocking collectives (``async_op=False``: torch waits at once) run on the current stream
  itself, like NCCL's for such calls: no stream hop at all;
- send and recv signal "ready" on the current stream (so work queued after them keeps running)
  and ``Work.wait()`` enqueues the wait for the op's done counter on whatever stream is current
  then: one stream operation each, no event.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch
from torch._C._distributed_c10d import Work as _Work
from torch.futures import Future

from ._core import Handle
from ._torch_work import _DoneWork, _flat_tensors, _progress, _seconds, _wait_handle

# dtype name for data movement: the tensor's own where commd has it (so metrics and traces show
# the real dtype), else one of the element's size (only the bytes matter for moving them).
_REAL = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
         torch.bfloat16: "bf16", torch.int8: "i8", torch.uint8: "u8", torch.int32: "i32",
         torch.int64: "i64"}
for _name, _code in (("uint32", "u32"), ("uint64", "u64"), ("float8_e4m3fn", "f8e4m3"),
                     ("float8_e5m2", "f8e5m2")):
    if hasattr(torch, _name):
        _REAL[getattr(torch, _name)] = _code
_COMPLEX = {torch.complex64: "f32", torch.complex128: "f64"}
_MOVE = {1: "u8", 2: "f16", 4: "f32", 8: "f64"}


def move_name(t: torch.Tensor) -> tuple[str, int]:
    """(dtype name, elements of it per tensor element) to move ``t``'s data."""
    name = _REAL.get(t.dtype)
    if name is not None:
        return name, 1
    name = _COMPLEX.get(t.dtype)
    if name is not None:
        return name, 2
    return size_name(t)


def size_name(t: torch.Tensor) -> tuple[str, int]:
    """Like ``move_name``, by element size alone: for sends and recvs, which the daemon matches
    by dtype and count, so that a float32 send still pairs with an int32 recv of its size."""
    es = t.element_size()
    name = _MOVE.get(es)
    return (name, 1) if name is not None else ("u8", es)

# The fast path for contiguous tensors (False: every op takes the general path; for
# benchmarks that compare the two).
FAST = True

try:  # the raw cudaStream_t of the current stream, without making a Stream object
    _raw_stream: Callable[[int], int] = torch._C._cuda_getCurrentRawStream
except AttributeError:  # pragma: no cover - older torch
    def _raw_stream(dev: int) -> int:
        return torch.cuda.current_stream(dev).cuda_stream


def _done(result: Any) -> _Work:

    return _DoneWork(result)


# How a GPU op's failure is printed when its future had completed on the stream already.
_ASYNC_FAILURE = ("a GPU collective failed after its future had completed (its results are not "
                  "valid; the communicator's next call raises)")


def _stream_future(dev: int | None, stream: torch.cuda.Stream, value: Any) -> Future:
    """A CUDA-aware future completed at once, as NCCL's work futures are: its completion is
    recorded on ``stream`` after the op, so ``wait()`` and callbacks (DDP's reducer, comm hooks)
    order their streams after the op on the GPU instead of blocking the CPU until the daemon
    reports it done (CPU-completed futures make a DDP step much slower than NCCL's; with these:
    docs/benchmarks.md row ``ddp-overlap-2gpu``). A failed op is reported as for
    ``Work.wait()``: the stream is released and the communicator's next call raises; and as
    nothing waits on the future, the op's error is also printed at once (``_report_failure``: a
    thread of the native library, without the GIL)."""
    fut = Future(devices=[torch.device("cuda", torch.cuda.current_device() if dev is None
                                       else dev)])
    with torch.cuda.stream(stream):
        fut.set_result(value)
    return fut


def check_overlap(t: torch.Tensor, what: str) -> None:
    """Refuses a tensor whose elements share memory (an expand()ed or stride-0 view): what an
    op writes there depends on the order of its writes, and NCCL refuses such tensors too."""
    if t.numel() > 1 and not t.is_contiguous() and torch._debug_has_internal_overlap(t) == 1:
        raise ValueError(
            f"commd {what}: the tensor's elements overlap in memory (an expand()ed or stride-0 "
            f"view, shape {tuple(t.shape)} strides {t.stride()}); pass a .contiguous() copy")


def _wait_within(h: Handle, timeout: Any) -> None:
    """``Work.wait(timeout)`` of a GPU op, as NCCL's: without a timeout nothing (the caller's
    stream is ordered after the op, the CPU goes on); with one, the CPU waits for the op to
    complete and raises torch's timeout error (commd.torch.WaitTimeoutError) if it passes first,
    or the op's error."""

    secs = _seconds(timeout)
    if secs is not None:
        _wait_handle(h, secs, "the GPU op")


class FastCudaWork(_Work):
    """Work of an op posted by ``Communicator.cuda_op``: ``wait`` makes the caller's current
    stream wait (on the GPU) for the op's done event; the CPU never blocks."""

    def __init__(self, req: Any, dev: int, result: Any, captured: bool = False,
                 done_stream: int | None = None) -> None:
        super().__init__()
        self._req = req  # commd._native.CudaRequest
        self._dev = dev
        self._result = result
        # The raw stream whose work ends with the op's completion (the communication stream,
        # or the current one for an op run there); None for send/recv, whose wait is enqueued
        # only by wait().
        self._done_stream = done_stream
        self._fut: Future | None = None
        self._h: Handle | None = None
        # Captured into a CUDA graph: the op "completes" on each replay, on the GPU; on the CPU
        # there is nothing to track, and holding the tensors (a future watched until the
        # daemon registered the op) would keep graph-pool memory alive that torch's graph
        # trees expect freed when the capture ends.
        self._captured = captured

    def wait(self, timeout: Any = None) -> bool:
        # With a timeout (as NCCL's): the CPU waits until the op is done, or raises when the
        # timeout passes first.
        if not self._captured:
            _wait_within(self._handle(), timeout)
        # Raises the op's error if it already failed; one still running reports through its
        # stream (released with the error word set) and through is_completed()/get_future().
        self._req.cuda_wait(_raw_stream(self._dev))
        if self._captured:
            # torch keeps a functional collective's Work registered (from C++) past the end of
            # the capture; its tensors must not live on through it (graph-pool memory).
            self._result = None
        return True

    def _handle(self) -> Handle:
        if self._h is None:
            self._h = Handle([self._req], result=self._result, orphan=False)
        return self._h

    def is_completed(self) -> bool:
        return self._captured or self._handle().is_completed()

    def is_success(self) -> bool:
        return self._captured or (self.is_completed() and self._handle().exception() is None)

    def exception(self) -> Any:
        return self._handle().exception()

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        self._handle().wait()
        self._req.cuda_wait(_raw_stream(self._dev))

    def get_future(self) -> Future:

        if self._fut is None:
            if self._captured:
                self._fut = Future()
                self._fut.set_result(_flat_tensors(self._result))
            elif self._done_stream is not None:
                self._fut = _stream_future(self._dev, torch.cuda.ExternalStream(
                    self._done_stream, device=torch.device("cuda", self._dev)),
                    _flat_tensors(self._result))
                self._req.report_failure(_ASYNC_FAILURE)
            else:
                self._fut = Future()
                _progress.watch(self._handle(), self._fut, _flat_tensors(self._result))
        return self._fut


class CudaWork(_Work):
    """Work of a GPU op: ``wait`` orders the caller's stream after the op."""

    def __init__(self, handle: Handle, event: torch.cuda.Event, device: torch.device,
                 result: Any, flush: Callable[[], None] | None = None,
                 stream: torch.cuda.Stream | None = None) -> None:
        super().__init__()
        self._h = handle
        self._ev = event
        self._stream = stream  # the communication stream the op ran on
        self._dev = device
        self._result = result
        self._flush = flush
        self._fut: Future | None = None
        self._lock = threading.Lock()

    def _ordered(self) -> None:
        if self._flush is not None:
            self._flush()
            self._flush = None

    def wait(self, timeout: Any = None) -> bool:
        self._ordered()
        _wait_within(self._h, timeout)
        torch.cuda.current_stream(self._dev).wait_event(self._ev)
        # An op that already failed raises now; one still running reports through its stream
        # (released with the error word set) and through is_completed()/get_future().
        if self._h.is_completed():
            e = self._h.exception()
            if e is not None:
                raise e
        return True

    def is_completed(self) -> bool:
        self._ordered()
        return self._h.is_completed()

    def is_success(self) -> bool:
        return self.is_completed() and self._h.exception() is None

    def exception(self) -> Any:
        return self._h.exception()

    def result(self) -> Any:
        return self._result

    def synchronize(self) -> None:
        self._ordered()
        self._h.wait()
        torch.cuda.current_stream(self._dev).wait_event(self._ev)

    def get_future(self) -> Future:

        self._ordered()
        with self._lock:
            if self._fut is None:
                if self._stream is not None and not torch.cuda.is_current_stream_capturing():
                    self._fut = _stream_future(self._dev.index, self._stream,
                                               _flat_tensors(self._result))
                    self._h.report_failure(_ASYNC_FAILURE)
                else:
                    self._fut = Future()
                    _progress.watch(self._h, self._fut, _flat_tensors(self._result))
            return self._fut


class CudaOps:
    """The GPU half of one CommdBackend."""

    def __init__(self, comm: Any, rank: int, size: int) -> None:
        self._comm = comm  # commd._core.Communicator
        self._native = comm._native
        self._rank = rank
        self._size = size
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._raw: dict[int, int] = {}  # device index -> raw handle of its communication stream
        self._codes: dict[tuple[Any, ...], tuple[int, int]] = {}

    def stream(self, dev: torch.device) -> torch.cuda.Stream:
        i = dev.index if dev.index is not None else torch.cuda.current_device()
        s = self._streams.get(i)
        if s is None:
            s = torch.cuda.Stream(device=i)
            self._streams[i] = s
            self._raw[i] = s.cuda_stream
        return s

    # -- the fast path -------------------------------------------------------------------

    def _code(self, op: str, t: torch.Tensor, redop: str | None = None,
              dt: str | None = None, defer: bool = False,
              cur: bool = False) -> tuple[int, int]:
        """(cuda_op code, element multiplier) for ``op`` on ``t``'s dtype (cached). ``cur``:
        the op runs on the current stream (no ordering event, no done event)."""
        key = (op, t.dtype, redop, dt, defer, cur)
        c = self._codes.get(key)
        if c is None:
            mult = 1
            if dt is None:
                dt, mult = size_name(t) if op in ("send", "recv") else move_name(t)
            elif t.is_complex():
                mult = 2
            c = (self._native.cuda_code(op, dt, redop, defer_wait=defer, order_after=not cur,
                                        record=not cur), mult)
            self._codes[key] = c
        return c

    def fast(self, code: tuple[int, int], t: torch.Tensor, send: int, recv: int, peer: int,
             result: Any, keep: Any, cur: bool = False, p2p: bool = False,
             parts: int = 1) -> FastCudaWork:
        """Posts one op on ``t``'s device through ``cuda_op``: on the current stream (``cur``,
        with a code made with ``cur``), else on the communication stream ordered after the
        current one; ``keep`` stays referenced until the daemon reports the op done. The op's
        count is ``t``'s elements over ``parts`` (all-to-all: one chunk). An empty tensor moves
        nothing: the op completes at once, as NCCL's do with count 0."""
        if t.numel() == 0:
            return _done(result)
        dev = t.get_device()
        now = _raw_stream(dev)
        if cur:
            s = now
        else:
            s = self._raw.get(dev)
            if s is None:
                self.stream(t.device)
                s = self._raw[dev]
        req = self._native.cuda_op(code[0], peer, t.numel() // parts * code[1],
                                   (send, recv, s, now), keep)
        return FastCudaWork(req, dev, result, torch.cuda.is_current_stream_capturing(),
                            None if p2p else s)

    def run(self, tensors: list[torch.Tensor], result: Any,
            post: Callable[[int], list[Any]],
            after: Callable[[], None] | None = None, p2p: bool = False) -> CudaWork:
        """Runs ``post(stream_handle)`` (which posts the ops and returns their requests) on the
        communication stream of the tensors' device, after the current stream."""
        if all(t.numel() == 0 for t in tensors):
            return _done(result)
        dev = tensors[0].device
        for t in tensors:
            if t.device != dev:
                raise ValueError(f"commd: all tensors of one op must be on one device "
                                 f"(got {dev} and {t.device})")
            check_overlap(t, "op")  # before anything is posted
        # Under CUDA graph capture the communication stream joins the capture through the
        # ordering below and the native layer captures the ops as persistent ops
        # (docs/contracts.md #6); what it cannot capture it refuses before posting.
        s = self.stream(dev)
        cur = torch.cuda.current_stream(dev)
        s.wait_stream(cur)
        with torch.cuda.device(dev):
            reqs = post(s.cuda_stream)
            with torch.cuda.stream(s):
                if after is not None:
                    after()
            for t in tensors:
                t.record_stream(s)
            ev = torch.cuda.Event()
            ev.record(s)
        # Captured ops: the graph keeps their memory (see Communicator.cuda_op), nothing to hold.
        keep = [] if torch.cuda.is_current_stream_capturing() else list(tensors)

        def release() -> None:
            keep.clear()

        h = Handle(reqs, release=release, result=result, orphan=False)
        flush = None
        if p2p:
            native = self._native
            handle = s.cuda_stream

            def flush() -> None:  # the deferred waits of send/recv groups
                native.cuda_flush(handle)
                ev.record(s)

        return CudaWork(h, ev, dev, result, flush, s)

    # -- helpers -------------------------------------------------------------------------

    @staticmethod
    def flat(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(a contiguous tensor with ``t``'s data, whether it is a copy to write back)."""
        if t.is_contiguous():
            return t, False
        return t.contiguous(), True

    def post(self, op: str, dtype: str, count: int, stream: int, send: torch.Tensor | None,
             recv: torch.Tensor | None, redop: str | None = None, peer: int = 0,
             defer: bool = False) -> Any:
        return self._native.post_cuda(
            op, dtype, count, stream,
            send=send.data_ptr() if send is not None else None,
            recv=recv.data_ptr() if recv is not None else None,
            redop=redop, peer=peer, defer_wait=defer)

    @staticmethod
    def move_dtype(t: torch.Tensor, p2p: bool = False) -> tuple[str, int]:
        """(dtype name, count) to move ``t``'s data."""
        name, mult = size_name(t) if p2p else move_name(t)
        return name, t.numel() * mult

    # -- ops -----------------------------------------------------------------------------

    def reduce_like(self, op: str, t: torch.Tensor, dt: str, red: str, root: int,
                    out: torch.Tensor | None, result: Any,
                    sync: bool = False) -> CudaWork | FastCudaWork:
        """all_reduce / reduce in place on ``t`` (``out`` None), or reduce-scatter of ``t`` into
        ``out``. ``sync``: torch waits at once (``async_op=False``): run on the current
        stream."""
        if FAST and t.is_contiguous() and (
                out is None or (out.is_contiguous() and out.device == t.device)):
            if out is None:
                p = t.data_ptr()
                return self.fast(self._code(op, t, red, dt, cur=sync), t, p, p, root, result, t,
                                 sync)
            return self.fast(self._code(op, out, red, dt, cur=sync), out, t.data_ptr(),
                             out.data_ptr(), 0, result, (t, out), sync)
        src, back = self.flat(t)
        count = src.numel() * (2 if src.is_complex() else 1)
        if out is None:
            def post(s: int) -> list[Any]:
                return [self.post(op, dt, count, s, src, src, red, root)]

            after = (lambda: t.copy_(src)) if back else None
            return self.run([t, src], result, post, after)
        dst, back_o = self.flat(out)
        count = dst.numel() * (2 if dst.is_complex() else 1)

        def post_rs(s: int) -> list[Any]:
            return [self.post("reduce_scatter", dt, count, s, src, dst, red)]

        after = (lambda: out.copy_(dst)) if back_o else None
        return self.run([t, src, out, dst], result, post_rs, after)

    def broadcast(self, t: torch.Tensor, root: int, result: Any,
                  sync: bool = False) -> CudaWork | FastCudaWork:
        if FAST and t.is_contiguous():
            p = t.data_ptr()
            return self.fast(self._code("broadcast", t, cur=sync), t, p, p, root, result, t,
                             sync)
        src, back = self.flat(t)
        dt, count = self.move_dtype(src)

        def post(s: int) -> list[Any]:
            return [self.post("broadcast", dt, count, s, src, src, peer=root)]

        after = (lambda: t.copy_(src)) if back else None
        return self.run([t, src], result, post, after)

    def all_gather(self, out: torch.Tensor, t: torch.Tensor, result: Any,
                   outs: list[torch.Tensor] | None = None,
                   sync: bool = False) -> CudaWork | FastCudaWork:
        if (FAST and outs is None and t.is_contiguous() and out.is_contiguous()
                and out.device == t.device):
            return self.fast(self._code("all_gather", t, cur=sync), t, t.data_ptr(),
                             out.data_ptr(), 0, result, (t, out), sync)
        src, _ = self.flat(t)
        dst, back = self.flat(out)
        dt, count = self.move_dtype(src)

        def post(s: int) -> list[Any]:
            return [self.post("all_gather", dt, count, s, src, dst)]

        def after() -> None:
            if back:
                out.copy_(dst)
            if outs is not None:
                for i, o in enumerate(outs):
                    o.copy_(dst[i * src.numel():(i + 1) * src.numel()].view_as(o))

        keep = [t, src, out, dst] + list(outs or [])
        return self.run(keep, result, post, after)

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, result: Any,
                   sync: bool = False) -> CudaWork | FastCudaWork:
        if (FAST and t.is_contiguous() and out.is_contiguous() and out.device == t.device
                and t.data_ptr() != out.data_ptr()):
            return self.fast(self._code("all_to_all", t, cur=sync), t, t.data_ptr(),
                             out.data_ptr(), 0, result, (t, out), sync, parts=self._size)
        src, _ = self.flat(t)
        dst, back = self.flat(out)
        if src.data_ptr() == dst.data_ptr():
            src = src.clone()
        dt, count = self.move_dtype(src)
        count //= self._size

        def post(s: int) -> list[Any]:
            return [self.post("all_to_all", dt, count, s, src, dst)]

        after = (lambda: out.copy_(dst)) if back else None
        return self.run([t, src, out, dst], result, post, after)

    def p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
            result: Any, group: bool = True) -> CudaWork | FastCudaWork:
        """Sends and recvs: every readiness signal first, then one wait, so their order cannot
        deadlock. ``group`` False (single isend/irecv, e.g. from ``batch_isend_irecv``): the wait
        is enqueued at the first ``wait``/``is_completed`` of any Work of the communicator."""
        if not sends and not recvs:
            raise ValueError("commd: empty send/recv group")
        # Empty tensors move nothing (NCCL skips count 0 too); a group of only those is done.
        sends = [(t, p) for t, p in sends if t.numel() > 0]
        recvs = [(t, p) for t, p in recvs if t.numel() > 0]
        if not sends and not recvs:
            return _done(result)
        if FAST and not group and len(sends) + len(recvs) == 1:
            t, peer = sends[0] if sends else recvs[0]
            if t.is_contiguous():
                kind = "send" if sends else "recv"
                p = t.data_ptr()
                return self.fast(self._code(kind, t, defer=True, cur=True), t,
                                 p if sends else 0, 0 if sends else p, peer, result, t, True,
                                 p2p=True)
        fixed: list[tuple[torch.Tensor, torch.Tensor]] = []
        plan: list[tuple[str, torch.Tensor, int]] = []
        for t, peer in sends:
            plan.append(("send", self.flat(t)[0], peer))
        for t, peer in recvs:
            r, back = self.flat(t)
            if back:
                fixed.append((t, r))
            plan.append(("recv", r, peer))
        tensors = [x for _, x, _ in plan] + [t for t, _ in fixed]
        if not tensors:
            raise ValueError("commd: empty send/recv group")

        def post(s: int) -> list[Any]:
            reqs = []
            for kind, x, peer in plan:
                dt, count = self.move_dtype(x, p2p=True)
                reqs.append(self.post(kind, dt, count, s,
                                      x if kind == "send" else None,
                                      x if kind == "recv" else None, peer=peer, defer=True))
            if group or fixed:
                self._native.cuda_flush(s)
            return reqs

        def after() -> None:
            for t, r in fixed:
                t.copy_(r)

        return self.run(tensors, result, post, after if fixed else None,
                        p2p=not (group or fixed))
