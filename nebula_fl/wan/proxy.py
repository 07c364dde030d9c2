"""An emulated WAN access link: an asyncio TCP proxy between one cluster's SuperNode and the SuperLink.

Each direction of a proxy is one link shared by all of its connections, as one access link would be:
a chunk of n bytes that reaches the proxy at time t leaves the link at
``depart = max(t, previous depart) + n * 8 / rate`` and is delivered at ``depart + rtt / 2 + U(0, jitter)``,
never before the previous chunk of its own connection (jitter delays, it never reorders bytes). A new
connection costs one round trip (the TCP handshake) before its first byte goes up. Readers stop
reading while the link has more than ``MAX_BACKLOG_S`` queued, so TCP backpressure reaches the sender
and connections share the link instead of one filling an unbounded queue. Bytes are counted as they are
delivered, so the counts are what really crossed; HTTP requests are counted on the up direction
(``http_requests.py``). ``tc netem`` does the same in the kernel; this runs anywhere, unprivileged.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import time
from collections import deque
from pathlib import Path
from typing import Any

from nebula_fl.errors import ConfigError
from nebula_fl.wan.capture import CaptureWriter
from nebula_fl.wan.http_requests import HttpRequestCounter
from nebula_fl.wan.profile import DIRECTIONS, Direction, LinkProfile

READ_CHUNK = 64 * 1024  # largest read from a socket
SLICE = 16 * 1024  # largest unit the link schedules: a chunk is delivered slice by slice
MAX_BACKLOG_S = 0.025  # link queue (in seconds of serialization) above which readers pause
CLOCK_SLACK_S = 0.0005  # deliveries due this close together are written in one batch
CONNECT_TIMEOUT_S = 10.0
MAX_PATHS = 64  # distinct request paths counted by name; the rest are counted under "<other>"


class _WireClock:
    """Seconds during which any byte was on this cluster's link, either way: the union of every piece's
    [handed to the link, delivered] interval. The time the emulated WAN really took, not a model of it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.busy_until = 0.0

    def add(self, start: float, end: float) -> None:
        if end > self.busy_until:
            self.seconds += end - max(start, self.busy_until)
            self.busy_until = end


class _Link:
    """One direction of the access link: a FIFO serialization queue plus propagation delay."""

    def __init__(self, rng: random.Random, wire: _WireClock | None = None) -> None:
        self.rng = rng
        self.wire = wire
        self.rate_bps = 1.0
        self.delay_s = 0.0
        self.jitter_s = 0.0
        self.free_at = 0.0  # loop time at which the last scheduled byte has left the link

    def configure(self, rate_bps: float, delay_s: float, jitter_s: float) -> None:
        self.rate_bps, self.delay_s, self.jitter_s = rate_bps, delay_s, jitter_s

    def schedule(self, nbytes: int, arrival: float) -> float:
        """Put ``nbytes`` on the link at ``arrival``; return when its last byte reaches the far end."""
        self.free_at = max(arrival, self.free_at) + nbytes * 8 / self.rate_bps
        extra = self.rng.uniform(0.0, self.jitter_s) if self.jitter_s > 0 else 0.0
        delivered = self.free_at + self.delay_s + extra
        if self.wire is not None:
            self.wire.add(arrival, delivered)
        return delivered

    def read_size(self) -> int:
        """Bytes to read at once: about MAX_BACKLOG_S of serialization, between one slice and READ_CHUNK."""
        return min(READ_CHUNK, max(SLICE, int(self.rate_bps / 8 * MAX_BACKLOG_S)))

    def buffer_cap(self) -> int:
        """Bytes one connection may hold undelivered: twice what is in flight on the link, at least 1 MiB."""
        in_flight = self.rate_bps / 8 * (self.delay_s + self.jitter_s + MAX_BACKLOG_S)
        return max(1 << 20, int(2 * in_flight) + 2 * READ_CHUNK)


