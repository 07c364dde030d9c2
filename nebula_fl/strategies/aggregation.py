"""The example-weighted mean of cluster updates: the one reduction every outer optimizer consumes."""

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
