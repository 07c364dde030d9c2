"""What secure aggregation costs: nebula-fl plain vs nebula-fl secure vs Flower's own legacy SecAgg+.

In one run, side by side, with the same clusters (default 8) and an adapter of about a million
parameters (the shipped MiniLM with LoRA rank 108 on query,value; codec `none`, so the masked vector is
the whole adapter) and a training cost kept tiny so that the rounds measure the protocol, not the model:
  1. `nebula-fl run` plain and `nebula-fl run --secure-aggregation` (same seed, data, rounds),
  2. Flower 1.42's legacy SecAgg+ (`SecAggPlusWorkflow`, via `secagg_legacy_run.run_legacy`) on real
     processes with the same clusters and the adapter's parameter count, and its plain round.
Round 1 holds the one-time key setup of a key epoch, so round times are compared on rounds 2..R
(medians); the median over all rounds and the setup seconds are reported too.

    .venv/bin/python benchmarks/secagg.py            # 4 rounds per side
    .venv/bin/python benchmarks/secagg.py --quick    # 3 rounds, fewer examples, no legacy plain: < 10 min

Writes results.json (and each side's run folder and logs) under --out; prints a table with the goals.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from federation_runs import fresh_out, run_federation  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table
from safetensors import safe_open
from secagg_legacy_run import run_legacy

GOALS = {"secure_over_plain": ("<=", 1.3), "legacy_over_nebula": (">", 1.0), "bytes_secure_over_plain": ("<=", 1.1)}


# -- nebula-fl -------------------------------------------------------------------------------------
def nebula_args(args: argparse.Namespace, *, secure: bool) -> list[str]:
    run_config = (f"max-examples={args.max_examples} batch-size=2 max-seq-len={args.max_seq_len} "
                  f"lora-r={args.lora_r} eval-initial=false eval-batch-size=256 "
                  f"test-fraction={args.test_fraction}")
    cmd = ["--clusters", str(args.clusters), "--rounds", str(args.rounds), "--local-steps", "1",
           "--seed", str(args.seed), "--port", "0", "--codec", "none", "--partition", "iid", "--run-config", run_config]
    return cmd + (["--secure-aggregation"] if secure else [])


def run_nebula(name: str, *, secure: bool, args: argparse.Namespace, out: Path, console: Console) -> dict:
    folder = out / name
    cmd = nebula_args(args, secure=secure)
    console.print(f"[bold]{name}[/bold]: nebula-fl run {shlex.join(cmd)}")
    started = time.monotonic()
    _, lines = run_federation(cmd, folder=folder, log=folder.with_suffix(".log"))
    if len(lines) != args.rounds:
        raise SystemExit(f"{name} recorded {len(lines)} of {args.rounds} rounds; see {folder / 'metrics.jsonl'}")
    rounds = []
    for line in lines:
        clusters = {k: {"bytes_up": c.get("bytes_up", 0), "bytes_down": c.get("bytes_down", 0)}
                    for k, c in line["clusters"].items()}
        rounds.append({"round": line["round"], "seconds": line["seconds"], "accuracy": line.get("accuracy"),
                       "clusters_aggregated": line.get("clusters_aggregated"), "skipped": line.get("skipped"),
                       "secagg": line.get("secagg"), "clusters": clusters})
    console.print(f"  {name} done in {time.monotonic() - started:.0f} s")
    return {"name": name, "secure": secure, "folder": str(folder), "params": adapter_params(folder),
            "round_seconds": [r["seconds"] for r in rounds], "rounds": rounds}


def adapter_params(folder: Path) -> int:
    """The number of values in the run's final adapter: what is trained, exchanged and (securely) summed."""
    with safe_open(str(folder / "adapter.safetensors"), framework="numpy") as handle:
        return sum(math.prod(handle.get_slice(key).get_shape()) for key in handle.keys())  # noqa: SIM118 (not iterable)


def cluster_round_bytes(side: dict) -> list[int]:
    """Up + down bytes of every cluster in every round after the first (round 1 has no downlink of a new
    adapter and the secure side's key setup; both are reported apart)."""
    return [c["bytes_up"] + c["bytes_down"] for r in side["rounds"][1:] for c in r["clusters"].values()]


