"""Export a trained LengthRegressor to an ONNX predictor directory (contract B), fp32 and optionally int8.

`switchyard predictor export --checkpoint <name>-teacher.pt [--int8]` re-exports a saved torch checkpoint;
`switchyard predictor train` calls `export_predictor` for fp32 and int8 of the teacher and the student.

    <dir>/model.onnx      (input_ids, attention_mask) int64 [batch, seq] -> "length" float32 [batch]
    <dir>/tokenizer.json  MiniLM's WordPiece tokenizer, truncation to max_input_tokens built in
    <dir>/predictor.json  name, kind, quantized, max_input_tokens, max_output_tokens, num_prompt_tokens, layers,
                          dim, train {...}, export {ORT vs torch check}, created

Legacy exporter (dynamo=False, opset 17): it needs no onnxscript and keeps dynamic batch/seq axes. The trace
uses a batch with a padded row so the attention-mask path is in the graph (transformers drops the mask for
an all-ones mask in eager mode, but never while tracing). int8 is ONNX Runtime's dynamic quantization
(QInt8 weights, per output channel; activations quantized per batch at run time): ~4x smaller, ~2x faster on
CPU. Per-channel, measured on 400 test prompts: mean |int8 - fp32| 4.9 tokens for the student (14.9 per
tensor), 11.5 for the teacher (24.5), at the same speed and the same MAE within noise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from switchyard.router.predictor.paths import predictors_dir

PROMPT_INITIALIZER = "prompt_tuning_embeddings"
CHECK_TEXTS = (
    "Write a haiku about the sea.",
    "Explain in detail how a transformer neural network works, with examples and code in Python.",
    "hi",
    "Translate to French: I would like a coffee, please.",
)


def encode_texts(tokenizer, texts: Sequence[str], max_input_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """[CLS] text [SEP], head-truncated to max_input_tokens, right padded with 0: (input_ids, attention_mask)."""
    rows = [e.ids[:max_input_tokens] for e in tokenizer.encode_batch(list(texts))]
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
        mask[i, : len(r)] = 1
    return ids, mask


def _ort_session(path: Path):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def export_onnx(model, path: Path, max_input_tokens: int) -> None:
    """torch.onnx.export of model.forward(input_ids, attention_mask) -> length, dynamic batch and seq."""
    import torch

    from switchyard.router.predictor.convert import load_tokenizer

    ids, mask = encode_texts(load_tokenizer(max_input_tokens), CHECK_TEXTS[:2], max_input_tokens)
    model = model.eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TracerWarnings from transformers' shape checks, expected here
        torch.onnx.export(
            model,
            (torch.from_numpy(ids), torch.from_numpy(mask)),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids", "attention_mask"],
            output_names=["length"],
            dynamic_axes={
                "input_ids": {0: "batch", 1: "seq"},
                "attention_mask": {0: "batch", 1: "seq"},
                "length": {0: "batch"},
            },
        )


def name_prompt_initializer(path: Path, prompts: np.ndarray) -> None:
    """Give the prompt-tuning matrix a findable name in the graph (the exporter folds the parameter into an
    anonymous constant such as `onnx::Expand_323`)."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(str(path))
    graph = model.graph
    for init in graph.initializer:
        if init.dims and int(np.prod(init.dims)) == prompts.size:
            value = numpy_helper.to_array(init)
            if np.array_equal(value.reshape(prompts.shape), prompts):
                old = init.name
                init.name = PROMPT_INITIALIZER
                for node in graph.node:
                    node.input[:] = [PROMPT_INITIALIZER if x == old else x for x in node.input]
                onnx.save(model, str(path))
                return
    raise RuntimeError(f"prompt-tuning embeddings not found among the initializers of {path}")


def quantize_int8(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # it logs a "consider pre-processing" hint on the root logger every time
    try:
        quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=True)
    finally:
        root.setLevel(level)


