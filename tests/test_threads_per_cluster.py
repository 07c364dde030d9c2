"""`nebula-fl run --threads-per-cluster`: torch threads per worker, per cluster (a slower cluster on one box)."""

from __future__ import annotations

from argparse import Namespace

import pytest

from nebula_fl.errors import NebulaError
from nebula_fl.launcher.plan import make_plan


def _args(tmp_path, **given) -> Namespace:
    base = dict(resume=None, rewind=False, clusters=2, preset="smoke", task=None, rounds=None, local_steps=None,
                outer_optimizer=None, partition="iid", seed=None, codec=None, secure_aggregation=None, run_config=None,
                out=str(tmp_path / "run"), workers_per_cluster=None, device=None, port=0, wan=None, secure=None)
    return Namespace(**{**base, **given})


def test_threads_per_cluster_are_the_trainers_and_kept_for_resume(tmp_path):
    plan = make_plan(_args(tmp_path, workers_per_cluster="2,1", threads_per_cluster="2,1"))
    assert plan.threads == [2, 1]
    assert plan.launcher_record()["threads_per_cluster"] == [2, 1]
    assert make_plan(_args(tmp_path, threads_per_cluster="3")).threads == [3, 3]


def test_without_the_flag_the_cores_are_shared_evenly(tmp_path, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    plan = make_plan(_args(tmp_path, workers_per_cluster="2,2"))
    assert plan.threads == [2, 2] and plan.launcher_record()["threads_per_cluster"] is None


@pytest.mark.parametrize("given, fragment", [("2,1,1", "lists 3 values for 2 clusters"), ("0", "1 or more"),
                                             ("two", "1 or more"), ("4096", "at most 1024")])
def test_bad_threads_per_cluster(tmp_path, given, fragment):
    with pytest.raises(NebulaError, match=fragment):
        make_plan(_args(tmp_path, threads_per_cluster=given))