def problems(side: dict, clusters: int) -> list[str]:
    """Rounds that did not aggregate every cluster (an aborted secure round, a skipped round): a measured
    time from such a round is not a time of the protocol, so it is reported."""
    out = []
    for r in side["rounds"]:
        sec = r.get("secagg") or {}
        if r.get("skipped") or sec.get("aborted") or r.get("clusters_aggregated") != clusters:
            out.append(f"{side['name']} round {r['round']}: aggregated {r.get('clusters_aggregated')}, "
                       f"skipped {r.get('skipped')}, secagg aborted {sec.get('aborted')}")
        elif side["secure"] and sec.get("survivors") != clusters:
            out.append(f"{side['name']} round {r['round']}: {sec.get('survivors')} survivors of {clusters}")
    return out


# -- analysis --------------------------------------------------------------------------------------
def after_first(seconds: list[float]) -> float:
    return statistics.median(seconds[1:])


def goal(name: str, value: float | None) -> dict[str, Any]:
    op, target = GOALS[name]
    met = value is not None and (value <= target if op == "<=" else value > target)
    return {"value": value, "goal": f"{op} {target}", "met": met}


def analyse(plain: dict, secure: dict, legacy: dict | None, legacy_plain: dict | None, *, args, command: str,
            notes: list[str]) -> dict:
    sec_rounds = [r.get("secagg") or {} for r in secure["rounds"]]
    setup = [s["setup_s"] for s in sec_rounds if "setup_s" in s]
    unmask = [s["unmask_s"] for s in sec_rounds if "unmask_s" in s]
    secure_over_plain = after_first(secure["round_seconds"]) / after_first(plain["round_seconds"])
    legacy_over_nebula = (after_first(legacy["round_seconds"]) / after_first(secure["round_seconds"])
                          if legacy else None)
    bytes_ratio = statistics.mean(cluster_round_bytes(secure)) / statistics.mean(cluster_round_bytes(plain))
    sides: dict[str, Any] = {}
    for key, side in (("nebula_plain", plain), ("nebula_secure", secure)):
        sides[key] = {"median_round_s_2_to_R": after_first(side["round_seconds"]),
                      "median_round_s_all": statistics.median(side["round_seconds"]),
                      "first_round_s": side["round_seconds"][0],
                      "bytes_per_cluster_round_2_to_R": statistics.mean(cluster_round_bytes(side)),
                      "folder": side["folder"]}
    for key, side in (("legacy_secure", legacy), ("legacy_plain", legacy_plain)):
        if side:
            sides[key] = {"median_round_s_2_to_R": after_first(side["round_seconds"]),
                          "median_round_s_all": side["median_round_s"],
                          "first_round_s": side["round_seconds"][0],
                          "bytes_up_per_client": side["bytes_up_per_client"],
                          "bytes_down_per_client": side["bytes_down_per_client"],
                          "num_shares": side["num_shares"], "threshold": side["threshold"],
                          "max_abs_error": side["max_abs_error"], "folder": side["workdir"]}
    return {
        "secure_over_plain": secure_over_plain,
        "legacy_over_nebula": legacy_over_nebula,
        "bytes_secure_over_plain": bytes_ratio,
        "clusters": args.clusters,
        "params": secure["params"],
        "stage_seconds": {"setup_s": statistics.median(setup) if setup else None,
                          "unmask_s": statistics.median(unmask) if unmask else None,
                          "setup_s_each": setup, "unmask_s_each": unmask},
        "rounds": args.rounds,
        "goals": {name: goal(name, value) for name, value in (("secure_over_plain", secure_over_plain),
                                                              ("legacy_over_nebula", legacy_over_nebula),
                                                              ("bytes_secure_over_plain", bytes_ratio))},
        "round_seconds": {"nebula_plain": plain["round_seconds"], "nebula_secure": secure["round_seconds"],
                          "legacy_secure": legacy["round_seconds"] if legacy else None,
                          "legacy_plain": legacy_plain["round_seconds"] if legacy_plain else None},
        "sides": sides,
        "settings": {"lora_r": args.lora_r, "max_examples": args.max_examples, "max_seq_len": args.max_seq_len,
                     "test_fraction": args.test_fraction, "seed": args.seed, "quick": args.quick,
                     "local_steps": 1, "batch_size": 2, "codec": "none"},
        "notes": notes,
        "command": command,
    }


