"""Knowledge distillation on BBC News: a federated MiniLM teacher, and a shallow student federated with and without KD.

Three federations with the project's launcher (`nebula-fl run`: real SuperLink, SuperNodes and trainers):
  teacher   task classify: MiniLM (6 layers) + LoRA, its final global adapter kept in its run folder
  kd        task distill: MiniLM cut to its first --student-layers layers + LoRA, trained on
            kd_loss(alpha 0.5, T 2) against that teacher's logits (each cluster labels its own shard once)
  no-kd     the same student, alpha 0: plain cross-entropy, no teacher
kd and no-kd share the data split, partition, seed, steps, rounds and evaluation; the teacher sees the same
split and partition. Then, in this process: parameters of both models, what each exchanges per round (from each
run's metrics.jsonl, payload both directions, all clusters), and the student's inference speed-up over the
teacher: one thread, the same test batches, teacher and student passes alternating, median of each.

    .venv/bin/python benchmarks/distill.py            # all of BBC News, 128 tokens
    .venv/bin/python benchmarks/distill.py --quick    # 1,000 articles, 64 tokens, 3 x 20 steps: 9 min 30 s measured
                                                      # on 2 cores shared with other jobs (load ~9; budget 15 min)

Writes results.json, distill.png (test accuracy per round of the three runs) and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from harness import ADAPTER, fresh_out, run_federation, write_results  # beside this script, first on sys.path
from rich.console import Console
from rich.table import Table
from safetensors.numpy import load_file

from nebula_fl.config import DataConfig, ModelConfig
from nebula_fl.data.datasets import train_test_split
from nebula_fl.model.adapter import load_adapter_arrays
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.evaluation import evaluate
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.model.teacher import load_run_teacher
from nebula_fl.tasks import TaskSetup, make_task


def plan(quick: bool) -> dict:
    """The job: the data and model keys shared by all three runs, the teacher's budget and the students'."""
    if quick:
        shared = {"max-examples": 1000, "max-seq-len": 64, "batch-size": 16, "eval-initial": False}
        return {"shared": shared, "clusters": 2, "teacher": {"rounds": 3, "local_steps": 20},
                "student": {"rounds": 3, "local_steps": 20}, "timing_batches": 4, "timing_repeats": 5}
    shared = {"max-seq-len": 128, "batch-size": 16, "eval-initial": False}
    return {"shared": shared, "clusters": 2, "teacher": {"rounds": 5, "local_steps": 30},
            "student": {"rounds": 5, "local_steps": 30}, "timing_batches": 0, "timing_repeats": 7}


def run_config_text(keys: dict) -> str:
    return " ".join(f'{k}="{v}"' if isinstance(v, str) else f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in keys.items())


def federate(name: str, *, task: str, keys: dict, budget: dict, args, job: dict, out: Path, console: Console) -> dict:
    folder = out / name
    config = {"partition": args.partition, **job["shared"], **keys}
    cmd = ["--task", task, "--clusters", str(job["clusters"]), "--rounds", str(budget["rounds"]), "--local-steps",
           str(budget["local_steps"]), "--seed", str(args.seed), "--port", "0", "--run-config", run_config_text(config)]
    console.print(f"[bold]{name}[/bold] ({task}): {job['clusters']} clusters, {budget['rounds']} rounds x "
                  f"{budget['local_steps']} steps, {run_config_text(config)}")
    started = time.monotonic()
    summary, lines = run_federation(cmd, folder=folder, log=folder.with_suffix(".log"))
    return {
        "name": name, "task": task, "folder": str(folder), "final_accuracy": summary["final_accuracy"],
        "final_macro_f1": summary["final_macro_f1"], "accuracy_by_round": [x["accuracy"] for x in lines],
        "bytes_per_round": sum(x["bytes_up"] + x["bytes_down"] for x in lines) / len(lines),
        "update_bytes_per_cluster": summary.get("bytes_up_per_round_per_cluster"),
        "wall_seconds": time.monotonic() - started, "run_config": config,
    }


def count(model: torch.nn.Module, *, trainable: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


@torch.no_grad()
def pass_seconds(model: torch.nn.Module, batches: list[dict[str, torch.Tensor]]) -> float:
    started = time.perf_counter()
    for batch in batches:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return time.perf_counter() - started


def compare_models(teacher_run: dict, kd_run: dict, *, args, job: dict, console: Console) -> dict:
    """Load the teacher and the KD student as the runs left them; parameters, accuracy check, timed passes."""
    torch.set_num_threads(1)
    flat = kd_run["run_config"]
    model_cfg = ModelConfig.from_flat(flat)
    _, test = train_test_split(DataConfig.from_flat(flat), seed=args.seed)
    teacher = load_run_teacher(teacher_run["folder"])
    task = make_task("distill", {k: v for k, v in flat.items() if k.startswith("task.")})
    path = resolve_model_path(model_cfg.model)
    setup = TaskSetup(model=model_cfg, labels=list(test.label_names), seed=args.seed, path=path)
    student = task.build_model(setup)
    load_adapter_arrays(student, load_file(str(Path(kd_run["folder"]) / ADAPTER)))
    student.eval()
    data = TokenizedTexts(task.tokenizer(setup), test.texts, test.labels, max_len=model_cfg.max_seq_len)
    checks = {  # the models loaded here are the ones the runs evaluated
        "teacher_accuracy_here": evaluate(teacher.model, data, batch_size=32, num_classes=len(test.label_names))[
            "accuracy"],
        "student_accuracy_here": evaluate(student, data, batch_size=32)["accuracy"],
    }
    n = len(data) // 32 if not job["timing_batches"] else min(job["timing_batches"], len(data) // 32)
    batches = [data.batch(range(i * 32, (i + 1) * 32)) for i in range(max(n, 1))]
    pass_seconds(teacher.model, batches[:1]), pass_seconds(student, batches[:1])  # warm-up
    times: dict[str, list[float]] = {"teacher": [], "student": []}
    for _ in range(job["timing_repeats"]):
        times["teacher"].append(pass_seconds(teacher.model, batches))
        times["student"].append(pass_seconds(student, batches))
    median = {k: statistics.median(v) for k, v in times.items()}
    console.print(f"timed {job['timing_repeats']} alternating passes over {len(batches)} test batches of 32, "
                  f"one thread: teacher {median['teacher']:.3f} s, student {median['student']:.3f} s")
    exchanged = {"teacher": task.exchanged(teacher.model), "student": task.exchanged(student)}
    return {
        "parameters": {"teacher": count(teacher.model), "student": count(student)},
        "exchanged_parameters": {k: int(sum(a.size for a in v.values())) for k, v in exchanged.items()},
        "encoder_layers": {"teacher": int(teacher.model.get_base_model().encoder.config.num_hidden_layers),
                           "student": int(student.get_base_model().encoder.config.num_hidden_layers)},
        "inference_seconds": {"median": median, "all": times, "batches": len(batches), "batch_size": 32,
                              "threads": 1},
        "speedup": median["teacher"] / median["student"],
        **checks,
    }


def plot(runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for r in runs:
        ax.plot(range(1, len(r["accuracy_by_round"]) + 1), r["accuracy_by_round"], marker="o",
                label=f"{r['name']} ({r['bytes_per_round'] / 1e3:.0f} kB/round)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title("BBC News: teacher, student with and without KD")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "distill.png")
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--student-layers", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=2.0)
    parser.add_argument("--alpha", type=float, default=0.5, help="the KD run's alpha (the control's is 0)")
    parser.add_argument("--partition", default="dirichlet:0.5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/distill")
    args = parser.parse_args()
    console = Console(highlight=False, width=140)
    out = fresh_out(args.out)
    job = plan(args.quick)
    started = time.monotonic()
    teacher = federate("teacher", task="classify", keys={}, budget=job["teacher"], args=args, job=job, out=out,
                       console=console)
    student_keys = {"task.student-layers": args.student_layers, "task.temperature": args.temperature}
    kd = federate("kd", task="distill", budget=job["student"], args=args, job=job, out=out, console=console,
                  keys={**student_keys, "task.teacher": teacher["folder"], "task.alpha": args.alpha})
    plain = federate("no-kd", task="distill", budget=job["student"], args=args, job=job, out=out, console=console,
                     keys={**student_keys, "task.teacher": teacher["folder"], "task.alpha": 0.0})
    models = compare_models(teacher, kd, args=args, job=job, console=console)
    runs = [teacher, kd, plain]
    results = {
        "benchmark": "distill", "config": vars(args), "plan": job,
        "accuracy": {r["name"]: r["final_accuracy"] for r in runs},
        "macro_f1": {r["name"]: r["final_macro_f1"] for r in runs},
        "kd_gain_points": 100 * (kd["final_accuracy"] - plain["final_accuracy"]),
        "bytes_per_round": {r["name"]: r["bytes_per_round"] for r in runs},
        "student_bytes_share": kd["bytes_per_round"] / teacher["bytes_per_round"],
        **models, "runs": runs, "wall_seconds": time.monotonic() - started,
    }
    write_results(out, results)
    plot(runs, out)

    table = Table(title=f"Distillation on BBC News (seed {args.seed}; kd and no-kd: same split, steps, rounds)")
    for col in ("run", "layers", "parameters", "exchanged", "accuracy", "macro-F1", "bytes / round", "inference s",
                "wall s"):
        table.add_column(col, justify="right")
    layers, params, sent = models["encoder_layers"], models["parameters"], models["exchanged_parameters"]
    secs = models["inference_seconds"]["median"]
    for r in runs:
        role = "teacher" if r["name"] == "teacher" else "student"
        table.add_row(r["name"], str(layers[role]), f"{params[role]:,}", f"{sent[role]:,}", f"{r['final_accuracy']:.4f}",
                      f"{r['final_macro_f1']:.4f}", f"{r['bytes_per_round']:,.0f}", f"{secs[role]:.3f}",
                      f"{r['wall_seconds']:.0f}")
    console.print(table)
    console.print(f"KD gain: {results['kd_gain_points']:+.1f} accuracy points over the same student without KD; "
                  f"student bytes per round {results['student_bytes_share']:.0%} of the teacher's; inference "
                  f"speed-up {models['speedup']:.2f}x (one thread); total {results['wall_seconds']:.0f} s")
    console.print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
