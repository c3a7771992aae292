"""The simulated worker's OpenAI/vLLM HTTP facade and its vLLM-format ZMQ KV events.

A real worker process (`--http-port 0`, ZMQ PUB + replay on ephemeral ports) is driven over HTTP with aiohttp;
the KV events are read back with pyzmq + msgpack and checked against the wire shape of
specs/vllm-and-peer-routers.md section 1 and against `block_digests`/`to_event_hash` of the prompt.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from switchyard.bench import procs
from switchyard.ext.blockhash import block_digests, to_event_hash
from switchyard.workers.engine import kv_events as kv
from switchyard.workers.tokenizer import ChatMessage, load_tokenizer
from switchyard.workers.zmq_kv_publisher import END_SEQ, ZmqKvPublisher, encode_batch, should_bind

aiohttp = pytest.importorskip("aiohttp")

BLOCK = 16
WORKER_ARGS = [
    "--time-scale", "0.02", "--block-size", str(BLOCK), "--num-kv-blocks", "1025", "--max-num-seqs", "32",
    "--max-model-len", "4096", "--hash-algo", "xxhash", "--profile", "llama3-8b-a100", "--model", "sim-model",
    "--http-port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-replay-endpoint", "tcp://127.0.0.1:*",
    "--kv-events-topic", "kv",
]  # fmt: skip


class Worker:
    def __init__(self, popen: subprocess.Popen[str], extra: dict[str, str], timings: Path, address: str) -> None:
        self.popen = popen
        self.address = address  # gRPC
        self.url = f"http://{extra['http']}"
        self.zmq = extra["zmq"]
        self.zmq_replay = extra["zmq_replay"]
        self.timings = timings

    def timing(self, request_id: str) -> dict | None:
        for line in self.timings.read_text().splitlines():
            rec = json.loads(line)
            if rec["request_id"] == request_id:
                return rec
        return None


def start_worker(timings: Path, *extra: str, timeout_s: float = 30.0) -> Worker:
    args = ["worker", "sim", "--port", "0", *WORKER_ARGS, "--timings-log", str(timings), *extra]
    p = procs.start("worker", args, timeout_s=timeout_s)
    return Worker(p.popen, p.extra, timings, p.address)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = start_worker(tmp_path_factory.mktemp("facade") / "timings.jsonl")
    yield w
    w.popen.send_signal(signal.SIGTERM)
    assert w.popen.wait(timeout=15) == 0


async def post(session, url: str, body: dict, **kw):  # type: ignore[no-untyped-def]
    async with session.post(url, json=body, **kw) as r:
        return r.status, await r.json(content_type=None), r.headers


async def sse(session, url: str, body: dict, **kw) -> list[dict]:  # type: ignore[no-untyped-def]
    events = []
    async with session.post(url, json=body, **kw) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        async for line in r.content:
            line = line.strip()
            if line.startswith(b"data: "):
                events.append("DONE" if line == b"data: [DONE]" else json.loads(line[6:]))
    assert events[-1] == "DONE"
    return events[:-1]


# ---------------------------------------------------------------- HTTP


async def test_probes_and_info(worker: Worker) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{worker.url}/health") as r:
            assert r.status == 200
        async with s.get(f"{worker.url}/v1/models") as r:
            models = await r.json()
        assert models["data"][0]["id"] == "sim-model"
        for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            async with s.get(f"{worker.url}{path}") as r:
                info = await r.json()
            model_path = Path(info["model_path"])
            assert model_path.is_dir() and model_path.is_absolute()  # local: smg must not try the hub
            assert info["tokenizer_path"] == info["model_path"]
        async with s.get(f"{worker.url}/get_server_info") as r:
            info = await r.json()
        assert info["block_size"] == BLOCK and info["max_model_len"] == 4096
        assert info["kv_events"]["endpoint"] == worker.zmq
        async with s.get(f"{worker.url}/get_load") as r:
            (load,) = await r.json()
        assert {"num_running_reqs", "num_waiting_reqs", "token_usage"} <= load.keys()
        async with s.get(f"{worker.url}/v1/loads") as r:
            assert (await r.json())["loads"][0]["dp_rank"] == 0
        async with s.get(f"{worker.url}/load") as r:
            assert (await r.json()) == {"server_load": 0}
        async with s.get(f"{worker.url}/kv_event_sources") as r:
            src = (await r.json())["0"]
        assert (src["publisher"], src["endpoint"], src["replay_endpoint"], src["topic"]) == (
            "zmq", worker.zmq, worker.zmq_replay, "kv")  # fmt: skip


async def test_completion_json_uses_request_id_header(worker: Worker) -> None:
    prompt = load_tokenizer().encode("The quick brown fox jumps over the lazy dog")
    async with aiohttp.ClientSession() as s:
        # the extra SGLang fields smg / vllm-router add must be tolerated
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 5, "ignore_eos": True, "echo": False,
                "no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False, "stream": False}  # fmt: skip
        status, out, headers = await post(
            s, f"{worker.url}/v1/completions", body, headers={"X-Request-Id": "rq-1"}
        )
    assert status == 200, out
    assert out["id"] == "rq-1" and headers["X-Request-Id"] == "rq-1"
    assert out["object"] == "text_completion"
    assert out["choices"][0]["finish_reason"] == "length" and isinstance(out["choices"][0]["text"], str)
    assert out["usage"]["prompt_tokens"] == len(prompt) and out["usage"]["completion_tokens"] == 5
    rec = worker.timing("rq-1")  # the timings log is keyed by the HTTP request id
    assert rec is not None and rec["prompt_tokens"] == len(prompt) and rec["output_tokens"] == 5
    assert rec["received_at"] <= rec["first_token_at"] <= rec["finished_at"]


async def test_completion_text_prompt_without_header_gets_generated_id(worker: Worker) -> None:
    async with aiohttp.ClientSession() as s:
        status, out, _ = await post(s, f"{worker.url}/v1/completions",
                                    {"prompt": "Hello there", "max_tokens": 3, "ignore_eos": True})  # fmt: skip
    assert status == 200
    assert out["id"].startswith("cmpl-")
    assert worker.timing(out["id"]) is not None  # the client learns the id from the response


async def test_completion_sse_stream_with_usage(worker: Worker) -> None:
    prompt = load_tokenizer().encode("Streaming tokens one at a time, please")
    body = {"prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        events = await sse(s, f"{worker.url}/v1/completions", body, headers={"X-Request-Id": "rq-sse"})
    assert all(e["id"] == "rq-sse" and e["object"] == "text_completion" for e in events)
    *chunks, usage = events
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 6
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def event_ids(events: list[dict]) -> list[list[int]]:
    """Each SSE event's token ids (the usage event, with no choices, left out)."""
    return [e["choices"][0]["token_ids"] for e in events if e["choices"]]


