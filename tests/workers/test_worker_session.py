"""The worker's Session stream (many requests over one stream) against a real simulated worker on loopback: each
request gets exactly the chunks its own Generate call would, an engine step's chunks of several requests share one
message, a request's failure or abort ends that request alone, and the stream's own end (closed, cancelled, a
protocol error, the worker's drain) ends or aborts what runs on it. Synchronised on RPC results only."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import grpc
import pytest
from test_sim_worker import WorkerProc, collect, gen_request, prompt_of, start_worker, wait_until_idle

from switchyard.router.worker_session import FRAME_BYTES, SessionCall, WorkerSender, WorkerSession
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from switchyard.workers.sim_worker import SESSION_REPLY_EVENTS, _Session

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def worker() -> WorkerProc:
    proc = start_worker("--worker-id", "session-test")
    yield proc
    assert proc.stop() == 0


class Sender:
    """The router's side of a session: frames queued here are the stream's requests; `close` half-closes it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[worker_pb2.SessionRequest | None] = asyncio.Queue()

    def send(self, *generate: worker_pb2.WorkerGenerateRequest, abort: tuple[str, ...] = ()) -> None:
        self.queue.put_nowait(worker_pb2.SessionRequest(generate=generate, abort_request_ids=abort))

    def close(self) -> None:
        self.queue.put_nowait(None)

    async def frames(self) -> AsyncIterator[worker_pb2.SessionRequest]:
        while (frame := await self.queue.get()) is not None:
            yield frame


@contextlib.asynccontextmanager
async def session_to(address: str) -> AsyncIterator[tuple[worker_pb2_grpc.WorkerStub, Sender, grpc.aio.StreamStreamCall]]:
    """A channel to the worker, and a Session stream on it whose requests `Sender` sends."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        sender = Sender()
        yield stub, sender, stub.Session(sender.frames())


async def read_until_done(call, rids: set[str]) -> tuple[dict[str, list], list[set[str]]]:  # type: ignore[no-untyped-def]
    """Events by request until each of `rids` ended (a final chunk or an error), and each reply's requests."""
    by_rid: dict[str, list] = {}
    replies: list[set[str]] = []
    open_ = set(rids)
    while open_:
        reply = await call.read()
        assert reply is not grpc.aio.EOF, f"stream ended with {open_} open"
        replies.append({ev.chunk.request_id for ev in reply.events})
        for ev in reply.events:
            rid = ev.chunk.request_id
            by_rid.setdefault(rid, []).append(ev)
            if ev.status_code or ev.chunk.finish_reason:
                open_.discard(rid)
    return by_rid, replies


async def test_info_advertises_the_session(worker: WorkerProc) -> None:
    async with grpc.aio.insecure_channel(worker.address) as ch:
        assert (await worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest())).session


async def test_each_request_gets_its_generate_calls_chunks_and_a_step_shares_one_message(worker: WorkerProc) -> None:
    prompts = {f"r{i}": prompt_of(f"story number {i} about a lighthouse keeper") for i in range(4)}
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        alone = {rid: await collect(stub, gen_request(f"call-{rid}", p, 20, seed=7)) for rid, p in prompts.items()}
        sender = Sender()
        call = stub.Session(sender.frames())
        sender.send(*(gen_request(rid, p, 20, seed=7) for rid, p in prompts.items()))
        events, replies = await read_until_done(call, set(prompts))
        sender.close()
        assert await call.read() is grpc.aio.EOF  # half-closed with nothing running: the stream ends
        assert await call.code() == grpc.StatusCode.OK
    for rid, chunks in alone.items():
        got = [ev.chunk for ev in events[rid]]
        assert all(ev.status_code == 0 for ev in events[rid])
        # the same tokens and text (how they are cut into chunks depends on when each reader wakes, as for calls)
        assert [t for c in got for t in c.token_ids] == [t for c in chunks for t in c.token_ids]
        assert len(got[0].token_ids) == 1  # the first token alone (TTFT), as a call's
        assert "".join(c.text for c in got) == "".join(c.text for c in chunks)
        assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert got[-1].usage.completion_tokens == 20
        assert 0 < got[0].received_at <= got[0].first_token_at
    # the four run in one batch: a step's chunks of all of them go in one message, not one message each
    assert max(len(r) for r in replies) == 4, replies
    assert len(replies) < sum(len(v) for v in events.values()) / 2


