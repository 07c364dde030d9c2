"""One uint8 array per upload: the sealed self-mask shares (JSON) and the masked vector, back to back.

One array is one HTTP request on Flower's wire; two would cost a round trip each on a slow link.
"""

from __future__ import annotations

import json
import struct

import numpy as np

_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 24


def pack_upload(*, masked: bytes, tokens: dict[str, str]) -> np.ndarray:
    head = json.dumps(tokens, sort_keys=True).encode()
    return np.frombuffer(_LEN.pack(len(head)) + head + masked, dtype=np.uint8).copy()


def unpack_upload(blob: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """(masked vector bytes, tokens by holder); ValueError if malformed."""
    data = np.asarray(blob, dtype=np.uint8).tobytes()
    if len(data) < _LEN.size:
        raise ValueError("the masked upload is truncated")
    (n,) = _LEN.unpack_from(data)
    if n > MAX_HEADER or _LEN.size + n > len(data):
        raise ValueError("the masked upload's share header runs past its end")
    tokens = json.loads(data[_LEN.size:_LEN.size + n])
    if not isinstance(tokens, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()):
        raise ValueError("the masked upload's shares are not a map of holder to sealed share")
    return data[_LEN.size + n:], tokens
