"""FedAvg (McMahan et al. 2017) as an outer step: move the global adapter by lr x the mean update."""

from __future__ import annotations

from typing import Any

import numpy as np

from nebula_fl.strategies.adapter_strategy import AdapterStrategy, Arrays


def fedavg_step(params: Arrays, delta: Arrays, *, lr: float) -> Arrays:
    return {k: (params[k] + lr * delta[k]).astype(np.float32) for k in params}


class AdapterFedAvg(AdapterStrategy):
    name = "fedavg"
    default_lr = 1.0

    def outer_step(self, params: Arrays, delta: Arrays) -> Arrays:
        return fedavg_step(params, delta, lr=self.lr)

    def outer_state(self) -> dict[str, Any]:
        return {}

    def load_outer_state(self, state: dict[str, Any]) -> None:
        pass
