"""Count the HTTP/1.x requests in one connection's client -> server byte stream, as it passes.

Flower 1.42's SuperNode sends every Fleet call (and every array object) as its own ``POST`` with a
``Content-Length`` body over keep-alive HTTP/1.1 connections, so request boundaries follow from the
headers alone. The parser only walks the framing (request line, headers, a ``Content-Length`` or
``chunked`` body, pipelined or not) and never buffers a body. Anything it cannot frame for certain —
not HTTP/1.x (TLS, HTTP/2), a request that switches protocol (``Upgrade``, ``CONNECT``), a
``Transfer-Encoding`` other than chunked, oversized headers — makes the stream *opaque*: counting
stops there, so the totals are exact for parseable streams and a lower bound otherwise.
"""

from __future__ import annotations

import re

_START, _HEADERS, _BODY, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILERS, _OPAQUE = range(8)
_REQUEST_LINE = re.compile(rb"^([A-Z]+) (\S+) HTTP/1\.[01]$")
MAX_LINE = 16 * 1024
MAX_HEAD = 64 * 1024


class HttpRequestCounter:
    """Incremental framing of HTTP/1.x requests; ``feed`` returns the paths of requests that began."""

    def __init__(self) -> None:
        self.requests = 0
        self.opaque_reason: str | None = None
        self._state = _START
        self._buf = bytearray()
        self._remaining = 0
        self._head_bytes = 0
        self._length: int | None = None
        self._chunked = False
        self._switches = False

    @property
    def opaque(self) -> bool:
        return self._state == _OPAQUE

    def feed(self, data: bytes) -> list[str]:
        """Walk ``data`` (the next bytes of the stream); return the path of each request line seen."""
        started: list[str] = []
        i, n = 0, len(data)
        while i < n and self._state != _OPAQUE:
            if self._state in (_BODY, _CHUNK_DATA):
                take = min(self._remaining, n - i)
                i += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _START if self._state == _BODY else _CHUNK_END
                continue
            j = data.find(b"\n", i)
            if j < 0:
                self._buf += data[i:]
                i = n
                if len(self._buf) > MAX_LINE:
                    self._give_up(f"a line longer than {MAX_LINE} bytes")
                continue
            if self._buf:
                self._buf += data[i:j]
                line = bytes(self._buf)
                self._buf.clear()
            else:
                line = data[i:j]
            i = j + 1
            if len(line) > MAX_LINE:
                self._give_up(f"a line longer than {MAX_LINE} bytes")
                break
            self._line(line[:-1] if line.endswith(b"\r") else line, started)
        return started

    def _give_up(self, reason: str) -> None:
        self._state = _OPAQUE
        self.opaque_reason = reason
        self._buf.clear()

    def _line(self, line: bytes, started: list[str]) -> None:
        state = self._state
        if state == _START:
            if not line:
                return  # RFC 9112: ignore empty lines before a request line
            match = _REQUEST_LINE.match(line)
            if not match:
                self._give_up(f"not an HTTP/1.x request line: {line[:40]!r}")
                return
            self.requests += 1
            started.append(match.group(2).split(b"?", 1)[0].decode("latin-1"))
            self._state, self._head_bytes = _HEADERS, len(line)
            self._length, self._chunked, self._switches = None, False, match.group(1) == b"CONNECT"
        elif state == _HEADERS:
            self._head_bytes += len(line) + 2
            if self._head_bytes > MAX_HEAD:
                self._give_up(f"a header block over {MAX_HEAD} bytes")
            elif line:
                self._header(line)
            elif self._switches:
                self._give_up("the connection switched protocol (Upgrade or CONNECT)")
            elif self._chunked:
                self._state = _CHUNK_SIZE
            elif self._length:
                self._state, self._remaining = _BODY, self._length
            else:
                self._state = _START
        elif state == _CHUNK_SIZE:
            size = line.split(b";", 1)[0].strip()
            try:
                self._remaining = int(size, 16)
            except ValueError:
                self._give_up(f"a bad chunk size {size[:20]!r}")
                return
            if self._remaining < 0 or size.startswith((b"-", b"+", b"0x", b"0X")):
                self._give_up(f"a bad chunk size {size[:20]!r}")
            else:
                self._state = _CHUNK_DATA if self._remaining else _TRAILERS
        elif state == _CHUNK_END:
            if line:
                self._give_up("chunk data not followed by CRLF")
            else:
                self._state = _CHUNK_SIZE
        elif state == _TRAILERS and not line:
            self._state = _START

    def _header(self, line: bytes) -> None:
        if line[:1] in (b" ", b"\t"):
            return  # obsolete line folding of the previous header: it never carries the framing
        name, sep, value = line.partition(b":")
        if not sep:
            self._give_up(f"a header line without ':': {line[:40]!r}")
            return
        name, value = name.strip().lower(), value.strip()
        if name == b"content-length":
            if not value.isdigit() or (self._length is not None and self._length != int(value)):
                self._give_up(f"an invalid Content-Length {value[:20]!r}")
            else:
                self._length = int(value)
        elif name == b"transfer-encoding":
            codings = [c.strip().lower() for c in value.split(b",") if c.strip()]
            if codings and codings[-1] == b"chunked":
                self._chunked = True
            else:
                self._give_up(f"a request body framed by Transfer-Encoding {value[:40]!r}")
        elif name == b"upgrade":
            self._switches = True
