import socket
import threading
import time

import numpy as np
import pytest

from nebula_fl.clients.protocol import TrainerListener, key_path, listen, pack, request, unpack
from nebula_fl.errors import NebulaError


def test_frames_round_trip_headers_and_tensors():
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1.5], np.float32)}
    header, out = unpack(pack({"op": "train", "n": 3}, arrays))
    assert header == {"op": "train", "n": 3}
    for k in arrays:
        np.testing.assert_array_equal(out[k], arrays[k])


@pytest.mark.parametrize("frame", [b"", b"\x01\x00", b"\xff\xff\x00\x00{}", b"\x02\x00\x00\x00{}garbage"])
def test_malformed_frames_raise_value_errors(frame):
    with pytest.raises(ValueError):
        unpack(frame)


def test_request_reply_over_the_socket_and_wrong_key_is_refused(tmp_path):
    sock = tmp_path / "t.sock"
    listener = listen(sock)
    assert (key_path(sock).stat().st_mode & 0o777) == 0o600

    def serve_once():
        with listener.accept() as conn:
            header, arrays = unpack(conn.recv_bytes())
            conn.send_bytes(pack({"ok": True, "echo": header["op"]}, {"x": arrays["x"] * 2}))

    t = threading.Thread(target=serve_once)
    t.start()
    reply, out = request(sock, {"op": "ping"}, {"x": np.ones(3, np.float32)})
    t.join(5)
    assert reply["echo"] == "ping"
    np.testing.assert_array_equal(out["x"], 2 * np.ones(3))
    key_path(sock).write_bytes(b"not the key")

    def refuse_once():
        try:
            listener.accept()
        except Exception:
            pass

    t = threading.Thread(target=refuse_once)
    t.start()
    with pytest.raises(NebulaError, match="cannot reach the cluster trainer"):
        request(sock, {"op": "ping"})
    t.join(5)
    listener.close()


def test_a_missing_trainer_says_how_to_start_one(tmp_path):
    with pytest.raises(NebulaError, match="nebula-fl trainer"):
        request(tmp_path / "nothing.sock", {"op": "hello"})


def test_a_client_that_stalls_in_the_handshake_is_dropped_after_the_io_timeout(tmp_path):
    listener = TrainerListener(tmp_path / "t.sock", io_timeout=0.5)
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stalled.connect(str(tmp_path / "t.sock"))  # connects, never answers the challenge
    started = time.monotonic()
    with pytest.raises(OSError):
        listener.accept()
    assert time.monotonic() - started < 5
    stalled.close()
    listener.close()


def test_a_live_socket_is_never_taken_over_but_a_stale_one_is_reused(tmp_path):
    first = listen(tmp_path / "t.sock")
    with pytest.raises(NebulaError, match="another trainer already serves"):
        listen(tmp_path / "t.sock")
    first.close()  # the process died: its socket file stays, nobody listens
    assert (tmp_path / "t.sock").exists()
    listen(tmp_path / "t.sock").close()
