"""Fuzz every decoder and validator of untrusted input, and count the crashes.

A crash is any exception other than the one an entry point documents: CodecError for codec blobs,
NebulaError (ConfigError, CheckpointError, ...) for run configs and checkpoints, ValueError for
trainer frames, uplink arrays and layouts. A *violation* is an input accepted with a result that
breaks the entry point's promise (a decoded vector that is not finite float32 of the layout's size, a
config that does not round-trip, a layout whose size is not the product of its shapes). Inputs come
from Hypothesis under a fixed seed, so a run is reproducible; each target mixes random input with
valid input damaged in targeted ways (truncated, bytes flipped, lengths and JSON fields changed).

    .venv/bin/python -m tests.fuzz_wire            # 30,000 inputs, ~2 min on 2 cores
    .venv/bin/python -m tests.fuzz_wire --quick    # 1,500 inputs, ~10 s
    .venv/bin/python -m tests.fuzz_wire --only codec-blob,trainer-frame --seed 3

Prints a table and the first crashes, writes results.json (default benchmarks/results/fuzz/), and
exits 0 even when it found crashes: it is a report; tests/test_fuzz.py runs a short pass as the gate.
It lives beside the tests (it drives the trainer's wire protocol, the privacy gate, the secure-aggregation
stage and tests/secagg_adversary.py directly, as tests do); run it from the repository root.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import itertools
import json
import math
import os
import platform
import shutil
import struct
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, given, seed, settings
from hypothesis import strategies as st

from nebula_fl.clients.protocol import pack, unpack
from nebula_fl.comm.validation import check_arrays
from nebula_fl.components import load
from nebula_fl.compression import CodecError, Compressor, Layout, available_codecs, parse_spec
from nebula_fl.config import RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.plan import parse_run_config  # the CLI's --run-config parser
from nebula_fl.secagg.evidence import json_map
from nebula_fl.storage.run_folder import RunFolder

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "benchmarks" / "results" / "fuzz" / "results.json"
KEEP = 5  # crashing inputs kept per target in results.json
QUICK_DIVISOR = 20
REPR_LIMIT = 400

# -- shared generators -------------------------------------------------------------------------------

SPECIAL_INTS = [0, 1, -1, 7, 255, 256, 2**15, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**62 + 1,
                2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), 10**30, 10**400]
SPECIAL_FLOATS = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-300, 1e-12, 0.5, 1.0, 1.0000001, 1e6, 1e308,
                  1.7976931348623157e308, -1.0]
JSON_SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from(SPECIAL_INTS),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
)
WILD_JSON = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                         | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
NESTING = st.integers(1, 200_000).map(lambda depth: "[" * depth + "]" * depth)


def rng_bytes(draw: Callable, low: int, high: int) -> bytes:
    """`low`..`high` random bytes from a drawn seed: large payloads without filling Hypothesis's buffer."""
    size = draw(st.integers(low, high))
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1))).bytes(size)


def flip(draw: Callable, data: bytes, *, lo: int = 0, hi: int | None = None, most: int = 8) -> tuple[bytes, str]:
    """`data` with 1..`most` bytes in [lo, hi) XOR-ed with a non-zero value."""
    hi = len(data) if hi is None else min(hi, len(data))
    if hi <= lo:
        return data, "flip (nothing to flip)"
    out = bytearray(data)
    where = []
    for _ in range(draw(st.integers(1, most))):
        pos = draw(st.integers(lo, hi - 1))
        out[pos] ^= draw(st.integers(1, 255))
        where.append(pos)
    return bytes(out), f"flip at {where}"


def damage_bytes(draw: Callable, data: bytes) -> tuple[bytes, str]:
    """Generic damage: truncate, extend, flip, or overwrite a run of bytes."""
    kind = draw(st.sampled_from(["truncate", "extend", "flip", "overwrite"]))
    if kind == "truncate" and data:
        cut = draw(st.integers(0, len(data) - 1))
        return data[:cut], f"truncated to {cut}"
    if kind == "extend":
        return data + draw(st.binary(min_size=1, max_size=16)), "extended"
    if kind == "overwrite" and data:
        start = draw(st.integers(0, len(data) - 1))
        junk = rng_bytes(draw, 1, 64)
        return data[:start] + junk + data[start + len(junk):], f"overwritten at {start}"
    return flip(draw, data)


def short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception as err:  # e.g. an int past the str-digits limit
        text = f"<unrepresentable {type(value).__name__}: {err}>"
    return text if len(text) <= REPR_LIMIT else text[: REPR_LIMIT - 3] + "..."


@dataclass
class Case:
    """One generated input: what to call the entry point with, and how it was made (for the report)."""

    how: str
    args: dict[str, Any]

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={_show_arg(v)}" for k, v in self.args.items() if not k.startswith("_"))
        return f"[{self.how}] {shown}"


def _show_arg(value: Any) -> str:
    """Bytes as their length and first bytes in hex; a memoryview by content (its repr holds an address)."""
    if isinstance(value, bytes | bytearray | memoryview) and (len(value) > 48 or isinstance(value, memoryview)):
        return f"<{type(value).__name__} of {len(value)} bytes {bytes(value[:48]).hex()}...>"
    return short_repr(value)


# -- codec blobs -------------------------------------------------------------------------------------

LAYOUT = Layout.from_shapes({"a.lora_A": (4, 64), "a.lora_B": (64, 4), "head.weight": (3, 64), "head.bias": (3,)})
OTHER_LAYOUTS = {
    "transposed": Layout.from_shapes({"a.lora_A": (64, 4), "a.lora_B": (4, 64), "head.weight": (3, 64),
                                      "head.bias": (3,)}),
    "renamed": Layout.from_shapes({"x.lora_A": (4, 64), "a.lora_B": (64, 4), "head.weight": (3, 64), "head.bias": (3,)}),
    "smaller": Layout.from_shapes({"a.lora_A": (4, 64)}),
    "one": Layout.from_shapes({"w": (1,)}),
}
ROUND_SEED = 11
# (dtype, value) written over aligned buffer entries: float32 / float16 / bfloat16 NaN and Inf, overflowing
# scales, subnormals, out-of-range packed int4 nibbles.
SPECIAL_DATA = [("<f4", np.nan), ("<f4", np.inf), ("<f4", -np.inf), ("<f4", 3e38), ("<f4", -0.0), ("<f4", 1e-45),
                ("<f4", -1.0), ("<f2", np.inf), ("<f2", np.nan), ("<f2", 65504.0), ("<u2", 0x7F80), ("<u2", 0xFFC1),
                ("<u2", 0xFFFF), ("u1", 0xFF), ("u1", 0x10), ("u1", 0x80), ("u1", 0)]
STAGE_ARGS = {"topk": ("0.05", "0.4"), "randk": ("0.1",), "lowrank": ("2",), "int8": (None, "64"), "int4": (None,)}


@cache
def codec_chains() -> tuple[str, ...]:
    """Every chain the registry can build: each stage alone, and every transform followed by a quantizer."""
    transforms, quantizers = [], []
    for name in available_codecs():
        for arg in STAGE_ARGS.get(name, (None,)):
            stage = name if arg is None else f"{name}:{arg}"
            try:
                (codec,) = parse_spec(stage)
            except CodecError:
                continue  # a plugin whose argument cannot be guessed
            (transforms if codec.role == "transform" else quantizers).append(stage)
    return tuple(transforms + quantizers + [f"{t}+{q}" for t in transforms for q in quantizers])


