"""Federated LoRA tuning of a pretrained decoder vs the same tuning done centrally, and what crosses the WAN.

The causal-lm task on the shipped data: SmolLM2-135M-Instruct (shipped as a GGUF, pretrained; `model=smollm2`),
LoRA on q_proj,v_proj, tuned to name a BBC News article's topic (the instruction view, `dataset=bbcnews`), two
clusters with topic-skewed shards (`partition=dirichlet:1.0`). Real federations through `nebula-fl run`, one
after another, on the same data, seed, batch size, learning-rate schedule, rounds and evaluation schedule (the
server evaluates the same held-out split before round 1, the zero-shot model, and after every round):

  1. `federated`        2 clusters, `--codec none` (the adapter crosses the WAN as fp32), `--outer-optimizer
                        fedavg`, each cluster behind its own emulated link (`--wan`, a proxy that counts bytes);
  2. `centralized`      one cluster holding all of the training data (the union of the clusters' shards) with
                        local-steps = clusters x the federation's, the same rounds: the same number of examples
                        seen, evaluated at the same points; under FedAvg one cluster's round is plain training
                        (the adapter comes back as it went up, and the trainer keeps AdamW's moments);
  2b. `data-parallel`   one cluster holding all of the training data with the federation's local steps at clusters
                        x its batch size: the same examples seen in as many sequential steps as one federated
                        cluster takes, i.e. what pooling the data and the clusters' hardware (one step's batch split
                        across them) would train;
  3. `federated-CHAIN`  as 1 with `--codec CHAIN` (default topk:0.25+int4): what compression costs in loss and
                        exact match, and what it saves in bytes;
  4. `flower-lora`      stock Flower FedAvg over the same PEFT adapter through its ArrayRecord path
                        (benchmarks/stock_flower, `task=causal-lm`), behind the same links.

Figures (results.json): `loss_gap_relative` = (federated - centralized) / centralized held-out loss per learned
token after the last round (goal <= 0.02); `exact_match_gap_points` = 100 x (centralized - federated) exact match
(goal <= 1 point); the same two against `data-parallel` (`..._vs_data_parallel`, the same goals; one held-out record with a short answer is 100 / that many points, stated as
`exact_match_resolution_points`); `bytes_ratio_vs_flower_lora` = stock Flower's WAN bytes per round per cluster /
nebula-fl's with `--codec none`, as benchmarks/comm.py counts them (the proxies' counts, both ways, HTTP and
polling included, mean over rounds >= 1 and clusters), and `bytes_ratio_vs_flower_lora_compressed` with the
chain, and `..._from_round_2` the same over rounds 2 on (round 1 carries the first download and Flower's set-up:
what a long run pays per round); `first_round_within_loss_goal` = the first round from which the federated loss
stays within 2% of centralized's at the same round. Before the runs, with no federation: `records`, what
max-seq-len does to the shipped data (the BBC instruction view at the task's default length and at the demo's:
inputs cut, records dropped; the BBC articles as plain text: `packed_text_tokens_kept_ratio`, tokens kept / tokens
in the data when packed, goal 1.0), and `memory_per_worker`, one worker's peak resident memory for fp32, bf16 and
nf4 bases (decoder_memory.py's measurement, 8 x 256 tokens). Goals are judged as measured; the settings were fixed
before the runs, never tuned to a result.

    .venv/bin/python benchmarks/causal.py --quick   # 5 runs, 3 rounds x 5 steps, 300 examples: <= 20 min on 2 idle cores
    .venv/bin/python benchmarks/causal.py           # the demo preset's sizes: 600 examples, 4 rounds x 10 steps
    .venv/bin/python benchmarks/causal.py --rounds 12   # the same, run on until the federation nears centralized

Writes results.json (the command, the model, the settings, every run's per-round curve and bytes), causal.png
(held-out loss and exact match per round) and prints a table; keeps every run's folder and log.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from comm import _flower_value, records_from_lines  # beside this script: the same byte count as comm.py
from harness import StockFederation, fresh_out, metrics_lines, run_federation, table, write_results
from rich.console import Console

from nebula_fl.components import settle
from nebula_fl.config import RunConfig
from nebula_fl.tasks.causal_lm import CausalLMTask

HERE = Path(__file__).resolve().parent
STOCK_APP = HERE / "stock_flower"
FEDERATED, CENTRALIZED, DATA_PARALLEL, FLOWER = "federated", "centralized", "data-parallel", "flower-lora"
GOALS: dict[str, tuple[str, float]] = {
    "loss_gap_relative": ("<=", 0.02),
    "packed_text_tokens_kept_ratio": (">=", 1.0),
    "exact_match_gap_points": ("<=", 1.0),
    "loss_gap_relative_vs_data_parallel": ("<=", 0.02),
    "exact_match_gap_points_vs_data_parallel": ("<=", 1.0),
}
MODEL_NOTE = "SmolLM2-135M-Instruct (shipped GGUF, pretrained), LoRA on q_proj,v_proj"


@dataclass(frozen=True, kw_only=True)
class Mode:
    """What every run of one benchmark mode trains on, fixed before the runs."""

    rounds: int
    local_steps: int  # per cluster per round; the centralized run takes clusters x this
    max_examples: int
    test_fraction: float

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.local_steps < 1:
            raise ValueError(f"rounds {self.rounds} and local_steps {self.local_steps} must be 1 or more")
        if self.max_examples < 0 or not 0 < self.test_fraction < 1:
            raise ValueError("max_examples must be 0 (all) or more and test_fraction in (0, 1)")


DEMO = CausalLMTask.presets["demo"]
QUICK = Mode(rounds=3, local_steps=5, max_examples=300, test_fraction=0.2)  # 240 train, 60 held out
FULL_MODE = Mode(rounds=int(DEMO["num-server-rounds"]), local_steps=int(DEMO["local-steps"]),
                 max_examples=int(DEMO["max-examples"]), test_fraction=0.2)


# -- the runs' settings ------------------------------------------------------------------------------
def run_config(mode: Mode, *, partition: str, seed: int) -> RunConfig:
    """The validated config every run shares: the causal-lm demo preset with this mode's sizes."""
    return settle(RunConfig().replace({**DEMO, "task.name": "causal-lm", "num-server-rounds": mode.rounds,
                                       "local-steps": mode.local_steps, "max-examples": mode.max_examples,
                                       "test-fraction": mode.test_fraction, "partition": partition, "seed": seed,
                                       "eval-initial": True}))


