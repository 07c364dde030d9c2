"""The order and shapes of the tensors a flat update vector is made of."""

from __future__ import annotations

import hashlib
import json
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

#: Element-count cap: indices travel as (at most) 32-bit integers.
MAX_SIZE = 2**32 - 1


@dataclass(frozen=True)
class Layout:
    """Ordered (name, shape) pairs: what a flat float32 vector of `size` elements means.

    Sender and receiver must build the same Layout (same names, shapes and order); every blob carries
    its layout's fingerprint, so a blob decoded against another layout is refused, not misread.
    """

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    def __post_init__(self) -> None:
        try:
            entries = tuple((name, tuple(_dim(d) for d in shape)) for name, shape in self.entries)
        except (TypeError, ValueError):
            raise ValueError("layout entries must be (name, shape) pairs with integer dimensions, "
                             "e.g. Layout.from_arrays({'w': np.zeros((8, 4))})") from None
        names = [name for name, _ in entries]
        for name, shape in entries:
            if not isinstance(name, str) or not name:
                raise ValueError(f"layout tensor name {name!r} must be a non-empty string")
            if any(d < 0 for d in shape):
                raise ValueError(f"layout tensor '{name}' has shape {shape}; dimensions must be integers >= 0")
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"layout tensor name '{dup}' appears twice; names must be unique")
        object.__setattr__(self, "entries", entries)
        if not 1 <= self.size <= MAX_SIZE:
            raise ValueError(f"layout holds {self.size} elements; it must hold between 1 and {MAX_SIZE}")

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray]) -> Layout:
        """The layout of `arrays`, in their iteration order."""
        return cls(tuple((name, tuple(np.shape(value))) for name, value in arrays.items()))

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, Sequence[int]]) -> Layout:
        return cls(tuple((name, tuple(shape)) for name, shape in shapes.items()))

    @cached_property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.entries)

    @cached_property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape in self.entries)

    @cached_property
    def sizes(self) -> tuple[int, ...]:
        return tuple(int(np.prod(shape, dtype=object)) for shape in self.shapes)  # exact: int64 would wrap

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each tensor in the flat vector (one more entry at the end: `size`)."""
        out = [0]
        for s in self.sizes:
            out.append(out[-1] + s)
        return tuple(out)

    @cached_property
    def size(self) -> int:
        return sum(self.sizes)

    @cached_property
    def fingerprint(self) -> str:
        """8 hex digits of SHA-256 over the canonical JSON: enough to tell two layouts apart by accident."""
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:8]

    def flatten(self, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
        """One 1-D float32 vector of every tensor in layout order; keys and shapes must match exactly."""
        missing = [n for n in self.names if n not in arrays]
        extra = [n for n in arrays if n not in set(self.names)]
        if missing or extra:
            raise ValueError(f"arrays do not match the layout: {len(missing)} missing (e.g. {missing[:1]}), "
                             f"{len(extra)} unexpected (e.g. {extra[:1]}); build the layout from the same tensors")
        out = np.empty(self.size, dtype=np.float32)
        for name, shape, start, end in zip(self.names, self.shapes, self.offsets, self.offsets[1:]):
            value = np.asarray(arrays[name])
            if value.shape != shape:
                raise ValueError(f"tensor '{name}' has shape {value.shape}, the layout says {shape}")
            if not (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer)):
                raise ValueError(f"tensor '{name}' has dtype {value.dtype}; expected a real number type")
            out[start:end] = value.reshape(-1)
        return out

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """The tensors of a flat vector, in layout order, as float32 views of one private copy."""
        flat = np.asarray(flat)
        if flat.shape != (self.size,):
            raise ValueError(f"flat vector has shape {flat.shape}, the layout needs ({self.size},)")
        if not np.issubdtype(flat.dtype, np.floating):
            raise ValueError(f"flat vector has dtype {flat.dtype}; expected a float type")
        own = np.array(flat, dtype=np.float32, copy=True)
        return {name: own[start:end].reshape(shape)
                for name, shape, start, end in zip(self.names, self.shapes, self.offsets, self.offsets[1:])}

    def to_json(self) -> str:
        return json.dumps({"tensors": [[name, list(shape)] for name, shape in self.entries]}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Layout:
        try:
            data = json.loads(text)
            tensors = data["tensors"]
            if not isinstance(tensors, list) or not all(
                isinstance(t, list) and len(t) == 2 and isinstance(t[1], list) for t in tensors
            ):
                raise TypeError
            return cls(tuple((name, tuple(shape)) for name, shape in tensors))
        except ValueError as exc:
            if "layout" in str(exc):
                raise
            raise ValueError(f"layout JSON is invalid ({exc}); pass the text Layout.to_json() wrote") from None
        except (TypeError, KeyError, RecursionError):
            raise ValueError('layout JSON must look like {"tensors": [["name", [8, 384]], ...]}; '
                             "pass the text Layout.to_json() wrote") from None


def _dim(value: object) -> int:
    if isinstance(value, bool):
        raise TypeError("a bool is not a dimension")
    return operator.index(value)
