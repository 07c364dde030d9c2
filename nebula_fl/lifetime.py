"""Tie a process's life to its parent's: when the parent dies, even by SIGKILL, the child gets a signal.

Linux's ``prctl(PR_SET_PDEATHSIG)`` delivers the signal the moment the parent thread exits, so a
SIGKILLed launcher or trainer supervisor cannot leave workers behind. Elsewhere it is a no-op (the
launcher's watchdog still covers the launcher's own children).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """libc, loaded once (finding it may run ldconfig: never between a fork and its exec)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def die_with_parent(sig: int = signal.SIGTERM, *, expected_parent: int | None = None) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies; returns whether it could.

    If the parent is already gone by the time this runs (a race at start-up), the signal is raised
    at once: `expected_parent` is the pid the caller was started by.
    """
    libc = _libc()
    if libc is None or libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if expected_parent is not None and os.getppid() != expected_parent:
        os.kill(os.getpid(), sig)
    return True


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def preexec_die_with_parent(sig: int = signal.SIGTERM):
    """A ``subprocess.Popen(preexec_fn=...)`` that makes the child die with the process starting it."""
    parent = os.getpid()
    _libc()  # in the parent, now: the child only calls prctl

    def _preexec() -> None:
        die_with_parent(sig, expected_parent=parent)

    return _preexec
