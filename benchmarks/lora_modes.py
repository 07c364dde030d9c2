"""LoRA aggregation modes side by side: `standard` (A and B averaged separately) vs `frozen-a` (FFA-LoRA).

Two splits of BBC News, each run once per mode with the same data, seed, steps, rounds and evaluation:
  demo  the demo's job (2 clusters, Dirichlet 0.5, 10 local steps, 5 rounds)
  hard  4 clusters, Dirichlet 0.1 (one cluster holds a single class), 40 local steps, 5 rounds: the
        clusters drift apart, which is where mean(B)·mean(A) departs from mean(B·A)
Modes: standard (r=8), frozen-a (r=8: half the uplink), frozen-a-r16 (r=16: the same bytes as standard r=8).
Bytes per round are what the clusters' updates and the global adapter took on the wire (payload, both
directions, all clusters), from each run's metrics.jsonl.

    .venv/bin/python benchmarks/lora_modes.py             # 5 rounds each: over an hour on 2 cores
    .venv/bin/python benchmarks/lora_modes.py --quick     # 3 rounds each: 57 min measured on 2 shared cores

Writes results.json (`accuracy` and `bytes_per_round` keyed by mode, then split) and lora_modes.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from harness import fresh_out, run_federation, write_results  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table

MODES = {
    "standard": "lora-mode=\"standard\"",
    "frozen-a": "lora-mode=\"frozen-a\"",
    "frozen-a-r16": "lora-mode=\"frozen-a\" lora-r=16 lora-alpha=32",
}


def splits(quick: bool) -> dict[str, dict]:
    rounds = 3 if quick else 5
    return {
        "demo": {"clusters": 2, "local_steps": 10, "rounds": rounds, "partition": "dirichlet:0.5"},
        "hard": {"clusters": 4, "local_steps": 40, "rounds": rounds, "partition": "dirichlet:0.1"},
    }


def run(split: str, spec: dict, mode: str, args, out: Path, console: Console) -> dict:
    folder = out / f"{split}-{mode}"
    config = f'partition="{spec["partition"]}" eval-initial=false {MODES[mode]}'
    cmd = ["--clusters", str(spec["clusters"]), "--rounds", str(spec["rounds"]), "--local-steps",
           str(spec["local_steps"]), "--seed", str(args.seed), "--port", "0", "--run-config", config]
    console.print(f"[bold]{split} / {mode}[/bold]: {spec['clusters']} clusters, {spec['partition']}, "
                  f"{spec['rounds']} rounds x {spec['local_steps']} steps")
    started = time.monotonic()
    summary, lines = run_federation(cmd, folder=folder, log=folder.with_suffix(".log"))
    total = sum(x["bytes_up"] + x["bytes_down"] for x in lines)
    first = next(iter(lines[-1]["clusters"].values()))
    return {
        "split": split, "mode": mode, "final_accuracy": summary["final_accuracy"],
        "final_macro_f1": summary["final_macro_f1"], "accuracy_by_round": [x["accuracy"] for x in lines],
        "bytes_per_round": total / len(lines),
        "update_bytes_per_cluster": first.get("update_bytes"),
        "wall_seconds": time.monotonic() - started, "folder": str(folder),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--splits", default="demo,hard")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/lora_modes")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {', '.join(unknown)}; use {', '.join(MODES)}")
    plan = {k: v for k, v in splits(args.quick).items() if k in args.splits.split(",")}
    console = Console(highlight=False, width=140)
    out = fresh_out(args.out)
    runs = [run(split, spec, mode, args, out, console) for split, spec in plan.items() for mode in modes]
    accuracy = {m: {r["split"]: r["final_accuracy"] for r in runs if r["mode"] == m} for m in modes}
    per_round = {m: {r["split"]: r["bytes_per_round"] for r in runs if r["mode"] == m} for m in modes}
    summary = {"benchmark": "lora_modes", "config": vars(args), "splits": plan, "accuracy": accuracy,
               "bytes_per_round": per_round, "runs": runs}
    write_results(out, summary)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(plan), figsize=(6.0 * len(plan), 4.2), dpi=120, squeeze=False)
    for ax, split in zip(axes[0], plan, strict=True):
        for r in (r for r in runs if r["split"] == split):
            ax.plot(range(1, len(r["accuracy_by_round"]) + 1), r["accuracy_by_round"], marker="o",
                    label=f"{r['mode']} ({r['bytes_per_round'] / 1e3:.0f} kB/round)")
        ax.set_title(f"{split}: {plan[split]['clusters']} clusters, {plan[split]['partition']}, "
                     f"{plan[split]['local_steps']} local steps")
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "lora_modes.png")
    plt.close(fig)

    table = Table(title="LoRA modes (BBC News; same data, seed, steps and rounds per split)")
    for col in ("split", "mode", "final accuracy", "macro-F1", "bytes / round", "update bytes / cluster", "wall s"):
        table.add_column(col, justify="right")
    for r in runs:
        table.add_row(r["split"], r["mode"], f"{r['final_accuracy']:.4f}", f"{r['final_macro_f1']:.4f}",
                      f"{r['bytes_per_round']:,.0f}", f"{r['update_bytes_per_cluster'] or 0:,}", f"{r['wall_seconds']:.0f}")
    console.print(table)
    console.print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
