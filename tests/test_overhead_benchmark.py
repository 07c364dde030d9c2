"""benchmarks/overhead.py without running a federation: its medians over synthetic round records, and the
arguments it hands `nebula-fl run`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, load_script

overhead = load_script("nebula_benchmarks_overhead", REPO / "benchmarks" / "overhead.py")


def _line(rnd, elapsed, clusters):
    return {"round": rnd, "elapsed_seconds": elapsed, "accuracy": 0.5,
            "timeline": {"round_s": 4.0, "overhead_s": 1.0, "clusters": clusters}}


def test_utilisation_medians_run_over_every_round_and_cluster_that_reports_it():
    lines = [
        _line(1, 4.0, {"0": {"compute_s": 1.0}, "1": {"compute_s": 2.0}}),  # first round: no previous send
        _line(2, 8.0, {"0": {"compute_s": 1.0, "busy_fraction": 0.5, "idle_s": 2.0},
                       "1": {"compute_s": 2.0, "busy_fraction": 0.9, "idle_s": 0.25}}),
        _line(3, 12.0, {"0": {"compute_s": 1.0, "busy_fraction": 0.6, "idle_s": 1.5},
                        "1": {"compute_s": 2.0, "busy_fraction": 0.8, "idle_s": 0.5}}),
    ]
    got = overhead.medians(lines)
    assert got["busy_fraction"] == pytest.approx((0.6 + 0.8) / 2)  # median of 0.5, 0.6, 0.8, 0.9
    assert got["idle_s"] == pytest.approx((0.5 + 1.5) / 2)  # median of 0.25, 0.5, 1.5, 2.0
    assert got["cluster_compute_s"] == 1.5 and got["period_s"] == 4.0
    bare = overhead.medians(lines[:1])
    assert "busy_fraction" not in bare and "idle_s" not in bare


def test_device_is_passed_to_nebula_fl_run_and_utilisation_lands_in_results(tmp_path, monkeypatch):
    calls = []

    def fake_run(args, *, folder, log, env=None, cwd=None):
        calls.append(args)
        return {}, [_line(1, 4.0, {"0": {"compute_s": 1.0}}),
                    _line(2, 8.0, {"0": {"compute_s": 1.0, "busy_fraction": 0.75, "idle_s": 1.0}})]

    monkeypatch.setattr(overhead, "run_federation", fake_run)
    monkeypatch.setattr(overhead, "plot", lambda runs, path: None)
    monkeypatch.setattr(sys, "argv", ["overhead.py", "--model", "minilm", "--device", "cuda", "--overlap", "both",
                                      "--local-steps", "auto", "--out", str(tmp_path / "out")])
    assert overhead.main() == 0
    assert all(args[args.index("--device") + 1] == "cuda" for args in calls) and len(calls) == 2
    assert all(args[args.index("--local-steps") + 1] == "auto" for args in calls)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["device"] == "cuda"
    assert results["busy_fraction_median"] == {"eval-overlap on": 0.75, "eval-overlap off": 0.75}
    assert results["idle_s_median"] == {"eval-overlap on": 1.0, "eval-overlap off": 1.0}
    assert results["phase_medians"]["eval-overlap on"]["busy_fraction"] == 0.75


def test_against_a_ref_alternates_the_two_trees_and_runs_the_other_from_its_own_worktree(tmp_path, monkeypatch):
    calls = []

    def fake_run(args, *, folder, log, env=None, cwd=None):
        here = None if cwd is None else (Path(cwd) / "nebula_fl" / "__init__.py").is_file()
        calls.append((folder.name, cwd, (env or {}).get("PYTHONPATH", ""), here))
        return {}, [_line(1, 4.0, {"0": {"compute_s": 1.0}}), _line(2, 9.0 if cwd else 7.0, {"0": {"compute_s": 1.0}})]

    monkeypatch.setattr(overhead, "run_federation", fake_run)
    monkeypatch.setattr(overhead, "plot", lambda runs, path: None)
    monkeypatch.setattr(sys, "argv", ["overhead.py", "--against", "HEAD", "--repeats", "2", "--out",
                                      str(tmp_path / "out")])
    assert overhead.main() == 0
    assert [c[0] for c in calls] == ["this-tree-0", "at-HEAD-0", "this-tree-1", "at-HEAD-1"]  # alternating
    tree = tmp_path / "out" / "tree-HEAD"
    assert calls[0][1] is None and calls[1][1] == tree and calls[1][2].startswith(str(tree)) and calls[1][3] is True
    assert not tree.exists()  # the worktree is removed after
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    # two runs a side pooled, the period taken within each run only (never across the two runs' records)
    assert results["phase_medians"]["this tree"]["period_s"] == 3.0
    assert results["phase_medians"]["at HEAD"]["period_s"] == 5.0
