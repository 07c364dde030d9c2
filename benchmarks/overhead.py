"""The round-time floor: where a round goes when compute is negligible.

Runs real federations (`nebula-fl run`: a SuperLink, SuperNodes, trainers, `flwr run`) of a tiny
1-layer BERT for 10 rounds and reads each round's timeline from metrics.jsonl: the server's phases
(configure, push, exchange, aggregate, evaluate, checkpoint), each cluster's (pickup = wait for the SuperNode
and SuperExec polls + the ClientApp process's start-up, compute, upload)
and the framework overhead = round − slowest cluster's compute − its transfer − server evaluation.
Reports per-phase medians against the goal `overhead_s_median` ≤ 6 s, of which ~3 s is the SuperNode's
hard-coded idle poll (a message waits 0–3 s for it, 1.5 s on average, on the way in). Also the clusters'
utilisation, median over every (round, cluster) that reports it: `busy_fraction` (the share of the time between a
cluster's two sends that it trained) and `idle_s` (the rest, the seconds its accelerator waited); a cluster's first
round has no previous send and does not count.

`--overlap both` runs the same federation with and without `eval-overlap` side by side (use it with a
real model, e.g. `--model minilm --preset demo --rounds 5`, where evaluation takes seconds).
`--against REF` runs the same federation with nebula-fl as of git REF too (a temporary worktree, the launcher's
working folder and first on PYTHONPATH for every process it starts), `--repeats` times each, the two sides
alternating: this tree against an earlier commit on the same machine in one run.

    .venv/bin/python benchmarks/overhead.py                 # ~2 min on 2 cores
    .venv/bin/python benchmarks/overhead.py --model minilm --preset demo --rounds 5 --overlap both
    .venv/bin/python benchmarks/overhead.py --model minilm --preset demo --device cuda   # on a GPU machine
    .venv/bin/python benchmarks/overhead.py --against 251dd94 --repeats 2   # this tree vs a commit, alternating

Writes results.json and round_timeline.png under --out; prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from harness import fresh_out, run_federation, write_results  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table

GOAL_OVERHEAD_S = 6.0
SERVER_PHASES = ("configure_s", "push_s", "exchange_s", "aggregate_s", "evaluate_s", "checkpoint_s")
CLUSTER_PHASES = ("pickup_s", "wait_s", "start_s", "compute_s", "train_s", "encode_s", "upload_s")
UTILISATION = ("busy_fraction", "idle_s")  # per cluster in the timeline; the medians keep these names


def machine() -> dict[str, Any]:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cores": os.cpu_count(), "cpu": model, "python": platform.python_version()}


def medians(lines: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-phase medians over rounds; cluster phases over every (round, cluster); the period is the time
    between two rounds' records (with eval-overlap, less than a round's own latency)."""
    timelines = [line["timeline"] for line in lines if "timeline" in line]
    out: dict[str, Any] = {}
    for key in ("round_s", "overhead_s", *SERVER_PHASES):
        values = [t[key] for t in timelines if key in t]
        if values:
            out[key] = statistics.median(values)
    for key in CLUSTER_PHASES:
        values = [c[key] for t in timelines for c in t["clusters"].values() if key in c]
        if values:
            out[f"cluster_{key}"] = statistics.median(values)
    for key in UTILISATION:
        values = [c[key] for t in timelines for c in t["clusters"].values() if key in c]
        if values:
            out[key] = statistics.median(values)
    slowest = [t["clusters"][t["slowest_cluster"]] for t in timelines if t.get("slowest_cluster") in t["clusters"]]
    for key in ("pickup_s", "wait_s", "start_s", "upload_s"):
        values = [c[key] for c in slowest if key in c]
        if values:
            out[f"slowest_{key}"] = statistics.median(values)
    periods = [b["elapsed_seconds"] - a["elapsed_seconds"] for a, b in itertools.pairwise(lines)
               if b["round"] == a["round"] + 1]  # within one run: repeats are pooled one after the other
    if periods:
        out["period_s"] = statistics.median(periods)
    return out


