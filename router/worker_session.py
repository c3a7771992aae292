"""Many requests to one worker over one Session stream (worker.proto), instead of one Generate call each.

Why: a gRPC call costs the router a fixed amount (call set-up, metadata, status) plus one message per chunk, each a
wake-up of grpc.aio's poller. Over a Session the worker sends every chunk ready at once, of all the requests it
runs, in one message: an engine step's tokens for a whole batch cost one message instead of one per request, and a
request costs no call of its own (`bench live --worker-session`).

`SessionCall` is what `Dispatcher._attempt` drives, with the parts of a `grpc.aio.UnaryStreamCall` it uses: async
iteration over the request's chunks, ending after the final one or raising `grpc.aio.AioRpcError` with the status
its Generate call would have ended with (the worker's, or DEADLINE_EXCEEDED at the request's own deadline, or
UNAVAILABLE when the stream itself ends), and `cancel()`, which aborts it on the worker and makes a pending read
raise `asyncio.CancelledError`, as a call's cancel does.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import grpc

from switchyard.v1 import worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)

# requests per message to the worker: up to this many bytes (a quarter of gRPC's default 4 MiB receive limit, which
# a burst of long prompts in one message would pass); a larger request goes as its own Generate call
FRAME_BYTES = 1 << 20
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_CANCELLED = object()  # queued by `SessionCall.cancel`: the pending read raises CancelledError


def frame_length(sizes: list[int], budget: int) -> int:
    """How many of the queued requests (their sizes, in order) the next message takes: as many as fit in `budget`
    bytes, and at least one."""
    n, total = 0, 0
    while n < len(sizes) and (n == 0 or total + sizes[n] <= budget):
        total += sizes[n]
        n += 1
    return n


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class SessionCall:
    """One request's chunks over its worker's session."""

    __slots__ = ("request_id", "_session", "_queue", "_done", "_deadline")

    def __init__(self, session: WorkerSession, request_id: str, timeout: float | None) -> None:
        self.request_id = request_id
        self._session = session
        self._queue: asyncio.Queue[worker_pb2.SessionEvent | grpc.aio.AioRpcError | object] = asyncio.Queue()
        self._done = False
        self._deadline = (
            asyncio.get_running_loop().call_later(max(0.0, timeout), self._expire) if timeout is not None else None
        )

    def __aiter__(self) -> AsyncIterator[worker_pb2.WorkerGenerateChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[worker_pb2.WorkerGenerateChunk]:
        while True:
            item = await self._queue.get()
            if item is _CANCELLED:
                raise asyncio.CancelledError
            if isinstance(item, grpc.aio.AioRpcError):
                raise item
            assert isinstance(item, worker_pb2.SessionEvent)
            if item.status_code:
                self._end()
                raise _error(_CODES.get(item.status_code, grpc.StatusCode.UNKNOWN), item.status_message)
            chunk = item.chunk
            if chunk.finish_reason:
                self._end()
                yield chunk
                return  # as a call's iteration, it ends after the final chunk
            yield chunk

    def _push(self, item: worker_pb2.SessionEvent | grpc.aio.AioRpcError | object) -> None:
        self._queue.put_nowait(item)

    def _end(self) -> None:
        """No more events for it: out of the session's table, its deadline timer off."""
        if self._done:
            return
        self._done = True
        if self._deadline is not None:
            self._deadline.cancel()
        self._session._forget(self)

    def _expire(self) -> None:
        if not self._done:
            self._end()
            self._session._abort(self.request_id)
            self._push(_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))

    def cancel(self) -> bool:
        """As a call's: aborts the request on the worker (unless it already ended) and fails a pending read."""
        if self._done:
            return False
        self._end()
        self._session._abort(self.request_id)
        self._push(_CANCELLED)
        return True


