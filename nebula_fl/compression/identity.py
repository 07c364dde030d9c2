"""The pass-through transform a quantizer-only chain runs on: one value segment per layout tensor.

Not a registered codec (there is nothing to write in a spec): the Compressor inserts it, so that a
quantizer's blocks never straddle two tensors of different scale (a LoRA A and a LoRA B matrix).
"""

from __future__ import annotations

import numpy as np

from nebula_fl.compression.codec import Codec, Encoded, Plan
from nebula_fl.compression.layout import Layout


class Tensors(Codec):
    name = "tensors"
    role = "transform"
    finite_output = True  # it returns the quantizer's (checked) values unchanged

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        return Plan(values=layout.sizes)

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        return Encoded(values=values)

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        return encoded.values

    def subtract_decoded(
        self, target: np.ndarray, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int
    ) -> None:
        target -= encoded.values
