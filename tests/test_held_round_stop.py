"""No held round is lost when a run stops: secure aggregation with round-overlap holds round r's uploads until round
r+1, and every way a run ends (all sampled clusters refused, all stopped, the last round reached after a resume)
still applies them, or says why not. The real round loop (`start`) drives the in-process federation of
tests/secagg_harness.py; the server's privacy accountant counts the rounds whose sum was released."""

from __future__ import annotations

import json
import logging

import numpy as np
from flwr.app import ConfigRecord

from nebula_fl.config import PrivacyConfig
from nebula_fl.storage.checkpoint import join_state, split_state
from nebula_fl.strategies.adapter_strategy import to_record
from nebula_fl.strategies.base import StopFederation
from tests.secagg_harness import make_federation
from tests.test_secagg_overlap import SHAPES, close, fast, flat, mean_of, new_updates, sent

CLIENT_DP = PrivacyConfig(mode="client", noise_multiplier=1.0, accountant="rdp")


def start(strategy, grid, initial, clusters, layout, *, rounds, planned, first_round=1, on_aggregated=None):
    """Run the loop over `rounds` (the config says `planned`), each round its own updates; returns (outcomes,
    [(mean, spread)] of each round's updates)."""
    outcomes, means = [], []

    def aggregated(outcome):
        if on_aggregated:
            on_aggregated(outcome)
        new_updates(clusters, outcome.round + 1)
        means.append(mean_of(clusters, layout, {c.cid for c in clusters}))

    new_updates(clusters, first_round)
    means.append(mean_of(clusters, layout, {c.cid for c in clusters}))
    config = ConfigRecord({"federation-id": "fed1", "round-overlap": True, "num-server-rounds": planned})
    strategy.start(grid, to_record(initial), num_rounds=rounds, timeout=5, train_config=config, first_round=first_round,
                   evaluate_initial=False, on_round_end=outcomes.append, on_round_aggregated=aggregated,
                   poll_interval=0.01)
    return outcomes, means


def secagg_of(outcome):
    return outcome.extras["secagg"]


def test_a_last_round_every_cluster_refuses_still_applies_the_held_round_from_the_refusals(tmp_path):
    strategy, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast(),
                                                                privacy=CLIENT_DP)
    for c in clusters:  # the natural end of a budget-limited run: every cluster's gate declines round 3
        c.refuse_rounds.add(3)
    outcomes, means = start(strategy, grid, initial, clusters, layout, rounds=3, planned=3)
    last = outcomes[-1]
    assert [o.round for o in outcomes] == [1, 2, 3] and last.skipped is None
    assert secagg_of(last)["unmasked_rounds"] == [2] and secagg_of(last)["extra_trips"] == 0
    assert not sent(grid, "unmask"), "the refusal replies carried every answer"
    close(flat(last.arrays, layout), means[0][0] + means[1][0], step=strategy.inner.round["code"].step,
          spread=means[0][1] + means[1][1])
    assert strategy.inner.held is None and last.strategy_state["inner"]["held"] is None
    # the accountant: round 1's sum was released in round 2, round 2's in round 3; round 3 released nothing
    assert [o.extras["privacy"]["rounds"] for o in outcomes] == [0, 1, 2]


def test_a_stop_because_every_cluster_stopped_flushes_the_held_round_into_one_more_record(tmp_path):
    strategy, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast(),
                                                                privacy=CLIENT_DP)

    def stop_everyone(outcome):  # their operators stop them after round 1: round 2 is never sent
        for c in clusters:
            strategy.exhausted[str(c.cid)] = {"round": 1, "reason": "stopped in the test", "refusal": "policy"}
            strategy.directory.stopped.add(str(c.cid))

    outcomes, means = start(strategy, grid, initial, clusters, layout, rounds=5, planned=5,
                            on_aggregated=stop_everyone)
    assert "every cluster has stopped" in strategy.stop_reason
    flush = outcomes[-1]
    assert [(o.round, o.trained) for o in outcomes] == [(1, True), (2, False)] and flush.skipped is None
    assert secagg_of(flush)["flushed"] == 1 and secagg_of(flush)["unmasked_rounds"] == [1]
    assert len(sent(grid, "unmask", rnd=1)) == 3 and secagg_of(flush)["extra_trips"] == 1
    assert sum(t.bytes_down for t in flush.nodes.values()) > 0, "the unmask trip is the flush record's traffic"
    np.testing.assert_allclose(flat(flush.arrays, layout), layout.flatten(initial) + means[0][0], atol=1e-4)
    assert flush.strategy_state["inner"]["held"] is None and flush.train_metrics["clusters"] == 3
    assert flush.extras["privacy"]["rounds"] == 1


