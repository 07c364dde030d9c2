"""The privacy report of a run folder: ε per cluster per round, the budgets, and where and why a cluster stopped.

It reads only what the run wrote (``metrics.jsonl`` and ``summary.json``, see
``nebula_fl/server/run_folder.py``); it recomputes nothing, so it shows the ε the clusters enforced.

Inputs, per round line of ``metrics.jsonl``:

- ``clusters[cid]`` (sample-level DP, each cluster's own ledger): ``epsilon``, ``delta``,
  ``noise_multiplier``, ``sample_rate``, ``dp_steps`` (cumulative), ``max_grad_norm``, ``accountant``,
  optionally ``max_epsilon``, ``privacy_refused`` (bool or 0/1) and ``privacy_reason``;
- ``privacy`` (client-level DP, the server's ledger): ``mode`` = "client", ``epsilon``, ``delta``,
  ``noise_multiplier``, ``sample_rate``, ``rounds``, ``accountant``.

``summary.json`` may hold ``privacy: {mode, max_epsilon, clusters: {cid: {stopped_round, reason,
[max_epsilon]}}}``. Outputs: ``privacy.json`` (``build_report``'s dict) and ``privacy.png`` (ε vs round).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nebula_fl.errors import NebulaError
from nebula_fl.server.run_folder import CONFIG, METRICS, SUMMARY, RunFolder, write_json

REPORT_JSON = "privacy.json"
REPORT_PNG = "privacy.png"
CLUSTER_FIELDS = ("epsilon", "dp_steps", "privacy_refused")


# -- reading -------------------------------------------------------------------------------------
def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    number = _number(value)
    return None if number is None or not math.isfinite(number) else int(number)


def _cluster_order(cid: str) -> tuple[int, int, str]:
    return (0, int(cid), cid) if cid.isdigit() else (1, 0, cid)


def _last_line_per_round(lines: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per round, the last written (a resumed run may have rewritten a round)."""
    by_round: dict[int, dict[str, Any]] = {}
    for line in lines:
        rnd = _int(line.get("round")) if isinstance(line, dict) else None
        if rnd is not None:
            by_round[rnd] = line
    return [by_round[r] for r in sorted(by_round)]


def _is_privacy_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and any(key in entry for key in CLUSTER_FIELDS)


def _cluster_row(rnd: int, entry: dict[str, Any]) -> dict[str, Any]:
    reason = entry.get("privacy_reason")
    return {
        "round": rnd,
        "epsilon": _number(entry.get("epsilon")),
        "delta": _number(entry.get("delta")),
        "noise_multiplier": _number(entry.get("noise_multiplier")),
        "sample_rate": _number(entry.get("sample_rate")),
        "steps": _int(entry.get("dp_steps")),
        "max_grad_norm": _number(entry.get("max_grad_norm")),
        "accountant": entry.get("accountant") if isinstance(entry.get("accountant"), str) else None,
        "refused": bool(entry.get("privacy_refused") or False),
        "reason": reason if isinstance(reason, str) else None,
    }


def _final(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, Any]:
    """The last round's values, each taken from the last row that has it (a refused round may carry fewer)."""
    final: dict[str, Any] = {"round": rows[-1]["round"] if rows else None}
    for key in keys:
        final[key] = next((row[key] for row in reversed(rows) if row.get(key) is not None), None)
    return final


def _verdict(cid: str, section: dict[str, Any]) -> str:
    eps = section["final"]["epsilon"]
    budget = section["max_epsilon"]
    shown = "-" if eps is None else f"{eps:.2f}"
    if budget is not None and eps is not None and eps > budget:
        head = f"cluster {cid}: final ε {shown} EXCEEDS its budget ε ≤ {budget:g}"
    elif budget is not None:
        head = f"cluster {cid}: final ε {shown} within its budget ε ≤ {budget:g}"
    else:
        head = f"cluster {cid}: final ε {shown} (no budget set)"
    if section["stopped_round"] is not None:
        head += f"; stopped at round {section['stopped_round']}"
        if section["stop_reason"]:
            head += f" ({section['stop_reason']})"
    return head


