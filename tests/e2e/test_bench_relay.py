"""End to end: `bench relay` (bench live's floor of a Python gRPC router) over real worker processes: a token-id
request streams every token back with the worker's final chunk, requests alternate over the workers, a text
prompt is refused with INVALID_ARGUMENT, and a client that leaves mid-stream has its request aborted on the worker;
over worker sessions (the daemon's default) and over one Generate call per request (`--calls`)."""

from __future__ import annotations

import grpc
import pytest
from polling import until

from switchyard.bench import procs
from switchyard.router.client import RouterClient, make_request
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b-sim"


def _stats(worker: procs.Proc) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(worker.address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)


@pytest.mark.parametrize("mode", ["session", "calls"])
def test_relay_streams_round_robin_and_refuses_text(mode: str) -> None:
    workers = [  # real decode speed (~9 ms a step): the long request below is still running when the client leaves
        procs.start(f"w{i}", ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--time-scale", "1"])
        for i in range(2)
    ]
    relay = procs.start("relay", ["bench", "relay", *(x for w in workers for x in ("--worker", w.address)),
                                  *(["--calls"] if mode == "calls" else [])])
    with procs.running([*workers, relay]), RouterClient(relay.address) as c:
        for i in range(4):
            chunks = list(c.generate(request=make_request(
                MODEL, token_ids=[1, *range(100 + i, 164 + i)], max_tokens=5, ignore_eos=True, request_id=f"r{i}")))
            assert sum(len(ch.token_ids) for ch in chunks) == 5
            assert {ch.request_id for ch in chunks} == {f"r{i}"}
            assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert chunks[-1].usage.prompt_tokens == 65
        with pytest.raises(grpc.RpcError) as err:
            list(c.generate(request=make_request(MODEL, prompt="hello", max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # round-robin: each worker served two of the four requests
        assert [_stats(w).num_requests_received for w in workers] == [2, 2]
        call = c.generate(request=make_request(
            MODEL, token_ids=[1, *range(300, 364)], max_tokens=2000, ignore_eos=True, request_id="long"))
        next(call), next(call)
        assert _stats(workers[0]).num_running == 1
        call.cancel()
        until(lambda: _stats(workers[0]).num_running == 0, what="the worker aborted the request the client left")
