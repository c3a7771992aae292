"""The simulated worker process over real gRPC on loopback: Info, Generate, cancellation, KV events, drain.

Each worker is a real subprocess started with --port 0 and a small --time-scale; tests wait for its
`READY host:port` line and synchronise on RPC results only (no sleeps).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import until_async

from switchyard.bench import procs
from switchyard.ext.blockhash import block_digests, to_event_hash
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from switchyard.workers.engine import kv_events as kv
from switchyard.workers.engine.types import FinishReason, RequestOutput
from switchyard.workers.sim_worker import (
    SNAPSHOT_BATCH_BLOCKS,
    SUBSCRIBER_QUEUE_BATCHES,
    IncrementalDetokenizer,
    KvEventHub,
    _Stream,
)
from switchyard.workers.tokenizer import load_tokenizer

pytestmark = pytest.mark.e2e

WORKER_ARGS = [
    "--time-scale", "0.02",
    "--block-size", "16",
    "--num-kv-blocks", "1025",  # 1024 usable + vLLM's null block
    "--max-num-seqs", "32",
    "--max-num-batched-tokens", "2048",
    "--max-model-len", "4096",
    "--hash-algo", "xxhash",
    "--profile", "llama3-8b-a100",
]  # fmt: skip


class WorkerProc:
    def __init__(self, popen: subprocess.Popen[str], address: str) -> None:
        self.popen = popen
        self.address = address

    def stop(self) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def start_worker(*extra: str, timeout_s: float = 30.0) -> WorkerProc:
    """Start `switchyard worker sim --port 0 ...` and wait for its READY line (bench.procs)."""
    p = procs.start("worker", ["worker", "sim", "--port", "0", *WORKER_ARGS, *extra], timeout_s=timeout_s)
    return WorkerProc(p.popen, p.address)


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProc]:
    proc = start_worker("--worker-id", "sim-test")
    yield proc
    assert proc.stop() == 0


def gen_request(
    request_id: str, prompt: list[int], max_tokens: int, **sampling
) -> worker_pb2.WorkerGenerateRequest:  # type: ignore[no-untyped-def]
    return worker_pb2.WorkerGenerateRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling),
    )


async def collect(stub: worker_pb2_grpc.WorkerStub, req: worker_pb2.WorkerGenerateRequest) -> list:
    return [chunk async for chunk in stub.Generate(req)]


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list:
    """The remaining chunks of a call already read with read() (the two styles cannot be mixed)."""
    chunks = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


async def wait_until_idle(stub: worker_pb2_grpc.WorkerStub, timeout_s: float = 5.0) -> worker_pb2.WorkerStats:
    """The worker's first Stats report with nothing running or waiting."""

    async def idle() -> worker_pb2.WorkerStats | None:
        stats = await stub.Stats(worker_pb2.StatsRequest())
        return stats if stats.num_running == 0 and stats.num_waiting == 0 else None

    return await until_async(idle, timeout_s, "the worker to be idle")


def prompt_of(text: str) -> list[int]:
    return load_tokenizer().encode(text)


async def test_info_reports_configuration(worker: WorkerProc) -> None:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        info = await worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest())
    assert info.worker_id == "sim-test"
    assert info.model == "mistral-7b-sim"
    assert (info.max_model_len, info.block_size) == (4096, 16)
    assert info.kv_capacity_blocks == 1024  # 1025 - the null block
    assert info.tokenizer_id == load_tokenizer().tokenizer_id
    assert (info.block_hash_algo, info.block_hash_seed) == ("xxhash", "")
    assert info.role == worker_pb2.WORKER_ROLE_MIXED
    assert info.state == worker_pb2.LIFECYCLE_STATE_READY
    assert (info.engine, info.perf_profile) == ("sim", "llama3-8b-a100")
    assert (info.max_num_seqs, info.max_num_batched_tokens) == (32, 2048)


