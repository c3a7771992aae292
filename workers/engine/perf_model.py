"""Iteration time of one engine step as a function of its batch, and the least-squares fit that derives a
profile's coefficients from measured tables (`shared/data`, README sections 5 and 6).

Model (milliseconds; P = prefill tokens, A = prefill query-key pairs sum n*(c + (n+1)/2), D = decode requests,
C = sum of decode context tokens):

    t = step_ms                                   every iteration (scheduling, sampling, launch overheads)
      + prefill_ms * [P > 0]                      extra fixed cost of an iteration holding prompt tokens
      + per_decode_ms * D                         per-sequence decode cost (KV gather, sampling)
      + decode_ctx_ms_per_ktok * C / 1000         decode attention: reading C cached tokens (memory bound)
      + lin_ms_per_tok * (max(0, P + D - knee_tokens) + attn_pair_ratio * A)
                                                  GEMMs once compute bound (below the knee the weight reads
                                                  dominate and are already in step_ms), plus prefill
                                                  attention at the same efficiency as the GEMMs
    t *= mixed_batch_factor when P > 0 and D > 0  (1.0: no table measures mixed batches; Splitwise uses 1.1)

attn_pair_ratio is first principles, not fitted: attention FLOPs per query-key pair over linear FLOPs per
token = (4 * layers * q_heads * head_dim) / (2 * params). The tables stop at 8k-token prompts, so beyond them
the quadratic prefill term is an EXTRAPOLATION (it dominates from ~30k tokens for an 8B model). The decode
context term is fitted where the tables vary context, but never below the bandwidth floor
(KV bytes per token / aggregate HBM bandwidth), which also serves as the EXTRAPOLATION where they do not.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Architecture numbers the capacity and first-principles terms need."""

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_params: float
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes  # K and V

    @property
    def attn_pair_ratio(self) -> float:
        """Linear-token equivalents of one attention query-key pair (QK^T and PV: 4 flops per head dim)."""
        return (4 * self.num_layers * self.num_q_heads * self.head_dim) / (2 * self.num_params)


@dataclass(frozen=True, slots=True)
class PerfCoeffs:
    step_ms: float
    prefill_ms: float
    per_decode_ms: float
    decode_ctx_ms_per_ktok: float
    lin_ms_per_tok: float
    knee_tokens: int


