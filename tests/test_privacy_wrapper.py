"""The privacy wrapper against mock replies: refusals, exhausted clusters, equal weights, the server ledger."""

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Metadata, MetricRecord, RecordDict
from flwr.app.message.message import make_message

from nebula_fl.config import OuterConfig, PrivacyConfig
from nebula_fl.strategies import make_strategy
from nebula_fl.strategies.adapter_strategy import to_numpy
from nebula_fl.strategies.base import StopFederation
from nebula_fl.strategies.privacy import PrivacyWrapper

GLOBAL = {"w": np.zeros(4, np.float32)}


class FakeGrid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def reply(node, *, update=None, examples=10, refused=False):
    meta = Metadata(run_id=1, message_id="", src_node_id=node, dst_node_id=0, reply_to_message_id=f"m{node}",
                    group_id="1", created_at=0.0, ttl=100.0, message_type="train")
    metrics = {"num-examples": examples, "cluster-id": node, "train-loss": 1.0, "epsilon": 2.5}
    records = {"metrics": MetricRecord(metrics | ({"privacy-refused": 1} if refused else {}))}
    records["update"] = ArrayRecord({k: Array(np.asarray(v, np.float32)) for k, v in (update or {}).items()})
    if refused:
        records["notes"] = ConfigRecord({"privacy-reason": "cluster budget ε ≤ 3 would be exceeded"})
    return make_message(metadata=meta, content=RecordDict(records))


def wrapper(mode, **privacy):
    cfg = PrivacyConfig(mode=mode, noise_multiplier=1.0, accountant="rdp", **privacy)
    return PrivacyWrapper(make_strategy(OuterConfig()), cfg=cfg, num_rounds=10, clusters=3)


def record():
    return ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})


def test_a_refusing_cluster_is_never_sampled_again_and_the_run_stops_when_none_is_left():
    s = wrapper("sample", max_epsilon=3.0)
    s.configure_train(1, record(), ConfigRecord({}), FakeGrid([1, 2]))
    arrays, metrics = s.aggregate_train(1, [reply(1, update={"w": np.ones(4)}), reply(2, refused=True)])
    np.testing.assert_allclose(to_numpy(arrays)["w"], 1.0)
    assert metrics["clusters"] == 1
    assert s.exhausted["2"]["round"] == 1 and "would be exceeded" in s.exhausted["2"]["reason"]
    assert s.round_notes()["2"]["privacy_refused"] is True
    messages = list(s.configure_train(2, arrays, ConfigRecord({}), FakeGrid([1, 2])))
    assert [m.metadata.dst_node_id for m in messages] == [1]
    arrays2, metrics2 = s.aggregate_train(2, [reply(1, refused=True)])
    assert metrics2["clusters"] == 0
    np.testing.assert_array_equal(to_numpy(arrays2)["w"], to_numpy(arrays)["w"])  # nothing trained: unchanged
    with pytest.raises(StopFederation, match="every cluster has stopped: its privacy budget is spent"):
        s.configure_train(3, arrays2, ConfigRecord({}), FakeGrid([1, 2]))
    assert s.report()["clusters"] == {"1": {"stopped_round": 2, "reason": s.exhausted["1"]["reason"],
                                            "epsilon": 2.5, "refusal": "budget"},
                                      "2": {"stopped_round": 1, "reason": s.exhausted["2"]["reason"],
                                            "epsilon": 2.5, "refusal": "budget"}}


def test_exhausted_clusters_survive_a_checkpoint():
    s = wrapper("sample", max_epsilon=3.0)
    s.configure_train(1, record(), ConfigRecord({}), FakeGrid([1, 2]))
    s.aggregate_train(1, [reply(1, update={"w": np.ones(4)}), reply(2, refused=True)])
    restored = wrapper("sample", max_epsilon=3.0)
    restored.load_state_dict(s.state_dict())
    assert set(restored.exhausted) == {"2"}


def test_client_level_dp_weights_clusters_equally_and_accounts_each_round_on_the_server():
    s = wrapper("client")
    messages = list(s.configure_train(1, record(), ConfigRecord({}), FakeGrid([1, 2])))
    assert all(m.content.config_records["config"]["privacy-sigma"] == 1.0 for m in messages)
    assert all(m.content.config_records["config"]["privacy-noise-shares"] == 1 for m in messages)
    arrays, _ = s.aggregate_train(1, [reply(1, update={"w": np.ones(4)}, examples=1000),
                                      reply(2, update={"w": -np.ones(4)}, examples=10)])
    np.testing.assert_allclose(to_numpy(arrays)["w"], 0.0, atol=1e-7)  # not pulled toward the big cluster
    first = s.round_summary()["privacy"]
    assert first["rounds"] == 1 and first["mode"] == "client" and first["epsilon"] > 0
    s.configure_train(2, arrays, ConfigRecord({}), FakeGrid([1, 2]))
    s.aggregate_train(2, [reply(1, update={"w": np.ones(4)}), reply(2, update={"w": np.ones(4)})])
    assert s.round_summary()["privacy"]["epsilon"] > first["epsilon"]


def test_client_level_budget_stops_the_federation_before_it_is_passed():
    s = wrapper("client", max_epsilon=1.0)
    with pytest.raises(StopFederation, match="client-level budget"):
        s.configure_train(1, record(), ConfigRecord({}), FakeGrid([1]))


def test_privacy_config_needs_exactly_one_of_noise_and_target():
    from nebula_fl.errors import ConfigError

    with pytest.raises(ConfigError, match="set exactly one"):
        PrivacyConfig(mode="sample")
    with pytest.raises(ConfigError, match="set exactly one"):
        PrivacyConfig(mode="sample", noise_multiplier=1.0, target_epsilon=8.0)
    PrivacyConfig(mode="off")
