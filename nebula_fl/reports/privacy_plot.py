"""The privacy figure a data owner reads at a glance: ε spent so far against the budget, and what each round cost.

Two panels share the x axis (rounds, or a cluster's releases): the total ε so far per series with each
budget as a labelled line, and bars of the ε each round added. Clusters with the same policy and data size
spend exactly the same ε, and one line would hide the other; so every series has its own colour, marker
and line style and sits a little to the side within its round, and the legend names the ones that coincide.
Below the panels, a caption in plain words: what ε protects (the unit), δ, the accountant and the noise,
and — only where the plotted numbers bear it out — why the first round cost the most.

Both privacy reports draw with this module: ``report.py`` (a run folder) and ``cluster_report.py`` (a
cluster's own ledger). matplotlib is imported when a figure is drawn, not with this module.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

UNIT = {"sample": "each example's influence", "client": "each cluster's whole update"}
UNIT_MEANING = {
    "sample": "how much any single training example (one row of the task's data: a labelled text, an instruction "
              "record, a document) can change what its cluster sends out",
    "client": "how much a cluster's entire data set can change what the server learns from it",
}
ACCOUNTANT = {"prv": "Opacus's PRV accountant (numerical composition, an upper bound)",
              "rdp": "Opacus's RDP accountant (Rényi DP, an upper bound)"}
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
CAPTION_WIDTH = 118


@dataclass(frozen=True, kw_only=True)
class Series:
    """One curve of the figure: a cluster's ε, or the server's client-level account, round by round."""

    label: str
    x: tuple[int, ...]
    """Round (or release) numbers, ascending."""
    epsilon: tuple[float | None, ...]
    """Total ε after each x (None where the round recorded none)."""
    spent: tuple[float | None, ...]
    """ε added by each x alone (None where unknown, e.g. a lifetime ledger that started before this run)."""
    steps: tuple[int | None, ...] = ()
    """DP steps (or releases) each x accounted; empty if unknown."""
    refused: tuple[bool, ...] = ()
    """True where the cluster refused the round; empty if it refused none."""
    budget: float | None = None

    def __post_init__(self) -> None:
        n = len(self.x)
        if len(self.epsilon) != n or len(self.spent) != n:
            raise ValueError(f"series '{self.label}': x, epsilon and spent must have one value per point")
        for name in ("steps", "refused"):
            if getattr(self, name) and len(getattr(self, name)) != n:
                raise ValueError(f"series '{self.label}': {name} must be empty or have one value per point")
        if list(self.x) != sorted(set(self.x)):
            raise ValueError(f"series '{self.label}': x must be ascending without repeats, got {list(self.x)}")


@dataclass(frozen=True, kw_only=True)
class Figure:
    """What to draw: the series, the words around them, and the x axis's name and tick labels."""

    series: tuple[Series, ...]
    title: str
    caption: tuple[str, ...]
    y_unit: str
    """Shown on the y axis, e.g. "each example's influence"."""
    x_name: str = "round"
    """What one x is, in the words of the caption and the lower panel: "round" or "release"."""
    x_label: str = ""
    """The x axis's title, if it should say more than ``x_name``."""
    tick_labels: dict[int, str] = field(default_factory=dict)
    """Labels for the x ticks (shown when there are at most 16), e.g. a release's federation and round."""

    def __post_init__(self) -> None:
        if not self.series:
            raise ValueError("a privacy figure needs at least one series")


def spent_per_point(x: Sequence[int], epsilon: Sequence[float | None], *, start: float | None = 0.0
                    ) -> tuple[float | None, ...]:
    """The ε each point added: the difference from the last point with a value (``start`` before the first)."""
    out: list[float | None] = []
    previous = start
    for eps in epsilon:
        if eps is None:
            out.append(None)
            continue
        out.append(None if previous is None else max(eps - previous, 0.0))
        previous = eps
    return tuple(out)


def same_curve(a: Series, b: Series) -> bool:
    return a.x == b.x and all(
        (p is None and q is None) or (p is not None and q is not None and math.isclose(p, q, rel_tol=1e-9))
        for p, q in zip(a.epsilon, b.epsilon, strict=True))


# -- the words -----------------------------------------------------------------------------------
def unit_sentence(mode: str) -> str:
    return (f"ε measures {UNIT[mode]}: {UNIT_MEANING[mode]}. Lower is more private; "
            "it only ever grows, each round adding to it.")


def chance(delta: float) -> str:
    """δ as a data owner reads it: "1 in 100,000" (or the number itself when that is not a whole 1 in N)."""
    odds = 1 / delta
    return f"1 in {odds:,.0f}" if odds >= 2 and math.isclose(odds, round(odds), rel_tol=1e-6) else f"{delta:.3g}"


def delta_sentence(delta: float | None) -> str:
    return "" if delta is None else (f"δ = {delta:.3g}: a {chance(delta)} chance that this ε bound does not hold.")


