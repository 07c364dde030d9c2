"""Centralized LoRA on the pooled data vs the federation, side by side, same steps and seed.

The centralized baseline trains one LoRA adapter on the whole training split (what the clusters hold
together) for rounds x clusters x local-steps steps, the total number of inner steps the federation
takes, with the same batch size, learning rate, model and seed; both are evaluated on the same
held-out test split. Goal: the federation within 1.0 accuracy point of the centralized baseline.

    .venv/bin/python benchmarks/centralized_vs_federated.py            # the demo job (~7 min on 2 cores)
    .venv/bin/python benchmarks/centralized_vs_federated.py --preset smoke

Writes results.json, a PNG and prints a table.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from harness import fresh_out, parse_run_config, run_federation, table, write_results  # beside this script
from rich.console import Console

from nebula_fl.components import settle
from nebula_fl.config import PRESETS, RunConfig
from nebula_fl.data.datasets import train_test_split
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.evaluation import evaluate
from nebula_fl.model.loading import build_model, load_tokenizer
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.training import BatchSchedule, scheduled_lr, train_steps

GOAL_POINTS = 1.0


def centralized(cfg: RunConfig, *, clusters: int, console: Console) -> dict:
    """Train on the pooled training split; evaluate after every round's worth of steps."""
    torch.set_num_threads(os.cpu_count() or 1)
    seed = cfg.federation.seed
    train, test = train_test_split(cfg.data, seed=seed)
    path = resolve_model_path(cfg.model.model)
    tokenizer = load_tokenizer(path)
    model = build_model(cfg.model, num_labels=len(train.label_names), seed=seed, path=path)
    train_data = TokenizedTexts(tokenizer, train.texts, train.labels, max_len=cfg.model.max_seq_len)
    test_data = TokenizedTexts(tokenizer, test.texts, test.labels, max_len=cfg.model.max_seq_len)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    schedule = BatchSchedule(len(train_data), batch_size=cfg.train.batch_size, seed=seed, rank=0)
    torch.manual_seed(seed)
    per_round = clusters * cfg.train.local_steps
    total = per_round * cfg.federation.num_server_rounds
    curve = []
    started = time.monotonic()
    for rnd in range(1, cfg.federation.num_server_rounds + 1):
        done = (rnd - 1) * per_round

        def lr_at(i: int, done: int = done) -> float:
            # the federation's schedule, over the same total number of inner steps
            return scheduled_lr(cfg.train.lr, progress=(done + i) / total, schedule=cfg.train.lr_schedule,
                                min_ratio=cfg.train.lr_min_ratio)

        train_steps(model, optimizer, train_data, schedule, steps=per_round, max_grad_norm=cfg.train.max_grad_norm,
                    device=torch.device("cpu"), lr_at=lr_at)
        metrics = evaluate(model, test_data, batch_size=cfg.federation.eval_batch_size,
                           num_classes=len(train.label_names))
        curve.append({"round": rnd, **metrics})
        console.print(f"centralized: {rnd * per_round} steps, accuracy {metrics['accuracy']:.4f}")
    return {
        "accuracy": curve[-1]["accuracy"],
        "macro_f1": curve[-1]["macro_f1"],
        "steps": per_round * cfg.federation.num_server_rounds,
        "examples_seen": per_round * cfg.federation.num_server_rounds * cfg.train.batch_size,
        "wall_seconds": time.monotonic() - started,
        "curve": curve,
    }


def federated(args, out: Path, console: Console) -> dict:
    run_dir = out / "federated-run"
    cmd = ["--preset", args.preset, "--clusters", str(args.clusters), "--seed", str(args.seed), "--port", "0"]
    if args.run_config:
        cmd += ["--run-config", args.run_config]
    console.print(f"federated: nebula_fl run {' '.join(cmd)} --out {run_dir}")
    started = time.monotonic()
    summary, rounds = run_federation(cmd, folder=run_dir)
    steps = sum(c["steps"] for line in rounds for c in line["clusters"].values())
    return {
        "accuracy": summary["final_accuracy"],
        "macro_f1": summary["final_macro_f1"],
        "steps": steps,
        "examples_seen": sum(c["examples_seen"] for line in rounds for c in line["clusters"].values()),
        "wall_seconds": time.monotonic() - started,
        "bytes_up_total": summary["bytes_up_total"],
        "bytes_down_total": summary["bytes_down_total"],
        "run_folder": str(run_dir),
        "curve": [{"round": line["round"], "accuracy": line["accuracy"], "macro_f1": line["macro_f1"]} for line in rounds],
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for name in ("centralized", "federated"):
        curve = results[name]["curve"]
        ax.plot([c["round"] for c in curve], [c["accuracy"] for c in curve], marker="o", label=name)
    ax.set_xlabel("round (centralized: the same number of steps so far)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"centralized vs federated, gap {results['gap_points']:+.2f} points")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--run-config", default="", help="extra app config keys, as for nebula-fl run")
    parser.add_argument("--out", default="benchmarks/results/centralized_vs_federated")
    args = parser.parse_args()
    console = Console(highlight=False, width=140)
    out = fresh_out(args.out)
    overrides = {**PRESETS[args.preset], "seed": args.seed, "min-clusters": args.clusters,
                 **parse_run_config(args.run_config)}
    cfg = settle(RunConfig().replace(overrides))

    fed = federated(args, out, console)
    cen = centralized(cfg, clusters=args.clusters, console=console)
    if cen["steps"] != fed["steps"]:
        raise SystemExit(f"step counts differ: centralized {cen['steps']}, federated {fed['steps']}")
    gap = 100.0 * (cen["accuracy"] - fed["accuracy"])
    results = {
        "benchmark": "centralized_vs_federated",
        "config": cfg.to_flat(),
        "clusters": args.clusters,
        "centralized": cen,
        "federated": fed,
        "gap_points": gap,
        "goal_points": GOAL_POINTS,
        "goal_met": bool(gap <= GOAL_POINTS),  # the federation may also beat the baseline
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
    }
    write_results(out, results)
    plot(results, out / "centralized_vs_federated.png")

    shown = table(f"centralized vs federated ({args.preset}, {args.clusters} clusters, seed {args.seed})",
                  ("setting", "accuracy", "macro-F1", "inner steps", "examples seen", "WAN bytes", "wall s"))
    shown.add_row("centralized (pooled data)", f"{cen['accuracy']:.4f}", f"{cen['macro_f1']:.4f}", str(cen["steps"]),
                  str(cen["examples_seen"]), "-", f"{cen['wall_seconds']:.0f}")
    shown.add_row("federated", f"{fed['accuracy']:.4f}", f"{fed['macro_f1']:.4f}", str(fed["steps"]),
                  str(fed["examples_seen"]), f"{fed['bytes_up_total'] + fed['bytes_down_total']:,}",
                  f"{fed['wall_seconds']:.0f}")
    console.print(shown)
    verdict = "met" if results["goal_met"] else "NOT met"
    console.print(f"gap (centralized - federated): {gap:+.2f} accuracy points; goal gap <= {GOAL_POINTS}: {verdict}")
    console.print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
