"""The local link between a cluster's thin ClientApp and its persistent trainer.

A Unix socket (mode 0600) with multiprocessing's HMAC handshake on a key file beside it; each frame
is a JSON header plus the tensors as safetensors bytes, so nothing is ever unpickled. This module
imports neither torch nor transformers: it is what the per-message ``flwr-clientapp`` process loads.
"""

from __future__ import annotations

import json
import os
import secrets
import struct
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from nebula_fl.errors import NebulaError

Arrays = dict[str, np.ndarray]
_HEADER = struct.Struct("<I")


def key_path(socket_path: str | Path) -> Path:
    return Path(f"{socket_path}.key")


def pack(header: dict[str, Any], arrays: Arrays | None = None) -> bytes:
    head = json.dumps(header).encode()
    body = st_save({k: np.ascontiguousarray(v) for k, v in arrays.items()}) if arrays else b""
    return _HEADER.pack(len(head)) + head + body


def unpack(frame: bytes) -> tuple[dict[str, Any], Arrays]:
    if len(frame) < _HEADER.size:
        raise ValueError("truncated frame")
    (n,) = _HEADER.unpack_from(frame)
    if _HEADER.size + n > len(frame):
        raise ValueError("frame header runs past its end")
    body = frame[_HEADER.size + n :]
    try:
        header = json.loads(frame[_HEADER.size : _HEADER.size + n])
        arrays = st_load(body) if body else {}
    except (ValueError, SafetensorError) as err:
        raise ValueError(f"malformed frame: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("malformed frame: the header is not an object")
    return header, arrays


def listen(socket_path: str | Path) -> Listener:
    """Create the trainer's socket and key file, both readable by this user only."""
    path = Path(socket_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    key = secrets.token_bytes(32)
    kp = key_path(path)
    fd = os.open(kp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key)
    old = os.umask(0o177)
    try:
        return Listener(str(path), family="AF_UNIX", authkey=key)
    finally:
        os.umask(old)


def request(socket_path: str | Path, header: dict[str, Any], arrays: Arrays | None = None) -> tuple[dict[str, Any], Arrays]:
    """Send one request to a trainer and wait for its reply; a refused reply raises NebulaError."""
    path = Path(socket_path)
    try:
        key = key_path(path).read_bytes()
        conn: Connection = Client(str(path), family="AF_UNIX", authkey=key)
    except AuthenticationError:
        raise NebulaError(
            f"cannot reach the cluster trainer at '{path}': its key file {key_path(path)} does not match the "
            "running trainer; restart the trainer, or run the ClientApp as the user who started it"
        ) from None
    except (OSError, EOFError) as err:
        raise NebulaError(
            f"cannot reach the cluster trainer at '{path}' ({err}); start it with `nebula-fl trainer "
            f"--socket {path} ...` and give the SuperNode --node-config 'trainer=\"{path}\"'"
        ) from None
    with conn:
        conn.send_bytes(pack(header, arrays))
        reply, out = unpack(conn.recv_bytes())
    if not reply.get("ok"):
        raise NebulaError(f"cluster trainer refused the request: {reply.get('error', 'no reason given')}")
    return reply, out
