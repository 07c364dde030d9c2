"""int4: stochastic rounding to 15 levels per block, two codes a byte + a float32 scale per block.

Spec ``int4[:BLOCK]`` (default 256: 0.516 bytes an element). Unbiased, |x̂ - x| <= max|x| / 7 of
the block; see blockquant for the algorithm. Element 2i is the low nibble of byte i, element 2i+1
the high one; an odd count leaves the last high nibble 0.
"""

from __future__ import annotations

import numpy as np

from nebula_fl.compression.blockquant import OFFSET, BlockQuantizer, block_count
from nebula_fl.compression.codec import ArraySpec, Encoded, Plan
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.layout import Layout

_SHIFT = np.uint8(OFFSET - 8)  # codes come out as q + 128; nibbles hold q + 8 in [1, 15]


class Int4(BlockQuantizer):
    name = "int4"
    levels = 7
    bits = 4

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        n = sum(segments)
        return Plan(arrays=(ArraySpec("q", "u1", (n + 1) // 2),
                            ArraySpec("s", "f4", block_count(segments, self.block))))

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        codes, scales = self.quantize(values, segments, seed)
        codes -= _SHIFT
        packed = codes[0::2].copy()
        packed[:codes.size // 2] |= codes[1::2] << 4
        return Encoded(arrays={"q": packed, "s": scales})

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        n = sum(segments)
        packed = encoded.arrays["q"]
        low, high = packed & np.uint8(15), packed >> 4
        pairs = n // 2
        if (low.size and low.min() < 1) or (pairs and high[:pairs].min() < 1):
            raise CodecError("blob buffer 'q' (int4 codes) holds -8, outside [-7, 7]; it is corrupt")
        if n % 2 and high[-1] != 0:
            raise CodecError("blob buffer 'q' (int4 codes) has a non-zero padding nibble; it is corrupt")
        codes = np.empty(n, dtype=np.uint8)
        np.add(low, _SHIFT, out=codes[0::2])
        np.add(high[:pairs], _SHIFT, out=codes[1::2])
        return self.dequantize(codes, encoded.arrays["s"], segments)
