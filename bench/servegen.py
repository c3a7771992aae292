"""ServeGen's production arrivals (Alibaba Cloud Model Studio, NSDI'26; `shared/data/servegen`) as a trace.

ServeGen publishes, per client (API customer) of a model, one row per 600-s window over 14 days: the mean request
rate, the inter-arrival CV and the fitted gap distribution (Gamma or Weibull, shape and scale), and for a few
clients the prompt and output length PMFs per 6-h window. This builds requests from them as ServeGen's generator
does: in each window a client sends round(rate × 600) requests (the fraction rounded by a draw), their gaps drawn
from its fitted distribution and rescaled so that they fill the window, and each request's lengths drawn from the
client's PMFs of the 6-h window it falls in. The clients are those with a length file (as ServeGen's `ClientPool`
loads them): m-large's 61 and 143, m-mid's 60. Prompts are unique (ServeGen has no prefix identity), so this is
a load-balancing workload: bursts of a client's CV up to ~130 (m-mid), real length mixes (m-large: a chat client,
~850 → ~80-330 tokens, beside a scoring one, ~650 → ~4).

Time 0 is the trace's local midnight of its first day (ServeGen's README reads `span(72000, 75600)` as 20:00-21:00);
a slice starts at `start_s` from there. Every draw comes from `numpy.random.default_rng(seed)` in a fixed order
(client, then window), so a (model, slice, seed) is one trace.
"""

from __future__ import annotations

import ast
import csv
import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from switchyard.bench.traces import NS_UNIQUE, Trace, TraceRequest, find_data_dir

PREFIX = "servegen-"
MODELS = ("m-large", "m-mid")
NAMES = tuple(PREFIX + m for m in MODELS)
WINDOW_S = 600.0  # a trace row's window
LENGTH_WINDOW_S = 21600.0  # a length file's window (6 h)


@dataclass(frozen=True, slots=True)
class Window:
    start_s: float
    rate: float  # requests/s
    pattern: str  # "Gamma" | "Weibull" | "" (idle, or no fit: Poisson)
    shape: float
    scale: float


@dataclass(frozen=True, slots=True)
class Client:
    client_id: int
    windows: tuple[Window, ...]
    lengths_path: Path  # chunk-<id>-dataset.json


def model_dir(model: str, data_dir: Path | None = None) -> Path:
    return (data_dir or find_data_dir()) / "servegen" / "data" / "language" / model


def read_windows(path: Path) -> tuple[Window, ...]:
    """A client's `chunk-<id>-trace.csv` (no header: start, rate, cv, pattern, shape, scale)."""
    out = []
    with open(path, newline="", encoding="utf-8") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row:
                continue
            try:
                start, rate, _cv, pattern, shape, scale = row[:6]
                w = Window(float(start), float(rate), pattern.strip(), float(shape or 0), float(scale or 0))
            except ValueError as e:
                raise ValueError(f"{path}: line {lineno}: not a ServeGen trace row ({e}): {row!r}") from None
            if w.rate < 0 or not math.isfinite(w.rate) or w.pattern not in ("", "Gamma", "Weibull"):
                raise ValueError(f"{path}: line {lineno}: rate {w.rate}, pattern {w.pattern!r}")
            out.append(w)
    return tuple(sorted(out, key=lambda w: w.start_s))


def load_clients(model: str, data_dir: Path | None = None) -> list[Client]:
    """The model's clients that have a length file, by id."""
    d = model_dir(model, data_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"no ServeGen data for {model!r} at {d}")
    clients = []
    for lengths in sorted(d.glob("chunk-*-dataset.json")):
        cid = int(lengths.name.split("-")[1])
        clients.append(Client(cid, read_windows(d / f"chunk-{cid}-trace.csv"), lengths))
    if not clients:
        raise FileNotFoundError(f"no ServeGen client of {model!r} has a length file in {d}")
    return sorted(clients, key=lambda c: c.client_id)


