"""A cluster audits itself: the privacy its data has spent, from its own ledger, without the server's files.

``nebula-fl privacy-report STATE_DIR`` (a trainer's ``--state-dir``) reads ``privacy-ledger.jsonl``
and ``privacy-policy.json`` there and recomputes ε release by release with the policy's accountant
at the policy's δ, for every federation this data was ever trained in. It writes ``privacy.json`` and
``privacy.png`` into STATE_DIR, the names a run folder's report has (each whole or not at all).

Each row: ``steps`` is what the release alone accounted (DP-SGD steps, or 1 noised update), ``steps_total``
the total so far; ``epsilon`` the total ε so far, ``epsilon_spent`` what the release alone added; ``no_budget``
that the cluster's policy set no budget when it made it (mode 'off': it ran whatever DP the server asked).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console

from nebula_fl.errors import NebulaError
from nebula_fl.privacy.cluster_ledger import LEDGER_FILE, ClusterLedger
from nebula_fl.privacy.ledger import epsilon_of, merge_entry
from nebula_fl.privacy.policy import POLICY_FILE, PrivacyPolicy
from nebula_fl.reports import privacy_plot as plot
from nebula_fl.reports.privacy_report import table
from nebula_fl.storage.run_folder import write_json

REPORT_JSON = "privacy.json"
REPORT_PNG = "privacy.png"
NO_BUDGET = ("no budget: the policy was 'off', so this cluster ran whatever differential privacy the server asked, "
             "with no ε cap of its own")


def is_cluster_state(path: Path) -> bool:
    return (path / LEDGER_FILE).exists() or (path / POLICY_FILE).exists()


def build_cluster_report(state_dir: str | Path, *, num_examples: int | None = None) -> dict[str, Any]:
    path = Path(state_dir).expanduser().resolve()
    if not is_cluster_state(path):
        raise NebulaError(f"'{path}' holds no privacy ledger; pass a trainer's --state-dir (or a run folder)")
    policy = PrivacyPolicy.load(path / POLICY_FILE) if (path / POLICY_FILE).exists() else PrivacyPolicy()
    ledger = ClusterLedger(path=path / LEDGER_FILE, accountant=policy.accountant)
    delta = policy.delta
    modes: dict[str, Any] = {}
    order = {(e["federation"], e["round"], e["mode"]): i for i, e in enumerate(ledger.entries(), start=1)}
    for mode in ("sample", "client"):
        entries = ledger.entries(mode=mode)
        if not entries:
            continue
        at = delta if delta is not None else min(float(e["delta"]) for e in entries)
        rows, history, before, total = [], [], 0.0, 0
        for e in entries:
            merge_entry(history, (float(e["noise_multiplier"]), float(e["sample_rate"]), int(e["steps"])))
            eps = epsilon_of(list(history), accountant=ledger.accountant, delta=at)
            total += int(e["steps"])
            rows.append({"release": order[(e["federation"], e["round"], mode)], "federation": e["federation"],
                         "round": e["round"], "time": e.get("time"),
                         "noise_multiplier": e["noise_multiplier"], "sample_rate": e["sample_rate"],
                         "steps": e["steps"], "steps_total": total, "epsilon_spent": max(eps - before, 0.0),
                         "epsilon": eps, "no_budget": e.get("no_budget") is True})
            before = eps
        final = rows[-1]["epsilon"]
        budget = policy.budget if policy.mode == mode else None
        modes[mode] = {"delta": at, "epsilon": final, "max_epsilon": budget,
                       "within_budget": None if budget is None else final <= budget,
                       "releases": len(rows), "steps_total": total,
                       "no_budget_releases": sum(row["no_budget"] for row in rows),
                       "federations": sorted({r["federation"] for r in rows}), "rows": rows}
    ok = all(m["within_budget"] is not False for m in modes.values())
    return {"state_dir": str(path), "policy": policy.to_dict(), "accountant": ledger.accountant, "ok": ok,
            "modes": modes}


def figure_of(report: dict[str, Any]) -> plot.Figure:
    """This cluster's figure: ε release by release, one series per mode (each protects its own unit)."""
    modes = report["modes"]
    rows = [row for section in modes.values() for row in section["rows"]]
    federations = list(dict.fromkeys(row["federation"] for row in sorted(rows, key=lambda row: row["release"])))
    one_federation = len(federations) == 1
    # one federation: x is the round, as in the run's own report; more: the release, in the ledger's order
    x_of = "round" if one_federation else "release"
    ticks = {} if one_federation else {row["release"]: f"{row['round']}\n{row['federation'][:8]}" for row in rows}
    series, caption = [], []
    for mode, section in modes.items():
        label = "this cluster" if len(modes) == 1 else f"{mode}-level ({plot.UNIT[mode]})"
        series.append(plot.Series(
            label=label, x=tuple(r[x_of] for r in section["rows"]),
            epsilon=tuple(r["epsilon"] for r in section["rows"]),
            spent=tuple(r["epsilon_spent"] for r in section["rows"]),
            steps=tuple(r["steps"] for r in section["rows"]), budget=section["max_epsilon"]))
        caption.append(plot.unit_sentence(mode))
    deltas = {section["delta"] for section in modes.values()}
    caption.append(plot.delta_sentence(deltas.pop()) if len(deltas) == 1 else
                   "δ: " + ", ".join(f"{plot.delta_sentence(s['delta'])} ({m})" for m, s in modes.items()))
    how = plot.ACCOUNTANT.get(report["accountant"], report["accountant"])
    for mode, section in modes.items():
        sigmas = sorted({r["noise_multiplier"] for r in section["rows"]})
        rates = sorted({r["sample_rate"] for r in section["rows"]})
        sigma = f"{sigmas[0]:.3g}" if len(sigmas) == 1 else f"{sigmas[0]:.3g} to {sigmas[-1]:.3g}"
        rate = f"{rates[0]:.3g}" if len(rates) == 1 else f"{rates[0]:.3g} to {rates[-1]:.3g}"
        what = ("every training step clipped each example's gradient and added Gaussian noise of "
                f"σ = {sigma} × the clipping norm, each step drawing a random share q = {rate} of the examples"
                if mode == "sample" else
                f"every release was one update, clipped and noised with σ = {sigma} × the clipping norm "
                "(no sampling discount: who takes part is the server's choice)")
        caption.append(f"Recomputed from this cluster's own ledger by {how}: {what}.")
    if any(s.budget is not None for s in series):
        caption.append("The red dashed line is this cluster's budget: it refuses any release that would pass it.")
    unbudgeted = sum(section["no_budget_releases"] for section in modes.values())
    if unbudgeted:
        caption.append(f"{unbudgeted} release(s) were made with {NO_BUDGET}.")
    x_name = "round" if one_federation else "release"
    for mode, s in zip(modes, series, strict=True):
        caption.append(plot.first_round_note([s], x_name=x_name, step="update" if mode == "client" else "step"))
    where = "federation " + federations[0] if one_federation else f"{len(federations)} federations, in order"
    path = Path(report["state_dir"])
    return plot.Figure(series=tuple(series), title=f"Privacy this cluster's data has spent — {path.parent.name}/"
                       f"{path.name} ({where})", caption=tuple(caption),
                       y_unit=plot.UNIT[next(iter(modes))] if len(modes) == 1 else "see each label",
                       x_name=x_name, x_label="" if one_federation else "release: round, federation",
                       tick_labels=ticks)


