"""Exact-repeat memory of output lengths: a prompt the router has seen finish is answered from its own history.

Repeats are common in service (templated prompts, greetings, retries, probes), and one prompt's answers vary far
less than a model's error: on ShareGPT's first turns, 532 prompts recur (1,372 samples, e.g. "hi" 66 times); the
median of a prompt's other answers misses by 18.5 tokens on average (leave-one-out), while the trained student's MAE
over the test split is 158. 8.5% of the test split's prompts occur in the training split (`switchyard predictor
eval`). So an exact repeat is answered from the memo, before (and instead of) the model.

Keyed by (model, LoRA adapter, prompt token ids): the ids are what the engine sees, so a repeat is exact. Learns only
from natural finishes: a request cut at `max_tokens` says nothing about the answer's length. The answer is the
median of the last `window` lengths (robust to one odd sample, and it follows drift). A bounded LRU. Pure; no clock,
no I/O; not thread-safe (the event loop owns it, as the fallback).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from statistics import median_low

PromptKey = tuple[str, str, int, int]  # (model, adapter, prompt length, hash of the token ids)


class PromptMemo:
    """(model, adapter, prompt) -> the last `window` observed output lengths; `lookup` answers their median."""

    def __init__(self, max_entries: int = 100_000, window: int = 8) -> None:
        if max_entries < 1 or window < 1:
            raise ValueError("max_entries and window must be >= 1")
        self.max_entries = max_entries
        self.window = window
        self._lengths: OrderedDict[PromptKey, deque[int]] = OrderedDict()

    @staticmethod
    def key(model: str, token_ids: Sequence[int], adapter: str = "") -> PromptKey:
        """The prompt's key. Python's hash of a tuple of ints is deterministic (no per-process salt) and 64-bit;
        the length rides along, so a collision needs equal lengths too. O(prompt): ~1.6 µs per 500 tokens."""
        ids = token_ids if isinstance(token_ids, tuple) else tuple(token_ids)
        return (model, adapter, len(ids), hash(ids))

    def __len__(self) -> int:
        return len(self._lengths)

    def lookup(self, key: PromptKey) -> int | None:
        """The median (low) of the prompt's recent lengths, or None when it was never seen finish."""
        seen = self._lengths.get(key)
        if seen is None:
            return None
        self._lengths.move_to_end(key)
        return median_low(seen)

    def observe(self, key: PromptKey, output_tokens: int) -> None:
        """Record a natural finish (not one cut at max_tokens) of `output_tokens` tokens."""
        if output_tokens <= 0:
            return
        seen = self._lengths.get(key)
        if seen is None:
            seen = self._lengths[key] = deque(maxlen=self.window)
            if len(self._lengths) > self.max_entries:
                self._lengths.popitem(last=False)
        else:
            self._lengths.move_to_end(key)
        seen.append(output_tokens)
