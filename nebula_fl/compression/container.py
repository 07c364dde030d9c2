"""The byte container of one encoded message: self-describing, and checked before it is trusted.

    offset 0  b"NBC"            magic
           3  u8                 format version (1)
           4  u32 little-endian  header length H (a multiple of 8 with the prefix: JSON + space padding)
           8  H bytes            compact JSON: {"spec", "n", "layout", ["seed"], "arrays"}
        8 + H buffers            little-endian, each aligned to its item size with zero bytes

``arrays`` lists, per stage (transform, then quantizer), ``[name, dtype code, length]``. The reader
compares every entry with the plan the layout and the spec imply, and the total with the blob's
length, before it touches a buffer; buffers are read in place (np.frombuffer), never allocated from
a declared size.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from nebula_fl.compression.codec import DTYPES, ArraySpec
from nebula_fl.compression.errors import CodecError

MAGIC = b"NBC"
VERSION = 1
PREFIX = struct.Struct("<3sBI")
MAX_HEADER = 16384
HEADER_KEYS = frozenset({"spec", "n", "layout", "seed", "arrays"})
MAX_ARRAYS_PER_STAGE = 16


def header_bytes(header: dict[str, Any]) -> bytes:
    """The prefix and the JSON header, padded with spaces so the buffers start 8-byte aligned."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(PREFIX.size + len(text)) % 8)
    return PREFIX.pack(MAGIC, VERSION, len(text)) + text


def _pad(offset: int, itemsize: int) -> int:
    return -offset % itemsize


def data_size(start: int, specs: Sequence[ArraySpec]) -> int:
    """Bytes from `start` (the first buffer) to the end of the blob, alignment padding included."""
    offset = start
    for spec in specs:
        offset += _pad(offset, DTYPES[spec.dtype].itemsize) + spec.nbytes
    return offset - start


def pack(header: dict[str, Any], arrays: Sequence[tuple[ArraySpec, np.ndarray]]) -> bytes:
    head = header_bytes(header)
    pieces: list[Any] = [head]
    offset = len(head)
    for spec, value in arrays:
        itemsize = DTYPES[spec.dtype].itemsize
        pad = _pad(offset, itemsize)
        if pad:
            pieces.append(bytes(pad))
        value = np.ascontiguousarray(value, dtype=DTYPES[spec.dtype])
        pieces.append(memoryview(value).cast("B"))
        offset += pad + spec.nbytes
    return b"".join(pieces)


def _reject_constant(token: str) -> Any:
    raise ValueError(f"{token} is not allowed")


def _reject_float(token: str) -> Any:
    raise ValueError(f"floating-point number {token} is not allowed")


def _small_int(token: str) -> int:
    if len(token) > 20:
        raise ValueError(f"integer with {len(token)} digits is not allowed")
    return int(token)


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate keys in {keys}")
    return dict(pairs)


def read_header(blob: bytes | bytearray | memoryview) -> tuple[memoryview, dict[str, Any], int]:
    """(the blob as bytes, the validated header, offset of the first buffer)."""
    try:
        view = memoryview(blob).cast("B")
    except (TypeError, ValueError):
        raise CodecError(f"a blob must be bytes, bytearray or a contiguous memoryview, got {type(blob).__name__}") from None
    if len(view) < PREFIX.size:
        raise CodecError(f"blob is {len(view)} bytes, shorter than the {PREFIX.size}-byte prefix; it is truncated")
    magic, version, length = PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CodecError(f"blob starts with {bytes(magic)!r}, not {MAGIC!r}: it is not a nebula-fl compressed message")
    if version != VERSION:
        raise CodecError(f"blob has container version {version}; this nebula-fl reads version {VERSION}, "
                         "so sender and receiver need the same nebula-fl release")
    if length > MAX_HEADER:
        raise CodecError(f"blob declares a {length}-byte header, over the {MAX_HEADER}-byte limit; it is corrupt")
    if PREFIX.size + length > len(view):
        raise CodecError(f"blob declares a {length}-byte header but holds only {len(view) - PREFIX.size} bytes "
                         "after the prefix; it is truncated")
    if (PREFIX.size + length) % 8:
        raise CodecError(f"blob header length {length} leaves the buffers unaligned; it is corrupt")
    try:
        header = json.loads(bytes(view[PREFIX.size:PREFIX.size + length]).decode("utf-8"),
                            object_pairs_hook=_unique_keys, parse_constant=_reject_constant,
                            parse_float=_reject_float, parse_int=_small_int)
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        raise CodecError(f"blob header is not valid JSON ({type(exc).__name__}: {str(exc)[:120]}); it is corrupt") from None
    _check_header(header)
    return view, header, PREFIX.size + length


