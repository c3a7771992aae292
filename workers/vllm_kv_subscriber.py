"""vLLM's ZMQ KV-event stream -> Switchyard KV events, with gap recovery and a mirror of the resident blocks.

vLLM's publisher (`vllm/distributed/kv_events.py`, ZmqEventPublisher) sends 3-frame messages
`[topic, seq (u64 big-endian, from 0), msgpack(EventBatch)]`; `EventBatch` is array-like
`[ts, events, data_parallel_rank]` and each event a map tagged by "type" (BlockStored, BlockRemoved,
AllBlocksCleared). Its PUB socket binds only for `*`, `::`, `ipc://` and `inproc://` endpoints and connects
otherwise, so this subscriber **binds** a loopback TCP port (port 0: no race) and hands vLLM the resulting
`tcp://127.0.0.1:<port>`, which vLLM connects to. The replay ROUTER always binds: it gets an `ipc://` path in
a private temp dir. On a sequence gap the subscriber asks the replay socket for every batch from the first
missing one (DEALER `[b"", start_seq]` -> `[b"", topic, seq, payload]`... then an end marker with seq -1).

The mirror (hash -> its BlockStored) lets a fresh Switchyard KvEvents subscriber be given a snapshot of the
cache, which vLLM itself cannot provide.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from switchyard.workers.engine import kv_events as kv

log = logging.getLogger(__name__)

END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0
_MASK64 = (1 << 64) - 1
_DEVICE_MEDIA = (None, "GPU")  # vLLM reports "GPU" even on the CPU backend; other media are offload tiers


def _hash64(h: int | bytes) -> int:
    """vLLM sends uint64 ints by default; with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 the full digest."""
    return h & _MASK64 if isinstance(h, int) else int.from_bytes(h, "big") & _MASK64


def decode_events(raw: Sequence[dict[str, Any]]) -> list[kv.KvEvent]:
    """vLLM's event maps -> Switchyard events (device-tier events only)."""
    out: list[kv.KvEvent] = []
    for ev in raw:
        kind = ev.get("type")
        if kind == "BlockStored":
            if ev.get("medium") not in _DEVICE_MEDIA:
                continue
            parent = ev.get("parent_block_hash")
            out.append(
                kv.BlockStored(
                    block_hashes=tuple(_hash64(h) for h in ev["block_hashes"]),
                    parent_block_hash=None if parent is None else _hash64(parent),
                    token_ids=tuple(ev["token_ids"]),
                    block_size=int(ev["block_size"]),
                    lora_name=ev.get("lora_name") or None,
                )
            )
        elif kind == "BlockRemoved":
            if ev.get("medium") not in _DEVICE_MEDIA:
                continue
            out.append(kv.BlockRemoved(block_hashes=tuple(_hash64(h) for h in ev["block_hashes"])))
        elif kind == "AllBlocksCleared":
            out.append(kv.AllBlocksCleared())
        else:
            log.debug("ignoring KV event of type %r", kind)
    return out


