"""What a run's folder says when it ends: the ServerApp in process (no model: a stand-in evaluator), driving a
scripted grid or the in-process secure-aggregation federation (tests/secagg_harness.py). A run that aggregated no
round failed; one whose held round was never unmasked says so in summary.json; one whose last round every cluster
refused still holds every released round in its final adapter."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, Metadata, MetricRecord, RecordDict
from flwr.app.message.message import make_message
from safetensors.numpy import load_file

from nebula_fl.config import PrivacyConfig, RunConfig
from nebula_fl.errors import NebulaError
from nebula_fl.server import app
from nebula_fl.storage.run_folder import RunFolder
from tests.secagg_harness import make_federation
from tests.test_round_faults import ScriptedGrid
from tests.test_secagg_overlap import SHAPES, fast, mean_of, new_updates


def evaluator_for(initial):
    class Evaluator:
        """The ServerApp's evaluator without a model: the initial adapter given, accuracy r/10 for round r."""

        labels = ("a", "b")
        device = "cpu"

        def __init__(self, cfg):
            self.task = SimpleNamespace(metric="accuracy", exchange="adapter", higher_is_better=True)

        def initial_adapter(self):
            return {k: v.copy() for k, v in initial.items()}

        def frozen_fingerprint(self):
            return ""

        def records(self):
            return None  # no records to count: not a causal-lm run

        def save_peft(self, arrays, folder):
            return False  # no PEFT model behind it

        def __call__(self, server_round, arrays):
            return MetricRecord({"accuracy": server_round / 10, "loss": 1.0})

    return Evaluator


class RefusingGrid(ScriptedGrid):
    """Every cluster's gate declines every round: its policy requires secure aggregation, which the run lacks."""

    def _answer(self, message, mid):
        if message.metadata.message_type != "train":
            return super()._answer(message, mid)
        node = message.metadata.dst_node_id
        meta = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id=mid,
                        group_id="1", created_at=0.0, ttl=100.0, message_type="train")
        notes = ConfigRecord({"privacy-refusal": "policy",
                              "privacy-reason": "this cluster's policy requires secure aggregation"})
        metrics = MetricRecord({"cluster-id": int(self.script[node]), "privacy-refused": 1})
        return make_message(metadata=meta, content=RecordDict({"metrics": metrics, "notes": notes}))


def server_run(monkeypatch, tmp_path, *, initial, rounds, strategy=None, **flat):
    monkeypatch.setattr(app, "ServerEvaluator", evaluator_for(initial))
    monkeypatch.setattr(app, "plot_metric_vs_bytes", lambda *args, **kwargs: None)  # not what is tested; slow
    if strategy is not None:
        monkeypatch.setattr(app, "build_strategy", lambda cfg, initial=None: strategy)
    config = {"out-dir": str(tmp_path / "run"), "num-server-rounds": rounds, "min-clusters": 1, **flat}
    return app.ServerRun(RunConfig.from_flat(config)), RunFolder(tmp_path / "run")


def test_a_run_in_which_no_round_was_aggregated_fails_and_says_why(tmp_path, monkeypatch):
    run, folder = server_run(monkeypatch, tmp_path, initial={"w": np.zeros(3, np.float32)}, rounds=3)
    with pytest.raises(NebulaError, match="no round was aggregated"):
        run.run(RefusingGrid({1: "0", 2: "1"}))
    summary = folder.read_summary()
    assert summary["status"] == "failed" and "no round was aggregated in 1 round(s)" in summary["error"]
    assert "every cluster has stopped" in summary["error"] and "requires secure aggregation" in summary["error"]
    assert not (folder.path / "adapter.safetensors").exists()


