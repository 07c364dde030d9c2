"""What `privacy.mode="sample"` trains with unless told otherwise, and why.

DP-SGD adds N(0, (sigma C)^2) to each step's sum of clipped per-example gradients, so the noise on the mean
is sigma C / B: with the non-DP recipe's 64-example steps it drowns the signal (on one cluster's 4,001
tweets at epsilon 8, clipping alone costs 0.2 points and the noise 11). What the ablation in
``benchmarks/dp_levers.py`` found to help, at equal compute: logical batches of about an eighth of the
cluster's data (computed in length-sorted chunks of `batch-size`), a learning rate
scaled with the batch (Adam's square-root rule, Malladi et al. 2022), and FFA-LoRA's frozen A (noise
in half the dimensions; Sun et al. 2024; `model/frozen_a.lora_mode`). Each is only a default: an explicit key wins.
"""

from __future__ import annotations

import math

DP_BATCH_FRACTION = 8  # the logical batch is 1/8 of the cluster's examples: q = 1/8


def logical_batch(*, requested: int | None, num_examples: int, batch_size: int, world: int, private: bool) -> int:
    """Expected examples per step of the cluster: `privacy.batch-size` if set; under sample DP about n / 8
    (never less than one batch per worker); otherwise one batch per worker."""
    if requested:
        return requested
    per_step = batch_size * world
    if not private:
        return per_step
    return max(per_step, math.ceil(num_examples / DP_BATCH_FRACTION))


def learning_rate(*, requested: float | None, lr: float, logical: int, batch_size: int, world: int) -> float:
    """`privacy.lr` if set, else `lr` scaled by the square root of how many per-worker batches a step holds."""
    if requested is not None:
        return requested
    return lr * math.sqrt(max(1.0, logical / (batch_size * world)))

