"""Peak memory of one causal-lm worker training SmolLM2 with LoRA, per base precision and with gradient
checkpointing, measured, beside the model the README uses for larger decoders.

Each setting runs in a fresh process (peak resident memory is per process): the shipped SmolLM2-135M-Instruct
loaded as the task loads it (`task.base-dtype` fp32, bf16, nf4 or int8; LoRA on q_proj,v_proj), then 3 AdamW steps
on BBC instruction records of the setting's batch and length. Reported: the base's weight bytes, the peak once
loaded, the peak after training, and activation memory per token = (trained - loaded) / tokens per batch; for the
fp32 rows without checkpointing, against the README's model of it, layers x (10 x hidden + 4 x MLP width) x 4 bytes,
with the model's error.

    .venv/bin/python benchmarks/decoder_memory.py            # 8 settings, ~4 min on 2 cores
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

# (batch, tokens, base dtype, gradient checkpointing): the demo's batches, then longer ones under each base
SETTINGS = ((4, 96, "fp32", False), (8, 256, "fp32", False), (8, 256, "bf16", False), (8, 256, "nf4", False),
            (8, 256, "int8", False), (8, 256, "fp32", True), (8, 256, "bf16", True), (8, 256, "nf4", True))


def measure(batch: int, tokens: int, base_dtype: str, checkpointing: bool) -> dict:
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
    task = make_task("causal-lm", {"task.base-dtype": base_dtype, "task.gradient-checkpointing": checkpointing})
    setup = TaskSetup(model=ModelConfig(model="smollm2", max_seq_len=tokens, lora_target_modules="q_proj,v_proj"),
                      labels=[], seed=0, path=resolve_model_path("smollm2"))
    tokenizer, model = task.tokenizer(setup), task.build_model(setup)
    model.train()
    loaded = peak_mb()
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 2**20
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
    return {"batch": batch, "tokens": tokens, "base_dtype": base_dtype, "checkpointing": checkpointing,
            "weights_mb": weights, "tokens_per_batch": seen, "loaded_mb": loaded, "trained_mb": peak_mb(),
            "layers": config.num_hidden_layers, "hidden": config.hidden_size, "mlp": config.intermediate_size,
            "parameters": sum(p.numel() for p in model.parameters())}


def modelled_mb_per_token(*, layers: int, hidden: int, mlp: int, bytes_per_value: int = 4) -> float:
    """The README's activation model: per layer ~10 hidden-wide and 4 MLP-wide values kept for the backward pass."""
    return layers * (10 * hidden + 4 * mlp) * bytes_per_value / 2**20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/decoder-memory")
    parser.add_argument("--one", nargs=4, metavar=("BATCH", "TOKENS", "DTYPE", "CHECKPOINTING"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # the child: one setting, its figures on stdout
        batch, tokens, dtype, checkpointing = args.one
        print(json.dumps(measure(int(batch), int(tokens), dtype, checkpointing == "1")))
        return 0
    out = fresh_out(args.out)
    console = Console(highlight=False)
    rows = []
    for batch, tokens, dtype, checkpointing in SETTINGS:
        console.print(f"batch {batch} x {tokens} tokens, {dtype} base{', checkpointing' if checkpointing else ''}: a "
                      "fresh process loads SmolLM2 and trains 3 steps")
        done = subprocess.run([sys.executable, __file__, "--one", str(batch), str(tokens), dtype,
                               "1" if checkpointing else "0"], check=True, capture_output=True, text=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        row["measured_mb_per_token"] = (row["trained_mb"] - row["loaded_mb"]) / row["tokens_per_batch"]
        if dtype == "fp32" and not checkpointing:
            row["modelled_mb_per_token"] = modelled_mb_per_token(layers=row["layers"], hidden=row["hidden"],
                                                                 mlp=row["mlp"])
            row["model_error"] = row["modelled_mb_per_token"] / row["measured_mb_per_token"] - 1
        rows.append(row)
    write_results(out, {"benchmark": "decoder_memory", "model": "smollm2 (LoRA q_proj,v_proj), CPU", "rows": rows})
    shown = table("causal-lm worker, SmolLM2-135M + LoRA, CPU: peak resident memory",
                  ("batch x tokens", "base", "checkpointing", "weights MB", "loaded MB", "trained MB", "MB / token",
                   "modelled", "error"))
    for r in rows:
        modelled = "modelled_mb_per_token" in r
        shown.add_row(f"{r['batch']} x {r['tokens']}", r["base_dtype"], "yes" if r["checkpointing"] else "no",
                      f"{r['weights_mb']:.0f}", f"{r['loaded_mb']:.0f}", f"{r['trained_mb']:.0f}",
                      f"{r['measured_mb_per_token']:.2f}", f"{r['modelled_mb_per_token']:.2f}" if modelled else "-",
                      f"{100 * r['model_error']:+.0f}%" if modelled else "-")
    console.print(shown)
    console.print(f"results: {Path(out) / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
