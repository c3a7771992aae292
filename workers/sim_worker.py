"""The simulated worker process: `EngineCore` in real time behind the gRPC `switchyard.v1.Worker` service.

It plays vLLM's `EngineCoreProc` role: one asyncio task steps the engine, sleeps for each iteration's modelled
duration (x `--time-scale`), then delivers the outputs to the request streams and publishes the KV events. The
engine itself never sleeps or touches a socket (`workers/engine/core.py`).

    python -m switchyard.workers.sim_worker --port 0 --time-scale 0.01   # prints `READY 127.0.0.1:<port> ...`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TextIO

import grpc
import xxhash
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from switchyard.grpc_options import add_keepalive_args, server_options_from_args
from switchyard.sd_notify import ServiceNotifier
from switchyard.tls import TlsError, add_port, add_server_args, server_tls_from_args
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from switchyard.workers.engine import kv_events as kv
from switchyard.workers.engine.core import SCHEDULINGS, EngineConfig, EngineCore
from switchyard.workers.engine.types import EngineRequest, FinishReason, RequestOutput
from switchyard.workers.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

DEFAULT_MODEL = "mistral-7b-sim"
DEFAULT_PROFILE = "llama3-8b-a100"
SERVICE_NAME = "switchyard.v1.Worker"
REPLAY_BATCHES = 10_000  # KvEvents replay buffer (vLLM's buffer_steps default)
SNAPSHOT_BATCH_BLOCKS = 4_096  # blocks per snapshot batch: ~0.2 MB at 16 tokens a block, far under gRPC's 4 MB
SUBSCRIBER_QUEUE_BATCHES = (
    2_000  # a KvEvents subscriber this far behind is dropped (it reconnects and replays)
)
RATE_WINDOW_S = 5.0  # Stats token rates are averaged over this window
RESYNC_LAG_S = 0.05  # wall seconds behind schedule after which the engine clock stops chaining steps
DETOK_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output (vLLM's initial detokenization offset)
DETOK_MAX_HOLD_TOKENS = 6  # emit text even if it still ends in U+FFFD after this many held tokens
STREAM_MAX_HOLD_S = 1.0  # a request's `stream_interval_tokens` holds no token longer (a slow decode still streams)

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_BIND_FAILED = 3

_FINISH_TO_PROTO = {
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.ABORT: common_pb2.FINISH_REASON_ABORT,
}


class IncrementalDetokenizer:
    """Text deltas for a growing token list, correct for SentencePiece (vLLM's prefix/read offsets).

    Decoding one token alone loses SentencePiece's leading-space handling and splits multi-byte characters,
    so each delta is decode(window) minus decode(window without the new tokens), where the window starts a few
    tokens back (seeded with the prompt's tail). Text ending in an incomplete character is held back.
    """

    __slots__ = ("_tok", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self._tok = tokenizer
        self._ids = list(prompt_token_ids[-DETOK_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_ids: Sequence[int], final: bool = False) -> str:
        self._ids.extend(token_ids)
        if len(self._ids) == self._read_offset:
            return ""
        prefix_text = self._tok.decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._tok.decode(self._ids[self._prefix_offset :])
        held = len(self._ids) - self._read_offset
        if (
            (len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"))
            and not final
            and held < DETOK_MAX_HOLD_TOKENS
        ):
            return ""  # an incomplete UTF-8 sequence: wait for its remaining bytes
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # NOTE: SentencePiece decodes a window's first piece without its leading space; both texts start at the
        # same token, so the difference is still exact.
        return new_text[len(prefix_text) :]


class _Aborted:
    """Queued to a stream when the request was aborted by the Abort RPC or the drain timeout."""


class _Failed:
    """Queued to a stream when the engine loop raised."""


class TokenRateMeter:
    """Prompt/generation tokens per second over the last RATE_WINDOW_S, from cumulative counters (for Stats)."""

    def __init__(self) -> None:
        self._samples: collections.deque[tuple[float, int, int]] = collections.deque()

    def sample(self, t: float, prompt_total: int, generation_total: int) -> None:
        """Record the counters at most every 0.25 s, keeping one sample older than the window."""
        samples = self._samples
        if samples and t - samples[-1][0] < 0.25:
            return
        samples.append((t, prompt_total, generation_total))
        while len(samples) > 2 and t - samples[1][0] > RATE_WINDOW_S:
            samples.popleft()

    def rates(self, t: float, prompt_total: int, generation_total: int) -> tuple[float, float]:
        self.sample(t, prompt_total, generation_total)
        t0, p0, g0 = self._samples[0]
        if t - t0 <= 1e-3:
            return 0.0, 0.0
        return (prompt_total - p0) / (t - t0), (generation_total - g0) / (t - t0)


def _merged(
    held: worker_pb2.WorkerGenerateChunk, chunk: worker_pb2.WorkerGenerateChunk
) -> worker_pb2.WorkerGenerateChunk:
    """`held` followed by `chunk`, as one chunk: ids and text appended, the final chunk's fields taken."""
    text = held.text + chunk.text
    held.MergeFrom(chunk)  # repeated token ids append; finish reason and usage (set only on the last) are copied
    held.text = text
    return held


class ChunkGatherer:
    """Cuts one stream's chunks into chunks of at least `interval` token ids (vLLM's `stream_interval`), so a
    streaming client and every hop before it handle N times fewer messages. Which tokens, and when the first and
    the last arrive, never change: the first chunk and the final one go at once, and no token is held longer than
    `STREAM_MAX_HOLD_S` (a slow decode still streams). The gRPC Generate and the HTTP facade share it."""

    __slots__ = ("interval", "_held", "_held_since", "_sent")

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._held: worker_pb2.WorkerGenerateChunk | None = None
        self._held_since = 0.0
        self._sent = False

    def add(self, chunk: worker_pb2.WorkerGenerateChunk, finished: bool) -> worker_pb2.WorkerGenerateChunk | None:
        """The chunk to send now (`chunk`, after what was held), or None while it is held."""
        if self.interval <= 1:
            return chunk
        if self._held is not None:
            chunk = _merged(self._held, chunk)
        if self._sent and not finished and len(chunk.token_ids) < self.interval:
            now = time.monotonic()
            if self._held is None:
                self._held_since = now
            if now - self._held_since < STREAM_MAX_HOLD_S:
                self._held = chunk
                return None
        self._held = None
        self._sent = True
        return chunk


def effective_stream_interval(requested: int, worker_floor: int) -> int:
    """A request's effective stream interval: what it asked for (0: not set), raised to the worker's
    `--stream-interval`, as vLLM clamps a request's `stream_interval` up to its engine-level one."""
    return max(requested, worker_floor, 1)


def add_stream_interval_arg(p: argparse.ArgumentParser) -> None:
    """`--stream-interval`, the sim and the vLLM worker's (vLLM's engine flag of the same name and meaning)."""
    def at_least_one(text: str) -> int:
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be at least 1 (got {n})")
        return n

    p.add_argument(
        "--stream-interval", type=at_least_one, default=1,
        help="token ids per streamed chunk, at least (the first and the last go at once; a request may ask for "
        "more, never less): fewer messages for the router and the client, as vLLM's --stream-interval",
    )  # fmt: skip


class _Stream:
    """One Generate call's state: outputs queued by the engine loop, consumed by the RPC handler."""

    __slots__ = (
        "request_id",
        "queue",
        "received_at",
        "first_token_at",
        "num_prompt_tokens",
        "num_cached_tokens",
        "num_output_tokens",
        "num_streamed_tokens",
        "detok",
        "stops",
        "max_stop_len",
        "text",
        "num_emitted_chars",
        "is_finished",
        "is_engine_done",
        "origin",
        "finish",
    )

    def __init__(self, request_id: str, received_at: float, detok: IncrementalDetokenizer, stops: list[str]):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | _Aborted | _Failed] = asyncio.Queue()
        self.received_at = received_at
        self.first_token_at = 0.0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.num_output_tokens = 0
        self.num_streamed_tokens = 0  # token ids sent in chunks so far
        self.detok = detok
        self.stops = [s for s in stops if s]
        self.max_stop_len = max((len(s) for s in self.stops), default=0)
        self.text = ""  # generated text so far (trimmed at a stop string)
        self.num_emitted_chars = 0
        self.is_finished = False  # the final chunk was built
        self.is_engine_done = False  # the engine finished or aborted the request itself
        self.origin = ""  # the router replica that sent it (its request events name it)
        self.finish: FinishReason | None = None  # the final chunk's

    def ended(self) -> kv.RequestEnded:
        """Its end, for the request events (at the RPC's end: finished, or aborted, cancelled or failed)."""
        return kv.RequestEnded(
            self.request_id, self.origin, self.num_output_tokens,
            self.finish is not None and self.finish is not FinishReason.ABORT,
        )

    async def take(self) -> list[RequestOutput | _Aborted | _Failed]:
        """Wait for the next output, then take everything queued behind it (one chunk per wake-up)."""
        items = [await self.queue.get()]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def _cut_at_stop(self) -> bool:
        """Trim the text at the first stop string that the last token completed; True if one did."""
        start = max(0, self.num_emitted_chars - self.max_stop_len)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def consume(
        self, items: list[RequestOutput | _Aborted | _Failed]
    ) -> worker_pb2.WorkerGenerateChunk | None:
        """Fold queued outputs into one chunk; None when there is nothing to send (a prefill chunk)."""
        new_ids: list[int] = []
        finish: FinishReason | None = None
        for item in items:
            if isinstance(item, _Aborted):
                finish = FinishReason.ABORT
                self.is_engine_done = True
                break
            if isinstance(item, _Failed):
                raise RuntimeError("the engine loop failed")
            self.num_prompt_tokens = item.num_prompt_tokens or self.num_prompt_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, item.num_cached_tokens)
            last = item.finish_reason is not None
            if self.stops:
                # token by token, as vLLM's output processor: where a stop string ends must not depend on how
                # many engine steps this wake-up folds (a slow consumer would otherwise get the whole tail)
                ids = item.new_token_ids
                for j, tid in enumerate(ids):
                    new_ids.append(tid)
                    self.text += self.detok.add([tid], final=last and j == len(ids) - 1)
                    if self._cut_at_stop():
                        finish = FinishReason.STOP
                        break
                if finish is FinishReason.STOP:  # usage counts through the token that completed the stop
                    self.num_output_tokens = self.num_streamed_tokens + len(new_ids)
                    break
                if not ids and last:
                    self.text += self.detok.add([], final=True)
            else:
                new_ids.extend(item.new_token_ids)
            self.num_output_tokens = max(self.num_output_tokens, item.num_output_tokens)
            if last:
                finish = item.finish_reason
                self.is_engine_done = True
                break
        if not self.stops:
            self.text += self.detok.add(new_ids, final=finish is not None)
        if finish is not None or not self.stops:
            end = len(self.text)
        else:  # hold back what could be the start of a stop string until the next delta decides
            end = max(self.num_emitted_chars, len(self.text) - self.max_stop_len + 1)
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = max(self.num_emitted_chars, end)
        self.num_streamed_tokens += len(new_ids)
        if not new_ids and not delta and finish is None:
            return None
        chunk = worker_pb2.WorkerGenerateChunk(
            request_id=self.request_id,
            token_ids=new_ids,
            text=delta,
            received_at=self.received_at,
            first_token_at=self.first_token_at,
        )
        if finish is not None:
            self.is_finished = True
            self.finish = finish
            chunk.finish_reason = _FINISH_TO_PROTO[finish]
            chunk.usage.prompt_tokens = self.num_prompt_tokens
            chunk.usage.completion_tokens = self.num_output_tokens
            chunk.usage.cached_prompt_tokens = self.num_cached_tokens
        return chunk


def event_to_proto(event: kv.KvEvent) -> worker_pb2.KvEvent:
    if isinstance(event, kv.BlockStored):
        stored = worker_pb2.BlockStored(
            block_hashes=event.block_hashes,
            token_ids=event.token_ids,
            block_size=event.block_size,
            lora_name=event.lora_name or "",
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        return worker_pb2.KvEvent(stored=stored)
    if isinstance(event, kv.BlockRemoved):
        return worker_pb2.KvEvent(removed=worker_pb2.BlockRemoved(block_hashes=event.block_hashes))
    return worker_pb2.KvEvent(cleared=worker_pb2.AllBlocksCleared())


def request_event_to_proto(event: kv.RequestEvent) -> worker_pb2.RequestEvent:
    out = worker_pb2.RequestEvent(request_id=event.request_id, origin=event.origin)
    if isinstance(event, kv.RequestAdmitted):
        out.admitted.CopyFrom(worker_pb2.RequestAdmitted(
            block_hashes=event.block_hashes, num_prompt_tokens=event.num_prompt_tokens, max_tokens=event.max_tokens,
            predicted_output_tokens=event.predicted_output_tokens, lora_name=event.lora_name or "",
            cache_salt=event.cache_salt or "", tenant=event.tenant,
        ))
    elif isinstance(event, kv.RequestFirstToken):
        out.first_token.SetInParent()
    else:
        out.ended.CopyFrom(worker_pb2.RequestEnded(num_output_tokens=event.num_output_tokens, finished=event.finished))
    return out


class _Subscriber:
    __slots__ = ("queue", "is_overflowed")

    def __init__(self) -> None:
        self.queue: asyncio.Queue[worker_pb2.KvEventBatch | None] = asyncio.Queue(SUBSCRIBER_QUEUE_BATCHES)
        self.is_overflowed = False


class KvEventHub:
    """Numbers KV event batches, keeps the last REPLAY_BATCHES for resuming subscribers, fans out live ones.

    Publishing never blocks: a subscriber whose queue is full is dropped (its stream ends RESOURCE_EXHAUSTED).
    Request events (`announce`) ride the same stream: they wait for the next batch (`publish`, `flush_requests`),
    and the open requests' admissions are kept for new subscribers' snapshots.
    """

    def __init__(self, capture: Callable[[], Callable[[], list[kv.KvEvent]]]) -> None:
        # reads the cache now and returns what builds its snapshot events (`EngineCore.capture_kv_snapshot`)
        self._capture = capture
        self._seq = 0
        # this process's numbering: a router resuming with another incarnation's seq gets the snapshot
        self.incarnation = uuid.uuid4().hex[:16]
        # deque, not list: O(1) eviction of the oldest batch
        self._buffer: collections.deque[worker_pb2.KvEventBatch] = collections.deque(maxlen=REPLAY_BATCHES)
        self._subscribers: set[_Subscriber] = set()
        self._pending: list[worker_pb2.RequestEvent] = []  # request events for the next batch
        # (origin, request id) -> its admission and first-token events, while open (snapshots re-announce them)
        self._open: dict[tuple[str, str], list[worker_pb2.RequestEvent]] = {}

    @property
    def seq(self) -> int:
        return self._seq

    def announce(self, event: kv.RequestEvent) -> None:
        """Queue a request event for the next batch."""
        pe = request_event_to_proto(event)
        key = (event.origin, event.request_id)
        if isinstance(event, kv.RequestEnded):
            self._open.pop(key, None)
        else:
            self._open.setdefault(key, []).append(pe)
        self._pending.append(pe)

    def flush_requests(self, ts: float) -> None:
        """Publish the queued request events now, in a batch of their own (none queued: nothing)."""
        if self._pending:
            self.publish((), ts)

    def publish(self, events: Sequence[kv.KvEvent], ts: float) -> None:
        self._seq += 1
        batch = worker_pb2.KvEventBatch(
            seq=self._seq, ts=ts, events=[event_to_proto(e) for e in events], requests=self._pending
        )
        self._pending = []
        self._buffer.append(batch)
        for sub in list(self._subscribers):
            try:
                sub.queue.put_nowait(batch)
            except asyncio.QueueFull:
                sub.is_overflowed = True
                self._subscribers.discard(sub)
                log.warning(
                    "KvEvents subscriber fell %d batches behind; dropping it", SUBSCRIBER_QUEUE_BATCHES
                )

    def subscribe(
        self, start_after_seq: int, ts: float, incarnation: str = ""
    ) -> tuple[_Subscriber, Callable[[], list[worker_pb2.KvEventBatch]]]:
        """Register a subscriber; returns it with what makes the batches to send first: a replay, or a snapshot of
        the cache as it is now (read here; built by the function, which touches nothing the engine changes, so
        the servicer runs it in a thread: 0.25-0.6 s for a full 64k-block cache, which held the engine's loop
        before). Events published meanwhile queue up behind it.
        `incarnation`: the one `start_after_seq` was read from ("" = unknown: the seq alone decides)."""
        oldest = self._buffer[0].seq if self._buffer else self._seq + 1
        ours = incarnation in ("", self.incarnation)
        sub = _Subscriber()
        self._subscribers.add(sub)
        if ours and 0 < start_after_seq <= self._seq and start_after_seq >= oldest - 1:
            replay = [b for b in self._buffer if b.seq > start_after_seq]
            return sub, lambda: replay
        # a fresh subscriber, one older than the buffer, or one from another incarnation of this worker
        build, seq = self._capture(), self._seq
        # the open requests as of now; later events queue up behind the snapshot
        open_requests = [e for events in self._open.values() for e in events]

        def snapshot() -> list[worker_pb2.KvEventBatch]:
            parts = kv.split_stored([kv.AllBlocksCleared(), *build()], SNAPSHOT_BATCH_BLOCKS)
            # only the last part carries the seq: a stream cut mid-snapshot leaves the router at 0, so it resumes
            # with a fresh snapshot rather than from a half-applied one
            return [
                worker_pb2.KvEventBatch(
                    seq=seq if i == len(parts) - 1 else 0, ts=ts, events=[event_to_proto(e) for e in part],
                    requests=open_requests if i == 0 else (), snapshot=i == 0,
                )
                for i, part in enumerate(parts)
            ]

        return sub, snapshot

    def unsubscribe(self, sub: _Subscriber) -> None:
        self._subscribers.discard(sub)

    def close(self) -> None:
        """End every live stream (shutdown)."""
        for sub in self._subscribers:
            with contextlib.suppress(asyncio.QueueFull):
                sub.queue.put_nowait(None)
        self._subscribers.clear()


class SimWorker:
    """The engine loop, the request streams and the KV event hub; the gRPC servicer is a thin shell over it."""

    def __init__(
        self,
        core: EngineCore,
        tokenizer: Tokenizer,
        worker_id: str,
        model: str,
        perf_profile: str,
        time_scale: float = 1.0,
        seed: int | None = None,
        timings_log: TextIO | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.model = model
        self.perf_profile = perf_profile
        self.time_scale = time_scale
        self.seed = seed
        self.timings_log = timings_log  # JSONL, one line per request: the worker-side timestamps
        self.stream_interval = 1  # token ids per streamed chunk, at least (`--stream-interval`)
        self.state = worker_pb2.LIFECYCLE_STATE_STARTING
        self.hub = KvEventHub(core.capture_kv_snapshot)
        # Extra KV event consumers, called with each step's events (the vLLM-format ZMQ publisher).
        self.kv_sinks: list[Callable[[Sequence[kv.KvEvent], float], object]] = []
        self.streams: dict[str, _Stream] = {}
        self.idle = asyncio.Event()  # set while no Generate stream is open (drain waits on it)
        self.idle.set()
        self._wake = asyncio.Event()
        self._epoch = time.time()
        self._last_arrival_s = 0.0
        self.rates = TokenRateMeter()
        self._task: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- clock

    def engine_now(self) -> float:
        """The engine clock: wall time, running 1 / time_scale times faster (so scaled sleeps stay exact)."""
        return self._epoch + (time.time() - self._epoch) / self.time_scale

    def wall_of(self, engine_s: float) -> float:
        return self._epoch + (engine_s - self._epoch) * self.time_scale

    # ---------------------------------------------------------------- engine loop

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._engine_loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _engine_loop(self) -> None:
        core = self.core
        busy_until: float | None = None  # engine time the last step's outputs became visible
        while True:
            if not core.has_unfinished():
                busy_until = None
                self._flush_kv_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.engine_now()
            # Back-to-back iterations chain exactly (a GPU does not wait for the event loop's timer slack).
            if busy_until is not None and now - busy_until < RESYNC_LAG_S / self.time_scale:
                now = max(busy_until, self._last_arrival_s)
            try:
                result = core.step(now)
            except Exception:
                log.exception("engine step failed; failing every open request")
                self._fail_all()
                busy_until = None
                self._wake.clear()
                await self._wake.wait()
                continue
            if result is None:  # nothing schedulable until a request arrives or is aborted
                busy_until = None
                self._flush_kv_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            busy_until = now + result.duration_s
            delay = self.wall_of(busy_until) - time.time()
            if delay > 0:
                await asyncio.sleep(delay)
            self._deliver(result.outputs)
            self._flush_kv_events()
            st = core.stats()
            self.rates.sample(time.time(), st.prompt_tokens_total, st.generation_tokens_total)

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        t = time.time()
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue  # the client went away after this step was scheduled
            if out.new_token_ids and not stream.first_token_at:
                stream.first_token_at = t
                self.hub.announce(kv.RequestFirstToken(out.request_id, stream.origin))
            stream.queue.put_nowait(out)

    def _flush_kv_events(self) -> None:
        """The step's KV events and the request events queued since the last batch, in one batch."""
        events = self.core.take_kv_events()
        ts = time.time()
        if events:
            self.hub.publish(events, ts)
            for sink in self.kv_sinks:
                sink(events, ts)
        else:
            self.hub.flush_requests(ts)

    def _fail_all(self) -> None:
        for rid, stream in list(self.streams.items()):
            self.core.abort_request(rid)
            stream.queue.put_nowait(_Failed())

    # ---------------------------------------------------------------- requests

    def add(
        self, request: EngineRequest, stops: list[str], received_at: float, origin: str = "", tenant: str = ""
    ) -> _Stream:
        """Register a stream and queue the request in the engine (ValueError from the engine propagates); announce
        it to every KV event subscriber at once (the router replicas that did not send it learn of it there)."""
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        stream = _Stream(request.request_id, received_at, detok, stops)
        stream.num_prompt_tokens = len(request.prompt_token_ids)
        stream.origin = origin
        self.core.add_request(request)
        rid = request.request_id
        self.hub.announce(kv.RequestAdmitted(
            rid, origin, self.core.prompt_block_hashes(rid), stream.num_prompt_tokens, request.max_tokens,
            request.predicted_output_tokens, request.lora_name, request.cache_salt, tenant,
        ))
        self.hub.flush_requests(time.time())
        self.streams[rid] = stream
        self.idle.clear()
        self._last_arrival_s = request.arrival_s
        self._wake.set()
        return stream

    def release(self, stream: _Stream) -> None:
        """The RPC ended: abort the request if it did not finish (client cancelled, stop string, error)."""
        if not stream.is_engine_done:
            self.core.abort_request(stream.request_id)
        self.streams.pop(stream.request_id, None)
        self.hub.announce(stream.ended())  # published with the next batch (the loop is woken below)
        if self.timings_log is not None:
            self._log_timings(stream)
        if not self.streams:
            self.idle.set()
        self._wake.set()

    def _log_timings(self, stream: _Stream) -> None:
        """Record when this worker received the request and produced its first token, keyed by request id,
        so router-added latency is measured the same way whichever router sent it."""
        record = {
            "request_id": stream.request_id,
            "received_at": stream.received_at,
            "first_token_at": stream.first_token_at,
            "finished_at": time.time(),
            "prompt_tokens": stream.num_prompt_tokens,
            "cached_prompt_tokens": stream.num_cached_tokens,
            "output_tokens": stream.num_output_tokens,
        }
        assert self.timings_log is not None
        self.timings_log.write(json.dumps(record) + "\n")

    def abort(self, request_ids: Sequence[str]) -> int:
        num_aborted = 0
        for rid in request_ids:
            stream = self.streams.get(rid)
            if stream is None or stream.is_finished or not self.core.abort_request(rid):
                continue  # unknown, or already finished in the engine (its final output is queued)
            stream.queue.put_nowait(_Aborted())
            num_aborted += 1
        self._wake.set()
        return num_aborted

    def request_seed(self, request_id: str) -> int | None:
        """The sampler seed of a request that carries none: from --seed and its id (None: the engine's default)."""
        if self.seed is None:
            return None
        return xxhash.xxh64_intdigest(f"{self.seed}:{request_id}".encode()) >> 1  # fits proto's int64

    # ---------------------------------------------------------------- info and stats

    def info(self) -> worker_pb2.WorkerInfo:
        cfg = self.core.config
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id,
            model=self.model,
            max_model_len=cfg.max_model_len,
            block_size=cfg.block_size,
            kv_capacity_blocks=self.core.stats().kv_blocks_total,
            tokenizer_id=self.tokenizer.tokenizer_id,
            block_hash_algo=self.core.block_hash_algo,
            block_hash_seed=self.core.block_hash_seed,
            role=worker_pb2.WORKER_ROLE_MIXED,
            state=self.state,
            perf_profile=self.perf_profile,
            engine="sim",
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            incarnation=self.hub.incarnation,
            session=True,
        )

    def stats(self) -> worker_pb2.WorkerStats:
        t = time.time()
        s = self.core.stats()
        prompt_rate, gen_rate = self.rates.rates(t, s.prompt_tokens_total, s.generation_tokens_total)
        return worker_pb2.WorkerStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_blocks_used=s.kv_blocks_used,
            kv_blocks_total=s.kv_blocks_total,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            prompt_tokens_per_s=prompt_rate,
            generation_tokens_per_s=gen_rate,
            num_iterations=s.num_iterations,
            num_preemptions=s.num_preemptions,
            num_waiting_uncached_tokens=s.num_waiting_uncached_tokens,
            timestamp=t,
            state=self.state,
            num_requests_received=s.num_requests_received,
            incarnation=self.hub.incarnation,
        )