class BlockMirror:
    """The blocks vLLM holds, rebuilt from its events (insertion order = store order)."""

    def __init__(self) -> None:
        # hash -> (parent hash, token ids of the block, block size, lora name)
        self._blocks: collections.OrderedDict[int, tuple[int | None, tuple[int, ...], int, str | None]] = (
            collections.OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def apply(self, events: Sequence[kv.KvEvent]) -> None:
        for ev in events:
            if isinstance(ev, kv.BlockStored):
                parent = ev.parent_block_hash
                bs = ev.block_size
                for i, h in enumerate(ev.block_hashes):
                    if h not in self._blocks:  # vLLM may re-announce a hash; keep the first
                        self._blocks[h] = (parent, ev.token_ids[i * bs : (i + 1) * bs], bs, ev.lora_name)
                    parent = h
            elif isinstance(ev, kv.BlockRemoved):
                for h in ev.block_hashes:
                    self._blocks.pop(h, None)
            else:
                self._blocks.clear()

    def snapshot(self) -> list[kv.KvEvent]:
        """Every resident block, as BlockStored chains, parents before children where vLLM stored them so."""
        return self.capture()()

    def capture(self) -> Callable[[], list[kv.KvEvent]]:
        """`snapshot` in two halves: a copy of the mirror now (its values are immutable tuples), and a function
        that builds the events from the copy, which any thread may call while the mirror goes on changing."""
        # two flat copies, not an (hash, value) tuple per block: 64k new tuples set off collections on vLLM's loop
        hashes, values = list(self._blocks.keys()), list(self._blocks.values())
        return lambda: list(
            kv.chain_stored((h, p, t, bs, lora) for h, (p, t, bs, lora) in zip(hashes, values, strict=True))
        )


class VllmKvSubscriber:
    """Owns the SUB (bound) and replay DEALER sockets; calls `on_events(events, ts)` per vLLM batch, in order."""

    def __init__(
        self,
        on_events: Callable[[list[kv.KvEvent], float], None],
        topic: str = "",
        host: str = "127.0.0.1",
    ) -> None:
        self._on_events = on_events
        self.topic = topic
        self.mirror = BlockMirror()
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side; vLLM's PUB hwm bounds memory
        self._sub.bind(f"tcp://{host}:0")
        self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://127.0.0.1:<port>
        self._tmpdir = Path(tempfile.mkdtemp(prefix="switchyard-kv-"))
        self.replay_endpoint = f"ipc://{self._tmpdir}/replay"
        self._next_seq = 0  # the next vLLM sequence number expected
        self.num_batches = 0
        self.num_replayed = 0
        self.num_lost = 0  # batches neither received nor recoverable by replay
        self._task: asyncio.Task[None] | None = None

    def kv_events_config(self) -> dict[str, Any]:
        """vLLM's KVEventsConfig fields for this subscriber."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
        }

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-kv-subscriber")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sub.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    async def _run(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            try:
                gap_until = self._handle(frames, replayed=False)
                if gap_until is not None:
                    await self._recover(gap_until, frames)
            except Exception:
                log.exception("bad KV event message from vLLM; skipping it")

    def _handle(self, frames: list[bytes], replayed: bool) -> int | None:
        """Apply one message in sequence order; returns its seq instead when batches before it are missing
        (live messages only: the caller replays the gap, then applies this one)."""
        if len(frames) != 3:
            log.warning("KV event message with %d frames; expected 3", len(frames))
            return None
        _topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if seq < self._next_seq:
            return None  # already applied (a replay overlapping the live stream)
        if seq > self._next_seq and not replayed:
            return seq
        if seq > self._next_seq:  # the replay buffer no longer holds the missing batches
            self._lose(seq - self._next_seq)
        self._apply(seq, payload)
        return None

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        ts = float(batch[0]) if batch else time.time()
        events = decode_events(batch[1] if len(batch) > 1 else [])
        self._next_seq = seq + 1
        self.num_batches += 1
        if events:
            self.mirror.apply(events)
            self._on_events(events, ts)

    def _lose(self, n: int) -> None:
        """Batches are gone for good: the mirror (and every consumer's view) can no longer be trusted, so
        everything is dropped; later stores rebuild it."""
        self.num_lost += n
        log.warning("lost %d KV event batches from vLLM (beyond its replay buffer); clearing the view", n)
        self.mirror.apply([kv.AllBlocksCleared()])
        self._on_events([kv.AllBlocksCleared()], time.time())

    async def _recover(self, live_seq: int, live_frames: list[bytes]) -> None:
        start = self._next_seq
        log.info("KV event gap: expected seq %d, got %d; replaying", start, live_seq)
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + REPLAY_TIMEOUT_S
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not await dealer.poll(remaining * 1000):
                    log.warning("KV event replay timed out")
                    break
                frames = await dealer.recv_multipart()
                if len(frames) != 4:
                    continue
                _, topic, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    break
                if seq >= live_seq:
                    continue  # the live message (and later ones) come through SUB
                before = self._next_seq
                self._handle([topic, seq_bytes, payload], replayed=True)
                self.num_replayed += self._next_seq > before
        finally:
            dealer.close(linger=0)
        self._handle(live_frames, replayed=True)