async def test_stream_interval_gathers_the_sse_events(worker: Worker) -> None:
    """vLLM's per-request `stream_interval` cuts the same tokens into fewer events: the first alone, then at least
    the interval each until the last; the text is unchanged, on completions and on chat."""
    prompt = load_tokenizer().encode("Gather the streamed tokens")
    body = {"prompt": prompt, "max_tokens": 23, "ignore_eos": True, "stream": True, "seed": 5,
            "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "Gather"}], "max_tokens": 23, "ignore_eos": True,
            "stream": True, "seed": 5}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        each = await sse(s, f"{worker.url}/v1/completions", body)
        by_five = await sse(s, f"{worker.url}/v1/completions", {**body, "stream_interval": 5})
        chat_each = await sse(s, f"{worker.url}/v1/chat/completions", chat)
        chat_by_five = await sse(s, f"{worker.url}/v1/chat/completions", {**chat, "stream_interval": 5})
    ids, gathered = event_ids(each), event_ids(by_five)
    assert [t for e in gathered for t in e] == [t for e in ids for t in e] and len(gathered[0]) == 1
    assert all(len(e) >= 5 for e in gathered[1:-1]) and len(gathered) <= 6
    assert "".join(e["choices"][0]["text"] for e in by_five if e["choices"]) == "".join(
        e["choices"][0]["text"] for e in each if e["choices"])  # fmt: skip
    assert by_five[-1]["usage"]["completion_tokens"] == 23 and by_five[-2]["choices"][0]["finish_reason"] == "length"

    def text(events: list[dict]) -> str:
        return "".join(e["choices"][0]["delta"].get("content", "") for e in events)

    assert len(chat_by_five) <= 7  # the role event, the first token, 4 chunks of 5 or more (22 tokens)
    assert text(chat_by_five) == text(chat_each)
    assert chat_by_five[-1]["choices"][0]["finish_reason"] == "length"


