"""A record of every byte a WAN proxy forwards, to check what an eavesdropper on the link would see.

Off unless asked (``python -m nebula_fl.wan --capture FILE``, or ``NEBULA_WAN_CAPTURE_DIR`` for the
proxies the launcher starts). Each delivery is appended as one record: a 13-byte header (direction
``u``/``d``, connection number, payload length, little-endian) and the bytes as they left the proxy;
``read_capture`` joins them back into one byte stream per connection and direction, so a search over
a stream sees exactly the bytes one TCP connection carried that way.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path

HEADER = struct.Struct("<cIQ")  # direction, connection number, payload length
CAPTURE_DIR_ENV = "NEBULA_WAN_CAPTURE_DIR"


class CaptureWriter:
    """Appends records to ``path``; every record is flushed, so a killed proxy loses nothing it delivered."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab")

    def record(self, direction: str, connection: int, chunks: Iterable[bytes]) -> None:
        data = b"".join(chunks)
        self._file.write(HEADER.pack(direction[0].encode(), connection, len(data)) + data)
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_capture(path: str | Path) -> dict[tuple[int, str], bytes]:
    """``{(connection, "up" | "down"): bytes}`` from a capture file; a record cut short ends the file."""
    raw = Path(path).read_bytes()
    streams: dict[tuple[int, str], bytearray] = {}
    offset = 0
    while offset + HEADER.size <= len(raw):
        tag, connection, length = HEADER.unpack_from(raw, offset)
        offset += HEADER.size
        if offset + length > len(raw):
            break
        direction = "up" if tag == b"u" else "down"
        streams.setdefault((connection, direction), bytearray()).extend(raw[offset : offset + length])
        offset += length
    return {key: bytes(value) for key, value in streams.items()}