async def test_generate_streams_max_tokens_with_text(worker: WorkerProc) -> None:
    prompt = prompt_of("The quick brown fox jumps over the lazy dog, again and again.")
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        before = await stub.Stats(worker_pb2.StatsRequest())
        chunks = await collect(stub, gen_request("gen-1", prompt, 24))
        after = await stub.Stats(worker_pb2.StatsRequest())
    assert after.num_requests_received == before.num_requests_received + 1  # every router's requests count
    token_ids = [t for c in chunks for t in c.token_ids]
    assert len(token_ids) == 24
    assert all(c.request_id == "gen-1" for c in chunks)
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 24)
    assert len({c.received_at for c in chunks}) == 1
    assert 0 < chunks[0].received_at <= chunks[0].first_token_at == last.first_token_at
    # the streamed deltas concatenate to the one-shot incremental decode of the same tokens
    detok = IncrementalDetokenizer(load_tokenizer(), prompt)
    assert "".join(c.text for c in chunks) == detok.add(token_ids, final=True)
    assert "".join(c.text for c in chunks).strip()


async def test_a_stream_interval_gathers_the_tokens_after_the_first(worker: WorkerProc) -> None:
    """`stream_interval_tokens` changes how the tokens are cut into chunks, never which: the first token goes
    alone (TTFT), every later chunk but the final one holds at least the interval, and an interval past the output
    leaves just the first token and the final chunk."""
    prompt = prompt_of("Chunks of tokens, please.")

    def request(rid: str, interval: int) -> worker_pb2.WorkerGenerateRequest:
        req = gen_request(rid, prompt, 30, seed=3)
        req.stream_interval_tokens = interval
        return req

    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        each = await collect(stub, request("iv-1", 0))
        by_four = await collect(stub, request("iv-4", 4))
        whole = await collect(stub, request("iv-all", 1_000))
    for chunks in (each, by_four, whole):
        assert [t for c in chunks for t in c.token_ids] == [t for c in each for t in c.token_ids]
        assert "".join(c.text for c in chunks) == "".join(c.text for c in each)
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert chunks[-1].usage.completion_tokens == 30
        assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        assert 0 < chunks[0].first_token_at == chunks[-1].first_token_at
    assert all(len(c.token_ids) >= 4 for c in by_four[1:-1])
    assert len(whole) == 2 and 1 <= len(whole[0].token_ids) < 30


