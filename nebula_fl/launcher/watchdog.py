"""Stop every process of a launch when the launcher dies, whatever killed it (SIGKILL included).

The launcher starts this process first (``python -m nebula_fl.launcher.watchdog``), in its own
session and not tied to the launcher's life, and writes to its stdin one line per process it starts
(``watch PID CREATE_TIME``), the paths to delete if it dies (``remove PATH``), and ``done`` once it
has stopped everything itself. Every ~0.5 s the watchdog walks the trees of those processes and
remembers every descendant with its create time: Flower's SuperLink starts flower-superexec in a new
session, which starts flwr-serverapp processes, so neither a
process group nor the launcher's own children reach all of them. When stdin ends without ``done``
(the launcher is gone: only it held the pipe's write end) the watchdog SIGTERMs every remembered
process still alive (matching the create time, so a reused pid is never hit), waits a grace period
for them and anything they spawn meanwhile, SIGKILLs the rest and exits.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

# psutil's create_time is boot time + start ticks, and the kernel recomputes boot time from the wall clock on
# every read, so a clock adjustment moves a process's start by a second between two readings; a PID reused by
# another process starts far later (the old one must have exited and the PID space cycled).
SAME_PROCESS_TOLERANCE_S = 2.5


def same_process_start(a: float, b: float) -> bool:
    """Whether two create-time readings are one process's start."""
    return abs(a - b) < SAME_PROCESS_TOLERANCE_S


class Remembered:
    """Processes known by (pid, create time): the watched ones and every descendant seen since."""

    def __init__(self) -> None:
        self.known: dict[int, float] = {}

    def add(self, pid: int, created: float | None = None) -> None:
        if created is None:
            try:
                created = psutil.Process(pid).create_time()
            except psutil.Error:
                return
        self.known.setdefault(pid, created)

    def _process(self, pid: int, created: float) -> psutil.Process | None:
        """The process `pid` if it is still the one remembered (not a newer process reusing the pid)."""
        try:
            proc = psutil.Process(pid)
            if same_process_start(proc.create_time(), created):
                return proc
        except psutil.Error:
            pass
        return None

    def walk(self) -> None:
        """Remember the descendants of every remembered live process; forget the ones that are gone.

        Walking from every remembered process, not only the watched roots, finds the children of a
        process whose parent died (it is reparented away from the tree) as long as it was seen once.
        One scan of the process table per walk (psutil's ``children()`` scans it again for every call,
        which cost this watchdog ~8% of a core with a few dozen processes remembered).
        """
        live = []
        for pid, created in list(self.known.items()):
            if self._process(pid, created) is None:
                del self.known[pid]
            else:
                live.append(pid)
        children: dict[int, list[tuple[int, float]]] = {}
        for proc in psutil.process_iter(["ppid", "create_time"]):
            ppid, created = proc.info["ppid"], proc.info["create_time"]
            if ppid is not None and created is not None:
                children.setdefault(ppid, []).append((proc.pid, created))
        while live:
            for child, created in children.get(live.pop(), ()):
                if child not in self.known:
                    self.known[child] = created
                    live.append(child)

    def alive(self) -> list[psutil.Process]:
        out = []
        for pid, created in self.known.items():
            proc = self._process(pid, created)
            try:
                if proc is not None and proc.status() != psutil.STATUS_ZOMBIE:
                    out.append(proc)
            except psutil.Error:
                pass
        return out

    def stop(self, *, grace: float) -> int:
        """SIGTERM every remembered live process (and what they spawn meanwhile), SIGKILL what is left
        after `grace` seconds; returns how many processes were signalled."""
        self.walk()
        signalled: set[int] = set()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            alive = self.alive()
            if not alive:
                return len(signalled)
            for proc in alive:
                if proc.pid not in signalled:
                    _signal(proc, signal.SIGTERM)
                    signalled.add(proc.pid)
            time.sleep(0.1)
            self.walk()
        for _ in range(3):  # a process may still spawn while it is being killed: sweep until none is left
            self.walk()
            alive = self.alive()
            if not alive:
                break
            for proc in alive:
                _signal(proc, signal.SIGKILL)
                signalled.add(proc.pid)
            psutil.wait_procs(alive, timeout=1)
        return len(signalled)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.Error:
        pass


def watch_stdin(*, interval: float, grace: float, fd: int = 0) -> int:
    """The watchdog's loop; returns its exit status (0 after "done", 1 after the launcher died)."""
    remembered = Remembered()
    removals: list[Path] = []
    pending = b""
    while True:
        ready, _, _ = select.select([fd], [], [], interval)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break  # EOF without "done": the launcher died
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                words = raw.decode(errors="replace").split(maxsplit=1)
                if not words:
                    continue
                if words[0] == "done":
                    return 0
                if words[0] == "watch" and len(words) == 2:
                    pid, _, created = words[1].partition(" ")
                    try:
                        remembered.add(int(pid), float(created) if created else None)
                    except ValueError:
                        print(f"watchdog: ignored a malformed line: {raw[:80]!r}", flush=True)
                elif words[0] == "remove" and len(words) == 2:
                    removals.append(Path(words[1]))
        remembered.walk()
    alive = len(remembered.alive())
    print(f"watchdog: the launcher is gone; stopping {alive} process(es) of its federation", flush=True)
    stopped = remembered.stop(grace=grace)
    for path in removals:
        shutil.rmtree(path, ignore_errors=True)
    print(f"watchdog: stopped {stopped} process(es); exiting", flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nebula_fl.launcher.watchdog", description=__doc__.split("\n")[0])
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between walks of the process trees")
    parser.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    args = parser.parse_args(argv)
    # Ctrl-C and a terminal hang-up are the launcher's to handle; this process acts only on the pipe.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    return watch_stdin(interval=args.interval, grace=args.grace)


class Watchdog:
    """The launcher's end: starts the watchdog, tells it each process started, releases it at the end.

    If the watchdog itself is gone (killed by hand), telling it more is skipped: the launcher's own
    stop, and each child's parent-death signal, still hold.
    """

    def __init__(self, *, log_path: Path, interval: float = 0.5, grace: float = 3.0) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "nebula_fl.launcher.watchdog", "--interval", str(interval), "--grace", str(grace)],
                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
            )

    def _send(self, line: str) -> None:
        stdin = self.popen.stdin
        if stdin is None or stdin.closed:
            return
        try:
            stdin.write(line.encode() + b"\n")
            stdin.flush()
        except (BrokenPipeError, OSError):
            stdin.close()  # the watchdog is gone; nothing more to tell it

    def watch(self, pid: int) -> None:
        try:
            created = psutil.Process(pid).create_time()
        except psutil.Error:
            return  # already gone
        self._send(f"watch {pid} {created!r}")

    def remove_if_killed(self, path: Path) -> None:
        """Delete `path` (a folder of sockets) after stopping everything, if the launcher dies."""
        self._send(f"remove {path}")

    def release(self, *, timeout: float = 5.0) -> None:
        """The launcher has stopped everything itself: let the watchdog exit without acting."""
        self._send("done")
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            try:
                self.popen.stdin.close()
            except OSError:
                pass
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


if __name__ == "__main__":
    raise SystemExit(main())
