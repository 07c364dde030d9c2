"""What every benchmark does around a federation: a fresh results folder, the run (nebula-fl or stock Flower),
its records, results.json and a table; and every piece of nebula-fl's internals a benchmark needs.

This is the only benchmark code that imports `nebula_fl.launcher`, `nebula_fl.clients` or `nebula_fl.server`
(tests/test_harness.py scans every other script, lazy imports included, and checks that this file's reaches stay
in the import block at the top); no benchmark imports the test suite. A nebula-fl federation starts through its
public command line, `nebula-fl run`. A stock Flower federation starts with Flower's own commands under the
launcher's own process environment (`child_env`: Flower's SuperExec poll, telemetry and update checks off, offline
Hugging Face) and its supervision (`ProcessSet`: every process tree stopped, the children Flower starts in new
sessions included), imported rather than copied: a baseline that runs in an environment of its own measures that
environment, and a copy would drift from the launcher's. The trainer's inner loop is not here: baselines that
train as a cluster does take it from the public `nebula_fl.training`.

Re-exported for the benchmarks, each the nebula-fl object itself (not a copy), so a benchmark measures what runs:

- `WanCounters` (nebula_fl.server.wan_counters): the per-round bytes of the WAN proxies, counted as nebula-fl's
  ServerApp counts them (the stock Flower app counts with it; `StockFederation` puts this folder on its
  PYTHONPATH).
- `SERVER_APP_SOURCE`: the file of nebula-fl's ServerApp (nebula_fl.server.app), for a benchmark that reads a
  setting from the code that sets it.

Here, not re-exported from elsewhere: `Tracked`, a `nebula-fl` command line whose every descendant is recorded
while it lives (the fault benchmark kills some and checks that none outlives the run).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil
from rich.table import Table

# -- nebula-fl's internals: every reach of the benchmarks below its public API is in this block -----------
from nebula_fl.launcher.federation import child_env
from nebula_fl.launcher.plan import free_port, parse_run_config, port_free
from nebula_fl.launcher.processes import Managed, ProcessSet
from nebula_fl.launcher.watchdog import same_process_start
from nebula_fl.server.wan_counters import WanCounters
from nebula_fl.wan.service import query_proxy  # public: the WAN proxy's control socket

__all__ = ["SERVER_APP_SOURCE", "StockFederation", "Tracked", "WanCounters", "flower_env",
           "free_port", "fresh_out", "metrics_lines", "parse_run_config",
           "read_run", "run_federation", "table", "write_results"]

HERE = Path(__file__).resolve().parent
SERVER_APP_SOURCE = Path(importlib.util.find_spec("nebula_fl.server.app").origin)  # read, not imported
"""nebula-fl's ServerApp module file (nebula_fl/server/app.py), for reading a setting from the code that sets it."""

POLL_S = 0.5  # how often a stock federation's processes and records are looked at
LEFTOVER_SETTLE_S = 5.0  # orphaned children are reaped by init a moment after their parent dies


# -- results ------------------------------------------------------------------------------------------
def fresh_out(path: str) -> Path:
    """The results folder, created; an earlier benchmark's results are never mixed into a new one."""
    out = Path(path).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty; pass --out to a new folder")
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_results(out: Path, results: dict[str, Any], *, name: str = "results.json") -> Path:
    """`results` as indented JSON in OUT/NAME; returns the path, for the line that says where it is."""
    path = out / name
    path.write_text(json.dumps(results, indent=2) + "\n")
    return path


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]] = ()) -> Table:
    """A results table, every column right-aligned (the figures line up); add rows later with `add_row`."""
    out = Table(title=title)
    for column in columns:
        out.add_column(column, justify="right")
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row of table {title!r} has {len(row)} cells for {len(columns)} columns")
        out.add_row(*row)
    return out


