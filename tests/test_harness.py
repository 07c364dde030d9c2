"""benchmarks/harness.py: the one benchmark module that reaches into the launcher (an AST scan of every other
script), and its pure parts: the results folder, results.json, the table, the records, the Flower environment."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

import nebula_fl.clients.inner_loop as inner_loop
import nebula_fl.training as training
from nebula_fl.launcher.federation import child_env
from tests.conftest import REPO, load_script

harness = load_script("nebula_benchmarks_harness", REPO / "benchmarks" / "harness.py")

BANNED = ("nebula_fl.launcher", "nebula_fl.clients.inner_loop")


def internal_imports(path: Path) -> list[str]:
    """Every module under BANNED that `path` imports, at any depth of the file (a lazy import counts)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module.startswith(BANNED) else [
                f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [f"{path}:{node.lineno} {name}" for name in names
                  if any(name == b or name.startswith(b + ".") for b in BANNED)]
    return found


def test_no_benchmark_but_the_harness_imports_the_launcher_or_the_inner_loop():
    scripts = sorted((REPO / "benchmarks").rglob("*.py"))
    harness_path = REPO / "benchmarks" / "harness.py"
    assert harness_path in scripts and len(scripts) > 10  # the scan sees the benchmarks, apps included
    offenders = [hit for path in scripts if path != harness_path for hit in internal_imports(path)]
    assert offenders == [], f"import these through benchmarks/harness.py or nebula_fl.training: {offenders}"
    # the scan finds what it looks for: the harness's own launcher imports, and every spelling of one
    assert any("nebula_fl.launcher.processes" in hit for hit in internal_imports(harness_path))


@pytest.mark.parametrize("source", ["import nebula_fl.launcher.plan", "from nebula_fl.launcher import plan",
                                    "from nebula_fl.clients import inner_loop",
                                    "def f():\n    from nebula_fl.clients.inner_loop import train_steps\n"])
def test_the_scan_catches_every_spelling_of_an_internal_import(tmp_path, source):
    path = tmp_path / "probe.py"
    path.write_text(source + "\n")
    assert internal_imports(path)


def test_the_scan_leaves_public_modules_alone(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import nebula_fl.training\nfrom nebula_fl.clients import protocol\n"
                    "from nebula_fl.config import RunConfig\nimport nebula_fl.launcherish\n")
    assert internal_imports(path) == []


def test_the_public_training_module_hands_out_the_trainers_own_objects():
    # not copies: a change to the inner loop must reach every baseline that claims to train as a cluster does
    assert training.train_steps is inner_loop.train_steps
    assert training.BatchSchedule is inner_loop.BatchSchedule
    assert training.scheduled_lr is inner_loop.scheduled_lr
    assert set(training.__all__) == {"BatchSchedule", "scheduled_lr", "train_steps"}


# -- results -------------------------------------------------------------------------------------------
def test_fresh_out_creates_a_folder_and_refuses_a_used_one(tmp_path):
    out = harness.fresh_out(str(tmp_path / "a" / "b"))
    assert out.is_dir() and out.is_absolute()
    assert harness.fresh_out(str(out)) == out  # empty: fine
    (out / "results.json").write_text("{}")
    with pytest.raises(SystemExit, match="not empty; pass --out"):
        harness.fresh_out(str(out))


def test_write_results_writes_indented_json_with_a_final_newline(tmp_path):
    results = {"benchmark": "x", "figures": {"ratio": 1.5, "none": None}, "runs": [1, 2]}
    path = harness.write_results(tmp_path, results)
    assert path == tmp_path / "results.json"
    text = path.read_text()
    assert text == json.dumps(results, indent=2) + "\n" and json.loads(text) == results
    assert harness.write_results(tmp_path, {"a": 1}, name="runs.json").read_text() == '{\n  "a": 1\n}\n'


def test_table_right_aligns_every_column_and_checks_row_width():
    shown = harness.table("t", ("setting", "accuracy"), [("a", "0.9"), ("b", "0.8")])
    assert [c.header for c in shown.columns] == ["setting", "accuracy"]
    assert all(c.justify == "right" for c in shown.columns) and shown.row_count == 2
    with pytest.raises(ValueError, match="has 1 cells for 2 columns"):
        harness.table("t", ("setting", "accuracy"), [("a",)])


# -- records -------------------------------------------------------------------------------------------
def test_read_run_returns_the_summary_and_one_record_per_metrics_line(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "final_accuracy": 0.9}))
    lines = [{"round": 1, "accuracy": 0.8}, {"round": 2, "accuracy": 0.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + "\n")
    summary, rounds = harness.read_run(tmp_path)
    assert summary == {"status": "completed", "final_accuracy": 0.9} and rounds == lines
    assert harness.metrics_lines(tmp_path) == lines


def test_run_federation_reports_a_failed_run_with_its_log(tmp_path):
    log = tmp_path / "bad.log"
    with pytest.raises(SystemExit, match=r"failed \(exit 2\); see .*bad.log"):
        harness.run_federation(["--no-such-flag"], folder=tmp_path / "run", log=log)
    assert "--no-such-flag" in log.read_text()


# -- the stock Flower federation's pure parts ---------------------------------------------------------------
def test_flower_env_is_the_launchers_with_the_app_first_on_pythonpath(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", raising=False)
    env = harness.flower_env(tmp_path / ".flwr", pythonpath=[tmp_path / "app"], extra={"X_EXTRA": "1"})
    assert env["FLWR_HOME"] == str(tmp_path / ".flwr")
    assert env["FLWR_TELEMETRY_ENABLED"] == "0" and env["FLWR_DISABLE_UPDATE_CHECK"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path / "app"), "/elsewhere"]
    assert env["X_EXTRA"] == "1"
    launcher = child_env(tmp_path / ".flwr")  # every other variable exactly as nebula-fl's own processes get it
    assert {k: v for k, v in env.items() if k not in ("PYTHONPATH", "X_EXTRA")} == {
        k: v for k, v in launcher.items() if k != "PYTHONPATH"}
    poll = harness.flower_env(tmp_path, extra={"FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "0.5"})
    assert poll["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.5"


def test_stock_federation_checks_its_arguments_before_starting_anything(tmp_path):
    app = REPO / "benchmarks" / "stock_flower"
    with pytest.raises(ValueError, match=r"has no pyproject\.toml"):
        harness.StockFederation(app=tmp_path, folder=tmp_path / "run", clusters=2)
    with pytest.raises(ValueError, match="clusters is 0"):
        harness.StockFederation(app=app, folder=tmp_path / "run", clusters=0)
    with pytest.raises(ValueError, match="up_timeout_s is 0"):
        harness.StockFederation(app=app, folder=tmp_path / "run", clusters=1, up_timeout_s=0)
    fed = harness.StockFederation(app=app, folder=tmp_path / "run", clusters=2)
    assert fed.home == (tmp_path / "run" / ".flwr").resolve() and fed.controls == []
    assert fed.env["PYTHONPATH"].split(os.pathsep)[0] == str(app)
    with pytest.raises(RuntimeError, match="call run"):
        fed.wait(timeout_s=1)
    assert not (tmp_path / "run").exists()  # nothing started, nothing written
