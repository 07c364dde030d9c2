"""The contract every stage of a compression chain implements: built-ins and plugins alike.

A chain is at most two stages, ``transform+quantizer``:

* a **transform** (topk, randk, lowrank) turns the flat vector x (n float32) into fewer float32
  *values* (split into segments, e.g. P and Q of every matrix) plus side arrays (e.g. indices);
* a **quantizer** (none, fp16, bf16, int8, int4, plugins such as sign) turns float32 values into
  buffers (codes, scales) and hands no values on.

A spec with only a quantizer gets the pass-through transform (one segment per layout tensor); a spec
with only a transform gets ``none`` (float32) for its values. The Compressor does everything else:
error feedback, the byte container, validation of what a stage returns against what it planned.

Plugin contract (a subclass registered with ``register_codec`` or through the ``nebula_fl.codecs``
entry-point group, ``sign = "nebula_codec_sign:SignCodec"``):

1. Class attributes: ``name`` (the spec name, equal to the entry-point name), ``role``
   ("transform" or "quantizer") and the flags below.
2. ``from_arg(arg)`` builds an instance from the text after ``name:`` (None when absent) and raises
   CodecError for a bad argument; ``arg`` gives it back in canonical form (None for the default),
   so ``parse_spec(c.spec)`` rebuilds an equal codec: the decoder knows the codec only by its spec.
3. ``plan(segments, layout=)`` says, from sizes alone, exactly which arrays ``encode`` will return
   (name, dtype code, length) and the segment lengths of the values it hands on. Lengths must not
   depend on the data: the decoder checks every declared length against the plan before it reads a
   byte, so a hostile blob can never make it allocate more than the plan allows.
4. ``encode(values, segments=, layout=, seed=)`` returns an Encoded matching the plan; it must not
   modify ``values``. Any randomness comes from ``self.generator(seed)``, so encoding is a pure
   function of (state, input, seed).
5. ``decode(encoded, segments=, layout=, seed=)`` inverts it, from the arrays alone (and the seed
   when ``seeded_decode``): validate what the arrays may hold (value ranges, padding, NaN/Inf) and
   raise CodecError, never another exception; return a new float32 array of ``sum(segments)``.
6. ``state_dict()``/``load_state_dict()`` hold whatever an encoder carries between rounds, as
   plain nested dicts of numpy arrays, ints, floats and strings.
7. ``param``/``with_param()`` expose one knob for adaptive compression, if the codec has one.
"""

from __future__ import annotations

import abc
import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.layout import Layout

#: The only buffer types a blob may declare (all little-endian).
DTYPES: dict[str, np.dtype] = {code: np.dtype("<" + code) for code in ("u1", "i1", "u2", "i2", "u4", "i4", "f2", "f4")}

_ARRAY_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,15}\Z")
EMPTY = np.zeros(0, dtype=np.float32)
EMPTY.flags.writeable = False


@dataclass(frozen=True)
class ArraySpec:
    """One buffer of a blob: a short name, a dtype code from DTYPES, and its exact element count."""

    name: str
    dtype: str
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _ARRAY_NAME.match(self.name):
            raise CodecError(f"array name {self.name!r} must be 1-16 letters, digits or '_', starting with a letter")
        if self.dtype not in DTYPES:
            raise CodecError(f"array '{self.name}' has dtype code {self.dtype!r}; use one of {sorted(DTYPES)}")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 0:
            raise CodecError(f"array '{self.name}' has length {self.length!r}; it must be an integer >= 0")

    @property
    def nbytes(self) -> int:
        return self.length * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Plan:
    """What a stage will produce for given input sizes: value segments handed on, and its own arrays."""

    values: tuple[int, ...] = ()
    arrays: tuple[ArraySpec, ...] = ()

    def __post_init__(self) -> None:
        names = [a.name for a in self.arrays]
        if len(set(names)) != len(names):
            raise CodecError(f"a plan names an array twice ({names}); array names must be unique")


@dataclass
class Encoded:
    """The intermediate representation between stages.

    `values`: the 1-D float32 values a following quantizer compresses (the segments of
    `Plan.values`, concatenated; empty for a quantizer's output). `arrays`: the stage's own buffers,
    keyed as in its plan, stored in the blob as they are.
    """

    values: np.ndarray = field(default_factory=lambda: EMPTY)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


