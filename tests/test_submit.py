"""`nebula-fl submit` exits with the run's outcome, where `flwr run` exits 0 whatever becomes of the run.

The verdict is pure (the SuperLink's status and the ServerApp's outcome line in, an exit status and a line out);
one test submits to a real SuperLink with no cluster, whose ServerApp fails, and one gives a connection that does
not exist. The launcher's federations (test_e2e and the others) submit through it too, and see it exit 0."""

from __future__ import annotations

import subprocess

import pytest
import tomli_w

from nebula_fl.config import RunConfig
from nebula_fl.launcher.federation import child_env, write_app
from nebula_fl.launcher.plan import free_port
from nebula_fl.launcher.processes import ProcessSet
from nebula_fl.launcher.submit import Submission, verdict
from nebula_fl.server.outcome import outcome_line, parse_outcome
from tests.conftest import nebula_cmd, start_plain_superlink


def shown(*lines: str) -> Submission:
    seen = Submission()
    for line in lines:
        seen.read(line + "\n")
    return seen


def outcome(status="completed", rounds=2, error=None, folder="/srv/runs/a"):
    return "INFO :      " + outcome_line(status=status, rounds_completed=rounds, rounds_aggregated=rounds, error=error,
                                         run_folder=folder)


def test_the_stream_gives_the_run_id_the_outcome_and_the_last_error():
    seen = shown("Successfully started run 4711", "ERROR :     a cluster's reply was refused", outcome())
    assert seen.run_id == 4711 and seen.outcome["run_folder"] == "/srv/runs/a"
    assert seen.last_error == "ERROR :     a cluster's reply was refused"
    assert parse_outcome("INFO : nebula-fl outcome: {not json") is None


def test_only_a_completed_run_with_an_aggregated_round_exits_zero():
    code, line = verdict(shown("Successfully started run 7", outcome()), {"status": "finished:completed"})
    assert code == 0 and line == "run 7: completed, 2 round(s) aggregated; run folder on the server host: /srv/runs/a"


@pytest.mark.parametrize(("status", "lines", "fragment"), [
    # the ServerApp failed the run and said why (every cluster refused: no round aggregated)
    ("finished:failed", [outcome("failed", 0, "NebulaError: no round was aggregated in 3 round(s)")],
     "failed: NebulaError: no round was aggregated in 3 round(s); run folder on the server host: /srv/runs/a"),
    # a ServerApp crash before any outcome line: the last error line of the stream says why
    ("finished:failed", ["ValueError: no cluster is connected"], "failed: ValueError: no cluster is connected"),
    # Flower says completed, but no nebula-fl ServerApp said how the run ended
    ("finished:completed", ["INFO : done"], "the ServerApp wrote no outcome line"),
    # ... or it ended completed with nothing aggregated
    ("finished:completed", [outcome("completed", 0)], "no round was aggregated"),
    ("finished:stopped", [outcome("interrupted", 1, "stopped by SIGTERM")], "stopped: stopped by SIGTERM"),
    ("running", [], "running: the ServerApp wrote no outcome line"),
])
def test_anything_else_exits_one_with_the_reason(status, lines, fragment):
    code, line = verdict(shown("Successfully started run 7", *lines), {"status": status})
    assert code == 1 and line.startswith("run 7: ") and fragment in line and "\n" not in line


@pytest.mark.e2e
def test_a_run_whose_serverapp_fails_exits_one_and_a_run_that_never_starts_exits_two(tmp_path, tiny_model):
    home, port = tmp_path / ".flwr", free_port()
    home.mkdir()
    target = {"address": f"127.0.0.1:{port}", "insecure": True}
    (home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": "here", "here": target}}))
    cfg = RunConfig().replace({"model": str(tiny_model), "out-dir": str(tmp_path / "run"), "min-clusters": 1,
                               "connect-timeout": 1.0, "eval-initial": False})
    app = write_app(tmp_path, cfg.to_flat())
    procs = ProcessSet()
    try:
        start_plain_superlink(procs, port=port, home=home, folder=tmp_path)
        failed = subprocess.run(nebula_cmd("submit", str(app), "here"), env=child_env(home), capture_output=True,
                                text=True, timeout=240, cwd=tmp_path)
        # no cluster ever connects: the ServerApp fails, which `flwr run --stream` alone reports with exit 0
        last = failed.stdout.strip().splitlines()[-1]
        assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr
        assert last.startswith("run ") and ": failed: " in last and "only 0 of 1 clusters connected" in last, last
        assert f"run folder on the server host: {tmp_path / 'run'}" in last
        # a connection that does not exist: no run, exit 2, one line
        nowhere = subprocess.run(nebula_cmd("submit", str(app), "nowhere"), env=child_env(home), capture_output=True,
                                 text=True, timeout=120, cwd=tmp_path)
        errors = [x for x in nowhere.stderr.splitlines() if x.strip()]
        assert nowhere.returncode == 2 and len(errors) == 1 and "no run was started" in errors[0], nowhere.stderr
        not_an_app = subprocess.run(nebula_cmd("submit", str(tmp_path / "nothing"), "here"), env=child_env(home),
                                    capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert not_an_app.returncode == 2 and "is not an app folder" in not_an_app.stderr
    finally:
        procs.stop_all()
