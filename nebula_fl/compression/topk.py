"""Top-k sparsification (Stich et al. 2018; Lin et al. 2018): keep the k largest |x|, error feedback for the rest.

Spec ``topk:RATIO`` keeps k = max(1, ceil(RATIO n)) entries: their values (float32, or whatever the
quantizer after it makes of them, in index order) and their positions, coded exactly by Elias-Fano
or a bitmap (see indices), which costs 2 + log2(n / k) bits an index instead of 32.
Ties at the k-th magnitude go to the lowest indices, so encoding is deterministic.
"""

from __future__ import annotations

import math

import numpy as np

from nebula_fl.compression import indices
from nebula_fl.compression.codec import Encoded, Plan, RatioCodec, kept
from nebula_fl.compression.layout import Layout

_SAMPLE = 1 << 16


def top_k_indices(magnitude: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the k largest entries of `magnitude` (ties: lowest index first).

    For large inputs a strided sample gives a threshold that admits ~1.5 k candidates, and the exact
    selection runs on those alone; when fewer than k pass (a skewed sample), it falls back to all.
    """
    n = magnitude.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    candidates = None
    if n >= 4 * _SAMPLE and k <= n // 8:
        sample = magnitude[::n // _SAMPLE]
        share = min(1.0, 1.5 * k / n + 4.0 * math.sqrt(k / n / sample.size))
        j = sample.size - max(1, math.ceil(share * sample.size))
        threshold = np.partition(sample, j)[j]
        candidates = np.flatnonzero(magnitude >= threshold)
        if candidates.size < k:
            candidates = None
    pool = magnitude if candidates is None else magnitude[candidates]
    kth = np.partition(pool, pool.size - k)[pool.size - k]
    chosen = pool > kth
    ties = np.flatnonzero(pool == kth)[:k - int(np.count_nonzero(chosen))]
    chosen[ties] = True
    picked = np.flatnonzero(chosen)
    return picked if candidates is None else candidates[picked]


class TopK(RatioCodec):
    name = "topk"
    role = "transform"
    error_feedback = True
    finite_output = True  # it scatters values its quantizer already checked

    def __init__(self, *, ratio: float) -> None:
        super().__init__(ratio=ratio)
        self._last: tuple[dict[str, np.ndarray], np.ndarray] | None = None

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        n = sum(segments)
        k = kept(self.ratio, n)
        return Plan(values=(k,), arrays=indices.plan(n, k))

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        n = values.size
        idx = top_k_indices(np.abs(values), kept(self.ratio, n))
        arrays = indices.encode(idx, n)
        self._last = (arrays, idx)  # error feedback reuses the positions instead of decoding them
        return Encoded(values=values[idx], arrays=arrays)

    def _positions(self, encoded: Encoded, n: int) -> np.ndarray:
        if self._last is not None and self._last[0] is encoded.arrays:
            return self._last[1]
        return indices.decode(encoded.arrays, n, kept(self.ratio, n))

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        n = sum(segments)
        out = np.zeros(n, dtype=np.float32)
        out[indices.decode(encoded.arrays, n, kept(self.ratio, n))] = encoded.values
        return out

    def subtract_decoded(
        self, target: np.ndarray, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int
    ) -> None:
        target[self._positions(encoded, target.size)] -= encoded.values
        self._last = None
