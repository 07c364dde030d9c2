"""What a trainer's socket says to whoever reaches it (the SuperNode's user, and so the server): `hello` names the
cluster and its hardware only; a refusal under secure aggregation follows the round replies' rule, its figures (δ,
σ floor, ε: each a function of the cluster's size) kept in the log."""

import numpy as np

from nebula_fl.clients.outgoing import IN_THE_CLEAR, released
from nebula_fl.clients.protocol import unpack
from nebula_fl.clients.rank import Boundary
from nebula_fl.clients.release import Round
from nebula_fl.clients.round_request import RoundRequest
from nebula_fl.clients.trainer_options import TrainerOptions, describe
from nebula_fl.config import RunConfig
from nebula_fl.data.datasets import TextDataset
from nebula_fl.privacy.policy import PrivacyPolicy
from nebula_fl.secagg.identity import Identity, roster_line

N = 20_000  # a cluster big enough that its default δ = 1/(10 n) names n exactly


def _boundary(tmp_path, policy: PrivacyPolicy) -> Boundary:
    shard = TextDataset([f"doc {i}" for i in range(N)], np.arange(N) % 2, ["a", "b"])
    opts = TrainerOptions(cluster_id=3, socket_path=tmp_path / "t.sock", state_dir=tmp_path / "state",
                          model_path=tmp_path, shard=shard, policy=policy)
    return Boundary(opts, trainer=None)  # no round reaches the ranks here


def _refusal(boundary: Boundary, config: dict) -> dict:
    rnd = Round(request=RoundRequest.parse({"config": config}))
    release = boundary.release
    admission = release.gate.admit(config, world=1, secure_threshold=2 if "secagg-epoch" in config else None)
    assert not admission.allowed
    try:
        release._decline(rnd, admission, admission.refusal)
    except Exception as answer:  # Answer: the frame the round is answered with, as it leaves (released)
        return unpack(released(answer.frame, secure=release.secure(config)))[0]["metrics"]
    raise AssertionError("a refused round was not answered")


def test_hello_names_the_cluster_and_its_hardware_and_nothing_of_its_data(tmp_path):
    boundary = _boundary(tmp_path, PrivacyPolicy(mode="sample", min_noise_multiplier=1.0))
    said = {k: v for k, v in unpack(boundary._answer_now("hello", {}))[0].items() if k != "ok"}
    assert said == describe(boundary.opts) == {"cluster_id": 3, "workers": 1, "nodes": 1, "device": "cpu",
                                               "precision": "auto", "parallel": "ddp", "privacy_mode": "sample"}
    assert {k.replace("_", "-") for k in said} <= set(IN_THE_CLEAR)
    assert str(N) not in str(said)


def test_a_refusal_under_secure_aggregation_keeps_its_size_dependent_figures_in_the_log(tmp_path, capsys):
    boundary = _boundary(tmp_path, PrivacyPolicy(mode="sample", target_epsilon=4.0, planned_rounds=10,
                                                 planned_local_steps=5))
    weak = {**RunConfig().to_flat(), "privacy.mode": "sample", "privacy.noise-multiplier": 0.3,
            "federation-id": "fed", "server-round": 1}
    plain = _refusal(boundary, weak)  # unmasked: the reason as the gate says it, figures and all (as before)
    assert "below this cluster's floor" in plain["privacy-reason"] and "epsilon" in plain and "delta" in plain
    masked = _refusal(boundary, {**weak, "secagg-epoch": "1"})
    assert masked["privacy-refused"] == 1 and masked["privacy-refusal"] == "policy"
    assert set(masked) <= set(IN_THE_CLEAR)
    assert "floor" not in masked["privacy-reason"] and "the reason is in its log" in masked["privacy-reason"]
    assert not any(ch.isdigit() for ch in masked["privacy-reason"])
    assert "below this cluster's floor" in capsys.readouterr().out  # the operator still reads why
    # a δ weaker than the cluster's own (1/(10 n)): the refusal would name n; masked it does not
    loose = _refusal(boundary, {**weak, "privacy.noise-multiplier": 5.0, "privacy.delta": 1e-5, "secagg-epoch": "1"})
    assert "δ" not in loose["privacy-reason"] and str(N) not in str(loose) and "5e-06" not in str(loose)
    # the operator demands masking: the round replies' rule holds for every round, masked or not
    roster = tmp_path / "peers.txt"
    folders = {3: tmp_path / "strict" / "state" / "secagg", 4: tmp_path / "other"}  # cluster 3's own key, and a peer's
    roster.write_text("".join(roster_line(i, Identity.load_or_create(f)) + "\n" for i, f in folders.items()))
    strict = _boundary(tmp_path / "strict", PrivacyPolicy(mode="sample", min_noise_multiplier=1.0,
                                                          require_secure_aggregation=True, secagg_peers=str(roster)))
    assert set(_refusal(strict, weak)) <= set(IN_THE_CLEAR)


def test_a_masked_round_in_a_codec_whose_sum_the_server_cannot_decode_is_refused_before_training(tmp_path):
    """Masking takes the uplink codec's values as the server sums them: only a linear chain's do (as the server's
    SecAggWrapper demands); a server that asks for another is told so, plainly, and nothing is trained."""
    boundary = _boundary(tmp_path, PrivacyPolicy())  # (trainer=None: a round that reached the ranks would fail)
    config = {**RunConfig().to_flat(), "federation-id": "fed", "server-round": 1, "secagg-epoch": "1",
              "local-steps": 5, "codec-seed": 3}
    for codec in ("topk:0.1", "randk:0.1+int8", None):
        asked = config if codec is None else {**config, "codec-up": codec}
        header = unpack(boundary.release.run({"op": "train", "config": asked}))[0]
        assert not header["ok"] and "needs a linear uplink codec" in header["error"]