@dataclass(frozen=True)
class PerfProfile:
    """A model on a GPU setup: limits, KV capacity and the fitted iteration-time model."""

    name: str
    description: str
    model: ModelSpec
    max_model_len: int
    kv_capacity_tokens: int  # KV slots over all GPUs of one replica
    coeffs: PerfCoeffs
    decode_ctx_floor_ms_per_ktok: float  # bandwidth bound, the lower limit of the fitted decode-context term
    mixed_batch_factor: float = 1.0
    tables: tuple[str, ...] = ()  # keys of the tables it is fitted to (profiles.TABLE_LOADERS)
    notes: str = ""  # excluded rows and why

    def num_kv_blocks(self, block_size: int) -> int:
        """Blocks for the engine, vLLM's null block included."""
        return self.kv_capacity_tokens // block_size + 1

    def iteration_time_ms(
        self,
        num_prefill_tokens: int,
        prefill_attn_pairs: int,
        num_decode_reqs: int,
        decode_context_tokens: int,
    ) -> float:
        c = self.coeffs
        t = (
            c.step_ms
            + c.per_decode_ms * num_decode_reqs
            + c.decode_ctx_ms_per_ktok * decode_context_tokens / 1000.0
            + c.lin_ms_per_tok
            * (
                max(0, num_prefill_tokens + num_decode_reqs - c.knee_tokens)
                + self.model.attn_pair_ratio * prefill_attn_pairs
            )
        )
        if num_prefill_tokens:
            t += c.prefill_ms
            if num_decode_reqs:
                t *= self.mixed_batch_factor
        return t

    def iteration_time_s(
        self,
        num_prefill_tokens: int,
        prefill_attn_pairs: int,
        num_decode_reqs: int,
        decode_context_tokens: int,
    ) -> float:
        return 0.001 * self.iteration_time_ms(
            num_prefill_tokens, prefill_attn_pairs, num_decode_reqs, decode_context_tokens
        )

    def min_prefill_iteration_s(self) -> float:
        """The least an iteration that computes prompt tokens can take: step + prefill (the mixed-batch factor
        applied when below 1). A block is stored at the end of one, so no earlier than this after the arrival of
        the first request that holds it."""
        c = self.coeffs
        return 0.001 * (c.step_ms + c.prefill_ms) * min(1.0, self.mixed_batch_factor)

    def first_token_floor_s(self, num_computed: int, num_cached: int, max_batched_tokens: int) -> float:
        """The least time an engine on this profile can take from a request's arrival to its first token, when
        it computes `num_computed` prompt tokens after `num_cached` cached ones: a lower bound on its TTFT under
        any load, batch and schedule, so the benchmarks can say how much any router could still gain.

        Why it bounds: the first token comes at the end of the iteration computing the prompt's last token, and
        the n computed tokens need m >= ceil(n / max_batched_tokens) iterations, all inside the TTFT. Every
        iteration holding some of them costs at least step + prefill (more requests only add, the mixed-batch
        factor aside: it is applied when below 1), and the linear term over them is at least
        lin * max(0, n - m * knee) in total; their attention pairs do not depend on how they are chunked. So
        TTFT >= min over m of m * (step + prefill) + lin * (max(0, n - m * knee) + ratio * pairs), whose minimum
        is at the fewest chunks whenever step + prefill >= lin * knee (both fitted profiles), else where the
        chunks reach the knee. An idle engine meets it for a single-chunk prompt (tests compare it to the engine).
        """
        n = max(1, num_computed)  # vLLM always computes the prompt's last token
        c = self.coeffs
        per_chunk = c.step_ms + c.prefill_ms
        pairs = n * max(0, num_cached) + n * (n + 1) // 2
        fewest = -(-n // max(1, max_batched_tokens))
        at_knee = max(fewest, n // c.knee_tokens) if c.knee_tokens > 0 else fewest
        ms = min(
            m * per_chunk + c.lin_ms_per_tok * max(0, n - m * c.knee_tokens)
            for m in {fewest, at_knee, at_knee + 1}
        ) + c.lin_ms_per_tok * self.model.attn_pair_ratio * pairs
        return 0.001 * ms * min(1.0, self.mixed_batch_factor)


# -- measured tables ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Point:
    """One measured configuration (median over its repeats), as a batch the model can price."""

    num_prefill_tokens: int
    prefill_attn_pairs: int
    num_decode_reqs: int
    decode_context_tokens: int
    time_ms: float
    label: str = ""


@dataclass(frozen=True)
class Table:
    name: str
    points: tuple[Point, ...]
    rows_used: int
    rows_excluded: int
    excluded: tuple[str, ...] = field(default_factory=tuple)  # why, per excluded group


def pairs_for_prompt(n: int, c: int = 0) -> int:
    return n * c + n * (n + 1) // 2


def find_data_dir(start: Path | None = None) -> Path | None:
    """`$SWITCHYARD_DATA_DIR`, else the first `shared/data` walking up from this file, then from the cwd."""
    env = os.environ.get("SWITCHYARD_DATA_DIR")
    if env:
        return Path(env) if Path(env).is_dir() else None
    for base in ([start] if start else []) + [Path(__file__).resolve(), Path.cwd().resolve()]:
        for d in [base, *base.parents]:
            cand = d / "shared" / "data"
            if cand.is_dir():
                return cand
    return None


def load_batch_table(
    path: Path,
    *,
    model: str | None,
    hardware: str | None,
    tp: int,
    units_s: bool,
    decode_total: bool,
    prefill_batch1_only: bool,
    name: str,
    exclude: dict[tuple[int, int, int], str] | None = None,
    exclude_decode: dict[tuple[int, int, int], str] | None = None,
    batch1_reason: str = "prompt_time is not a whole-batch prefill (README 6)",
) -> tuple[Table, Table]:
    """A Splitwise-format table as (prefill table, decode table).

    Args:
        units_s: times in seconds (SageServe) rather than ms (Splitwise).
        decode_total: token_time is the total over token_size tokens (SageServe), not per iteration.
        prefill_batch1_only: prompt_time at batch > 1 is left out of the prefill fit (SageServe's caveat: it is not a
            whole-batch prefill), for `batch1_reason`.
        exclude / exclude_decode: (prompt, batch, tokens) -> reason, dropped from both / the decode fit.
    """
    exclude = exclude or {}
    exclude_decode = exclude_decode or {}
    groups: dict[tuple[int, int, int], list[tuple[float, float]]] = defaultdict(list)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        if model and row["model"] != model or hardware and row["hardware"] != hardware:
            continue
        if int(row["tensor_parallel"]) != tp:
            continue
        key = (int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"]))
        groups[key].append((float(row["prompt_time"]), float(row["token_time"])))
    scale = 1000.0 if units_s else 1.0
    pre: list[Point] = []
    dec: list[Point] = []
    used_p = used_d = excl_p = excl_d = 0
    why: list[str] = []
    for (p, b, tok), reps in sorted(groups.items()):
        if (p, b, tok) in exclude:
            excl_p += len(reps)
            excl_d += len(reps)
            why.append(f"prompt={p} batch={b} tokens={tok}: {exclude[(p, b, tok)]}")
            continue
        pt = statistics.median(r[0] for r in reps) * scale
        tt = statistics.median(r[1] for r in reps) * scale
        if b == 1 or not prefill_batch1_only:
            if tok == 128 or b > 1:  # the prefill grid: prompt sweep at batch 1, batch sweep at prompt 512
                pre.append(Point(p * b, b * pairs_for_prompt(p), 0, 0, pt, f"prefill p={p} b={b}"))
                used_p += len(reps)
        else:
            excl_p += len(reps)
        if (p, b, tok) in exclude_decode:
            excl_d += len(reps)
            why.append(f"decode prompt={p} batch={b} tokens={tok}: {exclude_decode[(p, b, tok)]}")
            continue
        per_iter = tt / tok if decode_total else tt
        # the iteration that computes output i (1..tok-1 after the prefill) attends to p + i tokens; mean p + tok/2
        dec.append(Point(0, 0, b, round(b * (p + tok / 2)), per_iter, f"decode p={p} b={b} t={tok}"))
        used_d += len(reps)
    if prefill_batch1_only:
        why.append(
            f"{excl_p - sum(len(groups[k]) for k in exclude)} rows with batch > 1: {batch1_reason}, used for decode "
            "only"
        )
    return (
        Table(f"{name} prefill", tuple(pre), used_p, excl_p, tuple(why)),
        Table(f"{name} decode", tuple(dec), used_d, excl_d, tuple(why)),
    )


def load_prefill_curve(path: Path, name: str) -> Table:
    """SageServe's single-request prefill curve (`PromptLength, ExecTime` in seconds), medians per length."""
    groups: dict[int, list[float]] = defaultdict(list)
    n = 0
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        groups[int(row["PromptLength"])].append(float(row["ExecTime"]))
        n += 1
    pts = tuple(
        Point(p, pairs_for_prompt(p), 0, 0, statistics.median(v) * 1000.0, f"prefill p={p}")
        for p, v in sorted(groups.items())
    )
    return Table(name, pts, n, 0)


# -- fitting -------------------------------------------------------------------------------------------------
def _features(pt: Point, knee: int, ratio: float) -> list[float]:
    return [
        1.0,
        1.0 if pt.num_prefill_tokens else 0.0,
        float(pt.num_decode_reqs),
        pt.decode_context_tokens / 1000.0,
        max(0, pt.num_prefill_tokens + pt.num_decode_reqs - knee) + ratio * pt.prefill_attn_pairs,
    ]


def fit_coeffs(
    tables: Sequence[Table],
    model: ModelSpec,
    decode_ctx_floor: float,
    knees: Sequence[int] = tuple(range(0, 1025, 32)),
) -> PerfCoeffs:
    """Weighted least squares on relative error (each table weighs the same), over a grid of knees.

    Coefficients are kept >= 0 (a negative one is pinned to 0 and the rest refitted) and the decode-context
    coefficient >= decode_ctx_floor.
    """
    import numpy as np

    ratio = model.attn_pair_ratio
    pts: list[Point] = []
    weights: list[float] = []
    for t in tables:
        for p in t.points:
            pts.append(p)
            weights.append(1.0 / math.sqrt(len(t.points)))
    y = np.array([p.time_ms for p in pts])
    w = np.array(weights) / y  # relative error
    best: tuple[float, PerfCoeffs] | None = None
    for knee in knees:
        x = np.array([_features(p, knee, ratio) for p in pts])
        lower = np.array([0.0, 0.0, 0.0, decode_ctx_floor, 0.0])
        pinned: dict[int, float] = {}
        for _ in range(6):
            free = [i for i in range(5) if i not in pinned]
            resid = y - sum((x[:, i] * v for i, v in pinned.items()), np.zeros_like(y))
            sol, *_ = np.linalg.lstsq(x[:, free] * w[:, None], resid * w, rcond=None)
            coef = dict(pinned)
            coef.update(zip(free, sol, strict=True))
            bad = [i for i in free if coef[i] < lower[i] - 1e-12]
            if not bad:
                break
            for i in bad:
                pinned[i] = float(lower[i])
        vec = np.array([coef[i] for i in range(5)])
        err = float(np.sum(((x @ vec - y) * w) ** 2))
        c = PerfCoeffs(*(float(v) for v in vec), knee_tokens=knee)
        if best is None or err < best[0]:
            best = (err, c)
    assert best is not None
    return best[1]


def table_errors(profile: PerfProfile, table: Table) -> tuple[float, float, float]:
    """(median, p90, max) absolute % error of the profile over a table's points."""
    errs = sorted(
        abs(
            profile.iteration_time_ms(
                p.num_prefill_tokens, p.prefill_attn_pairs, p.num_decode_reqs, p.decode_context_tokens
            )
            - p.time_ms
        )
        / p.time_ms
        * 100.0
        for p in table.points
    )
    if not errs:
        return 0.0, 0.0, 0.0
    p90 = errs[min(len(errs) - 1, math.ceil(0.9 * len(errs)) - 1)]
    return statistics.median(errs), p90, errs[-1]
