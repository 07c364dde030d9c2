"""sign: 1 bit an element plus a float32 mean |x| per block; biased, so the Compressor applies error feedback.

x̂ = scale_b * sign(x) with scale_b = mean |x| over block b, the scaled sign that minimises
||x - x̂||² among those of its form (EF-signSGD, Karimireddy et al. 2019). Spec ``sign[:BLOCK]``,
block 256 by default: 0.141 bytes an element. Zero counts as positive.
"""

from __future__ import annotations

import numpy as np

from nebula_fl.compression import ArraySpec, Codec, CodecError, Encoded, Plan

DEFAULT_BLOCK = 256


class SignCodec(Codec):
    name = "sign"
    role = "quantizer"
    error_feedback = True

    def __init__(self, *, block: int = DEFAULT_BLOCK) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 1 << 16:
            raise CodecError(f"sign block size must be an integer in [1, 65536], got {block!r}")
        self.block = block

    @classmethod
    def from_arg(cls, arg: str | None) -> Codec:
        if arg is None:
            return cls()
        if not arg.isdigit():
            raise CodecError(f"'sign:{arg}' needs an integer block size, e.g. 'sign:256'")
        return cls(block=int(arg))

    @property
    def arg(self) -> str | None:
        return None if self.block == DEFAULT_BLOCK else str(self.block)

    def plan(self, segments, *, layout) -> Plan:
        n = sum(segments)
        return Plan(arrays=(ArraySpec("b", "u1", -(-n // 8)), ArraySpec("s", "f4", -(-n // self.block))))

    def encode(self, values, *, segments, layout, seed) -> Encoded:
        n, block = values.size, self.block
        blocks = -(-n // block)
        padded = np.zeros(blocks * block, dtype=np.float32)
        np.abs(values, out=padded[:n])
        counts = np.full(blocks, block, dtype=np.float32)
        counts[-1] = n - (blocks - 1) * block
        scales = (padded.reshape(blocks, block).sum(axis=1, dtype=np.float64) / counts).astype(np.float32)
        bits = np.packbits(values >= 0, bitorder="little")
        return Encoded(arrays={"b": bits, "s": scales})

    def decode(self, encoded, *, segments, layout, seed) -> np.ndarray:
        n, block = sum(segments), self.block
        bits, scales = encoded.arrays["b"], encoded.arrays["s"]
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise CodecError("blob buffer 's' (sign scales) holds a negative, NaN or Inf scale; it is corrupt")
        signs = np.unpackbits(bits, bitorder="little")
        if signs[n:].any():
            raise CodecError("blob buffer 'b' (sign bits) has padding bits set; it is corrupt")
        out = signs[:n].astype(np.float32)
        out *= 2
        out -= 1
        out *= np.repeat(scales, block)[:n]
        return out