def check_against_torch(
    model, onnx_path: Path, max_input_tokens: int, texts: Sequence[str] = CHECK_TEXTS
) -> dict:
    """ORT vs torch on a padded batch and on each text alone (batch 1): max |diff| in tokens."""
    import torch

    from switchyard.router.predictor.convert import load_tokenizer

    tok = load_tokenizer(max_input_tokens)
    sess = _ort_session(onnx_path)
    ids, mask = encode_texts(tok, texts, max_input_tokens)
    with torch.no_grad():
        ref = model.eval()(torch.from_numpy(ids), torch.from_numpy(mask)).numpy()
    got = sess.run(["length"], {"input_ids": ids, "attention_mask": mask})[0]
    single = np.concatenate(
        [
            sess.run(
                ["length"],
                dict(
                    zip(
                        ("input_ids", "attention_mask"), encode_texts(tok, [t], max_input_tokens), strict=True
                    )
                ),
            )[0]
            for t in texts
        ]
    )
    return {
        "max_abs_diff_tokens": float(np.max(np.abs(got - ref))),
        "max_abs_diff_padding_tokens": float(np.max(np.abs(single - got))),
        "torch": [round(float(x), 2) for x in ref],
        "onnx": [round(float(x), 2) for x in got],
    }


def export_predictor(
    model,  # noqa: ANN001 - a LengthRegressor
    out_dir: Path,
    *,
    name: str,
    kind: str,
    max_input_tokens: int,
    quantize: bool = False,
    train_info: dict | None = None,
    fp32_tolerance: float = 0.5,
) -> Path:
    """Write one predictor directory; raise if the fp32 graph disagrees with torch by more than
    `fp32_tolerance` tokens (int8 differences are recorded, not enforced)."""
    from switchyard.router.predictor.convert import load_tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = Path(tmp) / "model.onnx"
        export_onnx(model, fp32, max_input_tokens)
        name_prompt_initializer(fp32, model.prompts.detach().numpy())
        if quantize:
            quantize_int8(fp32, out_dir / "model.onnx")
        else:
            shutil.move(str(fp32), out_dir / "model.onnx")
    check = check_against_torch(model, out_dir / "model.onnx", max_input_tokens)
    if not quantize and check["max_abs_diff_tokens"] > fp32_tolerance:
        raise RuntimeError(f"ONNX export of {name} disagrees with torch: {check}")
    tok = load_tokenizer(max_input_tokens)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = model.config
    meta = {
        "name": name,
        "kind": kind,
        "quantized": quantize,
        "max_input_tokens": max_input_tokens,
        "max_output_tokens": cfg.max_output_tokens,
        "num_prompt_tokens": cfg.num_prompt_tokens,
        "layers": cfg.n_layers,
        "dim": int(model.encoder.config.dim),
        "train": train_info or {},
        "model": cfg.to_json(),
        "export": {
            **check,
            "seconds": round(time.perf_counter() - start, 2),
            "onnx_bytes": (out_dir / "model.onnx").stat().st_size,
        },
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    (out_dir / "predictor.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out_dir


def save_checkpoint(model, path: Path, *, kind: str, max_input_tokens: int, train_info: dict) -> None:
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": model.config.to_json(),
        "state_dict": model.state_dict(),
        "kind": kind,
        "max_input_tokens": max_input_tokens,
        "train": train_info,
    }
    torch.save(payload, path)


def load_checkpoint(path: Path):
    """(LengthRegressor, payload) from save_checkpoint's file."""
    import torch

    from switchyard.router.predictor.model import LengthRegressor, RegressorConfig

    payload = torch.load(path, map_location="cpu", weights_only=False)
    model = LengthRegressor(RegressorConfig.from_json(payload["config"]), pretrained=False)
    model.load_state_dict(payload["state_dict"])
    return model.eval(), payload


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard predictor export", description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a .pt file written by `predictor train`")
    ap.add_argument(
        "--output", default=None, help="predictor directory (default: beside the checkpoint, named after it)"
    )
    ap.add_argument("--int8", action="store_true", help="dynamic int8 quantization (QInt8 weights)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    ckpt = Path(args.checkpoint)
    if not ckpt.exists() and not ckpt.suffix:
        ckpt = predictors_dir() / f"{args.checkpoint}.pt"
    model, payload = load_checkpoint(ckpt)
    name = ckpt.stem + ("-int8" if args.int8 else "")
    out = Path(args.output) if args.output else ckpt.parent / name
    export_predictor(
        model,
        out,
        name=out.name,
        kind=payload["kind"],
        max_input_tokens=payload["max_input_tokens"],
        quantize=args.int8,
        train_info=payload["train"],
    )
    meta = json.loads((out / "predictor.json").read_text())
    print(
        f"wrote {out} ({meta['export']['onnx_bytes'] / 1e6:.1f} MB; ORT vs torch max |diff| {meta['export']['max_abs_diff_tokens']:.3g} tokens)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
