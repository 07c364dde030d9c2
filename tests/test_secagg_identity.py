"""Identities, the roster, the cluster's requirement and what it says in the clear under secure aggregation."""

from __future__ import annotations

import base64
import subprocess

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from nebula_fl.clients.secagg_stage import SecAggRefusal, SecAggStage
from nebula_fl.clients.trainer_service import IN_THE_CLEAR, in_the_clear
from nebula_fl.errors import ConfigError, NebulaError
from nebula_fl.privacy.policy import PrivacyPolicy
from nebula_fl.secagg.identity import Identity, load_roster, message, roster_line, verify
from tests.conftest import nebula_cmd


def test_a_signature_verifies_with_cryptography_itself_and_only_for_its_exact_fields(tmp_path):
    me = Identity.load_or_create(tmp_path)
    sig = me.sign("view", "fed", "e1", 3, ["0", "1"], ["0"])
    public = Ed25519PublicKey.from_public_bytes(base64.b64decode(me.public))
    public.verify(base64.b64decode(sig), message("view", "fed", "e1", 3, ["0", "1"], ["0"]))  # independent check
    assert verify(me.public, sig, "view", "fed", "e1", 3, ["0", "1"], ["0"])
    for other in [("view", "fed", "e1", 4, ["0", "1"], ["0"]), ("view", "fed", "e2", 3, ["0", "1"], ["0"]),
                  ("upload", "fed", "e1", 3, ["0", "1"], ["0"]), ("view", "fed", "e1", 3, ["0", "1"], ["1"])]:
        assert not verify(me.public, sig, *other)
    assert not verify(me.public, sig[:-4] + "AAA=", "view", "fed", "e1", 3, ["0", "1"], ["0"])
    assert not verify("not a key", sig, "view") and not verify(me.public, 12, "view")
    assert Identity.load_or_create(tmp_path).public == me.public  # the same identity for the cluster's life
    assert (tmp_path / "identity.key").stat().st_mode & 0o077 == 0


def test_the_roster_reads_identity_lines_and_refuses_what_it_cannot_trust(tmp_path):
    a, b = Identity.load_or_create(tmp_path / "a"), Identity.load_or_create(tmp_path / "b")
    path = tmp_path / "peers.txt"
    path.write_text(f"# our federation\n{roster_line(0, a)}\n\n{roster_line(1, b)}  # lab B\n")
    assert load_roster(path) == {"0": a.public, "1": b.public}
    for text, fragment in [(f"{roster_line(0, a)}\n0 {b.public}\n", "listed twice"),
                           (f"{roster_line(0, a)}\n1 {a.public}\n", "share one identity key"),
                           ("0 c2VjcmV0\n", "not an Ed25519 identity key"), ("zero key\n", "not '<cluster-id> <identity"),
                           ("# nobody\n", "lists no cluster")]:
        path.write_text(text)
        with pytest.raises(ConfigError, match=fragment):
            load_roster(path)
    with pytest.raises(ConfigError, match="cannot read the secure-aggregation roster"):
        load_roster(tmp_path / "missing.txt")


def test_a_stage_takes_its_roster_and_requirement_from_the_policy_and_says_so(tmp_path):
    mine = Identity.load_or_create(tmp_path / "state" / "secagg")
    other = Identity.load_or_create(tmp_path / "other")
    peers = tmp_path / "peers.txt"
    peers.write_text(f"{roster_line(0, mine)}\n{roster_line(1, other)}\n")
    policy = PrivacyPolicy(require_secure_aggregation=True, min_secagg_threshold=3, min_secagg_clusters=4,
                           secagg_peers=str(peers))
    stage = SecAggStage.for_policy(state_dir=tmp_path / "state", cluster_id=0, policy=policy)
    assert stage.roster == {"0": mine.public, "1": other.public}
    assert "required, in sums of at least 3 of at least 4 clusters, roster of 2 clusters" in stage.describe()
    assert "asks for an unmasked update" in stage.requirement_refusal({"federation-id": "f"})
    bare = SecAggStage.for_policy(state_dir=tmp_path / "bare", cluster_id=0, policy=PrivacyPolicy())
    assert bare.requirement_refusal({"federation-id": "f"}) is None and "no roster" in bare.describe()
    with pytest.raises(NebulaError, match="lists another identity key for cluster 1"):
        SecAggStage.for_policy(state_dir=tmp_path / "state", cluster_id=1, policy=policy)
    with pytest.raises(NebulaError, match="does not list cluster 2"):
        SecAggStage.for_policy(state_dir=tmp_path / "state", cluster_id=2, policy=policy)


