"""Raw float32: exact, 4 bytes an element; what a transform's values travel as when no quantizer follows."""

from __future__ import annotations

import numpy as np

from nebula_fl.compression.codec import ArraySpec, Codec, Encoded, Plan
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.layout import Layout


def require_finite(values: np.ndarray, *, what: str) -> None:
    if not np.isfinite(values).all():
        raise CodecError(f"{what} holds NaN or Inf")


class NoneCodec(Codec):
    name = "none"
    role = "quantizer"
    lossless = True
    checks_input = True
    finite_output = True

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        return Plan(arrays=(ArraySpec("v", "f4", sum(segments)),))

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        require_finite(values, what="the input to 'none'")
        return Encoded(arrays={"v": values})

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        values = encoded.arrays["v"]
        require_finite(values, what="blob buffer 'v' (float32 values)")
        return values.astype(np.float32, copy=True)