def write_cluster_report(report: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``privacy.json`` and ``privacy.png`` into the state folder (each whole or not at all)."""
    folder = Path(report["state_dir"])
    json_path, png_path = folder / REPORT_JSON, folder / REPORT_PNG
    write_json(json_path, report)
    if report["modes"]:
        plot.save(figure_of(report), png_path)
    else:
        plot.save(plot.draw_message("Privacy this cluster's data has spent",
                                    "No release recorded: this cluster's data has spent no privacy."), png_path)
    return json_path, png_path


def release_headers(mode: str, *, notes: bool = False) -> tuple[str, ...]:
    """The columns of a mode's table: "steps" is the release's own, "steps total" the total so far; `notes`: a
    last column marks the releases made with no budget."""
    steps = "steps" if mode == "sample" else "updates"
    return ("federation", "round", "σ", "q", steps, f"{steps} total", "ε spent", "ε total") + (
        ("note",) if notes else ())


def print_cluster_report(console: Console, report: dict[str, Any]) -> None:
    console.print(f"privacy policy: {report['policy'] or {'mode': 'off'}}")
    if not report["modes"]:
        console.print("no release recorded: this cluster's data has spent no privacy")
    for mode, section in report["modes"].items():
        budget = "no budget" if section["max_epsilon"] is None else f"budget ε ≤ {section['max_epsilon']:g}"
        notes = section["no_budget_releases"] > 0
        rows = [(row["federation"], str(row["round"]), f"{row['noise_multiplier']:.4g}", f"{row['sample_rate']:.4g}",
                 str(row["steps"]), str(row["steps_total"]), f"{row['epsilon_spent']:.4f}", f"{row['epsilon']:.4f}")
                + (("no budget" if row["no_budget"] else "",) if notes else ())
                for row in section["rows"]]
        console.print(table(f"{mode}-level releases, {plot.UNIT[mode]} ({report['accountant']} at "
                            f"δ = {section['delta']:g}, {budget})", release_headers(mode, notes=notes), rows))
        if notes:
            console.print(f"{mode}: {section['no_budget_releases']} release(s) with {NO_BUDGET}")
        verdict = "" if section["within_budget"] is None else (
            " (within budget)" if section["within_budget"] else " (BUDGET EXCEEDED)")
        console.print(f"{mode}: ε = {section['epsilon']:.4f} over {section['releases']} release(s) in "
                      f"{len(section['federations'])} federation(s){verdict}")


def cluster_report_main(state_dir: str, console: Console) -> int:
    """``nebula-fl privacy-report STATE_DIR``: build, write, print; 0, or 1 if ε is over the policy's budget."""
    report = build_cluster_report(state_dir)
    json_path, png_path = write_cluster_report(report)
    print_cluster_report(console, report)
    console.print(f"wrote {json_path} and {png_path}")
    return 0 if report["ok"] else 1
