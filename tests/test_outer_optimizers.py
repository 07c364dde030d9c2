"""Each outer optimizer equals its formula over 3 rounds, computed by hand here on 4-element arrays."""

import math

import numpy as np
import pytest

from nebula_fl.config import OuterConfig
from nebula_fl.strategies import make_strategy

X0 = np.array([1.0, -2.0, 0.5, 0.0], dtype=np.float32)
DELTAS = [
    np.array([0.1, 0.2, -0.3, 0.4], dtype=np.float32),
    np.array([-0.2, 0.1, 0.0, 0.3], dtype=np.float32),
    np.array([0.05, -0.05, 0.2, -0.1], dtype=np.float32),
]


def run(strategy, deltas=DELTAS):
    x = {"p": X0.copy()}
    trajectory = []
    for d in deltas:
        x = strategy.outer_step(x, {"p": d})
        trajectory.append(x["p"].astype(np.float64))
    return trajectory


def test_fedavg_is_x_plus_lr_delta():
    s = make_strategy(OuterConfig(outer_optimizer="fedavg", outer_lr=0.5))
    x = X0.astype(np.float64)
    for got, d in zip(run(s), DELTAS):
        x = x + 0.5 * d
        np.testing.assert_allclose(got, x, rtol=1e-6)


def test_fedavg_default_lr_is_one():
    assert make_strategy(OuterConfig(outer_optimizer="fedavg")).lr == 1.0


def test_fedavgm_heavy_ball():
    lr, m = 0.8, 0.5
    s = make_strategy(OuterConfig(outer_optimizer="fedavgm", outer_lr=lr, outer_momentum=m))
    d1, d2, d3 = (d.astype(np.float64) for d in DELTAS)
    v1 = d1
    v2 = m * v1 + d2
    v3 = m * v2 + d3
    expected = [X0 + lr * v1, X0 + lr * v1 + lr * v2, X0 + lr * (v1 + v2 + v3)]
    for got, want in zip(run(s), expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_nesterov_as_in_diloco():
    s = make_strategy(OuterConfig(outer_optimizer="nesterov"))
    lr, m = 0.7, 0.9  # DiLoCo's defaults
    assert (s.lr, s.momentum) == (lr, m)
    g1, g2, g3 = (-d.astype(np.float64) for d in DELTAS)
    b1 = g1
    x1 = X0 - lr * (g1 + m * b1)
    b2 = m * b1 + g2
    x2 = x1 - lr * (g2 + m * b2)
    b3 = m * b2 + g3
    x3 = x2 - lr * (g3 + m * b3)
    for got, want in zip(run(s), [x1, x2, x3]):
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_nesterov_first_step_moves_lr_times_one_plus_momentum_delta():
    s = make_strategy(OuterConfig(outer_optimizer="nesterov"))
    got = s.outer_step({"p": X0.copy()}, {"p": DELTAS[0]})["p"]
    np.testing.assert_allclose(got, X0 + 0.7 * 1.9 * DELTAS[0], rtol=1e-6)


def test_adam_with_bias_correction():
    lr, b1, b2, eps = 0.01, 0.9, 0.99, 1e-6
    s = make_strategy(OuterConfig(outer_optimizer="adam", outer_lr=lr, outer_beta1=b1, outer_beta2=b2, outer_eps=eps))
    x = X0.astype(np.float64)
    m = np.zeros(4)
    v = np.zeros(4)
    for t, (got, d) in enumerate(zip(run(s), DELTAS), start=1):
        g = -d.astype(np.float64)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        x = x - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        np.testing.assert_allclose(got, x, rtol=1e-5)
    # the first Adam step moves each coordinate by about lr in the update's direction
    first = run(make_strategy(OuterConfig(outer_optimizer="adam", outer_lr=lr)), DELTAS[:1])[0]
    np.testing.assert_allclose(np.abs(first - X0), lr, rtol=1e-3)
    assert math.isclose(float(np.sign(first - X0)[0]), 1.0)


@pytest.mark.parametrize("name", ["fedavg", "fedavgm", "nesterov", "adam"])
def test_state_dict_round_trip_continues_identically(name):
    a = make_strategy(OuterConfig(outer_optimizer=name), seed=3)
    run(a, DELTAS[:2])
    b = make_strategy(OuterConfig(outer_optimizer=name), seed=99)
    b.load_state_dict(a.state_dict())
    x = {"p": X0.copy()}
    np.testing.assert_array_equal(a.outer_step(x, {"p": DELTAS[2]})["p"], b.outer_step(x, {"p": DELTAS[2]})["p"])
    assert a.sample(list(range(10))) == b.sample(list(range(10)))


def test_loading_another_optimizers_state_is_refused():
    a = make_strategy(OuterConfig(outer_optimizer="adam"))
    b = make_strategy(OuterConfig(outer_optimizer="nesterov"))
    with pytest.raises(ValueError, match="'adam' optimizer state"):
        b.load_state_dict(a.state_dict())


def test_overlap_with_an_outer_optimizer_that_keeps_momentum_is_warned_about_and_fedavg_is_not():
    from nebula_fl.strategies.staleness import stale_step_warning

    for outer in ("fedavgm", "nesterov", "adam", "flwr:FedAdam", "flwr:FedAvgM"):
        said = stale_step_warning(outer=outer, overlap=True, secure=False)
        assert said is not None and f"'{outer}'" in said and "one round old" in said
        assert "two rounds old" in stale_step_warning(outer=outer, overlap=True, secure=True)
        assert stale_step_warning(outer=outer, overlap=False, secure=True) is None
    for outer in ("fedavg", "flwr:FedAvg", "my-plugin"):
        assert stale_step_warning(outer=outer, overlap=True, secure=True) is None
