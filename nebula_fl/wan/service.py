"""The WAN proxy as its own process: ``python -m nebula_fl.wan``, one per cluster, started by the launcher.

It runs the proxy and a control server on a Unix socket (``control.py``), prints one ready line —
``wan proxy listening on HOST:PORT -> TARGET (PROFILE)`` — once both are listening, and on SIGTERM,
SIGINT or ``{"op": "stop"}`` resets its connections, removes the socket file and exits with status 0.
``--capture FILE`` (or, for the proxies the launcher starts, ``NEBULA_WAN_CAPTURE_DIR`` in the
environment: ``<dir>/<control socket name>.cap``) records every byte forwarded (``capture.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
import sys
from collections.abc import Sequence
from pathlib import Path

from nebula_fl.errors import ConfigError, NebulaError
from nebula_fl.wan.capture import CAPTURE_DIR_ENV
from nebula_fl.wan.control import MAX_LINE, answer, query_proxy
from nebula_fl.wan.profile import LinkProfile, parse_profile
from nebula_fl.wan.proxy import WanProxy

__all__ = ["main", "parse_target", "query_proxy", "run_proxy"]

MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


def parse_target(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) as a (host, port) pair."""
    host, sep, port = text.strip().rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"WAN proxy target {text!r} is not HOST:PORT; write it like 127.0.0.1:8000")
    return host, int(port)


def _claim_socket_path(path: Path) -> None:
    """Make ``path`` free for a new socket: refuse a live one or a non-socket, remove a stale one."""
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(f"control socket path {path} is {len(os.fsencode(path))} bytes; Unix sockets allow "
                          f"{MAX_SOCKET_PATH}, so choose a shorter --control path")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"control socket path {path} exists and is not a socket; remove it or choose another --control")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # stale: left by a proxy that was killed
            return
    raise ConfigError(f"another process is listening on the control socket {path}; stop it or choose another --control")


async def _serve(proxy: WanProxy, control_socket: Path, stopping: asyncio.Event) -> None:
    sessions: set[asyncio.Task] = set()

    async def session(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            sessions.add(task)
        try:
            while line := await reader.readline():
                try:
                    reply = answer(proxy, json.loads(line), on_stop=stopping.set)
                except ValueError:
                    reply = {"ok": False, "error": "a request is one line of JSON, e.g. {\"op\": \"stats\"}"}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, ValueError, asyncio.LimitOverrunError, asyncio.CancelledError):
            pass  # a client that hung up, sent an over-long line, or a proxy that is stopping
        finally:
            writer.close()
            if task is not None:
                sessions.discard(task)

    _claim_socket_path(control_socket)
    old = os.umask(0o177)
    try:
        control = await asyncio.start_unix_server(session, path=str(control_socket), limit=MAX_LINE)
    finally:
        os.umask(old)
    created = control_socket.stat().st_ino
    try:
        os.chmod(control_socket, 0o600)
        print(f"wan proxy listening on {proxy.listen_host}:{proxy.port} -> {proxy.target_host}:{proxy.target_port} "
              f"({proxy.profile.spec})", flush=True)
        await stopping.wait()
    finally:
        control.close()
        for task in list(sessions):
            task.cancel()
        await asyncio.gather(*sessions, return_exceptions=True)
        with contextlib.suppress(OSError):
            if control_socket.stat().st_ino == created:  # never remove a successor's socket
                control_socket.unlink()


async def _run(proxy: WanProxy, control_socket: Path) -> None:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    handled: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stopping.set)
            handled.append(sig)
        except (ValueError, RuntimeError, NotImplementedError):
            pass  # not the main thread: stop it with {"op": "stop"}
    await proxy.start()
    try:
        await _serve(proxy, control_socket, stopping)
    finally:
        for sig in handled:
            loop.remove_signal_handler(sig)
        await proxy.stop()


def run_proxy(*, listen_port: int, target: str, profile: LinkProfile | str, control_socket: str | Path,
              listen_host: str = "127.0.0.1", seed: int = 0, capture: str | Path | None = None) -> None:
    """Run a WAN proxy to ``target`` (``HOST:PORT``) until SIGTERM, SIGINT or a ``stop`` request.

    Blocks; prints the ready line (flushed) once the proxy and its control socket both listen.
    """
    host, port = parse_target(target)
    link = parse_profile(profile) if isinstance(profile, str) else profile
    proxy = WanProxy(listen_host=listen_host, listen_port=listen_port, target_host=host, target_port=port,
                     profile=link, seed=seed, capture=capture)
    asyncio.run(_run(proxy, Path(control_socket)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nebula_fl.wan",
        description="Emulate one cluster's WAN link: a TCP proxy to the SuperLink with a rate each way, latency "
        "and jitter, counting the bytes and HTTP requests that pass. Point the SuperNode at it with "
        "--superlink HOST:LISTEN_PORT.",
    )
    parser.add_argument("--listen-host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--listen-port", type=int, default=0, help="port to listen on (0 picks a free one)")
    parser.add_argument("--target", required=True, help="the SuperLink, HOST:PORT, e.g. 127.0.0.1:8000")
    parser.add_argument("--profile", required=True,
                        help="RATE:RTT[:JITTER], RATE = R or DOWN/UP, e.g. 20mbit:100ms or 100mbit/20mbit:50ms:5ms")
    parser.add_argument("--control", required=True, help="Unix socket path for stats/drop/set_profile requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter")
    parser.add_argument("--capture", metavar="FILE",
                        help=f"append every byte forwarded, each way, to FILE (off by default; ${CAPTURE_DIR_ENV} "
                        "sets a folder for it instead)")
    args = parser.parse_args(argv)
    capture = args.capture
    if capture is None and os.environ.get(CAPTURE_DIR_ENV):
        capture = Path(os.environ[CAPTURE_DIR_ENV]) / f"{Path(args.control).stem}.cap"
    try:
        run_proxy(listen_port=args.listen_port, target=args.target, profile=args.profile,
                  control_socket=Path(args.control), listen_host=args.listen_host, seed=args.seed, capture=capture)
    except NebulaError as err:
        print(f"nebula-fl wan: error: {err}", file=sys.stderr)
        return 2
    return 0
