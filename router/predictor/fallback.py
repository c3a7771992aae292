"""The predictor of last resort: a running mean of observed output lengths per (model, prompt-length bucket).

Used when no trained model is configured or the model misses its deadline, so routing never waits. Buckets are
powers of two of the prompt length; an empty or thin bucket borrows (part of) the model's overall mean, and an
unseen model the prior. The mean is exponentially weighted (half-life in observations), so it follows a drifting workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(slots=True)
class _Mean:
    value: float
    weight: float


class LengthFallback:
    """Predict and learn output lengths from (model, prompt tokens) alone. Pure; no clock, no I/O."""

    def __init__(self, prior: float = 256.0, half_life: float = 500.0, min_weight: float = 3.0) -> None:
        if prior <= 0 or half_life <= 0:
            raise ValueError("prior and half_life must be positive")
        self.prior = prior
        self._decay = 0.5 ** (1.0 / half_life)
        self._min_weight = min_weight
        self._buckets: dict[tuple[str, int], _Mean] = {}
        self._models: dict[str, _Mean] = {}

    @staticmethod
    def bucket(prompt_tokens: int) -> int:
        """log2 bucket: 0 for < 2 tokens, k for [2^k, 2^(k+1))."""
        return max(0, int(math.log2(max(1, prompt_tokens))))

    def predict(self, model: str, prompt_tokens: int) -> int:
        overall = self._models.get(model)
        base = overall.value if overall is not None and overall.weight >= self._min_weight else self.prior
        b = self._buckets.get((model, self.bucket(prompt_tokens)))
        if b is None or b.weight <= 0:
            return max(1, round(base))
        # A thin bucket (weight below min_weight) is blended with the model mean in proportion to its weight.
        share = min(1.0, b.weight / self._min_weight)
        return max(1, round(share * b.value + (1.0 - share) * base))

    def observe(self, model: str, prompt_tokens: int, output_tokens: int) -> None:
        if output_tokens <= 0:
            return
        self._update(self._models, model, output_tokens)
        self._update(self._buckets, (model, self.bucket(prompt_tokens)), output_tokens)

    def _update(self, table: dict, key: object, x: float) -> None:
        m = table.get(key)
        if m is None:
            table[key] = _Mean(float(x), 1.0)
            return
        m.weight = m.weight * self._decay + 1.0
        m.value += (x - m.value) / m.weight
