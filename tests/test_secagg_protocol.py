"""Secure aggregation, the whole protocol in process: the real server wrapper and the real cluster stages,
joined by an in-memory grid (tests/secagg_harness.py). References are computed here with NumPy from each
cluster's own update: the server must end with exactly the weighted mean of the uploads it may sum."""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest

from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.compression import Compressor
from nebula_fl.config import SecAggConfig
from nebula_fl.privacy.policy import PrivacyPolicy, PrivacyRequest, admit
from nebula_fl.secagg.reveal import RevealLog, refuse_recover, refuse_unmask, refuse_view
from tests.secagg_harness import make_federation, run_round

SHAPES = {"a": (60,), "b": (5, 8)}


def fast(**kw) -> SecAggConfig:
    return SecAggConfig(enabled=True, timeout=0.5, **kw)


def expected_mean(wrapper, clusters, layout, codec, uploaders):
    seed = wrapper.inner.round_seed
    ws = np.array([c.weight for c in clusters if c.cid in uploaders], dtype=np.float64)
    ups = [Compressor.decode(Compressor(codec, layout=layout).encode(layout.flatten(c.update), seed=seed),
                             layout=layout, seed=seed).astype(np.float64) for c in clusters if c.cid in uploaders]
    return sum(w * u for w, u in zip(ws, ups)) / ws.sum(), ws.sum()


def flat_of(arrays, layout):
    return layout.flatten({k: v.numpy() for k, v in arrays.items()})


def check_round(wrapper, clusters, grid, layout, initial, rnd, codec, uploaders):
    (arrays, metrics), _ = run_round(wrapper, grid, rnd, initial)
    assert arrays is not None, wrapper.report
    ref, total = expected_mean(wrapper, clusters, layout, codec, uploaders)
    code = wrapper.round["code"]
    # each upload is rounded by at most one step of w·x: the mean is off by at most n·step/Σw
    bound = len(uploaders) * code.step / total
    assert np.abs(flat_of(arrays, layout) - ref).max() <= bound * 1.01
    assert metrics["clusters"] == len(uploaders) and metrics["num-examples"] == total
    return arrays


@pytest.mark.parametrize("n", [3, 5, 8])
@pytest.mark.parametrize("codec", ["none", "randk:0.25"])
def test_the_unmasked_sum_is_the_weighted_mean_of_every_upload(tmp_path, n, codec):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=n, shapes=SHAPES, codec=codec, cfg=fast())
    check_round(wrapper, clusters, grid, layout, initial, 1, codec, set(range(n)))
    epoch = wrapper.epoch["id"]
    check_round(wrapper, clusters, grid, layout, initial, 2, codec, set(range(n)))
    assert wrapper.epoch["id"] == epoch, "keys are agreed once, not every round"
    assert all(not c.log for c in clusters)


def test_weights_are_summed_exactly_and_never_sent_in_the_clear(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast(),
                                                               weights=[7, 1000, 333])
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", {0, 1, 2})
    uploads = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert uploads and all("num-examples" not in dict(m.content.config_records["config"]) for m in uploads)


@pytest.mark.parametrize("drops", [1, 2])
def test_clusters_that_drop_before_uploading_leave_the_sum_of_the_others(tmp_path, drops):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    assert wrapper.cfg.threshold_for(5) == 3  # 5 - 3 = 2 may drop
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(5)))
    for c in clusters[:drops]:
        c.drop_before_upload.add(2)
    check_round(wrapper, clusters, grid, layout, initial, 2, "none", set(range(drops, 5)))
    assert "recovered" not in wrapper.report, "a survivor revealed only that round's pair keys: no key was rebuilt"
    lacking = {c for c, k in wrapper.epoch["keys"].items() if k[0] != 3}
    assert lacking == {str(c) for c in range(drops)}, "their upload, and round 3's key in it, never came"
    check_round(wrapper, clusters, grid, layout, initial, 3, "none", set(range(5)))
    assert wrapper.report["key_trips"] == 1, "one next-key trip, to them alone"
    assert sum(1 for m in grid.sent if dict(m.content.config_records.get("secagg", {})).get("stage") == "next-key") \
        == drops


