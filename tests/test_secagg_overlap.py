"""Secure aggregation with round-overlap, in process (tests/secagg_harness.py): round r's unmask request rides on
round r+1's train message and its answer on the reply, so a round nobody dropped out of costs no extra trip.
References are computed here with NumPy from each cluster's own update of each round."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.config import SecAggConfig
from nebula_fl.storage.checkpoint import join_state, split_state
from tests.secagg_harness import make_federation, run_round

SHAPES = {"a": (60,), "b": (5, 8)}
ROUNDS = 3


def fast(**kw) -> SecAggConfig:
    return SecAggConfig(enabled=True, timeout=0.5, **kw)


def overlapped(wrapper, grid, rnd, arrays, *, rounds=ROUNDS):
    """One overlapped round from `arrays` (the global adapter as the loop hands it: the last round's result)."""
    (got, metrics), _ = run_round(wrapper, grid, rnd, arrays, round_overlap=True, num_server_rounds=rounds)
    return got, metrics


def numpy_of(record):
    return {k: v.numpy() for k, v in record.items()}


def new_updates(clusters, rnd):
    """Every round its own updates, so a sum applied one round late cannot pass for the round's own."""
    rng = np.random.default_rng(100 + rnd)
    for c in clusters:
        c.update = {k: rng.normal(0, 0.01, v.shape).astype(np.float32) for k, v in c.update.items()}


def mean_of(clusters, layout, uploaders):
    ws = np.array([c.weight for c in clusters if c.cid in uploaders], dtype=np.float64)
    ups = [layout.flatten(c.update).astype(np.float64) for c in clusters if c.cid in uploaders]
    return sum(w * u for w, u in zip(ws, ups)) / ws.sum(), len(ups) / ws.sum()


def flat(arrays, layout):
    return layout.flatten({k: v.numpy() for k, v in arrays.items()}).astype(np.float64)


def sent(grid, stage, *, rnd=None):
    return [m for m in grid.sent if m.metadata.message_type == "query.secagg"
            and dict(m.content.config_records["secagg"]).get("stage") == stage
            and (rnd is None or dict(m.content.config_records["secagg"]).get("round") == rnd)]


def close(got, want, *, step, spread):
    """Each upload is rounded by at most one step of w·x: a mean is off by at most n·step/Σw."""
    assert np.abs(got - want).max() <= step * spread * 1.01


def test_each_round_applies_the_last_rounds_sum_with_no_extra_trip_and_the_last_round_is_flushed(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    means, spreads, current = [], [], initial
    for rnd in (1, 2, 3):
        new_updates(clusters, rnd)
        mean, spread = mean_of(clusters, layout, set(range(5)))
        means.append(mean)
        spreads.append(spread)
        arrays, metrics = overlapped(wrapper, grid, rnd, current)
        step = wrapper.held.code.step if wrapper.held else wrapper.round["code"].step
        assert arrays is not None, wrapper.report
        if rnd == 1:  # nothing to unmask yet: the global stays as it was, and the round is not a skipped one
            assert np.array_equal(flat(arrays, layout), layout.flatten(initial))
            assert metrics["secagg-pending-round"] == 1 and wrapper.report["unmasked_round"] is None
            assert wrapper.report["extra_trips"] == 0 and wrapper.held.server_round == 1
        elif rnd == 2:  # round 1's sum, one round late, from the answers riding on round 2's replies
            close(flat(arrays, layout), means[0], step=step, spread=spreads[0])
            assert wrapper.report["unmasked_round"] == 1 and wrapper.report["extra_trips"] == 0
            assert len([m for m in grid.sent if m.metadata.message_type == "train"
                        and "secagg" in m.content.config_records]) == 5
        else:  # the last round: round 2's sum rides in, round 3's is unmasked at once with one explicit trip
            close(flat(arrays, layout), means[0] + means[1] + means[2], step=step, spread=sum(spreads))
            assert wrapper.report["unmasked_rounds"] == [2, 3] and wrapper.report["extra_trips"] == 1
            assert wrapper.held is None
        assert len(sent(grid, "unmask")) == (5 if rnd == 3 else 0)
        current = numpy_of(arrays)
        assert not sent(grid, "view")
    assert all(not c.log for c in clusters)
    assert [len(c.riding) for c in clusters] == [2] * 5


def test_without_overlap_every_round_costs_one_unmask_trip_and_applies_its_own_sum(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())
    (arrays, _), _ = run_round(wrapper, grid, 1, initial, num_server_rounds=ROUNDS)
    mean, spread = mean_of(clusters, layout, {0, 1, 2})
    close(flat(arrays, layout), mean, step=wrapper.round["code"].step, spread=spread)
    assert wrapper.report["extra_trips"] == 1 and wrapper.report["unmasked_round"] == 1 and wrapper.held is None
    assert not any("secagg" in m.content.config_records for m in grid.sent if m.metadata.message_type == "train")


@pytest.mark.parametrize(("lost", "trip"), [(1, False), (3, True)])
def test_missing_answers_fall_back_to_an_explicit_trip_only_when_t_holders_did_not_answer(tmp_path, lost, trip):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    assert wrapper.cfg.threshold_for(5) == 3
    new_updates(clusters, 1)
    mean, spread = mean_of(clusters, layout, set(range(5)))
    overlapped(wrapper, grid, 1, initial)
    for c in clusters[:lost]:  # its reply of round 2 comes without the answer; an explicit request it answers
        c.lose_riding.add(1)
    new_updates(clusters, 2)
    arrays, _ = overlapped(wrapper, grid, 2, initial)
    close(flat(arrays, layout), mean, step=wrapper.held.code.step, spread=spread)
    assert len(sent(grid, "unmask", rnd=1)) == (lost if trip else 0)
    assert wrapper.report["extra_trips"] == int(trip)


def test_a_cluster_not_sent_the_next_round_is_asked_explicitly_and_a_dropout_round_is_unmasked_at_once(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    new_updates(clusters, 1)
    mean1, spread1 = mean_of(clusters, layout, set(range(5)))
    overlapped(wrapper, grid, 1, initial)
    clusters[0].drop_before_upload.add(2)  # sent round 2, never answers it: its answer to round 1 is missing
    new_updates(clusters, 2)
    mean2, spread2 = mean_of(clusters, layout, {1, 2, 3, 4})
    arrays, _ = overlapped(wrapper, grid, 2, initial)
    close(flat(arrays, layout), mean1 + mean2, step=wrapper.round["code"].step, spread=spread1 + spread2)
    assert wrapper.report["unmasked_rounds"] == [1, 2] and wrapper.held is None
    assert not sent(grid, "unmask", rnd=1), "4 answers on the train trip rebuild every seed (t = 3)"
    assert len(sent(grid, "view", rnd=2)) == 4 and len(sent(grid, "unmask", rnd=2)) == 4
    assert wrapper.report["extra_trips"] == 2 and wrapper.report["signed_view"] == 4


def test_a_round_the_cluster_declines_still_carries_its_answer_to_the_last_round(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast(), privacy=True)
    secure = wrapper.inner
    assert secure.cfg.threshold_for(3) == 2
    new_updates(clusters, 1)
    mean1, spread1 = mean_of(clusters, layout, {0, 1, 2})
    overlapped(wrapper, grid, 1, initial)
    clusters[2].refuse_rounds.add(2)  # its gate declines round 2 ...
    clusters[1].lose_riding.add(1)  # ... and 1's answer is lost: 0's and 2's are the t = 2 needed
    new_updates(clusters, 2)
    mean2, spread2 = mean_of(clusters, layout, {0, 1})
    arrays, _ = overlapped(wrapper, grid, 2, initial)
    assert not sent(grid, "unmask", rnd=1), "the declined round's reply carried cluster 2's answer"
    assert secure.report["unmasked_rounds"] == [1, 2]
    assert "2" in wrapper.exhausted and not clusters[2].log
    close(flat(arrays, layout), mean1 + mean2, step=secure.round["code"].step, spread=spread1 + spread2)


def test_a_resumed_server_unmasks_the_held_round_from_its_checkpoint(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())
    new_updates(clusters, 1)
    mean1, spread1 = mean_of(clusters, layout, {0, 1, 2})
    overlapped(wrapper, grid, 1, initial)
    skeleton, arrays = split_state(wrapper.state_dict())  # as the checkpoint stores it: JSON and arrays apart
    state = join_state(json.loads(json.dumps(skeleton)), arrays)
    fresh, _, _, _, _ = make_federation(tmp_path / "other", n=3, shapes=SHAPES, cfg=fast())
    fresh.load_state_dict(state)
    fresh.inner.views = {}
    assert fresh.held is not None and fresh.held.server_round == 1
    new_updates(clusters, 2)
    got, _ = overlapped(fresh, grid, 2, initial)
    close(flat(got, layout), mean1, step=fresh.held.code.step, spread=spread1)
    assert fresh.report["unmasked_round"] == 1 and fresh.report["extra_trips"] == 0


# -- a lying server on the piggybacked path: refused as an explicit request is ------------------------------
def _invent_dropout(target):
    """Every holder but the target is told the target dropped out of the held round (no signatures)."""
    def change(cluster, request):
        if request.get("stage") != "unmask" or str(cluster.cid) == target:
            return request
        survivors = [c for c in request["survivors"] if c != target]
        return {**request, "survivors": survivors, "dropped": [target], "signatures": "{}"}
    return change


def _forge_receipt(target):
    """The target's receipt swapped for another cluster's: the server claims the target uploaded."""
    def change(cluster, request):
        if request.get("stage") != "unmask":
            return request
        receipts = json.loads(request["receipts"])
        other = next(c for c in receipts if c != target)
        return {**request, "receipts": json.dumps({**receipts, target: receipts[other]})}
    return change


def _ride_recover(target):
    """A recover request (the target's key shares) riding where an unmask request goes."""
    def change(cluster, request):
        return {"federation-id": request["federation-id"], "epoch": request["epoch"], "stage": "recover",
                "round": request["round"], "clusters": [target]}
    return change


@pytest.mark.parametrize(("attack", "refusal"), [(_invent_dropout, "not certified"),
                                                 (_forge_receipt, "no valid upload receipt"),
                                                 (_ride_recover, "only an unmask request may ride")])
def test_a_lying_server_on_the_piggybacked_path_is_refused_and_no_share_of_the_target_leaves(tmp_path, attack,
                                                                                              refusal):
    wrapper, clusters, grid, _layout, initial = make_federation(tmp_path, n=4, shapes=SHAPES, cfg=fast())
    overlapped(wrapper, grid, 1, initial)
    for c in clusters:
        c.tamper = attack("0")
    arrays, _ = overlapped(wrapper, grid, 2, initial)
    lied_to = [c for c in clusters if attack is not _invent_dropout or c.cid != 0]
    assert all(any(refusal in line for line in c.log) for c in lied_to), [c.log for c in clusters]
    for c in lied_to:  # nothing revealed: no answer recorded, nothing in the reveal log for round 1
        state = c.stage.state_dict()["fed1"]
        assert "unmask" not in next(r for r in state["rounds"].values() if r["round"] == 1)
        log = next(iter(state["epochs"].values()))["log"]
        assert not log.get("self_shares", {}).get("1") and not log.get("key_shares")
    assert arrays is None and "round 1's sum" in wrapper.report["aborted"]


def test_a_riding_answer_is_the_explicit_answer_and_another_view_of_the_round_is_refused(tmp_path):
    wrapper, clusters, grid, _layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())
    overlapped(wrapper, grid, 1, initial)
    overlapped(wrapper, grid, 2, initial)
    stage, request = clusters[0].stage, clusters[0].riding[0]
    first = stage.answer_riding(dict(request))
    assert "refused" not in first and stage.handle(dict(request)) == first  # asked again either way: one answer
    again = SecAggStage(state_dir=tmp_path / "c0", cluster_id=0, roster=stage.roster)  # restarted: its promise is on disk
    assert again.answer_riding(dict(request)) == first
    other = {**request, "survivors": ["0", "1"], "dropped": ["2"], "signatures": "{}"}
    assert "unmasked already" in again.answer_riding(other)["refused"]
    with pytest.raises(SecAggRefusal, match="unmasked already"):
        again.handle(other)


def test_the_trainer_answers_a_riding_request_on_a_round_its_policy_declines_and_again_the_same(tmp_path):
    """The cluster's boundary (rank.Boundary, rank 0): the round asks for an unmasked update, which
    this cluster's policy refuses; the held round's unmask still rides back, and a replay carries the same
    answer (the stage's first answer, from its state on disk)."""
    from nebula_fl.clients.protocol import unpack
    from nebula_fl.clients.rank import Boundary
    from nebula_fl.clients.trainer_options import TrainerOptions
    from nebula_fl.data.datasets import TextDataset
    from nebula_fl.privacy.policy import PrivacyPolicy

    wrapper, clusters, grid, _layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())
    overlapped(wrapper, grid, 1, initial)
    request = wrapper._riding_requests()["0"]
    roster = tmp_path / "peers.txt"
    roster.write_text("".join(f"{c.cid} {c.stage.identity.public}\n" for c in clusters))
    opts = TrainerOptions(cluster_id=0, socket_path=tmp_path / "trainer.sock", state_dir=tmp_path / "c0",
                          model_path=tmp_path, shard=TextDataset(["a", "b"], np.array([0, 1]), ["x", "y"]),
                          policy=PrivacyPolicy(require_secure_aggregation=True, secagg_peers=str(roster)))
    boundary = Boundary(opts, trainer=None)  # no round reaches the ranks here
    header = {"config": {"federation-id": "fed1", "server-round": 2}, "secagg": request}
    first, _ = unpack(boundary.release.run(dict(header)))
    assert first["ok"] and first["metrics"]["privacy-refused"] and "requires secure aggregation" in str(first)
    assert sorted(first["secagg"]["self-from"]) == ["0", "1", "2"]
    again, _ = unpack(boundary.release.run(dict(header)))
    assert json.dumps(again["secagg"]) == json.dumps(first["secagg"])
    restarted = SecAggStage(state_dir=tmp_path / "c0", cluster_id=0, roster=clusters[0].stage.roster)
    assert restarted.handle(dict(request)) == first["secagg"]
    lying = {**header, "secagg": {**request, "survivors": ["0", "1"], "dropped": ["2"], "signatures": "{}"}}
    assert "unmasked already" in unpack(boundary.release.run(lying))[0]["secagg"]["refused"]


def test_a_run_the_privacy_budget_ends_early_unmasks_its_last_round_at_once(tmp_path):
    import dataclasses

    from nebula_fl.config import PrivacyConfig
    from nebula_fl.strategies.base import StopFederation

    wrapper, clusters, grid, layout, initial = make_federation(
        tmp_path, n=3, shapes=SHAPES, cfg=fast(), privacy=PrivacyConfig(mode="client", noise_multiplier=1.0))
    ledger = wrapper.server_ledger
    two, three = (ledger.epsilon_after(noise_multiplier=1.0, sample_rate=1.0, steps=k) for k in (2, 3))
    wrapper.cfg = dataclasses.replace(wrapper.cfg, max_epsilon=(two + three) / 2)  # room for 2 rounds, not 3
    new_updates(clusters, 1)
    mean1, spread1 = mean_of(clusters, layout, {0, 1, 2})
    overlapped(wrapper, grid, 1, initial, rounds=10)
    new_updates(clusters, 2)
    mean2, spread2 = mean_of(clusters, layout, {0, 1, 2})
    arrays, _ = overlapped(wrapper, grid, 2, initial, rounds=10)
    secure = wrapper.inner
    assert secure.report["unmasked_rounds"] == [1, 2] and secure.held is None and secure.report["extra_trips"] == 1
    close(flat(arrays, layout), mean1 + mean2, step=secure.round["code"].step, spread=spread1 + spread2)
    with pytest.raises(StopFederation, match="budget"):
        overlapped(wrapper, grid, 3, numpy_of(arrays), rounds=10)