async def test_the_worker_stream_interval_is_a_floor_on_both_transports(tmp_path: Path) -> None:
    """`--stream-interval 4` gathers what a request leaves unset, over HTTP and gRPC alike, and a request may ask
    for more, never less (vLLM's engine-level clamp)."""
    import grpc

    from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    w = start_worker(tmp_path / "timings.jsonl", "--stream-interval", "4")
    try:
        prompt = load_tokenizer().encode("A floor on the interval")
        body = {"prompt": prompt, "max_tokens": 21, "ignore_eos": True, "stream": True, "return_token_ids": True}
        async with aiohttp.ClientSession() as s:
            unset = event_ids(await sse(s, f"{w.url}/v1/completions", body))
            fewer = event_ids(await sse(s, f"{w.url}/v1/completions", {**body, "stream_interval": 2}))
            more = event_ids(await sse(s, f"{w.url}/v1/completions", {**body, "stream_interval": 8}))
        async with grpc.aio.insecure_channel(w.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            req = worker_pb2.WorkerGenerateRequest(
                request_id="floor-grpc", prompt_token_ids=prompt,
                sampling=common_pb2.SamplingParams(max_tokens=21, ignore_eos=True),
            )  # fmt: skip
            via_grpc = [list(c.token_ids) async for c in stub.Generate(req)]
    finally:
        w.popen.send_signal(signal.SIGTERM)
        assert w.popen.wait(timeout=15) == 0
    for chunks, least in ((unset, 4), (fewer, 4), (more, 8), (via_grpc, 4)):
        assert sum(map(len, chunks)) == 21
        assert len(chunks[0]) == 1 and all(len(c) >= least for c in chunks[1:-1]), (least, chunks)
        assert len(chunks) <= 2 + 20 // least


async def test_chat_json_and_stream_apply_the_chat_template(worker: Worker) -> None:
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi!"}]},
    ]
    expected = load_tokenizer().apply_chat_template(
        [ChatMessage("system", "Be brief."), ChatMessage("user", "Hi!")]
    )
    async with aiohttp.ClientSession() as s:
        # smg renames max_tokens to max_completion_tokens and adds SGLang chat fields
        body = {"messages": msgs, "max_completion_tokens": 4, "ignore_eos": True, "continue_final_message": False,
                "separate_reasoning": True, "stream_reasoning": True}  # fmt: skip
        status, out, _ = await post(s, f"{worker.url}/v1/chat/completions", body)
        assert status == 200, out
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        assert out["choices"][0]["message"]["role"] == "assistant"
        assert out["usage"] == {**out["usage"], "prompt_tokens": len(expected), "completion_tokens": 4}
        events = await sse(s, f"{worker.url}/v1/chat/completions", {**body, "stream": True})
        status, rendered, _ = await post(s, f"{worker.url}/v1/chat/completions/render", body)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert status == 200 and rendered[0]["token_ids"] == expected


async def test_render_tokenize_detokenize(worker: Worker) -> None:
    tok = load_tokenizer()
    async with aiohttp.ClientSession() as s:
        status, rendered, _ = await post(s, f"{worker.url}/v1/completions/render",
                                         {"model": "sim-model", "prompt": "Render me"})  # fmt: skip
        assert status == 200
        assert isinstance(rendered, list) and rendered[0]["token_ids"] == tok.encode("Render me")
        _, t, _ = await post(s, f"{worker.url}/tokenize", {"model": "sim-model", "prompt": "Render me"})
        assert t["tokens"] == tok.encode("Render me") and t["count"] == len(t["tokens"])
        assert t["max_model_len"] == 4096
        _, d, _ = await post(
            s, f"{worker.url}/detokenize", {"tokens": tok.encode("Render me", add_bos=False)}
        )
        assert d["prompt"] == "Render me"