@pytest.mark.parametrize("module", ["sim_worker", "vllm_worker"])
def test_the_worker_stream_interval_flag_is_at_least_one(module: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Both workers take `--stream-interval` (vLLM's flag); 0 is a usage error, not a silent 1."""
    import importlib

    parser = importlib.import_module(f"switchyard.workers.{module}").build_parser()
    model = ["--model", "m"] if module == "vllm_worker" else []
    assert parser.parse_args([*model, "--stream-interval", "3"]).stream_interval == 3
    assert parser.parse_args(model).stream_interval == 1
    with pytest.raises(SystemExit):
        parser.parse_args([*model, "--stream-interval", "0"])
    assert "must be at least 1" in capsys.readouterr().err


async def test_a_held_token_waits_at_most_the_hold_limit() -> None:
    """A slow decode still streams with a huge interval: tokens held for `STREAM_MAX_HOLD_S` (1 s) go out, so a
    router's stall watchdog hears from the stream (~33 ms a step here, 60 steps)."""
    slow = start_worker("--time-scale", "4")
    try:
        async with grpc.aio.insecure_channel(slow.address) as ch:
            req = gen_request("hold-1", prompt_of("slowly"), 60)
            req.stream_interval_tokens = 1_000
            chunks = await collect(worker_pb2_grpc.WorkerStub(ch), req)
    finally:
        assert slow.stop() == 0
    assert sum(len(c.token_ids) for c in chunks) == 60
    assert len(chunks) >= 3  # the first token, at least one chunk the hold limit let go (~2 s of decode), the final


async def test_stop_string_ends_generation_and_aborts_in_engine(worker: WorkerProc) -> None:
    prompt = prompt_of("stop string test")
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        # same seed, same tokens: the first run tells us the text, the second stops inside it
        full = "".join(c.text for c in await collect(stub, gen_request("stop-1", prompt, 40, seed=7)))
        stop = full[len(full) // 2 : len(full) // 2 + 4]
        chunks = await collect(stub, gen_request("stop-2", prompt, 40, seed=7, stop=[stop]))
        stats = await wait_until_idle(stub)
    assert "".join(c.text for c in chunks) == full[: full.find(stop)]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert chunks[-1].usage.completion_tokens < 40
    assert stats.num_running == 0  # the engine no longer runs the stopped request


async def test_generate_invalid_arguments(worker: WorkerProc) -> None:
    cases = [
        gen_request("bad-empty", [], 4),  # empty prompt
        gen_request("bad-long", [1] * 4097, 4),  # 4097 > max_model_len 4096
        gen_request("bad-zero", [1, 2, 3], 0),  # max_tokens must be > 0
        gen_request("bad-neg", [1, 2, 3], -5),
        gen_request("bad-vocab", [1, 32000], 4),  # the tokenizer has ids 0..31999
    ]
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for req in cases:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, req.request_id


async def test_prefix_cache_hit_and_block_stored_events(worker: WorkerProc) -> None:
    prompt = prompt_of("Cache me if you can: " + "lorem ipsum dolor sit amet " * 8)[:70]
    # 70 tokens = 4 full blocks (64 tokens) + 6; the output (4 tokens, 74 total) fills no further block
    expected_hashes = [to_event_hash(d) for d in block_digests(prompt, 16, "xxhash")]
    assert len(expected_hashes) == 4
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        events = stub.KvEvents(worker_pb2.KvEventsRequest(start_after_seq=0))
        snapshot = await events.read()
        assert snapshot.events[0].WhichOneof("event") == "cleared"
        first = await collect(stub, gen_request("cache-1", prompt, 4))
        stored: list[worker_pb2.BlockStored] = []
        while sum(len(s.block_hashes) for s in stored) < 4:
            batch = await events.read()
            assert batch.seq > snapshot.seq
            stored += [e.stored for e in batch.events if e.WhichOneof("event") == "stored"]
        events.cancel()
        second = await collect(stub, gen_request("cache-2", prompt, 4))
    assert [h for s in stored for h in s.block_hashes] == expected_hashes
    assert not stored[0].HasField("parent_block_hash")  # the first block starts the sequence
    assert list(stored[0].token_ids[:16]) == prompt[:16]
    assert first[-1].usage.cached_prompt_tokens == 0
    assert second[-1].usage.cached_prompt_tokens == 64  # 4 cached blocks x 16 tokens


async def test_kv_events_resume_replays_buffered_batches(worker: WorkerProc) -> None:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        live = stub.KvEvents(worker_pb2.KvEventsRequest(start_after_seq=0))
        snapshot = await live.read()
        for i in range(3):  # 3 distinct 48-token prompts: at least one BlockStored batch each
            await collect(stub, gen_request(f"replay-{i}", prompt_of(f"replay prompt {i} " * 20)[:48], 2))
        seen = [await live.read() for _ in range(3)]
        live.cancel()
        assert [b.seq for b in seen] == list(range(snapshot.seq + 1, snapshot.seq + 4))
        # resume after the first one we saw: the buffer replays the next two, identical
        resumed = stub.KvEvents(worker_pb2.KvEventsRequest(start_after_seq=seen[0].seq))
        replayed = [await resumed.read() for _ in range(2)]
        resumed.cancel()
        assert replayed == seen[1:]
        # a sequence number this worker never issued (another incarnation): snapshot at the current seq
        fresh = stub.KvEvents(worker_pb2.KvEventsRequest(start_after_seq=10**9))
        rebuilt = await fresh.read()
        fresh.cancel()
    assert rebuilt.seq >= seen[-1].seq
    assert rebuilt.events[0].WhichOneof("event") == "cleared"
    snapshot_hashes = {h for e in rebuilt.events[1:] for h in e.stored.block_hashes}
    assert {h for b in seen for e in b.events for h in e.stored.block_hashes} <= snapshot_hashes


async def test_cancel_aborts_in_engine(worker: WorkerProc) -> None:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        call = stub.Generate(gen_request("cancel-1", prompt_of("a long story " * 10), 3000))
        first = await call.read()
        assert first.token_ids
        running = await stub.Stats(worker_pb2.StatsRequest())
        assert running.num_running == 1
        call.cancel()
        stats = await wait_until_idle(stub)
    assert (stats.num_running, stats.num_waiting) == (0, 0)


async def test_abort_rpc_and_duplicate_id(worker: WorkerProc) -> None:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        call = stub.Generate(gen_request("abort-1", prompt_of("abort me please"), 3000))
        await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub, gen_request("abort-1", [1, 2, 3], 4))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        resp = await stub.Abort(worker_pb2.AbortRequest(request_ids=["abort-1", "no-such-request"]))
        assert resp.num_aborted == 1
        rest = await read_rest(call)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert (await wait_until_idle(stub)).num_running == 0


async def test_sigterm_drains_in_flight_then_exits_zero() -> None:
    # time scale 0.2: 400 tokens take ~0.7 s, so the request is still running while the drain is checked
    proc = start_worker("--time-scale", "0.2", "--drain-timeout", "20")
    try:
        async with grpc.aio.insecure_channel(proc.address) as ch:
            stub = worker_pb2_grpc.WorkerStub(ch)
            call = stub.Generate(gen_request("drain-1", prompt_of("drain test"), 400))
            chunks = [await call.read()]
            proc.popen.send_signal(signal.SIGTERM)
            health = health_pb2_grpc.HealthStub(ch)


            async def draining() -> bool:
                return (await stub.Info(worker_pb2.InfoRequest())).state == worker_pb2.LIFECYCLE_STATE_DRAINING

            await until_async(draining, 10.0, "the SIGTERM to start the drain")
            check = await health.Check(health_pb2.HealthCheckRequest(service=""))
            assert check.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await collect(stub, gen_request("drain-2", [1, 2, 3], 4))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            chunks += await read_rest(call)
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in chunks) == 400
        assert proc.popen.wait(timeout=10) == 0
    finally:
        proc.stop()


# ---------------------------------------------------------------- no sockets: text handling


def _outputs_for(token_ids: list[int], finish_at_end: bool = True) -> list[RequestOutput]:
    return [
        RequestOutput(
            "r", (t,), FinishReason.LENGTH if finish_at_end and i == len(token_ids) - 1 else None, 3, 0, i + 1
        )
        for i, t in enumerate(token_ids)
    ]


def test_incremental_detokenizer_matches_full_decode() -> None:
    tok = load_tokenizer()
    text = "Grüße aus Zürich! 日本語のテキスト, emoji 🚀 and spaces  here."
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok, [tok.bos_id])
    deltas = [detok.add([t]) for t in ids]
    deltas.append(detok.add([], final=True))
    assert "".join(deltas) == tok.decode(ids)
    assert " aus" in deltas  # the leading space of a word survives one-token decoding


