"""Coordinate-wise trimmed mean (Yin et al. 2018) as a nebula-fl outer strategy: a few clusters sending
wild updates (a bug, bad data, an attacker) cannot drag the global adapter where they like."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from nebula_fl.config import Section, require
from nebula_fl.strategies.fedavg import AdapterFedAvg

Arrays = dict[str, np.ndarray]
log = logging.getLogger(__name__)  # its lines reach the run's logs/server.log


@dataclass(kw_only=True, frozen=True)
class TrimOptions(Section):
    PREFIX: ClassVar[str] = "strategy"

    trim: float = 0.2
    """Share of the updates cut from each end of every coordinate, in [0, 0.5); at least one while a value
    remains (`strategy.trim` in the run config)."""

    def __post_init__(self) -> None:
        require(0.0 <= self.trim < 0.5, "strategy.trim", f"is {self.trim!r}", "use a share in [0, 0.5)")


def cut(n: int, trim: float) -> int:
    """Values cut from each end: floor(trim n), at least 1 while a value remains (3 updates: the median)."""
    return min(max(math.floor(trim * n + 1e-9), 1), (n - 1) // 2)


def trimmed_mean(updates: Sequence[Arrays], *, trim: float) -> tuple[Arrays, list[float]]:
    """Per coordinate, drop the k smallest and k largest values and average the rest. Also returns, per update,
    the share of its coordinates whose value lies in the kept range (ties with a kept value count as kept)."""
    n, k = len(updates), cut(len(updates), trim)
    mean, inside, total = {}, np.zeros(n), 0
    for key in updates[0]:
        stacked = np.stack([u[key] for u in updates]).astype(np.float64)
        ordered = np.sort(stacked, axis=0)
        mean[key] = ordered[k:n - k].mean(axis=0).astype(np.float32)
        kept = (stacked >= ordered[k]) & (stacked <= ordered[n - k - 1])
        inside += kept.reshape(n, -1).sum(axis=1)
        total += stacked[0].size
    return mean, [float(x) for x in inside / max(total, 1)]


class TrimmedMean(AdapterFedAvg):
    """FedAvg's outer step (lr 1.0: the global adapter moves by the robust mean). Example counts are ignored:
    weighting would let one large (or lying) cluster buy back the influence trimming takes away."""

    name = "trimmed-mean"
    needs_individual_updates = True  # secure aggregation shows only the sum: no trimming possible
    Options = TrimOptions

    def aggregate_updates(self, updates: list[Arrays], weights: list[float]) -> Arrays:
        mean, shares = trimmed_mean(updates, trim=self.options.trim)
        for i, share in enumerate(shares):  # an update none of whose values was kept did not enter the mean
            self.record(i, kept=share > 0, kept_share=share)
        self.record_round(cut_per_end=cut(len(updates), self.options.trim))
        log.info("trimmed mean of %d updates; share of each cluster's coordinates kept: %s", len(updates),
                 ", ".join(f"{c} {s:.2f}" for c, s in zip(self.round_clusters, shares)))
        return mean
