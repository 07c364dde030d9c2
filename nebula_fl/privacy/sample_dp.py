"""Sample-level DP inside a cluster: Opacus's DP-SGD around the trainer's model, optimizer and data.

Opacus does the work: per-example gradients (GradSampleModule), clipping and noise (DPOptimizer; with
several ranks its DistributedDPOptimizer and DPDDP, so the cluster's whole logical batch is clipped
and noised once), and Poisson sampling (DPDataLoader; with several ranks its distributed sampler).
Its own accountant is not used: the cluster's ``PrivacyLedger`` records every step of the run and is
checkpointed with the trainer. Sampling and noise draw from torch's global RNG (``secure_mode`` off),
which the trainer snapshots, so a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from nebula_fl.model.batches import TokenizedTexts


class TokenDataset(Dataset):
    """(input ids, attention mask, label) per example, the shapes Opacus's empty-batch handling expects."""

    def __init__(self, data: TokenizedTexts) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids = torch.from_numpy(self.data.ids[i])
        return ids, torch.ones_like(ids), torch.tensor(int(self.data.labels[i]))


def collate(rows: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], pad_id: int = 0) -> list[torch.Tensor]:
    """Pad a batch to its longest example."""
    width = max(int(r[0].numel()) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for j, (x, m, _) in enumerate(rows):
        ids[j, : x.numel()] = x
        mask[j, : m.numel()] = m
    return [ids, mask, torch.stack([r[2] for r in rows])]


@dataclass
class PrivateTraining:
    module: nn.Module
    optimizer: Any  # opacus DPOptimizer
    loader: DataLoader

    @property
    def sample_rate(self) -> float:
        """Probability that an example is in a step's (logical, cluster-wide) batch."""
        return 1.0 / len(self.loader)


def make_private(
    *, model: nn.Module, optimizer: torch.optim.Optimizer, data: TokenizedTexts, batch_size: int,
    noise_multiplier: float, max_grad_norm: float, distributed: bool, poisson_sampling: bool = True,
) -> PrivateTraining:
    """Wrap model, optimizer and data for DP-SGD; `batch_size` is the cluster's expected logical batch."""
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    model.train()  # Opacus's hooks need train mode; from_pretrained returns eval mode
    module = DPDDP(model) if distributed else model
    pad_id = data.pad_id
    loader = DataLoader(TokenDataset(data), batch_size=batch_size, shuffle=not poisson_sampling,
                        collate_fn=lambda rows: collate(rows, pad_id))
    engine = PrivacyEngine(accountant="rdp", secure_mode=False)
    module, dp_optimizer, dp_loader = engine.make_private(
        module=module, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, poisson_sampling=poisson_sampling, grad_sample_mode="hooks",
    )
    return PrivateTraining(module, dp_optimizer, dp_loader)


class Batches:
    """An endless stream of the DP loader's batches (a new Poisson epoch when one runs out)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self.it: Iterator | None = None

    def next(self) -> list[torch.Tensor]:
        if self.it is None:
            self.it = iter(self.loader)
        try:
            return next(self.it)
        except StopIteration:
            self.it = iter(self.loader)
            return next(self.it)

    def reset(self) -> None:
        self.it = None


def train_private_steps(training: PrivateTraining, batches: Batches, *, steps: int, device: torch.device,
                        lr_at=None) -> list[float]:
    """`steps` DP-SGD steps; returns the loss of each (NaN for an empty Poisson batch)."""
    training.module.train()
    losses = []
    for i in range(steps):
        if lr_at is not None:
            for group in training.optimizer.param_groups:
                group["lr"] = lr_at(i)
        ids, mask, labels = (t.to(device) for t in batches.next())
        training.optimizer.zero_grad(set_to_none=True)
        # An empty Poisson batch (rare) goes through the same path: no per-example gradient, so the
        # step is pure noise, as the mechanism requires; its loss is NaN and is left out of the mean.
        logits = training.module(input_ids=ids, attention_mask=mask)
        loss = nn.functional.cross_entropy(logits, labels)
        loss.backward()
        training.optimizer.step()
        losses.append(float(loss.detach()) if ids.shape[0] else float("nan"))
    return losses