# events per Session reply, at most: a reply stays well under the router's 4 MiB receive limit (a chunk is a few
# hundred bytes) even when events piled up while the stream was slow to take them
SESSION_REPLY_EVENTS = 512


class RequestError(Exception):
    """A request that cannot run or failed: the status its Generate call ends with (a Session event's)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Session:
    """One Session stream's requests: a task per request (`WorkerServicer._generate`) putting its chunks, or its
    error, on one list of events that the stream's writer empties into each message."""

    def __init__(self, servicer: WorkerServicer) -> None:
        self.servicer = servicer
        self.events: list[worker_pb2.SessionEvent] = []
        self.ready = asyncio.Event()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.reading = True  # the router may still send requests
        self.ending = False  # the worker drains: end the stream once its requests ended (`end_sessions`)
        self.violation: RequestError | None = None  # a request no event could name: the stream ends with it

    async def read(self, request_iterator: AsyncIterator[worker_pb2.SessionRequest]) -> None:
        loop = asyncio.get_running_loop()
        try:
            async for req in request_iterator:
                for g in req.generate:
                    rid = g.request_id
                    if not rid or rid in self.tasks:  # its error event would name no request, or a running one
                        why = "empty" if not rid else f"{rid!r}, already running in this session"
                        self.violation = RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"session request_id {why}")
                        return
                    self.tasks[rid] = loop.create_task(self._run(g, time.time()))
                if req.abort_request_ids:
                    self.servicer.w.abort(list(req.abort_request_ids))
        finally:
            self.reading = False
            self.ready.set()

    async def _run(self, request: worker_pb2.WorkerGenerateRequest, received_at: float) -> None:
        rid = request.request_id
        try:
            async for chunk in self.servicer._generate(request, received_at):
                self.events.append(worker_pb2.SessionEvent(chunk=chunk))
                self.ready.set()
        except RequestError as e:
            self._put(rid, e)
        except Exception as e:  # noqa: BLE001 - the request ends with UNKNOWN, as an uncaught error ends a call
            log.exception("session request %s failed", rid)
            self._put(rid, RequestError(grpc.StatusCode.UNKNOWN, f"{type(e).__name__}: {e}"))
        finally:
            self.tasks.pop(rid, None)
            self.ready.set()

    def _put(self, rid: str, e: RequestError) -> None:
        self.events.append(worker_pb2.SessionEvent(
            chunk=worker_pb2.WorkerGenerateChunk(request_id=rid), status_code=e.code.value[0], status_message=e.message
        ))
        self.ready.set()

    async def take(self) -> list[worker_pb2.SessionEvent] | None:
        """Every event ready (waiting for one); None once the router closed its side and every request ended."""
        while not self.events:
            if self.violation is not None or ((not self.reading or self.ending) and not self.tasks):
                return None
            self.ready.clear()
            await self.ready.wait()
        if len(self.events) <= SESSION_REPLY_EVENTS:
            events, self.events = self.events, []
        else:
            events, self.events = self.events[:SESSION_REPLY_EVENTS], self.events[SESSION_REPLY_EVENTS:]
        return events

    def close(self) -> None:
        """The stream ended (cancelled, or the router's side closed): requests still running are cancelled,
        which aborts them in the engine (`release`)."""
        for task in self.tasks.values():
            task.cancel()


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """proto <-> SimWorker, and the status codes. The vLLM worker's servicer is this one with its own admission
    (`_admit`), chunking (`_consume`) and limits (`_limits`, `_validate`)."""

    unavailable_message = "worker is not accepting requests (draining)"

    def __init__(self, worker: SimWorker) -> None:
        self.w = worker
        self.sessions: set[_Session] = set()

    def end_sessions(self) -> None:
        """Draining: each Session stream ends (OK) once its requests have, so the server's stop does not wait its
        grace for streams the router keeps open."""
        for session in self.sessions:
            session.ending = True
            session.ready.set()

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: worker_pb2.WorkerGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.WorkerGenerateChunk]:
        try:
            async for chunk in self._generate(request, time.time()):
                yield chunk
        except RequestError as e:
            await context.abort(e.code, e.message)

    async def _generate(
        self, request: worker_pb2.WorkerGenerateRequest, received_at: float
    ) -> AsyncIterator[worker_pb2.WorkerGenerateChunk]:
        """One request's chunks, as Generate and Session send them; a request that cannot run or fails raises
        `RequestError` with the status its call ends with."""
        w = self.w
        if w.state != worker_pb2.LIFECYCLE_STATE_READY:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, self.unavailable_message)
        error = self._validate(request)
        if error:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, error)
        rid = request.request_id or uuid.uuid4().hex
        if rid in w.streams:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already running")
        stream = self._admit(request, rid, received_at)
        gather = ChunkGatherer(effective_stream_interval(request.stream_interval_tokens, w.stream_interval))
        try:
            while True:
                chunk = self._consume(stream, await stream.take())
                if chunk is not None:
                    chunk = gather.add(chunk, stream.is_finished)
                if chunk is not None:
                    yield chunk
                if stream.is_finished:
                    return
        finally:
            w.release(stream)

    async def Session(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[worker_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.SessionReply]:
        """Many Generate calls over one stream (worker.proto): each request runs as its own task, as under its
        own call, and every event ready when the stream can take one more message goes in that one message, so
        an engine step's tokens for all of the session's requests cost one message, not one per request."""
        session = _Session(self)
        self.sessions.add(session)
        reader = asyncio.get_running_loop().create_task(session.read(request_iterator))
        try:
            while (events := await session.take()) is not None:
                yield worker_pb2.SessionReply(events=events)
            if session.violation is not None:
                await context.abort(session.violation.code, session.violation.message)
        finally:
            self.sessions.discard(session)
            reader.cancel()
            session.close()

    def _admit(self, request: worker_pb2.WorkerGenerateRequest, rid: str, received_at: float) -> Any:
        """Queue the validated request in the engine; returns its stream (`RequestError` if the engine refuses)."""
        w = self.w
        sp = request.sampling
        engine_request = EngineRequest(
            request_id=rid,
            prompt_token_ids=tuple(request.prompt_token_ids),
            max_tokens=sp.max_tokens,
            arrival_s=w.engine_now(),
            ignore_eos=sp.ignore_eos,
            seed=sp.seed if sp.HasField("seed") else w.request_seed(rid),
            priority=request.priority,
            predicted_output_tokens=max(0, request.predicted_output_tokens),
            lora_name=request.lora_name or None,
            cache_salt=request.cache_salt or None,
        )
        try:
            stream = w.add(engine_request, list(sp.stop), received_at, request.origin, request.tenant)
        except ValueError as e:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        log.debug(
            "request %s: %d prompt tokens, max_tokens %d", rid, len(request.prompt_token_ids), sp.max_tokens
        )
        return stream

    def _consume(self, stream: Any, items: list[Any]) -> worker_pb2.WorkerGenerateChunk | None:
        """The chunk a batch of the stream's queued items makes (None: nothing to send yet)."""
        try:
            return stream.consume(items)
        except RuntimeError as e:
            raise RequestError(grpc.StatusCode.INTERNAL, str(e)) from None

    def _limits(self) -> tuple[int, int, int]:
        """(max_model_len, the longest prompt it admits, the vocabulary size)."""
        max_len = self.w.core.config.max_model_len
        return max_len, max_len, self.w.tokenizer.vocab_size

    def _validate(self, request: worker_pb2.WorkerGenerateRequest) -> str:
        """Why the request cannot run here ("" if it can): INVALID_ARGUMENT's message."""
        max_len, max_prompt, vocab_size = self._limits()
        sp = request.sampling
        ids = request.prompt_token_ids
        if not ids:
            return "prompt_token_ids is empty"
        if len(ids) > max_prompt:
            return f"prompt has {len(ids)} tokens; max_model_len is {max_len}"
        if sp.max_tokens <= 0:
            return f"sampling.max_tokens must be > 0 (got {sp.max_tokens})"
        if sp.HasField("temperature") and sp.temperature < 0:
            return "sampling.temperature must be >= 0"
        if sp.HasField("top_p") and not 0 < sp.top_p <= 1:
            return "sampling.top_p must be in (0, 1]"
        if not 0 <= min(ids) <= max(ids) < vocab_size:
            return f"prompt_token_ids must be in [0, {vocab_size})"
        return ""

    async def Abort(self, request: worker_pb2.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return worker_pb2.AbortResponse(num_aborted=self.w.abort(list(request.request_ids)))

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return self.w.info()

    async def Stats(self, request: worker_pb2.StatsRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return self.w.stats()

    async def KvEvents(  # noqa: N802
        self, request: worker_pb2.KvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.KvEventBatch]:
        hub = self.w.hub
        sub, first = hub.subscribe(request.start_after_seq, time.time(), request.incarnation)
        try:
            for batch in await asyncio.to_thread(first):
                yield batch
            while True:
                batch = await sub.queue.get()
                if batch is None:
                    return
                if sub.is_overflowed:
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED, "KV event subscriber too slow; resume"
                    )
                yield batch
        finally:
            hub.unsubscribe(sub)


# ---------------------------------------------------------------- process


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard worker sim", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (reported on the READY line)")
    p.add_argument("--worker-id", default="", help="default: sim-<port>")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument(
        "--profile", default=DEFAULT_PROFILE, help="performance profile (workers/engine/profiles.py)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="override the profile's KV capacity")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--hash-algo", default="xxhash", choices=("sha256", "xxhash"))
    p.add_argument(
        "--scheduling",
        default=None,
        choices=SCHEDULINGS,
        help="engine admission order: vLLM FCFS (default), vLLM priority, Preble's local priority groups (preble_groups) "
        "or SGLang's longest-prefix-match first (lpm)",
    )
    p.add_argument("--num-priority-groups", type=int, default=None, help="preble_groups: P (default 10)")
    p.add_argument("--priority-group-quota", type=int, default=None, help="preble_groups: k (default 10)")
    p.add_argument(
        "--tokenizer", default=None, help="SentencePiece .model (default: the bundled Mistral-7B one)"
    )
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies every iteration's duration")
    p.add_argument("--hash-seed", default="", help='block-hash chain seed; "" = vLLM\'s NONE_HASH')
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampler seed for requests without one (default: from the request id)",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="SIGTERM: seconds in-flight requests get"
    )
    p.add_argument(
        "--timings-log",
        default=None,
        help="append one JSON line per finished request (received_at, first_token_at, ...) to this file",
    )
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="also serve the OpenAI/vLLM-compatible HTTP facade on this port (0: a free one; needs aiohttp)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish vLLM-format ZMQ KV events here (binds if it has * or :: or is ipc/inproc, else connects)",
    )
    p.add_argument(
        "--kv-replay-endpoint", default=None, help="ZMQ ROUTER endpoint (bound) serving KV event replay"
    )
    p.add_argument("--kv-events-topic", default="", help="topic frame of the ZMQ KV event messages")
    p.add_argument("--log-level", default="INFO")
    add_stream_interval_arg(p)
    add_server_args(p)
    add_keepalive_args(p)
    return p


