"""The whole predictor pipeline on a toy model: train (teacher + student) -> export (fp32 + int8) -> ONNX serving,
plus claim 12 (spec §10): the ONNX model takes tokenised text only and returns one non-negative scalar <= 4096
per row, the prompt-tuning tokens are in the graph, and all base layers but the last stay frozen in training.

One `switchyard predictor train --tiny` run (about 20-30 s on one thread) is shared by the module.
"""

from __future__ import annotations

import json
import os
from statistics import median_low

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from switchyard.router.predictor import data  # noqa: E402
from switchyard.router.predictor.convert import load_tokenizer, pretrained_distilbert  # noqa: E402
from switchyard.router.predictor.data import LengthSample  # noqa: E402
from switchyard.router.predictor.export import PROMPT_INITIALIZER, encode_texts, load_checkpoint  # noqa: E402
from switchyard.router.predictor.model import LengthRegressor, RegressorConfig  # noqa: E402
from switchyard.router.predictor.onnx_predictor import OnnxLengthPredictor  # noqa: E402

NAMES = ("toy-teacher", "toy-teacher-int8", "toy-student", "toy-student-int8")
TEXTS = [
    "Write a haiku about the sea.",
    "Explain in detail how transformers work, with code.",
    "hi",
    "Translate to French: good morning, how are you today?",
]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from switchyard.router.predictor import train

    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("predictors")
    assert train.main(["--tiny", "--output", "toy", "--output-dir", str(out)]) == 0
    return out


def _session(path):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(str(path / "model.onnx"), opts, providers=["CPUExecutionProvider"])


def test_train_writes_four_predictor_directories(trained) -> None:
    for name in NAMES:
        meta = json.loads((trained / name / "predictor.json").read_text())
        assert meta["name"] == name
        assert meta["kind"] == name.split("-")[1]
        assert meta["quantized"] is name.endswith("-int8")
        assert meta["max_input_tokens"] == 32 and meta["max_output_tokens"] == 4096
        assert meta["num_prompt_tokens"] == 4 and meta["dim"] == 384
        assert meta["layers"] == (2 if "teacher" in name else 1)
        assert meta["train"]["samples"]["train_augmented"] >= meta["train"]["samples"]["train"] > 150
        assert meta["train"]["teacher"]["samples_per_s"] > 0
        assert set(meta["train"]["test_metrics_torch"]["student"]) >= {"mae", "acc25", "acc50", "acc100"}
        if not meta["quantized"]:
            assert meta["export"]["max_abs_diff_tokens"] < 0.5  # ORT vs torch at export time
        assert (trained / name / "tokenizer.json").exists()
    train_json = json.loads((trained / "toy-train.json").read_text())
    assert (
        0 < train_json["seconds"] <= train_json["seconds_with_export"] and train_json["config"]["epochs"] == 1
    )
    assert (trained / "toy-teacher.pt").exists() and (trained / "toy-student.pt").exists()


