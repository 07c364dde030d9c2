"""A port left in TIME_WAIT by the previous run is free for the next SuperLink; a listening one is not."""

import socket
import time

import psutil

from nebula_fl.launcher.plan import port_free


def _time_wait_on(port: int) -> bool:
    return any(c.laddr and c.laddr.port == port and c.status == psutil.CONN_TIME_WAIT
               for c in psutil.net_connections("tcp4"))


def _plain_bind_fails(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def test_time_wait_reads_free_and_a_listener_reads_busy():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds the SuperLink
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server side closes first (a SuperLink shutting down): its end of the port goes to TIME_WAIT
    client.close()
    server.close()
    deadline = time.monotonic() + 5
    while not _time_wait_on(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _time_wait_on(port), "no TIME_WAIT connection on the port"
    assert _plain_bind_fails(port), "a bind without SO_REUSEADDR should still fail here (what the old check did)"
    assert port_free(port)

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        assert not port_free(port)
    finally:
        listener.close()
