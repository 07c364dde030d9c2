"""Flower's own strategies (``flwr:<Class>``) as outer optimizers, each against the stock class on the same inputs.

The stock side is driven here as Flower's loop and stock ClientApps would drive it: its own configure_train
against a grid of the three clusters, then replies made with Flower's public ``Message(content, reply_to=...)``
holding each cluster's trained weights (global + update) and its example count under Flower's own defaults
(loss under ``train_loss``, QFedAvg's default key). The wrapped side gets nebula-fl's replies (updates). Inputs
are dyadic (sums and weights exact in float32), so where the two sides add the same numbers the results are
equal bit for bit. End to end: Flower's MultiKrum (reads every update) runs the regression plug-in's federation
(tests/test_regression_task.py), Flower's FedAdam under secure aggregation the shared causal-lm one.
"""

from __future__ import annotations

import flwr.serverapp.strategy as stock
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from nebula_fl.components import load as load_config
from nebula_fl.config import OuterConfig
from nebula_fl.errors import ConfigError
from nebula_fl.storage.checkpoint import read_checkpoint, write_checkpoint
from nebula_fl.strategies import make_strategy, strategy_class
from nebula_fl.strategies.adapter_strategy import to_numpy, to_record
from nebula_fl.strategies.aggregation import weighted_mean
from nebula_fl.strategies.flower import INDIVIDUAL, MEAN_BASED, REFUSED, FlowerOuter
from nebula_fl.strategies.plugin_class import check_strategy_class
from tests.conftest import put_on_path, take_off_path
from tests.test_plugins import _fake_dist
from tests.test_strategy import FakeGrid, _reply

NODES = (1, 2, 3)
GLOBAL = {"a": np.array([1.0, 2.0, 3.0, 4.0], np.float32), "b": np.array([[0.5, -0.5], [1.0, 0.0]], np.float32)}
ROUNDS = [  # per round: each cluster's update, weight (num-examples) and training loss
    [({"a": np.array([0.5, -1.0, 0.25, 2.0]), "b": np.array([[1.0, 0.0], [-0.5, 0.5]])}, 10, 0.5),
     ({"a": np.array([-0.5, 0.5, 0.75, -1.0]), "b": np.array([[0.0, 1.0], [0.5, 0.5]])}, 10, 1.0),
     ({"a": np.array([1.5, 0.0, -0.25, 0.5]), "b": np.array([[-1.0, 0.25], [0.0, -0.5]])}, 20, 2.0)],
    [({"a": np.array([0.25, 0.5, -0.5, 1.0]), "b": np.array([[0.5, 0.5], [0.0, -1.0]])}, 20, 0.25),
     ({"a": np.array([-1.0, 0.25, 0.5, 0.0]), "b": np.array([[0.0, -0.5], [1.0, 0.25]])}, 10, 0.5),
     ({"a": np.array([0.5, -0.5, 1.0, -0.25]), "b": np.array([[0.25, 0.0], [-0.5, 0.5]])}, 10, 1.5)],
]
OPTIONS = {  # non-default options, so each test also shows the strategy.* keys reach the Flower instance
    "FedAvg": {},
    "FedAvgM": {"strategy.server-learning-rate": 0.5, "strategy.server-momentum": 0.9},
    "FedProx": {"strategy.proximal-mu": 0.1},
    "FedAdam": {"strategy.eta": 0.05, "strategy.beta-2": 0.9},
    "FedYogi": {"strategy.eta": 0.02, "strategy.tau": 0.01},
    "FedAdagrad": {"strategy.eta": 0.3},
    "FedMedian": {},
    "FedTrimmedAvg": {"strategy.beta": 0.34},  # 3 clusters: one cut from each end
    "Krum": {},
    "MultiKrum": {"strategy.num-nodes-to-select": 2},
    "Bulyan": {},
    "QFedAvg": {"strategy.client-learning-rate": 0.1, "strategy.q": 0.2},
}


def _updates(rnd):
    return [({k: v.astype(np.float32) for k, v in u.items()}, w, loss) for u, w, loss in ROUNDS[rnd]]


def _wrapped(cls_name, options=None):
    return make_strategy(OuterConfig(outer_optimizer=f"flwr:{cls_name}"),
                         options=OPTIONS[cls_name] if options is None else options)