def test_a_resume_with_no_round_left_flushes_the_held_round_of_its_checkpoint(tmp_path):
    strategy, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())
    # a run planned for 3 rounds, stopped after round 1 (its uploads held in its checkpoint) ...
    outcomes, means = start(strategy, grid, initial, clusters, layout, rounds=1, planned=3)
    assert outcomes[-1].round == 2 and not outcomes[-1].trained  # (the loop ending with one held flushes it too)
    checkpointed = outcomes[0].strategy_state
    assert checkpointed["held"]["server_round"] == 1
    # ... resumed with num-server-rounds lowered to 1: no round is left to carry round 1's unmask request
    skeleton, arrays = split_state(checkpointed)
    resumed, _, _, _, _ = make_federation(tmp_path / "resumed", n=3, shapes=SHAPES, cfg=fast())
    resumed.load_state_dict(join_state(json.loads(json.dumps(skeleton)), arrays))
    before = len(sent(grid, "unmask", rnd=1))
    got, _ = start(resumed, grid, initial, clusters, layout, rounds=1, planned=1, first_round=2)
    assert [(o.round, o.trained) for o in got] == [(2, False)] and got[0].skipped is None
    assert len(sent(grid, "unmask", rnd=1)) - before == 3  # the nodes were identified first, then asked
    np.testing.assert_allclose(flat(got[0].arrays, layout), layout.flatten(initial) + means[0][0], atol=1e-4)
    np.testing.assert_allclose(flat(got[0].arrays, layout), flat(outcomes[-1].arrays, layout), atol=1e-6)


def test_a_held_round_that_cannot_be_unmasked_is_recorded_as_not_applied_with_a_warning(tmp_path):
    strategy, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())
    for c in clusters:
        c.drop_after_upload.add(1)  # every holder goes silent once round 1 is uploaded: its sum is lost
    warnings: list[str] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("flwr").addHandler(handler)
    try:
        outcomes, _ = start(strategy, grid, initial, clusters, layout, rounds=1, planned=3)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    flush = outcomes[-1]
    assert flush.round == 2 and not flush.trained and "could not be applied" in flush.skipped
    (entry,) = secagg_of(flush)["not_applied"]
    assert entry["round"] == 1 and "fell short" in entry["reason"]
    np.testing.assert_array_equal(flat(flush.arrays, layout), layout.flatten(initial))
    assert any("round 1's sum is not applied" in w for w in warnings), warnings
    assert flush.strategy_state["held"] is None


def test_a_secure_aggregation_round_aborted_before_anything_is_sent_is_no_stop_of_the_federation(tmp_path):
    strategy, clusters, grid, _, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast(), privacy=True)
    for c in clusters:
        c.silent_stages.add("keys")  # the key setup fails: the round is aborted, every cluster still in the run
    strategy.identify(grid, timeout=5, poll_interval=0.01)
    config = ConfigRecord({"federation-id": "fed1", "num-server-rounds": 3})
    try:
        messages = strategy.configure_train(1, to_record(initial), config, grid)
    except StopFederation as stop:
        raise AssertionError(f"an aborted round ended the run: {stop}") from None
    assert list(messages) == [] and "key setup" in strategy.inner.report["aborted"]
    arrays, _ = strategy.aggregate_train(1, [])
    assert arrays is None, "a round nothing was sent in is a skipped round"
