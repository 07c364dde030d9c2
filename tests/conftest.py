"""Shared fixtures: a tiny BERT built here (never the 22M model), and a way to run the real CLI."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nebula_fl.model.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str, path: Path):
    """A benchmark script by path: `benchmarks` is not a package here, and Opacus installs one of that name. Its
    folder is on sys.path while it loads (scripts import harness and the like from beside themselves)."""
    import importlib.util

    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))

# A suite started in the background by a non-interactive shell inherits SIGINT ignored, and so would every launcher
# it starts; the interrupt tests send SIGINT as a user's Ctrl-C would, so children start with the default handling.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-bert") / "model")


def nebula_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nebula_fl", *args]


def launch_trainer(args: list[str], *, sock: Path, log_path: Path, timeout: float = 120.0):
    """Start `nebula-fl trainer ARGS` and wait until it answers `hello` on `sock`; returns (process, hello reply)."""
    from nebula_fl.clients.protocol import request
    from nebula_fl.errors import NebulaError

    proc = subprocess.Popen(nebula_cmd("trainer", *args), stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return proc, request(sock, {"op": "hello"})[0]
        except NebulaError:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"the trainer did not answer within {timeout} s"
            time.sleep(0.3)


def stop_trainer(proc, timeout: float = 30.0) -> None:
    proc.terminate()
    assert proc.wait(timeout) == 0


def same_start(a: float, b: float) -> bool:
    """Two create-time readings of one process (they may differ by a clock adjustment; see the watchdog)."""
    from nebula_fl.launcher.watchdog import same_process_start

    return same_process_start(a, b)


class Tracked:
    """A CLI run whose every descendant is recorded while it lives, to check none outlives it."""

    def __init__(self, args: list[str], *, cwd: Path, log: Path) -> None:
        self.log = log
        self.handle = log.open("w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen(nebula_cmd(*args), cwd=cwd, stdout=self.handle, stderr=subprocess.STDOUT, env=env)
        self.seen: dict[int, tuple[float, str]] = {}
        # every (pid, command line) a descendant showed, whatever its start-time reading: a clock adjustment
        # between two readings must not hide the command a child exec'd into
        self.shown: set[tuple[int, str]] = set()

    def poll_tree(self) -> None:
        try:
            root = psutil.Process(self.popen.pid)
            for proc in root.children(recursive=True):
                try:  # the latest command line: a child caught between its fork and its exec shows its parent's
                    created = proc.create_time()
                    command = " ".join(proc.cmdline())
                    self.shown.add((proc.pid, command))
                    if same_start(self.seen.get(proc.pid, (created,))[0], created):
                        self.seen[proc.pid] = (created, command)
                except psutil.Error:
                    pass
        except psutil.NoSuchProcess:
            pass

    @property
    def commands(self) -> list[str]:
        """Every command line seen, once per process that showed it (a child between its fork and its exec shows
        its parent's: count distinct lines, not entries, to count processes started with a command)."""
        return [command for _, command in sorted(self.shown)]

    def wait(self, timeout: float, until=None) -> int:
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
        """A failed test must not orphan the federation: Ctrl-C the launcher (it stops what it started),
        then kill whatever of its recorded descendants is still alive."""
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
                if same_start(proc.create_time(), created):
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
        """Descendants still running (not zombies) after the CLI exited."""
        deadline = time.monotonic() + settle
        while True:
            alive = []
            for pid, (created, cmd) in self.seen.items():
                try:
                    proc = psutil.Process(pid)
                    if same_start(proc.create_time(), created) and proc.status() != psutil.STATUS_ZOMBIE:
                        alive.append(f"{pid}: {cmd}")
                except psutil.NoSuchProcess:
                    pass
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.2)


@pytest.fixture
def run_cli(tmp_path):
    runs: list[Tracked] = []

    def _run(*args: str, name: str = "cli") -> Tracked:
        tracked = Tracked(list(args), cwd=tmp_path, log=tmp_path / f"{name}-{len(runs)}.log")
        runs.append(tracked)
        return tracked

    yield _run
    for tracked in runs:
        tracked.stop()


@pytest.fixture(autouse=True)
def flower_task_identity():
    """Flower 1.42 stamps every new Message with the process's task identity; a test process has none."""
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0
    yield


def put_on_path(folder: Path) -> None:
    """Make a pip --target folder importable, its packages' entry points included."""
    import importlib

    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()


def take_off_path(folder: Path, *modules: str) -> None:
    """Undo ``put_on_path`` and forget the named top-level modules imported from it."""
    import importlib

    while str(folder) in sys.path:
        sys.path.remove(str(folder))
    for name in list(sys.modules):
        if name.split(".")[0] in modules:
            del sys.modules[name]
    importlib.invalidate_caches()


def pytest_collection_modifyitems(items) -> None:
    """A test that launches `nebula-fl run` (the run_cli fixture) is an end-to-end one: marked so that
    `pytest -m "not e2e"` (`make test-fast`) iterates on the rest; `make test` runs them all."""
    for item in items:
        if "run_cli" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
