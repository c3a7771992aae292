"""A tiny, valid exported predictor directory (contract B) built without torch, for fast serving tests.

The graph is arithmetic on the inputs, so every prediction is known in advance:
    length = clip(10 * num_real_tokens + (sum of real token ids) mod 7, 1, 4096)
where the real tokens are [CLS] text [SEP] (attention_mask == 1). Padding changes neither term.
The tokenizer is a lower-casing WordPiece over a 20-word vocabulary (anything else is [UNK]).
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
from onnx import TensorProto, helper
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

WORDS = (
    "hello",
    "there",
    "router",
    "tell",
    "me",
    "a",
    "story",
    "about",
    "the",
    "sea",
    "write",
    "poem",
    "long",
    "short",
    "please",
    "explain",
    "why",
    "sky",
    "is",
    "blue",
)
VOCAB = {tok: i for i, tok in enumerate(("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"))}
MAX_INPUT_TOKENS = 16
NAME = "tiny-fixture"


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(VOCAB, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", VOCAB["[CLS]"]), ("[SEP]", VOCAB["[SEP]"])]
    )
    return tok


def build_graph() -> onnx.ModelProto:
    i64, f32 = TensorProto.INT64, TensorProto.FLOAT
    nodes = [
        helper.make_node("Mul", ["input_ids", "attention_mask"], ["real_ids"]),
        helper.make_node("ReduceSum", ["real_ids", "axis1"], ["id_sum"], keepdims=0),
        helper.make_node("Mod", ["id_sum", "seven"], ["id_mod"]),
        helper.make_node("ReduceSum", ["attention_mask", "axis1"], ["num_real"], keepdims=0),
        helper.make_node("Mul", ["num_real", "ten"], ["scaled"]),
        helper.make_node("Add", ["scaled", "id_mod"], ["raw"]),
        helper.make_node("Cast", ["raw"], ["raw_f"], to=f32),
        helper.make_node("Clip", ["raw_f", "lo", "hi"], ["length"]),
    ]
    inits = [
        helper.make_tensor("axis1", i64, [1], [1]),
        helper.make_tensor("seven", i64, [], [7]),
        helper.make_tensor("ten", i64, [], [10]),
        helper.make_tensor("lo", f32, [], [1.0]),
        helper.make_tensor("hi", f32, [], [4096.0]),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_length",
        [
            helper.make_tensor_value_info("input_ids", i64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", i64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("length", f32, ["batch"])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # readable by every onnxruntime the router supports
    onnx.checker.check_model(model)
    return model


def make_predictor_dir(path: Path, name: str = NAME) -> Path:
    """Write model.onnx, tokenizer.json and predictor.json into `path` (created) and return it."""
    path.mkdir(parents=True, exist_ok=True)
    onnx.save(build_graph(), str(path / "model.onnx"))
    build_tokenizer().save(str(path / "tokenizer.json"))
    meta = {
        "name": name,
        "kind": "student",
        "quantized": False,
        "max_input_tokens": MAX_INPUT_TOKENS,
        "max_output_tokens": 4096,
        "num_prompt_tokens": 0,
        "layers": 0,
        "dim": 0,
        "train": {"samples": 0},
        "created": "2024-01-01T00:00:00+00:00",
    }
    (path / "predictor.json").write_text(json.dumps(meta))
    return path


def expected_length(text: str) -> int:
    """What the fixture graph answers for `text` (the same tokenizer, truncated the same way)."""
    tok = build_tokenizer()
    tok.enable_truncation(max_length=MAX_INPUT_TOKENS)
    ids = tok.encode(text).ids
    return max(1, min(4096, 10 * len(ids) + sum(ids) % 7))
