"""The knowledge-distillation loss (Hinton et al. 2015), as a pure function the tests can hit directly.

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))  +  (1 - alpha) * CE(student, labels)

The KL term is averaged over the batch ("batchmean", the mathematically correct KL mean) and scaled by T^2 so
its gradients keep the same size as the hard-label term's whatever the temperature (they shrink as 1/T^2).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, labels: torch.Tensor | None, *,
            temperature: float, alpha: float) -> torch.Tensor:
    """The mean distillation loss of one batch; the teacher's logits are targets (no gradient flows to them).

    `labels` may be None (unlabelled data) only with alpha = 1, `teacher_logits` only with alpha = 0 (plain
    cross-entropy, no teacher).
    """
    if not (isinstance(temperature, int | float) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"kd_loss: temperature is {temperature!r}; use a finite number > 0 (e.g. 2.0)")
    if not (isinstance(alpha, int | float) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"kd_loss: alpha is {alpha!r}; use a weight in [0, 1] (1: soft labels only, 0: hard only)")
    if student_logits.dim() != 2:
        raise ValueError(f"kd_loss: student logits have shape {tuple(student_logits.shape)}; expected (batch, classes)")
    if labels is None and alpha < 1.0:
        raise ValueError(f"kd_loss: no labels, but alpha = {alpha:g} < 1 weights the hard-label term; "
                         "pass the labels, or use alpha = 1 (soft labels only) for unlabelled data")
    if teacher_logits is None and alpha > 0.0:
        raise ValueError(f"kd_loss: no teacher logits, but alpha = {alpha:g} > 0 weights the distillation term; "
                         "pass the teacher's logits, or use alpha = 0 (plain cross-entropy)")
    total = student_logits.new_zeros(())
    if alpha > 0.0:
        assert teacher_logits is not None
        if teacher_logits.shape != student_logits.shape:
            raise ValueError(f"kd_loss: teacher logits {tuple(teacher_logits.shape)} and student logits "
                             f"{tuple(student_logits.shape)} differ in shape; teacher and student must share the labels")
        t = float(temperature)
        student_log_p = nn.functional.log_softmax(student_logits / t, dim=-1)
        teacher_log_p = nn.functional.log_softmax(teacher_logits.detach().to(student_logits.dtype) / t, dim=-1)
        kl = nn.functional.kl_div(student_log_p, teacher_log_p, reduction="batchmean", log_target=True)
        total = total + alpha * t * t * kl
    if alpha < 1.0:
        assert labels is not None
        total = total + (1.0 - alpha) * nn.functional.cross_entropy(student_logits, labels)
    return total
