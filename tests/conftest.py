"""Shared fixtures: a tiny BERT built here (never the 22M model), and a way to run the real CLI."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nebula_fl.model.tiny import build_tiny_model

REPO = Path(__file__).resolve().parents[1]


def docs_block(page: str, starts: str) -> list[list[str]]:
    """The commands of the docs page's shell block whose first command starts with `starts`, each as its argv
    (comments and continuation lines joined): what a test runs when the page says the test runs it."""
    import re
    import shlex

    text = (REPO / "docs" / page).read_text()
    for body in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        joined = re.sub(r"\\\n\s*", " ", body)
        commands = [shlex.split(line, comments=True) for line in joined.splitlines()]
        commands = [c for c in commands if c]
        if commands and " ".join(commands[0]).startswith(starts):
            return commands
    raise AssertionError(f"docs/{page} has no shell block starting with {starts!r}")


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


_RANK_HOST: dict = {}


def shared_rank_host() -> Path:
    """This test process's rank host (``nebula_fl/clients/rank_host.py``), started at its first use: the trainers
    the tests start fork their ranks from it, so torch, transformers and peft are imported once per test process
    rather than once per trainer (about 9 s of CPU each). Stopped when the session ends (`_stop_rank_host`)."""
    import tempfile

    from nebula_fl.lifetime import preexec_die_with_parent

    if "proc" not in _RANK_HOST:
        folder = Path(tempfile.mkdtemp(prefix="nebula-rank-host-"))
        sock = folder / "host.sock"
        with (folder / "host.log").open("w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "nebula_fl.clients.rank_host", "--socket", str(sock)],
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=preexec_die_with_parent(signal.SIGTERM))
        _RANK_HOST.update(proc=proc, sock=sock, folder=folder)
        deadline = time.monotonic() + 60
        while not sock.is_socket() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # it listens once its fork server is on the way
    assert _RANK_HOST["proc"].poll() is None, (_RANK_HOST["folder"] / "host.log").read_text()
    return _RANK_HOST["sock"]


@pytest.fixture(scope="session", autouse=True)
def _stop_rank_host():
    yield
    if "proc" in _RANK_HOST:
        import shutil

        _RANK_HOST["proc"].terminate()
        _RANK_HOST["proc"].wait(30)
        shutil.rmtree(_RANK_HOST["folder"], ignore_errors=True)


def launch_trainer(args: list[str], *, sock: Path, log_path: Path, timeout: float = 120.0, rank_host: bool = True):
    """Start `nebula-fl trainer ARGS` and wait until it answers `hello` on `sock`; returns (process, hello reply).
    Its ranks come from this process's shared rank host, or with `rank_host=False` from its own fork server."""
    from nebula_fl.clients.protocol import request
    from nebula_fl.errors import NebulaError

    host = ["--rank-host", str(shared_rank_host())] if rank_host else []
    proc = subprocess.Popen(nebula_cmd("trainer", *args, *host), stdout=log_path.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return proc, request(sock, {"op": "hello"})[0]
        except NebulaError:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, f"the trainer did not answer within {timeout} s"
            time.sleep(0.3)


def start_plain_superlink(procs, *, port: int, home: Path, folder: Path) -> None:
    """A `flower-superlink --insecure` on `port` (started in `procs`, its log in `folder`), once it listens."""
    from nebula_fl.launcher.federation import _bin, child_env
    from nebula_fl.launcher.plan import port_free

    procs.start("superlink", [_bin("flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                              "--port", str(port)], log_path=folder / "superlink.log", env=child_env(home), cwd=folder)
    deadline = time.monotonic() + 60
    while port_free(port):
        assert time.monotonic() < deadline, "the SuperLink did not open its port"
        time.sleep(0.2)

def stop_trainer(proc, timeout: float = 30.0) -> None:
    proc.terminate()
    assert proc.wait(timeout) == 0


def dp_steps_one_at_a_time(training, params, *, steps: int = 12, seed: int = 0):
    """`steps` DP-SGD steps on `training` (sample_dp.make_private), one at a time from seed `seed`, each checked to
    leave the weights finite; returns every step's loss and, for each empty Poisson batch (NaN loss), how `params`
    moved in that step."""
    import math

    import torch

    from nebula_fl.privacy.sample_dp import Batches, train_private_steps

    batches = Batches(training.loader)
    torch.manual_seed(seed)
    losses, empty_moves = [], []
    for _ in range(steps):
        before = torch.cat([p.detach().flatten().clone() for p in params])
        losses += train_private_steps(training, batches, steps=1, device=torch.device("cpu"))
        after = torch.cat([p.detach().flatten() for p in params])
        assert torch.isfinite(after).all()
        if math.isnan(losses[-1]):
            empty_moves.append(after - before)
    return losses, empty_moves


def as_installed(reply):
    """`reply` (a Message, or None) as nebula-fl's ClientApp sends it: a reply that is not an error names the
    cluster's install in the ``nebula`` record (the server refuses one without it: nebula_fl/compat.py)."""
    from flwr.app import ConfigRecord

    from nebula_fl import compat

    if reply is not None and not reply.has_error():
        reply.content[compat.RECORD] = ConfigRecord(compat.stamp())
    return reply

def same_start(a: float, b: float) -> bool:
    """Two create-time readings of one process (they may differ by a clock adjustment; see the watchdog)."""
    from nebula_fl.launcher.watchdog import same_process_start

    return same_process_start(a, b)


def still_running(procs, *, timeout: float) -> list:
    """Those of `procs` (psutil.Process) still running after up to `timeout` s. A zombie runs nothing: it counts as
    gone, since only its parent can reap it, and for an orphan that is the machine's init (which in some containers
    never does)."""
    from nebula_fl.launcher.processes import running

    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive

# A CLI run whose every descendant is recorded while it lives, to check none outlives it: the benchmarks' own
# (the fault benchmark kills some), so the suite and the benchmarks stop a federation the same way.
Tracked = load_script("nebula_benchmarks_harness", REPO / "benchmarks" / "harness.py").Tracked


@pytest.fixture
def run_cli(tmp_path):
    runs: list[Tracked] = []

    def _run(*args: str, name: str = "cli", own_rank_host: bool = False) -> Tracked:
        """`nebula-fl ARGS`; a federation (`run`) forks its ranks from this test process's rank host (its imports
        paid once per test process, not once per launch) unless `own_rank_host`: the launcher starts its own, as
        by default, and every process of the run is then its descendant."""
        if args and args[0] == "run" and not own_rank_host:
            args = (*args, "--rank-host", str(shared_rank_host()))
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

    from nebula_fl.strategies import STRATEGIES
    from nebula_fl.tasks import TASKS

    while str(folder) in sys.path:
        sys.path.remove(str(folder))
    for name in list(sys.modules):
        if name.split(".")[0] in modules:
            del sys.modules[name]
    for registry in (STRATEGIES, TASKS):  # a class loaded from a forgotten module is forgotten with it
        for key, cls in list(registry._loaded.items()):
            if cls.__module__.split(".")[0] in modules:
                del registry._loaded[key]
    importlib.invalidate_caches()


# Federations several test modules read, each started once per session (a module needing one names it as a
# fixture; under pytest-xdist its tests share an xdist_group, so one worker runs it).
SHARED_FEDERATIONS = ("causal_lm_secure_federation",)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks into the work units
def pytest_collection_modifyitems(items) -> None:
    """A test that launches `nebula-fl run` (the run_cli fixture) or reads a shared federation is an end-to-end one:
    marked so that `pytest -m "not e2e"` (`make test-fast`) iterates on the rest; `make test` runs them all."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "run_cli" in names or any(name in names for name in SHARED_FEDERATIONS):
            item.add_marker(pytest.mark.e2e)
        for name in SHARED_FEDERATIONS:
            if name in names:
                item.add_marker(pytest.mark.xdist_group(name))
    # The longest test first (pytest-xdist hands tests out in this order): mostly waiting, it overlaps the rest
    # instead of running alone at the end. (All federations first was slower: they contend for the 2 cores.)
    items.sort(key=lambda item: 0 if item.get_closest_marker("longest") else 1)


@dataclass
class Federation:
    """A finished shared run: the launcher (its output, its descendants), its exit status and its folder."""

    cli: Tracked
    code: int
    out: Path


@pytest.fixture(scope="session")
def causal_lm_secure_federation(tmp_path_factory):
    """`--task causal-lm --preset smoke` over 3 clusters under secure aggregation, client-level DP, the random-k codec
    and Flower's FedAdam: test_causal_lm_e2e checks the run, test_generate generates from its folder."""
    folder = tmp_path_factory.mktemp("causal-lm-secure")
    out = folder / "secure"
    dp = 'privacy.mode="client" privacy.noise-multiplier=0.5 privacy.max-grad-norm=0.5 privacy.max-epsilon=100'
    cli = Tracked(["run", "--task", "causal-lm", "--preset", "smoke", "--clusters", "3", "--port", "0", "--out",
                   str(out), "--secure-aggregation", "--codec", "randk:0.25", "--outer-optimizer", "flwr:FedAdam",
                   "--run-config", dp, "--rank-host", str(shared_rank_host())], cwd=folder, log=folder / "secure.log")
    try:
        yield Federation(cli=cli, code=cli.wait(480), out=out)
    finally:
        cli.stop()