@cache
def valid_blobs() -> dict[str, list[bytes]]:
    """Per chain, blobs of three inputs (normal, sparse with ties, all zero) encoded in sequence (error feedback on)."""
    rng = np.random.default_rng(0)
    normal = rng.standard_normal(LAYOUT.size).astype(np.float32)
    sparse = np.zeros(LAYOUT.size, np.float32)
    sparse[::37] = 1.0
    out = {}
    for chain in codec_chains():
        comp = Compressor(chain, layout=LAYOUT)
        out[chain] = [comp.encode(x, seed=ROUND_SEED) for x in (normal, sparse, np.zeros(LAYOUT.size, np.float32))]
    return out


def split_blob(blob: bytes) -> tuple[dict[str, Any], bytes]:
    length = struct.unpack_from("<I", blob, 4)[0]
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def rebuild_blob(header_text: bytes, data: bytes) -> bytes:
    header_text += b" " * (-(8 + len(header_text)) % 8)
    return b"NBC\x01" + struct.pack("<I", len(header_text)) + header_text + data


DTYPE_CODES = ["f4", "<f4", ">f4", "f8", "f2", "u1", "i1", "u2", "i4", "u4", "i8", "u8", "b1", "O", "V8", "S4", "U1", "c8",
               "bogus", "", "f4\x00"]


def mutate_header(draw: Callable, header: dict[str, Any]) -> tuple[Any, str]:
    """A header with one field set to a wild value, removed, or one array entry changed."""
    header = json.loads(json.dumps(header))
    kind = draw(st.sampled_from(["field", "remove", "entry", "entry", "entry"]))
    if kind == "field":
        key = draw(st.sampled_from([*header, "extra"]))
        header[key] = draw(st.one_of(WILD_JSON, st.sampled_from([header.get("n", 0) + 1, -1, 2**60, "int8", "topk:1e308",
                                                                  "a" * 300, "deadbeef"])))
        return header, f"header {key}={short_repr(header[key])[:60]}"
    if kind == "remove":
        key = draw(st.sampled_from(sorted(header)))
        del header[key]
        return header, f"header without {key}"
    stages = header.get("arrays") or [[]]
    stage = draw(st.integers(0, len(stages) - 1))
    if not stages[stage]:
        stages[stage].append(["v", "f4", 1])
        return header, f"entry added to stage {stage}"
    i = draw(st.integers(0, len(stages[stage]) - 1))
    entry = list(stages[stage][i])
    part = draw(st.integers(0, 3))
    if part == 0:
        entry[0] = draw(st.one_of(st.text(max_size=4), WILD_JSON))
    elif part == 1:
        entry[1] = draw(st.one_of(st.sampled_from(DTYPE_CODES), WILD_JSON))
    elif part == 2:
        length = entry[2] if isinstance(entry[2], int) else 0
        entry[2] = draw(st.one_of(st.integers(-3, 3).map(lambda d: length + d), st.sampled_from(SPECIAL_INTS),
                                  st.sampled_from([1.5, float(length), True, str(length), None])))
    else:
        entry = entry[: draw(st.integers(0, 2))] if draw(st.booleans()) else [*entry, draw(JSON_SCALARS)]
    stages[stage][i] = entry
    return header, f"stage {stage} entry {i} -> {short_repr(entry)[:80]}"


@st.composite
def codec_cases(draw: Callable) -> Case:
    chain = draw(st.sampled_from(codec_chains()))
    blob = draw(st.sampled_from(valid_blobs()[chain]))
    layout, layout_name, round_seed = LAYOUT, "main", ROUND_SEED
    kind = draw(st.sampled_from(["random", "magic+random", "truncate", "extend", "flip", "flip-header", "header-length",
                                 "header-field", "header-field", "header-raw", "splice", "data-random", "data-special",
                                 "seed", "layout", "type", "valid"]))
    how = kind
    if kind == "random":
        blob = draw(st.binary(max_size=64)) if draw(st.booleans()) else rng_bytes(draw, 0, 4096)
    elif kind == "magic+random":
        blob = b"NBC\x01" + rng_bytes(draw, 0, 4096)
    elif kind == "truncate":
        cut = draw(st.integers(0, len(blob) - 1))
        blob, how = blob[:cut], f"truncated to {cut} of {len(blob)}"
    elif kind == "extend":
        blob += draw(st.binary(min_size=1, max_size=32))
    elif kind == "flip":
        blob, how = flip(draw, blob)
    elif kind == "flip-header":
        blob, how = flip(draw, blob, hi=8 + struct.unpack_from("<I", blob, 4)[0], most=3)
    elif kind == "header-length":
        old = struct.unpack_from("<I", blob, 4)[0]
        new = draw(st.one_of(st.integers(-16, 16).map(lambda d: max(0, old + d)), st.sampled_from([0, 2**32 - 1, 16384,
                                                                                                     len(blob)]),
                             st.integers(0, 2**32 - 1)))
        blob, how = blob[:4] + struct.pack("<I", new % 2**32) + blob[8:], f"header length {old} -> {new}"
    elif kind == "header-field":
        header, data = split_blob(blob)
        mutated, how = mutate_header(draw, header)
        blob = rebuild_blob(json.dumps(mutated, separators=(",", ":")).encode(), data)
    elif kind == "header-raw":
        _, data = split_blob(blob)
        raw = draw(st.one_of(WILD_JSON.map(lambda v: json.dumps(v).encode()), NESTING.map(str.encode),
                             st.binary(max_size=64), st.just(b'{"spec":"\xff\xfe"}'),
                             st.integers(5000, 20000).map(lambda n: b'{"n":' + b"9" * n + b"}")))
        blob, how = rebuild_blob(raw, data), f"header text {short_repr(raw)[:60]}"
    elif kind == "splice":
        other = draw(st.sampled_from(codec_chains()))
        header_of, data_of = (blob, draw(st.sampled_from(valid_blobs()[other])))
        length = struct.unpack_from("<I", header_of, 4)[0]
        blob, how = header_of[:8 + length] + split_blob(data_of)[1], f"header of {chain}, data of {other}"
    elif kind == "data-random":
        _, data = split_blob(blob)
        blob = blob[: len(blob) - len(data)] + np.random.default_rng(draw(st.integers(0, 2**32 - 1))).bytes(len(data))
    elif kind == "data-special":
        _, data = split_blob(blob)
        start = len(blob) - len(data)
        out = bytearray(blob)
        for _ in range(draw(st.integers(1, 6))):
            code, value = draw(st.sampled_from(SPECIAL_DATA))
            raw = np.asarray(value, dtype=code).tobytes()
            if len(data) >= len(raw):
                pos = start + draw(st.integers(0, (len(data) - len(raw)) // len(raw))) * len(raw)
                out[pos:pos + len(raw)] = raw
        blob, how = bytes(out), "special values in the data"
    elif kind == "seed":
        round_seed = draw(st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([-1, 2**64, True, 1.5, "11", None,
                                                                                np.int64(11), np.uint64(2**63)])))
    elif kind == "layout":
        layout_name = draw(st.sampled_from(sorted(OTHER_LAYOUTS)))
        layout = OTHER_LAYOUTS[layout_name]
    elif kind == "type":
        blob = draw(st.sampled_from(["text", None, 12, [1, 2], np.zeros(3), bytearray(blob), memoryview(blob),
                                     np.frombuffer(blob, np.uint8)]))
        how = f"blob of type {type(blob).__name__}"
    return Case(f"{chain}: {how}", {"blob": blob, "layout": layout_name, "seed": round_seed,
                                     "_layout": layout})


def decode_blob(case: Case) -> np.ndarray:
    return Compressor.decode(case.args["blob"], layout=case.args["_layout"], seed=case.args["seed"])


def check_decoded(case: Case, y: Any) -> str | None:
    layout = case.args["_layout"]
    if not isinstance(y, np.ndarray) or y.dtype != np.float32 or y.shape != (layout.size,):
        return f"decoded to {type(y).__name__} {getattr(y, 'dtype', '')} {getattr(y, 'shape', '')}, not float32 " \
               f"({layout.size},)"
    if not np.isfinite(y).all():
        return "decoded vector holds NaN or Inf"
    return None


# -- run configs -------------------------------------------------------------------------------------

KEYS = RunConfig.known_keys()
SPECIAL_STRINGS = ["auto", "", " ", "none", "same", "iid", "dirichlet:0.5", "dirichlet:nan", "dirichlet:inf",
                   "dirichlet:-1", "dirichlet:5e-324", "dirichlet:1e999", "dirichlet:", "topk:0.05+int8", "topk:nan",
                   "topk:5e-324", "lowrank:1025", "lowrank:1024", "int8:7", "int4+topk:0.1", "constant", "cosine",
                   "fedavg", "adam", "sample", "client", "prv", "20mbit:100ms", "20mbit:100ms,1gbit:1ms:1ms", "0mbit:1ms",
                   "1e999gbit:1ms", "20mbit:1e999s", ",", "query,,value", " , ", "a\x00b", "a\nb", "a\rb", "\udcff", "\u2028",
                   "~nosuchuser/x", "~", "~/x", "-rf", "--help", "a" * 300, "/" + "a/" * 3000, "x" * 5000, "minilm",
                   "bbcnews", "/dev/null", ".", "..", "nan", "inf", "1e999", "true"]


@cache
def plausible(key: str) -> st.SearchStrategy:
    """Values of the key's own type near its default, to get past the type checks to the bounds."""
    default = RunConfig().to_flat()[key]
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.one_of(st.integers(-10, 10**6), st.sampled_from(SPECIAL_INTS))
    if isinstance(default, float):
        return st.one_of(st.floats(-1e3, 1e7), st.sampled_from(SPECIAL_FLOATS))
    return st.one_of(st.sampled_from(SPECIAL_STRINGS), st.text(max_size=20))


WILD_SCALAR = st.one_of(
    st.integers(-(2**70), 2**70), st.sampled_from(SPECIAL_INTS), st.floats(), st.sampled_from(SPECIAL_FLOATS),
    st.booleans(), st.text(max_size=40), st.sampled_from(SPECIAL_STRINGS), st.none(), st.binary(max_size=8),
    st.lists(st.integers(), max_size=2),
)


def near_miss(key: str) -> st.SearchStrategy:
    return st.sampled_from([key.upper(), key.replace("-", "_"), key[:-1], key + "s", "privacy." + key, f"{key}.x", ""])


@st.composite
def flat_cases(draw: Callable) -> Case:
    flat: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True)):
        flat[key] = draw(st.one_of(plausible(key), WILD_SCALAR))
    if draw(st.integers(0, 9)) == 0:
        key = draw(st.one_of(st.text(max_size=30), st.sampled_from(KEYS).flatmap(near_miss)))
        flat[key] = draw(WILD_SCALAR)
    return Case("from_flat", {"flat": flat})


