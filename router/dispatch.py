"""Dispatch: bind each admitted request to a worker (queue + policy), send it, and stream the result back.

The only module that sends requests to workers (policies only return a `Decision`). It owns the request's life
after admission: fast path or queue -> `policy.select` (timed) -> `Fleet.note_dispatch` + `on_dispatch` ->
worker Generate stream (a call, or the worker's Session) -> chunks with text deltas -> final chunk with usage and timings -> `on_finish`.
The output-length prediction started at admission is settled at the first bind: the fast path waits for it up to
its deadline; a request released from the queue takes what is there (the wait already overlapped inference).
Failures before the first token are retried on another worker; cancellations and deadlines remove the request
from the queue or abort it on its worker. Every exit path ends the attempt exactly once (`_end_attempt`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from switchyard.router import api
from switchyard.router.admission import AdmittedRequest, ApiError
from switchyard.router.clock import Clock
from switchyard.router.fleet import Fleet
from switchyard.router.metrics import RouterMetrics
from switchyard.router.policies.base import Decision, Policy, WorkerId, WorkerView
from switchyard.router.queue import QueueEntry, QueueFull, RequestQueue, should_hold
from switchyard.router.registry import WorkerRegistry
from switchyard.router.worker_session import SessionCall
from switchyard.v1 import common_pb2, router_pb2, worker_pb2

if TYPE_CHECKING:
    from switchyard.router.predictor.service import PredictorService

log = logging.getLogger(__name__)

# Worker statuses that mean "this worker could not serve it", so another worker may. Anything else (e.g.
# INVALID_ARGUMENT) is the request's fault and is passed through.
RETRYABLE_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,  # the worker's server shut down under it (our own cancels never get here)
    }
)


# A client whose deadline passes cancels its stream (RST_STREAM) at its own deadline, which falls a network hop and
# a header parse before the deadline the router derived from grpc-timeout; a cancel that close to the deadline is
# the deadline passing, not the caller giving up.
DEADLINE_SLACK_S = 0.05


class WorkerFailed(Exception):
    def __init__(self, worker_id: WorkerId, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.worker_id = worker_id
        self.code = code
        self.detail = detail


@dataclass(eq=False)
class _Flight:
    """One request from admission to its last chunk."""

    req: AdmittedRequest
    deadline_at: float | None  # router clock; None = no gRPC deadline
    enqueued_at: float
    attempt: int = 0  # 0-based, of the current dispatch
    excluded: frozenset[WorkerId] = frozenset()  # workers that failed it
    decision: Decision | None = None  # the current attempt's, until the attempt ends
    entry: QueueEntry | None = None
    future: asyncio.Future[Decision] | None = None  # resolved by the pump when released from the queue
    call: grpc.aio.UnaryStreamCall | SessionCall | None = None  # the current attempt's worker stream
    last_chunk_at: float = 0.0  # router clock: the current attempt's start or its last chunk
    watchdog: asyncio.TimerHandle | None = None  # the current attempt's stall check
    stalled: bool = False  # the watchdog cancelled the current attempt's stream
    queue_s: float = 0.0
    route_s: float = 0.0  # summed over attempts
    predicted_output_tokens: int | None = None  # settled at the first bind; None = no predictor (client hint)
    first_token_at: float | None = None
    num_tokens_sent: int = 0
    finished: bool = False
    served_by: str = ""
    stream_interval: int = 1  # token ids per chunk the workers may gather (`worker_request`)

    def remaining_s(self, now: float) -> float | None:
        return None if self.deadline_at is None else self.deadline_at - now


class Dispatcher:
    def __init__(
        self,
        fleet: Fleet,
        registry: WorkerRegistry,
        policy: Policy,
        policy_name: str,
        queue: RequestQueue,
        metrics: RouterMetrics,
        clock: Clock,
        kv_usage_hold_frac: float = 0.95,
        max_attempts: int = 3,
        retry_after_ms: int = 500,
        rpc_timeout_s: float = 2.0,
        stream_idle_timeout_s: float = 0.0,
        predictor: PredictorService | None = None,
    ) -> None:
        self._fleet = fleet
        self._predictor = predictor
        self._registry = registry
        self._policy = policy
        self._policy_name = policy_name
        self.queue = queue
        self._metrics = metrics
        self._clock = clock
        self._kv_hold = kv_usage_hold_frac
        self._max_attempts = max_attempts
        self._retry_after_ms = retry_after_ms
        self._rpc_timeout_s = rpc_timeout_s
        self._idle_s = stream_idle_timeout_s  # 0: no stall watchdog
        self._flights: dict[str, _Flight] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._pump_scheduled = False

    @property
    def num_active(self) -> int:
        return len(self._flights)

    def _hold(self, eligible: Sequence[WorkerView]) -> bool:
        return should_hold(eligible, self._kv_hold)

    def _has_room(self, model: str) -> bool:
        """The fast path is open: nothing of this model waits and its workers are not all saturated."""
        return not self.queue.size(model) and not self._hold(self._fleet.routable(model))

    # ------------------------------------------------------------------ binding
    def _bind(self, fl: _Flight) -> Decision:
        """policy.select for the flight's current attempt, then count the dispatch. UNAVAILABLE if none."""
        now = self._clock.now()
        self._fleet.set_time(now)
        p = fl.req.prediction
        if fl.predicted_output_tokens is None and self._predictor is not None and p is not None:
            fl.predicted_output_tokens = self._predictor.result_nowait(p)[0]
        ctx = fl.req.routing_context(fl.attempt, fl.excluded, fl.predicted_output_tokens)
        t0 = time.perf_counter()
        decision = self._policy.select(ctx, self._fleet, now)
        route_s = time.perf_counter() - t0
        self._metrics.route_time.labels(self._policy_name).observe(route_s)
        fl.route_s += route_s
        rec = self._fleet.get(decision.worker_id) if decision else None
        if decision is None or rec is None or not rec.is_routable or decision.worker_id in fl.excluded:
            why = f" (excluding {', '.join(sorted(fl.excluded))} after failures)" if fl.excluded else ""
            raise ApiError(grpc.StatusCode.UNAVAILABLE, f"no healthy worker for model {ctx.model!r}{why}")
        if fl.attempt == 0:
            fl.queue_s = now - fl.enqueued_at
            self._metrics.queue_time.labels(ctx.model).observe(fl.queue_s)
        self._fleet.note_dispatch(decision.worker_id)
        fl.decision = decision  # from here the attempt holds a slot, which `_end_attempt` frees on any exit
        self._policy.on_dispatch(ctx, decision, now)
        self._metrics.worker_in_flight.labels(decision.worker_id).set(rec.in_flight)
        log.debug(
            "route %s attempt=%d -> %s (%s) policy=%s predicted=%s in %.1f us",
            ctx.request_id, fl.attempt, decision.worker_id, decision.reason, self._policy_name,
            ctx.predicted_output_tokens, route_s * 1e6,
        )
        return decision

    async def _acquire(self, fl: _Flight) -> Decision:
        """Fast path when nothing waits and the model's workers have room; otherwise wait in the queue."""
        model = fl.req.model
        if self._has_room(model):
            p = fl.req.prediction
            if self._predictor is not None and p is not None and p.future is not None and not p.future.done():
                await self._predictor.result(p, fl.remaining_s(self._clock.now()))  # bounded by its deadline
            if self._has_room(model):  # re-checked: others may have bound while this one waited
                return self._bind(fl)
        fut: asyncio.Future[Decision] = asyncio.get_running_loop().create_future()
        entry = QueueEntry(fl.req.request_id, model, fl.req.arrival_s, fl.req.priority, payload=fl)
        try:
            self.queue.push(entry)
        except QueueFull as e:
            self._metrics.queue_rejected.labels(model).inc()
            raise ApiError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{e}; retry after {self._retry_after_ms} ms",
                trailing=(("retry-after-ms", str(self._retry_after_ms)),),
            ) from None
        fl.entry, fl.future = entry, fut
        self._metrics.queue_depth.labels(model).set(self.queue.size(model))
        log.debug("request %s queued for %s (depth %d)", fl.req.request_id, model, self.queue.size(model))
        timeout = fl.remaining_s(self._clock.now())
        try:
            # asyncio.timeout, not wait_for: 3.11's wait_for returns a decision that the pump made in the same loop
            # iteration as the client's cancel and swallows the cancel, so the cancelled request would be sent
            async with asyncio.timeout(None if timeout is None else max(timeout, 0.0)):
                return await fut
        except TimeoutError:
            raise ApiError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed while queued in the router") from None

    def pump(self) -> None:
        """Release queued requests while their model's hold condition is false; bind each before the next
        evaluation (a dispatch raises in_flight). Called on stats updates, finishes, worker changes and ticks."""
        self._pump_scheduled = False
        for model in self.queue.models():
            eligible = self._fleet.routable(model)
            while (entry := self.queue.release(model, eligible, self._hold)) is not None:
                fl: _Flight = entry.payload
                if fl.future is None or fl.future.done():
                    continue  # its waiter was cancelled or timed out a moment ago
                try:
                    fl.future.set_result(self._bind(fl))
                except ApiError as e:
                    fl.future.set_exception(e)
                except Exception:  # a policy bug: this request fails, the others are still released
                    log.exception("binding request %s failed inside the router", fl.req.request_id)
                    fl.future.set_exception(ApiError(grpc.StatusCode.INTERNAL, "internal router error"))
            self._metrics.queue_depth.labels(model).set(self.queue.size(model))

    def schedule_pump(self) -> None:
        """Coalesce pump requests into one call on the next loop iteration (never re-entrant)."""
        if not self._pump_scheduled:
            self._pump_scheduled = True
            asyncio.get_running_loop().call_soon(self.pump)

    # ------------------------------------------------------------------ request life
    async def generate(
        self, req: AdmittedRequest, time_remaining_s: float | None, stream_interval: int = 1
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        """Stream one admitted request's chunks (of `stream_interval` token ids, the first alone); raises ApiError
        for every non-OK outcome."""
        if req.request_id in self._flights:
            raise ApiError(grpc.StatusCode.ALREADY_EXISTS, f"request id {req.request_id!r} is already in flight")
        now = self._clock.now()
        fl = _Flight(
            req=req, deadline_at=None if time_remaining_s is None else now + time_remaining_s, enqueued_at=now,
            stream_interval=stream_interval,
        )
        self._flights[req.request_id] = fl
        status = grpc.StatusCode.OK
        try:
            decision = await self._acquire(fl)
            while True:
                try:
                    async with contextlib.aclosing(self._attempt(fl, decision)) as chunks:
                        async for chunk in chunks:
                            yield chunk
                    return
                except WorkerFailed as f:
                    decision = self._retry(fl, f)
        except ApiError as e:
            status = e.code
            raise
        except (asyncio.CancelledError, GeneratorExit):
            past = fl.deadline_at is not None and self._clock.now() >= fl.deadline_at - DEADLINE_SLACK_S
            status = grpc.StatusCode.DEADLINE_EXCEEDED if past else grpc.StatusCode.CANCELLED
            raise
        except Exception:
            status = grpc.StatusCode.INTERNAL
            log.exception("request %s failed inside the router", req.request_id)
            raise ApiError(grpc.StatusCode.INTERNAL, "internal router error") from None
        finally:
            if status is not grpc.StatusCode.OK:
                self._cleanup(fl, status)
            self._flights.pop(req.request_id, None)
            self._metrics.requests.labels(req.model, fl.served_by, status.name.lower()).inc()

    def _retry(self, fl: _Flight, f: WorkerFailed) -> Decision:
        self._end_attempt(fl, send_abort=False)
        if fl.num_tokens_sent:
            raise ApiError(
                grpc.StatusCode.UNAVAILABLE,
                f"worker {f.worker_id} failed after {fl.num_tokens_sent} tokens were delivered ({f}); "
                "the output is incomplete",
            )
        if fl.attempt + 1 >= self._max_attempts:
            raise ApiError(
                grpc.StatusCode.UNAVAILABLE,
                f"request failed on {fl.attempt + 1} attempt(s); last worker {f.worker_id}: {f}",
            )
        log.warning("request %s: worker %s failed before the first token (%s); retrying", fl.req.request_id, f.worker_id, f)
        self._metrics.retries.labels(fl.req.model, f.code.lower()).inc()
        fl.attempt += 1
        fl.excluded = fl.excluded | {f.worker_id}
        return self._bind(fl)

    async def _attempt(self, fl: _Flight, decision: Decision) -> AsyncIterator[router_pb2.GenerateChunk]:
        wid = decision.worker_id
        timeout = fl.remaining_s(self._clock.now())
        if timeout is not None and timeout <= 0:
            raise ApiError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before dispatch")
        request = api.worker_request(
            fl.req, decision, fl.predicted_output_tokens, self._registry.origin, fl.stream_interval
        )
        call = self._registry.generate(wid, request, timeout)
        if call is None:
            raise WorkerFailed(wid, "UNAVAILABLE", "worker was removed")
        fl.call, fl.last_chunk_at, fl.stalled = call, self._clock.now(), False
        if self._idle_s:
            fl.watchdog = asyncio.get_running_loop().call_later(self._idle_s, self._check_stall, fl, call)
        try:
            async for wc in call:
                chunk = self._relay(fl, wid, wc)
                if chunk is not None:
                    yield chunk
                if fl.finished:
                    return
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if fl.stalled and task is not None and not task.cancelling():  # our watchdog's cancel, not the client's
                self._registry.report_failure(wid, "Generate stalled")
                raise WorkerFailed(wid, "STALLED", f"no chunk for {self._idle_s:g} s") from None
            raise
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code is grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ApiError(code, f"deadline passed after {fl.num_tokens_sent} tokens were delivered") from None
            if code in RETRYABLE_CODES:
                self._registry.report_failure(wid, f"Generate {code.name}")
                raise WorkerFailed(wid, code.name, e.details() or "") from None
            raise ApiError(code, f"worker {wid}: {e.details()}") from None
        finally:
            if fl.watchdog is not None:
                fl.watchdog.cancel()
                fl.watchdog = None
        raise WorkerFailed(wid, "UNAVAILABLE", "stream ended without a final chunk")

    def _check_stall(self, fl: _Flight, call: grpc.aio.UnaryStreamCall | SessionCall) -> None:
        """The stall watchdog of the attempt streaming `call`: a timer, re-armed from the last chunk, so a stream
        costs one timer per idle period rather than one per chunk (asyncio.timeout around each read costs ~8 µs)."""
        if fl.call is not call:
            return  # that attempt is over
        quiet = self._clock.now() - fl.last_chunk_at
        if quiet >= self._idle_s:
            fl.stalled = True
            call.cancel()  # the stream's reader gets CancelledError: `_attempt` turns it into WorkerFailed
        else:
            fl.watchdog = asyncio.get_running_loop().call_later(self._idle_s - quiet, self._check_stall, fl, call)

    def _relay(self, fl: _Flight, wid: WorkerId, wc: worker_pb2.WorkerGenerateChunk) -> router_pb2.GenerateChunk | None:
        now = fl.last_chunk_at = self._clock.now()
        if wc.token_ids and fl.first_token_at is None:
            fl.first_token_at = now
            self._policy.on_first_token(fl.req.request_id, wid, now)
        final = wc.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
        text = wc.text  # NOTE: workers detokenize (and apply stop strings, as vLLM does); the router relays
        fl.num_tokens_sent += len(wc.token_ids)
        if not final:
            if not wc.token_ids and not text:
                return None
            return router_pb2.GenerateChunk(request_id=fl.req.request_id, token_ids=wc.token_ids, text=text)
        usage = common_pb2.Usage()
        if wc.HasField("usage"):
            usage.CopyFrom(wc.usage)
        else:
            usage.prompt_tokens, usage.completion_tokens = len(fl.req.prompt_token_ids), fl.num_tokens_sent
        e2e_s = now - fl.req.arrival_s
        ttft_s = (fl.first_token_at if fl.first_token_at is not None else now) - fl.req.arrival_s
        timings = router_pb2.Timings(
            queue_s=fl.queue_s, ttft_s=ttft_s, e2e_s=e2e_s, worker_id=wid, route_s=fl.route_s, attempts=fl.attempt + 1
        )
        capped = wc.finish_reason == common_pb2.FINISH_REASON_LENGTH
        self._finish(fl, wid, now, ttft_s, e2e_s, usage.completion_tokens, capped)
        return router_pb2.GenerateChunk(
            request_id=fl.req.request_id,
            token_ids=wc.token_ids,
            text=text,
            finish_reason=wc.finish_reason,
            usage=usage,
            timings=timings,
        )

    def _finish(
        self, fl: _Flight, wid: WorkerId, now: float, ttft_s: float, e2e_s: float, num_output: int, capped: bool
    ) -> None:
        """Bookkeeping before the final chunk is yielded, so a client leaving right after it is not an abort."""
        fl.finished = True
        fl.served_by = wid
        fl.call = None
        self._end_attempt(fl, send_abort=False, finished_tokens=num_output)
        model = fl.req.model
        if self._predictor is not None:
            self._predictor.observe(model, len(fl.req.prompt_token_ids), num_output, fl.req.prediction, capped)
        self._metrics.ttft.labels(model).observe(ttft_s)
        self._metrics.e2e.labels(model).observe(e2e_s)
        if num_output > 1:
            self._metrics.tpot.labels(model).observe((e2e_s - ttft_s) / (num_output - 1))
        log.debug(
            "request %s finished on %s: %d tokens ttft=%.3fs e2e=%.3fs attempts=%d",
            fl.req.request_id, wid, num_output, ttft_s, e2e_s, fl.attempt + 1,
        )

    def _end_attempt(self, fl: _Flight, send_abort: bool, finished_tokens: int | None = None) -> None:
        """The current attempt is over (finished, failed, cancelled): release its slot exactly once."""
        decision, fl.decision = fl.decision, None
        if decision is None:
            return
        wid = decision.worker_id
        now = self._clock.now()
        self._fleet.note_done(wid)
        if finished_tokens is not None:
            self._policy.on_finish(fl.req.request_id, wid, now, finished_tokens)
        else:
            self._policy.on_abort(fl.req.request_id, wid, now)
        rec = self._fleet.get(wid)
        if rec is not None:
            self._metrics.worker_in_flight.labels(wid).set(rec.in_flight)
        call, fl.call = fl.call, None
        if call is not None:
            call.cancel()
            if send_abort and not isinstance(call, SessionCall):  # a session's cancel sent its abort frame
                self._spawn(self._send_abort(wid, fl.req.request_id))
        self.schedule_pump()

    def _cleanup(self, fl: _Flight, status: grpc.StatusCode) -> None:
        """A non-OK exit: take the request out of the queue, or abort it on its worker."""
        stage = "admission"
        if fl.entry is not None and self.queue.remove(fl.entry):
            stage = "queued"
            self._metrics.queue_depth.labels(fl.req.model).set(self.queue.size(fl.req.model))
        elif fl.decision is not None:
            stage = "dispatched"
            self._end_attempt(fl, send_abort=True)
        if status is grpc.StatusCode.DEADLINE_EXCEEDED:
            self._metrics.deadline_exceeded.labels(fl.req.model, stage).inc()
        elif status is grpc.StatusCode.CANCELLED:
            self._metrics.cancelled.labels(fl.req.model, stage).inc()
        log.info("request %s ended %s (%s, attempt %d)", fl.req.request_id, status.name, stage, fl.attempt + 1)

    async def _send_abort(self, wid: WorkerId, request_id: str) -> None:
        stub = self._registry.stub(wid)
        if stub is None:
            return
        try:
            await stub.Abort(worker_pb2.AbortRequest(request_ids=[request_id]), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            log.debug("abort of %s on %s failed: %s", request_id, wid, e.code().name)

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ background
    async def run_ticks(self, interval_s: float) -> None:
        """Policy.on_tick every `interval_s`, plus a queue pump as a safety net for missed wake-ups."""
        while True:
            await asyncio.sleep(interval_s)
            now = self._clock.now()
            self._fleet.set_time(now)
            try:
                t0 = time.perf_counter()
                self._policy.on_tick(now)
                self._metrics.tick_time.labels(self._policy_name).observe(time.perf_counter() - t0)
                self._metrics.observe_policy_counters(self._policy_name, self._policy.counters())
                self._metrics.observe_policy_state(self._policy_name, self._policy.state_sizes())
            except Exception:  # a policy bug must not stop the ticks, nor the pump below
                log.exception("policy %s failed in on_tick", self._policy_name)
            self.pump()

    async def close(self) -> None:
        """Fail whatever still waits in the queue, and let pending Abort calls finish."""
        for model in self.queue.models():
            while (entry := self.queue.pop(model)) is not None:
                fl: _Flight = entry.payload
                if fl.future is not None and not fl.future.done():
                    fl.future.set_exception(ApiError(grpc.StatusCode.UNAVAILABLE, "router is shutting down"))
        if self._background:
            await asyncio.wait(self._background, timeout=self._rpc_timeout_s)
