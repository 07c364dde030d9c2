import random

import pytest

from nebula_fl.wan.http_requests import MAX_LINE, HttpRequestCounter

BODY = b"x" * 3000 + b"\r\n\r\nPOST /inside-a-body HTTP/1.1\r\n\r\n" + b"y" * 500
STREAM = (
    b"\r\n"  # a stray CRLF before the first request line is allowed
    b"POST /v1/fleet/push-object HTTP/1.1\r\nHost: x\r\nContent-Type: application/protobuf\r\n"
    b"Content-Length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
    + b"GET /v1/fleet/get-run?x=1 HTTP/1.1\r\nHost: x\r\n\r\n"
    + b"POST /chunked HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n1A\r\n" + b"GET / HTTP/1.1\r\n\r\n" + b"z" * 8 + b"\r\n0\r\nTrailer: t\r\n\r\n"
    + b"POST /v1/fleet/pull-object HTTP/1.0\nContent-Length: 3\n\nabc"  # bare LF line ends
    + b"POST /empty HTTP/1.1\r\ncontent-length:0\r\n\r\n"
)
PATHS = ["/v1/fleet/push-object", "/v1/fleet/get-run", "/chunked", "/v1/fleet/pull-object", "/empty"]


def feed_split(data: bytes, cuts: list[int]) -> tuple[HttpRequestCounter, list[str]]:
    counter, seen, last = HttpRequestCounter(), [], 0
    for cut in [*sorted(cuts), len(data)]:
        seen += counter.feed(data[last:cut])
        last = cut
    return counter, seen


def test_pipelined_requests_are_framed_exactly_however_the_stream_is_split():
    rng = random.Random(0)
    splits = [[], list(range(1, len(STREAM)))]  # whole, and byte by byte
    splits += [rng.sample(range(1, len(STREAM)), rng.randint(1, 40)) for _ in range(200)]
    for cuts in splits:
        counter, seen = feed_split(STREAM, cuts)
        assert seen == PATHS, cuts
        assert counter.requests == len(PATHS) and not counter.opaque


@pytest.mark.parametrize(
    ("stream", "requests", "reason"),
    [
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40) + b"\n", 0, "not an HTTP/1.x request line"),
        (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 0, "not an HTTP/1.x request line"),
        (b"GET /ws HTTP/1.1\r\nUpgrade: websocket\r\n\r\nbinary frames", 1, "switched protocol"),
        (b"CONNECT host:443 HTTP/1.1\r\n\r\n\x16\x03", 1, "switched protocol"),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 1, "Transfer-Encoding"),
        (b"POST / HTTP/1.1\r\nContent-Length: 1e3\r\n\r\n", 1, "Content-Length"),
        (b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 1, "Content-Length"),
        (b"POST / HTTP/1.1\r\nno colon here\r\n\r\n", 1, "without ':'"),
        (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 1, "chunk size"),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * (MAX_LINE + 10), 1, "longer than"),
    ],
)
def test_streams_it_cannot_frame_become_opaque_and_stop_counting(stream, requests, reason):
    counter = HttpRequestCounter()
    counter.feed(stream)
    assert counter.opaque and reason in counter.opaque_reason
    assert counter.requests == requests
    assert counter.feed(b"GET / HTTP/1.1\r\n\r\n") == []  # opaque for good: a lower bound, never a guess


def test_a_request_counts_at_its_request_line_before_its_body_arrives():
    counter = HttpRequestCounter()
    assert counter.feed(b"POST /v1/fleet/push-object HTTP/1.1\r\nContent-Length: 100\r\n") == ["/v1/fleet/push-object"]
    assert counter.feed(b"\r\n" + b"b" * 99) == []
    assert counter.feed(b"bGET /next HTTP/1.1\r\n\r\n") == ["/next"]
