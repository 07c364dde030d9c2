"""The example-weighted mean of cluster updates: the one reduction every outer optimizer consumes; and its
FedNova form for updates trained for different numbers of local steps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Arrays = dict[str, np.ndarray]


def weighted_mean(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float]) -> Arrays:
    """Sum_i w_i u_i / sum_i w_i, key by key, in float64 then cast back to float32."""
    if not updates:
        raise ValueError("cannot average zero updates")
    if len(updates) != len(weights):
        raise ValueError(f"{len(updates)} updates but {len(weights)} weights")
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not w.sum() > 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    keys = list(updates[0])
    for u in updates[1:]:
        if set(u) != set(keys):
            raise ValueError("updates disagree on their keys")
    total = w.sum()
    return {
        k: (sum(wi * np.asarray(u[k], dtype=np.float64) for wi, u in zip(w, updates, strict=True)) / total)
        .astype(np.float32)
        for k in keys
    }


def step_scales(*, weights: Sequence[float], steps: Sequence[float]) -> tuple[float, list[float]]:
    """FedNova's effective step count tau_eff = sum_i p_i tau_i (p_i = w_i / sum w) and each update's scale
    tau_eff / tau_i, for vanilla-SGD local training (Wang et al. 2020, "Tackling the Objective Inconsistency
    Problem in Heterogeneous Federated Optimization").

    Why: an update of tau_i local steps moves about tau_i times as far as one step would, so the plain
    weighted mean over unequal tau_i is FedAvg on the surrogate objective sum_i p_i tau_i f_i / sum_j p_j tau_j,
    not on sum_i p_i f_i -- a cluster that trains faster gets its data weighed more, and the run converges to
    the wrong optimum however long it runs (objective inconsistency). Dividing each update by its tau_i makes
    every cluster contribute one "average step"; multiplying by tau_eff gives the result FedAvg's step size, so
    the outer optimizer and its learning rate see updates of the usual magnitude.

    When every tau_i is equal the scales are exactly 1.0 and tau_eff is that tau (no rounding through the
    weights), so the normalised mean is bit for bit the weighted mean.
    """
    if len(steps) != len(weights):
        raise ValueError(f"{len(steps)} step counts but {len(weights)} weights")
    if not steps:
        raise ValueError("cannot normalise zero updates")
    tau = np.asarray(steps, dtype=np.float64)
    if not (np.isfinite(tau).all() and (tau > 0).all()):
        raise ValueError(f"step counts must be finite and > 0, got {list(steps)}")
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or not w.sum() > 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    if (tau == tau[0]).all():
        return float(tau[0]), [1.0] * len(tau)
    tau_eff = float(np.dot(w, tau) / w.sum())
    return tau_eff, [tau_eff / float(t) for t in tau]


def scale_updates(updates: Sequence[Mapping[str, np.ndarray]], scales: Sequence[float]) -> list[Arrays]:
    """Each update times its scale, computed in float64 and cast back to the array's own dtype (a scale of
    1.0 returns the arrays' values unchanged), so an aggregator downstream sees the dtypes it always did."""
    if len(updates) != len(scales):
        raise ValueError(f"{len(updates)} updates but {len(scales)} scales")
    return [
        {k: np.asarray(v) if s == 1.0 else (np.asarray(v, dtype=np.float64) * s).astype(np.asarray(v).dtype)
         for k, v in u.items()}
        for u, s in zip(updates, scales, strict=True)
    ]


def normalized_mean(updates: Sequence[Mapping[str, np.ndarray]], weights: Sequence[float], *,
                    steps: Sequence[float]) -> Arrays:
    """FedNova's combination of updates trained for different step counts: tau_eff * sum_i p_i u_i / tau_i.

    It is the weighted mean of the updates each scaled by tau_eff / tau_i (see ``step_scales`` for why); with
    equal step counts every scale is 1.0 and the result is exactly ``weighted_mean(updates, weights)``.
    """
    _, scales = step_scales(weights=weights, steps=steps)
    return weighted_mean(scale_updates(updates, scales), weights)
