"""The WAN proxy's control protocol: one-line JSON requests and replies over a Unix socket (mode 0600).

Requests: ``{"op": "stats"}``, ``{"op": "drop"}``, ``{"op": "set_profile", "profile": "2mbit:100ms"}``,
``{"op": "stop"}``. Each reply is one JSON line with ``"ok": true`` and the result's fields (``stats``:
the proxy's stats; ``drop``: ``dropped``, the connections reset now; ``set_profile``: ``profile``), or
``"ok": false`` and ``"error"``. A connection may carry several requests, one per line. This module is
synchronous and stdlib-only, so a launcher can poll a proxy process without an event loop.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nebula_fl.errors import NebulaError
from nebula_fl.wan.profile import parse_profile

OPS = ("stats", "drop", "set_profile", "stop")
MAX_LINE = 1 << 20


class ControlError(NebulaError):
    """The proxy's control socket cannot be reached, or the proxy refused a request."""


def answer(proxy: Any, request: Any, *, on_stop: Callable[[], None] | None = None) -> dict[str, Any]:
    """The reply to one decoded request, for a ``WanProxy``; raises nothing on bad input."""
    if not isinstance(request, dict) or not isinstance(request.get("op"), str):
        return {"ok": False, "error": f"a request is a JSON object with an 'op' string, one of {', '.join(OPS)}"}
    op = request["op"]
    if op == "stats":
        return {"ok": True, **proxy.stats()}
    if op == "drop":
        return {"ok": True, "dropped": proxy.drop_connections()}
    if op == "set_profile":
        text = request.get("profile")
        try:
            profile = parse_profile(text)
        except ValueError as err:
            return {"ok": False, "error": str(err)}
        proxy.set_profile(profile)
        return {"ok": True, "profile": profile.to_json()}
    if op == "stop" and on_stop is not None:
        on_stop()
        return {"ok": True}
    return {"ok": False, "error": f"unknown op {op!r}; use one of {', '.join(OPS)}"}


def query_proxy(control_socket: str | Path, op: str, *, timeout: float = 5.0, **fields: Any) -> dict[str, Any]:
    """Send one request to a running proxy and return its reply without ``ok``; raise ControlError on failure."""
    path = Path(control_socket)
    line = json.dumps({"op": op, **fields}).encode() + b"\n"
    start = f"start it with `python -m nebula_fl.wan ... --control {path}`"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(str(path))
        except FileNotFoundError:
            raise ControlError(f"no WAN proxy control socket at {path}; {start}, or fix the path") from None
        except ConnectionRefusedError:
            raise ControlError(f"nothing answers on the WAN proxy control socket {path} (its proxy has exited); "
                               f"{start}") from None
        except TimeoutError:
            raise ControlError(f"the WAN proxy at {path} did not accept within {timeout} s; check that it is "
                               f"running, or pass a longer timeout") from None
        except OSError as err:
            raise ControlError(f"cannot connect to the WAN proxy control socket {path} ({err}); "
                               f"check the path and its permissions") from None
        buf = bytearray()
        try:
            sock.sendall(line)
            while not buf.endswith(b"\n"):
                data = sock.recv(65536)
                if not data:
                    break
                buf += data
                if len(buf) > MAX_LINE:
                    raise ControlError(f"the WAN proxy at {path} sent a reply over {MAX_LINE} bytes; "
                                       f"is {path} really a WAN proxy control socket?")
        except TimeoutError:
            raise ControlError(f"the WAN proxy at {path} did not answer {op!r} within {timeout} s; "
                               f"pass a longer timeout or check its log") from None
        except OSError as err:
            raise ControlError(f"the WAN proxy at {path} closed the connection during {op!r} ({err}); "
                               f"check its log") from None
    try:
        reply = json.loads(buf)
    except ValueError:
        raise ControlError(f"the WAN proxy at {path} answered {op!r} with something other than one JSON line "
                           f"({bytes(buf[:60])!r}); is it a WAN proxy control socket?") from None
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        error = reply.get("error", reply) if isinstance(reply, dict) else reply
        raise ControlError(f"the WAN proxy at {path} refused {op!r}: {error}")
    reply.pop("ok")
    return reply
