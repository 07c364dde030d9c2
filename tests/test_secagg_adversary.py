"""A malicious server against real cluster stages: it must learn no single update and no sum of fewer than t.

The campaigns (tests/secagg_adversary.py) tell every cluster what the server likes — each subset its own
survivor set, invented dropouts, real ones, splits into camps, after an honest round — and an oracle
rebuilds whatever the answers allow and unmasks whatever it can (real reconstruction, checked against the
truth). The control switches the defence off and shows the same oracle recovering a cluster's update
from the attack that motivated it; another shows its check of earlier rounds recovering one when a single
key masks every round; the named cases below replay, reorder and forge single messages.
"""

from __future__ import annotations

import json

import pytest

import nebula_fl.clients.secagg_stage as stage_module
from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.secagg.identity import Identity
from tests.secagg_adversary import CAMPAIGNS, EPOCH, FAST, FED, Epoch, play, the_reported_attack, unmask


@pytest.fixture
def shm_tmp(tmp_path_factory):
    """Stage state on tmpfs when there is one: every answer is fsynced, and thousands are asked."""
    import tempfile
    from pathlib import Path

    root = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=root if root.is_dir() else tmp_path_factory.getbasetemp()) as tmp:
        yield Path(tmp)


@pytest.mark.parametrize("campaign", CAMPAIGNS, ids=lambda c: c.name)
def test_no_schedule_of_a_lying_server_recovers_a_sum_below_the_threshold(campaign, shm_tmp):
    tried, bad = play(campaign, shm_tmp)
    assert tried >= 60, "the campaign played (almost) nothing"
    assert not bad, f"{len(bad)} of {tried} schedules exposed sums below t; first: {bad[0]}"


@pytest.mark.parametrize("n,t", [(3, 2), (4, 3), (8, 5)])
def test_without_the_defence_the_reported_attack_recovers_the_target(n, t, shm_tmp, monkeypatch):
    """The oracle has power: with rules 2 and 3 of reveal.py switched off, the attack of the issue works."""
    monkeypatch.setattr(stage_module.SecAggStage, "_check_evidence", lambda *a, **k: None)
    monkeypatch.setattr(stage_module, "refuse_view", lambda log, **k: None)
    ep = Epoch(shm_tmp, n=n, threshold=t)
    assert ep.exposed(ep.run(the_reported_attack(ep.ids, "0"))) == [(1, ("0",))]


def test_a_key_rebuilt_for_a_dropout_unmasks_no_earlier_round(shm_tmp):
    """Rule 4 is per mask key: cluster 3's holders revealed its self shares in round 1, and in round 2, which it
    really dropped out of, they give the shares of its key of round 2 (the old rule, one key per epoch, refused
    them). The oracle rebuilds that key and checks round 1 with it too: it opens no pair mask of round 1."""
    ep = Epoch(shm_tmp, n=4, threshold=3)
    ep.settle_honestly(absent=("3",))
    reveals = ep.run(ep.honest())
    assert not any(r.refusals for r in reveals.values())
    assert ep.exposed(reveals) == []
    assert set(ep.rebuilt_keys) == {"3/2"} and ep.used["3"][0] == 2
    assert ep.rechecked == [(1, 0)], "round 1 was checked, and the key rebuilt in round 2 gave no pair key of it"
    assert ep.public["3/2"] != ep.history[0].keys["3"][1]


def test_without_rotation_a_key_rebuilt_for_a_dropout_unmasks_an_earlier_round(shm_tmp, monkeypatch):
    """The earlier-round check has power: with one key for every round (the control's stage) and rule 4 keyed by
    owner alone without its refusal, the key 3's holders give for round 2 is the one it masked round 1 with."""
    monkeypatch.setattr(stage_module, "key_id", lambda cluster, seq: f"{cluster}/1")
    monkeypatch.setattr(stage_module, "refuse_recover", lambda log, **k: None)
    ep = Epoch(shm_tmp, n=4, threshold=3, rotate_keys=False)
    ep.settle_honestly(absent=("3",))
    found = ep.exposed(ep.run(ep.honest()))
    assert set(ep.rebuilt_keys) == {"3/1"} and ep.rechecked[0][1] > 0
    assert found == [(1, ("3",))]