def stages_sent(grid, stage):
    return [m for m in grid.sent if m.metadata.message_type == "query.secagg"
            and dict(m.content.config_records["secagg"]).get("stage") == stage]


def test_a_round_without_dropouts_costs_one_unmask_trip_and_a_round_with_them_one_more(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(5)))
    assert len(stages_sent(grid, "unmask")) == 5 and not stages_sent(grid, "view")
    clusters[4].drop_before_upload.add(2)
    check_round(wrapper, clusters, grid, layout, initial, 2, "none", {0, 1, 2, 3})
    assert len(stages_sent(grid, "unmask")) == 9 and len(stages_sent(grid, "view")) == 4
    assert wrapper.report["signed_view"] == 4


@pytest.mark.parametrize(("n", "threshold"), [(5, 3), (8, 5)])
@pytest.mark.parametrize("when", ["before", "after"])
def test_one_and_n_minus_t_dropouts_still_close_the_round_with_the_right_sum(tmp_path, n, threshold, when):
    for drops in (1, n - threshold):
        wrapper, clusters, grid, layout, initial = make_federation(tmp_path / f"{drops}", n=n, shapes=SHAPES,
                                                                   cfg=fast())
        assert wrapper.cfg.threshold_for(n) == threshold
        check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(n)))
        for c in clusters[:drops]:
            (c.drop_before_upload if when == "before" else c.drop_after_upload).add(2)
        uploaders = set(range(drops, n)) if when == "before" else set(range(n))
        check_round(wrapper, clusters, grid, layout, initial, 2, "none", uploaders)


def _garble(kind):
    """A hostile unmask reply of one holder: what a faulty or lying cluster (or a tampering network) might send."""
    def change(cluster, request, reply):
        if request.get("stage") != "unmask":
            return reply
        shares = list(reply["self-shares"])
        if kind == "bad base64":
            shares[0] = "%%not base64%%"
        elif kind == "wrong length":
            shares[0] = base64.b64encode(base64.b64decode(shares[0])[:-3]).decode()
        elif kind == "wrong share":
            raw = bytearray(base64.b64decode(shares[-1]))
            raw[-1] ^= 0x5A
            shares[-1] = base64.b64encode(bytes(raw)).decode()
        elif kind == "a share it does not hold":
            return {**reply, "self-from": [*reply["self-from"], "99"], "self-shares": [*shares, shares[0]]}
        elif kind == "lists out of line":
            shares = shares[:-1]
        elif kind == "not lists":
            return {**reply, "self-from": "0,1,2"}
        return {**reply, "self-shares": shares}
    return change


@pytest.mark.parametrize("kind", ["bad base64", "wrong length", "wrong share", "a share it does not hold",
                                  "lists out of line", "not lists"])
def test_a_malformed_or_lying_unmask_reply_drops_its_holder_and_the_round_closes(tmp_path, kind):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    clusters[2].tamper_reply = _garble(kind)
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(5)))
    assert list(wrapper.report["bad_replies"]) == ["2"], wrapper.report


def test_a_lying_recover_reply_is_caught_and_the_key_rebuilt_from_the_others(tmp_path):
    # 8 clusters, threshold 5: 0 never uploads, 1 uploads and vanishes, so 6 holders can give 0's key shares
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=8, shapes=SHAPES, cfg=fast())
    clusters[0].drop_before_upload.add(1)
    clusters[1].drop_after_upload.add(1)

    def lie(cluster, request, reply):
        if request.get("stage") == "recover" and reply.get("key-shares"):
            raw = bytearray(base64.b64decode(reply["key-shares"][0]))
            raw[10] ^= 1
            return {**reply, "key-shares": [base64.b64encode(bytes(raw)).decode(), *reply["key-shares"][1:]]}
        return reply

    clusters[3].tamper_reply = lie
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(1, 8)))
    assert wrapper.report["recovered"] == ["0"] and list(wrapper.report["bad_replies"]) == ["3"]


