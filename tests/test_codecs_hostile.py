"""Hostile blobs: whatever the bytes, decode raises CodecError (never another exception) or returns a
finite float32 vector of the layout's size, and never allocates from a declared size."""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nebula_fl.compression import CodecError, Compressor, Layout

SPECS = ["none", "fp16", "bf16", "int8", "int4", "topk:0.05", "topk:0.4", "topk:0.05+int8", "topk:0.1+int4",
         "randk:0.1", "randk:0.1+fp16", "lowrank:2", "lowrank:2+int8", "lowrank:2+bf16"]
LAYOUT = Layout.from_shapes({"a.lora_A": (4, 64), "a.lora_B": (64, 4), "head.weight": (3, 64), "head.bias": (3,)})
SEED = 11
HOSTILE = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_blobs() -> dict[str, bytes]:
    x = np.random.default_rng(0).standard_normal(LAYOUT.size).astype(np.float32)
    return {spec: Compressor(spec, layout=LAYOUT).encode(x, seed=SEED) for spec in SPECS}


BLOBS = make_blobs()


def decode_or_codec_error(blob, layout: Layout = LAYOUT, seed: int = SEED) -> np.ndarray | None:
    """Decode; a CodecError is an acceptable answer, any other exception fails the test."""
    try:
        y = Compressor.decode(blob, layout=layout, seed=seed)
    except CodecError:
        return None
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (layout.size,)
    assert np.isfinite(y).all() and y.flags.writeable
    return y


def split(blob: bytes) -> tuple[dict, bytes]:
    length = struct.unpack_from("<I", blob, 4)[0]
    return json.loads(blob[8:8 + length]), blob[8 + length:]


def rebuild(header, data: bytes, *, raw: bytes | None = None) -> bytes:
    text = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return b"NBC\x01" + struct.pack("<I", len(text)) + text + data


def test_valid_blobs_decode():
    for spec, blob in BLOBS.items():
        assert decode_or_codec_error(blob) is not None, spec


@HOSTILE
@given(st.binary(max_size=2000))
def test_random_bytes(data):
    with pytest.raises(CodecError):
        Compressor.decode(data, layout=LAYOUT, seed=SEED)
    with pytest.raises(CodecError):
        Compressor.decode(b"NBC\x01" + data, layout=LAYOUT, seed=SEED)


@HOSTILE
@given(st.sampled_from(SPECS), st.data())
def test_truncated_or_extended(spec, data):
    blob = BLOBS[spec]
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CodecError):
        Compressor.decode(blob[:cut], layout=LAYOUT, seed=SEED)
    with pytest.raises(CodecError, match=r"trailing bytes|truncated"):
        Compressor.decode(blob + data.draw(st.binary(min_size=1, max_size=9)), layout=LAYOUT, seed=SEED)


@HOSTILE
@given(st.sampled_from(SPECS), st.data())
def test_flipped_bytes_give_codec_error_or_a_finite_vector(spec, data):
    blob = bytearray(BLOBS[spec])
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] ^= data.draw(st.integers(1, 255))
    decode_or_codec_error(bytes(blob))


@HOSTILE
@given(st.sampled_from(SPECS), st.data())
def test_flips_inside_the_header_never_escape(spec, data):
    blob = bytearray(BLOBS[spec])
    length = struct.unpack_from("<I", blob, 4)[0]
    pos = data.draw(st.integers(0, 8 + length - 1))
    blob[pos] = data.draw(st.integers(0, 255))
    decode_or_codec_error(bytes(blob))


