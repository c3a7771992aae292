"""The gRPC surface: proto <-> domain conversions, and the Router and Admin servicers with their status codes.

Servicers only translate: admission validates, the dispatcher queues/routes/streams, the registry owns workers.
Every accepted request ends in a final chunk or an explicit status (`ApiError` -> `context.abort`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc

from switchyard.auth import KeyEvents, KeyLimits, TokenCharge, cache_salt_for, calling_key
from switchyard.router.admission import (
    LONG_INPUT,
    AdmittedRequest,
    ApiError,
    GenerateParams,
    Sampling,
    admit,
    check,
    input_size,
    tokenize,
)
from switchyard.router.fleet import StatsSample, WorkerInfo, WorkerState
from switchyard.router.policies.base import Decision, WorkerId
from switchyard.router.stream_governor import StreamIntervalGovernor
from switchyard.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from switchyard.workers.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    RequestAdmitted,
    RequestEnded,
    RequestEvent,
    RequestFirstToken,
)
from switchyard.workers.tokenizer import ChatMessage

if TYPE_CHECKING:
    from switchyard.router.clock import Clock
    from switchyard.router.dispatch import Dispatcher
    from switchyard.router.metrics import RouterMetrics
    from switchyard.router.predictor.service import PredictorService
    from switchyard.router.registry import WorkerRegistry
    from switchyard.workers.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Complete's chunks from the worker: the first token alone (TTFT, the policy's first-token hook), then as few as the
# worker's hold limit allows (one a second), since nobody reads them before the end
COMPLETE_STREAM_INTERVAL = 1 << 30


# ---------------------------------------------------------------------- public requests
def sampling_from_proto(s: common_pb2.SamplingParams) -> Sampling:
    return Sampling(
        max_tokens=s.max_tokens,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        stop=tuple(s.stop),
        seed=s.seed if s.HasField("seed") else None,
        ignore_eos=s.ignore_eos,
        extra=dict(s.extra),
    )


def sampling_to_proto(s: Sampling) -> common_pb2.SamplingParams:
    out = common_pb2.SamplingParams(max_tokens=s.max_tokens, stop=list(s.stop), ignore_eos=s.ignore_eos, extra=s.extra)
    if s.temperature is not None:
        out.temperature = s.temperature
    if s.top_p is not None:
        out.top_p = s.top_p
    if s.seed is not None:
        out.seed = s.seed
    return out


def params_from_proto(req: router_pb2.GenerateRequest) -> GenerateParams:
    which = req.WhichOneof("input")
    return GenerateParams(
        request_id=req.request_id or uuid.uuid4().hex,
        model=req.model,
        sampling=sampling_from_proto(req.sampling),
        chat=tuple(ChatMessage(m.role, m.content) for m in req.chat.messages) if which == "chat" else None,
        prompt=req.prompt if which == "prompt" else None,
        token_ids=tuple(req.tokens.ids) if which == "tokens" else None,
        lora_name=req.lora_name,
        cache_salt=req.cache_salt,
        priority=req.priority,
        session_id=req.session_id,
        app_id=req.application.app_id,
        predicted_output_tokens_hint=req.predicted_output_tokens_hint,
    )


# ---------------------------------------------------------------------- worker protocol
def worker_request(
    req: AdmittedRequest,
    decision: Decision,
    predicted_output_tokens: int | None = None,
    origin: str = "",
    stream_interval: int = 1,
) -> worker_pb2.WorkerGenerateRequest:
    """Token ids only, so the worker caches exactly the blocks the router hashed. Hints: the policy's win, then
    the router's settled prediction (`predicted_output_tokens`), then the client's. `origin`: this router replica
    (the worker's request events name it); the API key's name travels as `tenant`, so the other replicas count the
    request toward its limits. `stream_interval`: token ids per chunk the worker may gather (the first goes alone)."""
    return worker_pb2.WorkerGenerateRequest(
        stream_interval_tokens=stream_interval,
        origin=origin,
        tenant=req.tenant,
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        sampling=sampling_to_proto(req.sampling),
        lora_name=req.lora_name,
        cache_salt=req.cache_salt,
        priority=decision.priority or req.priority,
        predicted_output_tokens=(
            decision.predicted_output_tokens or predicted_output_tokens or req.predicted_output_tokens or 0
        ),
    )


_LIFECYCLE_TO_STATE = {
    worker_pb2.LIFECYCLE_STATE_STARTING: WorkerState.STARTING,
    worker_pb2.LIFECYCLE_STATE_READY: WorkerState.READY,
    worker_pb2.LIFECYCLE_STATE_DRAINING: WorkerState.DRAINING,
    worker_pb2.LIFECYCLE_STATE_SLEEPING: WorkerState.SLEEPING,
}


def state_from_proto(state: int) -> WorkerState:
    """UNSPECIFIED (a worker that does not report a lifecycle) counts as ready."""
    return _LIFECYCLE_TO_STATE.get(state, WorkerState.READY)


def info_from_proto(info: worker_pb2.WorkerInfo, address: str) -> WorkerInfo:
    return WorkerInfo(
        worker_id=WorkerId(info.worker_id or address),
        model=info.model,
        max_model_len=info.max_model_len,
        block_size=info.block_size,
        kv_capacity_blocks=info.kv_capacity_blocks,
        block_hash_algo=info.block_hash_algo or "sha256",
        block_hash_seed=info.block_hash_seed,
        tokenizer_id=info.tokenizer_id,
        max_num_seqs=info.max_num_seqs or 256,
        max_num_batched_tokens=info.max_num_batched_tokens or 8192,
        perf_profile=info.perf_profile,
        engine=info.engine,
        address=address,
        incarnation=info.incarnation,
    )


def stats_from_proto(s: worker_pb2.WorkerStats) -> StatsSample:
    return StatsSample(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        kv_blocks_used=s.kv_blocks_used,
        kv_blocks_total=s.kv_blocks_total,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_waiting_uncached_tokens=s.num_waiting_uncached_tokens,
        num_iterations=s.num_iterations,
        num_preemptions=s.num_preemptions,
        generation_tokens_per_s=s.generation_tokens_per_s,
        num_requests_received=s.num_requests_received,
    )


def _event_from_proto(e: worker_pb2.KvEvent) -> KvEvent | None:
    which = e.WhichOneof("event")
    if which == "stored":
        s = e.stored
        return BlockStored(
            block_hashes=tuple(s.block_hashes),
            parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
            token_ids=(),  # not decoded: the router keys blocks by hash (see kv_batch_from_proto)
            block_size=s.block_size,
            lora_name=s.lora_name or None,
        )
    if which == "removed":
        return BlockRemoved(block_hashes=tuple(e.removed.block_hashes))
    if which == "cleared":
        return AllBlocksCleared()
    return None  # an event kind this router does not know: ignored


def _request_event_from_proto(e: worker_pb2.RequestEvent) -> RequestEvent | None:
    which = e.WhichOneof("event")
    if which == "admitted":
        a = e.admitted
        return RequestAdmitted(
            e.request_id, e.origin, tuple(a.block_hashes), a.num_prompt_tokens, a.max_tokens,
            a.predicted_output_tokens, a.lora_name or None, a.cache_salt or None, a.tenant,
        )
    if which == "first_token":
        return RequestFirstToken(e.request_id, e.origin)
    if which == "ended":
        return RequestEnded(e.request_id, e.origin, e.ended.num_output_tokens, e.ended.finished)
    return None  # a kind this router does not know: ignored


def kv_batch_from_proto(b: worker_pb2.KvEventBatch, peers_of: str | None = None) -> KvEventBatch:
    """The batch as the router uses it: BlockStored events keep hashes, parent, size and LoRA but not their
    token ids, which nothing in the router reads (a full cache's snapshot carries ~1M: 50-70 ms to decode).
    Request events are decoded for `peers_of` (this replica's origin) and only the other replicas' (it knows its
    own); with None, none are (a policy that does not mirror them)."""
    events = tuple(ev for ev in map(_event_from_proto, b.events) if ev is not None)
    requests: tuple[RequestEvent, ...] = ()
    if peers_of is not None and b.requests:
        got = [_request_event_from_proto(e) for e in b.requests if e.origin != peers_of]
        requests = tuple(ev for ev in got if ev is not None)
    return KvEventBatch(seq=b.seq, ts=b.ts, events=events, requests=requests, snapshot=b.snapshot)


# ---------------------------------------------------------------------- servicers
async def _abort(context: grpc.aio.ServicerContext, err: ApiError) -> None:
    if err.trailing:
        context.set_trailing_metadata(err.trailing)
    await context.abort(err.code, err.message)


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        registry: WorkerRegistry,
        dispatcher: Dispatcher,
        tokenizer_for: Callable[[str], Tokenizer],
        max_tokens_cap: int,
        clock: Clock,
        metrics: RouterMetrics,
        predictor: PredictorService | None = None,
        key_limits: KeyLimits | None = None,
        key_events: KeyEvents | None = None,
        stream_interval: StreamIntervalGovernor | None = None,
    ) -> None:
        self._registry = registry
        # Generate's token ids per chunk for requests that do not say (its `interval`, which may move under load)
        self._stream_interval = stream_interval or StreamIntervalGovernor(1, 1, 1.0)
        self._predictor = predictor
        self._key_limits, self._key_events = key_limits, key_events  # the Router service's API keys' (or None)
        self._dispatcher = dispatcher
        self._tokenizer_for = tokenizer_for
        self._max_tokens_cap = max_tokens_cap
        self._clock = clock
        self._metrics = metrics

    async def _admit(self, request: router_pb2.GenerateRequest) -> AdmittedRequest:
        params = params_from_proto(request)
        arrival_s = self._clock.now()
        token_ids, tokenize_s = None, 0.0
        try:
            key = calling_key.get()
            try:
                salt = cache_salt_for(params.cache_salt, key)
            except ValueError as e:
                raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            if salt != params.cache_salt:  # an isolated key's (a copy of the params only then)
                params = dataclasses.replace(params, cache_salt=salt)
            # a long input is tokenized in a thread, after the checks that need no tokenizer (`admit` checks again:
            # a worker may have left meanwhile)
            if input_size(params) > LONG_INPUT:
                check(params, self._registry, self._max_tokens_cap)
                t0 = time.perf_counter()
                token_ids = await asyncio.to_thread(tokenize, params, self._tokenizer_for(params.model))
                tokenize_s = time.perf_counter() - t0
            admitted = admit(
                params, self._registry, self._tokenizer_for, self._max_tokens_cap, arrival_s, self._predictor,
                token_ids, tokenize_s, key.name if key is not None else "",
            )
        except ApiError as e:
            log.info("request %s rejected: %s %s", params.request_id, e.code.name, e.message)
            # a model no worker serves is counted under "" : the label comes from the client, and one series per
            # made-up name would grow without bound (memory here, cardinality in Prometheus)
            model = request.model if self._registry.spec(request.model) is not None else ""
            self._metrics.requests.labels(model, "", e.code.name.lower()).inc()
            raise
        self._metrics.tokenize_time.labels(admitted.model).observe(admitted.tokenize_s)
        return admitted

    def _reserve(self, admitted: AdmittedRequest) -> TokenCharge | None:
        """Reserve the request's tokens under its API key's `tokens_per_min` (None without one), or end it
        RESOURCE_EXHAUSTED (with `retry-after-ms` where waiting will do)."""
        key = calling_key.get()
        if key is None or not key.tokens_per_min or self._key_limits is None:
            return None
        prompt = len(admitted.prompt_token_ids)
        reserved = prompt + admitted.sampling.max_tokens
        refusal = self._key_limits.reserve_tokens(key, reserved)
        if refusal is not None:
            if self._key_events is not None:
                self._key_events.limited(key.name, refusal.limit)
            log.info("request %s refused: %s", admitted.request_id, refusal.message)
            trailing = (("retry-after-ms", str(refusal.retry_after_ms)),) if refusal.retry_after_ms is not None else ()
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message, trailing)
        return TokenCharge(key, prompt, reserved)

    def _settle(self, charge: TokenCharge) -> None:
        """The request ended (a result, an error or a cancel): what it did not use goes back to its key."""
        assert self._key_limits is not None
        used = charge.used
        self._key_limits.refund_tokens(charge.key, charge.reserved - used)
        if self._key_events is not None:
            self._key_events.tokens(charge.key.name, used)

    async def _chunks(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext, stream_interval: int
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        """The request admitted, charged to its API key's token quota (`_reserve`), and streamed by the
        dispatcher in chunks of `stream_interval` tokens; the charge is settled however the stream ends."""
        admitted = await self._admit(request)
        charge = self._reserve(admitted)
        try:
            async for chunk in self._dispatcher.generate(admitted, context.time_remaining(), stream_interval):
                if charge is not None:
                    charge.seen(len(chunk.token_ids))
                yield chunk
        finally:
            if charge is not None:
                self._settle(charge)

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        try:
            interval = request.stream_interval_tokens or self._stream_interval.interval
            async for chunk in self._chunks(request, context, interval):
                yield chunk
        except ApiError as e:
            await _abort(context, e)

    async def Complete(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.CompleteResponse:
        try:
            token_ids: list[int] = []
            texts: list[str] = []
            last = None
            async for chunk in self._chunks(request, context, COMPLETE_STREAM_INTERVAL):
                token_ids.extend(chunk.token_ids)
                texts.append(chunk.text)
                last = chunk
        except ApiError as e:
            await _abort(context, e)
            raise  # unreachable: abort raises
        assert last is not None  # the dispatcher always ends with a final chunk or raises
        return router_pb2.CompleteResponse(
            request_id=last.request_id,
            token_ids=token_ids,
            text="".join(texts),
            finish_reason=last.finish_reason,
            usage=last.usage,
            timings=last.timings,
        )


class AdminService(router_pb2_grpc.AdminServicer):
    def __init__(self, registry: WorkerRegistry) -> None:
        self._registry = registry

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        return router_pb2.ListWorkersResponse(workers=self._registry.statuses())

    async def RegisterWorker(
        self, request: router_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.WorkerStatus:
        try:
            return await self._registry.register(request.address)
        except ApiError as e:
            await _abort(context, e)
            raise

    async def DeregisterWorker(
        self, request: router_pb2.WorkerRef, context: grpc.aio.ServicerContext
    ) -> router_pb2.WorkerStatus:
        try:
            return await self._registry.deregister(request.worker_id)
        except ApiError as e:
            await _abort(context, e)
            raise

    async def DrainWorker(self, request: router_pb2.WorkerRef, context: grpc.aio.ServicerContext) -> router_pb2.WorkerStatus:
        try:
            return self._registry.drain(request.worker_id)
        except ApiError as e:
            await _abort(context, e)
            raise