@pytest.mark.parametrize("drops", [1, 2])
def test_clusters_that_drop_after_uploading_still_count(tmp_path, drops):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    for c in clusters[:drops]:
        c.drop_after_upload.add(1)
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(5)))
    assert wrapper.report["survivors"] == 5


def test_more_dropouts_than_the_threshold_allows_abort_the_round_and_the_next_one_runs(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    for c in clusters[:3]:
        c.drop_before_upload.add(1)
    (arrays, _), _ = run_round(wrapper, grid, 1, initial)
    assert arrays is None and "fewer than the threshold 3" in wrapper.report["aborted"]
    for c in clusters[:3]:
        c.drop_after_upload.add(2)  # they upload, then none of them helps unmask
    (arrays, _), _ = run_round(wrapper, grid, 2, initial)
    assert arrays is None and "fewer than the 3" in wrapper.report["aborted"]
    check_round(wrapper, clusters, grid, layout, initial, 3, "none", set(range(5)))


def test_a_cluster_silent_in_the_key_setup_is_left_out_of_the_epoch(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    clusters[4].silent_stages.add("keys")
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", {0, 1, 2, 3})
    assert wrapper.epoch["members"] == ["0", "1", "2", "3"] and wrapper.report["sampled"] == 4
    clusters[4].silent_stages.clear()  # back: the sampled set differs from the epoch's, so keys are set up again
    check_round(wrapper, clusters, grid, layout, initial, 2, "none", set(range(5)))
    assert len(wrapper.epoch["members"]) == 5


def test_a_cluster_silent_in_the_share_distribution_aborts_that_round_only(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())
    clusters[1].silent_stages.add("share")
    (arrays, _), _ = run_round(wrapper, grid, 1, initial)
    assert arrays is None and "failed the share distribution" in wrapper.report["aborted"] and wrapper.epoch is None
    clusters[1].silent_stages.clear()
    check_round(wrapper, clusters, grid, layout, initial, 2, "none", {0, 1, 2})


def test_a_dropped_cluster_whose_pair_keys_nobody_can_reveal_has_its_key_rebuilt_and_masks_on_a_fresh_one(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    clusters[0].drop_before_upload.add(1)  # 0 never uploads ...
    clusters[1].drop_after_upload.add(1)  # ... and 1, who masked with 0, uploads and vanishes
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", {1, 2, 3, 4})
    assert wrapper.report["recovered"] == ["0"]
    epoch = wrapper.epoch["id"]
    own = clusters[0].stage.state_dict()["fed1"]["epochs"][epoch]["mask_keys"]
    assert own["1"]["round"] is None, "the rebuilt key (round 1's) never masked anything"
    rebuilt = own["1"]["pk"]
    check_round(wrapper, clusters, grid, layout, initial, 2, "none", set(range(5)))
    assert wrapper.epoch["id"] == epoch and wrapper.report["key_trips"] == 1 and wrapper.report.get("setup_trips", 0) == 0
    own = clusters[0].stage.state_dict()["fed1"]["epochs"][epoch]["mask_keys"]
    assert own["2"]["round"] == 2 and own["2"]["pk"] != rebuilt, "round 2 was masked with round 2's own key"
    assert "1" not in own, "the unused key of a past round is dropped: nothing can use it"


def test_a_revealed_self_mask_opens_one_round_and_the_next_round_s_key_can_still_be_rebuilt(tmp_path):
    """Round 1 reveals 0's self mask (under its key 0); round 2 was to be masked with its key 1, which can be
    rebuilt when 0 drops out of it: nothing of round 1 depends on it (reveal.py, rule 0)."""
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(5)))  # 0's self mask revealed
    clusters[0].drop_before_upload.add(2)
    clusters[1].drop_after_upload.add(2)
    check_round(wrapper, clusters, grid, layout, initial, 2, "none", {1, 2, 3, 4})
    assert wrapper.report["recovered"] == ["0"] and wrapper.held is None
    assert not any("refus" in line for c in clusters for line in c.log)
    check_round(wrapper, clusters, grid, layout, initial, 3, "none", set(range(5)))


def test_a_tampered_share_is_detected_and_not_counted(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=5, shapes=SHAPES, cfg=fast())

    def flip(cluster, request):
        if request.get("stage") == "unmask" and request.get("tokens"):
            token = bytearray(request["tokens"][0].encode())
            token[40] ^= 1
            request = {**request, "tokens": [token.decode(errors="replace"), *request["tokens"][1:]]}
        return request

    clusters[2].tamper = flip
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(5)))  # the other holders suffice
    assert list(wrapper.report["unreadable"]) == ["2"] and len(wrapper.report["unreadable"]["2"]) == 1


