"""MiniLM-L6-H384 (BERT) -> DistilBERT conversion: the converted model reproduces BertModel's hidden states."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from switchyard.router.predictor.convert import (  # noqa: E402
    bert_to_distilbert_state,
    load_bert_state,
    load_tokenizer,
    minilm_dir,
    pretrained_distilbert,
)

SENTENCES = [
    "Hello, world!",
    "Summarize the main ideas of Jeff Walker's Product Launch Formula into bullet points.",
    "def f(x):\n    return x ** 2  # a code prompt",
    "a",
]


@pytest.fixture(scope="module", autouse=True)
def _offline_one_thread():
    os.environ["HF_HUB_OFFLINE"] = "1"
    torch.set_num_threads(1)


def _batch(texts: list[str]):
    tok = load_tokenizer(64)
    rows = [e.ids for e in tok.encode_batch(texts)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return ids, mask


def test_converted_distilbert_matches_bert_hidden_states() -> None:
    bert = transformers.BertModel.from_pretrained(str(minilm_dir())).eval()
    distil = pretrained_distilbert().eval()
    assert isinstance(distil, transformers.DistilBertModel)
    cfg = distil.config
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.hidden_dim, cfg.vocab_size) == (384, 6, 12, 1536, 30522)
    ids, mask = _batch(SENTENCES)  # padded rows included
    with torch.no_grad():
        want = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        got = distil(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert (got - want)[real].abs().max().item() < 1e-5
    assert want[real].abs().mean().item() > 0.1  # not trivially equal (e.g. all zeros)


def test_token_type_row_is_folded_into_positions() -> None:
    bert = load_bert_state()
    state = bert_to_distilbert_state(bert)
    folded = state["embeddings.position_embeddings.weight"]
    want = bert["embeddings.position_embeddings.weight"] + bert["embeddings.token_type_embeddings.weight"][0]
    assert torch.equal(folded, want)
    assert not any("token_type" in k or "pooler" in k for k in state)


def test_layer_dropping_picks_blocks_in_order() -> None:
    bert = load_bert_state()
    model = pretrained_distilbert(layers=(0, 5))
    assert model.config.n_layers == 2
    q1 = model.transformer.layer[1].attention.q_lin.weight
    assert torch.equal(q1, bert["encoder.layer.5.attention.self.query.weight"])
    ln0 = model.transformer.layer[0].output_layer_norm.weight
    assert torch.equal(ln0, bert["encoder.layer.0.output.LayerNorm.weight"])


def test_tokenizer_is_lowercasing_wordpiece_with_cls_sep() -> None:
    tok = load_tokenizer(8)
    enc = tok.encode("Hello , WORLD !")
    assert enc.ids == [101, 7592, 1010, 2088, 999, 102]
    long = tok.encode("word " * 50)
    assert len(long.ids) == 8 and long.ids[0] == 101 and long.ids[-1] == 102  # head kept, [SEP] re-added
