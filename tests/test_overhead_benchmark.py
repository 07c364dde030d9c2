"""benchmarks/overhead.py without running a federation: its medians over synthetic round records, and the
arguments it hands `nebula-fl run`."""

from __future__ import annotations

import json
import sys

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

    def fake_run(args, *, folder, log):
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
