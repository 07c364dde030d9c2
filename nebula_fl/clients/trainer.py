"""One worker (rank) of a cluster's persistent trainer: builds the model once per run, trains rounds.

Every rank of the cluster runs the same calls in the same order; gradients are averaged by DDP, and
the few decisions that could differ between ranks (a request that fails to set up) are agreed on
through ``agree`` before any collective that could otherwise hang. Rank 0 alone answers the ClientApp
and writes the cluster's snapshots.

Inner-optimizer state (AdamW moments), the batch stream and each rank's RNG persist across rounds,
as in DiLoCo, and are snapshotted after every round this cluster trains (``snapshots.py``): a
restarted trainer continues from its newest snapshot. What the server may ask is decided before a
round reaches the ranks, by rank 0's privacy gate and reply cache (``trainer_service.py``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from nebula_fl.clients.inner_loop import BatchSchedule, scheduled_lr, train_steps
from nebula_fl.clients.reply_cache import FEDERATION_ID
from nebula_fl.clients.snapshots import SnapshotStore
from nebula_fl.comm.views import view_crc
from nebula_fl.compression import CodecError, Compressor, Layout
from nebula_fl.config import ModelConfig, PrivacyConfig, TrainConfig
from nebula_fl.data.datasets import TextDataset
from nebula_fl.errors import NebulaError
from nebula_fl.model.adapter import adapter_arrays, load_adapter_arrays
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.frozen_a import fingerprint
from nebula_fl.model.loading import build_model, load_tokenizer
from nebula_fl.privacy.dp_recipe import learning_rate, logical_batch
from nebula_fl.privacy.policy import Admission

Arrays = dict[str, np.ndarray]


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
    def setup(self, config: dict[str, Any], admission: Admission) -> None:
        """Build model, tokenised shard and fresh inner state for a federation; no-op if unchanged."""
        model_cfg = ModelConfig.from_flat(config)
        train_cfg = TrainConfig.from_flat(config)
        labels = list(config["labels"])
        asked = PrivacyConfig.from_flat(config)
        private = admission.mode == "sample"
        self.logical_batch = logical_batch(requested=asked.batch_size if private else None,
                                           num_examples=len(self.ctx.shard), batch_size=train_cfg.batch_size,
                                           world=self.ctx.world, private=private)
        self.dp_lr = learning_rate(requested=asked.lr, lr=train_cfg.lr, logical=self.logical_batch,
                                   batch_size=train_cfg.batch_size, world=self.ctx.world)
        key = json.dumps([config["federation-id"], model_cfg.to_flat(), labels, config["seed"], admission.mode,
                          train_cfg.batch_size, self.logical_batch], sort_keys=True)
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
        if not FEDERATION_ID.fullmatch(federation_id):
            # it names this cluster's snapshot folder: never let the server pick a path
            raise RequestError(f"federation id {federation_id!r} is not a plain name of letters, digits, '-' and '_'")
        remap = np.array([labels.index(n) for n in names], dtype=np.int64)
        self.labels = remap[self.ctx.shard.labels]
        self.federation_id = federation_id
        self.snapshots = SnapshotStore(self.ctx.state_dir / "snapshots" / federation_id)
        self.seed = int(config["seed"])
        model = build_model(model_cfg, num_labels=len(labels), seed=self.seed, path=self.ctx.model_path,
                            privacy_mode=asked.mode)
        self.peft = model.to(self.ctx.device)
        mine_fp, theirs_fp = fingerprint(model), str(config.get("frozen-fingerprint", ""))
        if mine_fp != theirs_fp:
            raise RequestError(
                f"cluster {self.ctx.cluster_id}'s frozen LoRA A (fingerprint {mine_fp[:12] or 'none'}) differs from the "
                f"server's ({theirs_fp[:12] or 'none'}): the two sides build different models; use the same model "
                "files, lora-* keys and seed on both sides"
            )
        self.mode = admission.mode
        initial = adapter_arrays(self.peft)
        if self.mode == "sample":
            self._setup_private(model_cfg, train_cfg, admission)
        else:
            self.model = (
                DistributedDataParallel(self.peft, device_ids=[self.ctx.device.index] if self.ctx.device.type == "cuda" else None)
                if self.ctx.world > 1
                else self.peft
            )
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        self.initial_optimizer_state = copy.deepcopy(self.optimizer.state_dict())
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
        self.layout = Layout.from_arrays({k: initial[k] for k in sorted(initial)})
        # the seeded initial adapter, the base of the first change the server sends (view round 0)
        self.initial_flat = self.layout.flatten(initial)
        self.setup_key = key
        self.round = None
        self.state_valid = False

    def _setup_private(self, model_cfg: ModelConfig, train_cfg: TrainConfig, admission: Admission) -> None:
        """DP-SGD over the cluster's whole shard: Opacus shards it across the ranks and Poisson-samples it."""
        from nebula_fl.privacy.sample_dp import Batches, make_private

        self.dp_data = TokenizedTexts(self.tokenizer, self.ctx.shard.texts, self.labels, max_len=model_cfg.max_seq_len)
        params = [p for p in self.peft.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        self.private = make_private(model=self.peft, optimizer=optimizer, data=self.dp_data,
                                    batch_size=self.logical_batch, physical_batch_size=train_cfg.batch_size,
                                    noise_multiplier=admission.noise_multiplier, max_grad_norm=admission.max_grad_norm,
                                    distributed=self.ctx.world > 1)
        if not math.isclose(self.private.sample_rate, admission.sample_rate, rel_tol=1e-12):
            raise RequestError(f"Opacus samples at q = {self.private.sample_rate:g} but the privacy gate admitted "
                               f"q = {admission.sample_rate:g}; this is a bug, please report it")
        self.model, self.optimizer = self.private.module, self.private.optimizer
        self.batches = Batches(self.private.loader)

    def _fresh_state(self, train_cfg: TrainConfig) -> None:
        self.optimizer.load_state_dict(copy.deepcopy(self.initial_optimizer_state))
        self.schedule = BatchSchedule(len(self.data), batch_size=train_cfg.batch_size, seed=self.seed, rank=self.ctx.rank)
        torch.manual_seed(self.seed * 1_000_003 + self.ctx.cluster_id * 1_009 + self.ctx.rank)
        if self.mode == "sample":
            self.batches.reset()
        self.state_valid = True
        self.round = 0
        self.view: np.ndarray | None = None  # the global adapter as this cluster has it (compressed downlink)
        self.view_round = -1
        self.up: Compressor | None = None  # uplink codec chain, with this cluster's error-feedback residual

    # -- snapshots ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's inner state (optimizer, batch stream, RNG, view, codec residual); never the privacy ledger."""
        assert self.round is not None
        return {
            "round": self.round,
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "rng": torch.get_rng_state(),
            "view": None if self.view is None else torch.from_numpy(self.view.copy()),
            "view_round": self.view_round,
            "up_spec": None if self.up is None else self.up.describe()["spec"],
            "up_state": None if self.up is None else _to_torch(self.up.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        torch.set_rng_state(state["rng"])
        self.round = int(state["round"])
        self.view = None if state.get("view") is None else state["view"].numpy().copy()
        self.view_round = int(state.get("view_round", -1))
        self.up = None
        if state.get("up_spec"):
            self.up = Compressor(state["up_spec"], layout=self.layout)
            self.up.load_state_dict(_to_numpy(state["up_state"]))

    def _save_snapshot(self) -> None:
        states: list[Any] = [None] * self.ctx.world
        dist.all_gather_object(states, self.state_dict(), group=self.ctx.control)
        if self.ctx.rank == 0:
            self.snapshots.save(self.round, world=self.ctx.world, ranks=states)

    def _restore_before(self, server_round: int, train_cfg: TrainConfig) -> None:
        """Make the in-memory state the one this cluster had just before `server_round`.

        In-memory state from an earlier round is current; otherwise (a fresh process, or a round trained
        but never released, e.g. the trainer died before replying) the newest snapshot before
        `server_round` is, or the initial state if there is none. Rounds already released never get
        here: the serving loop answers them from the reply cache.
        """
        if self.state_valid and self.round is not None and self.round < server_round:
            return
        self._fresh_state(train_cfg)
        newest = self.snapshots.newest_before(server_round)
        if newest is not None:
            saved = self.snapshots.load(newest)
            if saved["world"] != self.ctx.world:
                raise RequestError(
                    f"cluster {self.ctx.cluster_id} saved its state with {saved['world']} workers but runs "
                    f"{self.ctx.world} now; restart it with --workers {saved['world']}"
                )
            self.load_state_dict(saved["ranks"][self.ctx.rank])

    # -- one round ---------------------------------------------------------------------------------
    def _receive(self, config: dict[str, Any], payload: Arrays) -> tuple[Arrays, np.ndarray | None]:
        """The global adapter this round starts from: plain arrays, or a full copy / a change as one blob."""
        sync = config.get("sync")
        if sync is None:
            return payload, None
        blob = np.asarray(payload.get("blob", np.zeros(0, np.uint8)))
        if blob.dtype != np.uint8 or blob.ndim != 1:
            raise RequestError(f"the downlink blob must be 1-D uint8, got {blob.dtype} {blob.shape}")
        seed = int(config["codec-seed"])
        try:
            if sync == "delta" and blob.size == 0:  # no change since the base
                decoded = np.zeros(self.layout.size, np.float32)
            else:
                decoded = Compressor.decode(blob.tobytes(), layout=self.layout, seed=seed)
        except CodecError as err:
            raise RequestError(f"cannot decode the downlink: {err}") from None
        if sync == "full":
            view = decoded
        elif sync == "delta":
            base_round = int(config["view-round"])
            base = self.initial_flat if base_round == 0 else self.view
            if base is None or (base_round != 0 and self.view_round != base_round) or view_crc(base) != int(config["view-crc"]):
                raise RequestError(
                    f"resync needed: cluster {self.ctx.cluster_id} holds the view of round {self.view_round}, "
                    f"the server sent a change from round {base_round}"
                )
            view = (base + decoded).astype(np.float32)
        else:
            raise RequestError(f"unknown sync mode {sync!r}")
        if view_crc(view) != int(config["view-crc-after"]):
            raise RequestError("resync needed: the decoded global adapter differs from the server's")
        return self.layout.unflatten(view), view

    def _encode_up(self, update: Arrays, config: dict[str, Any]) -> Arrays:
        spec = str(config["codec-up"])
        if self.up is None or self.up.describe()["spec"] != spec:
            try:
                self.up = _retune(self.up, spec, self.layout)
            except CodecError as err:
                raise RequestError(f"cannot use uplink codec '{spec}': {err}") from None
        seed = int(config["codec-seed"])
        if "randk" not in spec:
            # random-k must share the round's seed across clusters (the same indices everywhere); every
            # other codec draws its rounding noise per cluster, so the noise averages out on the server
            seed = (seed + 7_919 * (self.ctx.cluster_id + 1)) % (2**31 - 1)
        blob = self.up.encode(self.layout.flatten(update), seed=seed)
        return {"blob": np.frombuffer(blob, dtype=np.uint8).copy()}

    def train_round(self, config: dict[str, Any], payload: Arrays, admission: Admission) -> tuple[Arrays, dict[str, Any]]:
        """Train `local-steps` from the global adapter; return (update, metrics). Same call on every rank.

        `admission` is the privacy gate's verdict (rank 0 decided it before the round reached the ranks):
        the mechanism to run, never the server's raw request.
        """
        server_round = int(config["server-round"])
        error = None
        try:
            train_cfg = TrainConfig.from_flat(config)
            self.setup(config, admission)
            self._restore_before(server_round, train_cfg)
            base_lr = self.dp_lr if self.mode == "sample" else train_cfg.lr
            for group in self.optimizer.param_groups:
                group["lr"], group["weight_decay"] = base_lr, train_cfg.weight_decay
            global_arrays, view = self._receive(config, payload)
            load_adapter_arrays(self.peft, global_arrays)
        except (NebulaError, ValueError, KeyError) as err:
            error = str(err) or type(err).__name__
        self.agree(error)

        total_rounds = int(config.get("num-server-rounds", server_round))
        total_steps = max(1, total_rounds * train_cfg.local_steps)
        done_before = (server_round - 1) * train_cfg.local_steps

        def lr_at(i: int) -> float:
            return scheduled_lr(base_lr, progress=(done_before + i) / total_steps,
                                schedule=train_cfg.lr_schedule, min_ratio=train_cfg.lr_min_ratio)

        if admission.mode != "off":
            # Every release draws fresh noise from the OS: replaying a round, or resuming, never repeats
            # (or lets anyone predict) a noise vector. Runs under DP are therefore not bit-reproducible.
            torch.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        started = time.monotonic()
        if self.mode == "sample":
            from nebula_fl.privacy.sample_dp import train_private_steps

            self.optimizer.noise_multiplier = admission.noise_multiplier
            self.optimizer.max_grad_norm = admission.max_grad_norm
            losses = train_private_steps(self.private, self.batches, steps=train_cfg.local_steps,
                                         device=self.ctx.device, lr_at=lr_at)
        else:
            losses = train_steps(
                self.model, self.optimizer, self.data, self.schedule,
                steps=train_cfg.local_steps, max_grad_norm=train_cfg.max_grad_norm, device=self.ctx.device, lr_at=lr_at,
            )
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        seconds = time.monotonic() - started
        after = adapter_arrays(self.peft)
        update = {k: (after[k] - np.asarray(global_arrays[k], dtype=np.float32)).astype(np.float32) for k in after}

        privacy_metrics: dict[str, Any] = {}
        if admission.mode == "client" and self.ctx.rank == 0:
            update, privacy_metrics = _privatize_update(update, admission)
        stats = torch.tensor([float(np.nanmean(losses)), _checksum(after)], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(self.ctx.world)]
        dist.all_gather(gathered, stats, group=self.ctx.control)
        rank_losses = [float(g[0]) for g in gathered]
        sums = [float(g[1]) for g in gathered]
        out: Arrays = update
        error = None
        encoding = time.monotonic()
        if "codec-up" in config and self.ctx.rank == 0:
            try:
                out = self._encode_up(update, config)
            except (NebulaError, ValueError) as err:
                error = str(err)
        encode_seconds = time.monotonic() - encoding
        try:
            self.agree(error)
        except RequestError:
            self.round = None  # the round trained but was not kept: restart from the last snapshot next time
            raise
        if view is not None:
            self.view, self.view_round = view, server_round
        self.round = server_round
        self._save_snapshot()
        metrics = {
            "cluster-id": self.ctx.cluster_id,
            "num-examples": len(self.ctx.shard),
            "examples-seen": int(train_cfg.local_steps * self.logical_batch),  # expected, under sample DP
            "steps": int(train_cfg.local_steps),
            "train-loss": float(np.mean(rank_losses)),
            "seconds": float(seconds),
            "encode-seconds": float(encode_seconds),
            "workers": int(self.ctx.world),
            "device": self.ctx.device.type,
            "rank-divergence": float(max(abs(s - sums[0]) for s in sums)),
        }
        if self.up is not None and self.ctx.rank == 0:
            metrics["codec-up"] = self.up.describe()["spec"]
            metrics["update-bytes"] = int(out["blob"].size) if "blob" in out else 0
        metrics.update(privacy_metrics)
        return out, metrics


def _privatize_update(update: Arrays, admission: Admission) -> tuple[Arrays, dict[str, Any]]:
    """Client-level DP: clip the update to C and add N(0, (σ C)² / shares) per entry: σ is the noise multiplier of
    what the server can see (this update alone, or under secure aggregation the sum of `shares` or more)."""
    from nebula_fl.privacy.client_dp import add_gaussian, clip_update

    clip = admission.max_grad_norm
    clipped, norm = clip_update(update, max_norm=clip)
    std = admission.noise_multiplier * clip / math.sqrt(admission.noise_shares)
    rng = np.random.default_rng(secrets.randbits(128))  # fresh OS randomness for every release
    noisy = add_gaussian(clipped, std=std, rng=rng)
    return noisy, {"update-norm-before-clip": norm, "clipped": int(norm > clip), "noise-std": std}


def _checksum(arrays: Arrays) -> float:
    """A cheap fingerprint of the adapter; ranks in sync give bit-identical sums."""
    return float(sum(float(np.abs(v).astype(np.float64).sum()) for v in arrays.values()))


def _retune(current: Compressor | None, spec: str, layout: Layout) -> Compressor:
    """The uplink compressor for `spec`: the current one re-tuned (keeping its error-feedback residual)
    when only its ratio/rank/bits changed, else a new one (another chain starts with no residual)."""
    fresh = Compressor(spec, layout=layout)
    if current is not None and fresh.param is not None:
        try:
            retuned = current.with_param(fresh.param)
        except CodecError:
            return fresh
        if retuned.spec == fresh.spec:
            return retuned
    return fresh


def _to_torch(state: Any) -> Any:
    """Codec state (NumPy arrays in nested dicts) as tensors, which torch.load(weights_only=True) accepts."""
    if isinstance(state, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(state).copy())
    if isinstance(state, dict):
        return {k: _to_torch(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return [_to_torch(v) for v in state]
    return state


def _to_numpy(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.numpy().copy()
    if isinstance(state, dict):
        return {k: _to_numpy(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_numpy(v) for v in state]
    return state
