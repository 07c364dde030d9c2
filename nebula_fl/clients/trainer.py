"""One worker (rank) of a cluster's persistent trainer: builds the model once per run, trains rounds.

Every rank of the cluster runs the same calls in the same order; gradients are averaged by DDP, and
the few decisions that could differ between ranks (a request that fails to set up) are agreed on
through ``agree`` before any collective that could otherwise hang. Rank 0 alone answers the ClientApp
and writes the cluster's snapshots.

Inner-optimizer state (AdamW moments), the batch stream and each rank's RNG persist across rounds,
as in DiLoCo, and are snapshotted after every round this cluster trains: a resumed federation, or a
round the server re-sends, restarts from the last snapshot before that round.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nebula_fl.clients.inner_loop import BatchSchedule, scheduled_lr, train_steps
from nebula_fl.config import ModelConfig, TrainConfig
from nebula_fl.data.datasets import TextDataset
from nebula_fl.errors import NebulaError
from nebula_fl.model.adapter import adapter_arrays, load_adapter_arrays
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.loading import build_model, load_tokenizer

Arrays = dict[str, np.ndarray]
SNAPSHOTS_KEPT = 3


@dataclass(kw_only=True)
class WorkerContext:
    rank: int
    world: int
    cluster_id: int
    device: torch.device
    model_path: Path
    shard: TextDataset
    state_dir: Path
    control: Any  # the gloo process group for control messages


class RequestError(NebulaError):
    """A request this cluster refuses; every rank raises it together, and rank 0 reports it."""


class ClusterTrainer:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.setup_key: str | None = None
        self.round: int | None = None  # last round trained with the in-memory state; None = nothing yet
        self.federation_id = ""
        self.tokenizer = load_tokenizer(ctx.model_path)

    # -- collectives -------------------------------------------------------------------------------
    def agree(self, error: str | None) -> None:
        """All ranks share their error (or None); if any rank failed, every rank raises the first one."""
        errors: list[str | None] = [None] * self.ctx.world
        dist.all_gather_object(errors, error, group=self.ctx.control)
        first = next((e for e in errors if e), None)
        if first:
            raise RequestError(first)

    # -- per-run setup -----------------------------------------------------------------------------
    def setup(self, config: dict[str, Any]) -> None:
        """Build model, tokenised shard and fresh inner state for a federation; no-op if unchanged."""
        model_cfg = ModelConfig.from_flat(config)
        labels = list(config["labels"])
        key = json.dumps([config["federation-id"], model_cfg.to_flat(), labels, config["seed"]], sort_keys=True)
        if key == self.setup_key:
            return
        names = self.ctx.shard.label_names
        unknown = [n for n in names if n not in labels]
        if unknown:
            raise RequestError(
                f"cluster {self.ctx.cluster_id} holds labels {unknown} that the federation does not know "
                f"({labels}); relabel the data or add them on the server"
            )
        federation_id = str(config["federation-id"])
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", federation_id):
            # it names this cluster's snapshot folder: never let the server pick a path
            raise RequestError(f"federation id {federation_id!r} is not a plain name of letters, digits, '-' and '_'")
        remap = np.array([labels.index(n) for n in names], dtype=np.int64)
        self.labels = remap[self.ctx.shard.labels]
        self.federation_id = federation_id
        self.seed = int(config["seed"])
        model = build_model(model_cfg, num_labels=len(labels), seed=self.seed, path=self.ctx.model_path)
        self.peft = model.to(self.ctx.device)
        self.model = (
            DistributedDataParallel(self.peft, device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None)
            if self.ctx.world > 1
            else self.peft
        )
        order = np.random.default_rng([self.seed, self.ctx.cluster_id]).permutation(len(self.labels))
        mine = np.sort(order[self.ctx.rank :: self.ctx.world])
        if len(mine) == 0:
            raise RequestError(
                f"cluster {self.ctx.cluster_id} has {len(self.labels)} examples for {self.ctx.world} workers; "
                "use fewer workers"
            )
        self.data = TokenizedTexts(
            self.tokenizer, [self.ctx.shard.texts[i] for i in mine], self.labels[mine], max_len=model_cfg.max_seq_len
        )
        self.setup_key = key
        self.round = None
        self.optimizer = None

    def _fresh_state(self, train_cfg: TrainConfig) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        self.schedule = BatchSchedule(len(self.data), batch_size=train_cfg.batch_size, seed=self.seed, rank=self.ctx.rank)
        torch.manual_seed(self.seed * 1_000_003 + self.ctx.cluster_id * 1_009 + self.ctx.rank)
        self.round = 0

    # -- snapshots ---------------------------------------------------------------------------------
    def _snapshot_dir(self) -> Path:
        return self.ctx.state_dir / self.federation_id

    def _snapshot_rounds(self) -> list[int]:
        folder = self._snapshot_dir()
        if not folder.is_dir():
            return []
        return sorted(int(p.stem.split("-")[1]) for p in folder.glob("round-*.pt"))

    def state_dict(self) -> dict[str, Any]:
        """This rank's full inner state (optimizer, batch stream, RNG)."""
        assert self.optimizer is not None and self.round is not None
        return {
            "round": self.round,
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "rng": torch.get_rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"])
        self.round = int(state["round"])

    def _save_snapshot(self) -> None:
        states: list[Any] = [None] * self.ctx.world
        dist.all_gather_object(states, self.state_dict(), group=self.ctx.control)
        if self.ctx.rank != 0:
            return
        folder = self._snapshot_dir()
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / f"round-{self.round:05d}.pt"
        tmp = target.with_suffix(".tmp")
        torch.save({"world": self.ctx.world, "ranks": states}, tmp)
        os.replace(tmp, target)
        for old in self._snapshot_rounds()[:-SNAPSHOTS_KEPT]:
            (folder / f"round-{old:05d}.pt").unlink(missing_ok=True)

    def _restore_before(self, server_round: int, train_cfg: TrainConfig) -> None:
        """Make the in-memory state the one this cluster had just before `server_round`.

        In-memory state from an earlier round is current; otherwise (a fresh process, or a round the
        server sends again after a resume) the newest snapshot before `server_round` is, or the initial
        state if there is none.
        """
        if self.optimizer is not None and self.round is not None and self.round < server_round:
            return
        self._fresh_state(train_cfg)
        earlier = [r for r in self._snapshot_rounds() if r < server_round]
        if earlier:
            saved = torch.load(self._snapshot_dir() / f"round-{earlier[-1]:05d}.pt", weights_only=True)
            if saved["world"] != self.ctx.world:
                raise RequestError(
                    f"cluster {self.ctx.cluster_id} saved its state with {saved['world']} workers but runs "
                    f"{self.ctx.world} now; restart it with --workers {saved['world']}"
                )
            self.load_state_dict(saved["ranks"][self.ctx.rank])

    # -- one round ---------------------------------------------------------------------------------
    def train_round(self, config: dict[str, Any], global_arrays: Arrays) -> tuple[Arrays, dict[str, Any]]:
        """Train `local-steps` from the global adapter; return (update, metrics). Same call on every rank."""
        server_round = int(config["server-round"])
        error = None
        try:
            train_cfg = TrainConfig.from_flat(config)
            self.setup(config)
            self._restore_before(server_round, train_cfg)
            for group in self.optimizer.param_groups:
                group["lr"], group["weight_decay"] = train_cfg.lr, train_cfg.weight_decay
            load_adapter_arrays(self.peft, global_arrays)
        except (NebulaError, ValueError, KeyError) as err:
            error = str(err) or type(err).__name__
        self.agree(error)

        total_rounds = int(config.get("num-server-rounds", server_round))
        total_steps = max(1, total_rounds * train_cfg.local_steps)
        done_before = (server_round - 1) * train_cfg.local_steps

        def lr_at(i: int) -> float:
            return scheduled_lr(train_cfg.lr, progress=(done_before + i) / total_steps,
                                schedule=train_cfg.lr_schedule, min_ratio=train_cfg.lr_min_ratio)

        started = time.monotonic()
        losses = train_steps(
            self.model, self.optimizer, self.data, self.schedule,
            steps=train_cfg.local_steps, max_grad_norm=train_cfg.max_grad_norm, device=self.ctx.device, lr_at=lr_at,
        )
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        seconds = time.monotonic() - started
        after = adapter_arrays(self.peft)
        update = {k: (after[k] - np.asarray(global_arrays[k], dtype=np.float32)).astype(np.float32) for k in after}

        stats = torch.tensor([float(np.mean(losses)), _checksum(after)], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(self.ctx.world)]
        dist.all_gather(gathered, stats, group=self.ctx.control)
        rank_losses = [float(g[0]) for g in gathered]
        sums = [float(g[1]) for g in gathered]
        self.round = server_round
        self._save_snapshot()
        metrics = {
            "cluster-id": self.ctx.cluster_id,
            "num-examples": len(self.ctx.shard),
            "examples-seen": int(train_cfg.local_steps * train_cfg.batch_size * self.ctx.world),
            "steps": int(train_cfg.local_steps),
            "train-loss": float(np.mean(rank_losses)),
            "seconds": float(seconds),
            "workers": int(self.ctx.world),
            "device": self.ctx.device.type,
            "rank-divergence": float(max(abs(s - sums[0]) for s in sums)),
        }
        return update, metrics


def _checksum(arrays: Arrays) -> float:
    """A cheap fingerprint of the adapter; ranks in sync give bit-identical sums."""
    return float(sum(float(np.abs(v).astype(np.float64).sum()) for v in arrays.values()))
