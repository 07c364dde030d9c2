"""Nothing about a cluster's shard leaves it in the clear under secure aggregation: two clusters identical but for
their number of examples n send byte-identical frames, apart from the masked payload.

Driven through the trainer's own boundary (its socket's `_handle` and the round's pipeline, `Release.run`, with the
real privacy gate, ledger, client-level DP, reply cache and `released`); two things stand in: the ranks (`FakeRanks`:
an update and the metrics `ClusterTrainer.train_round` reports, each data-dependent one a function of n, and the
round's codec), and, for
masked rounds, secure aggregation's stage (`StubStage`: its mask is random bytes, the weight it is given is
recorded). A policy that demands masking uses the real stage.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch.distributed as dist

from nebula_fl.clients import outgoing
from nebula_fl.clients.protocol import pack, split
from nebula_fl.clients.rank import Boundary
from nebula_fl.clients.trainer import RequestError
from nebula_fl.clients.trainer_options import TrainerOptions
from nebula_fl.compression import Compressor, Layout
from nebula_fl.config import RunConfig
from nebula_fl.data.datasets import TextDataset
from nebula_fl.privacy.policy import PrivacyPolicy
from nebula_fl.secagg.identity import Identity, roster_line

SIZES = (2_000, 16_000)  # σ for ε = 8 at a logical batch of 256 differs between them, and so does δ = 1/(10 n)
BATCH = 256
SETUPS = {  # policy, an admitted request, a request below the policy's floor
    "sample, target ε": (
        {"mode": "sample", "target_epsilon": 8.0, "planned_rounds": 10, "planned_local_steps": 5,
         "planned_batch_size": BATCH, "accountant": "rdp"},  # (rdp: the same property, seconds faster)
        {"privacy.mode": "sample", "privacy.target-epsilon": 8.0, "privacy.batch-size": BATCH},
        {"privacy.mode": "sample", "privacy.noise-multiplier": 0.05, "privacy.batch-size": BATCH}),
    "sample, fixed σ": (
        {"mode": "sample", "min_noise_multiplier": 0.5},
        {"privacy.mode": "sample", "privacy.noise-multiplier": 1.0, "privacy.batch-size": BATCH},
        {"privacy.mode": "sample", "privacy.noise-multiplier": 0.1, "privacy.batch-size": BATCH}),
    "client": (
        {"mode": "client", "min_noise_multiplier": 0.5},
        {"privacy.mode": "client", "privacy.noise-multiplier": 1.0, "privacy-sigma": 1.0, "privacy-noise-shares": 2},
        {"privacy.mode": "client", "privacy.noise-multiplier": 0.1, "privacy-sigma": 0.1, "privacy-noise-shares": 2}),
}


class FakeRanks:
    """The ranks' answer to a round, shaped as `ClusterTrainer.train_round`'s (the raw update), and rank 0's uplink
    codec as `ClusterTrainer.encode_up` runs it; `fail`: refuse the round as a rank would."""

    def __init__(self, n: int) -> None:
        self.n, self.fail = n, False
        self.layout = Layout.from_shapes({"lora_A": (4, 8), "lora_B": (8, 4), "head": (5,)})
        self.up = None
        self.ctx = SimpleNamespace(control=None)

    def train_round(self, config, arrays, admission):
        if self.fail:
            raise RequestError(f"cluster 3 has {self.n} examples for 20000 workers; use fewer workers")
        update = self.layout.unflatten(np.random.default_rng(self.n).normal(0, 0.01, self.layout.size)
                                       .astype(np.float32))
        steps = int(config["local-steps"])
        metrics = {
            "cluster-id": 3, "num-examples": self.n, "examples-seen": steps * BATCH, "steps": steps,
            "train-loss": 1.0 / self.n, "seconds": self.n / 1e3, "workers": 1, "device": "cpu",
            "precision": "fp32", "parallel": "ddp", "rank-divergence": 0.0, "busy-seconds": self.n / 1e3,
        }
        return update, metrics

    def encode_up(self, update, *, config):
        self.up = Compressor(str(config["codec-up"]), layout=self.layout)
        return self.up.select(self.layout.flatten(update), seed=int(config["codec-seed"]))

    def uplink_metrics(self, sent):
        return {"codec-up": self.up.describe()["spec"], "update-bytes": int(sent["blob"].size)}

    def commit(self, *, failed=None):  # the ranks keep the round once it is charged (ClusterTrainer.commit)
        if failed:
            raise RequestError(failed)


class StubStage:
    """Secure aggregation's cluster side as the boundary calls it on a masked round."""

    def __init__(self) -> None:
        self.weights: list[int] = []

    def requirement_refusal(self, config):
        return None

    def prepare(self, config):
        return SimpleNamespace(threshold=2, epoch=config["secagg-epoch"], code=SimpleNamespace(max_weight=1 << 20))

    def mask(self, plan, *, values, weight):
        self.weights.append(weight)
        return np.frombuffer(os.urandom(8 * (values.size + 1)), dtype=np.uint8)

    def holds_keys(self, federation, epoch):
        return True

    def handle(self, request):
        return {"stage": request.get("stage"), "ok": 1}


