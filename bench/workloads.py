"""Synthetic workloads: Poisson or Gamma arrivals, prompt/output lengths from a small distribution spec, and
optional shared-prefix groups (a common system prompt per group, then a unique suffix).

Everything is drawn from one `numpy.random.default_rng(seed)`, so a (spec, seed) pair is one fixed trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from switchyard.bench.traces import NS_GROUP, NS_UNIQUE, Segment, Trace, TraceRequest

ARRIVALS = ("poisson", "gamma")


def parse_length_dist(spec: str) -> Callable[[np.random.Generator, int], np.ndarray]:
    """A length distribution from a spec string; returns `draw(rng, n) -> int array (>= 1)`.

    Specs: `N` (constant), `uniform:LO:HI` (inclusive), `exp:MEAN`, `lognormal:MEDIAN:SIGMA`,
    `normal:MEAN:STD`. Values are rounded and clipped to >= 1.
    """
    parts = spec.split(":")
    kind = parts[0].lower()
    try:
        if len(parts) == 1:
            n = int(kind)
            return lambda rng, k: np.full(k, max(1, n), dtype=np.int64)
        a = float(parts[1])
        b = float(parts[2]) if len(parts) > 2 else 0.0
    except (ValueError, IndexError):
        raise ValueError(f"bad length spec {spec!r}") from None

    def clip(x: np.ndarray) -> np.ndarray:
        return np.maximum(1, np.rint(x)).astype(np.int64)

    if kind == "uniform":
        return lambda rng, k: clip(rng.integers(int(a), int(b) + 1, k))
    if kind == "exp":
        return lambda rng, k: clip(rng.exponential(a, k))
    if kind == "lognormal":
        return lambda rng, k: clip(rng.lognormal(np.log(a), b, k))
    if kind == "normal":
        return lambda rng, k: clip(rng.normal(a, b, k))
    raise ValueError(f"unknown length distribution {kind!r} in {spec!r}")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    arrival: str = "poisson"  # "poisson" | "gamma"
    rate: float = 4.0  # mean requests/s
    cv: float = 1.0  # inter-arrival coefficient of variation (gamma only; poisson is 1)
    num_requests: int = 200
    prompt_len: str = "lognormal:1024:0.6"  # spec for parse_length_dist
    output_len: str = "lognormal:128:0.8"
    prefix_groups: int = 0  # 0 = no shared prefixes
    prefix_len: int = 512  # tokens shared by every request of a group
    prefix_frac: float = 1.0  # fraction of requests that belong to some group


def inter_arrivals(rng: np.random.Generator, arrival: str, rate: float, cv: float, n: int) -> np.ndarray:
    """`n` gaps in seconds with mean 1/rate. Gamma shape k = 1/cv², scale = 1/(rate·k) (mean k·scale = 1/rate)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if arrival == "poisson":
        return rng.exponential(1.0 / rate, n)
    if arrival == "gamma":
        if cv <= 0:
            raise ValueError(f"cv must be > 0, got {cv}")
        k = 1.0 / (cv * cv)
        return rng.gamma(k, 1.0 / (rate * k), n)
    raise ValueError(f"unknown arrival process {arrival!r}; expected one of {ARRIVALS}")


def make_workload(spec: WorkloadSpec, seed: int = 0) -> Trace:
    """A synthetic trace; the first request arrives at 0."""
    rng = np.random.default_rng(seed)
    n = spec.num_requests
    gaps = inter_arrivals(rng, spec.arrival, spec.rate, spec.cv, n)
    arrivals = np.concatenate(([0.0], np.cumsum(gaps[1:]))) if n else np.zeros(0)
    prompt = parse_length_dist(spec.prompt_len)(rng, n)
    output = parse_length_dist(spec.output_len)(rng, n)
    groups = rng.integers(0, max(1, spec.prefix_groups), n)
    in_group = rng.random(n) < spec.prefix_frac
    reqs: list[TraceRequest] = []
    for i in range(n):
        n_in = int(prompt[i])
        segs: tuple[Segment, ...]
        if spec.prefix_groups > 0 and in_group[i]:
            n_in = max(n_in, spec.prefix_len + 1)  # at least one own token after the shared prefix
            segs = ((NS_GROUP, int(groups[i]), spec.prefix_len), (NS_UNIQUE, i, n_in - spec.prefix_len))
        else:
            segs = ((NS_UNIQUE, i, n_in),)
        reqs.append(
            TraceRequest(
                request_id=f"r{i}",
                arrival_s=float(arrivals[i]),
                num_prompt_tokens=n_in,
                num_output_tokens=int(output[i]),
                segments=segs,
            )
        )
    return Trace(
        name=spec.arrival,
        requests=tuple(reqs),
        source=f"synthetic {spec}",
        has_prefix_identity=spec.prefix_groups > 0,
    )