def _wrapped_round(strategy, rnd, params):
    strategy.configure_train(rnd + 1, to_record(params), ConfigRecord(), FakeGrid(NODES))
    replies = [_reply(n, u, {"num-examples": w, "train-loss": loss}) for n, (u, w, loss) in zip(NODES, _updates(rnd))]
    arrays, metrics = strategy.aggregate_train(rnd + 1, replies)
    assert arrays is not None, metrics
    return to_numpy(arrays)


def _stock(cls_name):
    """The stock class with the same options, otherwise Flower's own defaults (min nodes 2, keys, fractions)."""
    kwargs = {k.removeprefix("strategy.").replace("-", "_"): v for k, v in OPTIONS[cls_name].items()}
    return getattr(stock, cls_name)(**kwargs)


def _stock_round(strategy, rnd, params):
    """One round as Flower's loop runs it, with replies as a stock ClientApp makes them: its trained weights."""
    sent = list(strategy.configure_train(rnd + 1, to_record(params), ConfigRecord(), FakeGrid(NODES)))
    assert sorted(m.metadata.dst_node_id for m in sent) == list(NODES)
    by_node = dict(zip(NODES, _updates(rnd)))
    replies = []
    # replies in node order, as nebula-fl hands them over: Krum breaks a tie of scores by reply order (with 3
    # replies the two nearest each other always tie), so an order Flower's sampler shuffled would pick another
    for instruction in sorted(sent, key=lambda m: m.metadata.dst_node_id):
        update, weight, loss = by_node[instruction.metadata.dst_node_id]
        received = to_numpy(instruction.content.array_records["arrays"])
        trained = ArrayRecord({k: Array(received[k] + update[k]) for k in received})
        metrics = MetricRecord({"num-examples": weight, "train_loss": loss})
        replies.append(Message(RecordDict({"arrays": trained, "metrics": metrics}), reply_to=instruction))
    arrays, _ = strategy.aggregate_train(rnd + 1, replies)
    return {k: v.astype(np.float32) for k, v in to_numpy(arrays).items()}  # the model holds float32


# -- every supported class against its stock self -------------------------------------------------------------
@pytest.mark.parametrize("cls_name", [*MEAN_BASED, *INDIVIDUAL])
def test_two_rounds_equal_the_stock_strategy_on_the_replies_stock_clients_send(cls_name):
    wrapped, reference = _wrapped(cls_name), _stock(cls_name)
    for key, value in OPTIONS[cls_name].items():  # the options reached the wrapped instance
        assert getattr(wrapped.flower, key.removeprefix("strategy.").replace("-", "_")) == value
    ours = theirs = GLOBAL
    for rnd in range(2):  # two rounds: the second runs on the state (momentum, moments) the first left
        ours, theirs = _wrapped_round(wrapped, rnd, ours), _stock_round(reference, rnd, theirs)
        for key in GLOBAL:
            assert ours[key].dtype == np.float32
            np.testing.assert_allclose(ours[key], theirs[key], rtol=1e-6, atol=1e-7, err_msg=f"{cls_name} {key}")
        assert any(not np.array_equal(ours[k], GLOBAL[k]) for k in GLOBAL)


def test_fedavg_is_the_example_weighted_mean_by_hand():
    new = _wrapped_round(_wrapped("FedAvg"), 0, GLOBAL)
    # weights 10, 10, 20: a = global + (u1 + u2 + 2 u3) / 4
    np.testing.assert_array_equal(new["a"], np.array([1.0 + 0.75, 2.0 - 0.125, 3.0 + 0.125, 4.0 + 0.5], np.float32))
    np.testing.assert_array_equal(new["b"], np.array([[0.5 - 0.25, -0.5 + 0.375], [1.0 + 0.0, 0.0 + 0.0]], np.float32))


def test_fedmedian_is_the_coordinate_wise_median_by_hand():
    new = _wrapped_round(_wrapped("FedMedian"), 0, GLOBAL)
    np.testing.assert_array_equal(new["a"], np.array([1.0 + 0.5, 2.0 + 0.0, 3.0 + 0.25, 4.0 + 0.5], np.float32))
    np.testing.assert_array_equal(new["b"], np.array([[0.5 + 0.0, -0.5 + 0.25], [1.0 + 0.0, 0.0 + 0.5]], np.float32))