def build_core(args: argparse.Namespace, tokenizer: Tokenizer) -> EngineCore:
    """The engine from the flags: the profile's defaults, overridden by each flag that is set."""
    from switchyard.workers.engine import profiles

    profile = profiles.get_profile(args.profile)
    overrides = {
        "block_size": args.block_size,
        "num_kv_blocks": args.num_kv_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "scheduling": args.scheduling,
        "num_priority_groups": args.num_priority_groups,
        "priority_group_quota": args.priority_group_quota,
        "block_hash_algo": args.hash_algo,
        "block_hash_seed": args.hash_seed,
        "vocab_size": tokenizer.vocab_size,  # sampled ids must decode with the worker's tokenizer
        "eos_token_id": tokenizer.eos_id,
    }
    return EngineCore(EngineConfig(**{k: v for k, v in overrides.items() if v is not None}), profile)


class _Lifecycle:
    """Signal handlers only set events: the first SIGTERM/SIGINT drains, a second one forces. `logger`: the
    worker's own (the sim and the vLLM worker share this)."""

    def __init__(self, logger: logging.Logger = log) -> None:
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        self.log = logger

    def on_signal(self, signum: int) -> None:
        if self.stop.is_set():
            self.log.warning("second signal %d: forcing shutdown", signum)
            self.force.set()
        else:
            self.log.info("signal %d: draining", signum)
            self.stop.set()


