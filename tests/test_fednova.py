"""FedNova's normalised mean (strategies/aggregation.py) and its use by the adapter strategy.

Updates trained for different numbers of local steps: the plain weighted mean converges to a biased optimum,
the normalised one to the true optimum of sum_i p_i f_i. Expected values are computed by hand here.
"""

import numpy as np
import pytest

from nebula_fl.strategies.adapter_strategy import to_numpy
from nebula_fl.strategies.aggregation import normalized_mean, step_scales, weighted_mean
from tests.test_strategy import GLOBAL, _configured, _reply


def test_normalized_mean_matches_the_formula_by_hand():
    a = {"w": np.array([2.0, -4.0], np.float32)}
    b = {"w": np.array([9.0, 3.0], np.float32)}
    # weights 1, 3 -> p = (1/4, 3/4); steps 2, 6 -> tau_eff = 1/4*2 + 3/4*6 = 5
    # 5 * (1/4 * a/2 + 3/4 * b/6) = 5 * ([0.25, -0.5] + [1.125, 0.375]) = [6.875, -0.625]
    out = normalized_mean([a, b], [1, 3], steps=[2, 6])
    np.testing.assert_allclose(out["w"], [6.875, -0.625], rtol=1e-7)
    assert out["w"].dtype == np.float32
    tau_eff, scales = step_scales(weights=[1, 3], steps=[2, 6])
    assert tau_eff == 5.0 and scales == [2.5, 5 / 6]
    # the plain mean would be 1/4 a + 3/4 b = [7.25, 1.25]: normalising changes the answer
    np.testing.assert_allclose(weighted_mean([a, b], [1, 3])["w"], [7.25, 1.25])


@pytest.mark.parametrize("weights", [[1, 3, 5], [0.1, 0.2, 0.7], [7, 7, 7]])
def test_equal_steps_are_bit_identical_to_the_weighted_mean(weights):
    rng = np.random.default_rng(0)
    ups = [{"k": rng.normal(size=(3, 5)).astype(np.float32), "j": rng.normal(size=7).astype(np.float32)}
           for _ in range(3)]
    tau_eff, scales = step_scales(weights=weights, steps=[13, 13, 13])
    assert tau_eff == 13 and scales == [1.0, 1.0, 1.0]
    plain, normal = weighted_mean(ups, weights), normalized_mean(ups, weights, steps=[13, 13, 13])
    for key in plain:
        assert plain[key].tobytes() == normal[key].tobytes()


@pytest.mark.parametrize(
    ("weights", "steps", "match"),
    [([1, 1], [1], "1 step counts but 2 weights"), ([1], [0], "finite and > 0"),
     ([1], [float("nan")], "finite and > 0"), ([0, 0], [1, 2], "positive sum"), ([], [], "zero updates")],
)
def test_bad_step_counts_raise(weights, steps, match):
    with pytest.raises(ValueError, match=match):
        step_scales(weights=weights, steps=steps)


def _local_gd(x, *, a, c, lr, steps):
    """Plain gradient descent on f(x) = 1/2 a ||x - c||^2; returns the update (x after - x before)."""
    y = x.copy()
    for _ in range(steps):
        y = y - lr * a * (y - c)
    return y - x


def _fixed_point(*, normalise, weights, a, c, steps, lr, rounds):
    x = np.zeros(2)
    for _ in range(rounds):
        ups = [{"x": _local_gd(x, a=ai, c=ci, lr=lr, steps=ti)} for ai, ci, ti in zip(a, c, steps, strict=True)]
        mean = normalized_mean(ups, weights, steps=steps) if normalise else weighted_mean(ups, weights)
        x = x + mean["x"].astype(np.float64)  # outer FedAvg, lr 1
    return x


