"""One uint8 array per upload: a JSON head (sealed self-mask shares, commitments, receipt), then the masked vector.

One array is one HTTP request on Flower's wire; two would cost a round trip each on a slow link.

The head holds, besides the shares sealed to each holder, the uploader's commitments: SHA-256 of its
self-mask seed and of each round pair key it masked with. They reveal nothing (the secrets are 32 random
bytes each) and let the server check every rebuilt seed and every revealed pair key, so a holder that
returns a wrong share or key is caught and left out instead of corrupting the sum. The receipt is the
uploader's signature of the round and of `digest(head, masked)` (evidence.py).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import numpy as np

_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 24


def commitment(secret: bytes) -> str:
    return hashlib.sha256(b"nebula-fl secagg commitment" + secret).hexdigest()


def digest(head: dict[str, Any], masked: bytes) -> str:
    """What a receipt signs: the head without the receipt, and the masked bytes."""
    body = json.dumps({k: v for k, v in head.items() if k != "receipt"}, sort_keys=True).encode()
    return hashlib.sha256(_LEN.pack(len(body)) + body + masked).hexdigest()


def pack_upload(*, masked: bytes, head: dict[str, Any]) -> np.ndarray:
    body = json.dumps(head, sort_keys=True).encode()
    return np.frombuffer(_LEN.pack(len(body)) + body + masked, dtype=np.uint8).copy()


def unpack_upload(blob: np.ndarray) -> tuple[bytes, dict[str, Any]]:
    """(masked vector bytes, head); ValueError if malformed."""
    data = np.asarray(blob, dtype=np.uint8).tobytes()
    if len(data) < _LEN.size:
        raise ValueError("the masked upload is truncated")
    (n,) = _LEN.unpack_from(data)
    if n > MAX_HEADER or _LEN.size + n > len(data):
        raise ValueError("the masked upload's head runs past its end")
    head = json.loads(data[_LEN.size:_LEN.size + n])
    if not isinstance(head, dict):
        raise ValueError("the masked upload's head is not an object")
    tokens, commits, receipt = head.get("tokens"), head.get("commit"), head.get("receipt")
    if not isinstance(tokens, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tokens.items()):
        raise ValueError("the masked upload's shares are not a map of holder to sealed share")
    if not (isinstance(commits, dict) and isinstance(commits.get("self"), str) and isinstance(commits.get("pairs"), dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in commits["pairs"].items())):
        raise ValueError("the masked upload's commitments are malformed")
    if not isinstance(receipt, str):
        raise ValueError("the masked upload carries no receipt")
    return data[_LEN.size + n:], head
