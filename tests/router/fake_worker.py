"""An in-process Worker gRPC service whose behaviour each test scripts: tokens, gates, failures, KV events.

Runs on the test's own event loop next to an in-process router, so daemon tests are fast and deterministic
(no subprocesses, no timing): a request blocks on `gate` after `hold_after` tokens until the test opens it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc

from switchyard.ext.blockhash import block_digests, to_event_hash
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from switchyard.workers.tokenizer import load_tokenizer


@dataclass
class Script:
    fail_before_first: bool = False  # abort with UNAVAILABLE before any token
    fail_after_tokens: int | None = None  # abort with UNAVAILABLE after this many tokens
    hold_after: int | None = None  # wait on the gate after this many tokens
    status: grpc.StatusCode | None = None  # abort with this status before any token
    stop_after: int | None = None  # finish naturally (STOP, as at EOS) after this many tokens, if below max_tokens


@dataclass
class FakeWorker(worker_pb2_grpc.WorkerServicer):
    worker_id: str
    model: str = "m"
    max_model_len: int = 2048
    block_size: int = 4
    max_num_seqs: int = 4
    tokenizer_id: str = ""
    script: Script = field(default_factory=Script)
    num_waiting: int = 0  # reported in Stats
    kv_blocks_used: int = 0
    kv_blocks_total: int = 100
    received: list[worker_pb2.WorkerGenerateRequest] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    aborted: list[str] = field(default_factory=list)  # Abort RPC ids
    cancelled: list[str] = field(default_factory=list)  # Generate streams cancelled by the router
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    stats_calls: int = 0
    advertises_session: bool = False  # Info's `session`; this fake serves no Session (UNIMPLEMENTED), as a faulty worker
    _kv_queues: list[asyncio.Queue[worker_pb2.KvEventBatch]] = field(default_factory=list)
    _kv_seq: int = 0
    server: grpc.aio.Server | None = None
    address: str = ""

    def __post_init__(self) -> None:
        self.tokenizer_id = self.tokenizer_id or load_tokenizer(None).tokenizer_id

    async def start(self) -> str:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        return self.address

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
        async with asyncio.timeout(timeout):
            async with self.changed:
                await self.changed.wait_for(predicate)

    # ------------------------------------------------------------------ Worker service
    async def Info(self, request, context):  # type: ignore[no-untyped-def]
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id, model=self.model, max_model_len=self.max_model_len, block_size=self.block_size,
            kv_capacity_blocks=self.kv_blocks_total, tokenizer_id=self.tokenizer_id, block_hash_algo="xxhash",
            state=worker_pb2.LIFECYCLE_STATE_READY, engine="fake", max_num_seqs=self.max_num_seqs,
            session=self.advertises_session,
        )

    async def Stats(self, request, context):  # type: ignore[no-untyped-def]
        self.stats_calls += 1
        return worker_pb2.WorkerStats(
            num_running=len(self.active), num_waiting=self.num_waiting, kv_blocks_used=self.kv_blocks_used,
            kv_blocks_total=self.kv_blocks_total, prefix_cache_queries=100, prefix_cache_hits=25,
            state=worker_pb2.LIFECYCLE_STATE_READY,
        )

    async def Abort(self, request, context):  # type: ignore[no-untyped-def]
        self.aborted.extend(request.request_ids)
        await self._notify()
        return worker_pb2.AbortResponse(num_aborted=len(request.request_ids))

    async def KvEvents(self, request, context):  # type: ignore[no-untyped-def]
        q: asyncio.Queue[worker_pb2.KvEventBatch] = asyncio.Queue()
        self._kv_queues.append(q)
        try:
            while True:
                yield await q.get()
        finally:
            self._kv_queues.remove(q)

    def push_kv(self, batch: worker_pb2.KvEventBatch) -> None:
        """Stream a scripted batch to every KvEvents subscriber, numbered after the last one."""
        self._kv_seq += 1
        batch.seq = self._kv_seq
        for q in self._kv_queues:
            q.put_nowait(batch)

    def _store_prompt_blocks(self, ids: list[int], salt: str) -> None:
        digests = block_digests(ids, self.block_size, "xxhash", cache_salt=salt or None)
        if not digests:
            return
        self._kv_seq += 1
        batch = worker_pb2.KvEventBatch(seq=self._kv_seq, ts=time.time())  # as a worker stamps it
        batch.events.add().stored.block_hashes.extend(to_event_hash(d) for d in digests)
        for q in self._kv_queues:
            q.put_nowait(batch)

    async def Generate(self, request, context):  # type: ignore[no-untyped-def]
        s = self.script
        rid = request.request_id
        self.received.append(request)
        self.active.add(rid)
        await self._notify()
        try:
            if s.status is not None:
                await context.abort(s.status, "scripted failure")
            if s.fail_before_first:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: worker died")
            self._store_prompt_blocks(list(request.prompt_token_ids), request.cache_salt)
            n = request.sampling.max_tokens
            reason = common_pb2.FINISH_REASON_LENGTH
            if s.stop_after is not None and s.stop_after < n:
                n, reason = s.stop_after, common_pb2.FINISH_REASON_STOP
            for i in range(n):
                if s.fail_after_tokens is not None and i == s.fail_after_tokens:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: worker died mid-stream")
                if s.hold_after is not None and i == s.hold_after:
                    await self.gate.wait()
                token = 1000 + i  # "▁..." pieces: readable text
                last = i == n - 1
                chunk = worker_pb2.WorkerGenerateChunk(
                    request_id=rid, token_ids=[token], text=f"<{token}>"
                )
                if last:
                    chunk.finish_reason = reason
                    chunk.usage.prompt_tokens = len(request.prompt_token_ids)
                    chunk.usage.completion_tokens = n
                yield chunk
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.active.discard(rid)
            await self._notify()
