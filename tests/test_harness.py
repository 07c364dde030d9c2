"""benchmarks/harness.py: the one benchmark module that reaches into nebula-fl's internals (an AST scan of every
other script), and its pure parts: the results folder, results.json, the table, the records, the Flower environment."""

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

BANNED = ("nebula_fl.clients", "nebula_fl.server", "nebula_fl.launcher", "tests")
"""Internal packages (and the test suite): only benchmarks/harness.py imports them, and re-exports what is needed."""
DYNAMIC = ("__import__", "import_module")  # importlib.import_module("...") and __import__("...") count as imports


def imported_names(path: Path) -> list[tuple[int, str, bool]]:
    """(line, dotted name, at the top level of the file) for every import in `path`, at any depth of the file (a
    lazy import in a function counts): `import a.b as c` gives a.b, `from a.b import c` gives a.b.c, and a call
    of __import__ or importlib.import_module with a literal name gives that name."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "id", getattr(node.func, "attr", None)) in DYNAMIC):
            names = [node.args[0].value]
        else:
            continue
        found += [(node.lineno, name, id(node) in top) for name in names]
    return found


def banned(name: str) -> bool:
    return any(name == b or name.startswith(b + ".") for b in BANNED)


def private(name: str) -> bool:
    """A name beginning with `_` (a module or a member) anywhere under nebula_fl."""
    parts = name.split(".")
    return parts[0] == "nebula_fl" and any(part.startswith("_") for part in parts[1:])


def internal_imports(path: Path) -> list[str]:
    """Every import in `path` of a module under BANNED, or of a private name of nebula_fl."""
    return [f"{path}:{line} {name}" for line, name, _ in imported_names(path) if banned(name) or private(name)]


def test_no_benchmark_but_the_harness_imports_internals_or_the_tests():
    # not benchmarks/results/: the runs' own output (git-ignored), where a stock Flower run leaves its app's copy
    scripts = sorted(p for p in (REPO / "benchmarks").rglob("*.py") if p.relative_to(REPO / "benchmarks").parts[0]
                     != "results")
    harness_path = REPO / "benchmarks" / "harness.py"
    assert harness_path in scripts and len(scripts) > 10  # the scan sees the benchmarks, apps included
    offenders = [hit for path in scripts if path != harness_path for hit in internal_imports(path)]
    assert offenders == [], f"import these through benchmarks/harness.py or a public module: {offenders}"
    # the scan finds what it looks for: the harness's own launcher imports
    reaches = [(line, name, at_top) for line, name, at_top in imported_names(harness_path) if banned(name)]
    assert any(name.startswith("nebula_fl.launcher.processes.") for _, name, _ in reaches)
    # and the harness's reaches stay few and obvious: at the top of the file, none into the tests, nothing private
    assert all(at_top for _, _, at_top in reaches), reaches
    assert not [name for _, name, _ in reaches if name.split(".")[0] == "tests"]
    assert not [name for _, name, _ in imported_names(harness_path) if private(name)]


@pytest.mark.parametrize("source", [
    "import nebula_fl.launcher.plan", "from nebula_fl.launcher import plan", "from nebula_fl import launcher",
    "from nebula_fl.clients import inner_loop", "from nebula_fl.clients import protocol",
    "def f():\n    from nebula_fl.clients.inner_loop import train_steps\n",
    "import nebula_fl.server.app as server_app", "from nebula_fl.server.run_folder import RunFolder",
    "from nebula_fl import server as srv", "import nebula_fl.clients", "from nebula_fl.server import *",
    "class C:\n    def m(self):\n        import nebula_fl.server.checkpoint as ck\n",
    "if True:\n    from nebula_fl import clients, config\n",
    "import tests", "import tests.conftest", "import tests.secagg_harness as h", "from tests import secagg_campaign",
    "from tests.conftest import Tracked", "try:\n    from tests.secagg_adversary import Epoch\nexcept ImportError:\n    pass\n",
    "from nebula_fl.compression import _private", "import nebula_fl._internal", "from nebula_fl.model._x import y",
    "from nebula_fl import _hidden as h", "import nebula_fl.wan.__main__",
    "import importlib\nimportlib.import_module('nebula_fl.server.app')", "__import__('tests.conftest')",
    "from importlib import import_module\ndef f():\n    return import_module('nebula_fl.launcher')\n",
])
def test_the_scan_catches_every_spelling_of_an_internal_import(tmp_path, source):
    path = tmp_path / "probe.py"
    path.write_text(source + "\n")
    assert internal_imports(path)


def test_the_scan_leaves_public_modules_alone(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("from __future__ import annotations\nimport nebula_fl\nimport nebula_fl.training\n"
                    "from nebula_fl.config import RunConfig\nimport nebula_fl.launcherish\nimport nebula_fl.serverless\n"
                    "from nebula_fl import training, config\nimport nebula_fl.wan.model as wan\nimport testsuite\n"
                    "from nebula_fl.strategies.base import NebulaStrategy\nfrom nebula_fl.secagg.wire import unpack_upload\n"
                    "from harness import RunFolder, wrap_parallel\nimport importlib\n"
                    "importlib.import_module('nebula_fl.compression')\nfrom nebula_fl.compression import *\n"
                    "x = _private = 1\nfrom nebula_fl.model.tiny import build_tiny_model\n")
    assert internal_imports(path) == []


def test_the_public_training_module_hands_out_the_trainers_own_objects():
    # not copies: a change to the inner loop must reach every baseline that claims to train as a cluster does
    assert training.train_steps is inner_loop.train_steps
    assert training.BatchSchedule is inner_loop.BatchSchedule
    assert training.scheduled_lr is inner_loop.scheduled_lr
    assert set(training.__all__) == {"BatchSchedule", "scheduled_lr", "train_steps", "warmed_lr"}


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