def from_flat(case: Case) -> RunConfig:
    return load(case.args["flat"])  # values, then the plug-ins they name (components.resolve)


def check_config(case: Case, cfg: Any) -> str | None:
    if not isinstance(cfg, RunConfig):
        return f"returned {type(cfg).__name__}"
    flat = cfg.to_flat()
    bad = [k for k, v in flat.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        return f"accepted non-finite {bad}"
    if RunConfig.from_flat(flat) != cfg:
        return "the accepted config does not round-trip through to_flat"
    return None


TOML_VALUES = ["nan", "+nan", "-nan", "inf", "+inf", "-inf", "1e999", "-1e999", "1e-400", "0x10", "0o17", "0b101",
               "1_000", "9" * 30, "9" * 5000, "1.5", "-0", "-0.0", "true", "false", "True", '"auto"', '""',
               '"a\\u0000b"', '"a\\nb"', '"\\ud800"', '"\\uDFFF"', "1979-05-27", "07:32:00", "1979-05-27T07:32:00Z",
               "[1, 2]", "[]", "{a=1}", "{}", "'literal'", '"unterminated', "'x", '"x"y', "==", "=", "", '"~nouser"']


@st.composite
def config_text_cases(draw: Callable) -> Case:
    if draw(st.integers(0, 5)) == 0:
        return Case("random text", {"text": draw(st.text(max_size=120))})
    parts = []
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS).flatmap(near_miss),
                             st.text(alphabet="abcdefghijklmnopqrstuvwxyz.-_=\"' ", max_size=12)))
        value = draw(st.one_of(st.sampled_from(TOML_VALUES), st.integers().map(str), st.floats().map(repr),
                               st.text(max_size=20).map(json.dumps), st.sampled_from(SPECIAL_STRINGS).map(json.dumps),
                               st.text(max_size=10)))
        parts.append(f"{key}={value}")
    sep = draw(st.sampled_from([" ", "  ", "\t", "\n", ""]))
    return Case("run-config text", {"text": sep.join(parts)})


def config_text(case: Case) -> RunConfig:
    return RunConfig().replace(parse_run_config(case.args["text"]))


# -- trainer frames ----------------------------------------------------------------------------------


@cache
def valid_frames() -> list[bytes]:
    rng = np.random.default_rng(1)
    return [
        pack({"op": "hello"}),
        pack({"op": "train", "round": 3, "config": {"lr": 0.005, "local-steps": 10}},
             {"update": rng.standard_normal((5, 7)).astype(np.float32), "ids": np.arange(4, dtype=np.int64),
              "half": np.ones(3, np.float16), "flags": np.array([True, False])}),
        pack({"ok": True, "num_examples": 100}, {"blob": rng.integers(0, 255, 300, dtype=np.uint8)}),
    ]


SAFETENSORS_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64", "BOOL",
                      "F8_E4M3", "F8_E5M2", "C64", "F4", "XX", ""]


def mutate_safetensors(draw: Callable, body: bytes) -> tuple[bytes, str]:
    (n,) = struct.unpack_from("<Q", body)
    header = json.loads(body[8:8 + n])
    names = [k for k in header if k != "__metadata__"]
    kind = draw(st.sampled_from(["length", "dtype", "shape", "offsets", "metadata", "remove", "raw"]))
    if kind == "length":
        new = draw(st.one_of(st.integers(-8, 8).map(lambda d: max(0, n + d)), st.sampled_from([0, 2**64 - 1, 2**63,
                                                                                             100_000_001])))
        return struct.pack("<Q", new) + body[8:], f"safetensors header length {n} -> {new}"
    if kind == "raw":
        text = draw(st.one_of(WILD_JSON.map(json.dumps), NESTING))
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw + body[8 + n:], f"safetensors header {short_repr(text)[:60]}"
    if names and kind in ("dtype", "shape", "offsets", "remove"):
        name = draw(st.sampled_from(names))
        if kind == "dtype":
            header[name]["dtype"] = draw(st.one_of(st.sampled_from(SAFETENSORS_DTYPES), WILD_JSON))
        elif kind == "shape":
            header[name]["shape"] = draw(st.one_of(st.lists(st.one_of(st.integers(-2, 10), st.sampled_from(SPECIAL_INTS)),
                                                            max_size=4), WILD_JSON))
        elif kind == "offsets":
            header[name]["data_offsets"] = draw(st.one_of(st.lists(st.one_of(st.integers(-2, 400),
                                                                             st.sampled_from(SPECIAL_INTS)),
                                                                   max_size=3), WILD_JSON))
        else:
            del header[name][draw(st.sampled_from(sorted(header[name])))]
    else:
        header["__metadata__"] = draw(WILD_JSON)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body[8 + n:], f"safetensors {kind}: {short_repr(header)[:100]}"