def build_report(run_dir: str | Path) -> dict[str, Any]:
    """The privacy report of ``run_dir`` as a JSON-able dict (what ``privacy.json`` holds)."""
    path = Path(run_dir).expanduser()
    if not path.is_dir():
        raise NebulaError(f"run folder '{path}' does not exist; pass the folder a `nebula-fl run` wrote (its --out)")
    folder = RunFolder(path)
    if not any((folder.path / name).exists() for name in (METRICS, SUMMARY, CONFIG)):
        raise NebulaError(f"'{path}' is not a nebula-fl run folder (no {METRICS}, {SUMMARY} or {CONFIG}); "
                          "pass the folder a `nebula-fl run` wrote")
    lines = _last_line_per_round(folder.rounds())
    summary = folder.read_summary()
    privacy = summary.get("privacy") if isinstance(summary.get("privacy"), dict) else {}
    stopped = privacy.get("clusters") if isinstance(privacy.get("clusters"), dict) else {}
    global_budget = _number(privacy.get("max_epsilon"))

    rows: dict[str, list[dict[str, Any]]] = {}
    budgets: dict[str, float] = {}
    client_rows: list[dict[str, Any]] = []
    for line in lines:
        rnd = int(line["round"])
        clusters = line.get("clusters") if isinstance(line.get("clusters"), dict) else {}
        for cid, entry in clusters.items():
            if _is_privacy_entry(entry):
                rows.setdefault(str(cid), []).append(_cluster_row(rnd, entry))
                if _number(entry.get("max_epsilon")) is not None:
                    budgets[str(cid)] = float(entry["max_epsilon"])
        server = line.get("privacy")
        if isinstance(server, dict) and "epsilon" in server:
            client_rows.append({
                "round": rnd, "epsilon": _number(server.get("epsilon")), "delta": _number(server.get("delta")),
                "noise_multiplier": _number(server.get("noise_multiplier")),
                "sample_rate": _number(server.get("sample_rate")), "rounds": _int(server.get("rounds")),
                "accountant": server.get("accountant") if isinstance(server.get("accountant"), str) else None,
            })
    if not rows and not client_rows:
        if privacy:
            raise NebulaError(f"run '{path}' has no privacy records yet (no round finished); "
                              "run or resume it for at least one round")
        raise NebulaError(f"run '{path}' has no privacy records (it ran without differential privacy)")

    clusters_out: dict[str, Any] = {}
    verdicts: list[str] = []
    ok = True
    for cid in sorted(rows, key=_cluster_order):
        cluster_rows = rows[cid]
        note = stopped.get(cid) if isinstance(stopped.get(cid), dict) else {}
        budget = _number(note.get("max_epsilon"))
        budget = budget if budget is not None else budgets.get(cid, global_budget)
        refused = [row["round"] for row in cluster_rows if row["refused"]]
        stopped_round = _int(note.get("stopped_round"))
        if stopped_round is None and refused:
            stopped_round = refused[0]
        reason = note.get("reason") if isinstance(note.get("reason"), str) else None
        if reason is None and stopped_round is not None:
            reason = next((row["reason"] for row in cluster_rows if row["round"] == stopped_round), None)
        final = _final(cluster_rows, ("epsilon", "delta", "noise_multiplier", "sample_rate", "steps",
                                      "max_grad_norm", "accountant"))
        within = None if budget is None or final["epsilon"] is None else final["epsilon"] <= budget
        ok = ok and within is not False
        section = {"final": final, "max_epsilon": budget, "within_budget": within, "stopped_round": stopped_round,
                   "stop_reason": reason, "refused_rounds": refused, "rounds": cluster_rows}
        clusters_out[cid] = section
        verdicts.append(_verdict(cid, section))

    client_out = None
    if client_rows:
        client_budget = _number(privacy.get("client_max_epsilon"))
        final = _final(client_rows, ("epsilon", "delta", "noise_multiplier", "sample_rate", "rounds", "accountant"))
        within = None if client_budget is None or final["epsilon"] is None else final["epsilon"] <= client_budget
        ok = ok and within is not False
        client_out = {"final": final, "max_epsilon": client_budget, "within_budget": within, "rounds": client_rows}
        eps = "-" if final["epsilon"] is None else f"{final['epsilon']:.2f}"
        verdicts.append(f"client-level (server): final ε {eps} over {final['rounds']} rounds"
                        + ("" if client_budget is None else f", budget ε ≤ {client_budget:g}"))

    mode = privacy.get("mode") if isinstance(privacy.get("mode"), str) else (
        "sample+client" if rows and client_rows else "sample" if rows else "client")
    return {"run": str(folder.path), "mode": mode, "max_epsilon": global_budget, "rounds": len(lines),
            "status": summary.get("status"), "ok": ok, "verdict": "; ".join(verdicts),
            "clusters": clusters_out, "client": client_out}


