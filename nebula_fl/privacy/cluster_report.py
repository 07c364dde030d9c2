"""A cluster audits itself: the privacy its data has spent, from its own ledger, without the server's files.

``nebula-fl privacy-report STATE_DIR`` (a trainer's ``--state-dir``) reads ``privacy-ledger.jsonl``
and ``privacy-policy.json`` there and recomputes ε release by release with the policy's accountant
at the policy's δ, for every federation this data was ever trained in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from nebula_fl.errors import NebulaError
from nebula_fl.privacy.cluster_ledger import LEDGER_FILE, ClusterLedger
from nebula_fl.privacy.ledger import epsilon_of, merge_entry
from nebula_fl.privacy.policy import POLICY_FILE, PrivacyPolicy
from nebula_fl.server.run_folder import write_json

REPORT_JSON = "privacy-report.json"


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
    for mode in ("sample", "client"):
        entries = ledger.entries(mode=mode)
        if not entries:
            continue
        at = delta if delta is not None else min(float(e["delta"]) for e in entries)
        rows, history = [], []
        for e in entries:
            merge_entry(history, (float(e["noise_multiplier"]), float(e["sample_rate"]), int(e["steps"])))
            rows.append({"federation": e["federation"], "round": e["round"], "time": e.get("time"),
                         "noise_multiplier": e["noise_multiplier"], "sample_rate": e["sample_rate"],
                         "steps": e["steps"],
                         "epsilon": epsilon_of(list(history), accountant=ledger.accountant, delta=at)})
        final = rows[-1]["epsilon"]
        budget = policy.budget if policy.mode == mode else None
        modes[mode] = {"delta": at, "epsilon": final, "max_epsilon": budget,
                       "within_budget": None if budget is None else final <= budget,
                       "releases": len(rows), "steps": sum(r["steps"] for r in rows),
                       "federations": sorted({r["federation"] for r in rows}), "rows": rows}
    ok = all(m["within_budget"] is not False for m in modes.values())
    return {"state_dir": str(path), "policy": policy.to_dict(), "accountant": ledger.accountant, "ok": ok,
            "modes": modes}


def print_cluster_report(console: Console, report: dict[str, Any]) -> None:
    console.print(f"privacy policy: {report['policy'] or {'mode': 'off'}}")
    if not report["modes"]:
        console.print("no release recorded: this cluster's data has spent no privacy")
    for mode, section in report["modes"].items():
        unit = "per example" if mode == "sample" else "per cluster data set"
        budget = "no budget" if section["max_epsilon"] is None else f"budget ε ≤ {section['max_epsilon']:g}"
        table = Table(title=f"{mode}-level releases ({unit}; {report['accountant']} at δ = {section['delta']:g}, {budget})")
        for name in ("federation", "round", "σ", "q", "steps", "cumulative ε"):
            table.add_column(name, justify="left" if name == "federation" else "right")
        for row in section["rows"]:
            table.add_row(row["federation"], str(row["round"]), f"{row['noise_multiplier']:.4g}",
                          f"{row['sample_rate']:.4g}", str(row["steps"]), f"{row['epsilon']:.4f}")
        console.print(table)
        verdict = "" if section["within_budget"] is None else (
            " (within budget)" if section["within_budget"] else " (BUDGET EXCEEDED)")
        console.print(f"{mode}: ε = {section['epsilon']:.4f} over {section['releases']} release(s) in "
                      f"{len(section['federations'])} federation(s){verdict}")


def cluster_report_main(state_dir: str, console: Console) -> int:
    report = build_cluster_report(state_dir)
    target = Path(report["state_dir"]) / REPORT_JSON
    write_json(target, report)
    print_cluster_report(console, report)
    console.print(f"wrote {target}")
    return 0 if report["ok"] else 1
