"""The WAN proxy in this process, against small asyncio servers on 127.0.0.1 (bounded sizes and times)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import statistics
import time

import pytest

from nebula_fl.wan import WanProxy, parse_profile, wan_seconds

HOST = "127.0.0.1"


def arun(coro, timeout: float = 20.0):
    """Run one test coroutine on a fresh loop, bounded; fail if it leaves a task behind."""

    async def bounded():
        result = await asyncio.wait_for(coro, timeout)
        await asyncio.sleep(0)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        assert not left, f"tasks left running: {left}"
        return result

    return asyncio.run(bounded())


class Servers:
    """Echo, sink (reads to EOF, answers the count and its first/last byte times) and source servers."""

    def __init__(self) -> None:
        self.servers: list[asyncio.Server] = []
        self.closed = asyncio.Event()
        self.handlers: set[asyncio.Task] = set()

    async def _start(self, handler) -> int:
        async def tracked(reader, writer):
            task = asyncio.current_task()
            self.handlers.add(task)
            try:
                await handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                self.closed.set()
                writer.close()
                self.handlers.discard(task)

        server = await asyncio.start_server(tracked, HOST, 0)
        self.servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def echo(self) -> int:
        async def handle(reader, writer):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

        return await self._start(handle)

    async def sink(self) -> int:
        async def handle(reader, writer):
            n, first, last, digest = 0, None, None, hashlib.sha256()
            while data := await reader.read(65536):
                last = time.monotonic()
                first = first or last
                n += len(data)
                digest.update(data)
            writer.write(f"{n} {first} {last} {digest.hexdigest()}\n".encode())
            await writer.drain()

        return await self._start(handle)

    async def source(self) -> int:
        """Reads 'N\\n', then sends N bytes and closes."""

        async def handle(reader, writer):
            n = int(await reader.readline())
            writer.write(b"d" * n)
            await writer.drain()

        return await self._start(handle)

    async def rpc(self) -> int:
        """Request 'N M\\n' + N bytes, answered with M bytes once the whole request is in (as HTTP would)."""

        async def handle(reader, writer):
            while line := await reader.readline():
                n, m = map(int, line.split())
                await reader.readexactly(n)
                writer.write(b"a" * m)
                await writer.drain()

        return await self._start(handle)

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for task in list(self.handlers):
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        for server in self.servers:
            await server.wait_closed()


@contextlib.asynccontextmanager
async def setup(profile: str, server: str = "echo", **kw):
    servers = Servers()
    port = await getattr(servers, server)()
    proxy = WanProxy(target_host=HOST, target_port=port, profile=parse_profile(profile), **kw)
    await proxy.start()
    try:
        yield proxy, servers
    finally:
        await proxy.stop()
        await servers.close()


async def upload(port: int, data: bytes) -> tuple[float, list[str]]:
    """Send ``data`` to the sink through the proxy; return the seconds until its answer, and the answer."""
    start = time.monotonic()
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(data)
    await writer.drain()
    writer.write_eof()
    answer = (await reader.readline()).decode().split()
    elapsed = time.monotonic() - start
    writer.close()
    return elapsed, answer


async def wait_for(condition, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def within(measured: float, expected: float, rel: float) -> bool:
    return abs(measured - expected) <= rel * expected


def test_exact_bytes_both_ways_for_a_known_exchange():
    async def main():
        async with setup("100mbit:0ms") as (proxy, _):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            sizes, total = [1, 1000, 65536, 200_001, 7], 0
            for size in sizes:
                blob = os.urandom(size)
                writer.write(blob)
                assert await reader.readexactly(size) == blob
                total += size
            writer.write_eof()
            assert await reader.read() == b""  # the echo server's FIN came through
            writer.close()
            await wait_for(lambda: proxy.stats()["open_connections"] == 0)
            stats = proxy.stats()
            assert (stats["bytes_up"], stats["bytes_down"]) == (total, total) == (266_545, 266_545)
            assert stats["connections"] == 1 and stats["dropped"] == 0
            assert stats["profile"]["spec"] == "100mbit:0ms" and stats["started_at"] <= time.time()

    arun(main())


def test_bulk_upload_runs_at_the_configured_rate():
    async def main():
        async with setup("8mbit:0ms", "sink") as (proxy, _):
            data = os.urandom(1_000_000)
            elapsed, answer = await upload(proxy.port, data)
            assert answer[0] == "1000000" and answer[3] == hashlib.sha256(data).hexdigest()
            assert within(elapsed, 1.0, 0.10), elapsed  # 1 MB x 8 / 8 Mbit/s = 1.0 s
            assert proxy.stats()["bytes_up"] == 1_000_000

    arun(main())


def test_asymmetric_rates_apply_per_direction():
    async def main():
        async with setup("4mbit/16mbit:0ms", "sink") as (proxy, _):  # down 4, up 16 Mbit/s
            elapsed, _ = await upload(proxy.port, os.urandom(1_000_000))
            assert within(elapsed, 0.5, 0.10), elapsed
        async with setup("4mbit/16mbit:0ms", "source") as (proxy, _):
            start = time.monotonic()
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            writer.write(b"500000\n")
            got = await reader.read()
            elapsed = time.monotonic() - start
            writer.close()
            assert len(got) == 500_000 and proxy.stats()["bytes_down"] == 500_000
            assert within(elapsed, 1.0, 0.10), elapsed  # 500 kB x 8 / 4 Mbit/s

    arun(main())


def test_connections_of_one_proxy_share_its_link():
    async def main():
        async with setup("8mbit:0ms", "sink") as (proxy, _):
            results = await asyncio.gather(*(upload(proxy.port, os.urandom(500_000)) for _ in range(2)))
            slowest = max(elapsed for elapsed, _ in results)
            assert within(slowest, 1.0, 0.10), results  # together 1 MB over one 8 Mbit/s link

    arun(main())


async def exchange_seconds(reader, writer, size: int = 100) -> float:
    start = time.monotonic()
    writer.write(b"p" * size)
    await reader.readexactly(size)
    return time.monotonic() - start


def test_small_messages_take_one_rtt_after_the_handshake_and_set_profile_applies_live():
    async def main():
        async with setup("1gbit:100ms") as (proxy, _):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            first = await exchange_seconds(reader, writer)
            assert within(first, 0.2, 0.2), first  # the TCP handshake's round trip, then the exchange
            warm = [await exchange_seconds(reader, writer) for _ in range(4)]
            assert all(within(t, 0.1, 0.2) for t in warm), warm
            proxy.set_profile(parse_profile("1gbit:20ms"))
            faster = statistics.median([await exchange_seconds(reader, writer) for _ in range(5)])
            assert abs(faster - 0.02) <= 0.005, faster
            assert proxy.stats()["profile"]["rtt_s"] == 0.02
            writer.close()

    arun(main())


def test_handshake_emulation_can_be_turned_off():
    async def main():
        async with setup("1gbit:100ms", handshake=False) as (proxy, _):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            assert within(await exchange_seconds(reader, writer), 0.1, 0.2)
            writer.close()

    arun(main())


def test_jitter_never_reorders_or_corrupts_bytes():
    async def main():
        async with setup("50mbit:10ms:20ms", "sink", seed=3) as (proxy, _):
            rng = random.Random(1)
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            sent = hashlib.sha256()
            total = 0
            for _ in range(300):
                piece = rng.randbytes(rng.randint(1, 3000))
                sent.update(piece)
                total += len(piece)
                writer.write(piece)
                await asyncio.sleep(0.001)  # separate reads, so pieces get separate (jittered) deliveries
            writer.write_eof()
            answer = (await reader.readline()).decode().split()
            writer.close()
            assert int(answer[0]) == total and answer[3] == sent.hexdigest()

        async with setup("50mbit:10ms:20ms", seed=4) as (proxy, _):  # and both ways through an echo
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            blob = os.urandom(400_000)

            async def send():
                for offset in range(0, len(blob), 2000):
                    writer.write(blob[offset : offset + 2000])
                    await asyncio.sleep(0.0005)

            sender = asyncio.create_task(send())
            echoed = await reader.readexactly(len(blob))
            await sender
            writer.close()
            assert echoed == blob

    arun(main())


def test_drop_connections_resets_both_sides_and_later_connections_work():
    async def main():
        async with setup("100mbit:2ms") as (proxy, servers):
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            assert await exchange_seconds(reader, writer) < 1
            assert proxy.drop_connections() == 1
            try:
                assert await asyncio.wait_for(reader.read(), 2) == b""
            except ConnectionResetError:
                pass  # the RST arrived before the read: also a drop
            await asyncio.wait_for(servers.closed.wait(), 2)  # the far end saw it too
            writer.close()
            reader2, writer2 = await asyncio.open_connection(HOST, proxy.port)
            assert await exchange_seconds(reader2, writer2) < 1
            writer2.close()
            stats = proxy.stats()
            assert (stats["dropped"], stats["drops"], stats["connections"]) == (1, 1, 2)
            assert proxy.drop_connections() in (0, 1) and proxy.stats()["drops"] == 2

    arun(main())


def test_stop_resets_open_connections_and_leaves_nothing_running():
    async def main():
        servers = Servers()
        proxy = WanProxy(target_host=HOST, target_port=await servers.sink(), profile=parse_profile("1mbit:50ms"))
        port = await proxy.start()
        reader, writer = await asyncio.open_connection(HOST, port)
        writer.write(os.urandom(300_000))  # 2.4 s at 1 Mbit/s: still in flight at stop()
        await asyncio.sleep(0.2)
        await proxy.stop()
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection(HOST, port)
        await proxy.stop()  # idempotent
        await servers.close()

    arun(main())


def test_an_unreachable_target_resets_the_client_and_is_counted():
    async def main():
        probe = await asyncio.start_server(lambda r, w: None, HOST, 0)
        dead_port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()
        proxy = WanProxy(target_host=HOST, target_port=dead_port, profile=parse_profile("10mbit:10ms"))
        port = await proxy.start()
        reader, writer = await asyncio.open_connection(HOST, port)
        with contextlib.suppress(ConnectionResetError):
            assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()
        assert proxy.stats()["upstream_failures"] == 1
        await proxy.stop()

    arun(main())


def test_http_requests_on_keep_alive_connections_are_counted_by_path():
    async def http_server(reader, writer):
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while line := await reader.readline():
                if not line.strip():
                    continue
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(http_server, HOST, 0)
        proxy = WanProxy(target_host=HOST, target_port=server.sockets[0].getsockname()[1],
                         profile=parse_profile("100mbit:1ms"))
        port = await proxy.start()
        reader, writer = await asyncio.open_connection(HOST, port)
        sizes = [0, 10, 70_000, 300_000, 5]
        for i, size in enumerate(sizes):
            path = "/v1/fleet/push-object" if size else "/v1/fleet/pull-messages"
            request = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {size}\r\n\r\n".encode() + b"r" * size
            for offset in range(0, len(request), 4099 + i):  # awkward splits across header and body
                writer.write(request[offset : offset + 4099 + i])
                await writer.drain()
            await reader.readuntil(b"ok")
        writer.close()
        await wait_for(lambda: proxy.stats()["open_connections"] == 0)
        stats = proxy.stats()
        assert stats["requests"] == 5 and stats["unparsed_connections"] == 0
        assert stats["requests_by_path"] == {"/v1/fleet/pull-messages": 1, "/v1/fleet/push-object": 4}
        await proxy.stop()
        server.close()
        await server.wait_closed()

    arun(main())


async def rpc_workload(proxy: WanProxy, connections: int, calls: list[tuple[int, int]]) -> tuple[float, dict]:
    """Run ``calls`` (request bytes, reply bytes) on each of ``connections`` warm connections at once."""
    conns = [await asyncio.open_connection(HOST, proxy.port) for _ in range(connections)]

    async def call(reader, writer, up: int, down: int) -> None:
        writer.write(f"{up} {down}\n".encode() + b"u" * up)
        await reader.readexactly(down)

    await asyncio.gather(*(call(r, w, 0, 1) for r, w in conns))  # warm: the handshakes are done
    before = proxy.stats()

    async def worker(reader, writer):
        for up, down in calls:
            await call(reader, writer, up, down)

    start = time.monotonic()
    await asyncio.gather(*(worker(r, w) for r, w in conns))
    measured = time.monotonic() - start
    for _, writer in conns:
        writer.close()
    after = proxy.stats()
    return measured, {k: after[k] - before[k] for k in ("bytes_up", "bytes_down")}


CALLS = [(100_000, 100)] * 4 + [(100, 100_000)] * 4  # 4 uploads of 100 kB, then 4 downloads of 100 kB


def test_the_model_is_exact_for_requests_one_at_a_time():
    async def main():
        async with setup("20mbit:50ms", "rpc") as (proxy, _):
            measured, moved = await rpc_workload(proxy, 1, CALLS)
            predicted = wan_seconds(profile=proxy.profile, **moved, requests_up=4, requests_down=4, max_in_flight=1)
            assert within(predicted, 0.16 + 0.16 + 8 * 0.05, 0.01), predicted  # 0.72 s
            assert within(measured, predicted, 0.10), (measured, predicted)

    arun(main())


def test_the_model_bounds_two_requests_in_flight_from_above():
    """Two in flight overlap one's serialization with the other's round trip, which the sum ignores."""

    async def main():
        async with setup("20mbit:50ms", "rpc") as (proxy, _):
            measured, moved = await rpc_workload(proxy, 2, CALLS)
            predicted = wan_seconds(profile=proxy.profile, **moved, requests_up=8, requests_down=8)
            assert within(predicted, 0.32 + 0.32 + 8 * 0.05, 0.01), predicted  # 1.04 s
            bandwidth = proxy.profile.transfer_seconds(moved["bytes_up"], "up") + proxy.profile.transfer_seconds(
                moved["bytes_down"], "down")
            assert 0.95 * max(bandwidth, 8 * 0.05) <= measured <= 1.05 * predicted, (measured, predicted)

    arun(main())


def test_constructor_validates_its_arguments():
    profile = parse_profile("10mbit:10ms")
    with pytest.raises(ValueError, match="target_port"):
        WanProxy(target_host=HOST, target_port=0, profile=profile)
    with pytest.raises(ValueError, match="listen_port"):
        WanProxy(target_host=HOST, target_port=80, listen_port=70000, profile=profile)
    with pytest.raises(ValueError, match="LinkProfile"):
        WanProxy(target_host=HOST, target_port=80, profile="10mbit:10ms")
    with pytest.raises(ValueError, match="target_host"):
        WanProxy(target_host="", target_port=80, profile=profile)
    proxy = WanProxy(target_host=HOST, target_port=80, profile=profile)
    with pytest.raises(RuntimeError, match="start"):
        _ = proxy.port


def test_a_busy_listen_port_is_a_clear_error():
    async def main():
        blocker = await asyncio.start_server(lambda r, w: None, HOST, 0)
        busy = blocker.sockets[0].getsockname()[1]
        proxy = WanProxy(listen_port=busy, target_host=HOST, target_port=80, profile=parse_profile("10mbit:1ms"))
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{busy}"):
            await proxy.start()
        blocker.close()
        await blocker.wait_closed()

    arun(main())