class Codec(abc.ABC):
    """One stage of a chain; see the module docstring for the contract plugins follow."""

    name: ClassVar[str] = ""
    role: ClassVar[Literal["transform", "quantizer"]] = "quantizer"
    error_feedback: ClassVar[bool] = False
    """Biased stage: the Compressor keeps a residual (x + residual - decoded) and adds it next time."""
    seeded_decode: ClassVar[bool] = False
    """decode needs the encoder's seed (random-k regenerates its indices); the blob records a seed tag."""
    lossless: ClassVar[bool] = False
    """decode(encode(v)) == v exactly (float32 'none'): error feedback may skip decoding."""
    checks_input: ClassVar[bool] = False
    """encode raises CodecError on NaN/Inf in its input, so the Compressor need not look first."""
    finite_output: ClassVar[bool] = False
    """decode returns only finite values (or raises), so the Compressor need not check its output."""

    # -- construction from a spec --------------------------------------------------------------
    @classmethod
    def from_arg(cls, arg: str | None) -> Codec:
        """An instance from the text after ``name:`` (None when there is none)."""
        if arg is not None:
            raise CodecError(f"codec '{cls.name}' takes no argument, got '{cls.name}:{arg}'; write '{cls.name}'")
        return cls()

    @property
    def arg(self) -> str | None:
        """The canonical argument text, or None when everything is at its default."""
        return None

    @property
    def spec(self) -> str:
        return self.name if self.arg is None else f"{self.name}:{self.arg}"

    def __repr__(self) -> str:
        return f"<codec {self.spec}>"

    # -- adaptive compression ------------------------------------------------------------------
    @property
    def param(self) -> float | int | None:
        """The knob adaptive compression turns (ratio, rank, bits), or None when there is none."""
        return None

    def with_param(self, value: float | int) -> Codec:
        """A copy with the knob at `value`, carrying over whatever state still applies."""
        raise CodecError(f"codec '{self.spec}' has no adjustable parameter; adaptive compression needs a chain "
                         "that starts with topk, randk, lowrank, int8 or int4")

    # -- the stage itself ------------------------------------------------------------------------
    @abc.abstractmethod
    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        """The exact arrays and value segments `encode` produces for inputs of these segment lengths."""

    @abc.abstractmethod
    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        """Compress 1-D float32 `values` (segments of the given lengths, concatenated); never modify them."""

    @abc.abstractmethod
    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        """A new 1-D float32 array of sum(segments) from validated arrays; CodecError on anything malformed."""

    def subtract_decoded(
        self, target: np.ndarray, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int
    ) -> None:
        """target -= decode(encoded), in place (transforms override this with something cheaper)."""
        target -= self.decode(encoded, segments=segments, layout=layout, seed=seed)

    # -- state carried between rounds --------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state:
            raise CodecError(f"codec '{self.spec}' keeps no state, got keys {sorted(state)}; "
                             "the state belongs to another chain")

    # -- helpers -----------------------------------------------------------------------------------
    def generator(self, seed: int, *salt: int) -> np.random.Generator:
        """This codec's own random stream for `seed`: two stages of one chain never share draws."""
        return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(self.name.encode()), *salt])))


def parse_int_arg(name: str, arg: str | None, *, default: int, low: int, high: int, what: str) -> int:
    """The integer after ``name:``, within [low, high]."""
    if arg is None:
        return default
    text = arg.strip()
    if not text.isdigit():
        raise CodecError(f"'{name}:{arg}' needs an integer {what} in [{low}, {high}], e.g. '{name}:{default}'")
    value = int(text)
    if not low <= value <= high:
        raise CodecError(f"'{name}:{arg}': the {what} must be in [{low}, {high}], e.g. '{name}:{default}'")
    return value


def parse_ratio_arg(name: str, arg: str | None) -> float:
    """The fraction after ``name:``, in (0, 1]."""
    if arg is None:
        raise CodecError(f"'{name}' needs the fraction of entries to keep, e.g. '{name}:0.05'")
    try:
        value = float(arg)
    except ValueError:
        raise CodecError(f"'{name}:{arg}' needs a number in (0, 1], e.g. '{name}:0.05'") from None
    return check_ratio(name, value)


def check_ratio(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating | np.integer):
        raise CodecError(f"{name} ratio must be a number in (0, 1], got {value!r}")
    value = float(value)
    if not 0.0 < value <= 1.0:
        raise CodecError(f"{name} ratio must be in (0, 1], got {value}; e.g. {name}:0.05 keeps 5% of the entries")
    return value


def kept(ratio: float, n: int) -> int:
    """k = max(1, ceil(ratio * n)), capped at n: identical on every machine (IEEE arithmetic)."""
    return min(n, max(1, math.ceil(ratio * n)))


class RatioCodec(Codec):
    """A sparsifier whose one knob is the share of entries it keeps (`name:RATIO`)."""

    def __init__(self, *, ratio: float) -> None:
        self.ratio = check_ratio(self.name, ratio)

    @classmethod
    def from_arg(cls, arg: str | None) -> Codec:
        return cls(ratio=parse_ratio_arg(cls.name, arg))

    @property
    def arg(self) -> str:
        return repr(self.ratio)

    @property
    def param(self) -> float:
        return self.ratio

    def with_param(self, value: float | int) -> Codec:
        return type(self)(ratio=value)