@st.composite
def frame_cases(draw: Callable) -> Case:
    frame = draw(st.sampled_from(valid_frames()))
    (n,) = struct.unpack_from("<I", frame)
    head, body = frame[4:4 + n], frame[4 + n:]
    kind = draw(st.sampled_from(["random", "damage", "length", "header", "header", "body", "body", "body-damage"]))
    how = kind
    if kind == "random":
        frame = draw(st.binary(max_size=64)) if draw(st.booleans()) else rng_bytes(draw, 0, 4096)
    elif kind == "damage":
        frame, how = damage_bytes(draw, frame)
    elif kind == "length":
        new = draw(st.one_of(st.integers(-8, 8).map(lambda d: max(0, n + d)), st.sampled_from([0, 2**32 - 1, len(frame)])))
        frame, how = struct.pack("<I", new) + frame[4:], f"length {n} -> {new}"
    elif kind == "header":
        text = draw(st.one_of(WILD_JSON.map(lambda v: json.dumps(v).encode()), NESTING.map(str.encode),
                              st.binary(max_size=32), st.integers(4301, 9000).map(lambda d: b"9" * d),
                              st.just(b'{"op": NaN}'), st.just(b'{"a": 1, "a": 2}')))
        frame, how = struct.pack("<I", len(text)) + text + body, f"header {short_repr(text)[:60]}"
    elif kind == "body" and body:
        body, how = mutate_safetensors(draw, body)
        frame = struct.pack("<I", n) + head + body
    elif kind == "body-damage" and body:
        body, how = damage_bytes(draw, body)
        frame = struct.pack("<I", n) + head + body
    return Case(f"frame: {how}", {"frame": frame})


def unpack_frame(case: Case) -> Any:
    return unpack(case.args["frame"])


def check_unpacked(case: Case, result: Any) -> str | None:
    header, arrays = result
    if not isinstance(header, dict) or not isinstance(arrays, dict):
        return f"unpacked to {type(header).__name__}, {type(arrays).__name__}"
    if not all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in arrays.items()):
        return "arrays are not all str -> ndarray"
    return None


# -- checkpoints -------------------------------------------------------------------------------------

POINTERS = [b"", b"round-00003", b"round-00002", b"round-99999", b"..", b".", b"/", b"/etc/passwd",
            b"../checkpoint/round-00003", b"round-00003\x00", b"round-00003\njunk", b"r" * 5000, b"\xff\xfe",
            b"round-00003 sha256=" + b"0" * 64, b"round-00003 sha256=", b"round-3", b"round--0001", b"round-00003/.."]


def checkpoint_template(root: Path) -> Path:
    """A run folder with the checkpoints of rounds 2 and 3, written by save_checkpoint, to damage copies of."""
    folder = root / "template"
    if not folder.exists():
        rng = np.random.default_rng(2)
        run = RunFolder(folder)
        for rnd in (2, 3):
            adapter = {"a.lora_A": rng.standard_normal((4, 8)).astype(np.float32),
                       "head.bias": np.zeros(3, np.float32)}
            state = {"strategy": {"round": rnd, "views": {"0": rng.standard_normal(5).astype(np.float32)},
                                  "rng": {"state": 12345, "inc": 7}, "names": ["a", "b"]},
                     "optimizer": {"m": {"a": np.ones(4, np.float64)}, "t": rnd, "lr": 0.7}, "ledgers": []}
            run.save_checkpoint(round=rnd, adapter=adapter, state=state)
    return folder


@st.composite
def checkpoint_cases(draw: Callable, root: Path) -> Case:
    template = checkpoint_template(root)
    files = sorted(str(p.relative_to(template)) for p in (template / "checkpoint").rglob("*"))
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(files))
        kind = draw(st.sampled_from(["truncate", "flip", "random", "json", "json", "delete", "dir", "empty", "pointer",
                                     "dangling-link"]))
        if kind == "truncate":
            ops.append((target, kind, draw(st.floats(0, 1))))
        elif kind == "flip":
            ops.append((target, kind, draw(st.lists(st.tuples(st.integers(0, 2**31), st.integers(1, 255)),
                                                    min_size=1, max_size=6))))
        elif kind == "random":
            ops.append((target, kind, rng_bytes(draw, 0, 512)))
        elif kind == "json":
            ops.append((target, kind, json.dumps(draw(WILD_JSON)).encode()))
        elif kind == "pointer":
            ops.append(("checkpoint/latest", kind, draw(st.sampled_from(POINTERS))))
        else:
            ops.append((target, kind, None))
    return Case("damaged checkpoint", {"ops": ops, "_root": root})


def apply_damage(folder: Path, ops: list[tuple[str, str, Any]]) -> None:
    for rel, kind, arg in ops:
        try:
            _damage(folder / rel, kind, arg, folder)
        except OSError:
            pass  # an earlier op removed or replaced its parent: nothing left to damage there