@lru_cache(maxsize=8)
def _length_file(path: Path) -> dict[float, dict[str, str]]:
    with open(path, encoding="utf-8") as f:
        return {float(k): v for k, v in json.load(f).items()}


@lru_cache(maxsize=256)
def length_pmf(path: Path, window_s: float, field: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, probabilities) of `field` ("input_tokens" | "output_tokens") in the 6-h window starting at
    `window_s`, or the nearest window before it that has data (else the nearest after). The PMFs are Python dict
    literals: `ast.literal_eval`, never `eval`."""
    windows = _length_file(path)
    order = sorted(windows, key=lambda s: (s > window_s, abs(s - window_s)))
    for s in order:
        pmf = ast.literal_eval(windows[s].get(field) or "{}")
        if pmf:
            values = np.fromiter((int(k) for k in pmf), dtype=np.int64, count=len(pmf))
            probs = np.fromiter(pmf.values(), dtype=np.float64, count=len(pmf))
            return np.maximum(1, values), probs / probs.sum()
    raise ValueError(f"{path}: no {field} in any window")


def window_arrivals(w: Window, rng: np.random.Generator) -> np.ndarray:
    """Seconds from the window's start of its requests: round(rate × 600) of them (the fraction by a draw), gaps
    from the fitted distribution rescaled to fill the window (the first request after the first gap)."""
    mean = w.rate * WINDOW_S
    n = int(mean) + int(rng.random() < mean - int(mean))
    if n == 0:
        return np.empty(0)
    if w.pattern == "Gamma" and w.shape > 0 and w.scale > 0:
        gaps = rng.gamma(w.shape, w.scale, n + 1)
    elif w.pattern == "Weibull" and w.shape > 0 and w.scale > 0:
        gaps = rng.weibull(w.shape, n + 1) * w.scale
    else:
        gaps = rng.exponential(1.0, n + 1)
    return np.cumsum(gaps[:-1]) * (WINDOW_S / gaps.sum())


def servegen_trace(
    model: str,
    start_s: float = 0.0,
    duration_s: float = WINDOW_S,
    seed: int = 0,
    max_requests: int | None = None,
    data_dir: Path | None = None,
) -> Trace:
    """The requests of `model`'s clients (those with a length file) arriving in [start_s, start_s + duration_s)
    of the 14-day trace, re-based to the first, at most `max_requests` (the earliest)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    rng = np.random.default_rng(seed)
    end_s = start_s + duration_s
    rows: list[tuple[float, int, int, int]] = []  # (arrival, client, prompt, output)
    for c in load_clients(model, data_dir):
        for w in c.windows:
            if w.start_s + WINDOW_S <= start_s or w.start_s >= end_s:
                continue
            t = w.start_s + window_arrivals(w, rng)
            t = t[(t >= start_s) & (t < end_s)]
            if not len(t):
                continue
            lw = math.floor(w.start_s / LENGTH_WINDOW_S) * LENGTH_WINDOW_S
            vin, pin = length_pmf(c.lengths_path, lw, "input_tokens")
            vout, pout = length_pmf(c.lengths_path, lw, "output_tokens")
            prompts, outputs = rng.choice(vin, len(t), p=pin), rng.choice(vout, len(t), p=pout)
            rows.extend(zip(t.tolist(), [c.client_id] * len(t), prompts.tolist(), outputs.tolist(), strict=True))
    rows.sort()
    rows = rows[:max_requests] if max_requests is not None else rows
    t0 = rows[0][0] if rows else 0.0
    reqs = tuple(
        TraceRequest(f"r{i}", t - t0, p, o, ((NS_UNIQUE, i, p),)) for i, (t, _, p, o) in enumerate(rows)
    )
    clients = sorted({cid for _, cid, _, _ in rows})
    return Trace(
        name=PREFIX + model,
        requests=reqs,
        source=f"servegen {model} clients {clients}, [{start_s:g}, {end_s:g}) s from the first midnight, seed {seed}",
    )