def test_quadratics_normalisation_removes_the_objective_inconsistency():
    """Clients f_i(x) = 1/2 a_i ||x - c_i||^2, tau_i steps of GD at lr eta, outer FedAvg lr 1.

    Tolerance, derived: tau_i GD steps give u_i = g_i (c_i - x) with g_i = 1 - (1 - eta a_i)^tau_i, and
    g_i = eta tau_i a_i h_i with 1 - delta <= h_i <= 1, delta = max_i eta a_i (tau_i - 1) / 2. A fixed point
    of x + sum_i q_i' (c_i - x) (q_i' = p_i g_i, or p_i g_i / tau_i normalised) is sum q_i h_i c_i / sum q_i h_i
    with q_i = p_i tau_i a_i (FedAvg) or p_i a_i (normalised); it is off sum q_i c_i / sum q_i by
    -sum q_i e_i (c_i - xbar) / sum q_i h_i, e_i = 1 - h_i, so by at most delta / (1 - delta) * max_i |c_i - xbar|.
    """
    weights, a, steps, lr = [1.0, 3.0], [2.0, 1.0], [20, 2], 0.002
    c = [np.array([0.0, 0.0]), np.array([10.0, -10.0])]
    p = np.array(weights) / sum(weights)
    q_true = p * np.array(a)  # (0.5, 0.75)
    q_biased = p * np.array(steps) * np.array(a)  # (10, 1.5)
    true = sum(qi * ci for qi, ci in zip(q_true, c, strict=True)) / q_true.sum()  # (6, -6)
    biased = sum(qi * ci for qi, ci in zip(q_biased, c, strict=True)) / q_biased.sum()  # (1.304, -1.304)
    np.testing.assert_allclose(true, [6.0, -6.0])
    delta = max(lr * ai * (ti - 1) / 2 for ai, ti in zip(a, steps, strict=True))  # 0.038
    tol_true = delta / (1 - delta) * max(np.abs(ci - true).max() for ci in c)  # 0.24
    tol_biased = delta / (1 - delta) * max(np.abs(ci - biased).max() for ci in c)  # 0.34
    # float32 rounding of each round's mean adds ~1e-6 per round near the fixed point: far below either bound
    kw = {"weights": weights, "a": a, "c": c, "steps": steps, "lr": lr, "rounds": 3000}
    fedavg, fednova = _fixed_point(normalise=False, **kw), _fixed_point(normalise=True, **kw)
    assert np.abs(fedavg - biased).max() < tol_biased
    assert np.abs(fednova - true).max() < tol_true
    # the two optima are 4.7 apart per coordinate, over 10x either tolerance: the test sees normalisation off
    assert np.abs(fedavg - fednova).max() > 10 * max(tol_true, tol_biased)


def test_aggregate_train_normalises_unequal_steps():
    strategy, _ = _configured()
    ups = [
        _reply(1, {"lora_A": np.full((2, 2), 2.0), "head.bias": np.array([2.0, 0.0])},
               {"num-examples": 10, "train-loss": 1.0, "steps": 2}),
        _reply(2, {"lora_A": np.full((2, 2), 9.0), "head.bias": np.array([0.0, 3.0])},
               {"num-examples": 30, "train-loss": 1.0, "steps": 6}),
    ]
    arrays, metrics = strategy.aggregate_train(4, ups)
    new = to_numpy(arrays)
    # tau_eff = 1/4*2 + 3/4*6 = 5; lora_A: 5 * (1/4 * 2/2 + 3/4 * 9/6) = 6.875 (the plain mean: 7.25)
    np.testing.assert_allclose(new["lora_A"], GLOBAL["lora_A"] + 6.875, rtol=1e-6)
    # head.bias: 5 * (1/4 * [2, 0]/2 + 3/4 * [0, 3]/6) = [1.25, 1.875]
    np.testing.assert_allclose(new["head.bias"], [1.25, 1.875], rtol=1e-6)
    assert metrics["steps-normalized"] == 1 and metrics["tau-eff"] == pytest.approx(5.0)


@pytest.mark.parametrize("steps", [(6, 6), (2, None), (2, 0)])
def test_aggregate_train_keeps_the_plain_mean_when_steps_agree_or_are_missing(steps):
    strategy, _ = _configured()
    ups = [
        _reply(1, {"lora_A": np.full((2, 2), 2.0), "head.bias": np.zeros(2)},
               {"num-examples": 10, "train-loss": 1.0} | ({"steps": steps[0]} if steps[0] is not None else {})),
        _reply(2, {"lora_A": np.full((2, 2), 9.0), "head.bias": np.zeros(2)},
               {"num-examples": 30, "train-loss": 1.0} | ({"steps": steps[1]} if steps[1] is not None else {})),
    ]
    arrays, metrics = strategy.aggregate_train(4, ups)
    np.testing.assert_allclose(to_numpy(arrays)["lora_A"], GLOBAL["lora_A"] + 7.25)  # 1/4*2 + 3/4*9
    assert "steps-normalized" not in metrics and "tau-eff" not in metrics



def test_a_plugin_aggregator_receives_the_normalised_updates():
    strategy, _ = _configured()
    seen = []

    def record(updates, weights):
        seen.append(([u["lora_A"][0, 0] for u in updates], list(weights)))
        return weighted_mean(updates, weights)

    strategy.aggregate_updates = record
    ups = [_reply(1, {"lora_A": np.full((2, 2), 2.0), "head.bias": np.zeros(2)},
                  {"num-examples": 10, "train-loss": 1.0, "steps": 2}),
           _reply(2, {"lora_A": np.full((2, 2), 9.0), "head.bias": np.zeros(2)},
                  {"num-examples": 30, "train-loss": 1.0, "steps": 6})]
    strategy.aggregate_train(4, ups)
    # scaled by tau_eff / tau_i = 5/2 and 5/6: 2 * 2.5 = 5, 9 * 5/6 = 7.5; weights unchanged
    assert seen == [([pytest.approx(5.0), pytest.approx(7.5)], [10.0, 30.0])]