# -- writing -------------------------------------------------------------------------------------
def plot_privacy(report: dict[str, Any], path: Path) -> None:
    """ε vs round, one line per cluster (refused rounds marked ×), a dashed line per budget; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    budgets: dict[float, list[str]] = {}
    plotted: list[tuple[int, float]] = []
    for i, (cid, section) in enumerate(report["clusters"].items()):
        color = colors[i % len(colors)]
        points = [(row["round"], row["epsilon"]) for row in section["rounds"] if row["epsilon"] is not None]
        plotted += points
        if points:
            ax.plot(*zip(*points, strict=True), marker="o", color=color, label=f"cluster {cid}")
        refused = [(row["round"], row["epsilon"]) for row in section["rounds"]
                   if row["refused"] and row["epsilon"] is not None]
        if refused:
            ax.plot(*zip(*refused, strict=True), linestyle="none", marker="x", markersize=10, color=color)
        if section["max_epsilon"] is not None and math.isfinite(section["max_epsilon"]):
            budgets.setdefault(section["max_epsilon"], []).append(cid)
    client = report.get("client")
    if client:
        points = [(row["round"], row["epsilon"]) for row in client["rounds"] if row["epsilon"] is not None]
        plotted += points
        if points:
            ax.plot(*zip(*points, strict=True), marker="s", color="black", label="client-level (server)")
        if client["max_epsilon"] is not None and math.isfinite(client["max_epsilon"]):
            budgets.setdefault(client["max_epsilon"], []).append("server")
    cluster_ids = set(report["clusters"])
    for budget, owners in sorted(budgets.items()):
        if len(cluster_ids) > 1 and set(owners) >= cluster_ids:
            who = "all clusters" + (" and server" if "server" in owners else "")
        else:
            who = ", ".join(owner if owner == "server" else f"cluster {owner}" for owner in owners)
        ax.axhline(budget, linestyle="--", color="grey", linewidth=1)
        ax.annotate(f"budget ε ≤ {budget:g} ({who})", (0, budget), xycoords=("axes fraction", "data"),
                    textcoords="offset points", xytext=(4, 3), fontsize=8, color="grey")
    ax.set_xlabel("round")
    ax.set_ylabel("cumulative ε")
    shown = [eps for _, eps in plotted if math.isfinite(eps)] + list(budgets)
    top = max(shown, default=0.0)
    ax.set_ylim(0, 1.12 * top if top > 0 else 1.0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    ax.set_title(f"privacy spent (mode {report['mode']}; × = round refused)")
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)


def write_report(run_dir: str | Path, *, report: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write ``privacy.json`` and ``privacy.png`` into ``run_dir`` (each whole or not at all); returns their paths."""
    report = build_report(run_dir) if report is None else report
    folder = Path(report["run"])
    json_path, png_path = folder / REPORT_JSON, folder / REPORT_PNG
    write_json(json_path, report)
    plot_privacy(report, png_path)
    return json_path, png_path


# -- printing ------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_report(console: Console, report: dict[str, Any]) -> None:
    """A table per cluster (round, ε, δ, σ, q, cumulative steps, clip), the client-level one, and the verdict."""
    for cid, section in report["clusters"].items():
        final = section["final"]
        budget = "no budget" if section["max_epsilon"] is None else f"budget ε ≤ {section['max_epsilon']:g}"
        table = Table(title=f"cluster {cid}: sample-level DP ({final['accountant'] or '?'} accountant, {budget})")
        for name in ("round", "ε", "δ", "σ", "q", "steps", "clip", "note"):
            table.add_column(name, justify="left" if name == "note" else "right")
        for row in section["rounds"]:
            table.add_row(str(row["round"]), _fmt(row["epsilon"], ".4f"), _fmt(row["delta"], ".3g"),
                          _fmt(row["noise_multiplier"], ".4g"), _fmt(row["sample_rate"], ".4g"),
                          _fmt(row["steps"], "d"), _fmt(row["max_grad_norm"], ".4g"),
                          f"refused: {row['reason'] or 'budget'}" if row["refused"] else "")
        console.print(table)
    client = report.get("client")
    if client:
        final = client["final"]
        table = Table(title=f"client-level DP on the server ({final['accountant'] or '?'} accountant)")
        for name in ("round", "ε", "δ", "σ", "q", "rounds"):
            table.add_column(name, justify="right")
        for row in client["rounds"]:
            table.add_row(str(row["round"]), _fmt(row["epsilon"], ".4f"), _fmt(row["delta"], ".3g"),
                          _fmt(row["noise_multiplier"], ".4g"), _fmt(row["sample_rate"], ".4g"),
                          _fmt(row["rounds"], "d"))
        console.print(table)
    mark = "ok" if report["ok"] else "BUDGET EXCEEDED"
    console.print(f"privacy ({mark}): {report['verdict']}")


def privacy_report_main(run_dir: str, console: Console) -> int:
    """``nebula-fl privacy-report RUN_DIR``: build, write and print; 0, or 1 if a final ε exceeds its budget.

    A missing folder or a run without privacy records raises ``NebulaError`` (the CLI's exit status 2).
    """
    report = build_report(run_dir)
    json_path, png_path = write_report(run_dir, report=report)
    print_report(console, report)
    console.print(f"wrote {json_path} and {png_path}")
    return 0 if report["ok"] else 1
