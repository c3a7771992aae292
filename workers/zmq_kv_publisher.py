"""vLLM-format ZMQ KV cache events from the simulated worker, so vLLM-aware routers (vllm-router kv_aware) can
consume them exactly as they consume a real vLLM's (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`).

Wire format (specs/vllm-and-peer-routers.md, section 1):

* PUB socket; each engine step's events go out as one 3-frame message
  `[topic, seq (8-byte big-endian, from 0), msgpack(KVEventBatch)]`, where the batch is array-like
  `[ts, events, data_parallel_rank]` and each event is a map tagged by `"type"`:
  `BlockStored` (block_hashes as uint64 ints, parent_block_hash, token_ids, block_size, lora_id, medium "GPU",
  lora_name, extra_keys one per block, group_idx 0, kv_cache_spec_kind), `BlockRemoved` (block_hashes, medium,
  group_idx) and `AllBlocksCleared`.
* bind vs connect as vLLM: the PUB socket binds if the endpoint contains `*` or `::` or is `ipc://` /
  `inproc://`, and connects otherwise (then the subscriber binds).
* replay: a ROUTER socket (always bound); a DEALER sends `[b"", start_seq (8 bytes BE)]` and gets
  `[b"", topic, seq, payload]` for every buffered batch with seq >= start_seq, then the end marker
  `[b"", b"", END_SEQ (-1, 8 bytes signed BE), b""]` (vLLM's current 5-frame reply, identity included).

Publishing never blocks the engine loop: a full PUB queue (HWM) drops the message, as vLLM's does.
Worker-side deps only (pyzmq, msgpack).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from switchyard.workers.engine import kv_events as kv

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
DEFAULT_BUFFER_STEPS = 10_000  # vLLM KVEventsConfig.buffer_steps
DEFAULT_HWM = 100_000  # vLLM KVEventsConfig.hwm
MEDIUM = "GPU"  # what vLLM reports even on its CPU backend


def should_bind(endpoint: str) -> bool:
    """vLLM's rule: bind on wildcard / IPv6-any / ipc / inproc endpoints, connect otherwise."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def event_to_wire(event: kv.KvEvent) -> dict[str, Any]:
    """One event as vLLM's msgspec tagged map (field order and names as the spec's captures)."""
    if isinstance(event, kv.BlockStored):
        n = len(event.block_hashes)
        return {
            "type": "BlockStored",
            "block_hashes": [int(h) for h in event.block_hashes],
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": event.lora_name,
            "extra_keys": [[event.lora_name] if event.lora_name else None for _ in range(n)],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    if isinstance(event, kv.BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": [int(h) for h in event.block_hashes],
            "medium": MEDIUM,
            "group_idx": 0,
        }
    return {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[kv.KvEvent], ts: float, dp_rank: int = 0) -> bytes:
    return msgpack.packb([ts, [event_to_wire(e) for e in events], dp_rank], use_bin_type=True)


class ZmqKvPublisher:
    """PUB (+ optional ROUTER replay) sockets on the worker's event loop.

    `publish(events, ts)` is synchronous and non-blocking (called from the engine loop after each step);
    `start()` launches the replay task, `close()` stops it and closes the sockets.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        hwm: int = DEFAULT_HWM,
        dp_rank: int = 0,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._topic = topic.encode()
        self._dp_rank = dp_rank
        self._seq = itertools.count()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if should_bind(endpoint):
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self._replay: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task: asyncio.Task[None] | None = None
        self.num_dropped = 0

    @property
    def topic(self) -> str:
        return self._topic.decode()

    def start(self) -> None:
        if self._replay is not None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-replay")

    def publish(self, events: Sequence[kv.KvEvent], ts: float) -> int:
        """Send one batch; returns its seq. Never blocks (a full queue drops the live copy; replay keeps it)."""
        seq = next(self._seq)
        payload = encode_batch(events, ts, self._dp_rank)
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.num_dropped += 1
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        while True:
            frames = await self._replay.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid KV event replay request (%d frames)", len(frames))
                continue
            client_id, _, start_seq_bytes = frames
            start_seq = int.from_bytes(start_seq_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await self._replay.send_multipart(
                        (client_id, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await self._replay.send_multipart((client_id, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
