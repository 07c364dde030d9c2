"""FedAvgM (Hsu et al. 2019): heavy-ball momentum on the mean update, v = m v + delta, x += lr v."""

from __future__ import annotations

import numpy as np

from nebula_fl.strategies.adapter_strategy import Arrays
from nebula_fl.strategies.momentum import MomentumStrategy


def fedavgm_step(
    params: Arrays, delta: Arrays, velocity: Arrays | None, *, lr: float, momentum: float
) -> tuple[Arrays, Arrays]:
    new_v = {k: (delta[k] if velocity is None else momentum * velocity[k] + delta[k]).astype(np.float32)
             for k in params}
    return {k: (params[k] + lr * new_v[k]).astype(np.float32) for k in params}, new_v


class AdapterFedAvgM(MomentumStrategy):
    name = "fedavgm"
    default_lr = 1.0
    default_momentum = 0.9

    def outer_step(self, params: Arrays, delta: Arrays) -> Arrays:
        params, self.velocity = fedavgm_step(params, delta, self.velocity, lr=self.lr, momentum=self.momentum)
        return params