# -- a nebula-fl federation ----------------------------------------------------------------------------
def run_federation(args: list[str], *, folder: Path, log: Path | None = None, env: dict[str, str] | None = None,
                   cwd: Path | None = None) -> tuple[dict, list[dict]]:
    """Run `nebula-fl run ARGS --out FOLDER` (output to LOG, or to the console; in `env` and `cwd`, e.g. another
    tree of nebula-fl: `python -m` puts the working folder first on sys.path) and return its summary and its
    per-round records; a failed run stops the benchmark with where to look."""
    cmd = [sys.executable, "-m", "nebula_fl", "run", *args, "--out", str(folder)]
    folder.parent.mkdir(parents=True, exist_ok=True)
    if log is None:
        proc = subprocess.run(cmd, env=env, cwd=cwd)
    else:
        with log.open("w") as handle:
            proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"{folder.name} failed (exit {proc.returncode}); see {log or folder / 'logs'}")
    return read_run(folder)


def read_run(folder: Path) -> tuple[dict, list[dict]]:
    """A finished nebula-fl run's summary.json and its metrics.jsonl lines (one per round)."""
    return json.loads((folder / "summary.json").read_text()), metrics_lines(folder)


def metrics_lines(folder: Path) -> list[dict]:
    """FOLDER/metrics.jsonl, one record per line: what nebula-fl and the stock apps both write per evaluation."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


class Tracked:
    """`nebula-fl ARGS` in `cwd`, its output in `log`, and every descendant it shows recorded while it lives (`seen`:
    pid -> (start time, command line)), so that a killed or hung run can be stopped whole and none outlives it.
    (The suite's run_cli fixture stops its federations with this class too; tests/conftest.py.)"""

    def __init__(self, args: list[str], *, cwd: Path, log: Path) -> None:
        self.log = log
        self.handle = log.open("w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen([sys.executable, "-m", "nebula_fl", *args], cwd=cwd, stdout=self.handle,
                                      stderr=subprocess.STDOUT, env=env)
        self.seen: dict[int, tuple[float, str]] = {}
        # every (pid, command line) a descendant showed, whatever its start-time reading: a clock adjustment
        # between two readings must not hide the command a child exec'd into
        self.shown: set[tuple[int, str]] = set()

    def poll_tree(self) -> None:
        """Record every descendant alive now, with its latest command line."""
        try:
            root = psutil.Process(self.popen.pid)
            for proc in root.children(recursive=True):
                try:  # the latest command line: a child caught between its fork and its exec shows its parent's
                    created = proc.create_time()
                    command = " ".join(proc.cmdline())
                    self.shown.add((proc.pid, command))
                    if same_process_start(self.seen.get(proc.pid, (created,))[0], created):
                        self.seen[proc.pid] = (created, command)
                except psutil.Error:
                    pass
        except psutil.NoSuchProcess:
            pass

    @property
    def commands(self) -> list[str]:
        """Every command line seen, once per process that showed it."""
        return [command for _, command in sorted(self.shown)]

    def wait(self, timeout: float, until: Callable[[], bool] | None = None) -> int:
        """The exit status (-1 once `until()` holds first); past `timeout` the run is stopped and AssertionError
        raised with the end of its log."""
        deadline = time.monotonic() + timeout
        while self.popen.poll() is None:
            self.poll_tree()
            if until is not None and until():
                return -1
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"CLI did not finish in {timeout} s; log:\n{self.output()[-3000:]}")
            time.sleep(0.25)
        self.handle.close()
        return self.popen.returncode

    def stop(self, grace: float = 60.0) -> None:
        """Ctrl-C the launcher (it stops what it started), then kill whatever of its recorded descendants lives."""
        self.poll_tree()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        for pid, (created, _) in self.seen.items():
            try:
                proc = psutil.Process(pid)
                if same_process_start(proc.create_time(), created):
                    proc.kill()
            except psutil.Error:
                pass
        if not self.handle.closed:
            self.handle.close()

    def output(self) -> str:
        if not self.handle.closed:
            self.handle.flush()
        return self.log.read_text(errors="replace")

    def survivors(self, settle: float = 3.0) -> list[str]:
        """Descendants still running (not zombies) after the CLI exited, waiting up to `settle` s for them to go."""
        deadline = time.monotonic() + settle
        while True:
            alive = []
            for pid, (created, cmd) in self.seen.items():
                try:
                    proc = psutil.Process(pid)
                    if same_process_start(proc.create_time(), created) and proc.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{pid}: {cmd}")
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)


