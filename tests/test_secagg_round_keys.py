"""Each round its own mask keys (reveal.py, rule 0), on the real stages and the real server wrapper.

The reference for "what a key opens" is exhaustive, not the protocol's bookkeeping: a private key is tried
against every public key and every round of the run, and counts as opening a pair mask when the derived key
matches an upload's commitment (SHA-256, wire.py) of that mask."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nebula_fl.clients.secagg_stage import SecAggRefusal
from nebula_fl.config import SecAggConfig
from nebula_fl.secagg.masks import round_key
from nebula_fl.secagg.shares import pair_secret
from nebula_fl.secagg.wire import commitment, unpack_upload
from tests.secagg_harness import make_federation, run_round

SHAPES = {"a": (24,)}
ROUNDS = 4


def _run(tmp_path, *, n=4, rounds=ROUNDS):
    """n clusters, `rounds` honest rounds; returns (wrapper, clusters, grid, [(round, cluster, upload head)])."""
    wrapper, clusters, grid, _layout, initial = make_federation(tmp_path, n=n, shapes=SHAPES,
                                                                cfg=SecAggConfig(enabled=True, timeout=0.5))
    pulled: list = []
    pull = grid.pull_messages
    grid.pull_messages = lambda ids: pulled.extend(got := pull(ids)) or got
    heads = []
    for rnd in range(1, rounds + 1):
        pulled.clear()
        (arrays, _), _ = run_round(wrapper, grid, rnd, initial)
        assert arrays is not None, wrapper.report
        for m in pulled:
            if not m.has_error() and "update" in m.content.array_records:
                cid = str(clusters[m.metadata.src_node_id - 100].cid)
                heads.append((rnd, cid, unpack_upload(m.content.array_records["update"]["blob"].numpy())[1]))
    return wrapper, clusters, grid, heads


def _opened(private_pem: bytes, *, epoch: str, heads, public_keys: set[str], rounds: range) -> set[int]:
    """Rounds in which some upload's pair commitment is matched by a key derived from `private_pem` with any public
    key seen, any round number and any key-number order: everything the key can open, found by search."""
    commits = {(rnd, c): set(h["commit"]["pairs"].values()) for rnd, c, h in heads}
    found = set()
    for pk in public_keys:
        secret = pair_secret(private_pem, pk.encode())
        for guess in rounds:
            for seqs in {(a, b) for a in rounds for b in rounds}:
                digest = commitment(round_key(secret, epoch=epoch, server_round=guess, seqs=seqs))
                found |= {rnd for (rnd, _c), cs in commits.items() if digest in cs}
    return found


def test_a_cluster_masks_each_round_with_a_key_of_that_round_and_its_key_opens_that_round_only(tmp_path):
    wrapper, clusters, _grid, heads = _run(tmp_path)
    epoch = wrapper.epoch["id"]
    state = clusters[0].stage.state_dict()["fed1"]["epochs"][epoch]
    used = {int(r): k for r, k in state["mask_keys"].items() if k["round"] is not None}
    assert sorted(used) == list(range(1, ROUNDS + 1)) and all(int(r) == k["round"] for r, k in used.items())
    assert len({k["pk"] for k in used.values()}) == ROUNDS, "a fresh key pair every round"
    assert str(ROUNDS + 1) in state["mask_keys"], "the next round's key was made, and rode on the last upload"
    assert all(h["keys"] == {m: rnd for m in h["keys"]} for rnd, _c, h in heads), "every key named is the round's"
    public = {h["next-key"]["pk"] for _r, _c, h in heads} | set(wrapper.epoch["s_pks"])  # every key on the wire
    for rnd, key in used.items():  # as if the server had rebuilt it: it opens its own round and no other
        opened = _opened(key["sk"].encode(), epoch=epoch, heads=heads, public_keys=public, rounds=range(1, ROUNDS + 2))
        assert opened == {rnd}, f"cluster 0's key of round {rnd} opens rounds {sorted(opened)}"


def test_a_key_is_made_once_per_round_and_next_key_gives_it_again(tmp_path):
    wrapper, clusters, _grid, _heads = _run(tmp_path, rounds=2)
    stage, epoch = clusters[1].stage, wrapper.epoch["id"]
    ask = {"federation-id": "fed1", "epoch": epoch, "stage": "next-key"}
    first = stage.handle({**ask, "round": 3})
    assert stage.handle({**ask, "round": 3}) == first, "the round's key again, never a second one for it"
    assert first["pk"] == stage.state_dict()["fed1"]["epochs"][epoch]["mask_keys"]["3"]["pk"]
    later = stage.handle({**ask, "round": 7})
    assert later["seq"] == 7 and later["pk"] != first["pk"] and set(later["to"]) == set(first["to"])
    state = stage.state_dict()
    del state["fed1"]["epochs"][epoch]["mask_keys"]["1"]  # as when pruned
    stage.load_state_dict(state)
    with pytest.raises(SecAggRefusal, match="not after round 2, the last this cluster masked"):
        stage.handle({**ask, "round": 1})  # a past round gets no new key: it could only mask a round already past
    stage.handle({**ask, "round": 8}), stage.handle({**ask, "round": 9})
    with pytest.raises(SecAggRefusal, match="unused mask keys of rounds ahead already"):
        stage.handle({**ask, "round": 10})  # a server cannot make it prune the keys it will mask with
    assert {"2", "3", "7", "8", "9"} <= set(stage.state_dict()["fed1"]["epochs"][epoch]["mask_keys"])


def _config(wrapper, grid, rnd, cluster):
    """The train config the honest server sent `cluster` in round `rnd` (from the grid's record)."""
    sent = [m for m in grid.sent if m.metadata.message_type == "train" and m.metadata.dst_node_id == 100 + cluster
            and dict(m.content.config_records["config"])["server-round"] == rnd]
    return dict(sent[-1].content.config_records["config"])


@pytest.mark.parametrize("lie", ["stale", "resigned-round", "unsigned"])
def test_a_cluster_refuses_a_round_that_names_a_neighbour_s_key_of_another_round(tmp_path, lie):
    wrapper, clusters, grid, _heads = _run(tmp_path, rounds=2)
    cfg = _config(wrapper, grid, 2, 0)
    named = json.loads(cfg["secagg-keys"])
    epoch = wrapper.epoch["id"]
    other = clusters[1].stage.state_dict()["fed1"]["epochs"][epoch]["mask_keys"]
    if lie == "stale":  # cluster 1's key of round 2 (signed for round 2), named for round 3
        named["1"] = [3, other["2"]["pk"], other["2"]["sig"]]
        match = "not signed by its identity key for that round"
    elif lie == "resigned-round":  # round 2's key, its number left at 2, in a round-3 config
        named["1"] = [2, other["2"]["pk"], other["2"]["sig"]]
        match = "a mask key masks only the round it was made for"
    else:
        named["1"] = [3, other["2"]["pk"], ""]
        match = "not signed by its identity key for that round"
    stage = clusters[0].stage
    stage.handle({"federation-id": "fed1", "epoch": epoch, "stage": "next-key", "round": 3})  # its own key of 3
    named["0"] = [3]
    cfg.update({"server-round": 3, "secagg-keys": json.dumps(named), "secagg-key-from": [], "secagg-key-tokens": []})
    for m in named:
        if m not in ("0", "1"):
            mine = clusters[int(m)].stage.handle({"federation-id": "fed1", "epoch": epoch, "stage": "next-key",
                                                  "round": 3})
            named[m] = [3, mine["pk"], mine["sig"]]
    cfg["secagg-keys"] = json.dumps(named)
    with pytest.raises(SecAggRefusal, match=match):
        stage.prepare(cfg)
    named["1"] = [3, *(lambda k: [k["pk"], k["sig"]])(clusters[1].stage.handle(
        {"federation-id": "fed1", "epoch": epoch, "stage": "next-key", "round": 3}))]
    cfg["secagg-keys"] = json.dumps(named)
    plan = stage.prepare(cfg)  # the control: the same config with the right key goes through
    assert plan.keys["1"][0] == 3 and np.all(np.array([k for k, _ in plan.keys.values()]) == 3)


def test_a_holder_never_gives_both_a_self_share_and_the_key_share_of_one_round(tmp_path):
    """Round 2 is unmasked honestly (cluster 2's self share revealed by every holder); a server then claiming 2
    dropped from round 2 gets no share of 2's key of round 2 from anyone."""
    wrapper, clusters, _grid, _heads = _run(tmp_path, rounds=2)
    epoch = wrapper.epoch["id"]
    for holder in (0, 1, 3):
        with pytest.raises(SecAggRefusal):
            clusters[holder].stage.handle({"federation-id": "fed1", "epoch": epoch, "stage": "recover", "round": 2,
                                           "clusters": ["2"]})
        log = clusters[holder].stage.state_dict()["fed1"]["epochs"][epoch]["log"]
        assert "2/2" in log["self_keys"] and "2/2" not in log["key_shares"]