def _damage(path: Path, kind: str, arg: Any, folder: Path) -> None:
    """One damage op on one path of a copied run folder."""
    if kind in ("delete", "dir", "dangling-link"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        if kind == "dir":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "dangling-link":
            path.symlink_to(folder / "no-such-file")
        return
    if path.is_dir() or path.is_symlink():
        return  # only files are damaged in place
    data = path.read_bytes() if path.exists() else b""
    if kind == "truncate":
        data = data[: int(len(data) * arg)]
    elif kind == "flip":
        out = bytearray(data)
        for pos, xor in arg:
            if out:
                out[pos % len(out)] ^= xor
        data = bytes(out)
    elif kind == "empty":
        data = b""
    else:  # random, json, pointer: the new content
        data = arg
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def load_damaged(case: Case) -> Any:
    root: Path = case.args["_root"]
    work = root / "work"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(checkpoint_template(root), work, symlinks=True)
    try:
        apply_damage(work, case.args["ops"])
        case.args["_left"] = sorted(p.name for p in (work / "checkpoint").glob("round-*") if p.is_dir())
        return RunFolder(work).load_checkpoint()
    finally:
        shutil.rmtree(work, ignore_errors=True)


@cache
def pristine_checkpoint(root: Path) -> Any:
    return RunFolder(checkpoint_template(root)).load_checkpoint()


def same(a: Any, b: Any) -> bool:
    """Deep equality of loaded checkpoints (arrays compared by dtype, shape and bytes)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check_loaded(case: Case, result: Any) -> str | None:
    """Damage is reported, or it missed what is loaded: never a checkpoint that differs from what was saved."""
    if result is None:
        left = case.args.get("_left")
        return f"reads as having no checkpoint, with {left} still there" if left else None
    pristine = pristine_checkpoint(case.args["_root"])
    if not (isinstance(result, tuple) and len(result) == 3):
        return f"loaded {short_repr(result)[:80]}"
    if result[0] == pristine[0] and same(result, pristine):
        return None
    if result[0] == 2:  # the previous checkpoint, as saved, is a fair answer too if the loader rewinds
        return None if isinstance(result[1], dict) else "loaded a malformed round-2 checkpoint"
    return f"loaded round {result[0]} with content that differs from what was saved"


# -- the server's uplink: check_arrays and Layout.from_json --------------------------------------------

EXPECTED = dict(zip(LAYOUT.names, LAYOUT.shapes))
ARRAY_DTYPES = ["float16", "float32", "float64", "longdouble", "complex64", "complex128", "int8", "int64", "uint8",
                "uint64", "bool", "<U3", "S2", "V4", "datetime64[s]", "timedelta64[s]", "object", ">f4", ">f8"]


def make_array(dtype: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """A finite array of `dtype` (zeros for strings, bytes, void, dates; None for object)."""
    numeric = np.issubdtype(np.dtype(dtype), np.number) or dtype == "bool"
    if dtype == "object":
        return np.full(shape, None, dtype=object)
    if not numeric:
        return np.zeros(shape, dtype=dtype)
    return (np.random.default_rng(seed).standard_normal(shape) * 10).astype(dtype)


@st.composite
def uplink_cases(draw: Callable) -> Case:
    """The valid update (float32, the expected keys and shapes, finite), then 0..3 changes to it."""
    arrays = {name: make_array("float32", shape, i) for i, (name, shape) in enumerate(EXPECTED.items())}
    changes = []
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2, 3]))):
        name = draw(st.sampled_from(sorted(EXPECTED)))
        kind = draw(st.sampled_from(["drop", "extra", "shape", "dtype", "dtype", "value", "value"]))
        if kind == "drop":
            arrays.pop(name, None)
        elif kind == "extra":
            name = draw(st.one_of(st.text(max_size=12), st.sampled_from([name + " ", name.upper(), ""])))
            arrays[name] = make_array("float32", (2,), 0)
        elif kind == "shape":
            shape = EXPECTED[name]
            wanted = draw(st.sampled_from([shape[::-1], (), (0,), (*shape, 1), tuple(d + 1 for d in shape),
                                           (1, *shape), (0, *shape)]))
            arrays[name] = make_array("float32", wanted, 1)
        elif kind == "dtype":
            dtype = draw(st.sampled_from(ARRAY_DTYPES))
            arrays[name] = make_array(dtype, EXPECTED[name], 2)
        elif name in arrays and arrays[name].size and np.issubdtype(arrays[name].dtype, np.inexact):
            special = draw(st.sampled_from([math.nan, math.inf, -math.inf, 3e38, 1e300, -0.0, 5e-324]))
            with np.errstate(all="ignore"):
                arrays[name].reshape(-1)[draw(st.integers(0, arrays[name].size - 1))] = special
        changes.append(f"{kind} {name!r}")
    return Case(f"uplink arrays: {', '.join(changes) or 'valid'}",
                {"arrays": {k: f"{v.dtype}{v.shape}" for k, v in arrays.items()}, "_arrays": arrays})


def check_uplink(case: Case) -> None:
    check_arrays(expected=EXPECTED, arrays=case.args["_arrays"], what="update")


def check_uplink_result(case: Case, _: Any) -> str | None:
    arrays = case.args["_arrays"]
    if set(arrays) != set(EXPECTED):
        return "accepted other keys"
    for name, shape in EXPECTED.items():
        value = arrays[name]
        if value.shape != shape or not np.issubdtype(value.dtype, np.floating) or not np.isfinite(value).all():
            return f"accepted '{name}' {value.dtype}{value.shape}"
    return None


DIMS = st.one_of(st.integers(0, 70), st.sampled_from(SPECIAL_INTS), st.integers(-(2**70), 2**70),
                 st.sampled_from([1.5, 2.0, True, "4", None, [4]]))


@st.composite
def layout_json_cases(draw: Callable) -> Case:
    kind = draw(st.sampled_from(["valid", "structured", "structured", "structured", "json", "raw", "deep", "digits",
                                 "wrap"]))
    if kind == "valid":
        shapes = draw(st.dictionaries(st.text(min_size=1, max_size=6), st.lists(st.integers(0, 64), max_size=3),
                                      min_size=1, max_size=4))
        try:
            text: str | bytes = Layout.from_shapes(shapes).to_json()
        except ValueError:
            text = LAYOUT.to_json()
    elif kind == "structured":
        tensors = draw(st.lists(st.lists(st.one_of(st.text(max_size=6), WILD_JSON, st.lists(DIMS, max_size=4)),
                                         min_size=0, max_size=3)
                                | st.tuples(st.one_of(st.text(max_size=6), st.sampled_from(["a", "a", ""])),
                                            st.lists(DIMS, max_size=5)).map(list), max_size=5))
        text = json.dumps({"tensors": tensors} if draw(st.integers(0, 7)) else {"tensors": tensors, "x": 1})
    elif kind == "json":
        text = json.dumps(draw(WILD_JSON))
    elif kind == "raw":
        text = draw(st.one_of(st.text(max_size=60), st.binary(max_size=60)))
    elif kind == "deep":
        text = '{"tensors": ' + draw(NESTING) + "}"
    elif kind == "digits":
        text = '{"tensors": [["a", [' + "9" * draw(st.integers(18, 6000)) + "]]]}"
    else:  # dims whose product is 2**64 + 2**k: in int64 it wraps to a small, plausible size
        e = draw(st.integers(33, 63))
        dims = [2**e + 1, 2 ** (64 - e)] if draw(st.booleans()) else [2 ** (64 - e), 2**e + 1]
        text = json.dumps({"tensors": [["w", [3, 4]], ["a", dims]]})
    return Case(f"layout json ({kind})", {"text": text})


def layout_from_json(case: Case) -> Layout:
    return Layout.from_json(case.args["text"])


def check_layout(case: Case, layout: Any) -> str | None:
    if not isinstance(layout, Layout):
        return f"returned {type(layout).__name__}"
    exact = sum(math.prod(shape) for shape in layout.shapes)
    if layout.size != exact or not 1 <= exact <= 2**32 - 1:
        return f"size {layout.size}, but its shapes hold {exact} elements"
    if Layout.from_json(layout.to_json()) != layout:
        return "does not round-trip through to_json"
    return None


# -- the server's privacy request, as the cluster's gate reads it ------------------------------------

POLICY_FLOOR, POLICY_BUDGET, POLICY_DELTA = 1.0, 8.0, 1e-5
PRIVACY_KEYS = [k for k in KEYS if k.startswith("privacy.")] + ["batch-size", "local-steps", "num-server-rounds"]


class Refused(Exception):
    """The gate's refusal, raised here so it counts as the documented outcome of bad input."""


@cache
def privacy_gate(workdir: str):
    from nebula_fl.clients.privacy_gate import PrivacyGate
    from nebula_fl.privacy.cluster_ledger import ClusterLedger
    from nebula_fl.privacy.policy import PrivacyPolicy

    policy = PrivacyPolicy(mode="sample", min_noise_multiplier=POLICY_FLOOR, max_epsilon=POLICY_BUDGET,
                           delta=POLICY_DELTA, accountant="rdp")
    return PrivacyGate(policy=policy, ledger=ClusterLedger(path=Path(workdir) / "ledger.jsonl", accountant="rdp"),
                       num_examples=1000)


@st.composite
def privacy_request_cases(draw: Callable, workdir: Path) -> Case:
    config: dict[str, Any] = {"privacy.mode": draw(st.sampled_from(["sample", "client", "off", "", "SAMPLE"]))}
    if draw(st.booleans()):  # a well-formed request near the policy, so that the admitted path is tried too
        config = {"privacy.mode": "sample", "privacy.noise-multiplier": draw(st.floats(0.5, 3.0)),
                  "privacy.max-epsilon": draw(st.sampled_from(["auto", 4.0, 8.0, 8.0001, 50.0])),
                  "privacy.delta": draw(st.sampled_from(["auto", 1e-6, 1e-5, 1.1e-5]))}
    for key in draw(st.lists(st.sampled_from(PRIVACY_KEYS), max_size=3, unique=True)):
        config[key] = draw(st.one_of(plausible(key), WILD_SCALAR))
    for key in ("privacy-sigma", "privacy-noise-shares"):
        if draw(st.booleans()):
            config[key] = draw(WILD_SCALAR)
    return Case("round config", {"config": config, "_workdir": str(workdir)})


def admit_request(case: Case) -> Any:
    admission = privacy_gate(case.args["_workdir"]).admit(case.args["config"], world=1)
    if not admission.allowed:
        raise Refused(admission.reason)
    return admission


def check_admission(case: Case, admission: Any) -> str | None:
    """Whatever the server asks, nothing weaker than the policy is admitted."""
    if admission.mode != "sample":
        return f"admitted mode {admission.mode!r} under a 'sample' policy"
    sigma = admission.noise_multiplier
    if not (isinstance(sigma, float) and math.isfinite(sigma) and sigma >= POLICY_FLOOR * (1 - 1e-9)):
        return f"admitted noise multiplier {sigma!r} below the floor {POLICY_FLOOR}"
    if admission.budget is None or admission.budget > POLICY_BUDGET or admission.delta != POLICY_DELTA:
        return f"admitted budget {admission.budget!r} at δ {admission.delta!r}"
    if not (0 < admission.sample_rate <= 1 and admission.steps >= 1):
        return f"admitted q {admission.sample_rate!r}, steps {admission.steps!r}"
    return None


# -- secure aggregation: the cluster's stage, and the server's reading of replies ------------------------

SECAGG_T = 3  # 4 clusters, threshold 3, the complete graph: every cluster holds every other's shares


@cache
def secagg_epoch(workdir: str):
    """A key epoch over 4 real cluster stages, round 1 masked (tests/secagg_adversary.py): every case starts a
    stage from its state just after that upload."""
    from tests.secagg_adversary import Epoch

    return Epoch(Path(workdir) / "secagg", n=4, threshold=SECAGG_T)


def _secagg_views(ids: list[str]) -> list[frozenset[str]]:
    return [frozenset(v) for k in range(1, len(ids)) for v in itertools.combinations(ids, k)]


def _unmask_request(ep: Any, holder: str, survivors: frozenset[str]) -> dict[str, Any]:
    """The request an honest server sends: every upload's receipt, and with dropouts every survivor's signature."""
    request = {**ep.base(survivors), **ep.forwarded(holder, survivors), "stage": "unmask",
               "receipts": json.dumps(ep.receipts)}
    if survivors != frozenset(ep.ids):
        request["signatures"] = json.dumps({m: ep.signature(m, survivors) for m in survivors})
    return request


def _mutate_value(draw: Callable, value: Any) -> tuple[Any, str]:
    """A hostile version of one field: wild JSON, a string with a flipped character, a list changed."""
    how = draw(st.sampled_from(["wild", "flip", "list"]))
    if how == "flip" and isinstance(value, str) and value:
        i = draw(st.integers(0, len(value) - 1))
        return value[:i] + draw(st.sampled_from(["A", "/", "=", "%", "\x00", ""])) + value[i + 1:], "flipped a character"
    if how == "list" and isinstance(value, list):
        choice = draw(st.sampled_from(["drop", "dup", "add", "reverse"]))
        if choice == "drop" and value:
            return value[1:], "dropped a list item"
        if choice == "dup" and value:
            return [*value, value[0]], "duplicated a list item"
        if choice == "reverse":
            return list(reversed(value)), "reversed a list"
        return [*value, draw(WILD_JSON)], "added a wild list item"
    return draw(WILD_JSON), "wild value"


@st.composite
def secagg_stage_cases(draw: Callable, workdir: Path) -> Case:
    ep = secagg_epoch(str(workdir))
    holder = draw(st.sampled_from(ep.ids))
    view = draw(st.sampled_from([frozenset(ep.ids), *[v for v in _secagg_views(ep.ids) if holder in v]]))
    stage = draw(st.sampled_from(["keys", "share", "view", "unmask", "recover", "train"]))
    prefix: list[dict[str, Any]] = []
    if stage == "keys":
        request = {"stage": "keys", "federation-id": "fed1", "epoch": draw(st.sampled_from(["epoch-1", "epoch-2"]))}
    elif stage == "share":
        request = dict(ep.share_request)
    elif stage == "view":
        request = {**ep.base(view), "stage": "view"}
    elif stage == "unmask":
        request = _unmask_request(ep, holder, view)
        if draw(st.booleans()):  # sign some view first: the unmask must then be of that view
            prefix.append({**ep.base(draw(st.sampled_from([v for v in _secagg_views(ep.ids) if holder in v]))),
                           "stage": "view"})
    elif stage == "recover":
        prefix = [{**ep.base(view), "stage": "view"}, _unmask_request(ep, holder, view)]
        request = {"federation-id": "fed1", "epoch": "epoch-1", "stage": "recover", "round": 1,
                   "clusters": sorted(set(ep.ids) - view)}
    else:
        request = {**ep.train_config(holder), "server-round": draw(st.sampled_from([1, 2]))}
    how = "valid"
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2, 3] if stage != "train" else [1, 2]))):
        key = draw(st.sampled_from(sorted(request)))
        if draw(st.integers(0, 4)) == 0:
            request.pop(key)
            how = f"dropped '{key}'"
        else:
            request[key], change = _mutate_value(draw, request[key])
            how = f"{change} in '{key}'"
    if draw(st.integers(0, 9)) == 0:
        request, how = draw(st.dictionaries(st.text(max_size=12), WILD_JSON, max_size=6)), "wild request"
    return Case(f"{stage}: {how}", {"holder": holder, "request": request, "prefix": prefix, "_workdir": str(workdir)})


