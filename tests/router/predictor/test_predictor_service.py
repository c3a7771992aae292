"""PredictorService: micro-batching off the loop, deadline and error fallbacks, hints, learning, shutdown; then
the router daemon in-process (loopback gRPC, scripted fake worker) handing the prediction to the worker.

Test doubles block on threading events the test opens; waits are on conditions, never fixed sleeps (the one
deliberate wait is the service's own 20 ms deadline, which is the behaviour under test).
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import numpy as np
import pytest
from onnx_fixture import NAME, expected_length, make_predictor_dir

from switchyard.router.client import AsyncRouterClient
from switchyard.router.config import ConfigError, load_config
from switchyard.router.metrics import RouterMetrics
from switchyard.router.predictor.fallback import LengthFallback
from switchyard.router.predictor.memo import PromptMemo
from switchyard.router.predictor.onnx_predictor import OnnxLengthPredictor
from switchyard.router.predictor.service import PredictorService, load_predictor, resolve_model_dir
from switchyard.router.server import RouterDaemon, StartupError
from switchyard.workers.tokenizer import ChatMessage, load_tokenizer

# NOTE: the scripted fake worker lives one directory up (tests/router/), which pytest puts on sys.path only when
# it collects a test there; this file must also run alone.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_worker import FakeWorker, Script  # noqa: E402
from polling import until_async  # noqa: E402

TOK = load_tokenizer(None)
PRIOR = 256  # LengthFallback's default prior, what an untaught fallback answers


class ScriptedPredictor:
    """Answers len(text) + 100 per text, records batch sizes; optionally blocks or fails inside predict."""

    name = "scripted"
    providers = ["CPUExecutionProvider"]

    def __init__(self, block: bool = False, fail: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.entered = threading.Event()  # set when a predict call starts
        self.gate = threading.Event()  # predict waits on it when block=True
        self.block = block
        self.fail = fail

    def predict(self, texts: Sequence[str]) -> np.ndarray:
        self.batches.append(list(texts))
        self.entered.set()
        if self.block:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("scripted predictor failure")
        return np.array([len(t) + 100 for t in texts], dtype=np.int64)


def sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_predictor_dir(tmp_path_factory.mktemp("predictor") / NAME)


@asynccontextmanager
async def service(predictor=None, **kw) -> AsyncIterator[PredictorService]:  # type: ignore[no-untyped-def]
    s = PredictorService(RouterMetrics(), **kw)
    if predictor is not None:
        s.attach(predictor, warm_up=False)
    try:
        yield s
    finally:
        s.close()
        if isinstance(predictor, ScriptedPredictor):
            predictor.gate.set()


# ---------------------------------------------------------------------- the service
async def test_concurrent_requests_share_one_batch() -> None:
    p = ScriptedPredictor()
    # max_batch 4 closes the batch at the 4th request, long before the 10 s wait would
    async with service(p, max_batch=4, max_wait_ms=10_000, timeout_ms=10_000) as s:
        handles = [s.start("m", "x" * i, 10) for i in range(4)]
        results = await asyncio.gather(*(s.result(h) for h in handles))
        assert results == [(100, "model"), (101, "model"), (102, "model"), (103, "model")]
        assert [len(b) for b in p.batches] == [4]
        m = s._metrics
        assert m is not None
        assert sample(m, "switchyard_predictor_batch_size_count") == 1
        assert sample(m, "switchyard_predictor_batch_size_sum") == 4
        assert sample(m, "switchyard_predictor_latency_seconds_count") == 4
        assert sample(m, "switchyard_predictions_total", source="model") == 4


async def test_requests_arriving_during_a_batch_form_the_next_one() -> None:
    # max_wait_ms 0: no waiting, a batch is whatever queued while the previous one ran
    p = ScriptedPredictor(block=True)
    async with service(p, max_batch=16, max_wait_ms=0, timeout_ms=10_000) as s:
        first = s.start("m", "a", 1)
        await asyncio.to_thread(p.entered.wait, 5)  # the thread is inside predict(["a"])
        rest = [s.start("m", t, 1) for t in ("bb", "ccc", "dddd")]
        p.gate.set()
        assert [await s.result(h) for h in (first, *rest)] == [
            (101, "model"),
            (102, "model"),
            (103, "model"),
            (104, "model"),
        ]
        assert p.batches == [["a"], ["bb", "ccc", "dddd"]]


async def test_onnx_predictor_behind_the_service(model_dir: Path) -> None:
    texts = ["Hello there", "tell me a story", "why is the sky blue", "zzz"]
    async with service(
        OnnxLengthPredictor(model_dir), max_batch=4, max_wait_ms=10_000, timeout_ms=10_000
    ) as s:
        handles = [s.start("m", t, 5) for t in texts]
        assert [await s.result(h) for h in handles] == [(expected_length(t), "model") for t in texts]


async def test_past_the_deadline_the_fallback_answers() -> None:
    p = ScriptedPredictor(block=True)  # never answers until the test ends
    async with service(p, timeout_ms=20) as s:
        h = s.start("m", "slow", 10)
        assert await s.result(h) == (PRIOR, "fallback")
        assert p.batches == [["slow"]]  # it was asked, it just did not answer in time
        m = s._metrics
        assert m is not None
        assert sample(m, "switchyard_predictor_misses_total", reason="timeout") == 1
        assert sample(m, "switchyard_predictions_total", source="fallback") == 1
        assert await s.result(h) == (PRIOR, "fallback")  # settled once: a late answer changes nothing


async def test_a_predictor_error_falls_back_at_once() -> None:
    async with service(ScriptedPredictor(fail=True), timeout_ms=10_000) as s:
        h = s.start("m", "boom", 10)
        assert await asyncio.wait_for(s.result(h), 5) == (PRIOR, "fallback")  # not after the 10 s deadline
        assert sample(s._metrics, "switchyard_predictor_misses_total", reason="error") == 1  # type: ignore[arg-type]


async def test_binding_before_the_answer_takes_the_fallback() -> None:
    p = ScriptedPredictor(block=True)
    async with service(p, timeout_ms=10_000) as s:
        h = s.start("m", "queued", 10)
        assert s.result_nowait(h) == (PRIOR, "fallback")  # the queue's late binding cannot wait
        assert sample(s._metrics, "switchyard_predictor_misses_total", reason="early_bind") == 1  # type: ignore[arg-type]


async def test_without_a_model_the_fallback_answers_and_no_thread_runs() -> None:
    async with service(None) as s:
        assert not s.is_running and s.describe() == "fallback"
        assert "length-predictor" not in {t.name for t in threading.enumerate()}
        h = s.start("m", "hello", 10)
        assert h.future is None
        assert await s.result(h) == (PRIOR, "fallback")


async def test_token_id_requests_have_no_text_and_get_the_fallback() -> None:
    p = ScriptedPredictor()
    async with service(p) as s:
        assert await s.result(s.start("m", None, 10)) == (PRIOR, "fallback")
        assert p.batches == []


async def test_observe_teaches_the_fallback_and_records_the_error() -> None:
    async with service(None) as s:
        first = s.start("m", None, 100)
        assert await s.result(first) == (PRIOR, "fallback")
        for _ in range(10):
            s.observe("m", 100, 40, first)  # 10 finished requests of 40 tokens in the 100-token bucket
        expected = s.fallback.predict("m", 100)
        assert expected != PRIOR and abs(expected - 40) <= 1
        assert await s.result(s.start("m", None, 100)) == (expected, "fallback")
        m = s._metrics
        assert m is not None
        assert sample(m, "switchyard_predictor_abs_error_tokens_count", source="fallback") == 10
        assert sample(m, "switchyard_predictor_abs_error_tokens_sum", source="fallback") == 10 * (PRIOR - 40)


async def test_client_hint_wins_when_preferred_else_backs_up_the_model() -> None:
    p = ScriptedPredictor()
    async with service(p, prefer_client_hint=True) as s:
        assert await s.result(s.start("m", "abc", 10, hint=77)) == (77, "hint")
        assert p.batches == []  # the model was never asked
    p = ScriptedPredictor()
    async with service(p, prefer_client_hint=False, timeout_ms=10_000) as s:
        assert await s.result(s.start("m", "abc", 10, hint=77)) == (103, "model")
    async with service(ScriptedPredictor(fail=True), prefer_client_hint=False, timeout_ms=10_000) as s:
        assert await s.result(s.start("m", "abc", 10, hint=77)) == (77, "hint")  # the model failed


async def test_a_repeat_is_answered_from_the_memo_without_the_model() -> None:
    p = ScriptedPredictor()
    async with service(p, memo=PromptMemo(), timeout_ms=10_000) as s:
        first = s.start("m", "hi", 2, token_ids=[1, 2])
        assert await s.result(first) == (102, "model")
        s.observe("m", 2, 9, first)  # it finished naturally after 9 tokens
        again = s.start("m", "hi", 2, token_ids=[1, 2])
        assert await s.result(again) == (9, "memo") and again.future is None  # settled at start
        assert p.batches == [["hi"]]  # the model was asked once
        assert await s.result(s.start("m", "hi", 2, token_ids=[1, 2], hint=50)) == (50, "hint")  # a hint first
        other = s.start("m", "hi", 2, token_ids=[1, 2], adapter="lora-a")  # another adapter: not a repeat
        assert await s.result(other) == (102, "model")
        s.observe("m", 2, 500, other, capped=True)  # cut at max_tokens: says nothing about its length
        assert await s.result(s.start("m", "hi", 2, token_ids=[1, 2], adapter="lora-a")) == (102, "model")
        assert sample(s._metrics, "switchyard_predictions_total", source="memo") == 1  # type: ignore[arg-type]
    async with service(p) as s:  # no memo: token ids change nothing
        h = s.start("m", None, 2, token_ids=[1, 2])
        s.observe("m", 2, 9, h)
        assert h.key is None and (await s.result(s.start("m", None, 2, token_ids=[1, 2])))[1] == "fallback"


async def test_predictions_are_capped_by_max_tokens() -> None:
    async with service(ScriptedPredictor(), timeout_ms=10_000) as s:
        assert await s.result(s.start("m", "abc", 10, max_tokens=50)) == (50, "model")  # 103 > max_tokens


async def test_close_stops_the_thread_and_later_starts_fall_back() -> None:
    p = ScriptedPredictor()
    s = PredictorService(RouterMetrics(), timeout_ms=10_000)
    s.attach(p, warm_up=True)
    assert p.batches == [["warm up"]] and s.is_running
    assert await s.result(s.start("m", "abc", 10)) == (103, "model")
    s.close()
    assert not s.is_running
    assert "length-predictor" not in {t.name for t in threading.enumerate()}
    assert await s.result(s.start("m", "abc", 10)) == (PRIOR, "fallback")
    s.close()  # idempotent


# ---------------------------------------------------------------------- configuration
def test_predictor_section_from_every_source(tmp_path: Path) -> None:
    toml = tmp_path / "r.toml"
    toml.write_text('[predictor]\nmodel = "none"\nmax_batch = 8\ntimeout_ms = 30\n')
    c = load_config(
        toml,
        environ={
            "SWITCHYARD_PREDICTOR_MAX_BATCH": "4",
            "SWITCHYARD_PREDICTOR_PROVIDERS": "CPUExecutionProvider",
        },
        overrides={"predictor": {"threads": 2}},
    )
    p = c.predictor
    assert (p.model, p.max_batch, p.timeout_ms, p.threads, p.providers) == (
        "none",
        4,
        30.0,
        2,
        ("CPUExecutionProvider",),
    )
    assert load_config(environ={}).predictor.model == "auto"
    with pytest.raises(ConfigError, match="unknown key predictor.batch"):
        load_config(environ={"SWITCHYARD_PREDICTOR_BATCH": "3"})


def test_model_names_resolve_under_the_data_dir(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SWITCHYARD_CACHE_DIR", str(tmp_path))
    assert resolve_model_dir("none") is None
    assert resolve_model_dir("auto") is None  # the default predictor is not trained in this data dir
    assert resolve_model_dir("mine") == tmp_path / "predictor" / "mine"
    assert resolve_model_dir(str(model_dir)) == model_dir
    make_predictor_dir(tmp_path / "predictor" / "sharegpt-student-int8")
    assert resolve_model_dir("auto") == tmp_path / "predictor" / "sharegpt-student-int8"
    loaded = load_predictor(load_config(environ={}).predictor)
    assert loaded is not None and loaded.name == NAME


# ---------------------------------------------------------------------- in the daemon
@asynccontextmanager
async def stack(
    worker: FakeWorker, **predictor: object
) -> AsyncIterator[tuple[RouterDaemon, AsyncRouterClient]]:
    overrides = {
        "server": {"port": 0, "admin_port": 0, "metrics_enabled": False, "grace_s": 1.0},
        "workers": {"addresses": [await worker.start()], "stats_interval_s": 0.05, "connect_timeout_s": 2.0},
        "predictor": predictor,
    }
    daemon = RouterDaemon(load_config(environ={}, overrides=overrides))
    bound = await daemon.start()
    client = AsyncRouterClient(f"127.0.0.1:{bound.port}", admin_address=bound.admin)
    try:
        yield daemon, client
    finally:
        await client.close()
        await daemon.stop(0.5)
        await worker.stop()


async def test_daemon_hands_the_models_prediction_to_the_worker(model_dir: Path) -> None:
    w = FakeWorker("w0")
    async with stack(w, model=str(model_dir)) as (daemon, client):
        assert daemon.predictor.describe() == f"{NAME} (CPUExecutionProvider)"
        chat = [("system", "be brief"), ("user", "why is the sky blue")]
        await client.complete("m", prompt="Hello there", max_tokens=50)
        # chat: the predictor reads the last user message alone
        await client.complete("m", messages=chat, max_tokens=80)
        await client.complete("m", token_ids=TOK.encode("Hello there"), max_tokens=300)  # no text: fallback
        # the fallback had learned from the two finished requests (50 and 80 tokens) by then
        taught = LengthFallback()
        taught.observe("m", len(TOK.encode("Hello there")), 50)
        taught.observe("m", len(TOK.apply_chat_template([ChatMessage(*m) for m in chat])), 80)
        assert [r.predicted_output_tokens for r in w.received] == [
            expected_length("Hello there"),
            expected_length("why is the sky blue"),
            taught.predict("m", len(TOK.encode("Hello there"))),
        ]
        m = daemon.metrics
        assert sample(m, "switchyard_predictions_total", source="model") == 2
        assert sample(m, "switchyard_predictions_total", source="fallback") == 1
        # finished requests: |42 - 50| + |expected - 80| tokens of error for the model
        err = abs(expected_length("Hello there") - 50) + abs(expected_length("why is the sky blue") - 80)
        assert sample(m, "switchyard_predictor_abs_error_tokens_sum", source="model") == err
        assert w.received[2].predicted_output_tokens != PRIOR  # it did learn


async def test_client_hint_reaches_the_worker_when_preferred(model_dir: Path) -> None:
    w = FakeWorker("w0")
    async with stack(w, model=str(model_dir), prefer_client_hint=True) as (_daemon, client):
        await client.complete("m", prompt="Hello there", max_tokens=20, predicted_output_tokens_hint=7)
        assert w.received[0].predicted_output_tokens == 7


async def test_queued_request_binds_with_the_prediction_made_while_it_waited(model_dir: Path) -> None:
    # max_num_seqs=1 and a held first request: the second waits in the router's queue (late binding)
    w = FakeWorker("w0", max_num_seqs=1, script=Script(hold_after=0))
    async with stack(w, model=str(model_dir)) as (daemon, client):
        first = asyncio.create_task(client.complete("m", prompt="a", max_tokens=40, request_id="q1"))
        await w.wait_for(lambda: "q1" in w.active)
        second = asyncio.create_task(
            client.complete("m", prompt="tell me a story", max_tokens=90, request_id="q2")
        )
        await until_async(lambda: daemon.queue.size("m") == 1)
        # its prediction finished while it waited
        await until_async(lambda: sample(daemon.metrics, "switchyard_predictor_latency_seconds_count") == 2)
        w.gate.set()
        resp = await second
        await first
        assert resp.timings.queue_s > 0
        assert [r.predicted_output_tokens for r in w.received] == [
            expected_length("a"),
            expected_length("tell me a story"),
        ]
        assert sample(daemon.metrics, "switchyard_predictor_misses_total", reason="early_bind") == 0


async def test_daemon_answers_a_repeated_prompt_from_what_it_saw_finish() -> None:
    w = FakeWorker("w0", script=Script(stop_after=37))  # every answer ends (EOS) after 37 tokens
    async with stack(w, model="none") as (daemon, client):
        await client.complete("m", prompt="Hello there", max_tokens=300)
        await client.complete("m", prompt="Hello there", max_tokens=300)  # a repeat
        await client.complete("m", prompt="Hello again", max_tokens=300)  # not one
        await client.complete("m", prompt="Short one", max_tokens=20)  # cut at 20: not learnt
        await client.complete("m", prompt="Short one", max_tokens=300)
        got = [(r.predicted_output_tokens) for r in w.received]
        assert got[1] == 37  # the repeat, from the memo
        assert got[2] != 37 and got[4] != 20 and got[4] != 37  # from the fallback
        assert sample(daemon.metrics, "switchyard_predictions_total", source="memo") == 1
    w = FakeWorker("w0", script=Script(stop_after=37))
    async with stack(w, model="none", memo_entries=0) as (daemon, client):  # memo off
        for _ in range(2):
            await client.complete("m", prompt="Hello there", max_tokens=300)
        assert sample(daemon.metrics, "switchyard_predictions_total", source="memo") == 0


async def test_a_named_predictor_that_cannot_load_stops_startup(tmp_path: Path) -> None:
    w = FakeWorker("w0")
    with pytest.raises(StartupError, match="does not exist"):
        async with stack(w, model=str(tmp_path / "missing")):
            pass
    await w.stop()


def test_auto_max_batch_is_one_on_cpu_and_batches_on_a_gpu() -> None:
    from switchyard.router.predictor.service import auto_max_batch

    assert auto_max_batch(["CPUExecutionProvider"]) == 1
    assert auto_max_batch(["CUDAExecutionProvider", "CPUExecutionProvider"]) == 16
