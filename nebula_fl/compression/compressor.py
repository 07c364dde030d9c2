"""A codec chain for one stream (one cluster's uplink, or the server's downlink to one cluster).

Encoding adds the error-feedback residual when the chain is biased (topk, randk, lowrank, sign),
runs the transform and the quantizer, packs the blob, and keeps as the next residual exactly what
the receiver will not see: residual = (x + residual) - decode(blob). So over any number of rounds,
sum of decoded blobs + residual == sum of inputs (to float32 rounding). Decoding is a classmethod:
it needs the layout and the seed, never the encoder's state.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from nebula_fl.compression import container
from nebula_fl.compression.codec import EMPTY, Codec, Encoded, Plan
from nebula_fl.compression.errors import CodecError
from nebula_fl.compression.identity import Tensors
from nebula_fl.compression.layout import Layout
from nebula_fl.compression.none import NoneCodec
from nebula_fl.compression.spec import canonical, parse_spec

STATE_FORMAT = 1


def _check_seed(seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= int(seed) < 2**64:
        raise CodecError(f"seed must be an integer in [0, 2**64), got {seed!r}; pass the round's seed")
    return int(seed)


def _seed_tag(seed: int) -> str:
    return f"{zlib.crc32(seed.to_bytes(8, 'little')):08x}"


def _check_layout(layout: object) -> Layout:
    if not isinstance(layout, Layout):
        raise CodecError(f"layout must be a nebula_fl.compression.Layout, got {type(layout).__name__}; "
                         "build one with Layout.from_arrays(...)")
    return layout


def _finite(values: np.ndarray) -> bool:
    return bool(np.isfinite(values).all())


class _Chain:
    """The (transform, quantizer) pair a spec stands for, and their plans on one layout."""

    def __init__(self, stages: tuple[Codec, ...], layout: Layout) -> None:
        self.stages = stages
        self.spec = canonical(stages)
        self.transform = stages[0] if stages[0].role == "transform" else Tensors()
        self.quantizer = stages[-1] if stages[-1].role == "quantizer" else NoneCodec()
        self.error_feedback = any(stage.error_feedback for stage in stages)
        self.seeded = self.transform.seeded_decode or self.quantizer.seeded_decode
        n = layout.size
        self.t_plan = self._plan(self.transform, (n,), layout)
        self.q_plan = self._plan(self.quantizer, self.t_plan.values, layout)
        if self.q_plan.values:
            raise CodecError(f"quantizer '{self.quantizer.spec}' plans float values {self.q_plan.values}; a "
                             "quantizer must hand none on (a bug in that codec)")
        self.specs = (*self.t_plan.arrays, *self.q_plan.arrays)
        self.header = {"spec": self.spec, "n": n, "layout": layout.fingerprint}

    def _plan(self, stage: Codec, segments: tuple[int, ...], layout: Layout) -> Plan:
        try:
            plan = stage.plan(segments, layout=layout)
        except CodecError:
            raise
        except Exception as exc:
            raise CodecError(f"codec '{stage.spec}' failed to plan for this layout ({type(exc).__name__}: {exc})") from exc
        if not isinstance(plan, Plan):
            raise CodecError(f"codec '{stage.spec}'.plan returned {type(plan).__name__}, not a Plan")
        return plan

    def header_for(self, seed: int) -> dict[str, Any]:
        header = dict(self.header)
        if self.seeded:
            header["seed"] = _seed_tag(seed)
        header["arrays"] = [[[a.name, a.dtype, a.length] for a in plan.arrays] for plan in (self.t_plan, self.q_plan)]
        return header


def _check_encoded(stage: Codec, encoded: object, plan: Plan) -> Encoded:
    """What a stage returned must be exactly what it planned (a plugin bug must not reach the wire)."""
    where = f"codec '{stage.spec}'"
    if not isinstance(encoded, Encoded):
        raise CodecError(f"{where}.encode returned {type(encoded).__name__}, not an Encoded")
    if set(encoded.arrays) != {a.name for a in plan.arrays}:
        raise CodecError(f"{where}.encode returned arrays {sorted(encoded.arrays)}, its plan says "
                         f"{sorted(a.name for a in plan.arrays)}")
    for spec in plan.arrays:
        value = encoded.arrays[spec.name]
        if not isinstance(value, np.ndarray) or value.ndim != 1 or value.size != spec.length \
                or f"{value.dtype.kind}{value.dtype.itemsize}" != spec.dtype:
            raise CodecError(f"{where}.encode returned array '{spec.name}' as {getattr(value, 'dtype', '?')} "
                             f"{getattr(value, 'shape', '?')}, its plan says {spec.dtype} ({spec.length},)")
    want = sum(plan.values)
    if not isinstance(encoded.values, np.ndarray) or encoded.values.dtype != np.float32 \
            or encoded.values.shape != (want,):
        raise CodecError(f"{where}.encode handed on values {getattr(encoded.values, 'dtype', '?')} "
                         f"{getattr(encoded.values, 'shape', '?')}, its plan says float32 ({want},)")
    return encoded


def _check_decoded(stage: Codec, values: object, n: int) -> np.ndarray:
    if not isinstance(values, np.ndarray) or values.dtype != np.float32 or values.shape != (n,):
        raise CodecError(f"codec '{stage.spec}'.decode returned {getattr(values, 'dtype', '?')} "
                         f"{getattr(values, 'shape', '?')}, expected float32 ({n},)")
    if not stage.finite_output and not _finite(values):
        raise CodecError(f"blob decodes to NaN or Inf (in stage '{stage.spec}'); it is corrupt")
    return values


@dataclass(frozen=True)
class Selection:
    """One encode: `values`, what the receiver decodes before the transform places them (every coordinate, or
    random-k's picks; float32), and `blob`, the serialised form the plain uplink sends. `values` is None for a lossy
    chain that keeps no residual: it is not linear, and secure aggregation (which masks `values`) never uses one."""

    values: np.ndarray | None
    blob: bytes


class Compressor:
    """Encoder for one stream: ``Compressor("topk:0.05+int8", layout=layout).encode(x, seed=s) -> bytes``."""

    def __init__(self, spec: str, *, layout: Layout) -> None:
        self._setup(parse_spec(spec), _check_layout(layout))

    def _setup(self, stages: tuple[Codec, ...], layout: Layout) -> None:
        self.layout = layout
        self._chain = _Chain(stages, layout)
        self._residual: np.ndarray | None = (
            np.zeros(layout.size, dtype=np.float32) if self._chain.error_feedback else None)

    @classmethod
    def _from_stages(cls, stages: tuple[Codec, ...], layout: Layout) -> Compressor:
        comp = cls.__new__(cls)
        comp._setup(stages, layout)
        return comp

    # -- what it is --------------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        """The canonical spec (defaults left out: 'int8:256' -> 'int8')."""
        return self._chain.spec

    @property
    def stages(self) -> tuple[Codec, ...]:
        return self._chain.stages

    @property
    def error_feedback(self) -> bool:
        return self._chain.error_feedback

    @property
    def param(self) -> float | int | None:
        """The chain's primary knob: the first stage's ratio (topk/randk), rank (lowrank) or bits (int8/int4)."""
        return self._chain.stages[0].param

    @property
    def residual(self) -> np.ndarray | None:
        """A copy of the error-feedback residual (None when the chain keeps none)."""
        return None if self._residual is None else self._residual.copy()

    def encoded_size(self) -> int:
        """The exact length of every blob this compressor writes (it does not depend on the data)."""
        head = len(container.header_bytes(self._chain.header_for(0)))
        return head + container.data_size(head, self._chain.specs)

    def describe(self) -> dict[str, Any]:
        size = self.encoded_size()
        raw = 4 * self.layout.size
        info: dict[str, Any] = {
            "spec": self.spec,
            "param": self.param,
            "stages": [stage.spec for stage in self.stages],
            "error_feedback": self.error_feedback,
            "encoded_bytes": size,
            "raw_bytes": raw,
            "ratio": raw / size,
        }
        if self._residual is not None:
            info["residual_norm"] = float(np.linalg.norm(self._residual))
        return info

    def __repr__(self) -> str:
        return f"Compressor({self.spec!r}, layout=<{len(self.layout.names)} tensors, {self.layout.size} elements>)"

    # -- adaptive compression --------------------------------------------------------------------
    def with_param(self, value: float | int) -> Compressor:
        """A compressor for the same stream with the knob at `value`; the residual carries over (copied).

        topk/randk take a ratio in (0, 1], lowrank a rank >= 1, a quantizer-only int8/int4 chain
        the bit width 8 or 4; any other chain raises CodecError.
        """
        first = self._chain.stages[0].with_param(value)
        comp = Compressor._from_stages((first, *self._chain.stages[1:]), self.layout)
        if comp._residual is not None and self._residual is not None:
            comp._residual = self._residual.copy()
        return comp

    # -- encoding ------------------------------------------------------------------------------------
    def _check_input(self, x: object) -> np.ndarray:
        n = self.layout.size
        if not isinstance(x, np.ndarray) or x.shape != (n,):
            raise CodecError(f"encode needs a 1-D array of {n} elements (layout.size), got "
                             f"{getattr(x, 'shape', type(x).__name__)}; flatten the tensors with layout.flatten(...)")
        if not np.issubdtype(x.dtype, np.floating):
            raise CodecError(f"encode needs float values, got dtype {x.dtype}")
        return np.ascontiguousarray(x, dtype=np.float32)

    def encode(self, x: np.ndarray, *, seed: int) -> bytes:
        """The blob for x (1-D float32 of layout.size); updates the residual and the stages' state."""
        return self.select(x, seed=seed).blob

    def select(self, x: np.ndarray, *, seed: int) -> Selection:
        """`encode`, handing over the values the receiver will decode beside the blob (so secure aggregation masks
        them with no decode of it); updates the residual and the stages' state."""
        seed = _check_seed(seed)
        x = self._check_input(x)
        chain = self._chain
        t, q = chain.transform, chain.quantizer
        work = x if self._residual is None else np.add(x, self._residual)
        first = q if isinstance(t, Tensors) else t
        if (self._residual is not None or not first.checks_input) and not _finite(work):
            raise CodecError("encode input holds NaN or Inf" + (
                " (after adding the error-feedback residual)" if self._residual is not None else ""))
        saved = [stage.state_dict() for stage in chain.stages]
        try:
            with np.errstate(over="ignore", invalid="ignore"):
                t_out = _check_encoded(t, t.encode(work, segments=(self.layout.size,), layout=self.layout, seed=seed),
                                       chain.t_plan)
                q_out = _check_encoded(q, q.encode(t_out.values, segments=chain.t_plan.values, layout=self.layout,
                                                   seed=seed), chain.q_plan)
                sent = None
                if q.lossless:  # a copy only where the residual update below may work in place on these values
                    sent = t_out.values.copy() if self._residual is not None else t_out.values
                elif self._residual is not None:
                    sent = _check_decoded(q, q.decode(Encoded(EMPTY, q_out.arrays), segments=chain.t_plan.values,
                                                      layout=self.layout, seed=seed), sum(chain.t_plan.values))
                selection = Selection(values=sent, blob=container.pack(chain.header_for(seed), [
                    *((a, t_out.arrays[a.name]) for a in chain.t_plan.arrays),
                    *((a, q_out.arrays[a.name]) for a in chain.q_plan.arrays),
                ]))
                if self._residual is not None:
                    t.subtract_decoded(work, Encoded(sent, t_out.arrays), segments=(self.layout.size,),
                                       layout=self.layout, seed=seed)
                    if not _finite(work):  # never keep a residual that would poison every later round
                        raise CodecError("the error-feedback residual overflowed float32; the input is too large "
                                         "for this chain")
        except Exception as exc:
            for stage, state in zip(chain.stages, saved):
                stage.load_state_dict(state)
            if isinstance(exc, CodecError):
                raise
            raise CodecError(f"chain '{chain.spec}' failed to encode ({type(exc).__name__}: {exc})") from exc
        if self._residual is not None:
            self._residual = work
        return selection

    # -- decoding ------------------------------------------------------------------------------------
    @classmethod
    def decode(cls, blob: bytes | bytearray | memoryview, *, layout: Layout, seed: int,
               spec: str | None = None) -> np.ndarray:
        """The 1-D float32 vector a blob stands for, or CodecError (and nothing else) for any bad input.

        `spec`, when given, is the chain the receiver expects; a blob of any other chain is refused.
        """
        try:
            return cls._decode(blob, layout=layout, seed=seed, spec=spec)
        except CodecError:
            raise
        except Exception as exc:  # a corrupt blob must never surface as anything else
            raise CodecError(f"blob could not be decoded ({type(exc).__name__}: {str(exc)[:200]}); "
                             "it is corrupt or from an incompatible sender") from exc

    @classmethod
    def _decode(cls, blob: Any, *, layout: Layout, seed: int, spec: str | None) -> np.ndarray:
        layout = _check_layout(layout)
        seed = _check_seed(seed)
        view, header, start = container.read_header(blob)
        try:
            stages = parse_spec(header["spec"], rescan=False)
        except CodecError as exc:
            raise CodecError(f"blob header names an unusable chain: {exc}") from None
        chain = _Chain(stages, layout)
        expected = None if spec is None else canonical(parse_spec(spec))
        if expected is not None and chain.spec != expected:
            raise CodecError(f"blob was encoded with '{chain.spec}', the receiver expects '{expected}'")
        if header["n"] != layout.size or header["layout"] != layout.fingerprint:
            raise CodecError(f"blob is for a layout of {header['n']} elements (fingerprint {header['layout']}), "
                             f"this one has {layout.size} ({layout.fingerprint}); sender and receiver must build "
                             "the same Layout")
        if chain.seeded != ("seed" in header):
            raise CodecError("blob header's seed tag does not fit its chain; it is corrupt")
        if chain.seeded and header["seed"] != _seed_tag(seed):
            raise CodecError(f"blob was encoded with another seed than {seed}; decode with the round's seed")
        container.check_declared(header, (chain.t_plan.arrays, chain.q_plan.arrays))
        buffers = container.read_arrays(view, start, chain.specs)
        t_arrays = dict(zip((a.name for a in chain.t_plan.arrays), buffers))
        q_arrays = dict(zip((a.name for a in chain.q_plan.arrays), buffers[len(t_arrays):]))
        t, q = chain.transform, chain.quantizer
        with np.errstate(over="ignore", invalid="ignore"):
            values = _check_decoded(q, q.decode(Encoded(EMPTY, q_arrays), segments=chain.t_plan.values,
                                                layout=layout, seed=seed), sum(chain.t_plan.values))
            out = _check_decoded(t, t.decode(Encoded(values, t_arrays), segments=(layout.size,), layout=layout,
                                             seed=seed), layout.size)
        if not out.flags.writeable or np.may_share_memory(out, np.frombuffer(view, dtype=np.uint8)):
            out = out.copy()  # never hand out a view of the caller's blob
        return out

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """{'format', 'spec', 'layout', 'stages': {'0': ..., '1': ...}, ['residual']}: plain dicts of arrays/ints/str."""
        state: dict[str, Any] = {
            "format": STATE_FORMAT,
            "spec": self.spec,
            "layout": self.layout.fingerprint,
            "stages": {str(i): stage.state_dict() for i, stage in enumerate(self.stages)},
        }
        if self._residual is not None:
            state["residual"] = self._residual.copy()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("format") != STATE_FORMAT:
            raise CodecError(f"compressor state must be a dict from Compressor.state_dict() (format {STATE_FORMAT})")
        if state.get("spec") != self.spec:
            raise CodecError(f"compressor state is for '{state.get('spec')}', this compressor is '{self.spec}'; "
                             "build it with Compressor.from_state_dict(state, layout=...)")
        if state.get("layout") != self.layout.fingerprint:
            raise CodecError(f"compressor state is for layout {state.get('layout')}, this one is "
                             f"{self.layout.fingerprint}; use the layout it was saved with")
        stages = state.get("stages")
        if not isinstance(stages, Mapping) or set(stages) != {str(i) for i in range(len(self.stages))}:
            raise CodecError(f"compressor state 'stages' must have keys 0..{len(self.stages) - 1}")
        residual = None
        if self._residual is not None:
            residual = np.asarray(state.get("residual"))
            if residual.shape != (self.layout.size,) or not np.issubdtype(residual.dtype, np.floating) \
                    or not _finite(residual):
                raise CodecError(f"compressor state 'residual' must be finite floats of shape ({self.layout.size},)")
            residual = residual.astype(np.float32, copy=True)
        elif "residual" in state:
            raise CodecError(f"compressor state has a residual, but '{self.spec}' keeps none")
        saved = [stage.state_dict() for stage in self.stages]
        try:
            for i, stage in enumerate(self.stages):
                stage.load_state_dict(stages[str(i)])
        except Exception:
            for stage, old in zip(self.stages, saved):
                stage.load_state_dict(old)
            raise
        if residual is not None:
            self._residual = residual

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any], *, layout: Layout) -> Compressor:
        """A compressor rebuilt from its state (whatever param it had reached) that continues identically."""
        if not isinstance(state, Mapping) or not isinstance(state.get("spec"), str):
            raise CodecError("compressor state must be a dict from Compressor.state_dict()")
        comp = cls(state["spec"], layout=layout)
        comp.load_state_dict(state)
        return comp