def secagg_stage_call(case: Case) -> Any:
    from nebula_fl.clients.secagg_stage import SecAggRefusal

    ep = secagg_epoch(case.args["_workdir"])
    stage = ep.fresh(case.args["holder"])
    accepted = []
    for earlier in case.args["prefix"]:
        try:
            stage.handle(json.loads(json.dumps(earlier)))
            accepted.append(earlier)
        except SecAggRefusal:
            pass
    request = case.args["request"]
    if request.get("stage") is None and "secagg-epoch" in request:
        return "train", stage.prepare(request), accepted
    return request.get("stage"), stage.handle(request), accepted


def _b64_equal(a: Any, b: str) -> bool:
    try:
        return isinstance(a, str) and base64.b64decode(a, validate=True) == base64.b64decode(b)
    except ValueError:
        return False


def _rules_view(request: dict[str, Any], *, ids: list[str], holder: str) -> tuple[set[str], set[str]] | None:
    """(survivors, dropped) if the request's view is one the rules let a holder act on, else None."""
    s, d = request.get("survivors"), request.get("dropped", [])
    if not (isinstance(s, list) and isinstance(d, list) and all(isinstance(x, str) for x in s + d)):
        return None
    survivors, dropped = set(s), set(d)
    if (len(survivors) != len(s) or len(dropped) != len(d) or survivors & dropped or survivors | dropped != set(ids)
            or holder not in survivors or len(survivors) < SECAGG_T):
        return None
    return survivors, dropped


