"""Coordinate-wise trimmed mean (Yin et al. 2018) as a nebula-fl outer strategy: a few clusters sending
wild updates (a bug, bad data, an attacker) cannot drag the global adapter where they like."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from nebula_fl.strategies.fedavg import AdapterFedAvg

Arrays = dict[str, np.ndarray]


def trimmed_mean(updates: Sequence[Arrays], *, trim: float) -> Arrays:
    """Per coordinate, drop the k smallest and k largest values and average the rest; k = floor(trim n), but at
    least 1 while a value remains, so one outlier is always dropped (3 updates: the median; 2: their mean)."""
    n = len(updates)
    k = min(max(math.floor(trim * n + 1e-9), 1), (n - 1) // 2)
    return {key: np.sort(np.stack([u[key] for u in updates]).astype(np.float64), axis=0)[k:n - k].mean(axis=0)
            .astype(np.float32) for key in updates[0]}


class TrimmedMean(AdapterFedAvg):
    """FedAvg's outer step (lr 1.0: the global adapter moves by the robust mean). Example counts are ignored:
    weighting would let one large (or lying) cluster buy back the influence trimming takes away."""

    name = "trimmed-mean"
    needs_individual_updates = True  # secure aggregation shows only the sum: no trimming possible
    trim = 0.2

    def __init__(self, *, trim: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trim = type(self).trim if trim is None else float(trim)
        if not 0.0 <= self.trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5) (the share cut from each end), got {self.trim}")

    def aggregate_updates(self, updates: list[Arrays], weights: list[float]) -> Arrays:
        return trimmed_mean(updates, trim=self.trim)
