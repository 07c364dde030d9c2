"""The task's headline metric (accuracy, perplexity, ...) against the bytes that crossed the WAN: the curve a
WAN-bound federation is judged by."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_metric_vs_bytes(
    rounds: Sequence[dict[str, Any]], path: Path, *, metric: str = "accuracy", initial: float | None = None,
    title: str = "",
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys, labels = [], [], []
    if initial is not None:
        xs.append(0.0)
        ys.append(initial)
        labels.append("0")
    for line in rounds:
        xs.append(line["cumulative_bytes"] / 1e6)
        ys.append(line.get(metric))
        labels.append(str(line["round"]))
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    ax.plot(xs, ys, marker="o")
    for x, y, label in zip(xs, ys, labels, strict=True):
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set_xlabel("cumulative payload over the WAN, up + down, all clusters (MB)")
    ax.set_ylabel(f"test {metric}")
    if metric == "accuracy":
        ax.set_ylim(0, 1)
    elif metric == "perplexity":
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.set_title(title or f"{metric} vs bytes (labels: round)")
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