# -- a stock Flower federation -------------------------------------------------------------------------
def flower_env(home: Path, *, pythonpath: Sequence[Path] = (), extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment nebula-fl's launcher gives every Flower process it starts, under FLWR_HOME `home`, with
    `pythonpath` put first on PYTHONPATH (where `flwr run` finds an app's modules) and `extra` on top."""
    env = child_env(home)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in pythonpath), env.get("PYTHONPATH", "")])
    env.update(extra or {})
    return env


class StockFederation:
    """Stock Flower on loopback, with the real commands: a `flower-superlink`, per cluster a `flower-supernode` on
    its own --port (behind a `nebula_fl.wan` proxy shaping `link` when given), then `flwr run APP`; all under
    FOLDER/.flwr as FLWR_HOME, logs in FOLDER, and every process stopped when the `with` block ends.

        with StockFederation(app=APP, folder=out, clusters=2) as fed:
            fed.run("num-server-rounds=3")
            fed.wait(timeout_s=600)  # until `flwr run` exits

    The app's processes find APP, then this module (alone: FOLDER/.flwr/pythonpath/harness.py links here), first
    on PYTHONPATH. Cluster i is told `partition-id=i num-partitions=CLUSTERS` (its --node-config). A process that dies, a
    service that does not come up and a wait that runs out raise RuntimeError naming the log to read.
    """

    def __init__(self, *, app: Path, folder: Path, clusters: int, link: str | None = None,
                 env: dict[str, str] | None = None, up_timeout_s: float = 60.0) -> None:
        app = Path(app).resolve()
        if not (app / "pyproject.toml").is_file():
            raise ValueError(f"{app} has no pyproject.toml; pass the folder of a Flower app")
        if clusters < 1:
            raise ValueError(f"clusters is {clusters}; a federation needs at least 1")
        if up_timeout_s <= 0:
            raise ValueError(f"up_timeout_s is {up_timeout_s}; give seconds > 0")
        self.app, self.folder, self.clusters, self.link = app, Path(folder).resolve(), clusters, link
        self.up_timeout_s = up_timeout_s
        self.home = self.folder / ".flwr"
        self.shim = self.home / "pythonpath"  # this file alone (a link), for an app that imports harness
        self.env = flower_env(self.home, pythonpath=[app, self.shim], extra=env)
        self.port = 0
        self.controls: list[Path] = []  # the proxies' control sockets, in cluster order (none without a link)
        self.procs = ProcessSet()
        self.flwr_run: Managed | None = None
        self._sockets: Path | None = None

    def __enter__(self) -> StockFederation:
        try:
            self.start()
        except BaseException:
            self.stop(check=False)
            raise
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop(check=kind is None)  # a leftover process is an error, unless one is already on its way

    def start(self) -> None:
        """The SuperLink (up once it listens), each proxy (up once it answers) and each SuperNode."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self.home.mkdir(exist_ok=True)
        self.shim.mkdir(exist_ok=True)
        if not (self.shim / "harness.py").exists():
            (self.shim / "harness.py").symlink_to(HERE / "harness.py")
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "local"\n[superlink.local]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n')
        bindir = Path(sys.executable).parent
        self.procs.start("superlink", [str(bindir / "flower-superlink"), "--insecure",
                                       "--disable-runtime-dependency-installation", "--port", str(self.port)],
                         log_path=self.folder / "superlink.log", env=self.env, cwd=self.folder)
        self._until_up(lambda: not port_free(self.port), "the SuperLink", self.folder / "superlink.log")
        if self.link:
            self._sockets = Path(tempfile.mkdtemp(prefix="nebula-bench-"))  # short: a socket path has ~100 bytes
        for i in range(self.clusters):
            target = self.port
            if self.link:
                target, control = free_port(), self._sockets / f"wan-{i}.sock"
                self.procs.start(f"wan-{i}", [sys.executable, "-m", "nebula_fl.wan", "--listen-port", str(target),
                                              "--target", f"127.0.0.1:{self.port}", "--profile", self.link,
                                              "--control", str(control)],
                                 log_path=self.folder / f"wan-{i}.log", env=self.env)
                self._until_up(lambda control=control: _answers(control), "a WAN proxy", self.folder / f"wan-{i}.log")
                self.controls.append(control)
            self.procs.start(f"supernode-{i}", [str(bindir / "flower-supernode"), "--insecure", "--superlink",
                                                f"127.0.0.1:{target}", "--port", str(free_port()), "--node-config",
                                                f"partition-id={i} num-partitions={self.clusters}"],
                             log_path=self.folder / f"supernode-{i}.log", env=self.env)

    def run(self, run_config: str) -> None:
        """`flwr run APP local --stream --run-config RUN_CONFIG`, its output in FOLDER/server.log."""
        if self.flwr_run is not None:
            raise RuntimeError("this federation already runs its app; start another StockFederation for a second run")
        self.flwr_run = self.procs.start(
            "flwr-run", [str(Path(sys.executable).parent / "flwr"), "run", str(self.app), "local", "--stream",
                         "--run-config", run_config],
            log_path=self.folder / "server.log", env=self.env, cwd=self.folder, expect_exit=True)

    def wait(self, *, timeout_s: float, until: Callable[[], bool] | None = None) -> bool:
        """Look every POLL_S until `until()` holds (True) or `flwr run` has exited (False: whether it got far
        enough is the caller's to check, in its records). A service that dies raises RuntimeError, and running
        out of `timeout_s` TimeoutError, each naming the log to read."""
        if self.flwr_run is None:
            raise RuntimeError("nothing to wait for: call run() first")
        deadline = time.monotonic() + timeout_s
        while True:
            self.procs.remember_descendants()  # a child orphaned later is still found and stopped
            if until is not None and until():
                return True
            if (dead := self.procs.first_dead_service()) is not None:
                raise RuntimeError(f"{dead.name} died; see {dead.log_path}")
            if not self.flwr_run.alive():
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"the stock Flower run went on past {timeout_s:.0f} s; see {self.folder / 'server.log'}")
            time.sleep(POLL_S)

    def stop(self, *, check: bool = True) -> None:
        """Stop every process started here and their children; then kill any Flower process of this FLWR_HOME
        still alive (other people's Flower processes are not ours to touch), and with `check` say so."""
        known = self.procs.all_pids()
        self.procs.stop_all()
        if self._sockets is not None:
            shutil.rmtree(self._sockets, ignore_errors=True)
        deadline = time.monotonic() + LEFTOVER_SETTLE_S
        while time.monotonic() < deadline and any(_exists(pid, created) for pid, created in known.items()):
            time.sleep(0.1)
        left = [proc for proc in psutil.process_iter(["pid", "cmdline", "create_time"])
                if _ours(proc, known=known, home=self.home)]
        for proc in left:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=5)
        if left and check:
            raise RuntimeError(f"{len(left)} Flower process(es) of {self.home} outlived the stop and were killed: "
                               f"{[p.pid for p in left]}")

    def _until_up(self, condition: Callable[[], bool], what: str, log: Path) -> None:
        deadline = time.monotonic() + self.up_timeout_s
        while not condition():
            if self.procs.first_dead_service() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not come up within {self.up_timeout_s:.0f} s; see {log}")
            time.sleep(0.2)


def _answers(control: Path) -> bool:
    try:
        query_proxy(control, "stats")
        return True
    except Exception:
        return False


def _exists(pid: int, created: float) -> bool:
    """Whether that very process (a zombie included) is still in the process table."""
    try:
        return psutil.Process(pid).create_time() == created
    except psutil.NoSuchProcess:
        return False


def _ours(proc: psutil.Process, *, known: dict[int, float], home: Path) -> bool:
    """A Flower process started here (that pid with that start time) or one running under our FLWR_HOME."""
    try:
        if not any("flower" in part or "flwr" in part for part in proc.info["cmdline"] or []):
            return False
        return known.get(proc.pid) == proc.info["create_time"] or proc.environ().get("FLWR_HOME") == str(home)
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
