"""Random-k sparsification with positions drawn from the round's seed alone: linear, so it commutes with sums.

Spec ``randk:RATIO`` sends k = max(1, ceil(RATIO n)) values and no indices: the decoder draws the
same positions from the seed. Every sender in a round using the same seed picks the same positions,
so decode(encode(a)) + decode(encode(b)) == decode(encode(a + b)): the values can be summed under
secure aggregation before anyone decodes them. Values are not rescaled by n / k (error feedback
carries what was left out instead, which is unbiased over rounds and has far less variance).

The positions are stratified: one uniform draw in each of k consecutive strata of n / k entries
(floor/ceil sizes), so they come out distinct and sorted in O(k), each entry's inclusion probability
is 1 / its stratum size (within one entry of k / n), and no two kept entries crowd one region.
"""

from __future__ import annotations

import numpy as np

from nebula_fl.compression.codec import Encoded, Plan, RatioCodec, kept
from nebula_fl.compression.layout import Layout


def random_k_indices(n: int, k: int, gen: np.random.Generator) -> np.ndarray:
    """k sorted, distinct int64 positions below n, one per stratum."""
    bounds = ((np.arange(k + 1, dtype=np.uint64) * np.uint64(n)) // np.uint64(k)).astype(np.int64)
    sizes = np.diff(bounds)
    offsets = np.minimum((gen.random(k) * sizes).astype(np.int64), sizes - 1)
    return bounds[:-1] + offsets


class RandK(RatioCodec):
    name = "randk"
    role = "transform"
    error_feedback = True
    seeded_decode = True
    finite_output = True  # it scatters values its quantizer already checked

    def positions(self, n: int, seed: int) -> np.ndarray:
        return random_k_indices(n, kept(self.ratio, n), self.generator(seed))

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        return Plan(values=(kept(self.ratio, sum(segments)),))

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        return Encoded(values=values[self.positions(values.size, seed)])

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        n = sum(segments)
        out = np.zeros(n, dtype=np.float32)
        out[self.positions(n, seed)] = encoded.values
        return out

    def subtract_decoded(
        self, target: np.ndarray, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int
    ) -> None:
        target[self.positions(target.size, seed)] -= encoded.values
