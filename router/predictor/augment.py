"""PreServe's imbalance handling (spec §4.3), on the training split only: oversample thin length buckets with
synonym-perturbed copies.

    1. N evenly spaced buckets by output length over [0, upper] (default upper = the empirical P99; lengths
       above it fall in the last bucket);
    2. S = the largest bucket's count;
    3. every bucket under mu * S is filled to ceil(mu * S) by copies of its own samples, each copy with about
       15% of its words replaced by synonyms and its label kept.

Deviation from the spec (documented cap): a bucket's copies are capped at `max_copies` per original sample, so
a bucket of 3 samples far out in the tail is not copied hundreds of times (the spec has no cap: it would make
the model memorise three prompts). Such a bucket ends with count * (1 + max_copies) samples, below mu * S.
Copies are drawn in shuffled passes over the bucket (every original once per pass), i.e. with replacement but
evenly, so no original exceeds the cap before another is used.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from switchyard.router.predictor.data import MAX_OUTPUT_TOKENS, LengthSample
from switchyard.router.predictor.synonyms import SynonymSource, load_synonyms, perturb


@dataclass(frozen=True, slots=True)
class AugmentConfig:
    num_buckets: int = 20  # N, evenly spaced
    upper: float | None = None  # bucket range [0, upper]; None = the empirical P99 of the labels
    mu: float = 0.25  # fill target as a fraction of the largest bucket
    max_copies: int = 8  # cap: at most this many perturbed copies of one original (a deviation, see above)
    frac: float = 0.15  # fraction of words replaced per copy
    seed: int = 0


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]), numpy's default method, without numpy."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bucket_edges(labels: Sequence[int], num_buckets: int, upper: float | None = None) -> list[float]:
    """num_buckets + 1 evenly spaced edges over [0, upper] (upper defaults to the P99, within [1, 4096])."""
    top = percentile(labels, 99) if upper is None else upper
    top = min(float(MAX_OUTPUT_TOKENS), max(1.0, top))
    return [top * i / num_buckets for i in range(num_buckets + 1)]


def bucket_of(label: float, edges: Sequence[float]) -> int:
    """Index of [edges[i], edges[i+1]); the last bucket also holds everything above the range."""
    n = len(edges) - 1
    return min(n - 1, max(0, int(label * n / edges[-1])))


def bucket_counts(samples: Sequence[LengthSample], edges: Sequence[float]) -> list[int]:
    counts = [0] * (len(edges) - 1)
    for s in samples:
        counts[bucket_of(s.output_tokens, edges)] += 1
    return counts


def augment(
    samples: Sequence[LengthSample],
    config: AugmentConfig = AugmentConfig(),
    source: SynonymSource | None = None,
) -> list[LengthSample]:
    """The originals followed by the perturbed copies (conv_id "<id>+aug<k>", same label and prompt_tokens)."""
    if not samples:
        return []
    rng = random.Random(config.seed)
    source = source or load_synonyms()
    edges = bucket_edges([s.output_tokens for s in samples], config.num_buckets, config.upper)
    buckets: list[list[LengthSample]] = [[] for _ in range(config.num_buckets)]
    for s in samples:
        buckets[bucket_of(s.output_tokens, edges)].append(s)
    target = math.ceil(config.mu * max(len(b) for b in buckets))
    out = list(samples)
    for members in buckets:
        if not members or len(members) >= target:
            continue
        need = min(target - len(members), config.max_copies * len(members))
        made = 0
        while made < need:
            order = members[:]
            rng.shuffle(order)  # one pass: every original once before any is used again
            for s in order[: need - made]:
                made += 1
                prompt = perturb(s.prompt, config.frac, rng, source)
                out.append(replace(s, conv_id=f"{s.conv_id}+aug{made}", prompt=prompt))
    return out
