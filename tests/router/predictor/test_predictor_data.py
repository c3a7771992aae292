"""ShareGPT parsing (truncated file), length counting, and the seeded 7:3 split by conversation (contract A)."""

from __future__ import annotations

import json

import pytest

from switchyard.router.predictor import data
from switchyard.router.predictor.data import (
    LengthSample,
    conversation_group,
    conversation_pairs,
    iter_conversations,
    load_sharegpt,
    load_split,
    split_samples,
)
from switchyard.workers.tokenizer import load_tokenizer


def _conv(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_iter_conversations_stops_at_the_truncated_element() -> None:
    good = [_conv("a_0", ("human", "hi")), _conv("b_0", ("human", "yo"))]
    text = json.dumps(good, indent=2)
    # cut in the middle of a third element, as the packaged 125 MB file is cut
    truncated = text[:-2] + ',\n  {"id": "c_0", "conversations": [{"from": "hum'
    assert [c["id"] for c in iter_conversations(truncated)] == ["a_0", "b_0"]
    assert [c["id"] for c in iter_conversations(text)] == ["a_0", "b_0"]


def test_conversation_pairs_first_and_all() -> None:
    conv = _conv("x", ("human", "q1"), ("gpt", "a1"), ("human", "q2"), ("gpt", "a2"), ("human", "q3"))
    assert conversation_pairs(conv, "first") == [("q1", "a1")]
    assert conversation_pairs(conv, "all") == [("q1", "a1"), ("q2", "a2")]
    # a record opening with the assistant has no first-turn pair but still has later pairs
    late = _conv("y", ("gpt", "hello"), ("human", "q"), ("gpt", "a"))
    assert conversation_pairs(late, "first") == []
    assert conversation_pairs(late, "all") == [("q", "a")]
    with pytest.raises(ValueError):
        conversation_pairs(conv, "second")


def test_load_sharegpt_counts_mistral_tokens_and_clamps() -> None:
    tok = load_tokenizer()
    long_reply = "word " * 6000  # > 4096 tokens
    convs = [
        _conv("a_0", ("human", "Write a poem about the sea."), ("gpt", "The sea is wide.")),
        _conv("b_0", ("human", "   "), ("gpt", "skipped: empty prompt")),
        _conv("c_0", ("human", "Say nothing."), ("gpt", "")),
        _conv("d_0", ("human", "Go on forever."), ("gpt", long_reply)),
    ]
    got = load_sharegpt("first", text=json.dumps(convs))
    assert [s.conv_id for s in got] == ["a_0", "c_0", "d_0"]
    a = got[0]
    assert a.prompt == "Write a poem about the sea."
    assert (
        a.prompt_tokens == len(tok.encode(a.prompt)) == len(tok.encode(a.prompt, add_bos=False)) + 1
    )  # with BOS
    assert a.output_tokens == len(tok.encode("The sea is wide.", add_bos=False))
    assert got[1].output_tokens == 1  # empty reply: clamped up to 1
    assert got[2].output_tokens == 4096  # clamped down
    assert load_sharegpt("first", limit=2, text=json.dumps(convs)) == got[:2]


def test_load_sharegpt_reads_the_packaged_truncated_file() -> None:
    got = load_sharegpt("first", limit=40)
    assert len(got) == 40
    assert all(1 <= s.output_tokens <= 4096 and s.prompt_tokens >= 2 and s.prompt.strip() for s in got)
    assert len({s.conv_id for s in got}) == 40


def _samples(groups: int, parts: int = 2) -> list[LengthSample]:
    return [
        LengthSample(f"conv{g}_{p}", f"prompt {g} {p}", 5, 10 + g)
        for g in range(groups)
        for p in range(parts)
    ]


def test_split_is_seeded_disjoint_by_conversation_and_7_to_3() -> None:
    samples = _samples(200)
    train, test = split_samples(samples, seed=0, test_frac=0.3)
    assert len(train) + len(test) == len(samples)
    train_groups = {conversation_group(s.conv_id) for s in train}
    test_groups = {conversation_group(s.conv_id) for s in test}
    assert not train_groups & test_groups  # "convX_0" and "convX_1" always land on the same side
    assert len(test_groups) == 60  # round(0.3 * 200)
    again = split_samples(samples, seed=0, test_frac=0.3)
    assert again == (train, test)
    other = split_samples(samples, seed=1, test_frac=0.3)
    assert {s.conv_id for s in other[1]} != {s.conv_id for s in test}


def test_conversation_group_strips_only_a_numeric_part_suffix() -> None:
    assert conversation_group("QWJhYvA_0") == "QWJhYvA"
    assert conversation_group("QWJhYvA_12") == "QWJhYvA"
    assert conversation_group("plain") == "plain"
    assert conversation_group("a_b") == "a_b"


def test_load_split_caches_and_rebuilds_on_other_parameters(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SWITCHYARD_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_load(turns: str = "first", limit=None, text=None):
        calls.append(turns)
        return _samples(50)

    monkeypatch.setattr(data, "load_sharegpt", fake_load)
    first = load_split(seed=3)
    assert (tmp_path / "predictor" / "split-first-seed3.jsonl.gz").exists()
    assert load_split(seed=3) == first  # from the cache
    assert calls == ["first"]
    rebuilt = load_split(seed=3, test_frac=0.5)  # a different split in the same file name: rebuilt
    assert calls == ["first", "first"]
    assert len(rebuilt[1]) > len(first[1])
    assert load_split(seed=3, test_frac=0.5, refresh=True) == rebuilt
    assert calls == ["first", "first", "first"]