def nebula_command(mode: Mode, *, clusters: int, seed: int, partition: str, codec: str = "none",
                   link: str | None = None, batch_size: int | None = None) -> list[str]:
    """`nebula-fl run` arguments: the task's demo preset (model, LoRA, batch size, learning rate, sequence length)
    with this mode's rounds, local steps and data, every round evaluated, round 0 included."""
    cmd = ["--task", "causal-lm", "--preset", "demo", "--clusters", str(clusters), "--rounds", str(mode.rounds),
           "--local-steps", str(mode.local_steps), "--seed", str(seed), "--port", "0", "--outer-optimizer", "fedavg",
           "--codec", codec, "--partition", partition, "--run-config",
           f"max-examples={mode.max_examples} test-fraction={mode.test_fraction} eval-initial=true"
           + (f" batch-size={batch_size}" if batch_size else "")]
    return cmd + (["--wan", link] if link else [])


def centralized_mode(mode: Mode, *, clusters: int) -> Mode:
    """One cluster with all the data: clusters x the local steps, the same rounds (examples seen, eval points)."""
    return Mode(rounds=mode.rounds, local_steps=clusters * mode.local_steps, max_examples=mode.max_examples,
                test_fraction=mode.test_fraction)


def stock_run_config(cfg: RunConfig, *, clusters: int, folder: Path, controls: list[Path]) -> str:
    """The stock app's run config: the very train / model keys of the nebula-fl runs (comm.py's rule for which)."""
    shared: dict[str, Any] = {
        key: value for section in (cfg.train, cfg.model) for key, value in section.to_flat().items()
        if key not in ("round-overlap", "max-local-steps", "round-seconds", "prox-mu")
    }
    shared.update({
        "mode": "lora", "task": "causal-lm", "num-server-rounds": cfg.federation.num_server_rounds,
        "num-clusters": clusters, "seed": cfg.federation.seed, "max-examples": cfg.data.max_examples,
        "test-fraction": cfg.data.test_fraction, "partition": cfg.data.partition,
        "eval-batch-size": cfg.federation.eval_batch_size, "threads": max(1, (os.cpu_count() or 1) // clusters),
        "out-dir": str(folder), "wan-control": ",".join(str(c) for c in controls),
    })
    return " ".join(f"{k}={_flower_value(v)}" for k, v in shared.items())


# -- analysis: pure functions of run records (tests/test_causal_bench.py) ---------------------------
def curve(initial: dict | None, lines: list[dict]) -> list[dict]:
    """Per evaluation: round, loss, perplexity, exact match; round 0 (the zero-shot model) first when evaluated."""
    keys = ("loss", "perplexity", "exact-match")
    out = [{"round": 0, **{k: initial[k] for k in keys}}] if initial else []
    return out + [{"round": line["round"], **{k: line[k] for k in keys}} for line in lines]


def bytes_per_round(lines: list[dict], *, first: int = 1) -> float | None:
    """WAN bytes per round per cluster as comm.py counts them: the proxies' bytes both ways, mean over rounds >=
    `first` and clusters (None when the run had no link). From round 2 on, round 1's extras (the first download of
    the adapter, Flower's run set-up) are left out: what a long run pays per round."""
    per = [c["bytes_up"] + c["bytes_down"] for r in records_from_lines(lines) if r["round"] >= first
           for c in r["clusters"]]
    return statistics.mean(per) if per else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or not denominator > 0:
        return None
    return numerator / denominator


def figures(runs: dict[str, dict], *, chain_run: str) -> dict[str, float | None]:
    """The headline figures from each run's final evaluation and bytes per round."""
    fed, chain = runs[FEDERATED], runs.get(chain_run)
    last = {name: run["curve"][-1] for name, run in runs.items()}
    out: dict[str, float | None] = {
        "loss_gap_relative": (last[FEDERATED]["loss"] - last[CENTRALIZED]["loss"]) / last[CENTRALIZED]["loss"],
        "exact_match_gap_points": 100.0 * (last[CENTRALIZED]["exact-match"] - last[FEDERATED]["exact-match"]),
        "bytes_ratio_vs_flower_lora": ratio(runs.get(FLOWER, {}).get("bytes_per_round_per_cluster"),
                                            fed.get("bytes_per_round_per_cluster")),
        "bytes_ratio_vs_flower_lora_compressed": None, "loss_cost_relative_compressed": None,
        "exact_match_cost_points_compressed": None,
    }
    if DATA_PARALLEL in runs:
        out["loss_gap_relative_vs_data_parallel"] = ((last[FEDERATED]["loss"] - last[DATA_PARALLEL]["loss"])
                                                     / last[DATA_PARALLEL]["loss"])
        out["exact_match_gap_points_vs_data_parallel"] = 100.0 * (last[DATA_PARALLEL]["exact-match"]
                                                                  - last[FEDERATED]["exact-match"])
    if chain is not None:
        out["bytes_ratio_vs_flower_lora_compressed"] = ratio(runs.get(FLOWER, {}).get("bytes_per_round_per_cluster"),
                                                             chain.get("bytes_per_round_per_cluster"))
        out["loss_cost_relative_compressed"] = (last[chain_run]["loss"] - last[FEDERATED]["loss"]) / last[FEDERATED]["loss"]
        out["exact_match_cost_points_compressed"] = 100.0 * (last[FEDERATED]["exact-match"] - last[chain_run]["exact-match"])
    out["first_round_within_loss_goal"] = first_round_within(fed["curve"], runs[CENTRALIZED]["curve"],
                                                             relative=GOALS["loss_gap_relative"][1])
    demo_rounds = int(DEMO["num-server-rounds"])
    reference = next((p["loss"] for p in runs[CENTRALIZED]["curve"] if p["round"] == demo_rounds), None)
    out["round_reaching_centralized_demo_loss"] = None if reference is None else rounds_to_reach(
        fed["curve"], target=reference, relative=GOALS["loss_gap_relative"][1])
    stock_late = runs.get(FLOWER, {}).get("bytes_per_round_per_cluster_from_round_2")
    out["bytes_ratio_vs_flower_lora_from_round_2"] = ratio(stock_late, fed.get("bytes_per_round_per_cluster_from_round_2"))
    out["zero_shot_loss"] = fed["curve"][0]["loss"] if fed["curve"][0]["round"] == 0 else None
    out["zero_shot_exact_match"] = fed["curve"][0]["exact-match"] if fed["curve"][0]["round"] == 0 else None
    return out


def first_round_within(fed: list[dict], reference: list[dict], *, relative: float) -> int | None:
    """The first round from which the federated held-out loss stays within `relative` of the reference's at the
    same round (the same examples seen), or None if it does not by the last."""
    ref = {p["round"]: p["loss"] for p in reference}
    rounds = [p["round"] for p in fed if p["round"] >= 1 and p["round"] in ref]
    ok = {p["round"]: (p["loss"] - ref[p["round"]]) / ref[p["round"]] <= relative for p in fed if p["round"] in rounds}
    for r in rounds:
        if all(ok[q] for q in rounds if q >= r):
            return r
    return None


def rounds_to_reach(curve: list[dict], *, target: float, relative: float) -> int | None:
    """The first round whose held-out loss is within `relative` of `target` (at or below target x (1 + relative)),
    or None if none is."""
    return next((p["round"] for p in curve if p["round"] >= 1 and p["loss"] <= target * (1 + relative)), None)


def judge(values: dict[str, float | None]) -> dict[str, dict[str, Any]]:
    """Each goal with its measured value and whether it is met (a figure that could not be computed is not)."""
    out = {}
    for key, (op, bound) in GOALS.items():
        value = values.get(key)
        met = value is not None and not math.isnan(value) and (value >= bound if op == ">=" else value <= bound)
        out[key] = {"goal": f"{op} {bound:g}", "value": value, "met": met}
    return out


# -- running -----------------------------------------------------------------------------------------
def run_nebula(name: str, args_: list[str], *, out: Path, console: Console) -> dict:
    folder = out / name.replace(":", "-")
    console.print(f"{name}: nebula_fl run {shlex.join(args_)} --out {folder}")
    load = os.getloadavg()[0]  # other work on the box slows a run, never changes its figures but wall_seconds
    started = time.monotonic()
    summary, lines = run_federation(args_, folder=folder, log=out / f"{folder.name}.log")
    return {"system": "nebula-fl", "command": ["nebula-fl", "run", *args_, "--out", str(folder)],
            "wall_seconds": time.monotonic() - started, "load_average_at_start": load, "folder": str(folder),
            "curve": curve(summary.get("initial_evaluation"), lines),
            "examples_seen": sum(c.get("examples_seen", 0) for line in lines for c in line["clusters"].values()),
            "steps": sum(c.get("steps", 0) for line in lines for c in line["clusters"].values()),
            "bytes_per_round_per_cluster": bytes_per_round(lines),
            "bytes_per_round_per_cluster_from_round_2": bytes_per_round(lines, first=2),
            "bytes_total": summary.get("bytes_up_total", 0) + summary.get("bytes_down_total", 0)}


def run_stock(cfg: RunConfig, *, clusters: int, link: str, out: Path, console: Console) -> dict:
    folder = out / FLOWER
    console.print(f"{FLOWER}: stock Flower FedAvg on the PEFT adapter, {folder}")
    load = os.getloadavg()[0]
    started = time.monotonic()
    try:
        with StockFederation(app=STOCK_APP, folder=folder, clusters=clusters, link=link) as fed:
            config = stock_run_config(cfg, clusters=clusters, folder=folder, controls=fed.controls)
            fed.run(config)
            fed.wait(timeout_s=3 * 3600)
    except (RuntimeError, TimeoutError) as err:
        raise SystemExit(str(err)) from None
    if not (folder / "done.json").exists():
        raise SystemExit(f"the stock Flower run did not finish; see {folder / 'server.log'}")
    lines = metrics_lines(folder)
    initial = lines[0] if lines and lines[0]["round"] == 0 else None
    rounds = [line for line in lines if line["round"] >= 1]
    return {"system": "flower", "command": ["flwr", "run", str(STOCK_APP), "local", "--run-config", config],
            "wall_seconds": time.monotonic() - started, "load_average_at_start": load, "folder": str(folder),
            "curve": curve(initial, rounds),
            "bytes_per_round_per_cluster": bytes_per_round(rounds),
            "bytes_per_round_per_cluster_from_round_2": bytes_per_round(rounds, first=2)}


MEMORY_SETTINGS = ((8, 256, "fp32"), (8, 256, "bf16"), (8, 256, "nf4"))


def memory_rows(console: Console) -> list[dict]:
    """Peak resident memory of one worker per base precision: decoder_memory.py's measurement (load SmolLM2 as the
    task does, 3 AdamW steps at 8 x 256 tokens), each setting in a fresh process."""
    rows = []
    for batch, tokens, dtype in MEMORY_SETTINGS:
        console.print(f"memory: {dtype} base, batch {batch} x {tokens} tokens, in a fresh process")
        done = subprocess.run([sys.executable, str(HERE / "decoder_memory.py"), "--one", str(batch), str(tokens),
                               dtype, "0"], check=True, capture_output=True, text=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def records_figures(console: Console) -> dict[str, Any]:
    """What max-seq-len does to the shipped data, no federation needed: the BBC instruction view (2,225 records)
    at the task's default length and at the demo's, and the BBC articles as plain text, packed (tokens kept /
    tokens in the data) and one row per document (as under per-example DP)."""
    from nebula_fl.data.corpus import load_labelled
    from nebula_fl.data.instructions import load_records
    from nebula_fl.model.loading import load_tokenizer
    from nebula_fl.model.locate import resolve_model_path
    from nebula_fl.tasks.causal_lm import CausalRecords

    tokenizer = load_tokenizer(resolve_model_path("smollm2"))
    view = load_records("bbcnews")
    default = int(CausalLMTask.run_defaults()["max-seq-len"])
    out: dict[str, Any] = {}
    for name, length in (("instruction_view_default_length", default),
                         ("instruction_view_demo_length", int(DEMO["max-seq-len"]))):
        console.print(f"records: the BBC instruction view at max-seq-len {length}")
        records = CausalRecords(tokenizer, view.texts, [str(a) for a in view.labels], max_len=length,
                                objective="instruct", template="auto", exact_match_tokens=16)
        out[name] = records.report.to_dict()
    articles = load_labelled("bbcnews", targets="classes").texts
    for name, pack in (("plain_text_packed", True), ("plain_text_one_row_per_document", False)):
        console.print(f"records: the BBC articles as plain text at max-seq-len {default}, {name}")
        report = CausalRecords(tokenizer, articles, [""] * len(articles), max_len=default, objective="instruct",
                               template="auto", exact_match_tokens=16, pack=pack).report
        out[name] = {**report.to_dict(), "kept_ratio": report.text_tokens_kept / report.text_tokens}
    return out


def machine() -> dict[str, Any]:
    import torch

    load = os.getloadavg()
    return {"cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "load_average_at_end": [round(x, 2) for x in load]}


# -- output --------------------------------------------------------------------------------------------
def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    styles = {CENTRALIZED: ("o", "-"), DATA_PARALLEL: ("s", "--"), FEDERATED: ("^", "-"),
              results["chain_run"]: ("D", ":"), FLOWER: ("x", "-.")}  # close curves: told apart by marker and line
    for name, (marker, line) in styles.items():
        if name not in results["runs"]:
            continue
        points = results["runs"][name]["curve"]
        rounds = [p["round"] for p in points]
        left.plot(rounds, [p["loss"] for p in points], marker=marker, linestyle=line, label=name)
        right.plot(rounds, [100.0 * p["exact-match"] for p in points], marker=marker, linestyle=line, label=name)
    left.set_ylabel("held-out loss per learned token (log)")
    left.set_yscale("log")  # the late rounds, where the runs differ by tens of percent, stay readable
    right.set_ylabel("held-out exact match (%)")
    for ax in (left, right):
        ax.set_xlabel("round (0: the pretrained model, zero-shot)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    f = results["figures"]
    title = (f"{MODEL_NOTE}\nfederated vs centralized: loss gap {100 * f['loss_gap_relative']:+.1f}%, "
             f"exact-match gap {f['exact_match_gap_points']:+.1f} points")
    if f.get("loss_gap_relative_vs_data_parallel") is not None:
        title += (f"; vs data-parallel: {100 * f['loss_gap_relative_vs_data_parallel']:+.1f}%, "
                  f"{f['exact_match_gap_points_vs_data_parallel']:+.1f} points")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def results_table(results: dict) -> Any:
    shown = table(f"causal-lm: {MODEL_NOTE}; {results['settings']['clusters']} clusters, "
                  f"{results['settings']['partition']}, seed {results['settings']['seed']}",
                  ("run", "zero-shot loss", "final loss", "zero-shot EM", "final EM", "inner steps",
                   "WAN B / round / cluster", "wall s"))
    for name, run in results["runs"].items():
        first, last = run["curve"][0], run["curve"][-1]
        shown.add_row(name, _num(first["loss"], ".4f") if first["round"] == 0 else "-", _num(last["loss"], ".4f"),
                      _num(first["exact-match"], ".3f") if first["round"] == 0 else "-",
                      _num(last["exact-match"], ".3f"), str(run.get("steps", "-")),
                      _num(run.get("bytes_per_round_per_cluster"), ",.0f"), f"{run['wall_seconds']:.0f}")
    return shown


def memory_table(rows: list[dict]) -> Any:
    shown = table("one causal-lm worker, SmolLM2-135M + LoRA, CPU: peak resident memory",
                  ("base", "batch x tokens", "weights MB", "loaded MB", "trained MB"))
    for r in rows:
        shown.add_row(r["base_dtype"], f"{r['batch']} x {r['tokens']}", f"{r['weights_mb']:.0f}",
                      f"{r['loaded_mb']:.0f}", f"{r['trained_mb']:.0f}")
    return shown


def goals_table(results: dict) -> Any:
    shown = table("figures vs goals", ("figure", "measured", "goal", "met"))
    for key, g in results["goals"].items():
        fmt = ".4f" if "relative" in key else ".2f"
        shown.add_row(key, _num(g["value"], fmt), g["goal"].replace("<=", "≤").replace(">=", "≥"), "yes" if g["met"] else "[bold red]MISSED[/]")
    for key in ("first_round_within_loss_goal", "round_reaching_centralized_demo_loss", "bytes_ratio_vs_flower_lora", "bytes_ratio_vs_flower_lora_from_round_2",
                "bytes_ratio_vs_flower_lora_compressed", "loss_cost_relative_compressed",
                "exact_match_cost_points_compressed", "exact_match_resolution_points"):
        value = results["figures"].get(key)
        shown.add_row(key, _num(value, ".4f" if "relative" in key else ".2f"), "-", "-")
    return shown


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK.rounds} rounds x {QUICK.local_steps} steps on {QUICK.max_examples} examples: "
                             "the 5 runs in <= 20 min on 2 idle cores")
    parser.add_argument("--rounds", type=int, help="rounds of every run (default: the mode's; more rounds show where "
                                                   "the federation reaches the centralized loss)")
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--partition", default=str(DEMO["partition"]))
    parser.add_argument("--codec", default="topk:0.25+int4", help="the compressed chain of run 3")
    parser.add_argument("--wan", default="20mbit:100ms", help="the link of the byte-counting runs (1, 3, 4)")
    parser.add_argument("--out", default="benchmarks/results/causal")
    parser.add_argument("--report-only", action="store_true",
                        help="no runs: the report again from OUT's runs.json and measured.json (the same flags)")
    args = parser.parse_args()
    if args.clusters < 2:
        parser.error("--clusters must be 2 or more: the centralized run is the 1-cluster case")
    mode = QUICK if args.quick else FULL_MODE
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error("--rounds must be 1 or more")
        mode = dataclasses.replace(mode, rounds=args.rounds)
    console = Console(highlight=False, width=150)
    cfg = run_config(mode, partition=args.partition, seed=args.seed)
    if args.report_only:
        out = Path(args.out)
        measured = json.loads((out / "measured.json").read_text())
        runs = json.loads((out / "runs.json").read_text())
        report(runs, args=args, mode=mode, cfg=cfg, out=out, console=console, records=measured["records"],
               memory=measured["memory"], wall_seconds=sum(r["wall_seconds"] for r in runs.values()))
        return 0
    out = fresh_out(args.out)
    chain_run = f"{FEDERATED}-{args.codec}"
    started = time.monotonic()
    records = records_figures(console)
    memory = memory_rows(console)
    write_results(out, {"records": records, "memory": memory}, name="measured.json")
    runs: dict[str, dict] = {}
    common = {"seed": args.seed, "partition": args.partition}
    runs[FEDERATED] = run_nebula(FEDERATED, nebula_command(mode, clusters=args.clusters, link=args.wan, **common),
                                 out=out, console=console)
    write_results(out, runs, name="runs.json")  # what ran so far, if a later run fails
    runs[CENTRALIZED] = run_nebula(CENTRALIZED, nebula_command(centralized_mode(mode, clusters=args.clusters),
                                                               clusters=1, **common), out=out, console=console)
    write_results(out, runs, name="runs.json")
    runs[DATA_PARALLEL] = run_nebula(DATA_PARALLEL, nebula_command(mode, clusters=1, batch_size=args.clusters
                                                                   * int(cfg.train.batch_size), **common),
                                     out=out, console=console)
    write_results(out, runs, name="runs.json")
    runs[chain_run] = run_nebula(chain_run, nebula_command(mode, clusters=args.clusters, codec=args.codec,
                                                           link=args.wan, **common), out=out, console=console)
    write_results(out, runs, name="runs.json")
    runs[FLOWER] = run_stock(cfg, clusters=args.clusters, link=args.wan, out=out, console=console)
    write_results(out, runs, name="runs.json")
    report(runs, args=args, mode=mode, cfg=cfg, out=out, wall_seconds=time.monotonic() - started, console=console,
           records=records, memory=memory)
    return 0


def report(runs: dict[str, dict], *, args: argparse.Namespace, mode: Mode, cfg: RunConfig, out: Path,
           wall_seconds: float, console: Console, records: dict[str, Any] | None = None,
           memory: list[dict] | None = None) -> dict:
    """results.json, the PNG and the tables from the runs' records."""
    chain_run = f"{FEDERATED}-{args.codec}"
    for name, run in runs.items():
        console.print(f"{name}: " + " | ".join(f"r{p['round']} loss {p['loss']:.4f} EM {p['exact-match']:.3f}"
                                               for p in run["curve"]) + f" ({run['wall_seconds']:.0f} s)")
    for name in (CENTRALIZED, DATA_PARALLEL):
        if name in runs and runs[name].get("examples_seen") != runs[FEDERATED].get("examples_seen"):
            console.print(f"[bold yellow]WARNING: examples seen differ: {name} {runs[name].get('examples_seen')}, "
                          f"federated {runs[FEDERATED].get('examples_seen')}[/]")
    values = figures(runs, chain_run=chain_run)
    if records:
        values["packed_text_tokens_kept_ratio"] = records["plain_text_packed"]["kept_ratio"]
    test_records = _test_records(cfg)
    values["exact_match_resolution_points"] = 100.0 / test_records if test_records else None
    goals = judge(values)
    results = {
        "benchmark": "causal", "quick": args.quick, "command": shlex.join([Path(sys.executable).name, *(a for a in sys.argv if a != "--report-only")]),
        "model": {"name": "smollm2", "what": MODEL_NOTE, "pretrained": True, "task": "causal-lm",
                  "lora_target_modules": cfg.model.lora_target_modules, "lora_r": cfg.model.lora_r},
        "settings": {"rounds": mode.rounds, "local_steps": mode.local_steps,
                     "centralized_local_steps": args.clusters * mode.local_steps,
                     "data_parallel_batch_size": args.clusters * cfg.train.batch_size, "max_examples": mode.max_examples,
                     "test_fraction": mode.test_fraction, "held_out_records": test_records,
                     "clusters": args.clusters, "partition": args.partition, "seed": args.seed,
                     "batch_size": cfg.train.batch_size, "lr": cfg.train.lr, "lr_schedule": cfg.train.lr_schedule,
                     "max_seq_len": cfg.model.max_seq_len, "eval_batch_size": cfg.federation.eval_batch_size,
                     "dataset": cfg.data.dataset, "outer_optimizer": "fedavg", "codec": args.codec, "wan": args.wan,
                     "eval_initial": True},
        "config": cfg.to_flat(), "chain_run": chain_run, "figures": values, "goals": goals,
        "records": records, "memory_per_worker": memory,
        "goals_met": all(g["met"] for g in goals.values()),
        "wall_seconds": wall_seconds, "machine": machine(), "runs": runs,
    }
    write_results(out, results)
    plot(results, out / "causal.png")
    console.print(results_table(results))
    console.print(goals_table(results))
    if memory:
        console.print(memory_table(memory))
    console.print(f"goals met: {'yes' if results['goals_met'] else 'NO'}; {results['wall_seconds'] / 60:.1f} min; "
                  f"results: {out / 'results.json'}")
    return results


def _test_records(cfg: RunConfig) -> int:
    """Held-out records (the instruction view's answers are one-word topics: every record counts towards exact match,
    so one record is the resolution of exact match)."""
    from nebula_fl.data.datasets import train_test_split

    _, test = train_test_split(cfg.data, seed=cfg.federation.seed, targets="text")
    return len(test)


if __name__ == "__main__":
    raise SystemExit(main())
