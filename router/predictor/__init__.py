"""Output-length prediction: how many tokens a request will decode, before it runs.

Serving (no torch): `onnx_predictor` (ONNX Runtime session + HF fast tokenizer), `fallback` (running mean per
model and prompt-length bucket), `service` (off-loop micro-batching with a deadline, falling back). Training
(the `train` extra): `data`, `synonyms`, `augment`, `convert`, `model`, `train`, `export`, `evaluate`.
"""