def test_a_share_sealed_with_another_key_is_refused(tmp_path):
    wrapper, clusters, grid, _layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())

    def swap(cluster, request):  # forward to this holder the share another holder was meant to get
        if request.get("stage") == "unmask" and len(request.get("tokens", [])) >= 2:
            request = {**request, "tokens": list(reversed(request["tokens"]))}
        return request

    for c in clusters:
        c.tamper = swap
    (arrays, _), _ = run_round(wrapper, grid, 1, initial)
    assert arrays is None and "fewer than the 2" in wrapper.report["aborted"]


def _set_up_stage(tmp_path, n=3):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=n, shapes=SHAPES, cfg=fast())
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", set(range(n)))
    unmasks = [dict(m.content.config_records["secagg"]) for m in grid.sent
               if m.metadata.message_type == "query.secagg" and m.metadata.dst_node_id == 100
               and dict(m.content.config_records["secagg"]).get("stage") == "unmask"]
    return clusters, unmasks[-1]


def test_a_replayed_unmask_request_gets_the_same_answer_and_a_changed_one_is_refused(tmp_path):
    clusters, request = _set_up_stage(tmp_path)
    stage = clusters[0].stage
    first = stage.handle(dict(request))
    assert stage.handle(dict(request)) == first
    with pytest.raises(SecAggRefusal, match="unmasked already"):
        stage.handle({**request, "survivors": ["0", "1"], "dropped": ["2"]})
    with pytest.raises(SecAggRefusal, match="did not upload round 5"):
        stage.handle({**request, "round": 5})


def test_a_server_asking_for_both_halves_of_a_secret_is_refused(tmp_path):
    log = RevealLog()
    view = dict(me="0", server_round=1, round_set={"0", "1", "2"}, threshold=2)
    assert "both survived and dropped" in refuse_view(log, survivors={"0", "1"}, dropped={"1", "2"}, **view)
    assert "not round 1's clusters" in refuse_view(log, survivors={"0", "1"}, dropped=set(), **view)
    assert "not among the survivors" in refuse_view(log, survivors={"1", "2"}, dropped={"0"}, **view)
    assert "fewer than the threshold 2" in refuse_view(log, survivors={"0"}, dropped={"1", "2"}, **view)
    log.views[1] = [["0", "1"], ["2"]]
    assert "one view of a round" in refuse_view(log, survivors={"0", "1", "2"}, dropped=set(), **view)
    assert refuse_view(log, survivors={"0", "1"}, dropped={"2"}, **view) is None
    log.self_keys, log.views[2] = {"1/3"}, [["0", "2"], ["1"]]
    assert "did not drop out of round 2" in refuse_recover(log, server_round=2, wanted={"1": "1/3"})  # only signed
    log.certified.add(2)  # unmasked under that view: its evidence was checked
    assert "self-mask share of cluster(s) ['1']" in refuse_recover(log, server_round=2, wanted={"1": "1/3"})
    assert refuse_recover(log, server_round=2, wanted={"1": "1/4"}) is None, "another key of 1: another round"
    assert "did not drop out of round 1" in refuse_recover(log, server_round=1, wanted={"0": "0/0"})
    log.key_shares = {"4/2"}
    assert "mask key of cluster(s) ['4']" in refuse_unmask(log, server_round=5, survivor_keys={"4": "4/2"})
    assert refuse_unmask(log, server_round=5, survivor_keys={"4": "4/3", "0": "0/2"}) is None

    clusters, request = _set_up_stage(tmp_path)  # on a real stage: round 1 unmasked, 1 survived
    stage = clusters[0].stage
    recover = {k: request[k] for k in ("federation-id", "epoch")}
    with pytest.raises(SecAggRefusal, match="did not drop out of round 1"):
        stage.handle({**recover, "stage": "recover", "round": 1, "clusters": ["1"]})
    assert stage.state_dict()["fed1"]["epochs"][request["epoch"]]["log"]["key_shares"] == []


