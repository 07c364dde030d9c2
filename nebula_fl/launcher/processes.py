"""Start processes in their own sessions, watch them, and stop every one of them and their children.

Flower's SuperLink starts its SuperExec in a new session, and SuperExec starts the ServerApp; a
SuperNode's SuperExec starts a ClientApp per message. Killing a process group therefore misses some
of them, so stopping walks each process tree (psutil), signals every member, waits, and repeats for
anything spawned meanwhile, then SIGKILLs what is left.

If the launcher itself dies without stopping them (SIGKILL, OOM), two things still do: every process
started here gets SIGTERM from the kernel when the launcher dies (PR_SET_PDEATHSIG), and the
launcher's watchdog (watchdog.py), told each pid, stops every descendant it has seen.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from nebula_fl.launcher.watchdog import Watchdog, same_process_start
from nebula_fl.lifetime import preexec_die_with_parent


@dataclass
class Managed:
    name: str
    popen: subprocess.Popen
    log_path: Path
    expect_exit: bool = False  # a command that ends by itself (flwr run), not a service
    known: dict[int, float] = field(default_factory=dict)  # pid -> create_time of every descendant seen
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    restarts: int = 0  # how many times this service was started again after dying, in this launch

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie runs nothing; only its parent, or init for an orphan, can reap it)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ProcessSet:
    """The processes one launch started, stopped together in the order they were started.

    The first one started (the SuperLink, whose tree holds the ServerApp) is stopped first, so the
    ServerApp records an interruption while the clusters are still there, rather than a failed round.
    """

    def __init__(self, *, watchdog: Watchdog | None = None) -> None:
        self.items: list[Managed] = []
        self.watchdog = watchdog  # told every pid started, to stop them all if the launcher dies

    def start(
        self, name: str, argv: Sequence[str], *, log_path: Path, env: dict[str, str], cwd: Path | None = None,
        expect_exit: bool = False,
    ) -> Managed:
        popen = self._spawn(list(argv), log_path=log_path, env=env, cwd=cwd)
        managed = Managed(name, popen, log_path, expect_exit, argv=list(argv), env=env, cwd=cwd)
        self.items.append(managed)
        return managed

    def _spawn(self, argv: list[str], *, log_path: Path, env: dict[str, str], cwd: Path | None) -> subprocess.Popen:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd,
                start_new_session=True, preexec_fn=preexec_die_with_parent(signal.SIGTERM),
            )
        if self.watchdog is not None:
            self.watchdog.watch(popen.pid)
        return popen

    def restart(self, item: Managed, *, grace: float = 3.0) -> Managed:
        """Start a dead service again with the same argv, its log appended, in the same place in the stop order.

        Whatever the dead one left behind (its children, e.g. a SuperNode's SuperExec) is stopped first.
        """
        self._stop(item, grace=grace)
        popen = self._spawn(item.argv, log_path=item.log_path, env=item.env, cwd=item.cwd)
        again = Managed(item.name, popen, item.log_path, item.expect_exit, argv=item.argv, env=item.env, cwd=item.cwd,
                        restarts=item.restarts + 1)
        self.items[self.items.index(item)] = again
        return again

    def remember_descendants(self) -> None:
        """Record every live descendant, so a child orphaned later is still found and stopped."""
        for item in self.items:
            for proc in _tree(item.popen.pid):
                try:
                    item.known.setdefault(proc.pid, proc.create_time())
                except psutil.NoSuchProcess:
                    pass

    def first_dead_service(self) -> Managed | None:
        return next((m for m in self.items if not m.expect_exit and not m.alive()), None)

    def dead_services(self) -> list[Managed]:
        return [m for m in self.items if not m.expect_exit and not m.alive()]

    def all_pids(self) -> dict[int, float]:
        self.remember_descendants()
        out: dict[int, float] = {}
        for item in self.items:
            out.update(item.known)
        return out

    def stop_all(self, *, grace: float = 8.0) -> None:
        """Stop every tree at once, each with its own grace period: one after the other, the 17 services of an
        8-cluster federation took 8-10 s to stop; together they take the slowest one's time."""
        with ThreadPoolExecutor(max_workers=max(1, len(self.items)), thread_name_prefix="stop") as pool:
            list(pool.map(lambda item: self._stop(item, grace=grace), self.items))
        for item in self.items:
            item.popen.poll()

    def stop_in_reverse(self, *, grace: float = 10.0) -> None:
        """Every tree, one after the other, the last started first (a site's SuperNode before its trainer)."""
        for item in reversed(self.items):
            self._stop(item, grace=grace)

    def _stop(self, item: Managed, *, grace: float) -> None:
        members = {p.pid: p for p in _tree(item.popen.pid)}
        for pid, created in item.known.items():
            if pid not in members:
                try:
                    proc = psutil.Process(pid)
                    if same_process_start(proc.create_time(), created):
                        members[pid] = proc
                except psutil.NoSuchProcess:
                    pass
        deadline = time.monotonic() + grace
        sent: set[int] = set()
        while True:
            for proc in list(members.values()):
                for child in _tree(proc.pid)[1:]:
                    members.setdefault(child.pid, child)
            alive = [p for p in members.values() if running(p)]
            if not alive:
                break
            sig = signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL
            for proc in alive:
                if sig == signal.SIGKILL or proc.pid not in sent:
                    try:
                        proc.send_signal(sig)
                    except psutil.NoSuchProcess:
                        pass
                    sent.add(proc.pid)
            if sig == signal.SIGKILL:
                psutil.wait_procs(alive, timeout=2)
            else:
                time.sleep(0.1)
            item.popen.poll()
        if item.popen.poll() is None:
            try:
                os.killpg(item.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            item.popen.wait(timeout=5)
