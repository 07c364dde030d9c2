"""`nebula-fl submit`: start a run on a SuperLink, stream its log, and exit with its outcome.

`flwr run` returns 0 once the SuperLink has accepted a run, whatever becomes of it: in flwr 1.42 a ServerApp crash
and a run every cluster refused both exit 0, so automation had to log into the server host and read summary.json.
This command starts the run with the stock `flwr run --stream` (its log shown here as it goes), then asks the
SuperLink for the run's final status (`flwr ls --run-id N --format json`) and reads the ServerApp's outcome line
(``server/outcome.py``). It exits

- 0 only for a run the SuperLink reports ``finished:completed`` whose ServerApp aggregated at least one round;
- 1 for a run that failed, was stopped, aggregated nothing, or whose end could not be read, with the reason in one
  line;
- 2 when no run started (the app folder, the connection, or the SuperLink refused it).

Either way it prints the run id and where the run folder and logs are on the server host.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from nebula_fl.errors import NebulaError
from nebula_fl.server.outcome import parse_outcome

STARTED = re.compile(r"Successfully started run (\d+)")
FINISHED = "finished:"
STATUS_WAIT_S = 60.0  # after the stream ends, how long the run may take to be marked finished
STATUS_POLL_S = 2.0


@dataclass
class Submission:
    """What one `flwr run --stream` showed: the run id, the ServerApp's outcome line, the last error line."""

    run_id: int | None = None
    outcome: dict | None = None
    last_error: str | None = None
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=20))  # the last ones, for a run that never starts

    def read(self, line: str) -> None:
        text = line.strip()
        if self.run_id is None and (started := STARTED.search(text)):
            self.run_id = int(started.group(1))
        if (outcome := parse_outcome(text)) is not None:
            self.outcome = outcome
        elif _is_error(text):
            self.last_error = text
        self.lines.append(text)


def _is_error(text: str) -> bool:
    return bool(re.search(r"\bERROR\b|Error:|Exception:|error:", text))


def _flwr() -> str:
    """`flwr` beside this interpreter (a venv's), else on PATH."""
    beside = Path(sys.executable).with_name("flwr")
    found = str(beside) if beside.exists() else shutil.which("flwr")
    if found is None:
        raise NebulaError("`flwr` is not installed beside this Python or on PATH; install nebula-fl (it brings flwr)")
    return found


def stream_run(app: str, connection: str | None, run_config: list[str], *, out: IO[str]) -> tuple[Submission, int]:
    """`flwr run APP [CONNECTION] --stream`: each line to `out` as it comes; returns what it showed and its exit."""
    argv = [_flwr(), "run", app, *([connection] if connection else []), "--stream"]
    for item in run_config:
        argv += ["--run-config", item]
    seen = Submission()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            seen.read(line)
        return seen, proc.wait()
    finally:
        if proc.poll() is None:  # interrupted: the run goes on at the SuperLink (`flwr stop N` ends it)
            proc.terminate()
            proc.wait(10)


def run_status(run_id: int, connection: str | None, *, wait_s: float = STATUS_WAIT_S) -> dict:
    """The run's row from `flwr ls --run-id N --format json`, once its status is finished (or `wait_s` passed)."""
    argv = [_flwr(), "ls", *([connection] if connection else []), "--run-id", str(run_id), "--format", "json"]
    deadline = time.monotonic() + wait_s
    row: dict = {}
    while True:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        try:
            answer = json.loads(proc.stdout)
            rows = answer.get("runs") or []
            row = next((r for r in rows if str(r.get("run-id")) == str(run_id)), row)
        except (json.JSONDecodeError, AttributeError):
            row = {"status": "unknown", "status-details": (proc.stdout + proc.stderr).strip()[-300:]}
        if str(row.get("status", "")).startswith(FINISHED) or time.monotonic() >= deadline:
            return row
        time.sleep(STATUS_POLL_S)


def verdict(seen: Submission, row: dict) -> tuple[int, str]:
    """Exit status and one line for a run's end, from the SuperLink's status and the ServerApp's outcome line."""
    status = str(row.get("status") or "unknown")
    details = str(row.get("status-details") or "").strip()
    outcome = seen.outcome or {}
    rounds = outcome.get("rounds_aggregated")
    where = f"; run folder on the server host: {outcome['run_folder']}" if outcome.get("run_folder") else ""
    if status == "finished:completed" and outcome.get("status") == "completed" and isinstance(rounds, int) and rounds >= 1:
        return 0, f"run {seen.run_id}: completed, {rounds} round(s) aggregated{where}"
    if status == "finished:completed" and outcome.get("status") == "completed":
        why = "no round was aggregated"
    else:
        why = (outcome.get("error") or (details if details and details != status else None) or seen.last_error
               or ("the ServerApp wrote no outcome line (it stopped before its end, or it is not nebula-fl's)"
                   if not seen.outcome else f"the ServerApp reported {outcome.get('status')} after {rounds} round(s)"))
    return 1, f"run {seen.run_id}: {status.removeprefix(FINISHED)}: {why}{where}"


def submit(*, app: str, connection: str | None, run_config: list[str], out: IO[str] = sys.stdout) -> int:
    """Start the run, follow it, and return the exit status (module docstring); the last line says why."""
    if not (Path(app) / "pyproject.toml").is_file():
        raise NebulaError(f"'{app}' is not an app folder (no pyproject.toml); pass the folder `flwr run` takes, "
                          "e.g. the nebula-fl checkout or a run folder's app/")
    seen, code = stream_run(app, connection, run_config, out=out)
    if seen.run_id is None:
        last = seen.last_error or (seen.lines[-1] if seen.lines else f"flwr run exited with status {code}")
        raise NebulaError(f"no run was started: {last}")
    status, line = verdict(seen, run_status(seen.run_id, connection))
    print(line, file=out, flush=True)
    return status
