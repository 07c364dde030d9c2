"""Searching what the WAN proxies forwarded (``NEBULA_WAN_CAPTURE_DIR``) for an adapter's bytes.

The search is the attacker's view of the wire: every 32-byte window of the tensors that looks like float data,
looked for in every captured stream. test_e2e runs it on a plaintext federation as the control that it finds the
adapter; test_secure_federation runs it on a TLS one and must find nothing.
"""

from __future__ import annotations

from pathlib import Path

from nebula_fl.wan.capture import read_capture

WINDOW = 32


def windows(data: bytes) -> set[bytes]:
    """Every 32-byte window of ``data`` that looks like float data (not a run of zeros or repeats)."""
    return {w for i in range(len(data) - WINDOW + 1) if len(set(w := data[i:i + WINDOW])) >= 16}


def found(streams: dict, wanted: set[bytes]) -> set[bytes]:
    """The windows of ``wanted`` that occur anywhere in the captured streams."""
    hits = set()
    for stream in streams.values():
        for i in range(len(stream) - WINDOW + 1):
            if (w := stream[i:i + WINDOW]) in wanted:
                hits.add(w)
    return hits


def captured_streams(capture: Path) -> dict:
    """``{(file, connection, direction): bytes}`` over every proxy's capture file in ``capture``."""
    streams: dict = {}
    for path in sorted(capture.glob("*.cap")):
        streams.update({(path.name, *key): data for key, data in read_capture(path).items()})
    return streams


def adapter_windows(adapter: dict) -> set[bytes]:
    """The windows of every tensor of an adapter."""
    return windows(b"".join(v.tobytes() for _, v in sorted(adapter.items())))


def lora_b_windows(adapter: dict) -> set[bytes]:
    """The windows of an adapter's LoRA B factors (they start at zero, so the first change sent is them verbatim)."""
    return windows(b"".join(v.tobytes() for k, v in sorted(adapter.items()) if "lora_B" in k))
