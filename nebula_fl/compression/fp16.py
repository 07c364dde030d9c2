"""IEEE half precision: 2 bytes an element, |x̂ - x| <= 2^-11 |x| (|x| >= 2^-14), <= 2^-25 below; |x| <= 65504."""

from __future__ import annotations

import numpy as np

from nebula_fl.compression.codec import ArraySpec, Codec, Encoded, Plan
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.layout import Layout

MAX = 65504.0


def _any_nonfinite(half: np.ndarray) -> bool:
    """On the bits (numpy's float16 isfinite is ~5x slower): |h| >= Inf's bit pattern is Inf or NaN."""
    return bool(half.size) and int((half.view(np.uint16) & np.uint16(0x7FFF)).max()) >= 0x7C00


class FP16(Codec):
    name = "fp16"
    role = "quantizer"
    checks_input = True
    finite_output = True

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        return Plan(arrays=(ArraySpec("h", "f2", sum(segments)),))

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        with np.errstate(over="ignore", invalid="ignore"):
            half = values.astype("<f2")
        if _any_nonfinite(half):
            raise CodecError(f"fp16 got NaN or Inf, or a value beyond ±{MAX:g} (the fp16 range); "
                             "use bf16 or int8 for values that large")
        return Encoded(arrays={"h": half})

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        half = encoded.arrays["h"]
        if _any_nonfinite(half):
            raise CodecError("blob buffer 'h' (fp16 values) holds NaN or Inf; it is corrupt")
        return half.astype(np.float32)
