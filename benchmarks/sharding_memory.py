"""Memory per rank inside one cluster: `--parallel fsdp` (FSDP2, each rank a shard) vs `ddp` (each rank all of it).

A random BERT built here (no download), with a mean-pool classification head, trained 2 AdamW steps by 2 and 4
gloo ranks, each way, twice: full fine-tuning (every weight trainable: weights, gradients and two AdamW moments,
where sharding saves most) and LoRA (r 8 on query/value plus the head: the frozen base weights dominate). The
model is wrapped as the trainer wraps it (``clients/sharding.wrap``). Each rank reports:

  held        the exact bytes it holds in parameters + gradients + optimizer state (its local shards under fsdp;
              DDP's gradient buckets, another copy of the trainable gradients, are not counted)
  peak        its peak RSS growth over the whole run (``ru_maxrss`` minus the value before the model was built):
              under fsdp this includes the whole model, built once on every rank before it is sharded, as the
              trainer does
  wrapped     its RSS once the model is wrapped (garbage collected, freed heap handed back) minus its RSS before
              the model was built: what it keeps of the model before training
  train peak  its peak RSS while training (the high-water mark reset once the model is wrapped) minus its RSS
              before the model was built: what the steady state needs
  cuda peak   ``torch.cuda.max_memory_allocated`` with --device cuda (NCCL), else absent

    .venv/bin/python benchmarks/sharding_memory.py --quick   # hidden 384, 4 layers: about 2 min on 2 cores
    .venv/bin/python benchmarks/sharding_memory.py           # hidden 768, 8 layers

Writes benchmarks/results/sharding_memory/results.json (one row per world, mode and parallel, with every rank's
figures) and prints a table of the mean over ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Reset this process's RSS high-water mark (VmHWM); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _release() -> None:
    """Collect garbage and hand freed heap back to the OS (glibc keeps it otherwise), so RSS shows live memory."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _build(spec: dict, mode: str):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertModel

    from nebula_fl.model.classifier import SequenceClassifier

    torch.manual_seed(0)
    hidden = spec["hidden"]
    config = BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=spec["layers"],
                        num_attention_heads=max(1, hidden // 64), intermediate_size=4 * hidden,
                        max_position_embeddings=max(128, spec["seq"]))
    model = SequenceClassifier(BertModel(config, add_pooling_layer=False), hidden_size=hidden, num_labels=4)
    if mode == "lora":
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["query", "value"],
                                                 modules_to_save=["head"]))
    return model


def _local_bytes(tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def _rank(rank: int, world: int, init_file: str, spec: dict, parallel: str, mode: str, out: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist
    from harness import wrap_parallel as wrap  # beside this script: spawned ranks run it as __mp_main__

    torch.set_num_threads(1)
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    import peft  # noqa: F401  (the libraries the build and the wrap load: their code is not the model's memory)
    import torch.distributed.fsdp
    import transformers.models.bert.modeling_bert  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    _release()
    before_rss, before_max = _status_kb("VmRSS"), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = _build(spec, mode).to(device)
    params_total = sum(p.numel() for p in model.parameters())
    trainable_total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model = wrap(model, parallel=parallel, device=device, world=world)
    _release()
    after_wrap = _status_kb("VmRSS")
    reset = _reset_peak()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(rank)
    batch = spec["batch"]
    ids = torch.randint(5, 30522, (batch, spec["seq"]), generator=g).to(device)
    labels = torch.randint(0, 4, (batch,), generator=g).to(device)
    started = time.monotonic()
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(input_ids=ids, attention_mask=torch.ones_like(ids)), labels)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
    seconds = (time.monotonic() - started) / 2
    weights = sum(_local_bytes(p) for p in model.parameters())
    grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
    moments = sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
    row = {
        "rank": rank, "params": params_total, "trainable": trainable_total,
        "weights_bytes": weights, "grads_bytes": grads, "optimizer_bytes": moments,
        "held_bytes": weights + grads + moments,
        "peak_rss_growth_bytes": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_max) * 1024,
        "wrapped_rss_growth_bytes": (after_wrap - before_rss) * 1024,
        "train_peak_rss_growth_bytes": (_status_kb("VmHWM") - before_rss) * 1024 if reset else None,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
        "step_seconds": seconds,
    }
    rows: list = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def measure(world: int, spec: dict, parallel: str, mode: str) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="sharding-memory-") as tmp:
        out = Path(tmp) / "rows.json"
        mp.start_processes(_rank, args=(world, str(Path(tmp) / "init"), spec, parallel, mode, str(out)),
                           nprocs=world, start_method="spawn")
        return json.loads(out.read_text())


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="hidden 384, 4 layers (default: hidden 768, 8 layers)")
    parser.add_argument("--ranks", default="2,4", help="world sizes to run, e.g. 2,4")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default="benchmarks/results/sharding_memory")
    args = parser.parse_args()
    spec = {"hidden": 384 if args.quick else 768, "layers": 4 if args.quick else 8, "seq": 64, "batch": 4,
            "device": args.device}
    console = Console(highlight=False)
    if not console.is_terminal:  # a log file: the whole table, not 80 columns of it
        console = Console(highlight=False, width=170)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    started = time.monotonic()
    for world in [int(w) for w in args.ranks.split(",")]:
        for mode in ("full", "lora"):
            for parallel in ("ddp", "fsdp"):
                console.print(f"{world} ranks, {mode}, {parallel} ...")
                ranks = measure(world, spec, parallel, mode)
                mean = {k: sum(r[k] for r in ranks) / world for k in ranks[0]
                        if k != "rank" and all(isinstance(r[k], int | float) for r in ranks)}
                results.append({"world": world, "mode": mode, "parallel": parallel, "mean": mean, "ranks": ranks})
    summary = {"spec": spec, "seconds": time.monotonic() - started, "results": results}
    (out / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    table = Table(title=f"Memory per rank (MiB, mean over ranks): random BERT, hidden {spec['hidden']}, "
                        f"{spec['layers']} layers, batch {spec['batch']} x {spec['seq']} tokens per rank")
    for name in ("ranks", "mode", "parallel", "params (M)", "trainable (M)", "weights", "grads", "AdamW",
                 "held", "peak RSS growth", "wrapped", "train peak", *(["cuda peak"] if args.device == "cuda" else []),
                 "s / step"):
        table.add_column(name, justify="right")
    for r in results:
        m = r["mean"]
        table.add_row(str(r["world"]), r["mode"], r["parallel"], f"{m['params'] / 1e6:.1f}",
                      f"{m['trainable'] / 1e6:.2f}", _mb(m["weights_bytes"]), _mb(m["grads_bytes"]),
                      _mb(m["optimizer_bytes"]), _mb(m["held_bytes"]), _mb(m["peak_rss_growth_bytes"]),
                      _mb(m["wrapped_rss_growth_bytes"]),
                      _mb(m.get("train_peak_rss_growth_bytes")),
                      *([_mb(m.get("cuda_peak_bytes"))] if args.device == "cuda" else []), f"{m['step_seconds']:.2f}")
    console.print(table)
    console.print(f"results: {out / 'results.json'} ({summary['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