def plot(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(6 * len(runs), 4), dpi=120, squeeze=False)
    parts = (("wait for pickup (slowest)", "wait_s"), ("ClientApp start (slowest)", "start_s"),
             ("compute (slowest)", "compute_s"), ("upload (slowest)", "upload_s"))
    for ax, (name, lines) in zip(axes[0], runs.items()):
        rounds = [line["round"] for line in lines]
        bottom = [0.0] * len(lines)
        for label, key in parts:
            values = [line["timeline"]["clusters"].get(line["timeline"].get("slowest_cluster"), {}).get(key, 0.0)
                      for line in lines]
            ax.bar(rounds, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        for label, key in (("aggregate", "aggregate_s"), ("evaluate", "evaluate_s"), ("checkpoint", "checkpoint_s")):
            values = [line["timeline"].get(key, 0.0) for line in lines]
            ax.bar(rounds, values, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, values)]
        rest = [max(0.0, line["timeline"]["round_s"] - b) for line, b in zip(lines, bottom)]
        ax.bar(rounds, rest, bottom=bottom, label="other", color="lightgrey")
        ax.set_title(name)
        ax.set_xlabel("round")
        ax.set_ylabel("seconds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@contextlib.contextmanager
def other_tree(ref: str | None, out: Path):
    """nebula-fl as of git REF, checked out in a temporary worktree under OUT (None without a REF); removed after."""
    if ref is None:
        yield None
        return
    repo = Path(__file__).resolve().parents[1]
    where = out / f"tree-{ref}"
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(where), ref], check=True,
                   capture_output=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(where)], capture_output=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny", help="'tiny' (built here: compute is negligible) or a model name/path")
    parser.add_argument("--preset", default="smoke", help="the nebula-fl preset the runs start from")
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--local-steps", type=lambda v: v if v == "auto" else int(v), default=2,
                        help="inner steps per round, or 'auto' (time-budgeted: where busy_fraction tells most)")
    parser.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                        help="eval-overlap for the run(s); both = two runs side by side")
    parser.add_argument("--device", help="passed to `nebula-fl run --device`: cpu or cuda, or one per cluster "
                        "(e.g. cpu,cuda); default: nebula-fl run's own")
    parser.add_argument("--against", metavar="REF",
                        help="also run nebula-fl as of git REF (a temporary worktree), alternating with this tree")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, alternating (their rounds pooled)")
    parser.add_argument("--out", default="benchmarks/results/overhead")
    args = parser.parse_args()
    if args.against and args.overlap == "both":
        parser.error("--against compares two trees at one --overlap setting; give --overlap on or off")
    if not 1 <= args.repeats <= 10:
        parser.error("--repeats must be 1 to 10")
    console = Console(highlight=False, width=150)
    out = fresh_out(args.out)
    model = args.model
    if model == "tiny":
        from nebula_fl.model.tiny import build_tiny_model

        model = str(build_tiny_model(out / "tiny-model"))
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {}
    walls: dict[str, float] = {}  # command to exit, as a user waits for it (the median over repeats)
    sides = [(f"eval-overlap {o}", o, None) for o in (("on", "off") if args.overlap == "both" else (args.overlap,))]
    with other_tree(args.against, out) as tree:
        if tree is not None:
            sides = [("this tree", args.overlap, None), (f"at {args.against}", args.overlap, tree)]
        took: dict[str, list[float]] = {}
        for repeat, (name, overlap, where) in itertools.product(range(args.repeats), sides):
            folder = out / f"{name.replace(' ', '-')}-{repeat}"
            console.print(f"[bold]{name}[/bold] (run {repeat + 1}/{args.repeats}): {args.clusters} clusters, "
                          f"{args.rounds} rounds, model {args.model}")
            env = None if where is None else {**os.environ, "PYTHONPATH": os.pathsep.join(
                [str(where), *filter(None, [os.environ.get("PYTHONPATH")])])}
            launched = time.monotonic()
            _, lines = run_federation(
                ["--preset", args.preset, "--clusters", str(args.clusters), "--rounds", str(args.rounds),
                 "--local-steps", str(args.local_steps), "--port", "0",
                 *(["--device", args.device] if args.device else []),
                 "--run-config", f'model="{model}" eval-initial=false eval-overlap={str(overlap == "on").lower()}'],
                folder=folder, log=folder.with_suffix(".log"), env=env, cwd=where)
            runs.setdefault(name, []).extend(lines)
            took.setdefault(name, []).append(time.monotonic() - launched)
        walls = {name: statistics.median(values) for name, values in took.items()}
    figures = {name: {**medians(lines), "command_wall_s": walls[name],
                      "final_accuracy": lines[-1]["accuracy"]} for name, lines in runs.items()}
    first = figures[next(iter(figures))]
    results = {
        "benchmark": "overhead", "machine": machine(), "model": args.model, "preset": args.preset,
        "clusters": args.clusters, "rounds": args.rounds, "local_steps": args.local_steps, "device": args.device,
        "overhead_s_median": first.get("overhead_s"), "goal_overhead_s": GOAL_OVERHEAD_S,
        "goal_met": first.get("overhead_s", float("inf")) <= GOAL_OVERHEAD_S,
        **{f"{key}_median": {name: f.get(key) for name, f in figures.items()} for key in UTILISATION},
        "phase_medians": figures, "runs": runs, "benchmark_seconds": time.monotonic() - started,
    }
    write_results(out, results)
    plot({name: lines[:args.rounds] for name, lines in runs.items()}, out / "round_timeline.png")  # each first run

    table = Table(title=f"per-phase medians over {args.rounds} rounds, {args.clusters} clusters, model {args.model} "
                        f"({results['machine']['cores']} cores)")
    table.add_column("phase")
    for name in figures:
        table.add_column(name, justify="right")
    first_keys = ("command_wall_s", "final_accuracy", "period_s", "round_s", "overhead_s", *UTILISATION)
    keys = [*first_keys, *sorted({k for f in figures.values() for k in f} - set(first_keys))]
    for key in keys:
        table.add_row(key, *(f"{f[key]:.4g}" if isinstance(f.get(key), int | float) else "-" for f in figures.values()))
    console.print(table)
    verdict = "met" if results["goal_met"] else "MISSED"
    console.print(f"overhead_s_median {results['overhead_s_median']:.2f} s (goal ≤ {GOAL_OVERHEAD_S:g} s: {verdict})")
    console.print(f"results: {out / 'results.json'}, plot: {out / 'round_timeline.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