def distinct(values: dict[str, Any], fmt: str) -> str:
    """One value if every series has it, else each series' own: "0.674" or "0.674 (cluster 0), 0.9 (cluster 1)"."""
    known = {k: v for k, v in values.items() if v is not None}
    shown = {k: format(v, fmt) for k, v in known.items()}
    if not shown:
        return "?"
    if len(set(shown.values())) == 1:
        return next(iter(shown.values()))
    return ", ".join(f"{v} ({k})" for k, v in shown.items())


def first_round_note(series: Sequence[Series], *, x_name: str = "round", step: str = "step") -> str:
    """Why round 1 cost the most, stated only if every series' first round cost the most ε per step.

    Under composition ε grows more slowly than the number of steps, so for a fixed mechanism the first
    steps cost the most ε each. That holds for the accountant's numbers only while σ and q stay put; this
    checks the plotted numbers themselves (ε per step, round by round) and says nothing if any series breaks it.
    ``step`` names what a series' ``steps`` count: "step" (DP-SGD) or "update" (client-level DP).
    """
    shares, example = [], None
    for s in series:
        points = [(spent, steps) for spent, steps, refused in
                  zip(s.spent, s.steps or (None,) * len(s.x), s.refused or (False,) * len(s.x), strict=True)
                  if not refused and spent is not None and steps]
        if len(points) < 2 or s.spent[0] is None or not s.steps or not s.steps[0] or s.epsilon[0] is None:
            return ""
        per_step = [spent / steps for spent, steps in points]
        if any(later > per_step[0] * (1 + 1e-9) for later in per_step[1:]):
            return ""
        total_eps = next(e for e in reversed(s.epsilon) if e is not None)
        if total_eps <= 0:
            return ""
        shares.append(s.epsilon[0] / total_eps)
        if example is None:
            total_steps = sum(steps for _, steps in points)
            example = (s.label, total_steps, s.steps[0], total_eps / s.epsilon[0])
    if example is None:
        return ""
    low, high = min(shares), max(shares)
    share = f"{low:.0%}" if round(low, 2) == round(high, 2) else f"{low:.0%}–{high:.0%}"
    whose = ("the total ε" if len(series) == 1 else "each cluster's total ε"
             if all(s.label.startswith("cluster ") for s in series) else "each curve's total ε")
    label, total_steps, first_steps, ratio = example
    first = f"its first {step}" if first_steps == 1 else f"its first {first_steps} {step}s"
    return (f"Why {x_name} 1 cost the most ({share} of {whose}): under composition ε grows more slowly than the "
            f"number of {step}s — {label}'s {total_steps} {step}s cost {ratio:.2g}× the ε of {first} — "
            f"so the first {step}s cost the most ε each, and every later {x_name} adds less.")


# -- drawing -------------------------------------------------------------------------------------
def legend_labels(series: Sequence[Series]) -> list[str]:
    """Each series' name, its final ε, and which earlier series it coincides with (drawn beside it, not hidden)."""
    out = []
    for i, s in enumerate(series):
        twin = next((t.label for t in series[:i] if same_curve(t, s)), None)
        final = next((e for e in reversed(s.epsilon) if e is not None), None)
        out.append(s.label + ("" if final is None else f": ε = {final:.2f}") + (f" (same as {twin})" if twin else ""))
    return out


def _budgets(series: Sequence[Series]) -> list[tuple[float, str]]:
    """Each distinct budget and whose it is ("all clusters" when every cluster has it)."""
    owners: dict[float, list[str]] = {}
    for s in series:
        if s.budget is not None and math.isfinite(s.budget):
            owners.setdefault(s.budget, []).append(s.label)
    clusters = [s.label for s in series if s.label.startswith("cluster ")]
    out = []
    for budget, labels in sorted(owners.items()):
        if len(clusters) > 1 and set(clusters) <= set(labels):
            who = ", ".join(["all clusters"] + [label for label in labels if label not in clusters])
        else:
            who = ", ".join(labels)
        out.append((budget, who))
    return out


