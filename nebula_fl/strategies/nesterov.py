"""Nesterov outer momentum as in DiLoCo (Douillard et al. 2023).

The outer gradient is g = -delta (the mean update points downhill); with PyTorch's Nesterov SGD:
v = m v + g, x -= lr (g + m v). DiLoCo's defaults: lr 0.7, momentum 0.9.
"""

from __future__ import annotations

import numpy as np

from nebula_fl.strategies.adapter_strategy import Arrays
from nebula_fl.strategies.momentum import MomentumStrategy


def nesterov_step(
    params: Arrays, delta: Arrays, velocity: Arrays | None, *, lr: float, momentum: float
) -> tuple[Arrays, Arrays]:
    new_v: Arrays = {}
    new_p: Arrays = {}
    for k in params:
        g = -delta[k]
        v = g if velocity is None else momentum * velocity[k] + g
        new_v[k] = v.astype(np.float32)
        new_p[k] = (params[k] - lr * (g + momentum * v)).astype(np.float32)
    return new_p, new_v


class AdapterNesterov(MomentumStrategy):
    name = "nesterov"
    default_lr = 0.7
    default_momentum = 0.9

    def outer_step(self, params: Arrays, delta: Arrays) -> Arrays:
        params, self.velocity = nesterov_step(params, delta, self.velocity, lr=self.lr, momentum=self.momentum)
        return params