def check_secagg_stage(case: Case, result: Any) -> str | None:
    """Reveals only what reveal.py's rules allow, checked against the genuine receipts and signatures (not the
    stage's own checks): a certified view, one per round, shares of its survivors, pair keys of its dropouts."""
    ep, holder, request = secagg_epoch(case.args["_workdir"]), case.args["holder"], case.args["request"]
    kind, reply, accepted = result
    views = [_rules_view(r, ids=ep.ids, holder=holder) for r in accepted if r.get("stage") in ("view", "unmask")]
    if kind == "train":
        if reply.server_round == 1:
            return "round 1 was masked already and was prepared again"
        if holder not in reply.round_set or not set(reply.round_set) <= set(ep.ids):
            return f"prepared a round set {reply.round_set} without the holder or outside the epoch"
        return None
    if kind == "share" and {k: request.get(k) for k in ep.share_request} != ep.share_request:
        return "accepted a changed share request for an epoch already set up"
    if kind in ("view", "unmask"):
        view = _rules_view(request, ids=ep.ids, holder=holder)
        if view is None:
            return f"acted on a view the rules forbid ({request.get('survivors')!r} / {request.get('dropped')!r})"
        if any(v is not None and v != view for v in views):
            return "acted on a second view of the round"
    if kind == "unmask":
        survivors, dropped = view
        if not dropped:
            receipts = json_map(request.get("receipts"))
            if any(receipts.get(m) != ep.receipts[m] for m in ep.ids):
                return "unmasked the full view without every genuine receipt"
        else:
            sigs = json_map(request.get("signatures"))
            genuine = [m for m in survivors if _b64_equal(sigs.get(m), ep.signature(m, frozenset(survivors)) or "")]
            if len(genuine) < SECAGG_T:
                return f"unmasked a dropout view with {len(genuine)} genuine signatures"
        if not set(reply["self-from"]) <= survivors or not set(reply["pair-with"]) <= dropped:
            return f"revealed shares of {reply['self-from']} and pair keys with {reply['pair-with']} under {view}"
    if kind == "recover" and reply["key-from"]:
        unmasked = [_rules_view(r, ids=ep.ids, holder=holder) for r in accepted if r.get("stage") == "unmask"]
        if not unmasked or not set(reply["key-from"]) <= unmasked[-1][1]:
            return f"gave key shares of {reply['key-from']} without having unmasked a view in which they dropped"
    return None


@cache
def secagg_genuine_replies(workdir: str) -> dict[str, Any]:
    """The honest unmask replies of the full view, and of the view in which cluster 3 dropped (with the recover
    replies for 3's key), with what they must rebuild."""
    ep = secagg_epoch(workdir)
    everyone, three = frozenset(ep.ids), frozenset(ep.ids[:3])
    full = {h: ep.fresh(h).handle(_unmask_request(ep, h, everyone)) for h in ep.ids}
    seeds = {c: read(full, ep, survivors=ep.ids, dropped=[]).seeds[c] for c in ep.ids}
    dropout, recover = {}, {}
    for h in three:
        stage = ep.fresh(h)
        stage.handle({**ep.base(three), "stage": "view"})
        dropout[h] = stage.handle(_unmask_request(ep, h, three))
        recover[h] = stage.handle({"federation-id": "fed1", "epoch": "epoch-1", "stage": "recover", "round": 1,
                                   "clusters": ["3"]})
    pairs = read(dropout, ep, survivors=list(three), dropped=["3"]).pair_keys
    key = ep.snapshot["3"]["fed1"]["epochs"]["epoch-1"]["s_sk"].encode()
    return {"full": full, "seeds": seeds, "dropout": dropout, "pairs": pairs, "recover": recover, "key": key}


def read(replies: dict[str, Any], ep: Any, *, survivors: list[str], dropped: list[str]) -> Any:
    from nebula_fl.secagg.replies import read_unmask

    return read_unmask(replies, survivors=survivors, dropped=dropped, neighbours=ep.neighbours, threshold=SECAGG_T,
                       commits={c: h["commit"] for c, (_, h) in ep.uploads.items()})


@st.composite
def secagg_reply_cases(draw: Callable, workdir: Path) -> Case:
    genuine = secagg_genuine_replies(str(workdir))
    which = draw(st.sampled_from(["full", "dropout", "recover"]))
    replies = json.loads(json.dumps(genuine[which]))
    hows = []
    for _ in range(draw(st.integers(1, 3))):
        holder = draw(st.sampled_from(sorted(replies)))
        reply = replies[holder]
        choice = draw(st.integers(0, 9))
        if not isinstance(reply, dict):  # replaced wholesale already
            continue
        if choice == 0:
            replies[holder], how = draw(WILD_JSON), "wild reply"
        elif choice == 1 and reply:
            key = draw(st.sampled_from(sorted(reply)))
            reply.pop(key)
            how = f"dropped '{key}'"
        elif choice <= 4 and reply:  # a share, key or name of the reply replaced by a plausible lie
            key = draw(st.sampled_from([k for k in sorted(reply) if isinstance(reply[k], list) and reply[k]] or [None]))
            if key is None:
                continue
            i = draw(st.integers(0, len(reply[key]) - 1))
            item = reply[key][i]
            if isinstance(item, str) and key in ("self-shares", "pair-keys", "key-shares"):
                raw = bytearray(base64.b64decode(item))
                kind = draw(st.sampled_from(["flip", "truncate", "random", "extend"]))
                if kind == "flip" and raw:
                    raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
                elif kind == "truncate":
                    raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
                elif kind == "random":
                    raw = bytearray(np.random.default_rng(draw(st.integers(0, 2**31))).bytes(len(raw)))
                else:
                    raw += b"\x00" * draw(st.integers(1, 40))
                reply[key][i] = base64.b64encode(bytes(raw)).decode()
                how = f"{kind} of an item of '{key}'"
            else:
                reply[key][i], how = _mutate_value(draw, item)
                how = f"{how} in '{key}'"
        elif reply:
            key = draw(st.sampled_from(sorted(reply)))
            reply[key], how = _mutate_value(draw, reply[key])
            how = f"{how} in '{key}'"
        else:
            continue
        hows.append(f"{holder}: {how}")
    return Case(f"{which}: {'; '.join(hows) or 'valid'}", {"which": which, "replies": replies, "_workdir": str(workdir)})


def secagg_reply_call(case: Case) -> Any:
    from nebula_fl.secagg.replies import read_recover

    ep = secagg_epoch(case.args["_workdir"])
    replies, which = case.args["replies"], case.args["which"]
    if which == "full":
        return read(replies, ep, survivors=ep.ids, dropped=[])
    if which == "dropout":
        return read(replies, ep, survivors=ep.ids[:3], dropped=["3"])
    s_pk = ep.keys["3"]["s-pk"].encode()
    return read_recover(replies, asked={h: {"3"} for h in ep.ids[:3]}, threshold=SECAGG_T, public_keys={"3": s_pk})


def check_secagg_replies(case: Case, result: Any) -> str | None:
    """Whatever the replies say, what the server takes from them is the genuine secret or nothing."""
    genuine = secagg_genuine_replies(case.args["_workdir"])
    which = case.args["which"]
    if which == "recover":
        keys, _bad = result
        return None if keys.get("3") == genuine["key"] else "rebuilt a mask key that is not cluster 3's"
    wrong = [c for c, seed in result.seeds.items() if seed != genuine["seeds"][c]]
    if wrong:
        return f"rebuilt self-mask seeds of {wrong} that are not theirs"
    if which == "dropout" and any(result.pair_keys[k] != genuine["pairs"][k] for k in result.pair_keys):
        return "took a pair key that is not the pair's"
    return None


# -- targets and the runner --------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    name: str
    entry_point: str
    documented: tuple[type[BaseException], ...]
    inputs: st.SearchStrategy
    call: Callable[[Case], Any]
    check: Callable[[Case, Any], str | None]
    full: int  # inputs in a full run; --quick runs a twentieth


def _secagg_refusal() -> type[BaseException]:
    from nebula_fl.clients.secagg_stage import SecAggRefusal

    return SecAggRefusal


def _share_error() -> type[BaseException]:
    from nebula_fl.secagg.shares import ShareError

    return ShareError


