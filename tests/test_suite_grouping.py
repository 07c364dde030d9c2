"""The suite's scheduling holds: tests in one xdist_group run on one worker under `--dist loadgroup`.

The shared federations (conftest.SHARED_FEDERATIONS) rely on it: without it each worker starts its own copy. A pytest
or pytest-xdist upgrade has broken it silently before (pytest 9.2, pytest-xdist#1386), so it is checked on a real
two-worker run, beside a control: the same tests without the group do spread over both workers.
"""

import subprocess
import sys

import pytest

TESTS = """
import os, pytest
{mark}
@pytest.mark.parametrize("i", range(6))
def test_where(i):
    with open(os.path.join(os.path.dirname(__file__), f"{{__name__}}-{{i}}.worker"), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
"""


def _workers(tmp_path, name: str, mark: str) -> set[str]:
    folder = tmp_path / name
    folder.mkdir()
    for module in ("test_a.py", "test_b.py"):
        (folder / module).write_text(TESTS.format(mark=mark))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                          "no:cacheprovider", "-p", "no:randomly", str(folder)],
                         capture_output=True, text=True, timeout=120, cwd=folder)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "12 passed" in run.stdout, run.stdout
    workers = [path.read_text() for path in folder.glob("*.worker")]
    assert len(workers) == 12
    return set(workers)


@pytest.mark.parametrize(("mark", "spread"), [('pytestmark = pytest.mark.xdist_group("shared")', 1), ("", 2)],
                         ids=["grouped", "control"])
def test_a_group_runs_on_one_worker_and_ungrouped_tests_spread(tmp_path, mark, spread):
    assert len(_workers(tmp_path, "tests", mark)) == spread