class WorkerSession:
    """The router's side of one Session stream: a writer that sends every request and abort queued since its last
    message in one message, and a reader that hands each event to its request's `SessionCall`. The stream opens at
    the first request; once it ends (the worker went away, the channel closed), every request still on it fails
    with UNAVAILABLE, a retryable status, and `usable` turns False, so the next request opens a new session."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, name: str) -> None:
        self._stub = stub
        self._name = name
        self._calls: dict[str, SessionCall] = {}
        self._generate: list[tuple[worker_pb2.WorkerGenerateRequest, int]] = []  # (request, its size in bytes)
        self._abort_ids: list[str] = []
        self._wake = asyncio.Event()
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self.usable = True
        self.end_code: grpc.StatusCode | None = None  # the stream's status once it ended

    def start(self, request: worker_pb2.WorkerGenerateRequest, timeout: float | None, size: int = 0) -> SessionCall:
        """Send one request (`size`: its bytes, at most FRAME_BYTES); its chunks come through the returned call."""
        if not self.usable:
            raise RuntimeError("session is closed")
        rid = request.request_id
        if rid in self._calls:
            raise ValueError(f"request {rid!r} is already on this session")
        call = SessionCall(self, rid, timeout)
        self._calls[rid] = call
        self._generate.append((request, size))
        self._wake.set()
        if self._call is None:
            self._call = self._stub.Session(self._frames())
            self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"session {self._name}")
        return call

    def _forget(self, call: SessionCall) -> None:
        if self._calls.get(call.request_id) is call:
            del self._calls[call.request_id]

    def _abort(self, request_id: str) -> None:
        if self.usable:
            self._abort_ids.append(request_id)
            self._wake.set()

    async def _frames(self) -> AsyncIterator[worker_pb2.SessionRequest]:
        while True:
            while not self._generate and not self._abort_ids:
                self._wake.clear()
                await self._wake.wait()
            queued = self._generate
            n = frame_length([size for _, size in queued], FRAME_BYTES)
            generate = [r for r, _ in queued[:n]]
            self._generate, abort_ids, self._abort_ids = queued[n:], self._abort_ids, []
            yield worker_pb2.SessionRequest(generate=generate, abort_request_ids=abort_ids)

    async def _read(self) -> None:
        assert self._call is not None
        why = "the worker's session stream ended"
        try:
            async for reply in self._call:
                calls = self._calls
                for ev in reply.events:
                    call = calls.get(ev.chunk.request_id)
                    if call is not None:
                        call._push(ev)
            self.end_code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            self.end_code = e.code()
            why = f"the worker's session stream failed: {e.code().name} {e.details() or ''}".rstrip()
        except asyncio.CancelledError:
            self.end_code = grpc.StatusCode.CANCELLED
            why = "the worker's session stream was closed"
        finally:
            self.usable = False
            calls, self._calls = self._calls, {}
            for call in calls.values():
                call._end()
                call._push(_error(grpc.StatusCode.UNAVAILABLE, why))
            if calls:
                log.warning("%s: %s; %d requests on it fail over", self._name, why, len(calls))


class WorkerSender:
    """How a router sends one worker its requests: over one Session stream, a new one when the last ended, or as one
    Generate call each where `sessions` is off, and for a request alone over a session message's budget
    (`FRAME_BYTES`). The daemon (`WorkerRegistry.generate`) and the bench relay send the same way."""

    def __init__(
        self, stub: worker_pb2_grpc.WorkerStub, name: str, sessions: bool, on_open: Callable[[], None] | None = None
    ) -> None:
        self.stub = stub
        self.name = name  # the sessions' name in logs
        self.sessions = sessions  # the router's setting and the worker's Info both say Session
        self.session: WorkerSession | None = None  # the open one
        self._on_open = on_open  # called as each session opens

    def send(
        self, request: worker_pb2.WorkerGenerateRequest, timeout: float | None
    ) -> grpc.aio.UnaryStreamCall | SessionCall:
        size = request.ByteSize() if self.sessions else 0
        if not self.sessions or size > FRAME_BYTES:
            return self.stub.Generate(request, timeout=timeout)
        session = self.session
        if session is None or not session.usable:
            if session is not None and session.end_code is grpc.StatusCode.UNIMPLEMENTED:
                self.sessions = False  # advertised, not served: Generate calls until its Info says otherwise
                return self.stub.Generate(request, timeout=timeout)
            session = self.session = WorkerSession(self.stub, self.name)
            if self._on_open is not None:
                self._on_open()
        return session.start(request, timeout, size)
