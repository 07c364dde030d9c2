"""The loss test_pretrain_bench's spawned DDP ranks compute: in a module of its own, so that each rank imports
this and torch, not the test module with the benchmark scripts and nebula-fl behind it."""

from __future__ import annotations

import torch


def mse(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])
