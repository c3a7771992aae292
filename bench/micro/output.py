"""What the micro-benchmarks write: their files (JSON rows with the run's metadata, the markdown table, an optional
PNG), and their one chart, grouped bars of per-call latency (µs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_outputs(
    out: Path, stem: str, meta: dict[str, Any], rows: list[dict[str, Any]], md: str,
    plot: Callable[[Path], Path] | None,
) -> list[Path]:
    """Write out/stem.json ({"meta", "rows"}), out/stem.md and, when `plot` is given, plot(out/stem.png); print
    the table and the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{stem}.json", out / f"{stem}.md"]
    written[0].write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    written[1].write_text(md)
    if plot is not None:
        written.append(plot(out / f"{stem}.png"))
    print(md, end="")
    print("wrote " + ", ".join(str(p) for p in written))
    return written


def grouped_bars(
    path: Path, groups: list[str], series: list[tuple[str, list[float]]], title: str, *, log: bool = False,
    goal: tuple[float, str] | None = None,
) -> Path:
    """The micro-benchmarks' chart at `path`: one group per operation, and for each (label, heights) of `series`
    a bar per group, side by side; `goal` = (y, label) of a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for k, (label, heights) in enumerate(series):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))]
        ax.bar(xs, heights, width, label=label)
    if goal is not None:
        ax.axhline(goal[0], color="black", linestyle="--", linewidth=1, label=goal[1])
    if log:
        ax.set_yscale("log")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_ylabel("µs per call")
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
