"""VllmKvSubscriber against a stand-in for vLLM's ZmqEventPublisher (same sockets and frames: a connecting PUB,
a bound ROUTER replay socket): decoding, the block mirror, and gap recovery through replay. The real publisher
is exercised end to end in tests/e2e/test_vllm_worker.py."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
import zmq.asyncio
from polling import until_async

from switchyard.workers.engine import kv_events as kv
from switchyard.workers.vllm_kv_subscriber import BlockMirror, VllmKvSubscriber, decode_events

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(hashes: list[int], parent: int | None, first_token: int = 0) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(first_token, first_token + 2 * len(hashes))),
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


def payload(events: list[dict]) -> bytes:
    return msgpack.packb([1795312147.41, events, 0])


class FakePublisher:
    """vLLM's publisher protocol: PUB connects to a non-wildcard tcp endpoint; ROUTER binds the replay one."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.connect(endpoint)
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.bind(replay_endpoint)
        self.buffer: list[tuple[int, bytes]] = []
        self.replay_requests: list[int] = []

    async def publish(self, seq: int, events: list[dict], drop: bool = False) -> None:
        buf = payload(events)
        self.buffer.append((seq, buf))
        if not drop:
            await self.pub.send_multipart([b"", seq.to_bytes(8, "big"), buf])

    async def serve_replay(self) -> None:
        while True:
            client, _, start = await self.replay.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            for seq, buf in self.buffer:
                if seq >= start_seq:
                    await self.replay.send_multipart([client, b"", b"", seq.to_bytes(8, "big"), buf])
            await self.replay.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.replay.close(linger=0)


def test_decode_events_maps_vllm_fields_and_skips_offload_media() -> None:
    evs = decode_events(
        [
            stored([5, 6], None),
            {**stored([7], 6), "medium": "CPU"},  # an offload tier: not the device cache
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 0},
            {"type": "AllBlocksCleared"},
            {"type": "SomethingNew"},
        ]
    )
    assert evs == [
        kv.BlockStored(block_hashes=(5, 6), parent_block_hash=None, token_ids=(0, 1, 2, 3), block_size=2),
        kv.BlockRemoved(block_hashes=(5,)),
        kv.AllBlocksCleared(),
    ]
    # full 32-byte digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) become their low 64 bits, as the ints are
    digest = bytes(range(32))
    (ev,) = decode_events([{**stored([digest], None), "token_ids": [0, 1]}])
    assert ev.block_hashes == (int.from_bytes(digest, "big") & (2**64 - 1),)


def test_mirror_snapshot_rebuilds_the_resident_blocks() -> None:
    m = BlockMirror()
    m.apply(decode_events([stored([1, 2, 3], None), stored([2], 1, first_token=2)]))  # a re-announced hash
    m.apply([kv.BlockRemoved(block_hashes=(3,))])
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in m.snapshot()] == [((1, 2), None, (0, 1, 2, 3))]
    build = m.capture()  # the mirror now, built later (in a thread) while vLLM's events go on changing it
    m.apply([kv.AllBlocksCleared()])
    assert len(m) == 0
    assert [e.block_hashes for e in build()] == [(1, 2)]


@pytest.mark.timeout(30)
async def test_a_gap_is_recovered_through_the_replay_socket_in_order() -> None:
    got: list[tuple[kv.KvEvent, ...]] = []
    sub = VllmKvSubscriber(lambda events, ts: got.append(tuple(events)))
    sub.start()
    pub = FakePublisher(sub._ctx, sub.endpoint, sub.replay_endpoint)
    replay_task = asyncio.ensure_future(pub.serve_replay())
    try:
        # a PUB drops messages until the SUB's subscription reached it (slow joiner): resend seq 0 until it
        # arrives (the subscriber applies a sequence number once), so the gap below is the only one
        pub.buffer.append((0, payload([stored([10], None)])))

        async def resent() -> bool:
            await pub.pub.send_multipart([b"", (0).to_bytes(8, "big"), pub.buffer[0][1]])
            return bool(got)

        await until_async(resent, 5.0, "the subscriber to receive the first batch")
        await pub.publish(1, [stored([11], 10)], drop=True)  # lost on the wire
        await pub.publish(2, [stored([12], 11)], drop=True)
        await pub.publish(3, [{"type": "BlockRemoved", "block_hashes": [10], "medium": "GPU"}])
        await until_async(lambda: len(got) >= 4, 3.0, "the replayed and the live batches")
        assert pub.replay_requests == [1]
        assert [e.block_hashes for (e,) in got] == [(10,), (11,), (12,), (10,)]  # replayed, then the live one
        assert (sub.num_replayed, sub.num_lost, sub.num_batches) == (2, 0, 4)
        assert 10 not in sub.mirror and 12 in sub.mirror
    finally:
        replay_task.cancel()
        pub.close()
        await sub.stop()