class _Pipe:
    """One direction of one connection: read, schedule on the shared link, deliver on time, in order."""

    def __init__(self, proxy: WanProxy, direction: Direction, src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                 *, not_before: float, counter: HttpRequestCounter | None, connection: int = 0) -> None:
        self.proxy, self.direction, self.src, self.dst = proxy, direction, src, dst
        self.connection = connection
        self.link = proxy._links[direction]
        self.not_before = not_before
        self.counter = counter
        self.items: deque[tuple[float, bytes | None]] = deque()
        self.queued = 0
        self.last = 0.0
        self.has_items = asyncio.Event()
        self.has_room = asyncio.Event()

    def _push(self, at: float, data: bytes | None) -> None:
        self.last = at
        self.items.append((at, data))
        self.queued += len(data) if data else 0
        self.has_items.set()

    async def read_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while True:
                ahead = self.link.free_at - loop.time() - MAX_BACKLOG_S
                if ahead > 0:
                    await asyncio.sleep(ahead)
                elif self.queued > self.link.buffer_cap():
                    self.has_room.clear()
                    await self.has_room.wait()
                else:
                    break
            data = await self.src.read(self.link.read_size())
            now = max(loop.time(), self.not_before)
            if not data:
                self._push(max(self.last, now + self.link.delay_s), None)
                return
            if self.counter is not None and not self.counter.opaque:
                self.proxy._count_requests(self.counter, self.counter.feed(data))
            for offset in range(0, len(data), SLICE):
                piece = data[offset : offset + SLICE]
                self._push(max(self.link.schedule(len(piece), now), self.last), piece)

    async def write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self.items:
                self.has_items.clear()
                await self.has_items.wait()
            wait = self.items[0][0] - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            due = loop.time() + CLOCK_SLACK_S
            batch: list[bytes] = []
            eof = False
            while self.items and self.items[0][0] <= due:
                piece = self.items.popleft()[1]
                if piece is None:
                    eof = True
                    break
                batch.append(piece)
            if self.dst.is_closing():
                raise ConnectionResetError(f"the {self.direction} side closed while the proxy was delivering")
            if batch:
                nbytes = sum(map(len, batch))
                self.dst.writelines(batch)
                if self.proxy._capture is not None:
                    self.proxy._capture.record(self.direction, self.connection, batch)
                self.queued -= nbytes
                self.has_room.set()
                self.proxy._bytes[self.direction] += nbytes
                await self.dst.drain()
            if eof:
                if self.dst.can_write_eof():
                    self.dst.write_eof()
                return


def _reset(writer: asyncio.StreamWriter | None) -> None:
    """Close a connection abruptly: SO_LINGER 0 makes the kernel send RST instead of FIN."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class _Connection:
    def __init__(self, client: asyncio.StreamWriter, task: asyncio.Task | None) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.task = task
        self.reset = False
        self.number = 0  # 1, 2, ... in order of acceptance: names the connection in a capture

    def abort(self, *, cancel: bool = True) -> None:
        """Reset both sockets; ``cancel`` also ends the connection's task (from outside it)."""
        self.reset = True
        _reset(self.client)
        _reset(self.upstream)
        if cancel and self.task is not None:
            self.task.cancel()

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            if writer is not None and not writer.is_closing():
                writer.close()


