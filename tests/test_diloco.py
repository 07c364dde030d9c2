"""DiLoCo's outer step: nesterov_step and the AdapterNesterov strategy against the formula written out here.

A toy problem: two workers, each with its own quadratic f_i(x) = 0.5 |A_i x - b_i|^2, run H inner SGD steps
from the global x each round; the outer gradient is g = -(mean of the workers' deltas) and the outer step is
Nesterov as DiLoCo (and PyTorch's SGD with nesterov=True) defines it: v = m v + g; x -= lr (g + m v).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nebula_fl.strategies.nesterov import AdapterNesterov, nesterov_step

LR, M, H, ROUNDS, INNER_LR = 0.7, 0.9, 5, 6, 0.05


def _problem():
    rng = np.random.default_rng(0)
    a = [rng.standard_normal((4, 3)) for _ in range(2)]
    b = [rng.standard_normal(4) for _ in range(2)]
    return a, b


def _inner(x: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """H plain gradient steps on 0.5 |A x - b|^2 (float64, independent of the code under test)."""
    for _ in range(H):
        x = x - INNER_LR * (a.T @ (a @ x - b))
    return x


def _reference(x0: np.ndarray) -> list[np.ndarray]:
    """The DiLoCo loop, written out element by element."""
    a, b = _problem()
    x, v, out = x0.copy(), None, []
    for _ in range(ROUNDS):
        deltas = [_inner(x, a[i], b[i]) - x for i in range(2)]
        g = -(deltas[0] + deltas[1]) / 2
        v = g if v is None else M * v + g
        x = x - LR * (g + M * v)
        out.append(x.copy())
    return out


def _deltas(x: np.ndarray) -> dict[str, np.ndarray]:
    a, b = _problem()
    mean = (_inner(x.astype(np.float64), a[0], b[0]) + _inner(x.astype(np.float64), a[1], b[1])) / 2 - x
    return {"w": mean.astype(np.float32)}


def test_nesterov_step_is_diloco_outer_step():
    x0 = np.array([1.0, -2.0, 0.5])
    expected = _reference(x0)
    params, velocity = {"w": x0.astype(np.float32)}, None
    for want in expected:
        params, velocity = nesterov_step(params, _deltas(params["w"]), velocity, lr=LR, momentum=M)
        np.testing.assert_allclose(params["w"], want, rtol=1e-4, atol=1e-5)


def test_strategy_outer_step_keeps_its_velocity_and_checkpoints():
    x0 = np.array([0.3, 0.1, -1.0])
    expected = _reference(x0)
    strategy = AdapterNesterov(lr=LR, momentum=M)
    params = {"w": x0.astype(np.float32)}
    for rnd, want in enumerate(expected):
        if rnd == 3:  # resume from a checkpoint half way: the velocity travels with the state
            state = strategy.state_dict()
            strategy = AdapterNesterov(lr=LR, momentum=M)
            strategy.load_state_dict(state)
        params = strategy.outer_step(params, _deltas(params["w"]))
        np.testing.assert_allclose(params["w"], want, rtol=1e-4, atol=1e-5)


def test_matches_torch_sgd_nesterov():
    """The same step as PyTorch's SGD(nesterov=True) fed the outer gradient g = -delta."""
    rng = np.random.default_rng(1)
    x = torch.nn.Parameter(torch.tensor(rng.standard_normal(5), dtype=torch.float32))
    opt = torch.optim.SGD([x], lr=LR, momentum=M, nesterov=True)
    params, velocity = {"w": x.detach().numpy().copy()}, None
    for _ in range(4):
        delta = rng.standard_normal(5).astype(np.float32)
        x.grad = torch.from_numpy(-delta)
        opt.step()
        params, velocity = nesterov_step(params, {"w": delta}, velocity, lr=LR, momentum=M)
        np.testing.assert_allclose(params["w"], x.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_first_step_by_hand():
    """Round 1 from zero velocity: v = g, x - lr (1 + m) g; with g = -delta = -1: 1 + 0.7 * 1.9 = 2.33."""
    params, velocity = nesterov_step({"w": np.ones(2, np.float32)}, {"w": np.ones(2, np.float32)}, None,
                                     lr=LR, momentum=M)
    assert params["w"] == pytest.approx([2.33, 2.33])
    assert velocity["w"] == pytest.approx([-1.0, -1.0])
