"""Preble E2's time regressions PREFILLTIME and DECODETIME (specs/preble.md §5.2, §9), in seconds.

Two sources, chosen per worker by `preble_e2` from the worker's `WorkerInfo.perf_profile`:

- `ProfileCost`: a named `PerfProfile` (simulated workers; also the fallback for an unknown profile name).
  PREFILLTIME(e, c) = iteration_time_s(P=e, A=pairs(e, c), D=0, C=0): one request prefilling e uncached tokens
  after c cached ones, alone in a batch (§9.2: "PREFILLTIME used by the global scheduler = the above with one
  request"). DECODETIME(n, c) = n × iteration_time_s(0, 0, D=1, C=c): n tokens of one request decoding at
  context c, the paper's single-request regression, linear in context (§2.1, Fig. 2). `decode_marginal_s` is
  the batched alternative [inferred]: what n decode tokens add to iterations that run anyway (one more decoding
  sequence: iteration(D=2, C=2c) − iteration(D=1, C=c)); with continuous batching that is the GPU work a decode
  really costs, ~1-2% of the single-request figure, whose per-iteration step every decoding request shares.
- `OnlineFit`: real vLLM workers (perf_profile == "") have no profile, so both regressions are fitted online
  by running least squares (sums only, O(1) per sample) to what the router observes:
  TTFT_s ≈ a + b·e (e = uncached prompt tokens at dispatch) and TPOT_s ≈ c0 + d·ctx (ctx = prompt +
  half the output). Until `min_samples` samples arrive, or when every sample has the same x (singular), the
  fallback profile answers. NOTE: TTFT includes the worker's queueing, so the prefill fit is biased upward
  under load; it still ranks workers by observed responsiveness, which is what LOADCOST compares.
  `decay` < 1 is an exponential forgetting factor on the sums (1.0 = plain least squares).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Protocol

from switchyard.workers.engine.perf_model import PerfProfile
from switchyard.workers.engine.profiles import DEFAULT_PROFILE, PROFILES, get_profile


class CostModel(Protocol):
    def prefill_s(self, missed_tokens: int, cached_tokens: int) -> float: ...
    def decode_s(self, num_tokens: float, context_tokens: float) -> float: ...
    def decode_marginal_s(self, num_tokens: float, context_tokens: float) -> float: ...


@dataclass(frozen=True, slots=True)
class ProfileCost:
    """PREFILLTIME / DECODETIME from a fitted iteration-time profile (single-request batches).

    NOTE: E2 prices these for every candidate worker of every select and at every change of a worker's history
    window, with arguments that rarely repeat, so they are `PerfProfile.iteration_time_ms` written out for the
    batches they price (a prefill-only batch; D decode sequences at context C) over the profile's constants,
    in that method's own order of operations: bit for bit the same floats, without its calls. `ext/e2_select`'s
    Cython build prices `prefill_s` from `terms` in C by the same formula: a change to it goes there too
    (`tests/ext/test_e2_select.py` compares them).
    """

    profile: PerfProfile
    # (step_ms, per_decode_ms, decode_ctx_ms_per_ktok, prefill_ms, lin_ms_per_tok, knee_tokens, attn_pair_ratio)
    terms: tuple[float, float, float, float, float, int, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        c = self.profile.coeffs
        k = (c.step_ms, c.per_decode_ms, c.decode_ctx_ms_per_ktok, c.prefill_ms, c.lin_ms_per_tok, c.knee_tokens,
             self.profile.model.attn_pair_ratio)
        object.__setattr__(self, "terms", k)

    def prefill_s(self, missed_tokens: int, cached_tokens: int) -> float:
        """`profile.iteration_time_s(e, pairs_for_prompt(e, c), 0, 0)`, e = max(0, missed), c = max(0, cached)."""
        e = missed_tokens if missed_tokens > 0 else 0
        c = cached_tokens if cached_tokens > 0 else 0
        step, per_dec, ctx_ms, prefill_ms, lin, knee, ratio = self.terms
        t = step + per_dec * 0 + ctx_ms * 0 / 1000.0 + lin * (max(0, e + 0 - knee) + ratio * (e * c + e * (e + 1) // 2))
        if e:
            t += prefill_ms
        return 0.001 * t

    def decode_iteration_s(self, num_decode_reqs: int, context_tokens: int) -> float:
        """`profile.iteration_time_s(0, 0, D, C)`: one iteration of D decoding sequences holding C context tokens."""
        step, per_dec, ctx_ms, _, lin, knee, ratio = self.terms
        d = num_decode_reqs
        return 0.001 * (step + per_dec * d + ctx_ms * context_tokens / 1000.0 + lin * (max(0, 0 + d - knee) + ratio * 0))

    def decode_s(self, num_tokens: float, context_tokens: float) -> float:
        """n × `decode_iteration_s(1, int(context))` (written out: the same float without the call)."""
        if num_tokens <= 0:
            return 0.0
        # iteration_time is linear in C, so one iteration at the mean context prices n tokens of growing context
        step, per_dec, ctx_ms, _, lin, knee, ratio = self.terms
        return num_tokens * (0.001 * (step + per_dec * 1 + ctx_ms * int(context_tokens) / 1000.0
                                      + lin * (max(0, 0 + 1 - knee) + ratio * 0)))

    def decode_marginal_s(self, num_tokens: float, context_tokens: float) -> float:
        """GPU time n decode tokens add to iterations that run anyway (continuous batching): the increment of one
        more decoding sequence, iteration(D=2, C=2c) − iteration(D=1, C=c), without the per-iteration step.

        NOTE: E2's L prices it per history piece, and the default policy's O/W clock (`iteration_s`): both
        `decode_iteration_s` calls are written out, operation for operation (the same floats; a test compares
        them). The default policy's per-worker terms price it in C (`ext/_profile_cost.pxi`)."""
        if num_tokens <= 0:
            return 0.0
        c = int(context_tokens)
        step, per_dec, ctx_ms, _, lin, knee, ratio = self.terms
        inc = (0.001 * (step + per_dec * 2 + ctx_ms * (2 * c) / 1000.0 + lin * (max(0, 0 + 2 - knee) + ratio * 0))
               - 0.001 * (step + per_dec * 1 + ctx_ms * c / 1000.0 + lin * (max(0, 0 + 1 - knee) + ratio * 0)))
        return num_tokens * (inc if inc > 0.0 else 0.0)