class WanProxy:
    """A TCP proxy from ``listen_host:listen_port`` to ``target_host:target_port`` over an emulated link.

    ``await start()`` binds (``listen_port=0`` picks a free port) and returns the port; ``await stop()``
    resets every connection and returns once all of the proxy's tasks have ended. ``seed`` makes the
    jitter reproducible for the same arrival times. ``capture``, a file path, appends every byte
    forwarded each way to it (``capture.py``); off by default.
    """

    def __init__(self, *, listen_host: str = "127.0.0.1", listen_port: int = 0, target_host: str,
                 target_port: int, profile: LinkProfile, seed: int = 0, handshake: bool = True,
                 capture: str | Path | None = None) -> None:
        if not isinstance(profile, LinkProfile):
            raise ConfigError(f"WanProxy needs a LinkProfile, got {type(profile).__name__}; use parse_profile('20mbit:100ms')")
        for name, port, low in (("listen_port", listen_port, 0), ("target_port", target_port, 1)):
            if isinstance(port, bool) or not isinstance(port, int) or not low <= port <= 65535:
                raise ConfigError(f"WanProxy {name} is {port!r}; pass a TCP port between {low} and 65535")
        for name, host in (("listen_host", listen_host), ("target_host", target_host)):
            if not isinstance(host, str) or not host:
                raise ConfigError(f"WanProxy {name} is {host!r}; pass a host name or address such as 127.0.0.1")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"WanProxy seed is {seed!r}; pass an integer")
        self.listen_host, self.listen_port = listen_host, listen_port
        self.target_host, self.target_port = target_host, target_port
        self.handshake = handshake
        self._wire = _WireClock()
        self._links: dict[Direction, _Link] = {d: _Link(random.Random(f"{seed}:{d}"), self._wire) for d in DIRECTIONS}
        self._profile = profile
        self.set_profile(profile)
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()
        self._bytes: dict[Direction, int] = dict.fromkeys(DIRECTIONS, 0)
        self._connections = 0
        self._requests = 0
        self._paths: dict[str, int] = {}
        self._unparsed = 0
        self._upstream_failures = 0
        self._dropped = 0
        self._drops = 0
        self._started_at: float | None = None
        self.capture_path = None if capture is None else Path(capture)
        self._capture: CaptureWriter | None = None

    @property
    def profile(self) -> LinkProfile:
        return self._profile

    @property
    def port(self) -> int:
        """The bound port (after ``start``)."""
        if self._server is None:
            raise RuntimeError("the WAN proxy is not running; await start() first")
        return self.listen_port

    def set_profile(self, profile: LinkProfile) -> None:
        """Change the link live: bytes already scheduled keep their times, new bytes use the new profile."""
        if not isinstance(profile, LinkProfile):
            raise ConfigError(f"set_profile needs a LinkProfile, got {type(profile).__name__}; use parse_profile(text)")
        self._profile = profile
        for direction in DIRECTIONS:
            self._links[direction].configure(profile.rate_bps(direction), profile.one_way_s, profile.jitter_s)

    async def start(self) -> int:
        if self._server is not None:
            raise RuntimeError("the WAN proxy is already running")
        try:
            self._server = await asyncio.start_server(self._serve, self.listen_host, self.listen_port,
                                                      limit=4 * READ_CHUNK)
        except OSError as err:
            raise ConfigError(
                f"the WAN proxy cannot listen on {self.listen_host}:{self.listen_port} ({err.strerror or err}); "
                f"pick a free port, or 0 to let the system choose one"
            ) from None
        self.listen_port = int(self._server.sockets[0].getsockname()[1])
        if self.capture_path is not None:
            try:
                self._capture = CaptureWriter(self.capture_path)
            except OSError as err:
                await self.stop()
                raise ConfigError(f"the WAN proxy cannot write its capture to {self.capture_path} "
                                  f"({err.strerror or err}); pass a writable --capture path") from None
        self._started_at = time.time()
        return self.listen_port

    async def stop(self) -> None:
        """Stop listening, reset every open connection and wait for all of their tasks."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        tasks = [c.task for c in conns if c.task is not None and c.task is not asyncio.current_task()]
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
        if self._capture is not None:
            self._capture.close()
            self._capture = None

    def drop_connections(self) -> int:
        """Reset every open connection on both sides, as a link outage would; return how many."""
        conns = list(self._conns)
        for conn in conns:
            conn.abort()
        self._drops += 1
        self._dropped += len(conns)
        return len(conns)

    def stats(self) -> dict[str, Any]:
        """Cumulative counters since start (monotone), plus what is open now and the current profile."""
        return {
            "bytes_up": self._bytes["up"],
            "bytes_down": self._bytes["down"],
            "wire_seconds": self._wire.seconds,
            "connections": self._connections,
            "open_connections": len(self._conns),
            "requests": self._requests,
            "requests_by_path": dict(self._paths),
            "unparsed_connections": self._unparsed,
            "upstream_failures": self._upstream_failures,
            "dropped": self._dropped,
            "drops": self._drops,
            "started_at": self._started_at,
            "listen": f"{self.listen_host}:{self.listen_port}",
            "target": f"{self.target_host}:{self.target_port}",
            "profile": self._profile.to_json(),
        }

    def _count_requests(self, counter: HttpRequestCounter, paths: list[str]) -> None:
        self._requests += len(paths)
        for path in paths:
            key = path if path in self._paths or len(self._paths) < MAX_PATHS else "<other>"
            self._paths[key] = self._paths.get(key, 0) + 1
        if counter.opaque:
            self._unparsed += 1

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        accepted = loop.time()
        conn = _Connection(client_writer, asyncio.current_task())
        if self._server is None:  # accepted just before stop(): refuse it rather than outlive the proxy
            conn.abort(cancel=False)
            return
        self._conns.add(conn)
        self._connections += 1
        conn.number = self._connections
        try:
            await self._relay(conn, client_reader, accepted)
        except asyncio.CancelledError:
            pass  # dropped or stopped: the sockets are already reset, and this task is the proxy's own
        except OSError:
            conn.abort(cancel=False)
        finally:
            if not conn.reset:
                conn.close()
            self._conns.discard(conn)

    async def _relay(self, conn: _Connection, client_reader: asyncio.StreamReader, accepted: float) -> None:
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port, limit=4 * READ_CHUNK), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            self._upstream_failures += 1
            conn.reset = True
            _reset(conn.client)  # the client sees a reset, as if the far end refused it
            return
        conn.upstream = up_writer
        not_before = accepted + self._profile.rtt_s if self.handshake else 0.0
        up = _Pipe(self, "up", client_reader, up_writer, not_before=not_before, counter=HttpRequestCounter(),
                   connection=conn.number)
        down = _Pipe(self, "down", up_reader, conn.client, not_before=0.0, counter=None, connection=conn.number)
        tasks = [asyncio.create_task(c) for c in (up.read_loop(), up.write_loop(), down.read_loop(), down.write_loop())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if any(not t.cancelled() and t.exception() is not None for t in done):
                conn.abort(cancel=False)  # one side failed: reset the other too, as a middlebox losing state would
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
