"""int8: stochastic rounding to 255 levels per block, 1 byte an element + a float32 scale per block.

Spec ``int8[:BLOCK]`` (default 256: 1.016 bytes an element). Unbiased, |x̂ - x| <= max|x| / 127 of
the block; see blockquant for the algorithm.
"""

from __future__ import annotations

import numpy as np

from nebula_fl.compression.blockquant import BlockQuantizer, block_count
from nebula_fl.compression.codec import ArraySpec, Encoded, Plan
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.layout import Layout


class Int8(BlockQuantizer):
    name = "int8"
    levels = 127
    bits = 8

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        return Plan(arrays=(ArraySpec("q", "u1", sum(segments)),
                            ArraySpec("s", "f4", block_count(segments, self.block))))

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        codes, scales = self.quantize(values, segments, seed)
        return Encoded(arrays={"q": codes, "s": scales})

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        codes = encoded.arrays["q"]
        if codes.size and codes.min() < 1:  # q + 128 lies in [1, 255]
            raise CodecError("blob buffer 'q' (int8 codes) holds -128, outside [-127, 127]; it is corrupt")
        return self.dequantize(codes, encoded.arrays["s"], segments)
