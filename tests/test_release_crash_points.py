"""Write-ahead release inside a cluster: a crash or a failure at any step boundary of a round never lets the trainer,
restarted or not, release work its privacy ledger does not cover.

One gloo rank in this process runs the real boundary (`Release.run`, the round's pipeline: reply cache, privacy gate, ledger,
`ClusterTrainer.train_round` and `commit`, snapshots) on a per-example DP policy. A fault fires once, in round 2, at
one step boundary: `kill` is the process's death there (an exception nothing catches; the trainer is then built
again from its state folder, as the launcher restarts it), `raise` an OSError there. The server then moves on to
rounds 3 and 4. Each training attempt is tagged (its round and steps) as it trains, and the tag travels with the
trainer's state, in memory and in its snapshots; after every request the test checks that every snapshot on disk, every state a
trainer restores and every release holds only attempts that were charged, and that the ledger's steps per round
cover the steps of the attempts that influenced a release.
"""

from __future__ import annotations

import errno
import itertools
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from nebula_fl.clients import privacy_gate
from nebula_fl.clients.protocol import split
from nebula_fl.clients.rank import Boundary
from nebula_fl.clients.release import Release
from nebula_fl.clients.reply_cache import ReplyCache
from nebula_fl.clients.snapshots import SnapshotStore
from nebula_fl.clients.trainer import ClusterTrainer, WorkerContext
from nebula_fl.clients.trainer_options import TrainerOptions
from nebula_fl.config import RunConfig
from nebula_fl.data.datasets import TextDataset
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.model.loading import build_model
from nebula_fl.privacy import cluster_ledger
from nebula_fl.privacy.cluster_ledger import LEDGER_FILE, ClusterLedger
from nebula_fl.privacy.policy import PrivacyPolicy

LABELS = ["a", "b"]
FAULT_ROUND = 2
ROUNDS = (1, 2, 3, 4)
# every step boundary of a round inside the cluster, in order (the torn ones: a write that fails half done)
POINTS = ("admitted", "trained", "ledger-write", "ledger-torn", "ledger-written", "snapshot-write", "snapshot-torn",
          "snapshot-written", "reply", "cached")
HOWS = ("kill", "raise")


class Killed(BaseException):
    """The process dies here: nothing in the trainer catches it, nothing after it runs."""


class Fault:
    """One fault, armed for one point of one round; fires once."""

    def __init__(self, point: str | None, how: str) -> None:
        self.point, self.how, self.round, self.fired = point, how, None, False

    def __call__(self, point: str) -> None:
        if point == self.point and self.round == FAULT_ROUND and not self.fired:
            self.fired = True
            raise Killed(point) if self.how == "kill" else OSError(errno.EIO, f"injected at {point}")


class Books:
    """What the test knows: each attempt's tag, which were charged, what was released, what was restored."""

    def __init__(self) -> None:
        self.serial = itertools.count(1)
        self.charged: set[tuple[int, int, int]] = set()  # (round, attempt, steps) the ledger durably holds
        self.charging: tuple[int, int, int] | None = None
        self.cached: dict[int, tuple] = {}  # round -> the lineage of the reply cached for it
        self.released: dict[int, tuple] = {}  # round -> the lineage of the reply the server got
        self.restored: list[tuple] = []