def test_claim12_onnx_io_is_tokenised_text_to_one_bounded_scalar(trained) -> None:
    for name in NAMES:
        sess = _session(trained / name)
        inputs = {i.name: i for i in sess.get_inputs()}
        assert set(inputs) == {"input_ids", "attention_mask"}  # no length feature, no service id
        assert all(i.type == "tensor(int64)" for i in inputs.values())
        (out,) = sess.get_outputs()
        assert out.name == "length" and out.type == "tensor(float)" and len(out.shape) == 1
        rng = np.random.default_rng(0)
        for batch, seq in ((1, 3), (5, 32), (2, 17)):
            ids = rng.integers(0, 30522, (batch, seq)).astype(np.int64)
            ids[:, 0] = 101
            mask = np.ones_like(ids)
            mask[0, seq // 2 :] = 0  # one padded row
            (length,) = sess.run(["length"], {"input_ids": ids, "attention_mask": mask})
            assert length.shape == (batch,)
            assert np.all(length >= 1) and np.all(length <= 4096)


def test_claim12_prompt_tokens_live_in_the_graph(trained) -> None:
    from onnx import numpy_helper

    for name in NAMES:
        model, _ = load_checkpoint(trained / f"toy-{name.split('-')[1]}.pt")
        graph = onnx.load(str(trained / name / "model.onnx")).graph
        inits = {init.name: init for init in graph.initializer}
        assert PROMPT_INITIALIZER in inits, name
        value = numpy_helper.to_array(inits[PROMPT_INITIALIZER])
        np.testing.assert_array_equal(
            value.reshape(4, 384), model.prompts.detach().numpy()
        )  # the trained values
        assert any(PROMPT_INITIALIZER in node.input for node in graph.node)  # and the graph uses them


def test_claim12_all_base_layers_but_the_last_stay_frozen(trained) -> None:
    teacher, payload = load_checkpoint(trained / "toy-teacher.pt")
    assert payload["kind"] == "teacher"
    base = pretrained_distilbert(layers=(0, 5))  # the tiny teacher's MiniLM blocks
    trained_blocks = teacher.encoder.transformer.layer
    for i in (0,):
        for (n, p), (_, q) in zip(
            trained_blocks[i].named_parameters(), base.transformer.layer[i].named_parameters(), strict=True
        ):
            assert torch.equal(p, q), f"frozen block {i} changed: {n}"
    assert torch.equal(
        teacher.encoder.embeddings.word_embeddings.weight, base.embeddings.word_embeddings.weight
    )
    last_changed = any(
        not torch.equal(p, q)
        for p, q in zip(trained_blocks[1].parameters(), base.transformer.layer[1].parameters(), strict=True)
    )
    assert last_changed, "the last block must train"


def test_freeze_marks_only_last_block_prompts_and_head_trainable() -> None:
    model = LengthRegressor(RegressorConfig(layers=(0, 1, 5), num_prompt_tokens=4))
    model.freeze()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "prompts" in trainable
    assert {n for n in trainable if n.startswith("encoder.")} == {
        n for n, _ in model.named_parameters() if n.startswith("encoder.transformer.layer.2.")
    }
    assert {n for n in trainable if n.startswith("head.")} == {
        n for n, _ in model.head.named_parameters(prefix="head")
    }


def test_padding_does_not_change_a_prediction() -> None:
    torch.set_num_threads(1)
    model = LengthRegressor(RegressorConfig(layers=(0, 5), num_prompt_tokens=4)).eval()
    tok = load_tokenizer(32)
    alone = [encode_texts(tok, [t], 32) for t in TEXTS]
    ids, mask = encode_texts(tok, TEXTS, 32)
    wide_ids = np.pad(ids, ((0, 0), (0, 7)))  # 7 extra pad columns
    wide_mask = np.pad(mask, ((0, 0), (0, 7)))
    with torch.no_grad():
        single = torch.cat([model.forward_raw(torch.from_numpy(i), torch.from_numpy(m)) for i, m in alone])
        batched = model.forward_raw(torch.from_numpy(ids), torch.from_numpy(mask))
        wide = model.forward_raw(torch.from_numpy(wide_ids), torch.from_numpy(wide_mask))
    assert torch.allclose(single, batched, atol=1e-5) and torch.allclose(single, wide, atol=1e-5)
    # and the prompts do matter: a different prompt matrix changes the output
    with torch.no_grad():
        model.prompts.add_(torch.randn_like(model.prompts))  # not a constant shift: LayerNorm removes those
        moved = model.forward_raw(torch.from_numpy(ids), torch.from_numpy(mask))
    assert not torch.allclose(moved, batched, atol=1e-4)


def test_onnx_serving_matches_torch_and_is_padding_invariant(trained) -> None:
    student, _ = load_checkpoint(trained / "toy-student.pt")
    ids, mask = encode_texts(load_tokenizer(32), TEXTS, 32)
    with torch.no_grad():
        want = student(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    sess = _session(trained / "toy-student")
    (got,) = sess.run(["length"], {"input_ids": ids, "attention_mask": mask})
    np.testing.assert_allclose(got, want, atol=0.05)
    predictor = OnnxLengthPredictor(trained / "toy-student", threads=1)
    served = predictor.predict(TEXTS)
    assert served.dtype == np.int64 and served.tolist() == np.rint(want).astype(int).tolist()
    assert [int(predictor.predict([t])[0]) for t in TEXTS] == served.tolist()
    int8 = OnnxLengthPredictor(trained / "toy-student-int8", threads=1).predict(TEXTS)
    assert np.all(np.abs(int8 - served) <= np.maximum(10, 0.1 * served))  # quantisation error stays small


def test_export_cli_reexports_a_checkpoint(trained, tmp_path) -> None:
    from switchyard.router.predictor import export

    out = tmp_path / "again"
    assert export.main(["--checkpoint", str(trained / "toy-student.pt"), "--output", str(out)]) == 0
    meta = json.loads((out / "predictor.json").read_text())
    assert (
        meta["kind"] == "student"
        and meta["quantized"] is False
        and meta["export"]["max_abs_diff_tokens"] < 0.5
    )
    a = OnnxLengthPredictor(out).predict(TEXTS)
    b = OnnxLengthPredictor(trained / "toy-student").predict(TEXTS)
    assert a.tolist() == b.tolist()


def test_eval_and_latency_bench_run_on_the_toy_predictors(trained, tmp_path, monkeypatch) -> None:
    from switchyard.bench import predictor_latency
    from switchyard.router.predictor import evaluate

    test = [LengthSample(f"t{i}", t, 10, 50 + 40 * i) for i, t in enumerate(TEXTS * 3)]
    train = [LengthSample(f"r{i}", t, 5 + i, 30 + 20 * i) for i, t in enumerate(TEXTS * 4)]
    monkeypatch.setattr(data, "load_split", lambda **kw: (train, test))
    out = tmp_path / "results"
    names = [str(trained / n) for n in ("toy-student", "toy-student-int8")]
    assert (
        evaluate.main(["--predictors", *names, "--no-bucket-baseline", "--threads", "1", "--out", str(out)])
        == 0
    )
    result = json.loads((out / "accuracy.json").read_text())
    methods = [r["method"] for r in result["rows"]]
    assert methods[:2] == ["Switchyard toy-student (ONNX)", "Switchyard toy-student-int8 (ONNX)"]
    assert "mean length (train)" in methods and "PreServe (paper)" in methods
    assert all(r["n"] == len(test) for r in result["rows"] if "paper" not in r["method"])
    assert "78.25" in (out / "accuracy.md").read_text()
    # every test prompt occurs in the train split: the memo answers all, with the median (low) of its lengths
    memo_rows = {r["method"]: r for r in result["rows"] if "exact-repeat memo" in r["method"]}
    assert list(memo_rows) == [
        f"{m} + exact-repeat memo (100.0% of prompts)"
        for m in ("Switchyard toy-student", "Switchyard toy-student-int8", "median length")
    ]
    seen = {t: median_low([s.output_tokens for s in train if s.prompt == t]) for t in TEXTS}
    mae = sum(abs(seen[s.prompt] - s.output_tokens) for s in test) / len(test)
    assert all(r["mae"] == pytest.approx(mae) for r in memo_rows.values())

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(TEXTS * 4))
    args = [
        "--predictors",
        *names,
        "--requests",
        "16",
        "--batch-sizes",
        "8",
        "--prompts-file",
        str(prompts),
        "--out",
        str(out),
    ]
    assert predictor_latency.main(args) == 0
    lat = json.loads((out / "latency.json").read_text())
    assert lat["threads"] == 1 and [r["name"] for r in lat["rows"]] == ["toy-student", "toy-student-int8"]
    for r in lat["rows"]:
        assert 0 < r["batch1"]["p50_ms"] <= r["batch1"]["p99_ms"] and r["batch1"]["n"] == 16
        assert r["batched"]["8"]["n"] == 2 and r["load_s"] > 0
    assert (out / "latency.png").stat().st_size > 1000
