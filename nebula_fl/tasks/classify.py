"""Sequence classification with a LoRA adapter (the default task): MiniLM + mean pooling + a linear head.

Only the PEFT adapter and the head are trained and exchanged; the base model stays where it is. The one task
that runs per-example DP-SGD (Opacus) as well: its model is what Opacus's per-sample gradients support.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.evaluation import evaluate
from nebula_fl.model.loading import build_model
from nebula_fl.tasks.base import Examples, Task, TaskSetup


class ClassifyTask(Task):
    name = "classify"
    exchange = "adapter"
    metric = "accuracy"
    privacy_modes = ("off", "sample", "client")

    def build_model(self, setup: TaskSetup) -> nn.Module:
        if not setup.labels:
            raise ValueError("the classify task needs labelled data: the federation knows no labels")
        return build_model(setup.model, num_labels=len(setup.labels), seed=setup.seed, path=setup.path,
                           privacy_mode=setup.privacy_mode)

    def examples(self, *, setup: TaskSetup, tokenizer, texts: Sequence[str], labels: np.ndarray,
                 train: bool) -> TokenizedTexts:
        return TokenizedTexts(tokenizer, texts, labels, max_len=setup.model.max_seq_len)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        return nn.functional.cross_entropy(logits, batch["labels"])

    def evaluate(self, model: nn.Module, data: Examples, *, batch_size: int) -> dict[str, float]:
        return evaluate(model, data, batch_size=batch_size, num_classes=head_width(model))  # type: ignore[arg-type]


def head_width(model: nn.Module) -> int:
    """The classification head's width (PEFT wraps the head in a ModulesToSaveWrapper)."""
    for name, module in model.named_modules():
        if name.endswith(("head", "head.modules_to_save.default")) and hasattr(module, "out_features"):
            return int(module.out_features)
    raise ValueError("the classifier has no 'head' layer")
