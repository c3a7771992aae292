"""OnnxLengthPredictor on the torch-free fixture directory: shape, dtype, padding invariance, providers, errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx_fixture import NAME, expected_length, make_predictor_dir

from switchyard.router.predictor.onnx_predictor import (
    CPU,
    CUDA,
    OnnxLengthPredictor,
    PredictorLoadError,
    default_providers,
)

TEXTS = ["Hello there", "Tell me a story about the sea, please", "zzz unknown words", ""]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_predictor_dir(tmp_path_factory.mktemp("predictor") / NAME)


@pytest.fixture(scope="module")
def predictor(model_dir: Path) -> OnnxLengthPredictor:
    return OnnxLengthPredictor(model_dir, threads=1)


def test_predicts_int64_one_per_text(predictor: OnnxLengthPredictor) -> None:
    out = predictor.predict(TEXTS)
    assert out.dtype == np.int64 and out.shape == (4,)
    # "hello there" -> [CLS] hello there [SEP]: 10 * 4 + (2 + 5 + 6 + 3) % 7 = 42
    assert out[0] == 42
    assert out.tolist() == [expected_length(t) for t in TEXTS]
    assert predictor.predict([]).shape == (0,)


def test_padding_does_not_change_a_prediction(predictor: OnnxLengthPredictor) -> None:
    alone = [int(predictor.predict([t])[0]) for t in TEXTS]
    # in one batch the short texts are right-padded to the longest; the answers must not move
    assert predictor.predict(TEXTS).tolist() == alone
    assert predictor.predict(list(reversed(TEXTS))).tolist() == list(reversed(alone))


def test_truncates_to_max_input_tokens(predictor: OnnxLengthPredictor) -> None:
    # 40 words -> truncated to 16 tokens ([CLS] + 14 words + [SEP]): 10 * 16 + (2 + 14 * 10 + 3) % 7 = 165
    assert predictor.predict(["a " * 40]).tolist() == [165]


def test_runs_on_cpu_here_and_reports_the_sessions_providers(predictor: OnnxLengthPredictor) -> None:
    assert predictor.providers == [CPU]  # this machine's onnxruntime has no CUDA
    assert predictor.name == NAME and predictor.meta["max_input_tokens"] == 16


def test_serving_never_imports_torch(model_dir: Path) -> None:
    code = (
        "import sys; from switchyard.router.predictor.service import PredictorService; "
        "from switchyard.router.predictor.onnx_predictor import OnnxLengthPredictor; "
        f"print(OnnxLengthPredictor({str(model_dir)!r}).predict(['hello']).tolist(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == [f"[{expected_length('hello')}]", "False"]


def test_default_providers_put_cuda_first_only_when_listed() -> None:
    assert default_providers(["AzureExecutionProvider", CPU]) == [CPU]
    assert default_providers(["TensorrtExecutionProvider", CUDA, CPU]) == [CUDA, CPU]


def test_asking_for_cuda_without_it_falls_back_to_cpu(
    model_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    p = OnnxLengthPredictor(model_dir, providers=[CUDA, CPU])
    assert p.providers == [CPU]
    assert p.predict(["hello"]).tolist() == [expected_length("hello")]
    assert "Failed to" not in capfd.readouterr().err  # ORT's provider-fallback lines are silenced


def test_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PredictorLoadError, match="does not exist"):
        OnnxLengthPredictor(tmp_path / "nope")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: (d / "model.onnx").unlink(), "lacks model.onnx"),
        (lambda d: (d / "predictor.json").write_text("{not json"), "predictor.json"),
        (lambda d: (d / "predictor.json").write_text(json.dumps({"name": "x"})), "max_input_tokens"),
        (lambda d: (d / "model.onnx").write_bytes(b"garbage"), "model.onnx"),
        (lambda d: (d / "tokenizer.json").write_text("[]"), "tokenizer.json"),
    ],
)
def test_invalid_directory_is_a_clear_error(model_dir: Path, tmp_path: Path, damage, message: str) -> None:  # type: ignore[no-untyped-def]
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    damage(broken)
    with pytest.raises(PredictorLoadError, match=message):
        OnnxLengthPredictor(broken)