def test_fedavgm_momentum_by_hand():
    """Flower's FedAvgM: pseudo-gradient g = -(mean update), v = m v + g, x -= lr v; lr 0.5, m 0.9."""
    strategy = _wrapped("FedAvgM")
    first = _wrapped_round(strategy, 0, GLOBAL)
    second = _wrapped_round(strategy, 1, first)
    d1 = weighted_mean([u for u, _, _ in _updates(0)], [w for _, w, _ in _updates(0)])
    d2 = weighted_mean([u for u, _, _ in _updates(1)], [w for _, w, _ in _updates(1)])
    for k in GLOBAL:
        np.testing.assert_allclose(first[k], GLOBAL[k] + 0.5 * d1[k], rtol=1e-6)
        np.testing.assert_allclose(second[k], first[k] + 0.5 * (0.9 * d1[k] + d2[k]), rtol=1e-6, atol=1e-7)


# -- secure aggregation -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls_name", MEAN_BASED)
def test_a_mean_based_strategy_given_only_the_mean_moves_exactly_as_with_every_update(cls_name):
    individual, secure = _wrapped(cls_name), _wrapped(cls_name)
    ours = theirs = GLOBAL
    for rnd in range(2):
        ours = _wrapped_round(individual, rnd, ours)
        secure.configure_train(rnd + 1, to_record(theirs), ConfigRecord(), FakeGrid(NODES))
        updates = _updates(rnd)
        mean = weighted_mean([u for u, _, _ in updates], [w for _, w, _ in updates])
        arrays, metrics = secure.apply_mean(mean, weight=40, count=3)
        theirs = to_numpy(arrays)
        assert metrics["clusters"] == 3
        for key in GLOBAL:
            np.testing.assert_array_equal(ours[key], theirs[key], err_msg=f"{cls_name} round {rnd + 1} {key}")


@pytest.mark.parametrize("cls_name", INDIVIDUAL)
def test_a_strategy_that_reads_each_update_is_refused_with_secure_aggregation(cls_name):
    with pytest.raises(ConfigError, match=rf"outer-optimizer' is 'flwr:{cls_name}' with secure aggregation"):
        load_config({"outer-optimizer": f"flwr:{cls_name}", "secagg.enabled": True, **OPTIONS[cls_name]})
    strategy = _wrapped(cls_name)
    strategy.configure_train(1, to_record(GLOBAL), ConfigRecord(), FakeGrid(NODES))
    with pytest.raises(ConfigError, match="needs each cluster's update"):
        strategy.apply_mean({k: np.zeros_like(v) for k, v in GLOBAL.items()}, weight=40, count=3)


def test_mean_based_strategies_load_with_secure_aggregation():
    for cls_name in MEAN_BASED:
        cfg = load_config({"outer-optimizer": f"flwr:{cls_name}", "secagg.enabled": True, **OPTIONS[cls_name]})
        assert not strategy_class(cfg.outer.outer_optimizer).needs_individual_updates


# -- names, options, refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("name", "match"), [
    ("flwr:FedYogy", r"unknown outer optimizer 'flwr:FedYogy'; did you mean 'flwr:FedYogi'"),
    ("flwr:fedadam", r"did you mean 'flwr:FedAdam'"),
    ("FedYogi", r"unknown outer optimizer 'FedYogi'; did you mean 'flwr:FedYogi'"),
    ("flwr:FedXgbBagging", r"Flower's FedXgbBagging cannot be an outer optimizer: .*XGBoost"),
    ("flwr:DifferentialPrivacyServerSideFixedClipping", r"cannot be an outer optimizer: .*privacy\.mode"),
])
def test_unknown_and_refused_names_say_why(name, match):
    with pytest.raises(ConfigError, match=rf"config key 'outer-optimizer': .*{match}"):
        load_config({"outer-optimizer": name})


def test_every_flower_strategy_is_either_supported_or_refused_with_a_reason():
    exported = {n for n in stock.__all__ if n != "Result"}
    assert exported == {*MEAN_BASED, *INDIVIDUAL, *REFUSED}
    assert not set(MEAN_BASED) & set(INDIVIDUAL)


