"""PromptMemo: exact repeats answered from their own recent lengths; keys, window median, LRU bound."""

from __future__ import annotations

import pytest

from switchyard.router.predictor.memo import PromptMemo


def test_unseen_prompt_has_no_answer_then_its_observed_length() -> None:
    memo = PromptMemo()
    k = PromptMemo.key("m", [1, 2, 3])
    assert memo.lookup(k) is None
    memo.observe(k, 37)
    assert memo.lookup(k) == 37
    assert memo.lookup(PromptMemo.key("m", [1, 2, 4])) is None  # another prompt
    assert memo.lookup(PromptMemo.key("other-model", [1, 2, 3])) is None  # another model
    assert memo.lookup(PromptMemo.key("m", [1, 2, 3], adapter="sql-lora")) is None  # another adapter
    assert PromptMemo.key("m", [1, 2, 3]) == PromptMemo.key("m", (1, 2, 3))  # list or tuple, same key


def test_answer_is_the_low_median_of_the_last_window_lengths() -> None:
    memo = PromptMemo(window=3)
    k = PromptMemo.key("m", [5] * 40)
    for n in (10, 400, 12):
        memo.observe(k, n)
    assert memo.lookup(k) == 12  # one odd answer (400) does not move it
    memo.observe(k, 14)  # window: 400, 12, 14
    assert memo.lookup(k) == 14
    memo.observe(k, 20)
    memo.observe(k, 20)  # window: 14, 20, 20: the 400 has left
    assert memo.lookup(k) == 20
    memo.observe(k, 0)  # not a length: ignored
    assert memo.lookup(k) == 20


def test_least_recently_used_prompt_goes_first_when_full() -> None:
    memo = PromptMemo(max_entries=2)
    a, b, c = (PromptMemo.key("m", [i]) for i in (1, 2, 3))
    memo.observe(a, 1)
    memo.observe(b, 2)
    assert memo.lookup(a) == 1  # a is now the most recent
    memo.observe(c, 3)  # b is evicted
    assert len(memo) == 2
    assert memo.lookup(b) is None and memo.lookup(a) == 1 and memo.lookup(c) == 3


def test_bad_sizes_rejected() -> None:
    with pytest.raises(ValueError):
        PromptMemo(max_entries=0)
    with pytest.raises(ValueError):
        PromptMemo(window=0)
