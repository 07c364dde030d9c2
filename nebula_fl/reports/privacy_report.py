"""The privacy report of a run folder: ε per cluster per round, the budgets, and where and why a cluster stopped.

It reads only what the run wrote (``metrics.jsonl`` and ``summary.json``, see
``nebula_fl/storage/run_folder.py``); it recomputes nothing, so it shows the ε the clusters enforced.

Inputs, per round line of ``metrics.jsonl``:

- ``clusters[cid]`` (each cluster's own lifetime ledger): ``epsilon`` and ``dp_steps`` (both totals over
  the ledger's life), ``epsilon_federation`` (this federation's alone), ``delta``, ``noise_multiplier``,
  ``sample_rate``, ``max_grad_norm``, ``accountant``, ``privacy_mode`` ("sample": DP-SGD steps per example;
  "client": one noised update per round, per cluster data set), optionally ``max_epsilon``,
  ``privacy_refused`` (bool or 0/1), ``privacy_reason`` and ``privacy_no_budget`` (1: the cluster's own policy
  is 'off', so it runs whatever DP the server asks with no ε cap of its own; said under secure aggregation too);
- ``privacy`` (client-level DP, the server's ledger): ``mode`` = "client", ``epsilon``, ``delta``,
  ``noise_multiplier``, ``sample_rate``, ``rounds``, ``accountant``.

``summary.json`` may hold ``privacy: {mode, max_epsilon, clusters: {cid: {stopped_round, reason,
[max_epsilon]}}}``. Outputs: ``privacy.json`` (``build_report``'s dict) and ``privacy.png`` (``plot.py``).

Each row has one meaning per field: ``epsilon`` and ``steps_total`` are totals so far, ``epsilon_spent`` and
``steps`` what that round alone added (None where unknown: a ledger that spent before this run's first round).
For client-level DP a step is one noised update (``rounds`` / ``rounds_total`` on the server's rows).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nebula_fl.errors import NebulaError
from nebula_fl.reports import privacy_plot as plot
from nebula_fl.storage.run_folder import CONFIG, METRICS, SUMMARY, RunFolder, write_json

REPORT_JSON = "privacy.json"
REPORT_PNG = "privacy.png"
CLUSTER_FIELDS = ("epsilon", "dp_steps", "privacy_refused", "privacy_no_budget")
NO_BUDGET = "its policy is 'off': it runs whatever differential privacy the server asks, with no ε cap of its own"


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
        "epsilon_spent": None,
        "delta": _number(entry.get("delta")),
        "noise_multiplier": _number(entry.get("noise_multiplier")),
        "sample_rate": _number(entry.get("sample_rate")),
        "steps": None,
        "steps_total": _int(entry.get("dp_steps")),
        "max_grad_norm": _number(entry.get("max_grad_norm")),
        "accountant": entry.get("accountant") if isinstance(entry.get("accountant"), str) else None,
        "refused": bool(entry.get("privacy_refused") or False),
        "reason": reason if isinstance(reason, str) else None,
        "no_budget": bool(entry.get("privacy_no_budget") or False),
        "_federation_epsilon": _number(entry.get("epsilon_federation")),
    }


def _fill_per_round(rows: list[dict[str, Any]], *, total: str, per_round: str) -> None:
    """``epsilon_spent`` and ``per_round`` of each row: what it added to the previous row's totals.

    The first row starts from zero unless its ``_federation_epsilon`` (this federation's ε alone) is below its
    lifetime ε: then the ledger had spent before this run, by an amount these rows cannot tell, so it stays None.
    """
    before_eps: float | None = 0.0
    before_total: int | None = 0
    first = rows[0] if rows else None
    if first is not None and first.get("_federation_epsilon") is not None and first["epsilon"] is not None \
            and not math.isclose(first["_federation_epsilon"], first["epsilon"], rel_tol=1e-9, abs_tol=1e-12):
        before_eps = before_total = None
    for row in rows:
        eps, count = row["epsilon"], row[total]
        row["epsilon_spent"] = None if eps is None or before_eps is None else max(eps - before_eps, 0.0)
        row[per_round] = None if count is None or before_total is None else max(count - before_total, 0)
        if eps is not None:
            before_eps = eps
        if count is not None:
            before_total = count
    for row in rows:
        row.pop("_federation_epsilon", None)


def _mode_of(entry: dict[str, Any], fallback: str) -> str:
    mode = entry.get("privacy_mode")
    return mode if mode in ("sample", "client") else fallback


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
    elif section["no_budget"]:
        head = f"cluster {cid}: final ε {shown}, NO BUDGET"
    else:
        head = f"cluster {cid}: final ε {shown} (no budget set)"
    if section["no_budget"]:
        head += f" ({NO_BUDGET}" + ("" if budget is None else ", only the one the server asks") + ")"
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

    run_mode = privacy.get("mode") if privacy.get("mode") in ("sample", "client") else "client" if any(
        isinstance(line.get("privacy"), dict) and line["privacy"].get("mode") == "client" for line in lines) else "sample"
    rows: dict[str, list[dict[str, Any]]] = {}
    modes: dict[str, str] = {}
    budgets: dict[str, float] = {}
    client_rows: list[dict[str, Any]] = []
    for line in lines:
        rnd = int(line["round"])
        clusters = line.get("clusters") if isinstance(line.get("clusters"), dict) else {}
        for cid, entry in clusters.items():
            if _is_privacy_entry(entry):
                rows.setdefault(str(cid), []).append(_cluster_row(rnd, entry))
                modes[str(cid)] = _mode_of(entry, run_mode)
                if _number(entry.get("max_epsilon")) is not None:
                    budgets[str(cid)] = float(entry["max_epsilon"])
        server = line.get("privacy")
        if isinstance(server, dict) and "epsilon" in server:
            client_rows.append({
                "round": rnd, "epsilon": _number(server.get("epsilon")), "epsilon_spent": None,
                "delta": _number(server.get("delta")), "noise_multiplier": _number(server.get("noise_multiplier")),
                "sample_rate": _number(server.get("sample_rate")), "rounds": None,
                "rounds_total": _int(server.get("rounds")),
                "accountant": server.get("accountant") if isinstance(server.get("accountant"), str) else None,
            })
    for cluster_rows in rows.values():
        _fill_per_round(cluster_rows, total="steps_total", per_round="steps")
    _fill_per_round(client_rows, total="rounds_total", per_round="rounds")
    if not rows and not client_rows:
        if privacy.get("mode"):  # the server wrote its section (the launcher may add membership notes alone)
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
        final = _final(cluster_rows, ("epsilon", "delta", "noise_multiplier", "sample_rate", "steps_total",
                                      "max_grad_norm", "accountant"))
        within = None if budget is None or final["epsilon"] is None else final["epsilon"] <= budget
        ok = ok and within is not False
        section = {"mode": modes[cid], "final": final, "max_epsilon": budget, "within_budget": within,
                   "no_budget": any(row["no_budget"] for row in cluster_rows),
                   "stopped_round": stopped_round, "stop_reason": reason, "refused_rounds": refused,
                   "rounds": cluster_rows}
        clusters_out[cid] = section
        verdicts.append(_verdict(cid, section))

    client_out = None
    if client_rows:
        client_budget = _number(privacy.get("client_max_epsilon"))
        final = _final(client_rows, ("epsilon", "delta", "noise_multiplier", "sample_rate", "rounds_total",
                                     "accountant"))
        within = None if client_budget is None or final["epsilon"] is None else final["epsilon"] <= client_budget
        ok = ok and within is not False
        client_out = {"final": final, "max_epsilon": client_budget, "within_budget": within, "rounds": client_rows}
        eps = "-" if final["epsilon"] is None else f"{final['epsilon']:.2f}"
        verdicts.append(f"client-level (server): final ε {eps} over {final['rounds_total']} rounds"
                        + ("" if client_budget is None else f", budget ε ≤ {client_budget:g}"))

    mode = privacy.get("mode") if isinstance(privacy.get("mode"), str) else (
        "sample+client" if rows and client_rows else "sample" if rows else "client")
    return {"run": str(folder.path), "mode": mode, "max_epsilon": global_budget, "rounds": len(lines),
            "status": summary.get("status"), "ok": ok, "verdict": "; ".join(verdicts),
            "clusters": clusters_out, "client": client_out}


# -- writing -------------------------------------------------------------------------------------
def _series(label: str, section: dict[str, Any], *, per_round: str) -> plot.Series:
    rows = section["rounds"]
    return plot.Series(label=label, x=tuple(r["round"] for r in rows), epsilon=tuple(r["epsilon"] for r in rows),
                       spent=tuple(r["epsilon_spent"] for r in rows), steps=tuple(r[per_round] for r in rows),
                       refused=tuple(bool(r.get("refused")) for r in rows), budget=section["max_epsilon"])


def figure_of(report: dict[str, Any]) -> plot.Figure:
    """The privacy figure of a run report: one series per cluster, and the server's client-level account."""
    clusters = report["clusters"]
    series = [_series(f"cluster {cid}", section, per_round="steps") for cid, section in clusters.items()]
    client = report.get("client")
    if client:
        series.append(_series("server (the aggregate)", client, per_round="rounds"))
    modes = {section["mode"] for section in clusters.values()} | ({"client"} if client else set())
    mode = modes.pop() if len(modes) == 1 else None
    finals = {f"cluster {cid}": section["final"] for cid, section in clusters.items()}
    if client:
        finals["server"] = client["final"]
    deltas = {final["delta"] for final in finals.values() if final["delta"] is not None}
    accountants = {final["accountant"] for final in finals.values() if final["accountant"]}
    caption = []
    if mode is not None:
        caption.append(plot.unit_sentence(mode))
    if len(deltas) == 1:
        caption.append(plot.delta_sentence(deltas.pop()))
    elif deltas:
        caption.append(f"δ (the small chance that the ε bound does not hold): "
                       f"{plot.distinct({k: f['delta'] for k, f in finals.items()}, '.3g')}.")
    how = (f"Counted by {plot.ACCOUNTANT.get(next(iter(accountants)), next(iter(accountants)))}"
           if len(accountants) == 1 else "Counted by Opacus's accountants")
    sigma = plot.distinct({k: f["noise_multiplier"] for k, f in finals.items()}, ".3g")
    rate = plot.distinct({k: f["sample_rate"] for k, f in finals.items()}, ".3g")
    if mode == "client":
        sampled = ("every cluster takes part in every round (q = 1)" if rate == "1"
                   else f"the server samples a share q = {rate} of the clusters each round")
        caption.append(f"{how}: each round every cluster clips its update and adds Gaussian noise of σ = {sigma} "
                       f"× the clipping norm; {sampled}.")
    else:
        clip = plot.distinct({k: f.get("max_grad_norm") for k, f in finals.items()}, ".3g")
        caption.append(f"{how}: every training step clips each example's gradient to norm {clip} and adds "
                       f"Gaussian noise of σ = {sigma} × that norm; each step draws a random share q = {rate} "
                       "of the cluster's examples.")
    if any(s.budget is not None for s in series):
        caption.append("The red dashed line is the budget: a cluster refuses any round that would carry its ε past it.")
    unbudgeted = [cid for cid, section in clusters.items() if section.get("no_budget")]
    if unbudgeted:
        caption.append(f"No budget: cluster {', '.join(unbudgeted)} set none; a cluster whose policy is 'off' runs "
                       "whatever differential privacy the server asks, with no ε cap of its own.")
    caption.append(plot.first_round_note(series, step="update" if mode == "client" else "step"))
    if any(section["rounds"] and section["rounds"][0]["epsilon_spent"] is None
           and section["rounds"][0]["epsilon"] is not None for section in clusters.values()):
        caption.append("ε is each cluster's lifetime total: a cluster without a round-1 bar had spent privacy "
                       "in earlier federations (`nebula-fl privacy-report STATE_DIR` on its folder lists them).")
    unit = plot.UNIT[mode] if mode else "see each label"
    return plot.Figure(series=tuple(series), title=f"Privacy spent by each cluster's data — {Path(report['run']).name}",
                       caption=tuple(caption), y_unit=unit)


def write_report(run_dir: str | Path, *, report: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write ``privacy.json`` and ``privacy.png`` into ``run_dir`` (each whole or not at all); returns their paths."""
    report = build_report(run_dir) if report is None else report
    folder = Path(report["run"])
    json_path, png_path = folder / REPORT_JSON, folder / REPORT_PNG
    write_json(json_path, report)
    plot.save(figure_of(report), png_path)
    return json_path, png_path


# -- printing ------------------------------------------------------------------------------------
def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


STEP_HEADERS = {"sample": ("steps", "steps total"), "client": ("updates", "updates total")}


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[str]]) -> Table:
    """A table whose cells are never cut short (a header's words go one a line), but for a "note" column."""
    out = Table(title=title)
    for i, name in enumerate(headers):
        widest = max((len(row[i]) for row in rows), default=1)
        out.add_column(name.replace(" ", "\n"), justify="left" if name in ("note", "federation") else "right",
                       min_width=None if name == "note" else widest)
    for row in rows:
        out.add_row(*row)
    return out


def tables(report: dict[str, Any]) -> list[Table]:
    """A table per cluster and the server's client-level one, one meaning per column.

    "ε spent" and "steps" are what the round alone added, "ε total" and "steps total" the totals so far.
    """
    out = []
    for cid, section in report["clusters"].items():
        final, mode = section["final"], section["mode"]
        budget = "no budget" if section["max_epsilon"] is None else f"budget ε ≤ {section['max_epsilon']:g}"
        if section.get("no_budget"):
            budget += ", none of its own: policy 'off'" if section["max_epsilon"] is not None else " (policy 'off')"
        steps, steps_total = STEP_HEADERS[mode]
        notes = any(row["refused"] for row in section["rounds"])
        headers = ("round", "ε spent", "ε total", "δ", "σ", "q", steps, steps_total, "clip") + (
            ("note",) if notes else ())
        rows = [(str(row["round"]), _fmt(row["epsilon_spent"], ".4f"), _fmt(row["epsilon"], ".4f"),
                 _fmt(row["delta"], ".3g"), _fmt(row["noise_multiplier"], ".4g"), _fmt(row["sample_rate"], ".4g"),
                 _fmt(row["steps"], "d"), _fmt(row["steps_total"], "d"), _fmt(row["max_grad_norm"], ".4g"))
                + ((f"refused: {row['reason'] or 'budget'}" if row["refused"] else "",) if notes else ())
                for row in section["rounds"]]
        out.append(table(f"cluster {cid}: {mode}-level DP, {plot.UNIT[mode]} "
                         f"({final['accountant'] or '?'} accountant, {budget})", headers, rows))
    client = report.get("client")
    if client:
        final = client["final"]
        rows = [(str(row["round"]), _fmt(row["epsilon_spent"], ".4f"), _fmt(row["epsilon"], ".4f"),
                 _fmt(row["delta"], ".3g"), _fmt(row["noise_multiplier"], ".4g"), _fmt(row["sample_rate"], ".4g"),
                 _fmt(row["rounds_total"], "d")) for row in client["rounds"]]
        out.append(table(f"client-level DP on the server, the aggregate ({final['accountant'] or '?'} accountant)",
                         ("round", "ε spent", "ε total", "δ", "σ", "q", "rounds total"), rows))
    return out


def print_report(console: Console, report: dict[str, Any]) -> None:
    """The tables, then the verdict."""
    for each in tables(report):
        console.print(each)
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