def draw(figure: Figure) -> Any:
    """The matplotlib figure: cumulative ε on top, ε per round below, the caption underneath.

    Built without pyplot (no global figure list, no GUI backend): ``savefig`` renders it with Agg.
    """
    from matplotlib import rcParams
    from matplotlib.figure import Figure as Canvas
    from matplotlib.ticker import MaxNLocator

    lines = [wrapped for sentence in figure.caption if sentence
             for wrapped in textwrap.wrap(sentence, CAPTION_WIDTH, initial_indent="• ", subsequent_indent="  ")]
    n = len(figure.series)
    caption_h = 0.17 * len(lines)  # inches of text under the panels
    names = legend_labels(figure.series)
    refusals = any(any(s.refused) for s in figure.series)
    refused_name = f"{figure.x_name} the cluster refused to train (e.g. it would have passed the budget)"
    longest = max(len(name) for name in names + ([refused_name] if refusals else []))
    entries = n + refusals
    ncol = max(1, min(entries, int(8.6 // (0.06 * longest + 0.5))))  # as many as fit across, at 7.5 pt
    # the two panels; title and legend (a row per ncol entries) above; x labels below
    tick_lines = 1 + max((label.count("\n") for label in figure.tick_labels.values()), default=0)
    panels_h, head_h, foot_h = 5.6, 0.6 + 0.2 * math.ceil(entries / ncol), 0.35 + 0.17 * tick_lines
    height = panels_h + head_h + foot_h + caption_h + 0.15
    fig = Canvas(figsize=(9.0, height), dpi=110)
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3.2, 2.0], "hspace": 0.08})
    fig.subplots_adjust(left=0.1, right=0.98, top=1 - head_h / height, bottom=(foot_h + caption_h + 0.15) / height)
    colors = rcParams["axes.prop_cycle"].by_key()["color"]
    width = min(0.8 / n, 0.25)  # each series' bar; its points sit a little apart, close enough to read as one round
    nudge = min(0.5 / n, 0.06)
    handles, labels = [], []
    for i, s in enumerate(figure.series):
        color = colors[i % len(colors)]
        offset = (i - (n - 1) / 2) * nudge
        bar_offset = (i - (n - 1) / 2) * width
        label = names[i]
        points = [(x + offset, e) for x, e in zip(s.x, s.epsilon, strict=True) if e is not None]
        if points:
            (line,) = top.plot(*zip(*points, strict=True), color=color, marker=MARKERS[i % len(MARKERS)],
                               linestyle=LINESTYLES[i % len(LINESTYLES)], markersize=6, label=label)
            handles.append(line)
            labels.append(label)
        refused = [(x + offset, e) for x, e, r in zip(s.x, s.epsilon, s.refused or (False,) * len(s.x), strict=True)
                   if r and e is not None]
        if refused:
            top.plot(*zip(*refused, strict=True), linestyle="none", marker="x", markersize=12, markeredgewidth=2,
                     color=color)
        bars = [(x + bar_offset, v, r) for x, v, r in zip(s.x, s.spent, s.refused or (False,) * len(s.x),
                                                           strict=True) if v is not None]
        if bars:
            xs, vs, _ = zip(*bars, strict=True)
            bottom.bar(xs, vs, width=width * 0.9, color=color, edgecolor="black", linewidth=0.4, label=label)
            if n * len(bars) <= 16:  # few enough bars to write each one's value on it
                for x, v, r in bars:
                    bottom.annotate("refused" if r else f"{v:.2g}", (x, v), textcoords="offset points",
                                    xytext=(0, 2), ha="center", fontsize=7)
    if refusals:
        handles.append(top.plot([], [], linestyle="none", marker="x", markersize=9, markeredgewidth=2,
                                color="black")[0])
        labels.append(refused_name)
    tops = [e for s in figure.series for e in s.epsilon if e is not None and math.isfinite(e)]
    for budget, who in _budgets(figure.series):
        tops.append(budget)
        top.axhline(budget, linestyle="--", color="firebrick", linewidth=1.2)
        top.annotate(f"budget: ε ≤ {budget:g} ({who})", (0.005, budget), xycoords=("axes fraction", "data"),
                     textcoords="offset points", xytext=(2, 3), fontsize=8, color="firebrick")
    high = max(tops, default=0.0)
    top.set_ylim(0, 1.15 * high if high > 0 else 1.0)
    top.set_ylabel(f"total ε so far\n({figure.y_unit})")
    top.grid(alpha=0.3)
    bottom.set_ylabel(f"ε spent in\nthe {figure.x_name} alone")
    bottom.set_xlabel(figure.x_label or figure.x_name)
    bottom.grid(alpha=0.3, axis="y")
    spent = [v for s in figure.series for v in s.spent if v is not None]
    bottom.set_ylim(0, 1.15 * max(spent) if spent and max(spent) > 0 else 1.0)
    xs_all = sorted({x for s in figure.series for x in s.x})
    if xs_all:
        top.set_xlim(xs_all[0] - 0.5, xs_all[-1] + 0.5)
    if figure.tick_labels and len(xs_all) <= 16:
        bottom.set_xticks(xs_all, [figure.tick_labels.get(x, str(x)) for x in xs_all])
    else:
        bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.text(0.1, (caption_h + 0.1) / height, "\n".join(lines), va="top", ha="left", fontsize=8.5)
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7.5, frameon=False,
               bbox_to_anchor=(0.5, 1 - (head_h - 0.05) / height))
    fig.suptitle(figure.title, fontsize=12, y=1 - 0.08 / height, va="top")
    return fig


def draw_message(title: str, message: str) -> Any:
    """A figure that only says something, for a report with nothing to plot (e.g. no release yet)."""
    from matplotlib.figure import Figure as Canvas

    fig = Canvas(figsize=(9.0, 2.0), dpi=110)
    fig.suptitle(title, fontsize=12)
    fig.text(0.5, 0.4, message, ha="center", va="center", fontsize=10)
    return fig


def save(figure: Figure | Any, path: Path) -> None:
    """Write ``figure`` (a ``Figure`` to draw, or a drawn matplotlib one) to ``path`` as PNG, whole or not at all."""
    fig = draw(figure) if isinstance(figure, Figure) else figure
    tmp = path.with_name(f".{path.stem}.tmp.png")
    try:
        fig.savefig(tmp, format="png")
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