def test_stop_string_trims_text_and_finishes() -> None:
    tok = load_tokenizer()
    ids = tok.encode("Hello world. STOP and more text", add_bos=False)
    stream = _Stream("r", 1.0, IncrementalDetokenizer(tok, [tok.bos_id]), ["STOP"])
    texts = []
    for out in _outputs_for(ids):
        chunk = stream.consume([out])
        if chunk is not None:
            texts.append(chunk.text)
        if stream.is_finished:
            break
    assert "".join(texts) == "Hello world. "
    assert chunk is not None and chunk.finish_reason == common_pb2.FINISH_REASON_STOP
    assert not stream.is_engine_done  # the worker must still abort it in the engine


@pytest.mark.parametrize("fold", [1, 3, 64])
def test_stop_string_ends_at_the_same_token_however_many_steps_a_chunk_folds(fold: int) -> None:
    # a slow consumer takes several engine steps per wake-up (all of them, when the engine ran ahead): the stop
    # must still end the stream at the token that completed it, with that token count in usage
    tok = load_tokenizer()
    ids = tok.encode("Hello world. STOP and more text after the stop", add_bos=False)
    stream = _Stream("r", 1.0, IncrementalDetokenizer(tok, [tok.bos_id]), ["STOP"])
    outs = _outputs_for(ids)
    chunks = []
    for i in range(0, len(outs), fold):
        chunk = stream.consume(outs[i : i + fold])
        if chunk is not None:
            chunks.append(chunk)
        if stream.is_finished:
            break
    sent = [t for c in chunks for t in c.token_ids]
    through_stop = next(k for k in range(1, len(ids) + 1) if "STOP" in tok.decode(ids[:k]))
    assert "".join(c.text for c in chunks) == "Hello world. "
    assert sent == ids[:through_stop]
    assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert chunks[-1].usage.completion_tokens == through_stop < len(ids)
    assert not stream.is_engine_done