def _mutations(header: dict) -> list[tuple[str, object]]:
    """(description, mutated header or raw JSON bytes)."""
    out: list[tuple[str, object]] = []

    def with_(**kw):
        return {**header, **kw}

    arrays = header["arrays"]
    out += [("n off by one", with_(n=header["n"] + 1)), ("n huge", with_(n=2**60)), ("n negative", with_(n=-1)),
            ("n bool", with_(n=True)), ("n string", with_(n="1")),
            ("layout other", with_(layout="deadbeef")), ("layout long", with_(layout="x" * 9000)),
            ("spec unknown", with_(spec="zstd")), ("spec other", with_(spec="int4" if header["spec"] != "int4" else "int8")),
            ("spec nonsense", with_(spec="int8+topk:0.1")), ("spec huge ratio", with_(spec="topk:1e308")),
            ("spec type", with_(spec=7)), ("spec long", with_(spec="a" * 5000)),
            ("no arrays", {k: v for k, v in header.items() if k != "arrays"}), ("extra key", with_(extra=1)),
            ("seed tag added", with_(seed="00000000")), ("arrays not list", with_(arrays={"a": 1})),
            ("one stage", with_(arrays=arrays[:1])), ("three stages", with_(arrays=[*arrays, []])),
            ("deep nesting", with_(arrays=[[[[[[[[[]]]]]]]], []])), ("too many", with_(arrays=[[["v", "f4", 1]] * 40, []])),
            ("not an object", [1, 2, 3])]
    if "seed" in header:
        out += [("seed tag wrong", with_(seed="ffffffff")), ("seed tag dropped", {k: v for k, v in header.items()
                                                                                 if k != "seed"})]
    for stage, entries in enumerate(arrays):
        for i, (name, dtype, length) in enumerate(entries):
            def entry(value, stage=stage, i=i):
                changed = json.loads(json.dumps(arrays))
                changed[stage][i] = value
                return with_(arrays=changed)
            out += [(f"{name} length 2**60", entry([name, dtype, 2**60])), (f"{name} length -1", entry([name, dtype, -1])),
                    (f"{name} length +1", entry([name, dtype, length + 1])), (f"{name} length 0", entry([name, dtype, 0])),
                    (f"{name} length float", entry([name, dtype, 1.5])), (f"{name} dtype f8", entry([name, "f8", length])),
                    (f"{name} dtype object", entry([name, "O", length])), (f"{name} dtype <f4", entry([name, "<f4", length])),
                    (f"{name} dtype other", entry([name, "i4" if dtype != "i4" else "u4", length])),
                    (f"{name} renamed", entry(["zz", dtype, length])), (f"{name} short entry", entry([name, dtype])),
                    (f"{name} bad entry", entry("v"))]
    text = json.dumps(header, separators=(",", ":"))
    out += [("duplicate key", text[:-1].encode() + b',"n":1}'), ("NaN constant", text.replace(f'"n":{header["n"]}', '"n":NaN').encode()),
            ("float n", text.replace(f'"n":{header["n"]}', f'"n":{header["n"]}.0').encode()),
            ("huge int", text.replace(f'"n":{header["n"]}', '"n":' + "9" * 5000).encode()),
            ("not utf-8", b'{"spec":"\xff\xfe"}'), ("not json", b"{spec: int8}"), ("empty", b""), ("nested", b"[" * 5000 + b"]" * 5000)]
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_every_header_field_is_checked(spec):
    header, data = split(BLOBS[spec])
    for what, mutated in _mutations(header):
        blob = rebuild(None, data, raw=mutated) if isinstance(mutated, bytes) else rebuild(mutated, data)
        with pytest.raises(CodecError):
            Compressor.decode(blob, layout=LAYOUT, seed=SEED)
            pytest.fail(f"{spec}: mutation '{what}' decoded")


def test_prefix_checks():
    blob = BLOBS["int8"]
    length = struct.unpack_from("<I", blob, 4)[0]
    cases = {
        "magic": b"XBC" + blob[3:],
        "version": blob[:3] + b"\x02" + blob[4:],
        "header past the end": blob[:4] + struct.pack("<I", len(blob)) + blob[8:],
        "header huge": blob[:4] + struct.pack("<I", 2**32 - 1) + blob[8:],
        "header unaligned": blob[:4] + struct.pack("<I", length - 1) + blob[8:],
        "short": blob[:7],
        "empty": b"",
    }
    for what, bad in cases.items():
        with pytest.raises(CodecError):
            Compressor.decode(bad, layout=LAYOUT, seed=SEED)
            pytest.fail(what)
    for bad in ("a string", None, 12, [1, 2], np.zeros(3)):
        with pytest.raises(CodecError):
            Compressor.decode(bad, layout=LAYOUT, seed=SEED)
    assert decode_or_codec_error(bytearray(blob)) is not None and decode_or_codec_error(memoryview(blob)) is not None


def _put(spec: str, name: str, values: np.ndarray, at: int = 0) -> bytes:
    """The blob with array `name` overwritten (starting at element `at`) by `values`."""
    header, data = split(BLOBS[spec])
    blob = bytearray(BLOBS[spec])
    offset = len(BLOBS[spec]) - len(data)
    for entries in header["arrays"]:
        for entry_name, dtype, length in entries:
            itemsize = np.dtype(dtype).itemsize
            offset += -offset % itemsize
            if entry_name == name:
                raw = np.asarray(values, dtype="<" + dtype).tobytes()
                start = offset + at * itemsize
                blob[start:start + len(raw)] = raw
                return bytes(blob)
            offset += length * itemsize
    raise AssertionError(f"no array {name} in {spec}")


F32_INF, F32_NAN = np.float32(np.inf), np.float32(np.nan)


