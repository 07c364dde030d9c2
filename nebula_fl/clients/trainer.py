"""One worker (rank) of a cluster's persistent trainer: builds the task's model once per run, trains rounds.

What is trained is a ``Task`` (``nebula_fl/tasks/``): it builds the model, tokenises the shard, gives the loss,
and says what crosses the WAN. This file is the round loop around it: a round returns the raw update, which rank
0's pipeline (``release.py``) privatizes and encodes; what a round receives and sends (codecs, views, client-level
DP) is ``exchange.py``, what its reply says ``round_metrics.py``, the per-round snapshots ``snapshots.py``.

Every rank of the cluster runs the same calls in the same order; gradients are averaged by DDP (or FSDP), and
the few decisions that could differ between ranks (a request that fails to set up) are agreed on
through ``agree`` before any collective that could otherwise hang. Rank 0 alone answers the ClientApp
and writes the cluster's snapshots.

Inner-optimizer state (AdamW moments), the batch stream and each rank's RNG persist across rounds,
as in DiLoCo, and are snapshotted after every round this cluster trains, once its release is charged
(``commit``: write-ahead, ledger then snapshot then reply; ``snapshots.py``): a restarted trainer continues
from its newest snapshot, which the ledger always covers. What the server may ask is decided before a
round reaches the ranks, by rank 0's privacy gate and reply cache (``release.py``).
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from nebula_fl.clients.exchange import Exchange
from nebula_fl.clients.inner_loop import BatchSchedule, train_steps, warmed_lr
from nebula_fl.clients.overlap import (
    Ahead,
    Unapplied,
    ahead_usable,
    global_round_of,
    steps_ahead,
    steps_on_arrival,
)
from nebula_fl.clients.proximal import ProximalTerm, attach, prox_metrics
from nebula_fl.clients.reply_cache import FEDERATION_ID
from nebula_fl.clients.round_metrics import round_metrics
from nebula_fl.clients.snapshots import SnapshotStore
from nebula_fl.compression.compressor import Selection
from nebula_fl.config import ModelConfig, PrivacyConfig, TrainConfig
from nebula_fl.data.datasets import TextDataset
from nebula_fl.devices import DP_REFUSED, resolve_precision
from nebula_fl.errors import NebulaError
from nebula_fl.model.sharding import load_optimizer_state, local_optimizer_state, wrap
from nebula_fl.privacy.dp_recipe import learning_rate, logical_batch
from nebula_fl.privacy.policy import Admission
from nebula_fl.tasks import Task, TaskSetup, make_task, task_class
from nebula_fl.tasks.base import GlobalWeights
from nebula_fl.tasks.first_records import check_rows

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
    slowdown: float = 1.0  # emulate a slower site: each step takes this many times as long (the extra asleep)
    precision: str = "auto"  # the operator's: auto, fp32 or bf16 (nebula_fl/devices.py resolves it per mechanism)
    parallel: str = "ddp"  # "ddp": every rank holds the whole model; "fsdp": each a shard (model/sharding.py)


class RequestError(NebulaError):
    """A request this cluster refuses; every rank raises it together, and rank 0 reports it."""


class ClusterTrainer:
    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx
        self.setup_key: str | None = None
        self.round: int | None = None  # last round trained with the in-memory state; None = nothing yet
        self.federation_id = ""
        self.tokenizer = None
        self.anchor: Arrays | None = None  # overlapped rounds: the weights right after the last send
        self.ahead = Ahead()  # trained since the last send, not yet sent
        self.unapplied = Unapplied()  # overlapped rounds: this cluster's sent updates no global received holds yet
        self.global_round = 0  # the last round the global of the message being trained holds ("global-round")
        self.proximal: ProximalTerm | None = None  # `prox-mu` > 0: the pull toward the last global received
        self.last_config: dict[str, Any] | None = None  # the last round sent, and its train section parsed
        self.last_train: TrainConfig | None = None
        self.last_admission: Admission | None = None
        self.sent_at: float | None = None  # monotonic time of the last send (this process)
        self.last_rounds = 1

    # -- collectives -------------------------------------------------------------------------------
    def agree(self, error: str | None) -> None:
        """All ranks share their error (or None); if any rank failed, every rank raises the first one."""
        errors: list[str | None] = [None] * self.ctx.world
        dist.all_gather_object(errors, error, group=self.ctx.control)
        first = next((e for e in errors if e), None)
        if first:
            raise RequestError(first)

    # -- the round loop ----------------------------------------------------------------------------
    def train_round(self, config: dict[str, Any], payload: Arrays, admission: Admission) -> tuple[Arrays, dict[str, Any]]:
        """Train the round's steps from the global arrays (or, overlapped, from this cluster's own weights); return
        (the raw update, metrics). Same call on every rank; rank 0's pipeline (``release.py``) privatizes and
        encodes the update, then every rank keeps the round or drops it (`commit`).

        `admission` is the privacy gate's verdict (rank 0 decided it before the round reached the ranks):
        the mechanism to run, never the server's raw request.
        """
        server_round = int(config["server-round"])
        train_cfg, global_arrays, view = self._start_round(config, payload, admission)
        losses, seconds = self._round_steps(server_round, train_cfg, admission)
        busy_s = seconds + self.ahead.seconds
        after = self.task.exchanged(self.model_core)
        base = self.anchor if self.anchor is not None else global_arrays
        update = {k: (after[k] - np.asarray(base[k], dtype=np.float32)).astype(np.float32) for k in after}
        prox = prox_metrics(self.proximal, after=after, received=global_arrays)
        self._rebase(server_round, update, global_arrays, overlap=train_cfg.round_overlap)
        rank_losses, rank_sums = self._rank_stats(losses, after)
        since_send = self._close_round(server_round, view, config=config, train_cfg=train_cfg, admission=admission)
        metrics = round_metrics(ctx=self.ctx, steps=len(losses), logical_batch=self.logical_batch,
                                rank_losses=rank_losses, rank_sums=rank_sums, seconds=seconds,
                                precision=self.precision, busy_s=busy_s, since_send_s=since_send)
        return update, {**metrics, **prox}

    def _round_steps(self, server_round: int, train_cfg: TrainConfig, admission: Admission) -> tuple[list[float], float]:
        """The round's losses (what was trained ahead, then the steps left) and the seconds the steps left took."""
        if admission.mode != "off" and self.ahead.steps == 0:  # (trained ahead: seeded when that began)
            _fresh_noise_seed()
        started = time.monotonic()
        todo = steps_on_arrival(fixed=train_cfg.local_steps, ahead=self.ahead.steps, overlap=train_cfg.round_overlap)
        losses = self.ahead.losses + self._train(
            server_round, train_cfg, admission, first=self.ahead.steps,
            count=train_cfg.steps_cap - self.ahead.steps if todo is None else todo,
            seconds=train_cfg.round_seconds if todo is None else None)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return losses, time.monotonic() - started

    def _rebase(self, server_round: int, update: Arrays, global_arrays: Arrays, *, overlap: bool) -> None:
        """Overlapped, the progress no global holds yet is kept on the new one (clients/overlap.py): the model goes
        on from there; otherwise the next round starts from its global."""
        if overlap:
            self.unapplied.keep(server_round, update)
            self.anchor = self.unapplied.base(global_arrays, global_round=self.global_round)
            self.task.load_exchanged(self.model_core, self.anchor)
        else:
            self.anchor = None
            self.unapplied.clear()

    def _rank_stats(self, losses: list[float], after: Arrays) -> tuple[list[float], list[float]]:
        """Every rank's mean loss and weight checksum (ranks in sync give bit-identical sums)."""
        stats = torch.tensor([float(np.nanmean(losses)), _checksum(after)], dtype=torch.float64)
        gathered = [torch.zeros_like(stats) for _ in range(self.ctx.world)]
        dist.all_gather(gathered, stats, group=self.ctx.control)
        return [float(g[0]) for g in gathered], [float(g[1]) for g in gathered]

    def _close_round(self, server_round: int, view: np.ndarray | None, *, config: dict[str, Any],
                     train_cfg: TrainConfig, admission: Admission) -> float | None:
        """The round is the last trained (kept, snapshotted, only by `commit`, once rank 0 charged it); returns the
        seconds since the last one was sent (None: the first of this process)."""
        self.exchange.keep_view(view, server_round)
        self.round = server_round
        self.last_config, self.last_train, self.last_admission = config, train_cfg, admission
        self.ahead = Ahead()
        now = time.monotonic()
        since_send = None if self.sent_at is None else now - self.sent_at
        self.sent_at = now
        return since_send

    # -- training ahead (overlapped rounds) --------------------------------------------------------
    def wants_ahead(self) -> int:
        """Steps to train now, between messages (rank 0 asks): none unless the last round overlaps, its state is
        current and the run has rounds left."""
        cfg, train_cfg = self.last_config, self.last_train
        if (cfg is None or train_cfg is None or not self.state_valid or self.anchor is None or self.round is None
                or self.round >= int(cfg.get("num-server-rounds", self.round + 1))):
            return 0
        if not train_cfg.round_overlap:
            return 0
        cap = train_cfg.steps_cap
        if self.last_admission is not None and self.last_admission.mode == "sample":
            cap = min(cap, self.last_admission.steps)  # never more than the gate admitted per round
        return steps_ahead(fixed=train_cfg.local_steps, cap=cap, ahead=self.ahead.steps)

    def train_ahead(self, count: int) -> None:
        """Train `count` steps of the next round now, under the last round's config and mechanism. Same call on
        every rank; nothing is sent or charged until the next round's message (clients/overlap.py)."""
        assert self.last_train is not None and self.round is not None
        train_cfg, admission = self.last_train, self.last_admission
        if self.ahead.steps == 0:
            self.ahead.admission = admission
            if admission is not None and admission.mode != "off":
                _fresh_noise_seed()
        started = time.monotonic()
        self.ahead.losses += self._train(self.round + 1, train_cfg, admission, first=self.ahead.steps, count=count)
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        self.ahead.steps = len(self.ahead.losses)
        self.ahead.seconds += time.monotonic() - started

    def _start_round(self, config: dict[str, Any], payload: Arrays, admission: Admission):
        """Set up (once per federation), restore the state before this round, load the global arrays (overlapped,
        keep this cluster's own weights when what it trained ahead belongs to this round)."""
        error = None
        self.proximal = None
        try:
            # the server settles "auto" before it sends; a config from elsewhere gets the task's values here
            train_cfg = TrainConfig.from_flat(config).settled(task_class(str(config.get("task.name", "classify")))
                                                              .run_defaults())
            self.setup(config, admission, train_cfg=train_cfg)
            server_round = int(config["server-round"])
            self.last_rounds = int(config.get("num-server-rounds", server_round))
            why = ahead_usable(self.ahead, server_round=server_round, last_round=self.round, asked=admission,
                               cap=train_cfg.steps_cap)
            if self.ahead.steps and not train_cfg.round_overlap:
                why = "the round does not overlap"
            if why:
                if self.ctx.rank == 0:
                    print(f"trainer {self.ctx.cluster_id}: {self.ahead.steps} step(s) trained ahead set aside ({why}); "
                          "back to the last snapshot", flush=True)
                self.state_valid = False
            self._restore_before(server_round, train_cfg)
            self.base_lr = self.dp_lr if self.mode == "sample" else train_cfg.lr
            for group in self.optimizer.param_groups:
                group["lr"], group["weight_decay"] = self.base_lr, train_cfg.weight_decay
            global_arrays, view = self.exchange.receive(config, payload)
            if train_cfg.round_overlap:  # which rounds the message's global holds: the server says, never inferred
                self.global_round = global_round_of(config, server_round=server_round)
            if not train_cfg.round_overlap or self.round is None or self.round + 1 != server_round:
                self.anchor = None  # overlap carries progress over one round only: further, start from the global
            if self.ahead.steps == 0:  # else the model holds the anchor plus what was trained ahead
                self.task.load_exchanged(self.model_core, global_arrays if self.anchor is None else self.anchor)
            self.task.begin_round(self.model_core, global_weights=GlobalWeights(global_arrays, device=self.ctx.device))
            if train_cfg.prox_mu > 0:  # FedProx: pulled toward what this message brought (clients/proximal.py)
                self.proximal = self._proximal_term(global_arrays, mu=train_cfg.prox_mu)
        except (NebulaError, ValueError, KeyError) as err:
            error = str(err) or type(err).__name__
        self.agree(error)
        return train_cfg, global_arrays, view

    def _proximal_term(self, global_arrays: Arrays, *, mu: float) -> ProximalTerm:
        try:
            return ProximalTerm(params=self.task.exchanged_parameters(self.model_core), anchor=global_arrays, mu=mu)
        except ValueError as err:
            raise RequestError(f"cluster {self.ctx.cluster_id} cannot apply prox-mu = {mu:g} to task "
                               f"'{self.task.name}': {err}") from None

    def _train(self, server_round: int, train_cfg: TrainConfig, admission: Admission | None, *, first: int,
               count: int, seconds: float | None = None) -> list[float]:
        """Up to `count` steps of round `server_round`, its step `first` onwards; with `seconds`, stop once that
        much time has passed (after one step at least; rank 0's clock decides for every rank)."""
        cap = train_cfg.steps_cap
        total_steps = max(1, int(self.last_rounds) * cap)
        done_before = (server_round - 1) * cap + first

        def lr_at(i: int) -> float:
            return warmed_lr(self.base_lr, step=done_before + i, total=total_steps, warmup=train_cfg.lr_warmup_ratio,
                             schedule=train_cfg.lr_schedule, min_ratio=train_cfg.lr_min_ratio)

        pacer = Pacer(self.ctx.slowdown)
        keep_going = pacer.wrap(None if seconds is None else self._deadline(seconds))
        if count <= 0:
            return []
        if self.mode == "sample":
            from nebula_fl.privacy.sample_dp import train_private_steps

            self.optimizer.noise_multiplier = admission.noise_multiplier
            self.optimizer.max_grad_norm = admission.max_grad_norm
            losses = train_private_steps(self.private, self.batches, steps=count, device=self.ctx.device,
                                         lr_at=lr_at, keep_going=keep_going)
        else:
            losses = train_steps(self.model, self.optimizer, self.data, self.schedule, steps=count,
                                 max_grad_norm=train_cfg.max_grad_norm, device=self.ctx.device, lr_at=lr_at,
                                 loss_fn=self.task.loss, keep_going=keep_going, precision=self.precision)
        pacer.finish(len(losses))
        return losses

    def _deadline(self, seconds: float):
        """A step predicate for a time budget: true until `seconds` have passed on rank 0 (after the first step);
        rank 0's answer is broadcast, so every rank takes the same number of steps."""
        deadline = time.monotonic() + seconds

        def keep_going(done: int) -> bool:
            go = torch.tensor([int(done == 0 or time.monotonic() < deadline)], dtype=torch.int64)
            if self.ctx.world > 1:
                dist.broadcast(go, src=0, group=self.ctx.control)
            return bool(go.item())

        return keep_going

    def encode_up(self, update: Arrays, *, config: dict[str, Any]) -> Selection:
        """Rank 0: the update in the round's uplink codec (its residual is this rank's state, snapshotted by
        `commit`)."""
        return self.exchange.encode_up(update, config)

    def uplink_metrics(self, sent: Arrays) -> dict[str, Any]:
        return self.exchange.uplink_metrics(sent)

    # -- per-run setup -----------------------------------------------------------------------------
    def setup(self, config: dict[str, Any], admission: Admission, *, train_cfg: TrainConfig) -> None:
        """Build the task's model, tokenised shard and fresh inner state for a federation; no-op if unchanged.
        (`train_cfg`: the round's train section, as `_start_round` parsed it.)"""
        task_name = str(config.get("task.name", "classify"))
        model_cfg = ModelConfig.from_flat(config).settled(task_class(task_name).run_defaults())
        labels = list(config["labels"])
        asked = PrivacyConfig.from_flat(config)
        options = {k: v for k, v in config.items() if k.startswith("task.") and k != "task.name"}
        private = admission.mode == "sample"
        self.logical_batch = logical_batch(requested=asked.batch_size if private else None,
                                           num_examples=len(self.ctx.shard), batch_size=train_cfg.batch_size,
                                           world=self.ctx.world, private=private)
        self.dp_lr = learning_rate(requested=asked.lr, lr=train_cfg.lr, logical=self.logical_batch,
                                   batch_size=train_cfg.batch_size, world=self.ctx.world)
        key = json.dumps([config["federation-id"], model_cfg.to_flat(), labels, config["seed"], admission.mode,
                          train_cfg.batch_size, self.logical_batch, task_name, options], sort_keys=True)
        if key == self.setup_key:
            return
        targets = self._check_shard(task_name, labels)
        federation_id = str(config["federation-id"])
        if not FEDERATION_ID.fullmatch(federation_id):
            # it names this cluster's snapshot folder: never let the server pick a path
            raise RequestError(f"federation id {federation_id!r} is not a plain name of letters, digits, '-' and '_'")
        self.precision = resolve_precision(self.ctx.precision, device_kind=self.ctx.device.type,
                                           privacy_mode=admission.mode)
        self.task: Task = make_task(task_name, options)
        self._check_mechanism(task_name, admission)
        self.labels = _labels_as(targets, shard=self.ctx.shard, labels=labels)
        self.federation_id = federation_id
        self.snapshots = SnapshotStore(self.ctx.state_dir / "snapshots" / federation_id)
        self.seed = int(config["seed"])
        self._build_model(TaskSetup(model=model_cfg, labels=labels, seed=self.seed, path=self.ctx.model_path,
                                    privacy_mode=asked.mode, device=self.ctx.device),
                          server_fingerprint=str(config.get("frozen-fingerprint", "")))
        self.mode = admission.mode
        self.exchange = Exchange(initial=self.task.exchanged(self.model_core), cluster_id=self.ctx.cluster_id)
        self._build_optimizer(train_cfg, admission)
        self.data = self._rank_examples()
        if (report := getattr(self.data, "report", None)) is not None and self.ctx.rank == 0:  # the operator's log
            print(f"trainer {self.ctx.cluster_id}: rank 0's records at max-seq-len {model_cfg.max_seq_len}: "
                  f"{report.describe()}", flush=True)
        self.setup_key = key
        self.round = None
        self.state_valid = False

    def _check_shard(self, task_name: str, labels: list[Any]) -> str:
        """The shard fits the task (its kind of targets, returned) and the federation (every label known)."""
        targets = task_class(task_name).targets
        if self.ctx.shard.targets != targets:
            raise RequestError(
                f"cluster {self.ctx.cluster_id} read its labels as {self.ctx.shard.targets}, but task '{task_name}' "
                f"predicts {targets}; restart its trainer with --targets {targets}"
            )
        unknown = [n for n in self.ctx.shard.label_names if n not in labels]
        if unknown:
            raise RequestError(
                f"cluster {self.ctx.cluster_id} holds labels {unknown} that the federation does not know "
                f"({labels}); relabel the data or add them on the server"
            )
        return targets

    def _check_mechanism(self, task_name: str, admission: Admission) -> None:
        """The admitted privacy mechanism runs on this cluster's parallelism and the task."""
        if admission.mode == "sample" and self.ctx.parallel == "fsdp":
            raise RequestError(f"cluster {self.ctx.cluster_id}: {DP_REFUSED}")
        if admission.mode not in self.task.privacy_modes:
            raise RequestError(f"task '{task_name}' does not support privacy mode '{admission.mode}' "
                               f"(it supports {', '.join(self.task.privacy_modes)})")

    def _build_model(self, task_setup: TaskSetup, *, server_fingerprint: str) -> None:
        """The task's tokenizer and model, which must be the server's (its frozen LoRA A's fingerprint)."""
        self.task_setup = task_setup
        self.tokenizer = self.task.tokenizer(task_setup)
        self.model_core = self.task.build_model(task_setup).to(self.ctx.device)
        mine_fp = self.task.fingerprint(self.model_core)
        if mine_fp != server_fingerprint:
            raise RequestError(
                f"cluster {self.ctx.cluster_id}'s frozen LoRA A (fingerprint {mine_fp[:12] or 'none'}) differs from the "
                f"server's ({server_fingerprint[:12] or 'none'}): the two sides build different models; use the same "
                "model files, lora-* keys and seed on both sides"
            )

    def _build_optimizer(self, train_cfg: TrainConfig, admission: Admission) -> None:
        """The inner optimizer (DP-SGD's under sample DP), the proximal pull attached, its initial state kept."""
        if self.mode == "sample":
            self._setup_private(train_cfg, admission)
        else:
            self.model = wrap(self.model_core, parallel=self.ctx.parallel, device=self.ctx.device, world=self.ctx.world)
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        # every inner step adds the round's proximal gradient, if any, just before the update (clients/proximal.py)
        attach(self.optimizer, lambda: self.proximal)
        self.initial_optimizer_state = copy.deepcopy(self.optimizer.state_dict())

    def _rank_examples(self) -> Any:
        """This rank's share of the shard (a seeded split, the same on every restart), tokenised for training."""
        order = np.random.default_rng([self.seed, self.ctx.cluster_id]).permutation(len(self.labels))
        mine = np.sort(order[self.ctx.rank :: self.ctx.world])
        if len(mine) == 0:
            raise RequestError(
                f"cluster {self.ctx.cluster_id} has {len(self.labels)} examples for {self.ctx.world} workers; "
                "use fewer workers"
            )
        return self.task.examples(setup=self.task_setup, tokenizer=self.tokenizer,
                                  texts=[self.ctx.shard.texts[i] for i in mine], labels=self.labels[mine], train=True)

    def _setup_private(self, train_cfg: TrainConfig, admission: Admission) -> None:
        """DP-SGD over the cluster's whole shard: Opacus shards it across the ranks and Poisson-samples it."""
        from nebula_fl.privacy.sample_dp import Batches, make_private

        self.dp_data = self.task.examples(setup=self.task_setup, tokenizer=self.tokenizer, texts=self.ctx.shard.texts,
                                          labels=self.labels, train=True)
        check_rows(self.task, rows=len(self.dp_data), records=len(self.ctx.shard.texts), whose="this cluster's",
                   error=RequestError)
        params = [p for p in self.model_core.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=train_cfg.lr, weight_decay=train_cfg.weight_decay)
        self.private = make_private(model=self.model_core, optimizer=optimizer,
                                    data=self.task.private_examples(self.dp_data),
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
        self.exchange.reset()
        self.anchor, self.ahead = None, Ahead()
        self.unapplied.clear()

    # -- snapshots ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's inner state (optimizer, batch stream, RNG, view, codec residual); never the privacy ledger."""
        assert self.round is not None
        return {
            "round": self.round,
            "parallel": self.ctx.parallel,  # fsdp: the optimizer state below is this rank's shards
            "optimizer": local_optimizer_state(self.optimizer.state_dict()),  # sharded (fsdp): this rank's shards
            "schedule": self.schedule.state_dict(),
            **rng_state(self.ctx.device),
            "anchor": None if self.anchor is None else {k: torch.from_numpy(v.copy()) for k, v in self.anchor.items()},
            **self.unapplied.state_dict(),
            **self.exchange.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        if not set_rng_state(state, self.ctx.device) and self.ctx.rank == 0:
            print(f"trainer {self.ctx.cluster_id}: the snapshot of round {int(state['round'])} was written on "
                  f"{state.get('device', 'cpu')}, this run trains on {self.ctx.device.type}: training continues, "
                  "not bit-exactly", flush=True)
        self.round = int(state["round"])
        anchor = state.get("anchor")
        self.anchor = None if anchor is None else {k: v.numpy().copy() for k, v in anchor.items()}
        self.ahead = Ahead()
        self.unapplied.load_state_dict(state)
        self.exchange.load_state_dict(state)

    def commit(self, *, failed: str | None = None) -> None:
        """Keep the round `train_round` just trained, on every rank, or drop it: write-ahead, rank 0 charges the
        ledger first, then the snapshot is written, then the reply may leave. `failed`: rank 0's reason the round may
        not be kept (its charge failed); other ranks pass None. A round not kept (that, or a snapshot that cannot be
        written) is dropped from memory on every rank, so the next round restores the last snapshot, which the
        ledger covers: no restart, and no later round, ever continues from training that was not charged."""
        try:
            self.agree(failed)
            self.agree(self._save_snapshot())
        except RequestError:
            self.drop_state()
            raise

    def drop_state(self) -> None:
        """Forget the in-memory state: the next round starts from the newest snapshot before it."""
        self.state_valid = False
        self.ahead = Ahead()

    def _save_snapshot(self) -> str | None:
        """Every rank's state to rank 0, which writes the round's snapshot; returns why it could not (None: written)."""
        states: list[Any] = [None] * self.ctx.world
        dist.all_gather_object(states, self.state_dict(), group=self.ctx.control)
        if self.ctx.rank != 0:
            return None
        try:
            self.snapshots.save(self.round, world=self.ctx.world, ranks=states)
        except (OSError, RuntimeError) as err:  # torch.save reports a failed write as a RuntimeError
            return (f"cluster {self.ctx.cluster_id} could not write its snapshot of round {self.round} ({err}); the "
                    "round is dropped: free space in its --state-dir")
        return None

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
            parallel = saved["ranks"][self.ctx.rank].get("parallel", "ddp")
            if parallel != self.ctx.parallel and self.ctx.world > 1:
                raise RequestError(
                    f"cluster {self.ctx.cluster_id} saved its state with --parallel {parallel} but runs "
                    f"--parallel {self.ctx.parallel} now; restart it with --parallel {parallel}"
                )
            self.load_state_dict(saved["ranks"][self.ctx.rank])


def _labels_as(targets: str, *, shard: TextDataset, labels: list[Any]) -> Any:
    """The shard's labels as the task trains on them: values, texts, or class indices in the federation's order."""
    if targets == "values":
        return np.asarray(shard.labels, dtype=np.float32)
    if targets == "text":
        return shard.labels
    remap = np.array([labels.index(n) for n in shard.label_names], dtype=np.int64)
    return remap[shard.labels]


def rng_state(device: torch.device) -> dict[str, Any]:
    """The RNG streams a rank draws from: the CPU's, and its GPU's when it trains on one (dropout masks there)."""
    out: dict[str, Any] = {"rng": torch.get_rng_state(), "device": device.type}
    if device.type == "cuda":
        out["cuda_rng"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict[str, Any], device: torch.device) -> bool:
    """Restore `rng_state`'s streams; False when the snapshot was written on another kind of device (its GPU
    stream has no counterpart here, or ours none there): the run goes on, not bit-exactly."""
    torch.set_rng_state(state["rng"])
    saved_kind = state.get("device", "cpu")
    if device.type == "cuda" and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"], device)
    return saved_kind == device.type


def _fresh_noise_seed() -> None:
    """Every release draws fresh noise from the OS: replaying a round, or resuming, never repeats (or lets anyone
    predict) a noise vector. Runs under DP are therefore not bit-reproducible."""
    torch.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


class Pacer:
    """A slowdown: after each step, sleep (slowdown − 1) times that step's time, so a cluster on one shared machine
    runs as a slower site would without taking the CPU from the others (heterogeneous federations on one box)."""

    def __init__(self, slowdown: float) -> None:
        self.slowdown, self.mark, self.rested = slowdown, time.monotonic(), 0

    def _rest(self) -> None:
        time.sleep((self.slowdown - 1.0) * (time.monotonic() - self.mark))
        self.mark = time.monotonic()
        self.rested += 1

    def wrap(self, keep_going):
        """`keep_going` (or always-go) that first rests after the step before."""
        if self.slowdown <= 1.0:
            return keep_going

        def paced(done: int) -> bool:
            if done > 0:
                self._rest()
            else:
                self.mark = time.monotonic()
            return True if keep_going is None else keep_going(done)

        return paced

    def finish(self, steps: int) -> None:
        """The rest after the last step."""
        if self.slowdown > 1.0 and self.rested < steps:
            self._rest()


def _checksum(arrays: Arrays) -> float:
    """A cheap fingerprint of the adapter; ranks in sync give bit-identical sums."""
    return float(sum(float(np.abs(v).astype(np.float64).sum()) for v in arrays.values()))