def test_a_big_snapshot_goes_in_bounded_batches_and_only_the_last_carries_the_seq() -> None:
    """2.5 batches' worth of blocks in one chain: three batches, each at most SNAPSHOT_BATCH_BLOCKS; seq 0 on all
    but the last, so a router whose stream breaks mid-snapshot resumes from 0 and gets a fresh one."""
    n = SNAPSHOT_BATCH_BLOCKS * 5 // 2
    hashes = tuple(range(1, n + 1))
    hub = KvEventHub(lambda: lambda: [kv.BlockStored(hashes, None, tuple(range(2 * n)), 2)])
    hub.publish([kv.BlockRemoved((99,))], ts=1.0)
    first = hub.subscribe(0, ts=9.0)[1]()
    assert [b.seq for b in first] == [0, 0, hub.seq] and hub.seq == 1
    assert first[0].events[0].WhichOneof("event") == "cleared"
    stored = [e.stored for b in first for e in b.events if e.WhichOneof("event") == "stored"]
    assert all(sum(len(e.stored.block_hashes) for e in b.events) <= SNAPSHOT_BATCH_BLOCKS for b in first)
    assert [h for s in stored for h in s.block_hashes] == list(hashes)
    assert [t for s in stored for t in s.token_ids] == list(range(2 * n))
    # each piece hangs under the previous piece's last block
    assert [s.parent_block_hash if s.HasField("parent_block_hash") else None for s in stored] == [
        None, *(s.block_hashes[-1] for s in stored[:-1])
    ]


def test_kv_event_hub_replays_snapshots_and_drops_slow_subscribers() -> None:
    snapshot = [kv.BlockStored((11, 12), None, tuple(range(8)), 4)]
    hub = KvEventHub(lambda: lambda: snapshot)
    for h in (1, 2, 3):
        hub.publish([kv.BlockRemoved((h,))], ts=float(h))
    assert hub.seq == 3
    # resume after seq 1: batches 2 and 3 from the buffer
    sub, make = hub.subscribe(1, ts=9.0)
    assert [(b.seq, b.events[0].removed.block_hashes[0]) for b in make()] == [(2, 2), (3, 3)]
    hub.unsubscribe(sub)
    # fresh (0) or unknown (99 > 3): AllBlocksCleared + the snapshot, at the current seq
    for start in (0, 99):
        first = hub.subscribe(start, ts=9.0)[1]()
        assert len(first) == 1 and first[0].seq == 3
        assert [e.WhichOneof("event") for e in first[0].events] == ["cleared", "stored"]
        assert list(first[0].events[1].stored.block_hashes) == [11, 12]
        assert not first[0].events[1].stored.HasField("parent_block_hash")
    # seq 1 read from another incarnation of the worker (a restart) means nothing here: the snapshot, not a replay;
    # with this incarnation (or none given) it resumes
    first = hub.subscribe(1, ts=9.0, incarnation="an-earlier-process")[1]()
    assert [e.WhichOneof("event") for e in first[0].events] == ["cleared", "stored"]
    assert [b.seq for b in hub.subscribe(1, ts=9.0, incarnation=hub.incarnation)[1]()] == [2, 3]
    assert KvEventHub(lambda: lambda: snapshot).incarnation != hub.incarnation  # one per process start
    # a subscriber that never reads overflows, is marked and dropped; publishing never blocks
    slow, _ = hub.subscribe(3, ts=9.0)
    for _ in range(SUBSCRIBER_QUEUE_BATCHES + 1):
        hub.publish([kv.AllBlocksCleared()], ts=10.0)
    assert slow.is_overflowed and slow.queue.full()