@pytest.mark.parametrize("absent", [(), ("4",), ("3", "4")])
def test_an_honest_server_still_unmasks_the_exact_sum(absent, shm_tmp):
    ep = Epoch(shm_tmp, n=5, threshold=3, absent=absent)
    reveals = ep.run(ep.honest())
    assert not any(r.refusals for r in reveals.values())
    seeds, pairs = ep.knowledge(reveals)
    assert unmask(ep.uploaders, uploads={c: v for c, (v, _) in ep.uploads.items()}, seeds=seeds, pairs=pairs,
                  neighbours=ep.neighbours, code=ep.code, updates=ep.updates, weights=ep.weights) is not None
    assert ep.exposed(reveals) == []


def test_the_reported_attack_is_refused_by_the_target_and_no_share_of_it_leaves(shm_tmp):
    ep = Epoch(shm_tmp, n=4, threshold=3)
    reveals = ep.run(the_reported_attack(ep.ids, "0"))
    assert any("fewer than the threshold 3" in r for r in reveals["0"].refusals)
    assert not reveals["0"].self_shares and not reveals["0"].pair_keys and not reveals["0"].key_shares
    assert all(set(r.self_shares) == set(ep.ids) for c, r in reveals.items() if c != "0")  # the others: self shares only


# -- single messages replayed, reordered, forged -------------------------------------------------------------
def unmask_request(ep: Epoch, holder: str, survivors, **extra):
    """As the server words it: every receipt it holds rides on every unmask request (a dropout view's too)."""
    return {**ep.base(survivors), **ep.forwarded(holder, survivors), "stage": "unmask",
            "receipts": json.dumps(ep.receipts), **extra}


def test_a_replayed_request_gets_the_same_answer_and_any_other_view_of_the_round_is_refused(shm_tmp):
    ep = Epoch(shm_tmp, n=4, threshold=3)
    stage = ep.fresh("1")
    full = unmask_request(ep, "1", ep.ids, receipts=json.dumps(ep.receipts))
    first = stage.handle(dict(full))
    assert stage.handle(dict(full)) == first
    with pytest.raises(SecAggRefusal, match="unmasked already"):
        stage.handle(unmask_request(ep, "1", ["0", "1", "2"], signatures="{}"))
    with pytest.raises(SecAggRefusal, match="one view of a round"):
        stage.handle({**ep.base(["0", "1", "2"]), "stage": "view"})


def test_signing_a_survivor_set_commits_and_releases_nothing_by_itself(shm_tmp):
    ep = Epoch(shm_tmp, n=4, threshold=3)
    stage = ep.fresh("1")
    assert stage.handle({**ep.base(["0", "1", "2"]), "stage": "view"})["signature"]
    with pytest.raises(SecAggRefusal, match="one view of a round"):  # the full view, after signing another
        stage.handle(unmask_request(ep, "1", ep.ids, receipts=json.dumps(ep.receipts)))
    with pytest.raises(SecAggRefusal, match="did not drop out of round 1 in the view this cluster agreed"):
        stage.handle({"federation-id": FED, "epoch": EPOCH, "stage": "recover", "round": 1, "clusters": ["3"]})
    with pytest.raises(SecAggRefusal, match="not certified: 1 of this cluster's share holders signed"):
        stage.handle(unmask_request(ep, "1", ["0", "1", "2"],
                                    signatures=json.dumps({"1": ep.signature("1", frozenset({"0", "1", "2"}))})))


def test_the_full_view_needs_every_receipt_of_this_round(shm_tmp):
    ep = Epoch(shm_tmp, n=4, threshold=3, absent=("3",))
    stage = ep.fresh("1")
    with pytest.raises(SecAggRefusal, match=r"no valid upload receipt of cluster\(s\) \['3'\]"):
        stage.handle(unmask_request(ep, "1", ep.ids, receipts=json.dumps(ep.receipts)))
    forged = {**ep.receipts, "3": list(ep.receipts["2"])}  # another cluster's receipt
    with pytest.raises(SecAggRefusal, match=r"receipt of cluster\(s\) \['3'\]"):
        stage.handle(unmask_request(ep, "1", ep.ids, receipts=json.dumps(forged)))


