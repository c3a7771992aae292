"""The micro-benchmarks' one chart: grouped bars of per-call latency (µs), one group per operation, one bar per
(build, statistic) series."""

from __future__ import annotations

from pathlib import Path


def grouped_bars(
    path: Path, groups: list[str], series: list[tuple[str, list[float]]], title: str, *, log: bool = False,
    goal: tuple[float, str] | None = None,
) -> Path:
    """Write `path`: for each (label, heights) of `series` a bar per group, side by side; `goal` = (y, label) of
    a dashed line."""
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
