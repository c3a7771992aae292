"""The PreServe RQ3 workload: ShareGPT prompts with their real output lengths, Poisson arrivals at a given rate
over a fixed stretch of virtual time (specs/preserve.md §8.5: 10 minutes).

Samples come from the held-out 30% test split (`router/predictor/data.py` `load_split`), so a trained predictor
never saw them. The engine is forced to generate exactly each sample's output length (the trace's length becomes
max_tokens and the simulated stop point: ignore_eos semantics); samples whose prompt + output exceed the
context limit are left out rather than truncated.

Prompt tokens are the real Mistral-7B tokenization of the prompt text (`workers/tokenizer.py`, BOS first, as the
split counts them), so prefix caching sees ShareGPT's real shared openings ("I want you to act as ...").
Arrivals are drawn at unit rate and divided by the rate, and samples are taken in seeded shuffled passes over the
split: one seed gives the same request sequence at every rate (a higher rate packs more of it into the same
duration). A sample reused in pass k > 0 gets a per-pass first token in place of BOS, a cache salt: a reuse of
the small split never hits the cache of its own earlier copy (the paper drew from ~90k conversations).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from switchyard.bench.traces import NS_UNIQUE, PromptFactory, Trace, TraceRequest
from switchyard.ext.blockhash import block_digests, event_hashes

log = logging.getLogger(__name__)

DEFAULT_DURATION_S = 600.0  # PreServe RQ3: "a fixed duration (e.g. 10 minutes)"
DEFAULT_MAX_MODEL_LEN = 4096  # LLaMA-2's context (the paper's models); also the 70B profile's limit
SALT_TOKEN_BASE = 2  # pass k > 0 starts with token id 2 + k instead of BOS (1)


class LengthSampleLike(Protocol):
    """The fields of `router.predictor.data.LengthSample` this workload reads."""

    @property
    def conv_id(self) -> str: ...
    @property
    def prompt(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ShareGPTWorkload:
    """A trace plus, per request, its ShareGPT sample, pass number and real prompt token ids."""

    trace: Trace
    samples: tuple[LengthSampleLike, ...]  # aligned with trace.requests
    keys: tuple[str, ...]  # aligned with trace.requests: the sample's key (see `sample_keys`)
    passes: tuple[int, ...]  # aligned with trace.requests: 0 = first use of its sample
    token_ids: dict[str, tuple[int, ...]]  # sample key -> prompt token ids (pass 0, BOS first)
    rate: float  # requested arrival rate, req/s
    duration_s: float
    seed: int
    num_eligible: int  # samples that fit the context limit

    def prompt_texts(self) -> dict[str, str]:
        """Sample key -> prompt text of every sample used (what an offline predictor runs on)."""
        return {k: s.prompt for k, s in zip(self.keys, self.samples, strict=True)}

    def per_request(self, by_key: Mapping[str, int]) -> dict[str, int]:
        """Expand a sample key -> value table to request id -> value."""
        return {r.request_id: int(by_key[k]) for r, k in zip(self.trace.requests, self.keys, strict=True)}


def load_test_samples(seed: int = 0) -> list[LengthSampleLike]:
    """The 30% test split of ShareGPT (contract A; cached by `load_split`)."""
    from switchyard.router.predictor.data import load_split

    return list(load_split(seed=seed)[1])


def eligible(samples: Sequence[LengthSampleLike], max_model_len: int) -> list[LengthSampleLike]:
    """Samples whose prompt + true output fit the context, in their given order."""
    return [s for s in samples if s.prompt_tokens >= 1 and s.prompt_tokens + s.output_tokens <= max_model_len]


def sample_keys(samples: Sequence[LengthSampleLike]) -> list[str]:
    """A unique key per sample: its conv_id, with `#n` added to the n-th repeat of an id."""
    seen: dict[str, int] = {}
    keys = []
    for s in samples:
        n = seen.get(s.conv_id, 0)
        seen[s.conv_id] = n + 1
        keys.append(s.conv_id if n == 0 else f"{s.conv_id}#{n}")
    return keys


def unit_arrivals(seed: int, horizon: float) -> np.ndarray:
    """Arrival times of a unit-rate Poisson process on [0, horizon): cumulative Exp(1) gaps, seeded."""
    rng = np.random.default_rng([seed, 1])
    parts: list[np.ndarray] = []
    t = 0.0
    while t < horizon:
        gaps = rng.exponential(1.0, max(64, int(horizon - t) + 64))
        cum = t + np.cumsum(gaps)
        parts.append(cum)
        t = float(cum[-1])
    u = np.concatenate(parts) if parts else np.zeros(0)
    return u[u < horizon]


def sample_order(seed: int, num_samples: int, num_requests: int) -> tuple[np.ndarray, np.ndarray]:
    """(sample index, pass) per request: seeded shuffled passes, so no sample repeats before all were used."""
    rng = np.random.default_rng([seed, 2])
    passes = -(-num_requests // num_samples) if num_samples else 0
    order = (
        np.concatenate([rng.permutation(num_samples) for _ in range(passes)]) if passes else np.zeros(0, int)
    )
    return order[:num_requests], np.arange(num_requests) // max(1, num_samples)


def make_sharegpt_workload(
    samples: Sequence[LengthSampleLike],
    rate: float,
    duration_s: float = DEFAULT_DURATION_S,
    seed: int = 0,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    tokenize: Callable[[str], list[int]] | None = None,
    token_ids: Mapping[str, tuple[int, ...]] | None = None,
) -> ShareGPTWorkload:
    """Poisson arrivals at `rate` req/s over `duration_s`, each request one sample with its true output length.

    `tokenize(text)` gives prompt ids with BOS (default: the Mistral tokenizer); `token_ids` (sample key -> ids)
    reuses an earlier workload's tokenization (the same samples at another rate).
    """
    if rate <= 0 or duration_s <= 0:
        raise ValueError(f"rate and duration must be > 0, got {rate}, {duration_s}")
    pool = eligible(samples, max_model_len)
    if not pool:
        raise ValueError(f"no sample fits max_model_len {max_model_len}")
    pool_keys = sample_keys(pool)
    arrivals = unit_arrivals(seed, rate * duration_s) / rate
    idx, passes = sample_order(seed, len(pool), len(arrivals))
    ids = dict(token_ids or {})
    if tokenize is None and any(pool_keys[i] not in ids for i in set(idx.tolist())):
        from switchyard.workers.tokenizer import load_tokenizer

        tokenize = load_tokenizer().encode
    mismatched = 0
    reqs: list[TraceRequest] = []
    chosen: list[LengthSampleLike] = []
    keys: list[str] = []
    for i, (t, j) in enumerate(zip(arrivals.tolist(), idx.tolist(), strict=True)):
        s, key = pool[j], pool_keys[j]
        toks = ids.get(key)
        if toks is None:
            assert tokenize is not None
            toks = ids[key] = tuple(tokenize(s.prompt))
            mismatched += len(toks) != s.prompt_tokens
        chosen.append(s)
        keys.append(key)
        reqs.append(
            TraceRequest(
                request_id=f"r{i}",
                arrival_s=t,
                num_prompt_tokens=len(toks),
                num_output_tokens=s.output_tokens,  # the engine generates exactly this many (target + max_tokens)
                segments=((NS_UNIQUE, i, len(toks)),),  # unused: TokenizedPrompts supplies the real ids
            )
        )
    if mismatched:
        log.warning("%d prompts tokenized to a length other than their sample's prompt_tokens", mismatched)
    trace = Trace(
        name="sharegpt",
        requests=tuple(reqs),
        source=f"ShareGPT test split, {len(pool)} samples <= {max_model_len} tokens, Poisson {rate:g} req/s, "
        f"{duration_s:g} s, seed {seed}",
        has_prefix_identity=True,
    )
    return ShareGPTWorkload(
        trace=trace,
        samples=tuple(chosen),
        keys=tuple(keys),
        passes=tuple(int(p) for p in passes.tolist()),
        token_ids={k: ids[k] for k in keys},
        rate=rate,
        duration_s=duration_s,
        seed=seed,
        num_eligible=len(pool),
    )


class TokenizedPrompts(PromptFactory):
    """Real prompt token ids (and their block hashes) for a ShareGPT workload's requests, in place of the
    synthetic segments. Works for any workload built from the same samples and seed (requests are keyed by id).
    """

    def __init__(self, workloads: Sequence[ShareGPTWorkload], block_size: int, **kw: object) -> None:
        super().__init__(block_size, **kw)  # type: ignore[arg-type]
        self._by_request: dict[str, tuple[str, int]] = {}
        self._ids: dict[str, tuple[int, ...]] = {}
        for w in workloads:
            self.add(w)
        self._hash_memo: dict[tuple[str, int], tuple[int, ...]] = {}

    def add(self, workload: ShareGPTWorkload) -> None:
        for r, key, k in zip(workload.trace.requests, workload.keys, workload.passes, strict=True):
            prev = self._by_request.get(r.request_id)
            if prev is not None and prev != (key, k):
                raise ValueError(
                    f"request {r.request_id} differs between workloads (another seed or sample set)"
                )
            self._by_request[r.request_id] = (key, k)
        self._ids.update(workload.token_ids)

    def tokens(self, req: TraceRequest) -> tuple[int, ...]:
        key, k = self._by_request[req.request_id]
        ids = self._ids[key]
        return (SALT_TOKEN_BASE + k, *ids[1:]) if k else ids

    def block_hashes(self, req: TraceRequest, tokens: Sequence[int] | None = None) -> tuple[int, ...]:
        key = self._by_request[req.request_id]
        hit = self._hash_memo.get(key)
        if hit is None:
            toks = tokens if tokens is not None else self.tokens(req)
            digs = block_digests(
                toks, self.block_size, self.hash_algo, parent=self._none_digest, start_block=0
            )
            hit = self._hash_memo[key] = tuple(event_hashes(digs))
        return hit