async def test_bad_requests_are_400(worker: Worker) -> None:
    async with aiohttp.ClientSession() as s:
        for body in ({"prompt": []}, {"prompt": [1, 99999]}, {"prompt": "x", "max_tokens": 0},
                     {"prompt": "x", "n": 2}, {"prompt": [[1, 2], [3, 4]]},
                     # fields of the wrong type are the client's error too (these were 500s, found by a fuzz)
                     {"prompt": "x", "temperature": "hot"}, {"prompt": "x", "temperature": [1]},
                     {"prompt": "x", "priority": [1]}, {"prompt": "x", "priority": "high"},
                     {"prompt": "x", "stop": 5}, {"prompt": "x", "stop": ["a", 5]},
                     {"prompt": "x", "stream": True, "stream_options": [1]}, {"prompt": "x", "lora_name": 5},
                     {"prompt": "x", "cache_salt": {"a": 1}}, {"prompt": "x", "stream_interval": 0},
                     {"prompt": "x", "stream_interval": "4"}, {"prompt": "x", "stream_interval": 2.5}):  # fmt: skip
            status, out, _ = await post(s, f"{worker.url}/v1/completions", body)
            assert status == 400, body
            assert out["object"] == "error"
        async with s.post(f"{worker.url}/v1/completions", data=b"{not json") as r:
            assert r.status == 400


async def test_metrics_exposes_vllm_gauges(worker: Worker) -> None:
    async with aiohttp.ClientSession() as s, s.get(f"{worker.url}/metrics") as r:
        text = await r.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):  # fmt: skip
        assert name in values
    assert values["vllm:prefix_cache_queries_total"] > 0  # earlier tests ran requests


async def test_http2_preface_does_not_break_the_server(worker: Worker) -> None:
    """smg probes each worker for gRPC with an HTTP/2 preface; the HTTP/1 server must shrug it off."""
    host, port = worker.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    await writer.drain()
    await reader.read(1024)
    writer.close()
    async with aiohttp.ClientSession() as s, s.get(f"{worker.url}/health") as r:
        assert r.status == 200


# ---------------------------------------------------------------- ZMQ KV events


async def test_zmq_stream_carries_block_stored_with_prompt_hashes(worker: Worker) -> None:
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(worker.zmq)
    tok = load_tokenizer()
    try:
        async with aiohttp.ClientSession() as s:
            # ZMQ's slow joiner: send throwaway requests until the subscription delivers something (bounded)
            deadline = time.monotonic() + 10
            for i in itertools.count():
                assert time.monotonic() < deadline, "no KV event reached the subscriber"
                probe = tok.encode(f"warm up the subscription {i} " * 8)
                await post(s, f"{worker.url}/v1/completions", {"prompt": probe, "max_tokens": 1})
                if await sub.poll(200):
                    break
            while await sub.poll(50):  # drain
                await sub.recv_multipart()
            prompt = tok.encode("A distinctive prompt for the KV event check, long enough for blocks " * 6)
            await post(
                s, f"{worker.url}/v1/completions", {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
            )
        expected = [to_event_hash(d) for d in block_digests(prompt, BLOCK, "xxhash")]
        assert len(expected) >= 3
        stored: list[dict] = []
        seqs = []
        while await sub.poll(1000):
            frames = await sub.recv_multipart()
            assert len(frames) == 3
            topic, seq, payload = frames
            assert topic == b"kv" and len(seq) == 8
            seqs.append(int.from_bytes(seq, "big"))
            ts, events, dp_rank = msgpack.unpackb(payload)
            assert isinstance(ts, float) and dp_rank == 0
            stored += [e for e in events if e["type"] == "BlockStored"]
            if {h for e in stored for h in e["block_hashes"]} >= set(expected):
                break
        assert seqs == sorted(seqs)
        first = next(e for e in stored if e["block_hashes"][0] == expected[0])
        assert first["block_hashes"] == expected[: len(first["block_hashes"])]
        assert first["parent_block_hash"] is None  # the first block of a sequence
        assert first["token_ids"] == prompt[: BLOCK * len(first["block_hashes"])]
        assert (first["block_size"], first["medium"], first["lora_id"], first["lora_name"], first["group_idx"]) == (
            BLOCK, "GPU", None, None, 0)  # fmt: skip
        assert first["extra_keys"] == [None] * len(first["block_hashes"])
        assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first["block_hashes"])
    finally:
        sub.close(linger=0)
        ctx.term()


