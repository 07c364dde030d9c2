"""Fixed-point encoding of weighted updates into Z_{2^b}, and the packing of field vectors at b bits.

A cluster sends (w·x, w): x clipped to [-clip, clip] per coordinate and w an integer weight in
[0, max_weight] (its example count, or 1 under client-level DP). w·x is rounded stochastically
(unbiased) to a multiple of `step` = clip · max_weight / L, w is sent exactly, both as integers in
[-L, L], where L = min(floor((2^(b-1) - 1) / clusters), 2^48): the encoding computes in float64, which
holds such levels exactly with bits to spare for unbiased rounding; wider fields buy room for more
clusters, not more precision.

No-overflow bound: a sum of at most `clusters` such integers lies in [-clusters·L, clusters·L], and
clusters·L <= 2^(b-1) - 1, so reading the sum mod 2^b as a signed b-bit integer gives it exactly.
`clusters` is the number of inputs the server may sum (the round's sampled clusters).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BITS = tuple(range(16, 65, 8))  # whole bytes: packing is a byte slice, not bit twiddling
MAX_LEVELS = 1 << 48  # float64 holds every level exactly, with 5 fraction bits for the stochastic rounding


class FieldError(ValueError):
    """A field encoding that cannot hold what it is asked to (bits too few, weight too large)."""


@dataclass(frozen=True, kw_only=True)
class FieldCode:
    bits: int
    clip: float
    max_weight: int
    clusters: int

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or self.bits not in BITS:
            raise FieldError(f"field bits must be one of {BITS}, got {self.bits!r}")
        if not (np.isfinite(self.clip) and self.clip > 0):
            raise FieldError(f"the clipping range must be finite and > 0, got {self.clip!r}")
        if not 1 <= self.clusters <= 1 << 20:
            raise FieldError(f"clusters summed must be in 1..2^20, got {self.clusters!r}")
        if not 1 <= self.max_weight <= self.levels:
            raise FieldError(f"a weight bound of {self.max_weight} does not fit {self.bits}-bit fields summed over "
                             f"{self.clusters} clusters (at most {self.levels}); raise secagg.bits or lower max-weight")

    @property
    def levels(self) -> int:
        """L: the largest integer one input may hold."""
        return min(((1 << (self.bits - 1)) - 1) // self.clusters, MAX_LEVELS)

    @property
    def step(self) -> float:
        """The value of one unit of w·x."""
        return self.clip * self.max_weight / self.levels

    @property
    def mask(self) -> np.uint64:
        return np.uint64((1 << self.bits) - 1)

    @property
    def bytes_per_element(self) -> int:
        return self.bits // 8


def encode(x: np.ndarray, *, weight: int, code: FieldCode, rng: np.random.Generator) -> np.ndarray:
    """(w·x, w) as uint64 field elements (len(x) + 1, the weight last), w·x rounded stochastically."""
    if isinstance(weight, bool) or not isinstance(weight, int | np.integer) or not 0 <= weight <= code.max_weight:
        raise FieldError(f"the weight must be an integer in [0, {code.max_weight}], got {weight!r}")
    x = np.asarray(x, dtype=np.float64)
    if not np.isfinite(x).all():
        raise FieldError("the update holds NaN or Inf; it cannot be encoded")
    y = np.clip(x, -code.clip, code.clip) * (int(weight) / code.step)
    q = np.floor(y + rng.random(y.shape))
    np.clip(q, -code.levels, code.levels, out=q)  # float64 rounding near L must not step past it
    out = np.empty(x.size + 1, dtype=np.uint64)
    out[:-1] = q.astype(np.int64).view(np.uint64)
    out[-1] = np.uint64(int(weight))
    return out & code.mask


def decode_sum(total: np.ndarray, *, code: FieldCode) -> tuple[np.ndarray, int]:
    """(Σ wᵢxᵢ as float64, Σ wᵢ) from the field sum of at most `code.clusters` encoded inputs."""
    v = np.asarray(total, dtype=np.uint64) & code.mask
    signed = v.astype(np.int64)  # for b = 64 this is already the two's-complement reading
    if code.bits < 64:
        signed = np.where(v >= np.uint64(1 << (code.bits - 1)), signed - (1 << code.bits), signed)
    weight = int(signed[-1])
    return signed[:-1].astype(np.float64) * code.step, weight


def add(a: np.ndarray, b: np.ndarray, *, code: FieldCode) -> np.ndarray:
    """a + b in the field (uint64 arithmetic wraps mod 2^64; the mask reduces to 2^b)."""
    return (a + b) & code.mask


def subtract(a: np.ndarray, b: np.ndarray, *, code: FieldCode) -> np.ndarray:
    return (a - b) & code.mask


def pack(v: np.ndarray, *, bits: int) -> bytes:
    """Field elements at bits/8 bytes each, little-endian."""
    if bits == 32:
        return v.astype("<u4").tobytes()
    if bits == 16:
        return v.astype("<u2").tobytes()
    raw = np.ascontiguousarray(v, dtype="<u8").view(np.uint8).reshape(-1, 8)
    return raw[:, : bits // 8].tobytes()


def unpack(data: bytes | np.ndarray, *, bits: int, count: int) -> np.ndarray:
    """The inverse of `pack`; raises FieldError when the size is not `count` elements."""
    width = bits // 8
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes | bytearray) else np.asarray(data, np.uint8)
    if buf.size != count * width:
        raise FieldError(f"a masked vector of {buf.size} bytes, expected {count} elements of {width} bytes")
    if bits == 32:
        return buf.view("<u4").astype(np.uint64)
    if bits == 16:
        return buf.view("<u2").astype(np.uint64)
    raw = np.zeros((count, 8), dtype=np.uint8)
    raw[:, :width] = buf.reshape(count, width)
    return raw.view("<u8").reshape(count).astype(np.uint64)
