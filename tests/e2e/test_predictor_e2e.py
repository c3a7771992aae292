"""End to end: a real router process serves an exported length predictor to real simulated worker processes.

The fixture predictor's answers are known in advance (a function of the prompt's tokens), so the router's metrics
must show exactly those predictions handed to the policy, and exactly their error once the requests finished
(ignore_eos: each request decodes max_tokens). With `--predictor none` the same requests get the fallback.
"""

from __future__ import annotations

import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchyard.bench import procs
from switchyard.router.client import RouterClient

# NOTE: the fixture builder lives with the predictor unit tests; this file must also run alone.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router" / "predictor"))
from onnx_fixture import NAME, expected_length, make_predictor_dir  # noqa: E402

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b-sim"
PROMPTS = [("Hello there", 64), ("tell me a story about the sea", 20), ("why is the sky blue", 120)]


def metric(router: procs.Proc, name: str, **labels: str) -> float:
    body = urllib.request.urlopen(f"http://{router.extra['metrics']}/metrics", timeout=5).read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture(scope="module")
def worker() -> Iterator[procs.Proc]:
    w = procs.start("pw0", ["worker", "sim", "--port", "0", "--worker-id", "pw0", "--time-scale", "0.01"])
    with procs.running([w]):
        yield w


def start_router(worker: procs.Proc, predictor: str) -> procs.Proc:
    return procs.start(
        "router",
        [
            "serve",
            "--port",
            "0",
            "--admin-port",
            "0",
            "--metrics-port",
            "0",
            "--worker",
            worker.address,
            "--predictor",
            predictor,
        ],
    )


def run_prompts(router: procs.Proc) -> None:
    with RouterClient(router.address, admin_address=router.extra["admin"]) as c:
        for prompt, max_tokens in PROMPTS:
            resp = c.complete(MODEL, prompt=prompt, max_tokens=max_tokens, ignore_eos=True)
            assert resp.usage.completion_tokens == max_tokens


def test_router_routes_with_the_models_predictions(worker: procs.Proc, tmp_path: Path) -> None:
    model_dir = make_predictor_dir(tmp_path / NAME)
    router = start_router(worker, str(model_dir))
    with procs.running([router]):
        assert (router.extra["predictor"], router.extra["predictor_providers"]) == (
            NAME,
            "CPUExecutionProvider",
        )
        run_prompts(router)
        # each prediction is capped by its request's max_tokens: 42 | min(81, 20) = 20 | 73
        predicted = [min(expected_length(p), n) for p, n in PROMPTS]
        assert metric(router, "switchyard_predictions_total", source="model") == len(PROMPTS)
        assert metric(router, "switchyard_predictions_total", source="fallback") == 0
        assert metric(router, "switchyard_predicted_output_tokens_sum", source="model") == sum(predicted)
        # ignore_eos: every request decoded exactly max_tokens
        error = sum(abs(p - n) for p, (_, n) in zip(predicted, PROMPTS, strict=True))
        assert metric(router, "switchyard_predictor_abs_error_tokens_sum", source="model") == error
        assert metric(router, "switchyard_predictor_batch_size_sum") >= len(PROMPTS)


def test_without_a_model_the_router_uses_the_fallback(worker: procs.Proc) -> None:
    router = start_router(worker, "none")
    with procs.running([router]):
        assert router.extra["predictor"] == "fallback" and "predictor_providers" not in router.extra
        run_prompts(router)
        assert metric(router, "switchyard_predictions_total", source="fallback") == len(PROMPTS)
        assert metric(router, "switchyard_predictions_total", source="model") == 0
        assert metric(router, "switchyard_predictor_batch_size_count") == 0
