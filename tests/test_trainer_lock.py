"""A trainer's state-folder lock: the previous trainer still shutting down is waited for, a live one is refused."""

import fcntl
import os
import threading
import time

import pytest

from nebula_fl.clients.trainer_service import LOCK_FILE, _lock_state_dir
from nebula_fl.errors import NebulaError


def hold(state_dir, *, pid: int = 4242) -> int:
    """Lock the folder as another trainer would (its own open file), saying `pid` holds it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, str(pid).encode())
    return fd


def test_a_trainer_still_stopping_is_waited_for_and_the_lock_then_taken(tmp_path, capsys):
    held = hold(tmp_path / "state")
    threading.Timer(1.0, os.close, args=(held,)).start()  # the previous trainer exits a second later
    started = time.monotonic()
    fd = _lock_state_dir(tmp_path / "state", wait_s=10.0, poll_s=0.05)
    try:
        assert 0.9 <= time.monotonic() - started < 5.0
        assert (tmp_path / "state" / LOCK_FILE).read_text() == str(os.getpid())
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 1 and "pid 4242" in out[0] and "waiting up to 10 s" in out[0]
    finally:
        os.close(fd)


def test_a_trainer_that_never_lets_go_is_refused_after_the_wait(tmp_path):
    held = hold(tmp_path / "state")
    try:
        started = time.monotonic()
        with pytest.raises(NebulaError, match=r"is in use by another trainer \(pid 4242\); stop it, or give this"):
            _lock_state_dir(tmp_path / "state", wait_s=0.5, poll_s=0.05)
        assert 0.5 <= time.monotonic() - started < 3.0
        assert (tmp_path / "state" / LOCK_FILE).read_text() == "4242"  # the holder's record is left as it was
    finally:
        os.close(held)


def test_a_free_folder_is_locked_at_once_and_says_nothing(tmp_path, capsys):
    started = time.monotonic()
    fd = _lock_state_dir(tmp_path / "state", wait_s=10.0)
    os.close(fd)
    assert time.monotonic() - started < 0.5 and capsys.readouterr().out == ""
