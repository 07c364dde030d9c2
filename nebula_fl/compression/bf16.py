"""bfloat16 by bit arithmetic: the upper 16 bits of float32, rounded to nearest even.

Same range as float32 at 2 bytes an element: |x̂ - x| <= 2^-8 |x| for normal x (2^-133 absolute for
float32 subnormals). No torch: round-to-nearest-even is ``(bits + 0x7FFF + ((bits >> 16) & 1)) >> 16``.
"""

from __future__ import annotations

import numpy as np

from nebula_fl.compression.codec import ArraySpec, Codec, Encoded, Plan
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.layout import Layout


def _any_nonfinite(bits: np.ndarray) -> bool:
    """|b| >= Inf's bit pattern (an all-ones exponent) is Inf or NaN."""
    return bool(bits.size) and int((bits & np.uint16(0x7FFF)).max()) >= 0x7F80


class BF16(Codec):
    name = "bf16"
    role = "quantizer"
    checks_input = True
    finite_output = True

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        return Plan(arrays=(ArraySpec("b", "u2", sum(segments)),))

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        if not np.isfinite(values).all():  # a NaN's bits could wrap around to a finite value below
            raise CodecError("bf16 got NaN or Inf in its input")
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = (bits >> 16) & np.uint32(1)
        rounded += bits
        rounded += np.uint32(0x7FFF)
        rounded >>= 16
        out = rounded.astype("<u2")
        if _any_nonfinite(out):
            raise CodecError("bf16 got a value that rounds beyond the float32 range (|x| > 3.39e38)")
        return Encoded(arrays={"b": out})

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        bits = encoded.arrays["b"]
        if _any_nonfinite(bits):
            raise CodecError("blob buffer 'b' (bf16 values) holds NaN or Inf; it is corrupt")
        out = bits.astype(np.uint32)
        out <<= 16
        return out.view(np.float32)
