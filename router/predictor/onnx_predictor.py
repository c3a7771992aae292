"""Serve an exported length predictor (contract B) with ONNX Runtime: text in, predicted output tokens out.

No torch on this path: the directory holds `model.onnx`, `tokenizer.json` (an HF fast tokenizer, read by the
`tokenizers` library) and `predictor.json`. One `predict` call is one batch, padded to its longest member; the
caller (`service.PredictorService`) does the batching and runs this off the event loop.
"""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"
REQUIRED_FILES = ("model.onnx", "tokenizer.json", "predictor.json")


class PredictorLoadError(RuntimeError):
    """The predictor directory is missing, incomplete or unreadable."""


def default_providers(available: Sequence[str]) -> list[str]:
    """CUDA first when this onnxruntime build has it, else CPU alone.

    NOTE: `get_available_providers()` lists what the build contains, not what can run (onnxruntime-gpu lists CUDA
    on a machine without it); the session falls back to CPU then, and `session.get_providers()` says the truth.
    """
    return [CUDA, CPU] if CUDA in available else [CPU]


def read_meta(model_dir: Path) -> dict[str, Any]:
    """Check the directory holds the three files and return predictor.json, validated."""
    if not model_dir.is_dir():
        raise PredictorLoadError(
            f"predictor directory {model_dir} does not exist (train and export one first)"
        )
    missing = [f for f in REQUIRED_FILES if not (model_dir / f).is_file()]
    if missing:
        raise PredictorLoadError(f"predictor directory {model_dir} lacks {', '.join(missing)}")
    try:
        meta = json.loads((model_dir / "predictor.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PredictorLoadError(f"{model_dir / 'predictor.json'}: {e}") from None
    if (
        not isinstance(meta, dict)
        or not isinstance(meta.get("max_input_tokens"), int)
        or meta["max_input_tokens"] < 2
    ):
        raise PredictorLoadError(f"{model_dir / 'predictor.json'}: needs an integer max_input_tokens >= 2")
    return meta


class OnnxLengthPredictor:
    """An exported predictor on one ONNX Runtime session. `predict` is thread-safe but meant for one thread."""

    def __init__(
        self, model_dir: str | Path, threads: int = 1, providers: Sequence[str] | None = None
    ) -> None:
        import onnxruntime as ort  # lazy: a fallback-only router never loads it
        from tokenizers import Tokenizer

        self.model_dir = Path(model_dir)
        self.meta: dict[str, Any] = read_meta(self.model_dir)
        self.name: str = str(self.meta.get("name") or self.model_dir.name)
        self.max_output_tokens = int(self.meta.get("max_output_tokens", 4096))

        try:
            self._tokenizer = Tokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise PredictorLoadError(f"{self.model_dir / 'tokenizer.json'}: {e}") from None
        self._tokenizer.enable_truncation(max_length=int(self.meta["max_input_tokens"]))
        pad = self._tokenizer.padding or {}
        self._pad_id = int(pad.get("pad_id", self._tokenizer.token_to_id(pad.get("pad_token", "[PAD]")) or 0))
        self._tokenizer.no_padding()  # padded here, per batch (see predict)

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        # NOTE: idle pool threads must not spin: they share the cores with the router's event loop.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        requested = list(providers) if providers else default_providers(ort.get_available_providers())
        if CUDA in requested:
            # A CUDA-less host logs an E and a W line while ORT falls back to CPU; we log the outcome ourselves.
            ort.set_default_logger_severity(4)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter(
                    "ignore", UserWarning
                )  # plain onnxruntime warns about unknown providers
                self._session = ort.InferenceSession(
                    str(self.model_dir / "model.onnx"), opts, providers=requested
                )
        except Exception as e:  # onnxruntime raises its own Fail/InvalidGraph types
            raise PredictorLoadError(f"{self.model_dir / 'model.onnx'}: {e}") from None
        finally:
            if CUDA in requested:
                ort.set_default_logger_severity(2)  # ORT's default (warnings)
        self.providers: list[str] = list(self._session.get_providers())
        if requested[0] not in self.providers:
            log.warning("predictor %s: asked for %s, running on %s", self.name, requested, self.providers)

        self._inputs = [i.name for i in self._session.get_inputs()]
        unknown = set(self._inputs) - {"input_ids", "attention_mask", "token_type_ids"}
        if unknown:
            raise PredictorLoadError(f"{self.model_dir / 'model.onnx'}: unexpected inputs {sorted(unknown)}")
        outputs = [o.name for o in self._session.get_outputs()]
        self._output = "length" if "length" in outputs else outputs[0]

    def predict(self, texts: Sequence[str]) -> np.ndarray:
        """Predicted output tokens per text: int64 [len(texts)], each in [1, max_output_tokens]."""
        if not texts:
            return np.zeros(0, dtype=np.int64)
        # NOTE: one `encode` per text, not `encode_batch`: that one fans out over a rayon pool of every core,
        # which a router must not do behind its event loop's back. Right padding to the batch's longest.
        rows = [self._tokenizer.encode(t).ids for t in texts]
        ids = np.full((len(rows), max(1, *map(len, rows))), self._pad_id, dtype=np.int64)
        mask = np.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        feed = {
            "input_ids": ids,
            "attention_mask": mask,
            "token_type_ids": np.zeros_like(ids),
        }
        (length,) = self._session.run([self._output], {k: feed[k] for k in self._inputs})
        out = np.rint(np.asarray(length, dtype=np.float64).reshape(len(texts)))
        return np.clip(np.nan_to_num(out, nan=1.0), 1, self.max_output_tokens).astype(np.int64)

    def describe(self) -> str:
        return f"{self.name} on {','.join(self.providers)}"