async def test_zmq_replay_returns_buffered_batches_then_end(worker: Worker) -> None:
    async with aiohttp.ClientSession() as s:  # at least one batch in the buffer
        await post(s, f"{worker.url}/v1/completions", {"prompt": "replay me " * 10, "max_tokens": 1})
    ctx = zmq.asyncio.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(worker.zmq_replay)
    try:
        await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert await dealer.poll(5000), "no replay reply"
            frames = await dealer.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            if frames[2] == END_SEQ:
                break
            assert frames[1] == b"kv"
            seqs.append(int.from_bytes(frames[2], "big"))
            ts, events, _ = msgpack.unpackb(frames[3])
            assert all(e["type"] in ("BlockStored", "BlockRemoved", "AllBlocksCleared") for e in events)
        assert seqs and seqs[0] == 0 and seqs == list(range(len(seqs)))
        await dealer.send_multipart([b"", (len(seqs) - 1).to_bytes(8, "big")])  # from the last one only
        frames = await dealer.recv_multipart()
        assert int.from_bytes(frames[2], "big") == len(seqs) - 1
        assert (await dealer.recv_multipart())[2] == END_SEQ
    finally:
        dealer.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------- publisher units


def test_wire_shapes_match_vllm_captures() -> None:
    batch = encode_batch(
        [
            kv.BlockStored((5, 6), None, tuple(range(32)), 16),
            kv.BlockStored((7,), 6, tuple(range(16)), 16, lora_name="ad"),
            kv.BlockRemoved((5,)),
            kv.AllBlocksCleared(),
        ],
        ts=12.5,
    )
    ts, events, rank = msgpack.unpackb(batch)
    assert (ts, rank) == (12.5, 0)
    assert events[0] == {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None,
                         "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU",
                         "lora_name": None, "extra_keys": [None, None], "group_idx": 0,
                         "kv_cache_spec_kind": "full_attention"}  # fmt: skip
    assert events[1]["parent_block_hash"] == 6 and events[1]["extra_keys"] == [["ad"]]
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU", "group_idx": 0}
    assert events[3] == {"type": "AllBlocksCleared"}
    # uint64 hashes above 2**63 survive msgpack as unsigned ints
    _, (big,), _ = msgpack.unpackb(encode_batch([kv.BlockRemoved((2**64 - 1,))], 0.0))
    assert big["block_hashes"] == [2**64 - 1]


def test_bind_or_connect_rule() -> None:
    assert should_bind("tcp://*:5557") and should_bind("tcp://[::]:5557")
    assert should_bind("ipc:///tmp/kv") and should_bind("inproc://kv")
    assert not should_bind("tcp://127.0.0.1:5557")


async def test_connecting_publisher_reaches_a_binding_subscriber() -> None:
    """With a concrete endpoint the worker connects, as vLLM does, and the subscriber binds."""
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind("tcp://127.0.0.1:*")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    pub = ZmqKvPublisher(endpoint, topic="t")
    try:
        deadline = time.monotonic() + 5
        while not await sub.poll(50):  # slow joiner: republish until the connection is up (bounded)
            assert time.monotonic() < deadline
            pub.publish([kv.AllBlocksCleared()], 1.0)
        topic, seq, payload = await sub.recv_multipart()
        assert topic == b"t" and msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        await pub.close()
        sub.close(linger=0)
        ctx.term()
