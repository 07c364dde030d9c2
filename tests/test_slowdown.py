"""Emulated slower sites on one box: `nebula-fl run --slowdown-per-cluster` and the trainer's pacer."""

from __future__ import annotations

import pytest

from nebula_fl.clients import trainer
from nebula_fl.errors import NebulaError
from nebula_fl.launcher.plan import make_plan
from tests.test_threads_per_cluster import _args


def test_slowdown_per_cluster_is_each_trainers_and_kept_for_resume(tmp_path):
    plan = make_plan(_args(tmp_path, slowdown_per_cluster="1,4"))
    assert plan.slowdown_per_cluster == [1.0, 4.0]
    assert plan.launcher_record()["slowdown_per_cluster"] == [1.0, 4.0]
    assert make_plan(_args(tmp_path, slowdown_per_cluster=None)).slowdown_per_cluster is None


@pytest.mark.parametrize("given", ["0.5", "nan", "inf", "two", "1001", "1,2,3"])
def test_bad_slowdowns_are_refused_with_the_flag_named(tmp_path, given):
    with pytest.raises(NebulaError, match="--slowdown-per-cluster"):
        make_plan(_args(tmp_path, slowdown_per_cluster=given))


def test_the_pacer_rests_slowdown_minus_one_times_every_step_the_last_included(monkeypatch):
    clock, slept = [0.0], []
    monkeypatch.setattr(trainer.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(trainer.time, "sleep", lambda s: (slept.append(s), clock.__setitem__(0, clock[0] + s)))
    pacer = trainer.Pacer(4.0)
    go = pacer.wrap(lambda done: done < 3)  # a budget that allows 3 steps
    taken = 0
    while go(taken):
        clock[0] += 1.0  # a step of 1 s
        taken += 1
    pacer.finish(taken)
    assert taken == 3 and slept == [3.0, 3.0, 3.0]
    assert trainer.Pacer(1.0).wrap(None) is None  # no slowdown: nothing wrapped
