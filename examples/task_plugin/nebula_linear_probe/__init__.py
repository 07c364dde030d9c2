"""A linear probe as a nebula-fl task: the base encoder is frozen and only a linear head trains, so each round
sends a few kilobytes (hidden size x labels) and measures how linearly separable the encoder's features are."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from nebula_fl.config import Section, require
from nebula_fl.model.loading import build_classifier
from nebula_fl.tasks.base import TaskSetup
from nebula_fl.tasks.classify import ClassifyTask


@dataclass(kw_only=True, frozen=True)
class ProbeOptions(Section):
    PREFIX: ClassVar[str] = "task"

    pooling: str = "mean"
    """'mean' (token states averaged over the attention mask) or 'cls' (the first token's state)."""

    def __post_init__(self) -> None:
        require(self.pooling in ("mean", "cls"), "task.pooling", f"is {self.pooling!r}", "use 'mean' or 'cls'")


class Probe(nn.Module):
    def __init__(self, encoder: nn.Module, head: nn.Linear, *, pooling: str) -> None:
        super().__init__()
        self.encoder, self.head, self.pooling = encoder.requires_grad_(False), head, pooling

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.pooling == "cls":
            return self.head(hidden[:, 0])
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0))

    def train(self, mode: bool = True) -> Probe:
        super().train(mode)
        self.encoder.eval()  # fixed features: no dropout in the frozen encoder
        return self


class LinearProbeTask(ClassifyTask):
    """The classify task's data, loss and metrics; exchange 'full' sends every trainable weight: the head."""

    name = "linear-probe"
    exchange = "full"
    privacy_modes = ("off", "client")
    Options = ProbeOptions
    presets: ClassVar[dict] = {"smoke": {"lr": 0.05}, "demo": {"lr": 0.05}}  # a lone head takes a large rate

    def build_model(self, setup: TaskSetup) -> nn.Module:
        if not setup.labels:
            raise ValueError("the linear-probe task needs labelled data: the federation knows no labels")
        base = build_classifier(setup.path, num_labels=len(setup.labels), seed=setup.seed)
        return Probe(base.encoder, base.head, pooling=self.options.pooling)