def instrument(monkeypatch, fault: Fault, books: Books) -> None:
    """Tag the trainer's state with its lineage, and put the fault's hook at every step boundary."""

    def wrap(cls, name, before=None, after=None):
        original = getattr(cls, name)

        def wrapped(self, *args, **kwargs):
            if before:
                before(self, *args, **kwargs)
            out = original(self, *args, **kwargs)
            return after(self, out, *args, **kwargs) if after else out

        monkeypatch.setattr(cls, name, wrapped)

    def fresh(trainer, _out, *_):
        trainer.lineage = ()

    def tag(trainer, losses, server_round, *_, **__):  # when training changes the state, before anything keeps it
        trainer.lineage = (*trainer.lineage, (int(server_round), next(books.serial), len(losses)))
        return losses

    def with_lineage(trainer, state):
        return {**state, "test-lineage": [list(a) for a in trainer.lineage]}

    def restored(trainer, _out, state):
        trainer.lineage = tuple(tuple(a) for a in state["test-lineage"])
        books.restored.append(trainer.lineage)

    def before_charge(gate, **_):
        books.charging = gate.trainer.lineage[-1]

    def charged(_ledger, out, **_):  # the entry is durable: the attempt is charged, whatever happens next
        books.charged.add(books.charging)
        fault("ledger-written")
        return out

    def reply(release, rnd):
        books.cached[rnd.request.number] = release.trainer.lineage

    wrap(ClusterTrainer, "_fresh_state", after=fresh)
    wrap(ClusterTrainer, "_train", after=tag)
    wrap(ClusterTrainer, "train_round", after=lambda _t, out, *_: (fault("trained"), out)[1])
    wrap(ClusterTrainer, "state_dict", after=lambda t, out: with_lineage(t, out))
    wrap(ClusterTrainer, "load_state_dict", after=restored)
    wrap(privacy_gate.PrivacyGate, "charge", before=before_charge)
    wrap(Release, "_admit", after=lambda *_: fault("admitted"))
    wrap(Release, "_reply", before=reply)
    wrap(ClusterLedger, "record", before=lambda *_, **__: fault("ledger-write"), after=charged)
    wrap(SnapshotStore, "save", before=lambda *_, **__: fault("snapshot-write"),
         after=lambda *_, **__: fault("snapshot-written"))
    wrap(ReplyCache, "put", before=lambda *_: fault("reply"), after=lambda *_: fault("cached"))
    monkeypatch.setattr(cluster_ledger, "os", torn_os(fault, "ledger-torn"))
    original_save = torch.save

    def torn_save(obj, path, *args, **kwargs):
        if isinstance(path, Path) and fault.point == "snapshot-torn" and fault.round == FAULT_ROUND and not fault.fired:
            path.write_bytes(b"PK\x03\x04 half a snapshot")  # (torch.save on a BytesIO: a collective's pickling)
            fault("snapshot-torn")
        return original_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", torn_save)


