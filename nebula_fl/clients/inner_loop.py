"""The inner loop a cluster runs each round: `local_steps` AdamW steps on its own shard, on its task's loss.

Readable top to bottom on purpose; data parallelism is DDP's job (gradients are averaged inside
``backward``), so this file is the same for one worker or many.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from nebula_fl.devices import autocast
from nebula_fl.tasks.base import Examples


class BatchSchedule:
    """An endless, seeded stream of batches over one worker's shard: epoch after reshuffled epoch.

    Batch `k` depends only on (seed, rank, k), so the stream resumes exactly from a step count.
    """

    def __init__(self, num_examples: int, *, batch_size: int, seed: int, rank: int) -> None:
        if num_examples < 1:
            raise ValueError("a worker needs at least one example")
        self.n, self.batch_size, self.seed, self.rank = num_examples, batch_size, seed, rank
        self.step = 0

    def _epoch(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, self.rank, epoch]).permutation(self.n)

    def next_indices(self) -> np.ndarray:
        start = self.step * self.batch_size
        positions = np.arange(start, start + self.batch_size)
        epochs = positions // self.n
        out = np.empty(self.batch_size, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._epoch(int(epoch))[positions[sel] % self.n]
        self.step += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "n": self.n, "batch_size": self.batch_size, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("n", "batch_size", "seed"):
            if state[key] != getattr(self, key):
                raise ValueError(f"batch schedule mismatch on '{key}': saved {state[key]}, now {getattr(self, key)}")
        self.step = int(state["step"])


def scheduled_lr(base: float, *, progress: float, schedule: str, min_ratio: float) -> float:
    """The learning rate at `progress` (0 = first step of the run, 1 = after the last)."""
    if schedule == "constant":
        return base
    if schedule == "cosine":
        p = min(max(progress, 0.0), 1.0)
        return base * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p)))
    raise ValueError(f"unknown learning-rate schedule '{schedule}'")


def warmed_lr(base: float, *, step: int, total: int, warmup: float, schedule: str, min_ratio: float) -> float:
    """The rate at inner step `step` (0-based) of `total`: a linear rise over the first ceil(`warmup` x `total`)
    steps, from base / W at the first to `base` at the W-th (never 0: every step moves), then `schedule` over the
    steps left, as transformers' ``get_cosine_schedule_with_warmup`` shapes it."""
    warm = math.ceil(warmup * total) if warmup > 0 else 0
    if step < warm:
        return base * (step + 1) / warm
    return scheduled_lr(base, progress=(step - warm) / max(1, total - warm), schedule=schedule, min_ratio=min_ratio)


def classification_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return nn.functional.cross_entropy(logits, batch["labels"])


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Examples,
    schedule: BatchSchedule,
    *,
    steps: int,
    max_grad_norm: float,
    device: torch.device,
    lr_at: Callable[[int], float] | None = None,
    loss_fn: Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor] = classification_loss,
    keep_going: Callable[[int], bool] | None = None,
    precision: str = "fp32",
) -> list[float]:
    """Run up to `steps` optimizer steps (step i at learning rate `lr_at(i)`) on the task's loss (`loss_fn`, a
    Task's ``loss``), fewer when `keep_going(steps done)` says stop (a time budget); returns this worker's loss
    per step. With `precision` 'bf16' the forward and loss run under autocast; weights, gradients and the
    optimizer stay fp32, so what a cluster exchanges is fp32 whatever it trains in. A `prox-mu` term rides on
    `optimizer` as a step pre-hook (``clients/proximal.py``): its gradient joins after the clipping below."""
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    for i in range(steps):
        if keep_going is not None and not keep_going(i):
            break
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(i)
        with autocast(device, precision):
            loss = loss_fn(model, data.batch(schedule.next_indices(), device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses
