"""The adversary campaign as a fuzz target: a lying server searches multi-round schedules against real cluster stages.

Each schedule is played on n real SecAggStage instances (restored from a cached key setup) by tests/secagg_campaign.py;
the server's knowledge is then rebuilt from the real bytes (self seeds, mask keys, revealed and derived pair keys),
judged by the closure checker (tests/secagg_closure.py), and every single update or sub-threshold sum it reports
determined is computed from the real uploads and compared with the truth. Two searches per setting, each run on the
control (rotate_keys=False: one mask key an epoch, which must leak) and on the protocol (a key bound to one round,
which must not): seeded random schedules, and an exhaustive sweep of 3-round schedules over a menu of per-round moves
(round set, view pattern, forwarding, key naming, recover timing; it holds the issue-30 schedule and its stale-key
variant). The fixed schedules (issue 30, its stale-key variants, the control's finding) are played too.

    .venv/bin/python -m tests.secagg_campaign_report             # 200 random schedules a setting, 14-move sweep
    .venv/bin/python -m tests.secagg_campaign_report --quick     # 40 random a setting, 6-move sweep, ~2 min
    .venv/bin/python -m tests.secagg_campaign_report --schedules 2000 --seed 7

Prints a table and the first findings, writes results.json (default benchmarks/results/secagg_campaign/), and exits
0 even when the protocol leaks: it is a report; tests/test_secagg_campaign.py runs a short pass as the gate. It lives
beside the driver and the tests that gate it (it plays schedules on the cluster's own stages); run it from the
repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from tests.secagg_campaign import (
    MEDIUM_MENU,
    ROUNDS,
    SMALL_MENU,
    Setting,
    Tally,
    control_schedule,
    issue30_schedule,
    play,
    refusals,
    search_random,
    sweep,
    sweep_size,
)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "secagg_campaign" / "results.json"
RANDOM_SETTINGS = [Setting(3, 2), Setting(4, 3), Setting(5, 3), Setting(5, 2, num_shares=3), Setting(3, 2, epochs=2),
                   Setting(4, 3, colluders=("3",)), Setting(5, 4, colluders=("4",)), Setting(4, 3, premade=False)]
"""Shapes searched at random: the complete graph at three sizes, a sparse one (num-shares 3: a ring of 5), two
epochs, a colluder within the bound (t > (holders + c) / 2) at two sizes, mask keys made as the uploads go."""
SWEEP_SETTINGS = [Setting(3, 2), Setting(4, 3)]
FIXED_SETTINGS = [Setting(3, 2), Setting(4, 3), Setting(5, 3)]


def variant(setting: Setting, rotate: bool) -> Setting:
    return Setting(setting.n, setting.t, setting.num_shares, setting.colluders, rotate, setting.epochs, setting.premade)


def shape(setting: Setting) -> str:
    extra = ", ring" if setting.num_shares else ""
    extra += ", 2 epochs" if setting.epochs > 1 else ""
    extra += ", lazy keys" if not setting.premade else ""
    return f"{setting.n}/{setting.t}/{len(setting.colluders)}{extra}"


def findings_cell(tally: Tally, *, must_leak: bool) -> str:
    text = f"{tally.leaking} ({tally.real})"
    bad = (tally.leaking == 0) if must_leak else (tally.leaking > 0 or tally.errors)
    return f"[red]{text}[/red]" if bad else text


def fixed_schedules(console: Any) -> list[dict[str, Any]]:
    out = []
    for base in FIXED_SETTINGS:
        for rotate in (False, True):
            setting = variant(base, rotate)
            for schedule in (issue30_schedule(setting), issue30_schedule(setting, stale="stale"),
                             issue30_schedule(setting, stale="relabel"), control_schedule(setting)):
                run, verdict = play(setting, schedule)
                out.append({"setting": setting.label, "schedule": schedule.label, "keys_rebuilt": verdict.keys,
                            "singles": list(verdict.report.singles), "violations": len(verdict.report.violations),
                            "real": [r.what for r in verdict.real], "refusals": refusals(run)[:6]})
                if verdict.leaks and rotate:
                    console.print(f"[red]PROTOCOL LEAK[/red] {setting.label}: {schedule.label}\n{verdict.report}",
                                  markup=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="40 random schedules a setting and the 6-move sweep")
    parser.add_argument("--schedules", type=int, help="random schedules per setting and variant (default 200; "
                        "--quick: 40)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random schedules (default 0)")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results.json path")
    args = parser.parse_args(argv)
    count = args.schedules if args.schedules is not None else 40 if args.quick else 200
    menu, menu_name = (SMALL_MENU, "6-move") if args.quick else (MEDIUM_MENU, "14-move")
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    started = time.perf_counter()

    rows: list[dict[str, Any]] = []
    searches = [("random", s, None) for s in RANDOM_SETTINGS] + [("sweep", s, [menu] * ROUNDS) for s in SWEEP_SETTINGS]
    for kind, base, menus in searches:
        tallies = {}
        for rotate in (False, True):
            setting = variant(base, rotate)
            what = f"seed {args.seed}" if kind == "random" else f"{menu_name} menu, {sweep_size(menus)} schedules"
            console.print(f"{kind} {setting.label}: {what} ...")
            if kind == "random":
                tallies[rotate] = search_random(setting, schedules=count, seed=args.seed)
            else:
                tallies[rotate] = sweep(setting, menus)
        rounds = f"{ROUNDS}" + (" + 2" if base.epochs > 1 else "")
        rows.append({"search": f"sweep {menu_name}" if kind == "sweep" else f"random s{args.seed}", "shape": shape(base),
                     "rounds": rounds, "control": tallies[False], "protocol": tallies[True]})
    fixed = fixed_schedules(console)
    elapsed = time.perf_counter() - started

    table = Table(title=f"secagg adversary campaign: {'quick' if args.quick else 'full'} run, seed {args.seed} "
                  "(control / protocol; leaks: schedules determining something below t, of them with a real recovery)")
    for column in ("search", "n/t/colluders", "rounds", "schedules", "answered", "keys rebuilt", "pairs derived",
                   "control leaks", "protocol leaks", "errors", "s"):
        table.add_column(column, justify="left" if column in ("search", "n/t/colluders") else "right")
    for row in rows:
        ctl, pro = row["control"], row["protocol"]
        table.add_row(row["search"], row["shape"], row["rounds"], f"{ctl.schedules:,} + {pro.schedules:,}",
                      f"{ctl.accepted + pro.accepted:,} / {ctl.messages + pro.messages:,}",
                      f"{ctl.keys_rebuilt:,} / {pro.keys_rebuilt:,}", f"{ctl.pairs_derived:,} / {pro.pairs_derived:,}",
                      findings_cell(ctl, must_leak=True), findings_cell(pro, must_leak=False),
                      f"[red]{len(pro.errors)}[/red]" if pro.errors else "0", f"{ctl.seconds + pro.seconds:.1f}")
    total = sum(r["control"].schedules + r["protocol"].schedules for r in rows)
    leaks = sum(r["protocol"].leaking for r in rows) + sum(bool(f["violations"]) for f in fixed
                                                           if "(protocol)" in f["setting"])
    control_real = sum(r["control"].real for r in rows)
    table.add_row("total", "", "", f"{total:,}", "", "", "", f"{control_real} real", str(leaks), "", f"{elapsed:.1f}")
    console.print(table)
    for f in fixed:
        console.print(f"fixed {f['setting']}: {f['schedule'].split(':')[0]}: keys rebuilt {f['keys_rebuilt']}, "
                      f"real recoveries {f['real'] or 'none'}" + (f"; {f['refusals'][0]}" if f["refusals"] else ""),
                      markup=False)
    for row in rows:
        pro = row["protocol"]
        for finding in pro.findings[:3]:
            console.print(f"[red]PROTOCOL LEAK[/red] {pro.setting.label}:", markup=True)
            console.print(f"{finding['report']}\n{finding['schedule']}", markup=False)
        for line in pro.errors[:3]:
            console.print(f"protocol error (not a refusal): {line}", markup=False)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "schedules": total, "protocol_leaks": leaks, "control_real_recoveries": control_real,
        "seconds": round(elapsed, 1), "quick": args.quick, "seed": args.seed, "random_per_setting": count,
        "sweep_menu": [str(m) for m in menu], "rounds": ROUNDS,
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "searches": [{"search": r["search"], "shape": r["shape"], "rounds": r["rounds"],
                      "control": r["control"].to_json(), "protocol": r["protocol"].to_json()} for r in rows],
        "fixed": fixed,
    }
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    console.print(f"{total:,} schedules, {leaks} protocol leaks, {control_real} control schedules with a real recovery "
                  f"in {elapsed:.0f} s; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