def test_a_restarted_cluster_keeps_its_keys_and_its_promises(tmp_path):
    clusters, request = _set_up_stage(tmp_path)
    first = clusters[0].stage.handle(dict(request))
    again = SecAggStage(state_dir=tmp_path / "c0", cluster_id=0,  # a new process on the same state folder
                        roster=clusters[0].stage.roster)
    assert again.handle(dict(request)) == first
    with pytest.raises(SecAggRefusal, match="unmasked already"):
        again.handle({**request, "survivors": ["0", "1"], "dropped": ["2"]})
    assert (tmp_path / "c0" / "secagg" / "fed1.json").stat().st_mode & 0o077 == 0


def test_a_resumed_server_keeps_the_epoch(tmp_path):
    wrapper, clusters, grid, layout, initial = make_federation(tmp_path, n=3, shapes=SHAPES, cfg=fast())
    check_round(wrapper, clusters, grid, layout, initial, 1, "none", {0, 1, 2})
    state = wrapper.state_dict()
    fresh, _, _, _, _ = make_federation(tmp_path / "other", n=3, shapes=SHAPES, cfg=fast())
    fresh.load_state_dict(state)
    fresh.inner.views = {}
    check_round(fresh, clusters, grid, layout, initial, 2, "none", {0, 1, 2})
    assert fresh.epoch["id"] == wrapper.epoch["id"]


def test_under_secure_aggregation_a_cluster_adds_its_share_of_the_noise_and_judges_the_sum():
    policy = PrivacyPolicy(mode="client", min_noise_multiplier=1.0)
    kw = dict(num_examples=100, sample_rate=1.0, steps=1, planned_steps=3, derive_sigma=None)
    secure = admit(policy, PrivacyRequest(mode="client", client_sigma=1.0, noise_shares=3, secure_threshold=3), **kw)
    assert secure.allowed and secure.noise_multiplier == 1.0 and secure.noise_shares == 3
    # more shares than the threshold: a sum of only t uploads would carry less than σ; judged per share
    more = admit(policy, PrivacyRequest(mode="client", client_sigma=1.0, noise_shares=4, secure_threshold=3), **kw)
    assert not more.allowed and "below this cluster's floor" in more.reason
    # without secure aggregation a split noise is seen on its own: refused
    plain = admit(policy, PrivacyRequest(mode="client", client_sigma=1.0, noise_shares=3), **kw)
    assert not plain.allowed and math.isclose(1 / math.sqrt(3), float(plain.reason.split("= ")[2].split(",")[0]),
                                              rel_tol=1e-3)


def test_secure_aggregation_refuses_at_start_what_it_cannot_sum():
    from nebula_fl.config import ConfigError, RunConfig

    for codec in ("topk:0.1", "int8", "lowrank:4", "randk:0.1+int8"):
        with pytest.raises(ConfigError, match="'none' or 'randk:RATIO'"):
            RunConfig().replace({"secagg.enabled": True, "comm.codec": codec})
    with pytest.raises(ConfigError, match=r"comm\.adaptive"):
        RunConfig().replace({"secagg.enabled": True, "comm.codec": "randk:0.1", "comm.adaptive": True})
    with pytest.raises(ConfigError, match="more than half of the shares"):
        RunConfig().replace({"secagg.enabled": True, "secagg.num-shares": 5, "secagg.threshold": 2})
    assert RunConfig().replace({"secagg.enabled": True, "comm.codec": "randk:0.1"}).secagg.threshold_for(8) == 5
