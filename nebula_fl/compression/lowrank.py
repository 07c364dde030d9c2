"""PowerSGD-style low-rank compression (Vogels et al. 2019), with error feedback.

Spec ``lowrank:RANK``. Each tensor of the layout with at least 2 dimensions is read as a matrix M
(first dimension x the rest); when min(m, c) > RANK it travels as P (m x r) and Q (c x r) from one
power-iteration step warm-started from the previous round's Q: P = orth(M Q_prev) (np.linalg.qr),
Q = M^T P, decoded as P Q^T. That is r (m + c) numbers instead of m c, and exact whenever M has
rank <= r. Smaller and 1-D tensors (biases, a thin head) travel as raw values. The warm start is
the codec's state; the first round draws Q from the seed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from nebula_fl.compression.codec import Codec, Encoded, Plan, parse_int_arg
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.layout import Layout

MAX_RANK = 1024


class LowRank(Codec):
    name = "lowrank"
    role = "transform"
    error_feedback = True
    finite_output = True  # decode checks every product

    def __init__(self, *, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 1 <= rank <= MAX_RANK:
            raise CodecError(f"lowrank rank must be an integer in [1, {MAX_RANK}], got {rank!r}; e.g. lowrank:4")
        self.rank = int(rank)
        self._q: dict[str, np.ndarray] = {}

    @classmethod
    def from_arg(cls, arg: str | None) -> Codec:
        if arg is None:
            raise CodecError("'lowrank' needs a rank, e.g. 'lowrank:4'")
        return cls(rank=parse_int_arg(cls.name, arg, default=4, low=1, high=MAX_RANK, what="rank"))

    @property
    def arg(self) -> str:
        return str(self.rank)

    @property
    def param(self) -> int:
        return self.rank

    def with_param(self, value: float | int) -> Codec:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        new = type(self)(rank=value)  # type: ignore[arg-type]
        gen = np.random.default_rng([new.rank, 0x10C0])
        for name, q in self._q.items():
            if q.shape[1] >= new.rank:
                new._q[name] = q[:, :new.rank].copy()
            else:
                extra = gen.standard_normal((q.shape[0], new.rank - q.shape[1]), dtype=np.float32)
                new._q[name] = np.hstack([q, extra])
        return new

    def matrices(self, layout: Layout) -> list[tuple[str, int, int, int, bool]]:
        """(name, start, rows, columns, low-rank?) for every tensor, in layout order."""
        out = []
        for name, shape, start, size in zip(layout.names, layout.shapes, layout.offsets, layout.sizes):
            rows = shape[0] if len(shape) >= 2 else size
            cols = size // rows if rows else 0
            out.append((name, start, rows, cols, len(shape) >= 2 and min(rows, cols) > self.rank))
        return out

    def plan(self, segments: tuple[int, ...], *, layout: Layout) -> Plan:
        values: list[int] = []
        for _, _, rows, cols, low in self.matrices(layout):
            values.extend((rows * self.rank, cols * self.rank) if low else (rows * cols,))
        return Plan(values=tuple(values))

    def encode(self, values: np.ndarray, *, segments: tuple[int, ...], layout: Layout, seed: int) -> Encoded:
        parts = []
        for i, (name, start, rows, cols, low) in enumerate(self.matrices(layout)):
            block = values[start:start + rows * cols]
            if not low:
                parts.append(block)
                continue
            m = block.reshape(rows, cols)
            q = self._q.get(name)
            if q is None or q.shape != (cols, self.rank):
                q = self.generator(seed, i).standard_normal((cols, self.rank), dtype=np.float32)
            p, _ = np.linalg.qr(m @ q)
            q = m.T @ p
            parts += [p.reshape(-1), q.reshape(-1)]
            self._q[name] = self._warm(q, seed, i)
        return Encoded(values=np.concatenate(parts).astype(np.float32, copy=False))

    def _warm(self, q: np.ndarray, seed: int, i: int) -> np.ndarray:
        """Next round's start; a column that vanished (M of rank < r, or zero) restarts from the seed."""
        dead = ~(np.isfinite(q).all(axis=0) & (np.abs(q).max(axis=0) > 0))
        if dead.any():
            q = q.copy()
            q[:, dead] = self.generator(seed, i, 1).standard_normal((q.shape[0], int(dead.sum())), dtype=np.float32)
        return q

    def _factors(self, encoded: Encoded, layout: Layout):
        pos = 0
        vals = encoded.values
        for _, start, rows, cols, low in self.matrices(layout):
            if low:
                p = vals[pos:pos + rows * self.rank].reshape(rows, self.rank)
                pos += rows * self.rank
                q = vals[pos:pos + cols * self.rank].reshape(cols, self.rank)
                pos += cols * self.rank
                yield start, rows, cols, (p, q)
            else:
                yield start, rows, cols, vals[pos:pos + rows * cols]
                pos += rows * cols

    def decode(self, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int) -> np.ndarray:
        out = np.empty(layout.size, dtype=np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            for start, rows, cols, part in self._factors(encoded, layout):
                target = out[start:start + rows * cols]
                if isinstance(part, tuple):
                    np.matmul(part[0], part[1].T, out=target.reshape(rows, cols))
                    if not np.isfinite(target).all():
                        raise CodecError("blob low-rank factors multiply to Inf or NaN; it is corrupt")
                else:
                    target[:] = part
        return out

    def subtract_decoded(
        self, target: np.ndarray, encoded: Encoded, *, segments: tuple[int, ...], layout: Layout, seed: int
    ) -> None:
        for start, rows, cols, part in self._factors(encoded, layout):
            view = target[start:start + rows * cols]
            if isinstance(part, tuple):
                view.reshape(rows, cols)[...] -= part[0] @ part[1].T
            else:
                view -= part

    def state_dict(self) -> dict[str, Any]:
        return {"q": {name: q.copy() for name, q in self._q.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state) - {"q"} or not isinstance(state.get("q", {}), Mapping):
            raise CodecError(f"lowrank state must be {{'q': {{tensor: Q}}}}, got keys {sorted(state)}")
        loaded = {}
        for name, q in state.get("q", {}).items():
            q = np.asarray(q)
            if q.ndim != 2 or q.shape[1] != self.rank or not np.issubdtype(q.dtype, np.floating) \
                    or not np.isfinite(q).all():
                raise CodecError(f"lowrank state for '{name}' must be a finite float (columns x {self.rank}) "
                                 f"matrix, got shape {q.shape} dtype {q.dtype}")
            loaded[str(name)] = q.astype(np.float32)
        self._q = loaded