async def test_the_routers_session_call_iterates_as_a_generate_call(worker: WorkerProc) -> None:
    """The router's side (`WorkerSession`): `async for` over a request's `SessionCall` yields its Generate call's
    tokens and ends after the final chunk, as a call's iteration does (a caller that does not stop at the
    finish reason itself, as `bench relay`, would otherwise wait forever)."""
    async with grpc.aio.insecure_channel(worker.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        alone = await collect(stub, gen_request("call-it", prompt_of("one more story"), 6, seed=3))
        session = WorkerSession(stub, "test")
        req = gen_request("it", prompt_of("one more story"), 6, seed=3)
        got = await asyncio.wait_for(_chunks(session.start(req, 10.0, req.ByteSize())), 10)
    assert [t for c in got for t in c.token_ids] == [t for c in alone for t in c.token_ids]
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH


async def _chunks(call) -> list:  # type: ignore[no-untyped-def]
    return [chunk async for chunk in call]


async def test_the_sender_shares_a_session_until_it_ends_and_sends_the_rest_as_calls(worker: WorkerProc) -> None:
    """`WorkerSender`, how the daemon and the bench relay send: requests share one session, a new one opens once it
    ended, and a request over a session message's budget, or any where sessions are off, is a Generate call."""
    opened: list[WorkerSession | None] = []
    async with grpc.aio.insecure_channel(worker.address) as ch:
        sender = WorkerSender(worker_pb2_grpc.WorkerStub(ch), "test", sessions=True,
                              on_open=lambda: opened.append(sender.session))
        calls = [sender.send(gen_request(f"s{i}", prompt_of("a shared stream"), 3), 10.0) for i in range(2)]
        assert all(isinstance(c, SessionCall) for c in calls) and len(opened) == 1
        assert [await _tokens(c) for c in calls] == [3, 3]
        first = opened[0]
        assert first is not None and first._call is not None and first._reader is not None
        first._call.cancel()  # the stream ends (as when its channel breaks)
        await first._reader
        assert not first.usable
        again = sender.send(gen_request("s2", prompt_of("a new stream"), 3), 10.0)
        assert len(opened) == 2 and opened[1] is not first and await _tokens(again) == 3

        big = gen_request("big", [7] * (FRAME_BYTES + 1), 1)  # over the budget: its own call, which the worker refuses
        call = sender.send(big, 10.0)
        assert not isinstance(call, SessionCall) and len(opened) == 2
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _chunks(call)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        sender.sessions = False
        call = sender.send(gen_request("c", prompt_of("a call"), 3), 10.0)
        assert not isinstance(call, SessionCall) and await _tokens(call) == 3 and len(opened) == 2


async def _tokens(call) -> int:  # type: ignore[no-untyped-def]
    return sum(len(chunk.token_ids) for chunk in await _chunks(call))


async def test_a_failed_or_aborted_request_ends_alone(worker: WorkerProc) -> None:
    async with session_to(worker.address) as (stub, sender, call):
        sender.send(gen_request("long", prompt_of("a long story " * 10), 3000), gen_request("bad", [1, 2, 3], 0))
        bad, _ = await read_until_done(call, {"bad"})
        assert bad["bad"][-1].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "max_tokens" in bad["bad"][-1].status_message
        sender.send(gen_request("ok", [5, 6, 7, 8], 3))
        ok, _ = await read_until_done(call, {"ok"})
        assert ok["ok"][-1].chunk.finish_reason == common_pb2.FINISH_REASON_LENGTH
        sender.send(abort=("long",))
        long, _ = await read_until_done(call, {"long"})
        assert long["long"][-1].chunk.finish_reason == common_pb2.FINISH_REASON_ABORT
        sender.close()
        assert await call.read() is grpc.aio.EOF
        assert (await wait_until_idle(stub)).num_running == 0


async def test_cancelling_the_session_aborts_its_requests(worker: WorkerProc) -> None:
    async with session_to(worker.address) as (stub, sender, call):
        sender.send(gen_request("c1", prompt_of("cancel me"), 3000), gen_request("c2", prompt_of("and me"), 3000))
        seen: set[str] = set()
        while len(seen) < 2:  # both have sent tokens
            seen |= {ev.chunk.request_id for ev in (await call.read()).events}
        assert (await stub.Stats(worker_pb2.StatsRequest())).num_running == 2
        call.cancel()
        assert (await wait_until_idle(stub)).num_running == 0


async def test_a_request_id_no_event_could_name_ends_the_session(worker: WorkerProc) -> None:
    async with session_to(worker.address) as (stub, sender, call):
        sender.send(gen_request("dup", prompt_of("twice"), 3000))
        await call.read()
        sender.send(gen_request("dup", [1, 2, 3], 4))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await call.read() is not grpc.aio.EOF:
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "already running" in (err.value.details() or "")
        assert (await wait_until_idle(stub)).num_running == 0  # the running one was aborted with the stream


async def test_the_drain_ends_an_open_session_cleanly() -> None:
    """A router keeps its session open; the worker's drain ends it with OK once its requests finished, rather
    than the server's stop cutting it off."""
    proc = start_worker("--time-scale", "0.2", "--drain-timeout", "20")
    try:
        async with session_to(proc.address) as (_stub, sender, call):
            sender.send(gen_request("drain-1", prompt_of("drain test"), 200))
            first = await call.read()
            proc.popen.send_signal(signal.SIGTERM)
            events, _ = await read_until_done(call, {"drain-1"})
            assert await call.read() is grpc.aio.EOF
            assert await call.code() == grpc.StatusCode.OK
        chunks = [ev.chunk for ev in [*first.events, *events["drain-1"]]]
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert sum(len(c.token_ids) for c in chunks) == 200
        assert proc.popen.wait(timeout=10) == 0
    finally:
        proc.stop()


def test_a_reply_takes_at_most_its_event_budget() -> None:
    """Events that piled up while the stream was slow go out in replies of at most SESSION_REPLY_EVENTS each, in
    order, none lost."""
    session = _Session(servicer=None)  # type: ignore[arg-type]  # take() reads only its own events
    n = SESSION_REPLY_EVENTS + 88
    session.events = [worker_pb2.SessionEvent(chunk=worker_pb2.WorkerGenerateChunk(request_id=f"r{i}"))
                      for i in range(n)]
    first = asyncio.run(session.take())
    second = asyncio.run(session.take())
    assert first is not None and second is not None
    assert (len(first), len(second)) == (SESSION_REPLY_EVENTS, 88)
    assert [e.chunk.request_id for e in first + second] == [f"r{i}" for i in range(n)]
