"""What the person at the terminal sees: one line per event, one row per round, a table at the end."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _fmt(value: Any, spec: str = ".4f") -> str:
    """A metric as the table shows it; a count (a whole number of 10 or more, e.g. tokens scored) without decimals."""
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer() and abs(value) >= 10:
        return f"{value:.0f}"
    return format(value, spec)


LEGACY_METRICS = ("accuracy", "macro_f1", "loss", "perplexity")  # rounds recorded before rows named their metrics
LABELS = {"macro_f1": "macro-F1"}


def metric_names(rounds: Sequence[dict[str, Any]], *, initial: dict[str, Any] | None = None) -> list[str]:
    """The evaluation's metrics in the task's order (what its rows name), those some row or the initial one has."""
    named = [list(line["eval_metrics"]) for line in rounds if line.get("eval_metrics")]
    names: list[str] = []
    for name in [m for ms in named for m in ms] or list(initial or {}) or LEGACY_METRICS:
        if name not in names:
            names.append(name)
    seen = [initial or {}, *rounds]
    return [n for n in names if any(isinstance(line.get(n), int | float) for line in seen)]


def _label(name: str) -> str:
    return LABELS.get(name, name.replace("_", " "))


def round_line(line: dict[str, Any], total: int) -> str:
    clusters = line.get("clusters", {})
    per = ", ".join(
        f"c{cid} {c.get('train_loss', float('nan')):.3f}"
        for cid, c in sorted(clusters.items()) if isinstance(c.get("train_loss"), int | float)
    )
    rejected = f" | dropped: {', '.join(sorted(line['rejected']))}" if line.get("rejected") else ""
    if line.get("skipped"):
        rejected += " | SKIPPED: too few usable updates, the global adapter stays"
    secagg = line.get("secagg") or {}
    if line.get("trained") is False:  # a flush after the loop: no cluster trained
        rejected += f" | no training: applied held round(s) {_rounds(secagg.get('unmasked_rounds'))}"
    if secagg.get("not_applied"):
        rejected += f" | NOT APPLIED: round(s) {_rounds(e['round'] for e in secagg['not_applied'])}"
    shown = [n for n in metric_names([line]) if n != "loss"] or ["accuracy"]
    evaluated = "".join(f"{_label(n)} {_fmt(line.get(n))}, " for n in shown)
    return (
        f"round {line['round']}/{total}: {evaluated}"
        f"up {human_bytes(line.get('bytes_up'))}, down {human_bytes(line.get('bytes_down'))}, "
        f"{line.get('seconds', 0):.1f} s{f' (train loss {per})' if per else ''}{rejected}"
    )


def _rounds(rounds) -> str:
    return ", ".join(map(str, rounds or [])) or "-"


def results_table(rounds: Sequence[dict[str, Any]], *, initial: dict[str, Any] | None = None) -> Table:
    cluster_ids = sorted({cid for line in rounds for cid in line.get("clusters", {})})
    table = Table(title="nebula-fl: per-round results (bytes = serialized payload per cluster)")
    metrics = metric_names(rounds, initial=initial)
    for name in ("round", *(_label(m) for m in metrics), "train loss"):
        table.add_column(name, justify="right")
    for cid in cluster_ids:
        table.add_column(f"cluster {cid} up / down", justify="right")
    # the least busy cluster's share of its cycle spent training (where the clusters timed it): what the network
    # and the server cost the accelerators that round
    busy = any("busy_fraction_min" in line.get("timeline", {}) for line in rounds)
    if busy:
        table.add_column("busy (min)", justify="right")
    table.add_column("done at (s)", justify="right")  # run time when the round was recorded; rounds may overlap
    if initial:
        table.add_row("0", *(_fmt(initial.get(m)) for m in metrics), "-", *["-" for _ in cluster_ids],
                      *(["-"] if busy else []), "-")
    for line in rounds:
        cells = []
        for cid in cluster_ids:
            c = line.get("clusters", {}).get(cid)
            cells.append(f"{human_bytes(c['bytes_up'])} / {human_bytes(c['bytes_down'])}" if c else "-")
        table.add_row(
            str(line["round"]), *(_fmt(line.get(m)) for m in metrics), _fmt(line.get("train_loss")), *cells,
            *([_fmt(line.get("timeline", {}).get("busy_fraction_min"), ".0%")] if busy else []),
            f"{line.get('elapsed_seconds', 0):.1f}",
        )
    return table


def print_summary(console: Console, rounds: Sequence[dict[str, Any]], summary: dict[str, Any], out: str) -> None:
    if rounds:
        console.print(results_table(rounds, initial=summary.get("initial_evaluation")))
    status = summary.get("status", "unknown")
    console.print(
        f"status: {status} | rounds {summary.get('rounds_completed', 0)}/{summary.get('num_server_rounds', '?')} | "
        f"final {summary.get('metric', 'accuracy')} {_fmt(summary.get('final_metric', summary.get('final_accuracy')))} | up {human_bytes(summary.get('bytes_up_total'))} | "
        f"down {human_bytes(summary.get('bytes_down_total'))} | wall {summary.get('wall_seconds') or 0:.0f} s"
    )
    for lost in summary.get("rounds_not_applied") or []:
        console.print(f"[yellow]round {lost['round']}'s updates are not in the final adapter: {lost['reason']}[/yellow]")
    console.print(f"run folder: {out}")
