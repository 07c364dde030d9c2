"""Keep a site's services running: start them in order, restart one that dies, stop them all on SIGTERM.

A site (``nebula-fl site``) or a server host (``nebula-fl server``) runs for weeks under a service manager, which
sees one process: this one. So a dead child is restarted here, after a delay that grows while it keeps dying
(`BACKOFF_S`) and starts over once it has stayed up `STABLE_S`; a child that exits for bad input (status 2: its
one-line error is in its log) is not restarted, since it would fail the same way, and ends the site with that
line. Flower's SuperNode exits (status 1, "Exit Code: 305" in its log) when the SuperLink refuses it. That happens
with the same words whether its key is unregistered or its previous session is still marked online (until the
SuperLink's heartbeat timeout, about a minute after a kill or restart), so it is retried at a steady pace for as
long as it lasts, said once.

SIGTERM or SIGINT stops the services in the reverse of their start order, each tree whole (``ProcessSet``), so a
SuperNode goes before its trainer and leaves the SuperLink the usual way. `health()` is what the health endpoint
serves (``deploy/health.py``).
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nebula_fl.errors import NebulaError
from nebula_fl.launcher.processes import Managed, ProcessSet

BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
STABLE_S = 300.0  # up this long, a service's next death restarts it after the first delay again
BAD_INPUT = 2  # every nebula-fl command's exit status for bad input


@dataclass(frozen=True, kw_only=True)
class Service:
    """One supervised command. `retry` maps a line its log shows before it exits (Flower exits 1 for every error
    and names the reason only in its log, e.g. "Exit Code: 305") to (delay, why): not a crash; the service is
    started again after `delay`, as often as it takes. `after_start` runs once the process is up (every start); what
    it returns is said."""

    name: str
    argv: list[str]
    env: dict[str, str]
    cwd: Path | None = None
    retry: dict[str, tuple[float, str]] = field(default_factory=dict)
    after_start: Callable[[], str | None] | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.argv:
            raise ValueError("a service needs a name and a command")


@dataclass
class _State:
    service: Service
    managed: Managed | None = None
    started_at: float = 0.0
    deaths: int = 0  # in a row, reset once up STABLE_S
    restarts: int = 0
    due: float | None = None  # when a dead service starts again
    last_exit: int | None = None
    note: str = ""
    log_offset: int = 0  # where this start's lines begin in the (appended) log


class Supervisor:
    """Runs `services` until a signal (exit 0) or a service fails for bad input (exit 1); `log_dir` holds one log
    per service (appended across restarts); what the supervisor does goes to `say` (stdout: the journal)."""

    def __init__(self, services: list[Service], *, log_dir: Path, say: Callable[[str], None] | None = None,
                 poll_s: float = 0.5) -> None:
        names = [s.name for s in services]
        if len(set(names)) != len(names):
            raise ValueError(f"service names repeat: {names}")
        self.states = [_State(s) for s in services]
        self.log_dir = Path(log_dir)
        self.procs = ProcessSet()
        self.say = say or (lambda line: print(time.strftime("%Y-%m-%d %H:%M:%S ") + line, flush=True))
        self.poll_s = poll_s
        self.stopping: str | None = None
        self.failure: str | None = None

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.start_all()
            while self.stopping is None and self.failure is None:
                self.step(time.monotonic())
                time.sleep(self.poll_s)
        finally:
            self.stop()
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.failure is not None:
            self.say(f"stopped: {self.failure}")
            return 1
        self.say(f"stopped ({self.stopping})")
        return 0

    def start_all(self) -> None:
        for state in self.states:
            if self.failure is None:
                self._start(state)

    def step(self, now: float) -> None:
        """One look at every service: note a death and schedule its restart, start what is due."""
        for state in self.states:
            managed = state.managed
            if managed is not None and not managed.alive() and state.due is None:
                self._died(state, managed.popen.returncode, now)
                if self.failure is not None:
                    return
            if state.due is not None and now >= state.due:
                state.due = None
                state.restarts += 1
                self._start(state)

    def _died(self, state: _State, code: int, now: float) -> None:
        service = state.service
        state.last_exit = code
        said = self._said_since_start(state)
        marker = next((m for m in service.retry if m in said), None) if code != 0 else None
        if marker is not None:
            delay, why = service.retry[marker]
            if state.note != why:
                self.say(f"{service.name}: exited {code} ({marker}): {why}; retrying every {delay:g} s")
            state.note, state.due = why, now + delay
            return
        if code == BAD_INPUT:
            self.failure = f"{service.name} refused its input (exit 2): {_last_line(state.managed)}"
            return
        if now - state.started_at >= STABLE_S:
            state.deaths = 0
        delay = BACKOFF_S[min(state.deaths, len(BACKOFF_S) - 1)]
        state.deaths += 1
        state.note, state.due = f"exited {code}", now + delay
        self.say(f"{service.name}: exited {code} after {now - state.started_at:.0f} s; restarting in {delay:g} s "
                 f"(death {state.deaths} in a row; log {self._log(service)})")

    def _said_since_start(self, state: _State) -> str:
        try:
            with self._log(state.service).open("rb") as log:
                log.seek(state.log_offset)
                return log.read().decode(errors="replace")
        except OSError:
            return ""

    def _start(self, state: _State) -> None:
        service = state.service
        log = self._log(service)
        state.log_offset = log.stat().st_size if log.exists() else 0
        if state.managed is None:
            state.managed = self.procs.start(service.name, service.argv, log_path=self._log(service), env=service.env,
                                             cwd=service.cwd)
        else:
            state.managed = self.procs.restart(state.managed)
        state.started_at = time.monotonic()
        self.say(f"{service.name}: started (pid {state.managed.popen.pid})")
        if service.after_start is not None:
            try:
                if said := service.after_start():
                    self.say(f"{service.name}: {said}")
            except NebulaError as err:
                self.failure = f"{service.name}: {err}"

    def _log(self, service: Service) -> Path:
        return self.log_dir / f"{service.name}.log"

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stopping = signal.Signals(signum).name

    def stop(self, *, grace: float = 10.0) -> None:
        """Every service, in the reverse of the start order, each tree whole."""
        self.procs.stop_in_reverse(grace=grace)

    # -- health -------------------------------------------------------------------------------------
    def health(self) -> tuple[bool, dict[str, Any]]:
        """(all running, a report): each service's state, pid, restarts, seconds up, last exit and why it waits."""
        now = time.monotonic()
        services = {}
        for state in self.states:
            alive = state.managed is not None and state.managed.alive()
            services[state.service.name] = {
                "state": "running" if alive else ("restarting" if state.due is not None else "stopped"),
                "pid": state.managed.popen.pid if alive else None,
                "restarts": state.restarts,
                "up_seconds": round(now - state.started_at, 1) if alive else 0.0,
                "last_exit": state.last_exit,
                **({"waiting": state.note, "restart_in_seconds": round(max(0.0, state.due - now), 1)}
                   if state.due is not None and not alive else {}),
            }
        ok = all(s["state"] == "running" for s in services.values()) and self.stopping is None
        return ok, {"status": "ok" if ok else ("stopping" if self.stopping else "degraded"), "services": services}


def _last_line(managed: Managed | None) -> str:
    tail = managed.log_tail(5).strip().splitlines() if managed is not None else []
    return tail[-1] if tail else "(its log is empty)"


def main_loop(supervisor: Supervisor, *, health: str | None) -> int:
    """Run `supervisor` with its health endpoint on `health` (HOST:PORT) if given."""
    from nebula_fl.deploy.health import HealthServer

    server = HealthServer(health, supervisor.health) if health else None
    try:
        return supervisor.run()
    finally:
        if server is not None:
            server.close()
        sys.stdout.flush()