@pytest.mark.parametrize(("flat", "match"), [
    ({"strategy.etta": 0.1}, r"unknown config key 'strategy.etta'; did you mean 'strategy.eta'"),
    ({"strategy.eta": "fast"}, r"config key 'strategy.eta' must be float"),
    ({"strategy.eta": float("nan")}, r"config key 'strategy.eta' is nan; use a finite number"),
    ({"outer-lr": 0.1}, r"config key 'outer-lr' is 0.1, but it does not apply to outer optimizer 'flwr:FedYogi': "
                        r"its own server learning rate is strategy.eta"),
])
def test_bad_options_are_refused_at_start(flat, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"outer-optimizer": "flwr:FedYogi", **flat})


def test_options_reach_the_wrapped_instance_and_the_rest_keep_flowers_defaults():
    cfg = load_config({"outer-optimizer": "flwr:FedYogi", "strategy.eta": 0.05, "strategy.beta-1": 0.5})
    strategy = make_strategy(cfg.outer, options=cfg.strategy_options)
    assert (strategy.flower.eta, strategy.flower.beta_1) == (0.05, 0.5)
    assert (strategy.flower.beta_2, strategy.flower.tau, strategy.flower.eta_l) == (0.99, 1e-3, 0.0316)
    assert strategy.flower.weighted_by_key == "num-examples" and strategy.flower.min_available_nodes == 0
    assert "strategy.fraction-train" not in type(strategy).Options.flat_keys()  # the framework's, not an option


def test_flowers_own_refusals_and_required_arguments_are_config_errors():
    with pytest.raises(ConfigError, match=r"refuses its strategy\.\* options: `beta` must be in the range"):
        load_config({"outer-optimizer": "flwr:FedTrimmedAvg", "strategy.beta": 0.6})
    with pytest.raises(ConfigError, match=r"config key 'strategy.client-learning-rate' is required by outer "
                                          r"optimizer 'flwr:QFedAvg'.*the clusters' lr is"):
        load_config({"outer-optimizer": "flwr:QFedAvg"})


def test_fedprox_asks_the_clusters_for_its_proximal_term():
    assert _wrapped("FedProx").client_config() == {"prox-mu": 0.1}
    assert _wrapped("FedAvg").client_config() == {}


# -- checkpoint ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls_name", ["FedYogi", "FedAvgM", "FedAdagrad"])
def test_a_resumed_strategy_continues_bit_exactly_through_a_checkpoint(cls_name, tmp_path):
    uninterrupted = _wrapped(cls_name)
    first = _wrapped_round(uninterrupted, 0, GLOBAL)
    folder = tmp_path / "round-00001"
    folder.mkdir()
    write_checkpoint(folder, round=1, adapter=first, state={"strategy": uninterrupted.state_dict()})
    resumed = _wrapped(cls_name)
    resumed.load_state_dict(read_checkpoint(folder).state["strategy"])
    expected, got = _wrapped_round(uninterrupted, 1, first), _wrapped_round(resumed, 1, first)
    fresh = _wrapped_round(_wrapped(cls_name), 1, first)  # without the state, round 2 differs: the state matters
    for key in GLOBAL:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert any(not np.array_equal(fresh[k], expected[k]) for k in GLOBAL)


def test_the_state_of_another_strategy_is_refused():
    with pytest.raises(ValueError, match="holds 'flwr:FedYogi' optimizer state, this run uses 'flwr:FedAdam'"):
        _wrapped("FedAdam").load_state_dict(_wrapped("FedYogi").state_dict())


