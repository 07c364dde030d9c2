"""`ClusterTrainer.commit` over two real gloo ranks (spawned here): a round is kept (snapshotted) only once rank 0
charged it, and when rank 0 could not charge it or could not write its snapshot, every rank drops it, so the next
round starts, on every rank, from the last snapshot the ledger covers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.gloo_ranks import spawn_ranks

LABELS = ["a", "b"]


def _rank_checks(rank: int, world: int, model_path: Path, state_dir: Path) -> dict:
    import torch
    import torch.distributed as dist

    from nebula_fl.clients.trainer import ClusterTrainer, RequestError, WorkerContext
    from nebula_fl.config import RunConfig
    from nebula_fl.data.datasets import TextDataset
    from nebula_fl.model.adapter import adapter_arrays
    from nebula_fl.model.loading import build_model
    from nebula_fl.privacy.policy import Admission

    texts = [f"document {i} about {'money' if i % 2 else 'sport'}" for i in range(16)]
    trainer = ClusterTrainer(WorkerContext(
        rank=rank, world=world, cluster_id=0, device=torch.device("cpu"), model_path=model_path,
        shard=TextDataset(texts, np.arange(16) % 2, LABELS), state_dir=state_dir,
        control=dist.new_group(backend="gloo")))
    cfg = RunConfig().replace({"model": str(model_path), "local-steps": 1, "batch-size": 2, "max-seq-len": 16})
    start = adapter_arrays(build_model(cfg.model, num_labels=len(LABELS), seed=0))
    restored: list[int] = []
    load = trainer.load_state_dict
    trainer.load_state_dict = lambda state: (restored.append(int(state["round"])), load(state))[1]
    found: dict = {}

    def round_(number: int, **commit) -> str | None:
        config = {**cfg.train.to_flat(), **cfg.model.to_flat(), "labels": LABELS, "federation-id": "fed", "seed": 0,
                  "server-round": number, "num-server-rounds": 4}
        trainer.train_round(config, start, Admission(allowed=True))
        try:
            trainer.commit(**commit)
        except RequestError as err:
            return str(err)
        return None

    found["kept-1"] = round_(1)
    # rank 0 could not charge round 2 (its ledger failed): only rank 0 knows, every rank drops it
    found["dropped-2"] = round_(2, failed="the ledger could not be written" if rank == 0 else None)
    found["valid-after-2"] = trainer.state_valid
    # round 3 starts from round 1's snapshot; rank 0 cannot write round 3's: every rank drops it
    if rank == 0:
        def full(*_, **__):
            raise OSError(28, "No space left on device")

        trainer.snapshots.save = full
    found["dropped-3"] = round_(3)
    found["valid-after-3"] = trainer.state_valid
    found["restored"] = restored
    found["snapshots"] = trainer.snapshots.rounds()
    return found


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from nebula_fl.model.tiny import build_tiny_model

    tmp = tmp_path_factory.mktemp("commit")
    model_path = build_tiny_model(tmp / "model", layers=1)
    return spawn_ranks(_rank_checks, world=2, folder=tmp, args=(model_path, tmp / "state"))


def test_a_round_rank_0_could_not_charge_or_snapshot_is_dropped_on_every_rank(ranks):
    for found in ranks:
        assert found["kept-1"] is None
        assert found["dropped-2"] == "the ledger could not be written" and found["valid-after-2"] is False
        assert found["dropped-3"].startswith("cluster 0 could not write its snapshot of round 3 (")
        assert "free space in its --state-dir" in found["dropped-3"] and found["valid-after-3"] is False
        assert found["restored"] == [1]  # round 3 started from round 1's snapshot: round 2 left nothing behind
    assert ranks[0]["snapshots"] == [1]  # only the round that was charged is on disk