def bind_server(args: argparse.Namespace, logger: logging.Logger = log) -> tuple[grpc.aio.Server, int] | int:
    """A worker's gRPC server bound to --host/--port (TLS with --tls-cert) and its port, or the exit code
    (logged to `logger`, the worker's own) when it cannot be: the sim and the vLLM worker's."""
    try:
        server = grpc.aio.server(options=server_options_from_args(args))
    except ValueError as e:
        logger.error("bad keepalive configuration: %s", e)
        return EXIT_USAGE
    try:
        port = add_port(server, f"{args.host}:{args.port}", server_tls_from_args(args))
    except TlsError as e:
        logger.error("bad TLS configuration: %s", e)
        return EXIT_USAGE
    except RuntimeError as e:
        logger.error("cannot bind %s:%s: %s", args.host, args.port, e)
        return EXIT_BIND_FAILED
    if port == 0:
        logger.error("cannot bind %s:%s", args.host, args.port)
        return EXIT_BIND_FAILED
    return server, port


async def serve(args: argparse.Namespace) -> int:
    try:
        tokenizer = load_tokenizer(args.tokenizer)
        core = build_core(args, tokenizer)
    except (ValueError, OSError) as e:
        log.error("bad worker configuration: %s", e)
        return EXIT_USAGE
    bound = bind_server(args)
    if isinstance(bound, int):
        return bound
    server, port = bound
    timings_log = open(args.timings_log, "a", buffering=1) if args.timings_log else None  # noqa: SIM115
    worker = SimWorker(
        core,
        tokenizer,
        args.worker_id or f"sim-{port}",
        args.model,
        args.profile,
        args.time_scale,
        args.seed,
        timings_log,
    )
    worker.stream_interval = args.stream_interval
    servicer = WorkerServicer(worker)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    lifecycle = _Lifecycle()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lifecycle.on_signal, sig)
    notifier = ServiceNotifier()  # systemd's Type=notify (deploy/systemd); nothing outside systemd

    publisher = facade = None
    ready_extra = ""
    if args.kv_events_endpoint:
        from switchyard.workers.zmq_kv_publisher import ZmqKvPublisher

        try:
            publisher = ZmqKvPublisher(args.kv_events_endpoint, args.kv_replay_endpoint, args.kv_events_topic)
        except Exception as e:  # zmq.ZMQError: bad or busy endpoint
            log.error("cannot open the ZMQ KV event endpoints: %s", e)
            return EXIT_BIND_FAILED
        worker.kv_sinks.append(publisher.publish)
        publisher.start()
        ready_extra += f" zmq={publisher.endpoint}"
        if publisher.replay_endpoint:
            ready_extra += f" zmq_replay={publisher.replay_endpoint}"
    if args.http_port is not None:
        from switchyard.workers.http_facade import HttpFacade  # aiohttp: imported only when asked for

        facade = HttpFacade(worker, args.host, args.http_port, publisher)
        try:
            http_port = await facade.start()
        except OSError as e:
            log.error("cannot bind HTTP %s:%s: %s", args.host, args.http_port, e)
            return EXIT_BIND_FAILED
        ready_extra = f" http={args.host}:{http_port}" + ready_extra

    worker.start()
    await server.start()
    worker.state = worker_pb2.LIFECYCLE_STATE_READY
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"READY {args.host}:{port} worker_id={worker.worker_id}{ready_extra}", flush=True)
    notifier.ready(f"worker {worker.worker_id} serving on {args.host}:{port}")
    notifier.start_watchdog()
    log.info(
        "worker %s serving on %s:%d (profile %s, time scale %g)",
        worker.worker_id,
        args.host,
        port,
        args.profile,
        args.time_scale,
    )

    await lifecycle.stop.wait()
    notifier.stopping(f"draining {len(worker.streams)} requests")
    worker.state = worker_pb2.LIFECYCLE_STATE_DRAINING
    await health_servicer.enter_graceful_shutdown()
    waiters = [asyncio.ensure_future(worker.idle.wait()), asyncio.ensure_future(lifecycle.force.wait())]
    _, pending = await asyncio.wait(waiters, timeout=args.drain_timeout, return_when=asyncio.FIRST_COMPLETED)
    for fut in pending:
        fut.cancel()
    if worker.streams:
        log.warning("drain: aborting %d unfinished requests", len(worker.streams))
        worker.abort(list(worker.streams))
    servicer.end_sessions()
    worker.hub.close()
    if facade is not None:
        await facade.stop()
    await server.stop(grace=1.0)
    await worker.stop()
    if publisher is not None:
        await publisher.close()
    if timings_log is not None:
        timings_log.close()
    notifier.close()
    log.info("worker %s stopped", worker.worker_id)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.time_scale <= 0:
        print("--time-scale must be > 0", file=sys.stderr)
        return EXIT_USAGE
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop
    except ImportError:  # the worker-side install does not require it
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