class FakeConn:
    def __init__(self, frame: bytes) -> None:
        self.frame, self.sent = frame, []

    def recv_bytes(self, _limit):
        return self.frame

    def send_bytes(self, frame):
        self.sent.append(frame)

    def close(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def ask(boundary: Boundary, header: dict, arrays=None) -> bytes:
    """What the trainer sends back to one request, through the path `serve` takes."""
    conn = FakeConn(pack(header, arrays))
    boundary.socket._handle(SimpleNamespace(handshake=lambda raw: conn), None)
    if header.get("op") != "train":
        return conn.sent[-1]
    _, job = boundary.socket.jobs.get_nowait()  # the ranks' thread: serve() sends what the round's pipeline returns
    return boundary.release.run(job)


def cluster(tmp_path, n: int, policy: dict, *, stub: bool = True) -> Boundary:
    shard = TextDataset([f"doc {i}" for i in range(n)], np.arange(n) % 2, ["a", "b"])
    folder = tmp_path / f"n{n}"
    opts = TrainerOptions(cluster_id=3, socket_path=folder / "t.sock", state_dir=folder / "state", model_path=folder,
                          shard=shard, policy=PrivacyPolicy(**policy))
    boundary = Boundary(opts, trainer=FakeRanks(n))
    if stub:
        boundary.release.secagg = StubStage()
    return boundary


def request(privacy: dict, number: int, **extra) -> dict:
    config = {**RunConfig().to_flat(), **privacy, "federation-id": "fed", "server-round": number,
              "num-server-rounds": 10, "local-steps": 5, "codec-up": "none", "codec-seed": 11, "secagg-epoch": "e1",
              **extra}
    return {"op": "train", "config": config}


def head(frame: bytes) -> bytes:
    """The frame without its body (the update: masked under secure aggregation)."""
    return frame[: len(frame) - len(split(frame)[1])]


def frames(tmp_path, policy: dict, asks: list, *, stub: bool = True) -> list[list[bytes]]:
    """Per cluster size, the frames sent back to `asks` (header dicts, or ("fail", header): the ranks refuse)."""
    out = []
    for n in SIZES:
        boundary = cluster(tmp_path, n, policy, stub=stub)
        sent = []
        for item in asks:
            boundary.trainer.fail = isinstance(item, tuple)
            header = item[1] if isinstance(item, tuple) else item
            sent.append(ask(boundary, header, {"global": np.zeros(3, np.float32)}))
        out.append(sent)
    return out


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    monkeypatch.setattr(dist, "broadcast_object_list", lambda *a, **k: None)  # the other ranks: FakeRanks


@pytest.mark.parametrize("setup", list(SETUPS))
def test_clusters_that_differ_only_in_size_send_the_same_frames(tmp_path, setup):
    policy, admitted, weak = SETUPS[setup]
    asks = [
        {"op": "hello"},
        request(admitted, 1),  # accepted and masked
        request(admitted, 1),  # asked again: the reply cache's very bytes
        request(weak, 2),  # refused by the policy's floor
        ("fail", request(admitted, 2)),  # refused: the ranks could not train it (the reason names n)
        request(admitted, 2, **{"local-steps": "auto"}),  # refused: a masked round's step count is fixed
        {"op": "secagg", "request": {"stage": "view"}},
        {"op": "nonsense"},
    ]
    small, large = frames(tmp_path / "plain", policy, asks)
    assert [split(f)[0].get("ok") for f in small] == [True, True, True, True, False, False, True, False]
    assert [head(f) for f in small] == [head(f) for f in large]
    assert [len(f) for f in small] == [len(f) for f in large]  # the masked payload: one size, whatever n
    assert small[2] == small[1] and large[2] == large[1]
    accepted = split(small[1])[0]["metrics"]
    assert accepted["steps"] == 5 and not {"num-examples", "examples-seen", "seconds", "train-loss"} & set(accepted)
    figures = {"noise-multiplier", "delta", "sample-rate", "epsilon", "dp-steps"} & set(accepted)
    assert bool(figures) == (setup == "client")  # client-level DP's: the server's σ, q = 1, the operator's δ
    # spent: every further round goes past the budget, whatever n
    broke, broke_large = frames(tmp_path / "spent", {**policy, "max_epsilon": 1e-4}, [request(admitted, 1)])
    assert split(broke[0])[0]["metrics"]["privacy-refusal"] == "budget"
    assert broke == broke_large


def test_the_clusters_do_differ_and_the_difference_stays_masked(tmp_path):
    policy, admitted, _ = SETUPS["sample, fixed σ"]
    boundaries = [cluster(tmp_path, n, policy) for n in SIZES]
    sent = [ask(b, request(admitted, 1), {"global": np.zeros(3, np.float32)}) for b in boundaries]
    assert [b.release.secagg.weights for b in boundaries] == [[n] for n in SIZES]  # each weight went into its mask
    assert head(sent[0]) == head(sent[1])
    kept = [b.release.gate.metrics(b.release.gate.admit(request(admitted, 1)["config"], world=1), federation="fed") for b in boundaries]
    assert kept[0]["delta"] != kept[1]["delta"] and kept[0]["sample-rate"] != kept[1]["sample-rate"]


def test_a_policy_demanding_masking_holds_an_unmasked_round_to_the_same_rule(tmp_path):
    policy, admitted, _ = SETUPS["sample, target ε"]
    unmasked = request(admitted, 1)
    del unmasked["config"]["secagg-epoch"]
    sent = []
    for n in SIZES:  # each cluster's roster: its own identity key and a peer's
        folder = tmp_path / f"n{n}"
        folder.mkdir()
        keys = {3: folder / "state" / "secagg", 4: folder / "peer"}
        roster = folder / "peers.txt"
        roster.write_text("".join(roster_line(i, Identity.load_or_create(f)) + "\n" for i, f in keys.items()))
        strict = {**policy, "require_secure_aggregation": True, "secagg_peers": str(roster)}
        sent.append(ask(cluster(tmp_path, n, strict, stub=False), unmasked))
    said = split(sent[0])[0]["metrics"]
    assert said["privacy-refusal"] == "policy" and "requires secure aggregation" in said["privacy-reason"]
    assert sent[0] == sent[1]


def test_a_control_with_sigma_let_out_shows_the_check_can_see_n(tmp_path, monkeypatch):
    """The weakness this file guards against, switched back on: σ derived from q = B/n, said in the clear."""
    monkeypatch.setitem(outgoing.IN_THE_CLEAR, "noise-multiplier", "σ (the old rule)")
    policy, admitted, _ = SETUPS["sample, target ε"]
    small, large = frames(tmp_path, policy, [request(admitted, 1)])
    sigmas = [split(f[0])[0]["metrics"]["noise-multiplier"] for f in (small, large)]
    assert sigmas[0] > sigmas[1] and head(small[0]) != head(large[0])


def test_released_keeps_an_unmasked_frame_and_is_idempotent():
    frame = pack({"ok": True, "metrics": {"num-examples": 7, "delta": 1e-6}, outgoing.PLAIN: True},
                 {"u": np.ones(2, np.float32)})
    clear = outgoing.released(frame, secure=False)
    assert split(clear)[0] == {"ok": True, "metrics": {"num-examples": 7, "delta": 1e-6}}
    assert split(clear)[1] == split(frame)[1] and outgoing.released(clear, secure=False) is clear
    masked = outgoing.released(frame, secure=True)
    assert split(masked)[0] == {"ok": True, "metrics": {}} and outgoing.released(masked, secure=True) is masked
    error = outgoing.released(pack({"ok": False, "error": "cluster 3 has 7 examples"}), secure=True)
    assert split(error)[0] == {"ok": False, "error": outgoing.HIDDEN_ERROR}