# -- the entry-point route ------------------------------------------------------------------------------------
def test_a_plugin_may_register_a_flower_strategy_class_and_it_is_wrapped(tmp_path):
    site = tmp_path / "site"
    _fake_dist(site, "flower_plugin", "nebula_fl.strategies", "my-yogi = flwr.serverapp.strategy:FedYogi\n")
    put_on_path(site)
    try:
        cls = strategy_class("my-yogi")
        assert issubclass(cls, FlowerOuter) and cls.name == "my-yogi" and cls.flower_class is stock.FedYogi
        assert cls.needs_individual_updates  # nothing says a plug-in's class is mean-based
        cfg = load_config({"outer-optimizer": "my-yogi", "strategy.eta": 0.05})
        assert make_strategy(cfg.outer, options=cfg.strategy_options).flower.eta == 0.05
        with pytest.raises(ConfigError, match="with secure aggregation"):
            load_config({"outer-optimizer": "my-yogi", "secagg.enabled": True})
    finally:
        take_off_path(site)

    class MeanBased(stock.FedAvg):
        needs_individual_updates = False

    assert not check_strategy_class(MeanBased, name="mean", where="plugin 'mean'").needs_individual_updates
    with pytest.raises(ValueError, match=r"cannot be an outer optimizer: .*XGBoost"):
        check_strategy_class(type("Trees", (stock.FedXgbBagging,), {}), name="trees", where="plugin 'trees'")


# -- end to end ---------------------------------------------------------------------------------------------------
def test_replies_reach_the_strategy_in_cluster_order_whatever_order_they_arrived_in():
    """Krum with 3 replies: the two updates nearest each other tie, and Flower picks the first in reply order."""
    def krum(arrival, clusters):
        strategy = _wrapped("Krum")
        for node, cluster in clusters.items():
            strategy.directory.learn(node, cluster)
        strategy.configure_train(1, to_record(GLOBAL), ConfigRecord(), FakeGrid(NODES))
        replies = {n: _reply(n, u, {"num-examples": w, "train-loss": x}) for n, (u, w, x) in zip(NODES, _updates(0))}
        return to_numpy(strategy.aggregate_train(1, [replies[n] for n in arrival])[0])

    by_node = krum([1, 2, 3], {})
    assert all(np.array_equal(krum([3, 2, 1], {})[k], by_node[k]) for k in GLOBAL)
    reversed_clusters = krum([1, 2, 3], {1: "2", 2: "1", 3: "0"})  # cluster 0 is node 3: its reply comes first
    assert all(np.array_equal(krum([3, 1, 2], {1: "2", 2: "1", 3: "0"})[k], reversed_clusters[k]) for k in GLOBAL)
    assert any(not np.array_equal(reversed_clusters[k], by_node[k]) for k in GLOBAL)  # the order decided the tie


def test_multikrum_says_which_clusters_it_kept_and_clusters_aggregated_counts_them():
    """Four clusters, one far from the rest: MultiKrum (f = 1, keep 3) leaves it out, records kept=False for it,
    and the round's `clusters` (metrics.jsonl's clusters_aggregated) is 3 of 4 usable."""
    nodes = (1, 2, 3, 4)
    near = [np.array([0.5, 0.25, 0.0, 0.25]), np.array([0.25, 0.5, 0.25, 0.0]), np.array([0.5, 0.5, 0.25, 0.25])]
    updates = [{"a": u.astype(np.float32), "b": np.zeros((2, 2), np.float32)} for u in near]
    updates.insert(2, {"a": np.full(4, 50.0, np.float32), "b": np.full((2, 2), 50.0, np.float32)})  # cluster 2
    strategy = _wrapped("MultiKrum", {"strategy.num-malicious-nodes": 1, "strategy.num-nodes-to-select": 3})
    strategy.configure_train(1, to_record(GLOBAL), ConfigRecord(), FakeGrid(nodes))
    replies = [_reply(n, u, {"num-examples": 10, "train-loss": 1.0, "cluster-id": n - 1})
               for n, u in zip(nodes, updates)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert metrics["clusters"] == 3 and metrics["clusters-usable"] == 4
    notes = strategy.round_notes()
    assert {cid: n["strategy"]["kept"] for cid, n in notes.items()} == {"0": True, "1": True, "2": False, "3": True}
    kept_mean = np.mean([u["a"] for i, u in enumerate(updates) if i != 2], axis=0)
    np.testing.assert_allclose(to_numpy(arrays)["a"], GLOBAL["a"] + kept_mean, rtol=1e-6)
    fedavg = _wrapped("FedAvg")  # a mean-based strategy records nothing: every update is in its aggregate
    fedavg.configure_train(1, to_record(GLOBAL), ConfigRecord(), FakeGrid(nodes))
    _, plain = fedavg.aggregate_train(1, replies)
    assert plain["clusters"] == 4 and fedavg.round_notes() == {}
