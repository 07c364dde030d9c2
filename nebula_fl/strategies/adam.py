"""FedAdam (Reddi et al. 2021): Adam on the outer gradient g = -delta, with bias correction."""

from __future__ import annotations

from typing import Any

import numpy as np

from nebula_fl.strategies.adapter_strategy import AdapterStrategy, Arrays


def adam_step(
    params: Arrays,
    delta: Arrays,
    m: Arrays | None,
    v: Arrays | None,
    t: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
) -> tuple[Arrays, Arrays, Arrays, int]:
    """One Adam step; `t` is the number of steps taken before this one."""
    t += 1
    new_m, new_v, new_p = {}, {}, {}
    for k in params:
        g = -delta[k].astype(np.float64)
        mk = (1 - beta1) * g if m is None else beta1 * m[k] + (1 - beta1) * g
        vk = (1 - beta2) * g * g if v is None else beta2 * v[k] + (1 - beta2) * g * g
        m_hat = mk / (1 - beta1**t)
        v_hat = vk / (1 - beta2**t)
        new_p[k] = (params[k] - lr * m_hat / (np.sqrt(v_hat) + eps)).astype(np.float32)
        new_m[k] = mk.astype(np.float32)
        new_v[k] = vk.astype(np.float32)
    return new_p, new_m, new_v, t


class AdapterAdam(AdapterStrategy):
    name = "adam"
    default_lr = 0.01

    def __init__(self, *, beta1: float = 0.9, beta2: float = 0.99, eps: float = 1e-6, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps > 0):
            raise ValueError(f"need 0 <= beta1, beta2 < 1 and eps > 0, got {beta1}, {beta2}, {eps}")
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.m: Arrays | None = None
        self.v: Arrays | None = None
        self.t = 0

    def outer_step(self, params: Arrays, delta: Arrays) -> Arrays:
        params, self.m, self.v, self.t = adam_step(
            params, delta, self.m, self.v, self.t, lr=self.lr, beta1=self.beta1, beta2=self.beta2, eps=self.eps
        )
        return params

    def outer_state(self) -> dict[str, Any]:
        return {"m": self.m, "v": self.v, "t": self.t}

    def load_outer_state(self, state: dict[str, Any]) -> None:
        self.m, self.v, self.t = state.get("m"), state.get("v"), int(state.get("t", 0))