def secagg_run(monkeypatch, tmp_path, *, privacy=False):
    strategy, clusters, grid, layout, initial = make_federation(tmp_path / "fed", n=3, shapes=SHAPES, cfg=fast(),
                                                                privacy=privacy)
    run, folder = server_run(monkeypatch, tmp_path, initial=initial, rounds=3, strategy=strategy,
                             **{"round-overlap": True})
    means = []

    def updates_of(rnd):  # each round its own updates, drawn as its train messages go out
        new_updates(clusters, rnd)
        means.append(mean_of(clusters, layout, {0, 1, 2})[0])

    push = grid.push_messages

    def pushing(messages):
        messages = list(messages)
        rounds = {dict(m.content.config_records["config"])["server-round"] for m in messages
                  if m.metadata.message_type == "train"}
        for rnd in rounds:
            updates_of(rnd)
        return push(messages)

    grid.push_messages = pushing
    return run, folder, clusters, grid, layout, initial, means


def test_a_secagg_run_whose_last_round_every_cluster_refuses_completes_with_every_released_round(tmp_path,
                                                                                                monkeypatch):
    privacy = PrivacyConfig(mode="client", noise_multiplier=1.0, accountant="rdp")
    run, folder, clusters, grid, layout, initial, means = secagg_run(monkeypatch, tmp_path, privacy=privacy)
    for c in clusters:
        c.refuse_rounds.add(3)
    run.run(grid)
    summary, lines = folder.read_summary(), folder.rounds()
    assert summary["status"] == "completed" and summary["rounds_not_applied"] == []
    assert lines[-1]["secagg"]["unmasked_rounds"] == [2] and lines[-1]["privacy"]["rounds"] == 2
    assert summary["privacy"]["client"]["rounds"] == 2
    final = layout.flatten(load_file(folder.path / "adapter.safetensors")).astype(np.float64)
    np.testing.assert_allclose(final, layout.flatten(initial) + means[0] + means[1], atol=1e-4)
    done, _, state = folder.load_checkpoint()
    assert done == 3 and state["strategy"]["inner"]["held"] is None


def test_a_held_round_never_unmasked_is_named_in_summary_json_with_its_reason(tmp_path, monkeypatch):
    run, folder, clusters, grid, layout, initial, means = secagg_run(monkeypatch, tmp_path)
    for c in clusters:
        c.drop_after_upload.add(1)  # every holder goes silent after uploading round 1: its sum is lost
    run.run(grid)
    summary = folder.read_summary()
    assert summary["status"] == "completed"
    (lost,) = summary["rounds_not_applied"]
    assert lost["round"] == 1 and lost["recorded_in"] == 2 and "fell short" in lost["reason"]
    final = layout.flatten(load_file(folder.path / "adapter.safetensors")).astype(np.float64)
    np.testing.assert_allclose(final, layout.flatten(initial) + means[1] + means[2], atol=1e-4)


def test_the_console_says_which_record_only_flushed_and_which_round_was_not_applied():
    from rich.console import Console

    from nebula_fl.launcher.report import print_summary, round_line

    flush = {"round": 4, "trained": False, "clusters": {}, "secagg": {"unmasked_rounds": [3]}}
    assert "no training: applied held round(s) 3" in round_line(flush, 3)
    lost = {"round": 2, "clusters": {}, "secagg": {"not_applied": [{"round": 1, "reason": "holders silent"}]}}
    assert "NOT APPLIED: round(s) 1" in round_line(lost, 3)
    console = Console(record=True, width=200)
    print_summary(console, [], {"status": "completed", "rounds_not_applied": [{"round": 1, "reason": "holders silent"}]},
                  "runs/x")
    assert "round 1's updates are not in the final adapter: holders silent" in console.export_text()


def test_a_run_that_stops_with_a_round_held_names_it_until_a_resume_applies_it():
    rounds = [{"round": 1, "secagg": {"held": 1}}, {"round": 2, "secagg": {"unmasked_rounds": [1], "held": 2}}]
    assert app._not_applied(rounds, status="completed") == []  # (a completed run flushed it: never the case)
    (pending,) = app._not_applied(rounds, status="interrupted")
    assert pending["round"] == 2 and pending["recorded_in"] == 2 and "--resume" in pending["reason"]
