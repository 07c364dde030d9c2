"""What a round's reply says of the training: one dict, built on every rank from what the ranks agreed on.

Rank 0's pipeline (``release.py``) adds the codec's and the privacy gate's figures, and takes out, under DP, those
computed from the data (``DATA_DEPENDENT``); ``outgoing.released`` lets through only what secure aggregation allows.
"""

from __future__ import annotations

from collections.abc import Sized
from typing import Any, Protocol

import numpy as np
import torch

from nebula_fl.clients.overlap import busy


class Worker(Protocol):
    """What the reply says of the cluster's workers (``trainer.WorkerContext`` is one)."""

    cluster_id: int
    shard: Sized
    world: int
    device: torch.device
    parallel: str


def round_metrics(*, ctx: Worker, steps: int, logical_batch: int, rank_losses: list[float],
                  rank_sums: list[float], seconds: float, precision: str, busy_s: float,
                  since_send_s: float | None) -> dict[str, Any]:
    """`rank_losses`, `rank_sums`: each rank's mean loss and weight checksum (ranks in sync give equal sums)."""
    return {
        "cluster-id": ctx.cluster_id,
        "num-examples": len(ctx.shard),
        "examples-seen": int(steps * logical_batch),  # expected, under sample DP
        "steps": steps,
        "train-loss": float(np.mean(rank_losses)),
        "seconds": float(seconds),
        "workers": int(ctx.world),
        "device": ctx.device.type,
        "precision": precision,
        "parallel": ctx.parallel,
        "rank-divergence": float(max(abs(s - rank_sums[0]) for s in rank_sums)),
        **busy(busy_s=busy_s, since_send_s=since_send_s),
    }
