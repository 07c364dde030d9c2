"""The adapter strategy against mock replies: what it sends, what it aggregates, what it refuses."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Metadata, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from nebula_fl.config import OuterConfig
from nebula_fl.strategies import make_strategy
from nebula_fl.strategies.adapter_strategy import to_numpy

GLOBAL = {"lora_A": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "head.bias": np.zeros(2, np.float32)}


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def _reply(node_id, update=None, metrics=None, error=None):
    meta = Metadata(run_id=1, message_id="", src_node_id=node_id, dst_node_id=0, reply_to_message_id=f"m{node_id}",
                    group_id="1", created_at=0.0, ttl=100.0, message_type="train")
    if error:
        return make_message(metadata=meta, error=Error(code=1, reason=error))
    content = RecordDict({
        "update": ArrayRecord({k: Array(np.asarray(v)) for k, v in update.items()}),
        "metrics": MetricRecord(metrics if metrics is not None else {"num-examples": 10, "train-loss": 1.0}),
    })
    return make_message(metadata=meta, content=content)


def _configured(nodes=(1, 2, 3), **kwargs):
    strategy = make_strategy(OuterConfig(outer_optimizer="fedavg"), **kwargs)
    record = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    messages = list(strategy.configure_train(4, record, ConfigRecord({"local-steps": 3}), FakeGrid(nodes)))
    return strategy, messages


def test_configure_train_sends_the_global_adapter_and_round_to_every_cluster():
    _, messages = _configured()
    assert sorted(m.metadata.dst_node_id for m in messages) == [1, 2, 3]
    for m in messages:
        assert set(m.content.array_records) == {"arrays"}
        np.testing.assert_array_equal(to_numpy(m.content.array_records["arrays"])["lora_A"], GLOBAL["lora_A"])
        assert m.content.config_records["config"]["server-round"] == 4
        assert m.content.config_records["config"]["local-steps"] == 3


def test_clusters_per_round_samples_a_seeded_subset():
    _, a = _configured(nodes=range(1, 11), clusters_per_round=3, seed=5)
    _, b = _configured(nodes=range(1, 11), clusters_per_round=3, seed=5)
    assert len(a) == 3
    assert [m.metadata.dst_node_id for m in a] == [m.metadata.dst_node_id for m in b]


def test_aggregate_is_the_weighted_mean_applied_to_the_global():
    strategy, _ = _configured()
    ups = [
        _reply(1, {"lora_A": np.ones((2, 2)), "head.bias": np.array([1.0, 0.0])}, {"num-examples": 30, "train-loss": 2.0}),
        _reply(2, {"lora_A": -np.ones((2, 2)), "head.bias": np.array([0.0, 1.0])}, {"num-examples": 10, "train-loss": 1.0}),
    ]
    arrays, metrics = strategy.aggregate_train(4, ups)
    new = to_numpy(arrays)
    np.testing.assert_allclose(new["lora_A"], GLOBAL["lora_A"] + 0.5)  # (30*1 + 10*-1) / 40
    np.testing.assert_allclose(new["head.bias"], [0.75, 0.25])
    assert metrics["num-examples"] == 40 and metrics["clusters"] == 2
    assert metrics["train-loss"] == pytest.approx((30 * 2.0 + 10 * 1.0) / 40)


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (_reply(3, {"lora_A": np.ones((3, 2)), "head.bias": np.zeros(2)}), "shape"),
        (_reply(3, {"lora_A": np.full((2, 2), np.nan), "head.bias": np.zeros(2)}), "NaN or Inf"),
        (_reply(3, {"lora_A": np.ones((2, 2))}), "keys do not match"),
        (_reply(3, {"lora_A": np.ones((2, 2), np.int64), "head.bias": np.zeros(2)}), "dtype"),
        (_reply(3, {"lora_A": np.ones((2, 2)), "head.bias": np.zeros(2)}, {"train-loss": 1.0}), "num-examples"),
        (_reply(3, {"lora_A": np.ones((2, 2)), "head.bias": np.zeros(2)}, {"num-examples": -5}), "num-examples"),
        (_reply(3, error="trainer crashed"), "trainer crashed"),
    ],
)
def test_a_malformed_update_never_touches_the_aggregate(bad, reason):
    strategy, _ = _configured()
    good = _reply(1, {"lora_A": np.ones((2, 2)), "head.bias": np.zeros(2)})
    arrays, metrics = strategy.aggregate_train(4, [good, bad])
    np.testing.assert_allclose(to_numpy(arrays)["lora_A"], GLOBAL["lora_A"] + 1.0)
    assert metrics["clusters"] == 1
    assert reason in strategy.rejected[3]


def test_no_usable_update_gives_no_aggregate():
    strategy, _ = _configured()
    arrays, metrics = strategy.aggregate_train(4, [_reply(1, error="boom")])
    assert arrays is None and metrics["clusters"] == 0


def test_evaluation_is_server_side_only():
    strategy, _ = _configured()
    assert list(strategy.configure_evaluate(1, ArrayRecord(), ConfigRecord(), FakeGrid([1]))) == []
