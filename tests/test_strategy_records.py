"""What a strategy records of its decisions: checked as recorded, cleared each round, carried through the wrappers
into the round's line in metrics.jsonl and TensorBoard, and counted in clusters_aggregated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Metadata, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from nebula_fl.compression import Compressor, Layout
from nebula_fl.config import OuterConfig, RunConfig, Section, require
from nebula_fl.strategies import BUILTIN_STRATEGIES, make_strategy
from nebula_fl.strategies.adapter_strategy import to_numpy
from nebula_fl.strategies.base import RoundOutcome
from nebula_fl.strategies.fedavg import AdapterFedAvg
from tests.test_strategy import FakeGrid, _reply

GLOBAL = {"w": np.array([1.0, 2.0, 3.0], np.float32)}
LAYOUT = Layout.from_arrays(GLOBAL)


@dataclass(kw_only=True, frozen=True)
class DropOptions(Section):
    PREFIX: ClassVar[str] = "strategy"
    drop: int = 1
    """Updates left out each round: those farthest from the others."""

    def __post_init__(self) -> None:
        require(isinstance(self.drop, int) and self.drop >= 0, "strategy.drop", f"is {self.drop!r}", "use 0 or more")


class DropFarthest(AdapterFedAvg):
    """A Multi-Krum-like toy: score = summed squared distance to the other updates; the `drop` highest are out,
    the rest averaged without weights."""

    name = "drop-farthest"
    needs_individual_updates = True
    Options = DropOptions

    def aggregate_updates(self, updates, weights):
        flat = [np.concatenate([u[k].ravel() for k in sorted(u)]).astype(np.float64) for u in updates]
        scores = [sum(float(np.sum((a - b) ** 2)) for b in flat) for a in flat]
        out = set(np.argsort(scores)[len(scores) - self.options.drop:].tolist()) if self.options.drop else set()
        for i, score in enumerate(scores):
            self.record(i, kept=i not in out, score=score)
        self.record_round(dropped=len(out), rule="farthest")
        kept = [u for i, u in enumerate(updates) if i not in out]
        return {k: np.mean([u[k] for u in kept], axis=0).astype(np.float32) for k in updates[0]}


@pytest.fixture
def drop(monkeypatch):
    monkeypatch.setitem(BUILTIN_STRATEGIES, DropFarthest.name, DropFarthest)
    return DropFarthest


def _configured(strategy, nodes=(1, 2, 3), rnd=1):
    record = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    return list(strategy.configure_train(rnd, record, ConfigRecord({}), FakeGrid(nodes)))


def _plain_reply(node, value, cluster):
    return _reply(node, {"w": np.full(3, value, np.float32)},
                  {"num-examples": 10, "train-loss": 1.0, "cluster-id": cluster})


# -- the records themselves -------------------------------------------------------------------------------------
def test_a_dropped_update_is_recorded_and_not_counted_as_aggregated(drop):
    s = make_strategy(OuterConfig(outer_optimizer="drop-farthest"))
    _configured(s)
    # clusters 7, 8, 9 send 1, 2 and 100 on every coordinate; scores (3 coordinates): 7: 3 (1 + 99^2), 8: 3 (1 + 98^2),
    # 9: 3 (99^2 + 98^2); cluster 9 is out, the mean of 1 and 2 is 1.5
    arrays, metrics = s.aggregate_train(1, [_plain_reply(1, 1.0, 7), _plain_reply(2, 2.0, 8),
                                            _plain_reply(3, 100.0, 9)])
    np.testing.assert_allclose(to_numpy(arrays)["w"], GLOBAL["w"] + 1.5)
    assert metrics["clusters"] == 2 and metrics["clusters-usable"] == 3
    assert s.round_notes() == {"7": {"strategy": {"kept": True, "score": 3 * (1 + 99**2)}},
                               "8": {"strategy": {"kept": True, "score": 3 * (1 + 98**2)}},
                               "9": {"strategy": {"kept": False, "score": 3 * (99**2 + 98**2)}}}
    assert s.round_summary() == {"strategy": {"dropped": 1, "rule": "farthest"}}


def test_records_are_cleared_when_the_next_round_starts(drop):
    s = make_strategy(OuterConfig(outer_optimizer="drop-farthest"))
    _configured(s)
    s.aggregate_train(1, [_plain_reply(1, 1.0, 0), _plain_reply(2, 2.0, 1), _plain_reply(3, 100.0, 2)])
    assert s.round_notes() and s.round_summary()
    _configured(s, nodes=(1, 2), rnd=2)
    assert s.round_notes() == {} and s.round_summary() == {}
    s.aggregate_train(2, [_plain_reply(1, 1.0, 0), _plain_reply(2, 2.0, 1)])
    assert set(s.round_notes()) == {"0", "1"}  # round 2's clusters only


def test_a_strategy_that_records_nothing_reports_every_usable_update_and_no_records():
    s = make_strategy(OuterConfig())
    _configured(s)
    _, metrics = s.aggregate_train(1, [_plain_reply(1, 1.0, 0), _plain_reply(2, 2.0, 1)])
    assert metrics["clusters"] == metrics["clusters-usable"] == 2
    assert s.round_notes() == {} and s.round_summary() == {}


def test_a_skipped_round_aggregates_nothing_and_says_how_many_updates_were_usable():
    s = make_strategy(OuterConfig())
    s.set_min_updates(3)
    _configured(s)
    arrays, metrics = s.aggregate_train(1, [_plain_reply(1, 1.0, 0), _plain_reply(2, 2.0, 1)])
    assert arrays is None and metrics["clusters"] == 0 and metrics["clusters-usable"] == 2


class Recorder(AdapterFedAvg):
    name = "recorder"
    values: ClassVar[dict] = {}
    index: ClassVar[object] = 0

    def aggregate_updates(self, updates, weights):
        self.record(self.index, **self.values)
        return super().aggregate_updates(updates, weights)


@pytest.mark.parametrize(("index", "values", "problem"), [
    (0, {"score": float("nan")}, r"recorded 'score'=nan for cluster 0: record finite numbers only"),
    (0, {"score": [1, 2]}, r"'score'=\[1, 2\] for cluster 0: record a number, a bool or a short string"),
    (0, {"kept": 1}, r"'kept'=1 .*'kept' is True or False"),
    (0, {"Score": 1}, r"'Score'=1 .*lower_snake_case"),
    (0, {"note": "x" * 81}, r"one line of at most 80 characters"),
    (0, {"note": "two\nlines"}, r"one line of at most 80 characters"),
    (2, {"score": 1.0}, r"for update index 2; this round's aggregate_updates was given 2 update\(s\): use 0\.\.1"),
    (-1, {"score": 1.0}, r"for update index -1"),
    (True, {"score": 1.0}, r"for update index True"),
])
def test_a_bad_record_is_a_one_line_error_naming_the_strategy(monkeypatch, index, values, problem):
    monkeypatch.setattr(Recorder, "values", values)
    monkeypatch.setattr(Recorder, "index", index)
    s = Recorder()
    _configured(s)
    with pytest.raises(ValueError, match=r"^strategy 'recorder' .*" + problem) as err:
        s.aggregate_train(1, [_plain_reply(1, 1.0, 0), _plain_reply(2, 2.0, 1)])
    assert "\n" not in str(err.value)


def test_round_records_are_checked_too_and_numpy_scalars_become_plain_numbers():
    s = Recorder()
    with pytest.raises(ValueError, match=r"^strategy 'recorder' recorded 'kept' for the round"):
        s.record_round(kept=True)
    with pytest.raises(ValueError, match=r"recorded 'x'=inf for the round: record finite numbers only"):
        s.record_round(x=float("inf"))
    s.record_round(share=np.float32(0.5), count=np.int64(3), flag=np.bool_(True))
    got = s.round_summary()["strategy"]
    assert got == {"share": 0.5, "count": 3, "flag": True}
    assert [type(v) for v in got.values()] == [float, int, bool]


def test_outside_a_round_a_cluster_is_named_by_its_index(drop):
    s = make_strategy(OuterConfig(outer_optimizer="drop-farthest"))
    s.aggregate_updates([{"w": np.zeros(1)}, {"w": np.ones(1)}, {"w": np.full(1, 9.0)}], [1.0] * 3)
    assert s.round_notes()["2"]["strategy"]["kept"] is False


# -- through the wrappers, into the run's record ----------------------------------------------------------------
def _blob_reply(node, value, cluster, seed):
    meta = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id=f"m{node}",
                    group_id="1", created_at=0.0, ttl=100.0, message_type="train")
    blob = Compressor("none", layout=LAYOUT).encode(LAYOUT.flatten({"w": np.full(3, value, np.float32)}), seed=seed)
    return make_message(metadata=meta, content=RecordDict({
        "update": ArrayRecord({"blob": Array(np.frombuffer(blob, np.uint8).copy())}),
        "metrics": MetricRecord({"num-examples": 10, "cluster-id": cluster, "train-loss": 1.0}),
    }))


def test_records_pass_the_wrappers_into_metrics_jsonl_and_tensorboard(drop, tmp_path, monkeypatch):
    from nebula_fl.server import app
    from tests.test_tensorboard import read_back

    monkeypatch.setattr(app, "log", lambda *args: None)
    cfg = RunConfig.from_flat({"out-dir": str(tmp_path / "run"), "outer-optimizer": "drop-farthest",
                               "strategy.drop": 1, "comm.codec": "topk:0.1", "comm.adaptive": True})
    strategy = app.build_strategy(cfg, initial=GLOBAL)  # privacy(compression(drop-farthest)), adaptive codec notes
    assert strategy.inner.inner.options.drop == 1
    for node in (1, 2, 3):
        strategy.directory.learn(node, str(node - 1))
    _configured(strategy, nodes=(1, 2, 3))
    seed = strategy.inner.round_seed
    arrays, metrics = strategy.aggregate_train(1, [_blob_reply(1, 1.0, 0, seed), _blob_reply(2, 2.0, 1, seed),
                                                   _blob_reply(3, 100.0, 2, seed)])
    np.testing.assert_allclose(to_numpy(arrays)["w"], GLOBAL["w"] + 1.5)
    notes = strategy.round_notes()
    assert notes["2"]["strategy"]["kept"] is False and "codec_param" in notes["2"]  # the codec's note beside it

    run = app.ServerRun(cfg)
    run._open()
    run.metric, run.strategy = "accuracy", strategy
    run._record_round(RoundOutcome(round=1, arrays=arrays, train_metrics=metrics, eval_metrics=None, nodes={},
                                   rejected={}, seconds=1.0, notes=notes, extras=strategy.round_summary()))
    run.tensorboard.close()
    line = run.folder.rounds()[-1]
    assert line["clusters_aggregated"] == 2 and line["clusters_usable"] == 3
    assert line["strategy"] == {"dropped": 1, "rule": "farthest"}
    assert {cid: c["strategy"]["kept"] for cid, c in line["clusters"].items()} == {"0": True, "1": True, "2": False}
    got = read_back(run.folder.path / "tensorboard")
    assert got["train/clusters_aggregated"] == {1: 2.0} and got["train/clusters_usable"] == {1: 3.0}
    assert got["strategy/dropped"] == {1: 1.0} and "strategy/rule" not in got
    assert {c: got[f"strategy/kept/cluster_{c}"][1] for c in "012"} == {"0": 1.0, "1": 1.0, "2": 0.0}
    assert got["strategy/score/cluster_2"] == {1: pytest.approx(3 * (99**2 + 98**2))}
    assert not any(tag.startswith("cluster_") and "strategy" in tag for tag in got)  # one tag per record
