"""What server and cluster must compute identically to keep a cluster's view of the global adapter in sync."""

from __future__ import annotations

import zlib

import numpy as np


def view_crc(flat: np.ndarray) -> int:
    """CRC-32 of a flattened float32 view: cheap proof that both sides hold the same bits."""
    return zlib.crc32(np.ascontiguousarray(flat, dtype=np.float32).tobytes())


def codec_seed(seed: int, server_round: int) -> int:
    """The round's codec seed, the same for every cluster (random-k must pick the same indices everywhere)."""
    return (seed * 1_000_003 + server_round) % (2**31 - 1)