async def _requests_until(events: grpc.aio.UnaryStreamCall, done) -> list[worker_pb2.RequestEvent]:  # type: ignore[no-untyped-def]
    """Request events read off a KvEvents stream until `done(events so far)`."""
    got: list[worker_pb2.RequestEvent] = []
    while not done(got):
        got += (await events.read()).requests
    return got


async def test_kv_events_stream_each_request_admission_first_token_and_end(worker: WorkerProc) -> None:
    """Every router replica subscribes to every worker: the request events tell each one of the others' requests
    (their prompt's blocks as BlockStored will name them, their load), tagged with the sender's origin; a new
    subscriber's snapshot lists the requests open at that moment."""
    prompt = prompt_of("mirror me: " + "the quick brown fox jumps " * 10)[:70]  # 4 full blocks
    expected_hashes = [to_event_hash(d) for d in block_digests(prompt, 16, "xxhash")]
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        events = stub.KvEvents(worker_pb2.KvEventsRequest(start_after_seq=0))
        await events.read()  # the snapshot
        req = gen_request("mirror-1", prompt, 5)
        req.origin, req.predicted_output_tokens, req.tenant = "router-a", 7, "team-a"
        chunks = await collect(stub, req)
        seen = await _requests_until(events, lambda got: any(e.WhichOneof("event") == "ended" for e in got))
        mine = [e for e in seen if e.request_id == "mirror-1"]
        assert [e.WhichOneof("event") for e in mine] == ["admitted", "first_token", "ended"]
        assert {e.origin for e in mine} == {"router-a"}
        a = mine[0].admitted
        assert (list(a.block_hashes), a.num_prompt_tokens, a.max_tokens, a.predicted_output_tokens, a.tenant) == (
            expected_hashes, 70, 5, 7, "team-a")
        assert (mine[2].ended.finished, mine[2].ended.num_output_tokens) == (True, chunks[-1].usage.completion_tokens)
        # an open request is in a new subscriber's snapshot (its first part, marked); its abort ends it unfinished
        call = stub.Generate(gen_request("mirror-2", prompt_of("still running " * 10), 3000))
        await call.read()  # its first token: admitted and first-token events were published before
        late = stub.KvEvents(worker_pb2.KvEventsRequest(start_after_seq=0))
        first = await late.read()
        assert first.snapshot and first.events[0].WhichOneof("event") == "cleared"
        assert [(e.request_id, e.WhichOneof("event")) for e in first.requests] == [
            ("mirror-2", "admitted"), ("mirror-2", "first_token")]
        late.cancel()
        await stub.Abort(worker_pb2.AbortRequest(request_ids=["mirror-2"]))
        await read_rest(call)
        seen = await _requests_until(
            events, lambda got: any(e.request_id == "mirror-2" and e.WhichOneof("event") == "ended" for e in got))
        events.cancel()
    ended = next(e for e in seen if e.request_id == "mirror-2" and e.WhichOneof("event") == "ended")
    assert not ended.ended.finished and ended.origin == ""
