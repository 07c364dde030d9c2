"""A site's health endpoint: `GET /health` answers 200 with a JSON report when every service runs, else 503.

What a load balancer, a service manager's watchdog or an operator's `curl` asks. It binds the address the config
gives (127.0.0.1 unless the operator opens it) and serves from a thread of the supervisor.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from nebula_fl.errors import NebulaError


def parse_address(text: str, *, where: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise NebulaError(f"{where}: '{text}' is not HOST:PORT (e.g. 127.0.0.1:9100)")
    return host.strip("[]"), int(port)


class HealthServer:
    def __init__(self, address: str, report: Callable[[], tuple[bool, dict[str, Any]]]) -> None:
        host, port = parse_address(address, where="health")

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.rstrip("/") not in ("", "/health"):
                    self.send_error(404)
                    return
                ok, body = report()
                data = json.dumps(body, sort_keys=True).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args: Any) -> None:  # a poll every few seconds is not news
                pass

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except OSError as err:
            raise NebulaError(f"health: cannot listen on {address} ({err.strerror}); pick a free port") from None
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="health", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
