"""Text regression as a nebula-fl task: predict a number from a text (here, a tweet's signed sentiment score).

MiniLM with LoRA and a one-output linear layer on the mean-pooled token states, trained with the mean squared
error (or Huber); only the LoRA adapter and that layer cross the WAN. The task declares ``targets = "values"``, so
the label column is read as numbers, the test split and a Dirichlet partition are stratified by quantile bins of
the score, and ``examples`` gets float32 targets. Its metrics put the root mean squared error beside what
predicting the test split's own mean would score, so a run shows whether the model learned anything at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from nebula_fl.config import Section, require
from nebula_fl.model.loading import build_model
from nebula_fl.tasks.base import Task, TaskSetup

DATA = Path(__file__).resolve().parent / "sentiment_scores.csv"  # 5,000 scored tweets (make_data.py)
LOSSES = ("mse", "huber")


@dataclass(kw_only=True, frozen=True)
class RegressionOptions(Section):
    """The training loss (``task.*`` keys)."""

    PREFIX: ClassVar[str] = "task"

    loss: str = "mse"
    """'mse' (squared error) or 'huber' (squared below 1, linear above: outliers pull less)."""

    def __post_init__(self) -> None:
        require(self.loss in LOSSES, "task.loss", f"is {self.loss!r}", f"use one of {', '.join(LOSSES)}")


class ScoredTexts:
    """Texts tokenised once, with a float target each; batches padded to their longest text."""

    def __init__(self, tokenizer, texts: Sequence[str], targets: np.ndarray, *, max_len: int) -> None:
        self.ids = [np.asarray(x, dtype=np.int64)
                    for x in tokenizer(list(texts), truncation=True, max_length=max_len)["input_ids"]]
        self.targets = np.asarray(targets, dtype=np.float32)
        if len(self.targets) != len(self.ids):
            raise ValueError(f"{len(self.ids)} texts but {len(self.targets)} targets")
        self.pad_id = int(tokenizer.pad_token_id or 0)

    def __len__(self) -> int:
        return len(self.ids)

    def batch(self, indices: Sequence[int] | np.ndarray, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        rows = np.asarray(indices, dtype=np.int64).reshape(-1)
        width = max(len(self.ids[i]) for i in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for j, i in enumerate(rows):
            ids[j, : len(self.ids[i])], mask[j, : len(self.ids[i])] = self.ids[i], 1
        return {"input_ids": torch.from_numpy(ids).to(device), "attention_mask": torch.from_numpy(mask).to(device),
                "targets": torch.from_numpy(self.targets[rows]).to(device)}


class TextRegressionTask(Task):
    name = "text-regression"
    exchange = "adapter"
    targets = "values"
    metrics = ("rmse", "mae", "loss", "rmse_of_mean", "mae_of_mean")
    metric = "rmse"
    higher_is_better = False
    privacy_modes = ("off", "client")  # no 'sample': the classify task's Opacus path reads class labels
    Options = RegressionOptions
    presets: ClassVar[dict[str, dict[str, Any]]] = {
        # Every code path in seconds: 300 of the shipped tweets, 2 rounds of 3 steps.
        "smoke": {"dataset": str(DATA), "max-examples": 300, "max-seq-len": 48, "partition": "iid"},
        # All 5,000 tweets, skewed by score across the clusters.
        "demo": {"dataset": str(DATA), "max-seq-len": 64, "partition": "dirichlet:1.0", "local-steps": 20,
                 "num-server-rounds": 8},
    }

    def build_model(self, setup: TaskSetup) -> nn.Module:
        """The classify task's model with one output: MiniLM, LoRA, mean pooling, a 1-wide linear layer."""
        return build_model(setup.model, num_labels=1, seed=setup.seed, path=setup.path, privacy_mode=setup.privacy_mode)

    def examples(self, *, setup: TaskSetup, tokenizer, texts: Sequence[str], labels: np.ndarray,
                 train: bool) -> ScoredTexts:
        return ScoredTexts(tokenizer, texts, labels, max_len=setup.model.max_seq_len)

    def predict(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).squeeze(-1)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        prediction = self.predict(model, batch)
        if self.options.loss == "huber":
            return nn.functional.huber_loss(prediction, batch["targets"])
        return nn.functional.mse_loss(prediction, batch["targets"])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, data: ScoredTexts, *, batch_size: int) -> dict[str, float]:
        """RMSE, MAE and the training loss on held-out texts, and the RMSE and MAE of always predicting their mean
        (the best constant for RMSE): a model worth its weights scores below those."""
        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        predictions = []
        try:
            for start in range(0, len(data), batch_size):
                batch = data.batch(np.arange(start, min(start + batch_size, len(data))), device)
                predictions.append(self.predict(model, batch).float().cpu().numpy())
        finally:
            model.train(was_training)
        truth = data.targets.astype(np.float64)
        error = np.concatenate(predictions).astype(np.float64) - truth
        loss = self.loss_of(error)
        mean_error = truth.mean() - truth
        return {"rmse": float(np.sqrt(np.mean(error**2))), "mae": float(np.mean(np.abs(error))), "loss": loss,
                "rmse_of_mean": float(np.sqrt(np.mean(mean_error**2))), "mae_of_mean": float(np.mean(np.abs(mean_error)))}

    def loss_of(self, error: np.ndarray) -> float:
        """The training loss's mean over prediction errors (torch's Huber with delta 1)."""
        if self.options.loss == "huber":
            small = np.abs(error) < 1.0
            return float(np.mean(np.where(small, 0.5 * error**2, np.abs(error) - 0.5)))
        return float(np.mean(error**2))
