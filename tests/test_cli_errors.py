"""Bad input: one clear line on stderr, exit status 2, and no run folder written.

The refusals run `nebula_fl.cli.main` in-process (what `nebula-fl` calls; no interpreter to start per case); one
case runs the real command, so the process's exit status and stderr are checked as a user sees them."""

import contextlib
import io
import os
import socket
import subprocess
from dataclasses import dataclass

import pytest

from nebula_fl.cli import main
from tests.conftest import nebula_cmd


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def cli(cwd, *args) -> Result:
    """`nebula-fl ARGS` in-process, from `cwd`: its exit status (argparse's SystemExit included) and output."""
    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 2
    finally:
        os.chdir(here)
    return Result(code, out.getvalue(), err.getvalue())


def run_cli(tmp_path, *args):
    out = tmp_path / "run"
    return cli(tmp_path, "run", "--out", str(out), "--port", "0", *args), out


def assert_one_line_error(proc, out, *fragments):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("nebula-fl: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    assert not out.exists()


def test_the_real_command_exits_2_with_one_line(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(nebula_cmd("run", "--out", str(out), "--port", "0", "--run-config", "local-step=3"),
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert_one_line_error(proc, out, "unknown config key 'local-step'", "did you mean 'local-steps'")


def test_unknown_config_key(tmp_path):
    proc, out = run_cli(tmp_path, "--run-config", "local-step=3")
    assert_one_line_error(proc, out, "unknown config key 'local-step'", "did you mean 'local-steps'")


def test_wrongly_typed_config_value(tmp_path):
    proc, out = run_cli(tmp_path, "--run-config", 'lr="fast"')
    assert_one_line_error(proc, out, "'lr' must be float")


def test_no_clusters(tmp_path):
    proc, out = run_cli(tmp_path, "--clusters", "0")
    assert_one_line_error(proc, out, "--clusters is 0")


def test_model_folder_that_is_not_a_transformers_model(tmp_path):
    fake = tmp_path / "not-a-model"
    fake.mkdir()
    (fake / "config.json").write_text('{"hello": "world"}')
    proc, out = run_cli(tmp_path, "--run-config", f'model="{fake}"')
    assert_one_line_error(proc, out, "not a transformers config", str(fake))


def test_missing_model_folder(tmp_path):
    proc, out = run_cli(tmp_path, "--run-config", f'model="{tmp_path / "nowhere"}"')
    assert_one_line_error(proc, out, "does not exist")


def test_data_path_that_does_not_exist(tmp_path):
    proc, out = run_cli(tmp_path, "--run-config", f'dataset="{tmp_path / "no-data"}"')
    assert_one_line_error(proc, out, "dataset path", "does not exist")


def test_cluster_left_with_no_examples(tmp_path):
    proc, out = run_cli(tmp_path, "--preset", "smoke", "--clusters", "40", "--partition", "dirichlet:0.01")
    assert_one_line_error(proc, out, "gets 0 examples", "raise the Dirichlet alpha")


def test_port_already_in_use(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = cli(tmp_path, "run", "--out", str(tmp_path / "run"), "--port", str(port))
    assert_one_line_error(proc, tmp_path / "run", f"port {port}", "in use")


@pytest.mark.parametrize("what", ["missing", "a plain file", "a socket without its key"])
def test_a_rank_host_that_is_not_there(tmp_path, what):
    path = tmp_path / "host.sock"
    if what == "a plain file":
        path.write_text("")
    elif what == "a socket without its key":
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))
    proc, out = run_cli(tmp_path, "--rank-host", str(path))
    assert_one_line_error(proc, out, f"--rank-host '{path}'", "no rank host serves there", "nebula_fl.clients.rank_host")


def test_malformed_run_config_string(tmp_path):
    proc, out = run_cli(tmp_path, "--run-config", "lr=1e-3 broken=[")
    assert_one_line_error(proc, out, "--run-config")


def test_existing_run_folder_is_not_overwritten(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    proc = cli(tmp_path, "run", "--out", str(tmp_path / "run"), "--port", "0")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert (tmp_path / "run" / "config.json").read_text() == "{}"


@pytest.mark.parametrize("args", [["--socket", "x.sock"], ["--socket", "x.sock", "--data", "a", "--dataset", "b"]])
def test_trainer_needs_exactly_one_data_source(tmp_path, args):
    proc = cli(tmp_path, "trainer", *args)
    assert proc.returncode == 2 and "exactly one of --data" in proc.stderr
