"""Accuracy, macro-F1 and loss of a classifier on a tokenised split."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from nebula_fl.model.batches import TokenizedTexts


def macro_f1(y_true: np.ndarray, y_pred: np.ndarray, *, num_classes: int) -> float:
    """Unweighted mean of per-class F1; a class absent from both truth and prediction counts as 0."""
    y_true = np.asarray(y_true)
    y_pred = np.asarray(y_pred)
    scores = []
    for c in range(num_classes):
        tp = np.sum((y_pred == c) & (y_true == c))
        fp = np.sum((y_pred == c) & (y_true != c))
        fn = np.sum((y_pred != c) & (y_true == c))
        denom = 2 * tp + fp + fn
        scores.append(0.0 if denom == 0 else 2 * tp / denom)
    return float(np.mean(scores))


@torch.no_grad()
def evaluate(model: nn.Module, data: TokenizedTexts, *, batch_size: int, num_classes: int | None = None
             ) -> dict[str, float]:
    """Evaluate in eval mode (no dropout), restoring the model's mode afterwards. The classes are the logits'
    columns unless `num_classes` says otherwise: any model that returns (batch, classes) logits will do."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    preds, losses = [], []
    try:
        for start in range(0, len(data), batch_size):
            batch = data.batch(range(start, min(start + batch_size, len(data))), device)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            losses.append(nn.functional.cross_entropy(logits, batch["labels"], reduction="sum").item())
            preds.append(logits.argmax(dim=-1).cpu().numpy())
            num_classes = num_classes or int(logits.shape[-1])
    finally:
        model.train(was_training)
    y_pred = np.concatenate(preds)
    return {
        "accuracy": float((y_pred == data.labels).mean()),
        "macro_f1": macro_f1(data.labels, y_pred, num_classes=int(num_classes or 0)),
        "loss": float(np.sum(losses) / len(data)),
    }
