"""Peak memory of one causal-lm worker training SmolLM2 with LoRA, measured, beside the model the README uses for
larger decoders.

Each setting runs in a fresh process (peak resident memory is per process): the shipped SmolLM2-135M-Instruct
loaded as the task loads it (float32, LoRA on q_proj,v_proj), then 3 AdamW steps on BBC instruction records of
the setting's batch and length. Reported: the peak once loaded, the peak after training, and activation memory per
token = (trained - loaded) / tokens per batch, against the README's model of it, layers x (10 x hidden + 4 x MLP
width) x 4 bytes (float32), with the model's error.

    .venv/bin/python benchmarks/decoder_memory.py            # batches 4 x 96 and 8 x 256 tokens, ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

from harness import fresh_out, table, write_results
from rich.console import Console

SETTINGS = ((4, 96), (8, 256))  # (batch, tokens): the demo's batches, and longer ones


def measure(batch: int, tokens: int) -> dict:
    """In this process: load, train 3 steps, return the peaks (MB) and the model's shape."""
    import numpy as np
    import torch

    from nebula_fl.config import DataConfig, ModelConfig
    from nebula_fl.data.datasets import train_test_split
    from nebula_fl.model.locate import resolve_model_path
    from nebula_fl.tasks import TaskSetup, make_task

    def peak_mb() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    torch.set_num_threads(1)
    train, _ = train_test_split(DataConfig(dataset="bbcnews", max_examples=200), seed=0, targets="text")
    task = make_task("causal-lm", {})
    setup = TaskSetup(model=ModelConfig(model="smollm2", max_seq_len=tokens, lora_target_modules="q_proj,v_proj"),
                      labels=[], seed=0, path=resolve_model_path("smollm2"))
    tokenizer, model = task.tokenizer(setup), task.build_model(setup)
    loaded = peak_mb()
    examples = task.examples(setup=setup, tokenizer=tokenizer, texts=train.texts, labels=train.labels, train=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-4)
    seen = 0
    for step in range(3):
        batch_ = examples.batch(np.arange(step * batch, (step + 1) * batch))
        seen = max(seen, int(batch_["input_ids"].numel()))  # padded positions cost memory too
        task.loss(model, batch_).backward()
        optimizer.step()
        optimizer.zero_grad()
    config = model.get_base_model().config
    return {"batch": batch, "tokens": tokens, "tokens_per_batch": seen, "loaded_mb": loaded, "trained_mb": peak_mb(),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "mlp": config.intermediate_size,
            "parameters": sum(p.numel() for p in model.parameters())}


def modelled_mb_per_token(*, layers: int, hidden: int, mlp: int, bytes_per_value: int = 4) -> float:
    """The README's activation model: per layer ~10 hidden-wide and 4 MLP-wide values kept for the backward pass."""
    return layers * (10 * hidden + 4 * mlp) * bytes_per_value / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/decoder-memory")
    parser.add_argument("--one", nargs=2, type=int, metavar=("BATCH", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child: one setting, its figures on stdout
        print(json.dumps(measure(*args.one)))
        return 0
    out = fresh_out(args.out)
    console = Console(highlight=False)
    rows = []
    for batch, tokens in SETTINGS:
        console.print(f"batch {batch} x {tokens} tokens: a fresh process loads SmolLM2 and trains 3 steps")
        done = subprocess.run([sys.executable, __file__, "--one", str(batch), str(tokens)], check=True,
                              capture_output=True, text=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["measured_mb_per_token"] = (row["trained_mb"] - row["loaded_mb"]) / row["tokens_per_batch"]
        row["modelled_mb_per_token"] = modelled_mb_per_token(layers=row["layers"], hidden=row["hidden"], mlp=row["mlp"])
        row["model_error"] = row["modelled_mb_per_token"] / row["measured_mb_per_token"] - 1
        rows.append(row)
    write_results(out, {"benchmark": "decoder_memory", "model": "smollm2 (float32, LoRA q_proj,v_proj)", "rows": rows})
    shown = table("causal-lm worker, SmolLM2-135M + LoRA, float32, CPU: peak resident memory",
                  ("batch x tokens", "tokens in batch", "loaded MB", "trained MB", "MB / token", "modelled", "error"))
    for r in rows:
        shown.add_row(f"{r['batch']} x {r['tokens']}", str(r["tokens_per_batch"]), f"{r['loaded_mb']:.0f}",
                      f"{r['trained_mb']:.0f}", f"{r['measured_mb_per_token']:.2f}", f"{r['modelled_mb_per_token']:.2f}",
                      f"{100 * r['model_error']:+.0f}%")
    console.print(shown)
    console.print(f"results: {Path(out) / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
