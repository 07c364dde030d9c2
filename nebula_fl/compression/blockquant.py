"""Stochastic block quantization, unbiased (QSGD-style): the algorithm int8 and int4 share.

Values are cut into blocks of `block` elements (never straddling two value segments, e.g. two
tensors); each block b gets a float32 scale s_b = max|x| / L (L = 127 for int8, 7 for int4) and
each element the integer q = floor(x / s_b + u) in [-L, L], u ~ U[0, 1) drawn from the codec's
generator for the round's seed, so E[q s_b] = x and |q s_b - x| <= s_b.

Three limits of finite arithmetic, all far below anything that matters for a model update:
u carries 16 random bits, so E[q s_b] is x to within 2^-16 s_b; float32 rounding of the scale and of
x / s_b lets the error exceed s_b by less than 2^-15 s_b; and a block whose max|x| is below 2^-100 is
sent as zeros (error <= 2^-100 there) rather than with a subnormal scale.

Speed (one core): the work runs in cache-sized chunks; |x| and the block maxima use the float bits
as integers (no NaN-aware float max), u comes from raw generator words, and ``floor(y + u)`` is a
float-to-uint8 truncation of y + 128 + u, where 128 + u is built by OR-ing 16 random bits into the
mantissa of 128.0. Codes are stored offset by 128 (int8) or 8 (int4, two per byte).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from nebula_fl.compression.codec import Codec, parse_int_arg
from nebula_fl.compression.errors import CodecError

DEFAULT_BLOCK = 256
MIN_BLOCK, MAX_BLOCK = 8, 1 << 16
TINY = np.float32(2.0**-100)
CHUNK = 1 << 18  # elements per pass: a few hundred kB of scratch, stays in L2
OFFSET = 128
_ABS = np.uint32(0x7FFFFFFF)
_INF_BITS = np.uint32(0x7F800000)
_DITHER = np.uint32(0x43000000)  # 128.0; | r16 gives 128 + r16 / 2^16
_F32_MAX = float(np.finfo(np.float32).max)


def runs(segments: tuple[int, ...], block: int) -> list[tuple[int, int]]:
    """Maximal spans [start, end) whose blocks never straddle a segment (all but a run's last block are full)."""
    out = []
    start = pos = 0
    for length in segments:
        pos += length
        if (pos - start) % block:
            out.append((start, pos))
            start = pos
    if pos > start:
        out.append((start, pos))
    return out


def block_count(segments: tuple[int, ...], block: int) -> int:
    return sum(-(-(end - start) // block) for start, end in runs(segments, block))


class _Chunker:
    """Quantizes (rows, block) arrays chunk by chunk with reusable scratch buffers."""

    def __init__(self, block: int, levels: int, gen: np.random.Generator) -> None:
        self.block, self.levels, self.gen = block, levels, gen
        self.rows = max(1, CHUNK // block)
        self.scratch = np.empty((self.rows, block), dtype=np.uint32)
        self.dither = np.empty((self.rows, block), dtype=np.uint32)
        self.limit = scale_limit(levels)

    def quantize(self, x2: np.ndarray, codes2: np.ndarray, scales: np.ndarray) -> None:
        levels = np.float32(self.levels)
        for r in range(0, x2.shape[0], self.rows):
            xc = x2[r:r + self.rows]
            k = xc.shape[0]
            ab = self.scratch[:k]
            np.bitwise_and(xc.view(np.uint32), _ABS, out=ab)
            amax_bits = ab.max(axis=1)
            if amax_bits.max() >= _INF_BITS:
                raise CodecError("the quantizer got NaN or Inf in its input")
            amax = amax_bits.view(np.float32)
            sc = scales[r:r + k]
            np.divide(amax, levels, out=sc)
            if sc.max() > self.limit:
                raise CodecError(f"the quantizer got |x| = {amax.max():.4g}, within 1e-6 of the float32 limit, "
                                 "where its scale cannot be represented; use bf16 for such values")
            dead = amax < TINY
            with np.errstate(divide="ignore", over="ignore"):
                inv = np.nextafter(levels / amax, np.float32(0))  # rounded down: |x| * inv <= L exactly
            inv[dead] = 0
            sc[dead] = 0
            y = ab.view(np.float32)
            np.multiply(xc, inv[:, None], out=y)
            count = k * self.block
            r16 = self.gen.bit_generator.random_raw(-(-count // 4)).view(np.uint16)[:count].reshape(k, self.block)
            d = self.dither[:k]
            np.bitwise_or(r16, _DITHER, out=d)
            np.add(y, d.view(np.float32), out=y)
            np.copyto(codes2[r:r + k], y, casting="unsafe")  # truncation = floor: y + 128 + u >= 1

def quantize(values: np.ndarray, segments: tuple[int, ...], *, block: int, levels: int,
             gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(codes: uint8 of len(values), q + 128; scales: float32 per block)."""
    codes = np.empty(values.size, dtype=np.uint8)
    scales = np.empty(block_count(segments, block), dtype=np.float32)
    chunker = _Chunker(block, levels, gen)
    b = 0
    for start, end in runs(segments, block):
        full = (end - start) // block
        mid = start + full * block
        if full:
            chunker.quantize(values[start:mid].reshape(full, block), codes[start:mid].reshape(full, block),
                             scales[b:b + full])
            b += full
        if mid < end:
            pad = np.zeros((1, block), dtype=np.float32)
            pad[0, :end - mid] = values[mid:end]
            out = np.empty((1, block), dtype=np.uint8)
            chunker.quantize(pad, out, scales[b:b + 1])
            codes[mid:end] = out[0, :end - mid]
            b += 1
    return codes, scales


def _dequantize_rows(codes2: np.ndarray, scales: np.ndarray, out2: np.ndarray) -> None:
    """out = (code - 128) * scale, row block by row block, chunk by chunk."""
    rows = max(1, CHUNK // codes2.shape[1])
    offset = np.float32(OFFSET)
    for r in range(0, codes2.shape[0], rows):
        o = out2[r:r + rows]
        np.subtract(codes2[r:r + rows], offset, out=o)
        np.multiply(o, scales[r:r + rows, None], out=o)


def dequantize(codes: np.ndarray, scales: np.ndarray, segments: tuple[int, ...], *, block: int) -> np.ndarray:
    """Float32 values from validated codes (q + 128) and scales."""
    out = np.empty(codes.size, dtype=np.float32)
    b = 0
    for start, end in runs(segments, block):
        full = (end - start) // block
        mid = start + full * block
        if full:
            _dequantize_rows(codes[start:mid].reshape(full, block), scales[b:b + full],
                             out[start:mid].reshape(full, block))
            b += full
        if mid < end:
            pad = np.full((1, block), OFFSET, dtype=np.uint8)
            pad[0, :end - mid] = codes[mid:end]
            tail = np.empty((1, block), dtype=np.float32)
            _dequantize_rows(pad, scales[b:b + 1], tail)
            out[mid:end] = tail[0, :end - mid]
            b += 1
    return out


def scale_limit(levels: int) -> np.float32:
    """The largest scale s with L * s safely below float32's max, so a decoded value is always finite."""
    return np.float32(_F32_MAX / levels * (1 - 2.0**-20))


def check_scales(scales: np.ndarray, *, levels: int, name: str) -> None:
    """Finite, >= 0 and small enough that L * scale cannot overflow float32."""
    limit = scale_limit(levels)
    if scales.size and not ((scales >= 0) & (scales <= limit)).all():  # NaN fails both comparisons
        raise CodecError(f"blob buffer '{name}' (block scales) holds a negative, NaN, Inf or out-of-range "
                         "scale; it is corrupt")


class BlockQuantizer(Codec):
    """int8 / int4: the spec argument is the block size (default 256), the knob is the bit width."""

    role = "quantizer"
    checks_input = True
    finite_output = True
    levels: ClassVar[int]
    bits: ClassVar[int]
    widths: ClassVar[dict[int, type[BlockQuantizer]]] = {}  # bit width -> its codec: int8 and int4 sign in below

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        BlockQuantizer.widths.setdefault(cls.bits, cls)  # the built-ins load first; a plug-in never replaces one

    def __init__(self, *, block: int = DEFAULT_BLOCK) -> None:
        if isinstance(block, bool) or not isinstance(block, int) or not MIN_BLOCK <= block <= MAX_BLOCK:
            raise CodecError(f"{self.name} block size must be an integer in [{MIN_BLOCK}, {MAX_BLOCK}], got {block!r}")
        self.block = block

    @classmethod
    def from_arg(cls, arg: str | None) -> Codec:
        return cls(block=parse_int_arg(cls.name, arg, default=DEFAULT_BLOCK, low=MIN_BLOCK, high=MAX_BLOCK,
                                       what="block size"))

    @property
    def arg(self) -> str | None:
        return None if self.block == DEFAULT_BLOCK else str(self.block)

    @property
    def param(self) -> int:
        return self.bits

    def with_param(self, value: float | int) -> Codec:
        if value not in (4, 8) or isinstance(value, bool):
            raise CodecError(f"{self.spec}: the adjustable parameter is the bit width, 8 (int8) or 4 (int4); "
                             f"got {value!r}")
        return BlockQuantizer.widths[int(value)](block=self.block)  # type: ignore[call-arg]

    def quantize(self, values: np.ndarray, segments: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
        return quantize(values, segments, block=self.block, levels=self.levels, gen=self.generator(seed))

    def dequantize(self, codes: np.ndarray, scales: np.ndarray, segments: tuple[int, ...]) -> np.ndarray:
        check_scales(scales, levels=self.levels, name="s")
        return dequantize(codes, scales, segments, block=self.block)