def test_receipts_and_signatures_of_another_round_do_not_count(shm_tmp):
    ep = Epoch(shm_tmp, n=4, threshold=3, absent=("3",))
    survivors = frozenset({"0", "1", "2"})
    old_sigs = {m: ep.signature(m, survivors) for m in survivors}
    ep.settle_honestly(absent=("3",))  # round 2, same clusters, same dropout
    stage = ep.fresh("1")
    with pytest.raises(SecAggRefusal, match="not certified"):
        stage.handle(unmask_request(ep, "1", survivors, signatures=json.dumps(old_sigs)))


def test_a_forged_signature_does_not_certify_a_survivor_set(shm_tmp):
    ep = Epoch(shm_tmp, n=4, threshold=3)
    survivors = frozenset({"0", "1", "2"})
    mallory = Identity.load_or_create(shm_tmp / "mallory")
    from nebula_fl.secagg.evidence import view_fields

    fields = view_fields(federation=FED, epoch=EPOCH, setup=ep.setup, server_round=1, round_set=ep.ids,
                         survivors=survivors)
    sigs = {"0": mallory.sign("view", *fields), "2": mallory.sign("view", *fields),
            "1": ep.signature("1", survivors)}
    stage = ep.fresh("1")
    stage.handle({**ep.base(survivors), "stage": "view"})
    with pytest.raises(SecAggRefusal, match="not certified"):
        stage.handle(unmask_request(ep, "1", survivors, signatures=json.dumps(sigs)))


def test_a_round_is_masked_once_and_a_mask_key_masks_only_its_round(shm_tmp):
    ep = Epoch(shm_tmp, n=3, threshold=2)
    with pytest.raises(SecAggRefusal, match="masked already in epoch"):
        ep.fresh("0").prepare(ep.train_config("0"))
    stale = {**ep.train_config("0"), "server-round": 2}  # round 2, naming the neighbours' keys of round 1
    with pytest.raises(SecAggRefusal, match="masks only the round it was made for"):
        ep.fresh("0").prepare(stale)


def test_a_cluster_told_another_round_set_than_the_rest_refuses_the_full_view(shm_tmp):
    ep = Epoch(shm_tmp, n=4, threshold=3)
    # the server told cluster 3 the round was {1, 2, 3}: its receipt signs that set, not the others'
    from nebula_fl.secagg.evidence import upload_fields

    other = Identity.load_or_create(ep.stages["3"].folder)
    digest = ep.receipts["3"][0]
    keys = ep.receipts["3"][2]
    split = other.sign("upload", *upload_fields(federation=FED, epoch=EPOCH, setup=ep.setup, server_round=1,
                                                round_set=["1", "2", "3"], member="3", keys=keys, digest=digest))
    stage = ep.fresh("1")
    with pytest.raises(SecAggRefusal, match=r"receipt of cluster\(s\) \['3'\]"):
        stage.handle(unmask_request(ep, "1", ep.ids, receipts=json.dumps({**ep.receipts, "3": [digest, split, keys]})))


ROUND = 2  # the round a second epoch's keys are made for


# -- a forged member ------------------------------------------------------------------------------------------
def test_a_member_the_roster_does_not_list_is_refused(shm_tmp):
    ep = Epoch(shm_tmp, n=3, threshold=2)
    sybil = SecAggStage(state_dir=shm_tmp / "sybil", cluster_id=7, trust_server_membership=True)  # the server's own
    keys = sybil.handle({"stage": "keys", "federation-id": FED, "epoch": "epoch-2", "round": ROUND})
    request = _share_request(ep, "epoch-2", extra=("7", keys))
    with pytest.raises(SecAggRefusal, match=r"cluster\(s\) \['7'\] are not on this cluster's roster"):
        ep.stages["0"].handle(request)


