"""Sequence classification with a LoRA adapter (the default task): MiniLM + mean pooling + a linear head.

Only the PEFT adapter and the head are trained and exchanged; the base model stays where it is. It runs
per-example DP-SGD (Opacus) too: its model is what Opacus's per-sample gradients support.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.evaluation import evaluate
from nebula_fl.model.loading import build_model
from nebula_fl.tasks.base import Examples, Task, TaskSetup

if TYPE_CHECKING:
    from nebula_fl.privacy.sample_dp import PerExample


class ClassifyTask(Task):
    name = "classify"
    exchange = "adapter"
    metrics = ("accuracy", "macro_f1", "loss")
    metric = "accuracy"
    privacy_modes = ("off", "sample", "client")

    def build_model(self, setup: TaskSetup) -> nn.Module:
        if not setup.labels:
            raise ValueError("the classify task needs labelled data: the federation knows no labels")
        return build_model(setup.model, num_labels=len(setup.labels), seed=setup.seed, path=setup.path,
                           privacy_mode=setup.privacy_mode)

    def examples(self, *, setup: TaskSetup, tokenizer, texts: Sequence[str], labels: np.ndarray,
                 train: bool) -> TokenizedTexts:
        return TokenizedTexts(tokenizer, texts, labels, max_len=self.seq_len(setup))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return nn.functional.cross_entropy(logits, batch["labels"])

    def private_examples(self, data: Examples) -> PerExample:
        """Opacus samples the tokenised texts themselves (the path this task has always run under sample DP)."""
        from nebula_fl.privacy.sample_dp import token_texts

        return token_texts(data, loss=self.loss)  # type: ignore[arg-type]

    def evaluate(self, model: nn.Module, data: Examples, *, batch_size: int) -> dict[str, float]:
        """Accuracy, macro-F1 (over the logits' columns, whatever the layer that makes them is called) and loss."""
        return evaluate(model, data, batch_size=batch_size)  # type: ignore[arg-type]