def show(res: dict, console: Console) -> None:
    table = Table(title=f"Secure aggregation: {res['clusters']} clusters, {res['params']:,} parameters, "
                        f"{res['rounds']} rounds")
    for col in ("side", "median round 2..R (s)", "median all (s)", "round 1 (s)", "bytes / cluster / round"):
        table.add_column(col, justify="left" if col == "side" else "right")
    for key, side in res["sides"].items():
        if "bytes_per_cluster_round_2_to_R" in side:
            size = f"{side['bytes_per_cluster_round_2_to_R']:,.0f}"
        else:
            size = f"up {side['bytes_up_per_client'] or 0:,} / down {side['bytes_down_per_client'] or 0:,}"
        table.add_row(key, f"{side['median_round_s_2_to_R']:.2f}", f"{side['median_round_s_all']:.2f}",
                      f"{side['first_round_s']:.2f}", size)
    console.print(table)
    ratios = Table(title="Ratios and goals")
    for col in ("ratio", "value", "goal", ""):
        ratios.add_column(col)
    for name, g in res["goals"].items():
        value = "not measured" if g["value"] is None else f"{g['value']:.3f}"
        ratios.add_row(name, value, g["goal"], "[green]met[/green]" if g["met"] else "[red]MISSED[/red]")
    console.print(ratios)
    stage = res["stage_seconds"]
    console.print(f"nebula-fl secure stages: setup {_s(stage['setup_s'])}, unmask (median) {_s(stage['unmask_s'])}")
    for note in res["notes"]:
        console.print(f"[yellow]note:[/yellow] {note}")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, fewer examples, no legacy plain side (< 10 min on 2 cores)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side (default 4; --quick 3)")
    parser.add_argument("--clusters", type=int, default=8)
    parser.add_argument("--lora-r", type=int, default=108, help="LoRA rank: 108 gives ~1M adapter parameters")
    parser.add_argument("--max-examples", type=int, default=None, help="dataset cap (default 400; --quick 240)")
    parser.add_argument("--max-seq-len", type=int, default=32)
    parser.add_argument("--test-fraction", type=float, default=0.1, help="server test share (kept small: cheap eval)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-legacy-plain", action="store_true",
                        help="skip Flower's plain legacy round (--quick skips it anyway)")
    parser.add_argument("--legacy-timeout", type=float, default=1800.0, help="seconds for each legacy side")
    parser.add_argument("--out", default="benchmarks/results/secagg")
    args = parser.parse_args()
    args.rounds = args.rounds if args.rounds is not None else (3 if args.quick else 4)
    args.max_examples = args.max_examples if args.max_examples is not None else (240 if args.quick else 400)
    args.no_legacy_plain = args.no_legacy_plain or args.quick  # 80 s on 2 cores that --quick cannot spare
    if args.rounds < 2:
        parser.error(f"--rounds is {args.rounds}; use 2 or more (round 1 holds the key setup, rounds 2..R are compared)")
    if args.clusters < 3:
        parser.error(f"--clusters is {args.clusters}; use 3 or more (SecAgg+ needs 3 shares)")
    command = shlex.join([sys.executable, *sys.argv])
    out = fresh_out(args.out)
    console = Console()
    started = time.monotonic()
    plain = run_nebula("nebula-plain", secure=False, args=args, out=out, console=console)
    secure = run_nebula("nebula-secure", secure=True, args=args, out=out, console=console)
    notes = problems(plain, args.clusters) + problems(secure, args.clusters)
    if plain["params"] != secure["params"]:
        notes.append(f"adapter sizes differ: plain {plain['params']}, secure {secure['params']}")
    legacy_sides: dict[str, dict | None] = {"legacy-secure": None, "legacy-plain": None}
    for name, sec in (("legacy-secure", True), ("legacy-plain", False)):
        if name == "legacy-plain" and args.no_legacy_plain:
            continue
        console.print(f"[bold]{name}[/bold]: Flower legacy {'SecAgg+' if sec else 'FedAvg'}, {args.clusters} "
                      f"clusters, {secure['params']:,} parameters, {args.rounds} rounds "
                      f"({time.monotonic() - started:.0f} s so far)")
        t0 = time.monotonic()
        try:
            legacy_sides[name] = run_legacy(clusters=args.clusters, params=secure["params"], rounds=args.rounds,
                                            secure=sec, workdir=out / name, timeout_s=args.legacy_timeout)
        except RuntimeError as err:
            notes.append(f"{name} failed: {err}")
            console.print(f"[red]{name} failed:[/red] {err}")
            continue
        console.print(f"  {name} done in {time.monotonic() - t0:.0f} s")
    res = analyse(plain, secure, legacy_sides["legacy-secure"], legacy_sides["legacy-plain"], args=args,
                  command=command, notes=notes)
    res["wall_s"] = time.monotonic() - started
    (out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    show(res, console)
    console.print(f"wrote {out / 'results.json'} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