@cache
def profile_cost(name: str) -> ProfileCost:
    """The named profile's cost model; an unknown name falls back to the default profile."""
    return ProfileCost(get_profile(name if name in PROFILES else DEFAULT_PROFILE))


class _LinearFit:
    """y ≈ a + b·x by least squares over (optionally exponentially decayed) running sums."""

    __slots__ = ("n", "sx", "sy", "sxx", "sxy", "decay")

    def __init__(self, decay: float = 1.0) -> None:
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.decay = decay

    def add(self, x: float, y: float) -> None:
        k = self.decay
        self.n = self.n * k + 1.0
        self.sx = self.sx * k + x
        self.sy = self.sy * k + y
        self.sxx = self.sxx * k + x * x
        self.sxy = self.sxy * k + x * y

    def coeffs(self) -> tuple[float, float] | None:
        """(a, b), both clamped to >= 0; None while there are no samples."""
        if self.n <= 0:
            return None
        det = self.n * self.sxx - self.sx * self.sx
        if det <= 1e-9 * max(1.0, self.n * self.sxx):  # every x equal: the mean alone
            return max(0.0, self.sy / self.n), 0.0
        b = (self.n * self.sxy - self.sx * self.sy) / det
        a = (self.sy - b * self.sx) / self.n
        if b < 0:  # nonsense slope (noise, queueing): flat model at the mean
            return max(0.0, self.sy / self.n), 0.0
        return max(0.0, a), b


class OnlineFit:
    """Per-worker TTFT/TPOT fits for workers without a profile; `fallback` answers until both fits are ready."""

    def __init__(self, fallback: CostModel, min_samples: int = 8, decay: float = 1.0) -> None:
        self.fallback = fallback
        self.min_samples = min_samples
        self.prefill = _LinearFit(decay)
        self.decode = _LinearFit(decay)
        self.num_prefill_samples = 0
        self.num_decode_samples = 0

    def add_prefill(self, missed_tokens: int, ttft_s: float) -> None:
        self.prefill.add(float(missed_tokens), ttft_s)
        self.num_prefill_samples += 1

    def add_decode(self, context_tokens: float, tpot_s: float) -> None:
        self.decode.add(context_tokens, tpot_s)
        self.num_decode_samples += 1

    def prefill_s(self, missed_tokens: int, cached_tokens: int) -> float:
        ab = self.prefill.coeffs() if self.num_prefill_samples >= self.min_samples else None
        if ab is None:
            return self.fallback.prefill_s(missed_tokens, cached_tokens)
        return ab[0] + ab[1] * max(0, missed_tokens)

    def decode_s(self, num_tokens: float, context_tokens: float) -> float:
        cd = self.decode.coeffs() if self.num_decode_samples >= self.min_samples else None
        if cd is None:
            return self.fallback.decode_s(num_tokens, context_tokens)
        return max(0.0, num_tokens) * (cd[0] + cd[1] * context_tokens)

    def decode_marginal_s(self, num_tokens: float, context_tokens: float) -> float:
        """The context-dependent part of the TPOT fit (the intercept is the shared per-iteration step)."""
        cd = self.decode.coeffs() if self.num_decode_samples >= self.min_samples else None
        if cd is None:
            return self.fallback.decode_marginal_s(num_tokens, context_tokens)
        return max(0.0, num_tokens) * cd[1] * context_tokens