def test_without_a_roster_a_cluster_refuses_key_setup_and_masked_rounds_unless_its_operator_opts_out(tmp_path):
    keys = {"stage": "keys", "federation-id": "f", "epoch": "e1", "round": 1}
    asks = {"keys": lambda stage: stage.handle(dict(keys)),
            "share": lambda stage: stage.handle({**keys, "stage": "share", "members": ["0", "7"]}),
            "round": lambda stage: stage.prepare({"federation-id": "f", "secagg-epoch": "e1", "server-round": 1})}
    bare = SecAggStage.for_policy(state_dir=tmp_path / "bare", cluster_id=0, policy=PrivacyPolicy())
    assert "no roster, so masked rounds are refused (give --secagg-peers)" in bare.describe()
    for ask in asks.values():
        with pytest.raises(SecAggRefusal, match="cluster 0 has no roster of secure-aggregation peers") as err:
            ask(bare)
        assert "--secagg-peers FILE" in str(err.value) and "--secagg-trust-server-membership" in str(err.value)
        assert "\n" not in str(err.value)
    assert not (tmp_path / "bare" / "secagg" / "f.json").exists()  # refused before anything was made or kept
    with pytest.raises(SecAggRefusal, match="unknown to cluster 0"):  # other stages: their own checks (no epoch)
        bare.handle({**keys, "stage": "unmask", "round": 1})

    trusting = SecAggStage.for_policy(state_dir=tmp_path / "trusting", cluster_id=0,
                                      policy=PrivacyPolicy(secagg_trust_server_membership=True))
    assert trusting.membership_refusal() is None
    assert "no roster, membership: the server's word (--secagg-trust-server-membership)" in trusting.describe()
    assert set(asks["keys"](trusting)) == {"c-pk", "s-pk", "id-pk", "key-sig"}
    with pytest.raises(SecAggRefusal, match="epoch e1 has no shares yet"):  # past the membership check
        asks["round"](trusting)
    with pytest.raises(NebulaError, match="exclude each other"):
        SecAggStage(state_dir=tmp_path / "trusting", cluster_id=0, roster={"0": trusting.identity.public},
                    trust_server_membership=True)


def test_nebula_fl_identity_prints_the_same_roster_line_every_time(tmp_path):
    lines = [subprocess.run(nebula_cmd("identity", "--state-dir", str(tmp_path), "--cluster-id", "4"),
                            capture_output=True, text=True, timeout=120, check=True).stdout.strip() for _ in range(2)]
    assert lines[0] == lines[1] and lines[0].startswith("4 ")
    (tmp_path / "peers.txt").write_text(lines[0] + "\n")
    assert load_roster(tmp_path / "peers.txt") == {"4": Identity.load_or_create(tmp_path / "secagg").public}


def test_under_secure_aggregation_a_reply_says_only_what_is_harmless():
    everything = {  # what a trainer's round and its privacy gate put in a reply (trainer.py, privacy_gate.py)
        "cluster-id": 1, "num-examples": 4001, "examples-seen": 5000, "steps": 10, "train-loss": 0.4, "seconds": 3.2,
        "encode-seconds": 0.1, "workers": 2, "device": "cpu", "parallel": "fsdp", "rank-divergence": 0.0, "codec-up": "none",
        "update-bytes": 1000, "epsilon": 2.5, "epsilon-federation": 2.5, "delta": 2.5e-5, "dp-steps": 80,
        "accountant": "prv", "privacy-mode": "sample", "noise-multiplier": 1.1, "sample-rate": 0.125,
        "max-grad-norm": 1.0, "max-epsilon": 8.0, "secagg-keys-held": 1, "update-norm-before-clip": 3.0,
    }
    sample = in_the_clear(everything, mode="sample")
    assert set(sample) <= set(IN_THE_CLEAR)
    assert sample["parallel"] == "fsdp" and sample["workers"] == 2  # the cluster's hardware, not its data
    assert not {"num-examples", "examples-seen", "train-loss", "seconds", "epsilon", "sample-rate", "delta"} & set(sample)
    client = in_the_clear(everything, mode="client")
    assert {"epsilon", "delta"} <= set(client) and "num-examples" not in client