def make_targets(workdir: Path) -> dict[str, Target]:
    """Every fuzzed entry point; `workdir` holds the checkpoint template and its damaged copies."""
    workdir.mkdir(parents=True, exist_ok=True)
    targets = [
        Target("codec-blob", "Compressor.decode(blob, layout=, seed=)", (CodecError,), codec_cases(), decode_blob,
               check_decoded, 8000),
        Target("config-flat", "components.load(flat)", (NebulaError,), flat_cases(), from_flat, check_config, 4000),
        Target("config-text", "parse_run_config(text) -> RunConfig().replace", (NebulaError,), config_text_cases(),
               config_text, check_config, 3000),
        Target("trainer-frame", "clients.protocol.unpack(frame)", (ValueError,), frame_cases(), unpack_frame,
               check_unpacked, 3000),
        Target("checkpoint", "RunFolder(path).load_checkpoint()", (NebulaError,), checkpoint_cases(workdir),
               load_damaged, check_loaded, 1000),
        Target("uplink-arrays", "comm.validation.check_arrays(expected=, arrays=, what=)", (ValueError,),
               uplink_cases(), check_uplink, check_uplink_result, 1000),
        Target("layout-json", "Layout.from_json(text)", (ValueError,), layout_json_cases(), layout_from_json,
               check_layout, 2000),
        Target("privacy-request", "PrivacyGate.admit(config, world=)", (Refused,), privacy_request_cases(workdir),
               admit_request, check_admission, 2000),
        Target("secagg-stage", "SecAggStage.handle(request) / .prepare(config)", (_secagg_refusal(),),
               secagg_stage_cases(workdir), secagg_stage_call, check_secagg_stage, 3000),
        Target("secagg-replies", "secagg.replies.read_unmask / read_recover(replies)", (_share_error(),),
               secagg_reply_cases(workdir), secagg_reply_call, check_secagg_replies, 3000),
    ]
    return {t.name: t for t in targets}


def _where(err: BaseException) -> str:
    """The innermost frame in nebula_fl (else the innermost frame) of an exception's traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    ours = [f for f in frames if "nebula_fl" in f.filename] or frames
    if not ours:
        return "?"
    frame = ours[-1]
    path = frame.filename.split("nebula_fl/", 1)[-1] if "nebula_fl" in frame.filename else frame.filename
    return f"{'nebula_fl/' if 'nebula_fl' in frame.filename else ''}{path}:{frame.lineno}"


@dataclass
class Tally:
    name: str
    inputs: int = 0
    rejected: int = 0  # the documented error: the right answer to bad input
    accepted: int = 0
    crashes: int = 0
    violations: int = 0
    seconds: float = 0.0
    slowest_s: float = 0.0
    slowest_input: str = ""
    kinds: Counter = field(default_factory=Counter)
    digest: Any = field(default_factory=hashlib.sha256)  # of every input's repr: same seed and code, same inputs
    first: list[dict[str, str]] = field(default_factory=list)

    def _keep(self, case: Case, what: str, where: str) -> None:
        self.kinds[f"{what.split(':')[0]} at {where}"] += 1
        if len(self.first) < KEEP:
            self.first.append({"input": short_repr(case), "error": what[:300], "where": where})

    def feed(self, target: Target, case: Case) -> None:
        self.inputs += 1
        self.digest.update(short_repr(case).encode("utf-8", "surrogatepass"))
        start = time.perf_counter()
        try:
            result = target.call(case)
        except target.documented:
            self.rejected += 1
        except Exception as err:  # a crash: the point of the exercise
            self.crashes += 1
            self._keep(case, f"{type(err).__name__}: {err}", _where(err))
        else:
            self.accepted += 1
            try:
                problem = target.check(case, result)
            except Exception as err:
                problem = f"checking the result raised {type(err).__name__}: {err}"
            if problem:
                self.violations += 1
                self._keep(case, f"violation: {problem}", target.entry_point)
        finally:
            took = time.perf_counter() - start
            if took > self.slowest_s:
                self.slowest_s, self.slowest_input = took, short_repr(case)

    def summary(self) -> str:
        lines = [f"{self.name}: {self.crashes} crashes, {self.violations} violations in {self.inputs} inputs"]
        lines += [f"  {n} x {kind}" for kind, n in self.kinds.most_common()]
        lines += [f"  e.g. {c['error'][:160]} <- {c['input'][:240]}" for c in self.first]
        return "\n".join(lines)

    def to_json(self, target: Target) -> dict[str, Any]:
        return {"entry_point": target.entry_point, "documented": [t.__name__ for t in target.documented],
                "inputs": self.inputs, "inputs_sha256": self.digest.hexdigest(), "rejected": self.rejected, "accepted": self.accepted, "crashes": self.crashes,
                "violations": self.violations, "seconds": round(self.seconds, 2),
                "slowest_input_s": round(self.slowest_s, 4), "slowest_input": self.slowest_input, "crash_kinds": dict(self.kinds.most_common()),
                "first_crashes": self.first}


def run_target(target: Target, *, examples: int, seed_value: int = 0) -> Tally:
    """Feed `examples` generated inputs to one target (reproducibly for a given seed) and tally what happened."""
    tally = Tally(target.name)

    @seed(zlib.crc32(f"{target.name}:{seed_value}".encode()))
    @settings(max_examples=examples, database=None, deadline=None, phases=[Phase.generate], derandomize=False,
              suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet, report_multiple_bugs=False)
    @given(target.inputs)
    def feed(case: Case) -> None:
        tally.feed(target, case)

    start = time.perf_counter()
    feed()
    tally.seconds = time.perf_counter() - start
    return tally


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a twentieth of the inputs (1,500)")
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed of every target (default 0)")
    parser.add_argument("--only", help="comma-separated target names")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="results.json path")
    args = parser.parse_args(argv)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nebula-fuzz-") as work:
        targets = make_targets(Path(work))
        names = args.only.split(",") if args.only else list(targets)
        unknown = [n for n in names if n not in targets]
        if unknown:
            parser.error(f"unknown target(s) {unknown}; choose from {', '.join(targets)}")
        tallies = {}
        for name in names:
            target = targets[name]
            examples = max(50, target.full // QUICK_DIVISOR) if args.quick else target.full
            console.print(f"fuzzing {name} ({target.entry_point}) with {examples} inputs ...")
            tallies[name] = run_target(target, examples=examples, seed_value=args.seed)
    elapsed = time.perf_counter() - started

    table = Table(title=f"fuzz: {'quick' if args.quick else 'full'} run, seed {args.seed}")
    for column in ("target", "documented", "inputs", "rejected", "accepted", "crashes", "violations", "seconds",
                   "slowest input s"):
        table.add_column(column, justify="left" if column in ("target", "documented") else "right")
    for name, tally in tallies.items():
        table.add_row(name, "/".join(t.__name__ for t in targets[name].documented), f"{tally.inputs:,}",
                      f"{tally.rejected:,}", f"{tally.accepted:,}",
                      f"[red]{tally.crashes}[/red]" if tally.crashes else "0",
                      f"[red]{tally.violations}[/red]" if tally.violations else "0", f"{tally.seconds:.1f}",
                      f"{tally.slowest_s:.3f}")
    total_inputs = sum(t.inputs for t in tallies.values())
    total_crashes = sum(t.crashes for t in tallies.values())
    total_violations = sum(t.violations for t in tallies.values())
    table.add_row("total", "", f"{total_inputs:,}", "", "", str(total_crashes), str(total_violations), f"{elapsed:.1f}",
                  "")
    console.print(table)
    for tally in tallies.values():
        if tally.crashes or tally.violations:
            console.print(tally.summary(), markup=False)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "inputs": total_inputs, "crashes": total_crashes, "violations": total_violations, "seconds": round(elapsed, 1),
        "quick": args.quick, "seed": args.seed, "codec_chains": list(codec_chains()),
        "command": " ".join([os.path.relpath(sys.executable), *sys.argv]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "targets": {name: tally.to_json(targets[name]) for name, tally in tallies.items()},
    }
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"{total_inputs:,} inputs, {total_crashes} crashes, {total_violations} violations in {elapsed:.0f} s; "
                  f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