def test_keys_the_server_swapped_for_a_members_are_refused(shm_tmp):
    ep = Epoch(shm_tmp, n=3, threshold=2)
    imposter = SecAggStage(state_dir=shm_tmp / "imposter", cluster_id=2,  # holds keys, not cluster 2's identity
                           trust_server_membership=True)
    fake = imposter.handle({"stage": "keys", "federation-id": FED, "epoch": "epoch-2", "round": ROUND})
    request = _share_request(ep, "epoch-2", replace=("2", fake))
    with pytest.raises(SecAggRefusal, match=r"cluster\(s\) \['2'\] are not signed by their identity keys"):
        ep.stages["0"].handle(request)
    ep.stages["1"].trust_server_membership = True  # the operator's opt-out (without it: no setup at all)
    ep.stages["1"].roster = None  # without a roster the server's word stands for the identity: only the
    request_no_roster = {**request, "id-pks": [ep.keys["0"]["id-pk"], ep.keys["1"]["id-pk"], ep.keys["2"]["id-pk"]]}
    with pytest.raises(SecAggRefusal, match="not signed by their identity keys"):  # signature still binds it
        ep.stages["1"].handle(request_no_roster)


def _share_request(ep: Epoch, epoch: str, *, extra=None, replace=None):
    members = {c: ep.stages[c].handle({"stage": "keys", "federation-id": FED, "epoch": epoch, "round": ROUND})
               for c in ep.ids}
    if extra:
        members[extra[0]] = extra[1]
    if replace:
        members[replace[0]] = replace[1]
    ids = sorted(members, key=int)
    return {"stage": "share", "federation-id": FED, "epoch": epoch, "members": ids,
            "c-pks": [members[c]["c-pk"] for c in ids], "s-pks": [members[c]["s-pk"] for c in ids],
            "id-pks": [members[c]["id-pk"] for c in ids], "key-sigs": [members[c]["key-sig"] for c in ids],
            "num-shares": 0, "threshold": len(ids) // 2 + 1, "round": ROUND}


def test_the_full_view_is_what_the_honest_server_uses_and_needs_no_signature(shm_tmp):
    ep = Epoch(shm_tmp, n=4, threshold=3)
    assert set(ep.honest().values()) == {FAST}
    assert ep.calls == 0
    ep.run(ep.honest())
    assert ep.calls == 4, "one unmask request per cluster, nothing else"


def test_signatures_made_under_another_setup_of_the_epoch_do_not_count(shm_tmp):
    """A server that shows clusters different setups (members, keys, threshold) splits them into camps: a receipt or
    a survivor signature binds its signer's setup, so it counts for no cluster that saw another one."""
    from nebula_fl.secagg.evidence import upload_fields, view_fields

    ep = Epoch(shm_tmp, n=4, threshold=3)
    survivors = frozenset({"0", "1", "2"})
    other_setup = "0" * 64
    signer = {c: Identity.load_or_create(ep.stages[c].folder) for c in ep.ids}
    receipts = {c: [ep.receipts[c][0], signer[c].sign("upload", *upload_fields(
        federation=FED, epoch=EPOCH, setup=other_setup, server_round=1, round_set=ep.ids, member=c,
        keys=ep.receipts[c][2], digest=ep.receipts[c][0])), ep.receipts[c][2]] for c in ep.ids}
    with pytest.raises(SecAggRefusal, match="no valid upload receipt"):
        ep.fresh("1").handle(unmask_request(ep, "1", ep.ids, receipts=json.dumps(receipts)))
    fields = view_fields(federation=FED, epoch=EPOCH, setup=other_setup, server_round=1, round_set=ep.ids,
                         survivors=survivors)
    stage = ep.fresh("1")
    stage.handle({**ep.base(survivors), "stage": "view"})
    with pytest.raises(SecAggRefusal, match="not certified"):
        stage.handle(unmask_request(ep, "1", survivors,
                                    signatures=json.dumps({c: signer[c].sign("view", *fields) for c in survivors})))