def _check_header(header: Any) -> None:
    if not isinstance(header, dict):
        raise CodecError(f"blob header is a JSON {type(header).__name__}, not an object; it is corrupt")
    keys = set(header)
    required = HEADER_KEYS - {"seed"}
    if not required <= keys <= HEADER_KEYS:
        raise CodecError(f"blob header has keys {sorted(keys)}; expected {sorted(required)} (and optionally 'seed')")
    if not isinstance(header["spec"], str) or not 0 < len(header["spec"]) <= 256:
        raise CodecError("blob header 'spec' must be a codec spec string of at most 256 characters")
    if not _is_int(header["n"]):
        raise CodecError(f"blob header 'n' is {header['n']!r}, not an integer")
    for key in ("layout", "seed"):
        if key in header and not (isinstance(header[key], str) and len(header[key]) == 8):
            raise CodecError(f"blob header '{key}' must be 8 hex digits, got {str(header[key])[:20]!r}")
    stages = header["arrays"]
    if not isinstance(stages, list) or len(stages) != 2:
        raise CodecError("blob header 'arrays' must list the arrays of exactly 2 stages (transform, quantizer)")
    for stage in stages:
        if not isinstance(stage, list) or len(stage) > MAX_ARRAYS_PER_STAGE:
            raise CodecError(f"blob header 'arrays' must hold lists of at most {MAX_ARRAYS_PER_STAGE} entries")
        for entry in stage:
            if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str)
                    and isinstance(entry[1], str) and _is_int(entry[2])):
                raise CodecError(f"blob header array entry {str(entry)[:60]} is not [name, dtype, length]")
            if entry[1] not in DTYPES:
                raise CodecError(f"blob header declares dtype {entry[1][:16]!r} for array '{entry[0][:16]}'; "
                                 f"only {sorted(DTYPES)} are allowed")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_declared(header: dict[str, Any], plans: Sequence[Sequence[ArraySpec]]) -> None:
    """Every declared array must be exactly the planned one: same names, dtypes, lengths, order."""
    for stage, (declared, planned) in enumerate(zip(header["arrays"], plans)):
        want = [[a.name, a.dtype, a.length] for a in planned]
        if declared != want:
            role = "transform" if stage == 0 else "quantizer"
            raise CodecError(f"blob declares {role} arrays {str(declared)[:160]}, but spec '{header['spec']}' on "
                             f"this layout needs {str(want)[:160]}; the blob is corrupt or from another layout")


def read_arrays(view: memoryview, start: int, specs: Sequence[ArraySpec]) -> list[np.ndarray]:
    """Read-only views of the planned buffers, after checking the blob's exact length and padding."""
    expected = start + data_size(start, specs)
    if len(view) != expected:
        raise CodecError(f"blob is {len(view)} bytes, but its header implies exactly {expected}; "
                         "it is truncated or has trailing bytes")
    out = []
    offset = start
    for spec in specs:
        dtype = DTYPES[spec.dtype]
        pad = _pad(offset, dtype.itemsize)
        if pad and any(view[offset:offset + pad]):
            raise CodecError(f"blob has non-zero padding before array '{spec.name}'; it is corrupt")
        offset += pad
        out.append(np.frombuffer(view, dtype=dtype, count=spec.length, offset=offset))
        offset += spec.nbytes
    return out
