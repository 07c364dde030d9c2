"""Tie a process's life to its parent's: when the parent dies, even by SIGKILL, the child gets a signal.

Linux's ``prctl(PR_SET_PDEATHSIG)`` delivers the signal the moment the parent thread exits, so a
SIGKILLed launcher or trainer supervisor cannot leave workers behind. Elsewhere it is a no-op (the
launcher's watchdog still covers the launcher's own children). `die_with_process` ties a process to one that is
not its parent (a trainer's ranks come from a fork server).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import select
import signal
import sys
import threading
import time

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


def die_with_process(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send `sig` to this process when process `pid` exits, whether or not it is this one's parent.

    A trainer's ranks are forked by a fork server, not by the supervisor they must die with; and the fork server
    outlives the supervisor while any rank holds its pipe. A daemon thread waits on a pidfd (Linux), else polls.
    """
    try:
        fd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        os.kill(os.getpid(), sig)  # already gone
        return
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _exists(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name=f"die-with-{pid}", daemon=True).start()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def preexec_die_with_parent(sig: int = signal.SIGTERM):
    """A ``subprocess.Popen(preexec_fn=...)`` that makes the child die with the process starting it."""
    parent = os.getpid()
    _libc()  # in the parent, now: the child only calls prctl

    def _preexec() -> None:
        die_with_parent(sig, expected_parent=parent)

    return _preexec


def reap_multiprocessing_helpers() -> None:
    """Stop and reap the fork server and resource tracker this process started, before it exits. Left to exit on
    their own after it, they are orphans, and where the machine's init does not reap (some containers) they stay
    zombies. multiprocessing has no public call for this; `_stop` is what its own tests use (unchanged since 3.8)."""
    from multiprocessing import forkserver, resource_tracker

    for helper in (forkserver._forkserver, resource_tracker._resource_tracker):
        try:
            helper._stop()
        except (OSError, ChildProcessError, AttributeError) as err:
            print(f"could not stop multiprocessing's {type(helper).__name__} ({type(err).__name__}: {err})",
                  file=sys.stderr, flush=True)