def torn_os(fault: Fault, point: str):
    """The `os` the ledger sees: its append writes half the line, then fails (or the process dies)."""
    import os

    def write(fd, data):
        if fault.point == point and fault.round == FAULT_ROUND and not fault.fired:
            os.write(fd, bytes(data[: len(data) // 2]))
            fault(point)
        return os.write(fd, data)

    names = {name: getattr(os, name) for name in dir(os) if not name.startswith("__")}
    return types.SimpleNamespace(**{**names, "write": write})


class Cluster:
    """A trainer on one state folder, built again (as its launcher restarts it) after it dies."""

    def __init__(self, tmp_path: Path, tiny_model: Path, control, books: Books) -> None:
        texts = [f"document {i} about {'money' if i % 2 else 'sport'} and more words" for i in range(48)]
        self.opts = TrainerOptions(
            cluster_id=0, socket_path=tmp_path / "t.sock", state_dir=tmp_path / "state", model_path=tiny_model,
            shard=TextDataset(texts, np.arange(48) % 2, LABELS),
            policy=PrivacyPolicy(mode="sample", min_noise_multiplier=1.0, max_epsilon=1e4, accountant="rdp"))
        self.tiny_model, self.control, self.books = tiny_model, control, books
        self.start()

    def start(self) -> None:
        trainer = ClusterTrainer(WorkerContext(
            rank=0, world=1, cluster_id=0, device=torch.device("cpu"), model_path=self.tiny_model,
            shard=self.opts.shard, state_dir=self.opts.state_dir, control=self.control))
        self.boundary = Boundary(self.opts, trainer)
        self.boundary.release.gate.trainer = trainer

    def ask(self, config: dict, arrays: dict) -> dict | None:
        """The round's reply as the server gets it; None if the trainer died (it is restarted)."""
        try:
            frame = self.boundary.release.run({"op": "train", "config": config, "arrays": arrays})
        except (Killed, OSError):  # nothing catches it: rank 0 dies, and with it the trainer
            self.start()
            return None
        header, update = split(frame)[0], split(frame)[1]
        if header.get("ok") and update and not header["metrics"].get("privacy-refused"):
            self.books.released.setdefault(config["server-round"], self.books.cached[config["server-round"]])
        return header


def check(state_dir: Path, books: Books) -> None:
    """The invariant: nothing uncharged in any snapshot on disk, any restored state or any release."""
    for path in sorted((state_dir / "snapshots").rglob("round-*.pt")):
        lineage = {tuple(a) for a in torch.load(path, weights_only=True)["ranks"][0]["test-lineage"]}
        assert lineage <= books.charged, f"{path.name} holds uncharged training {sorted(lineage - books.charged)}"
    for lineage in books.restored:
        assert set(lineage) <= books.charged, f"a trainer restored uncharged training {lineage}"
    influencing = {a for lineage in books.released.values() for a in lineage}
    assert influencing <= books.charged, f"released uncharged training {sorted(influencing - books.charged)}"
    ledger = ClusterLedger(path=state_dir / LEDGER_FILE, accountant="rdp")
    for rnd in {a[0] for a in influencing}:
        charged = sum(e["steps"] for e in ledger.entries(federation="fed") if e["round"] == rnd)
        needed = sum(a[2] for a in influencing if a[0] == rnd)
        assert charged >= needed, f"round {rnd}: {charged} step(s) charged, {needed} influenced a release"


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('gloo') / 'init'}", rank=0,
                            world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def server(tiny_model):
    cfg = RunConfig().replace({"model": str(tiny_model), "local-steps": 2, "batch-size": 4, "max-seq-len": 16,
                               "lora-mode": "standard"})
    base = {**cfg.train.to_flat(), **cfg.model.to_flat(), **cfg.privacy.to_flat(), "labels": LABELS,
            "federation-id": "fed", "seed": 0, "num-server-rounds": len(ROUNDS), "privacy.mode": "sample",
            "privacy.noise-multiplier": 1.0, "privacy.batch-size": 8}
    return base, adapter_arrays(build_model(cfg.model, num_labels=len(LABELS), seed=0))


def run(tmp_path, tiny_model, control, server, monkeypatch, *, point: str | None, how: str) -> Books:
    base, adapter = server
    books, fault = Books(), Fault(point, how)
    instrument(monkeypatch, fault, books)
    cluster = Cluster(tmp_path, tiny_model, control, books)
    for rnd in ROUNDS:
        fault.round = rnd
        cluster.ask({**base, "server-round": rnd}, adapter)
        check(cluster.opts.state_dir, books)
    assert fault.fired or point is None
    return books


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("point", POINTS)
def test_no_fault_at_any_step_boundary_releases_uncharged_training(tmp_path, tiny_model, control, server,
                                                                   monkeypatch, point, how):
    books = run(tmp_path, tiny_model, control, server, monkeypatch, point=point, how=how)
    assert set(books.released) >= {1, 3, 4}  # the trainer goes on: restarted, or with the round dropped
    assert all(lineage[-1][0] == rnd for rnd, lineage in books.released.items())


def test_without_faults_every_round_is_released_from_the_one_before(tmp_path, tiny_model, control, server,
                                                                    monkeypatch):
    books = run(tmp_path, tiny_model, control, server, monkeypatch, point=None, how="kill")
    assert [[a[0] for a in books.released[rnd]] for rnd in ROUNDS] == [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]
    assert books.restored == []  # never restarted: each round continues from the state in memory