@pytest.mark.parametrize(("spec", "name", "values"), [
    ("none", "v", [F32_NAN]), ("none", "v", [F32_INF]), ("topk:0.05", "v", [-F32_INF]), ("randk:0.1", "v", [F32_NAN]),
    ("fp16", "h", [np.float16(np.inf)]), ("fp16", "h", [np.float16(np.nan)]), ("randk:0.1+fp16", "h", [np.float16(-np.inf)]),
    ("bf16", "b", [0x7F80]), ("bf16", "b", [0xFFC1]), ("lowrank:2+bf16", "b", [0x7F81]),
    ("int8", "s", [F32_NAN]), ("int8", "s", [-1.0]), ("int8", "s", [F32_INF]), ("int8", "s", [3e38]),
    ("int4", "s", [F32_NAN]), ("topk:0.05+int8", "s", [-0.0 - 1e-30]), ("lowrank:2+int8", "s", [F32_INF]),
    ("int8", "q", [0]), ("int4", "q", [0x10]), ("int4", "q", [0x01]), ("topk:0.1+int4", "q", [0xF0]),
    ("lowrank:2", "v", [3e38] * 600),  # P and Q whose product overflows float32
])
def test_nan_inf_and_out_of_range_buffers(spec, name, values):
    with pytest.raises(CodecError):
        Compressor.decode(_put(spec, name, np.asarray(values)), layout=LAYOUT, seed=SEED)


def test_index_coding_corruption():
    header, _ = split(BLOBS["topk:0.05"])
    names = [entry[0] for entry in header["arrays"][0]]
    assert names == ["hi", "lo"]  # Elias-Fano at 5 %
    assert [entry[0] for entry in split(BLOBS["topk:0.4"])[0]["arrays"][0]] == ["mask"]  # bitmap at 40 %
    hi_len = header["arrays"][0][0][2]
    for bad in (np.full(hi_len, 0xFF), np.zeros(hi_len), np.full(hi_len, 0x55)):
        with pytest.raises(CodecError, match=r"Elias-Fano|out of range"):
            Compressor.decode(_put("topk:0.05", "hi", bad), layout=LAYOUT, seed=SEED)
    mask_len = split(BLOBS["topk:0.4"])[0]["arrays"][0][0][2]
    for bad in (np.full(mask_len, 0xFF), np.zeros(mask_len)):
        with pytest.raises(CodecError, match="bitmap"):
            Compressor.decode(_put("topk:0.4", "mask", bad), layout=LAYOUT, seed=SEED)


def test_non_zero_padding_is_refused():
    header, data = split(BLOBS["int8"])
    q_len = header["arrays"][1][0][2]
    if q_len % 4:  # the scales start 4-aligned: the bytes in between are padding
        blob = bytearray(BLOBS["int8"])
        blob[len(blob) - len(data) + q_len] = 1
        with pytest.raises(CodecError, match="padding"):
            Compressor.decode(bytes(blob), layout=LAYOUT, seed=SEED)


def test_absurd_declared_sizes_allocate_nothing():
    header, data = split(BLOBS["int8"])
    header["arrays"][1][0][2] = 2**60
    blob = rebuild(header, data)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="needs"):
            Compressor.decode(blob, layout=LAYOUT, seed=SEED)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_blob_from_another_layout_is_refused():
    other_same_size = Layout.from_shapes({"a.lora_A": (64, 4), "a.lora_B": (4, 64), "head.weight": (3, 64),
                                          "head.bias": (3,)})
    renamed = Layout.from_shapes({"x.lora_A": (4, 64), "a.lora_B": (64, 4), "head.weight": (3, 64), "head.bias": (3,)})
    smaller = Layout.from_shapes({"a.lora_A": (4, 64)})
    for spec, blob in BLOBS.items():
        for layout in (other_same_size, renamed, smaller):
            with pytest.raises(CodecError, match="layout"):
                Compressor.decode(blob, layout=layout, seed=SEED)
                pytest.fail(spec)


def test_decode_argument_checks():
    blob = BLOBS["topk:0.05+int8"]
    with pytest.raises(CodecError, match="Layout"):
        Compressor.decode(blob, layout={"a": (3,)}, seed=SEED)  # type: ignore[arg-type]
    with pytest.raises(CodecError, match="seed"):
        Compressor.decode(blob, layout=LAYOUT, seed=-1)
    with pytest.raises(CodecError, match=r"expects 'topk:0.1\+int8'"):
        Compressor.decode(blob, layout=LAYOUT, seed=SEED, spec="topk:0.1+int8")
    assert decode_or_codec_error(blob) is not None
    Compressor.decode(blob, layout=LAYOUT, seed=SEED, spec="topk:5e-2+int8:256")  # same chain, other spelling
