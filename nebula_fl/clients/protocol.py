"""The local link between a cluster's thin ClientApp and its persistent trainer.

A Unix socket (mode 0600) with multiprocessing's HMAC handshake on a key file beside it; each frame
is a JSON header plus the tensors as safetensors bytes, so nothing is ever unpickled. This module
imports neither torch nor transformers: it is what the ClientApp runner (clients/runner.py) loads.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import struct
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
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
    body = st_save({k: np.ascontiguousarray(v) for k, v in arrays.items()}) if arrays else b""
    return join(header, body)


def join(header: dict[str, Any], body: bytes | memoryview) -> bytes:
    """A frame of this header and an already serialised body (`split`'s inverse)."""
    head = json.dumps(header).encode()
    return _HEADER.pack(len(head)) + head + body


def split(frame: bytes) -> tuple[dict[str, Any], memoryview]:
    """(header, a view of the body) without decoding or copying the body: a frame's header can be read and
    rewritten while its tensors pass through untouched."""
    if len(frame) < _HEADER.size:
        raise ValueError("truncated frame")
    (n,) = _HEADER.unpack_from(frame)
    if _HEADER.size + n > len(frame):
        raise ValueError("frame header runs past its end")
    try:
        header = json.loads(frame[_HEADER.size : _HEADER.size + n])
    except (ValueError, RecursionError) as err:  # RecursionError: deep JSON
        raise ValueError(f"malformed frame: {err}") from None
    if not isinstance(header, dict):
        raise ValueError("malformed frame: the header is not an object")
    return header, memoryview(frame)[_HEADER.size + n :]


def unpack(frame: bytes) -> tuple[dict[str, Any], Arrays]:
    header, body = split(frame)
    try:
        arrays = st_load(bytes(body)) if body else {}
    except (ValueError, KeyError, SafetensorError) as err:  # KeyError: a dtype numpy lacks
        raise ValueError(f"malformed frame: {err}") from None
    return header, arrays


IO_TIMEOUT_S = 60.0  # a client that stalls mid-handshake or mid-frame is dropped after this long


def socket_in_use(socket_path: str | Path) -> bool:
    """Whether a live process accepts connections on this Unix socket (a stale file reads as free)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(socket_path))
    except (FileNotFoundError, ConnectionRefusedError):
        return False
    except OSError:
        return Path(socket_path).exists()  # e.g. a backlog that is full: someone is there
    finally:
        probe.close()
    return True


def _timeouts(sock: socket.socket, seconds: float) -> None:
    """Kernel-level send/receive timeouts, which hold for the raw reads multiprocessing's Connection does."""
    value = struct.pack("ll", int(seconds), int((seconds % 1) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)


class TrainerListener:
    """The trainer's Unix socket (mode 0600, or 0660 for `group`: the SuperNode's user connects through it, the only
    way into the cluster) with multiprocessing's HMAC handshake and I/O timeouts; the key file beside it is
    readable by the same users (0600, or 0640 for the group).

    Every accepted connection gets kernel send/receive timeouts, so a client that stalls can hold
    neither the handshake nor a read for longer than `io_timeout`.
    """

    def __init__(self, socket_path: str | Path, *, io_timeout: float = IO_TIMEOUT_S, group: int | None = None) -> None:
        path = Path(socket_path)
        if not path.parent.exists() and group is not None:  # a folder made here lets the group reach the socket
            path.parent.mkdir(parents=True, mode=0o750)
            os.chown(path.parent, -1, group)
            path.parent.chmod(0o750)
        path.parent.mkdir(parents=True, exist_ok=True)
        if socket_in_use(path):
            raise NebulaError(
                f"another trainer already serves '{path}'; stop it first, or start this one with another --socket"
            )
        path.unlink(missing_ok=True)  # a stale file left by a trainer that died
        self.key = secrets.token_bytes(32)
        kp = key_path(path)
        kp.unlink(missing_ok=True)  # a fresh file: its mode and group are the ones set below
        fd = os.open(kp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            if group is not None:
                os.fchown(handle.fileno(), -1, group)
                os.fchmod(handle.fileno(), 0o640)
            handle.write(self.key)
        self.path, self.io_timeout = path, io_timeout
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self.sock.bind(str(path))
            if group is not None:  # connecting to a Unix socket needs write permission on it
                os.chown(path, -1, group)
                path.chmod(0o660)
        finally:
            os.umask(old)
        self.sock.listen(16)

    def accept_raw(self) -> socket.socket:
        """The next connection, with its timeouts set; the handshake is `handshake`'s job (off this thread)."""
        conn, _ = self.sock.accept()
        _timeouts(conn, self.io_timeout)
        return conn

    def handshake(self, raw: socket.socket) -> Connection:
        """HMAC challenge both ways on an accepted socket (raises AuthenticationError or OSError)."""
        conn = Connection(raw.detach())
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
        except BaseException:
            conn.close()
            raise
        return conn

    def accept(self) -> Connection:
        """The next authenticated connection (handshake on this thread: for one-at-a-time servers)."""
        return self.handshake(self.accept_raw())

    def close(self) -> None:
        self.sock.close()


def listen(socket_path: str | Path) -> TrainerListener:
    """Create the trainer's socket and key file, both readable by this user only; refuse a live one."""
    return TrainerListener(socket_path)


def _connect(path: Path, *, wait_s: float) -> Connection:
    """Connect and authenticate; a trainer that is (re)starting is waited for up to `wait_s` seconds."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            key = key_path(path).read_bytes()
            return Client(str(path), family="AF_UNIX", authkey=key)
        except AuthenticationError:
            raise NebulaError(
                f"cannot reach the cluster trainer at '{path}': its key file {key_path(path)} does not match the "
                "running trainer; restart the trainer, or run the ClientApp as the user who started it"
            ) from None
        except (OSError, EOFError) as err:
            if time.monotonic() < deadline:
                time.sleep(0.5)
                continue
            raise NebulaError(
                f"cannot reach the cluster trainer at '{path}' ({err}); start it with `nebula-fl trainer "
                f"--socket {path} ...` and give the SuperNode --node-config 'trainer=\"{path}\"'"
            ) from None


def request(socket_path: str | Path, header: dict[str, Any], arrays: Arrays | None = None, *,
            wait_s: float = 0.0) -> tuple[dict[str, Any], Arrays]:
    """Send one request to a trainer and wait for its reply; a refused reply raises NebulaError.

    `wait_s`: how long to keep trying to connect while the trainer is not listening (e.g. restarting).
    """
    path = Path(socket_path)
    conn = _connect(path, wait_s=wait_s)
    with conn:
        try:
            conn.send_bytes(pack(header, arrays))
            reply, out = unpack(conn.recv_bytes())
        except (EOFError, OSError) as err:
            raise NebulaError(
                f"the cluster trainer at '{path}' closed the connection before replying "
                f"({type(err).__name__}{': ' + str(err) if str(err) else ''}): it stopped or died mid-request; "
                "see its log"
            ) from None
    if not reply.get("ok"):
        raise NebulaError(f"cluster trainer refused the request: {reply.get('error', 'no reason given')}")
    return reply, out
