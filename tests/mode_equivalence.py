"""Mode equivalence (issue 31, item 6): every round mode computes what it says, on a problem whose optimum is known.

The federation is the real one (``server.app.build_strategy``'s wrapper stack driven by the real round loop,
``NebulaStrategy.start``); only the transport (tests/secagg_harness.py's in-memory FakeGrid) and the model are
stand-ins. Each cluster minimises a quadratic by plain gradient descent, but everything around those steps is
the real cluster code in the trainer's order: the downlink (`Exchange.receive`), the overlap bookkeeping
(`global_round_of`, `steps_on_arrival`/`steps_ahead`, `Unapplied`), client-level DP (`privatize_update`, admitted
by a real `PrivacyGate`), the uplink codec with its error-feedback residual (`Exchange.encode_up`) and masking
(`SecAggStage`). A short NumPy simulator of each mode's *algorithm*, written from the docstrings and papers and
importing nothing of the project, gives the reference trajectory. FAULTS switch a fix off (a double count, a lost
step, a lost round) to show the comparison catches it.

    python -m tests.mode_equivalence      # the table the issue quotes
"""

from __future__ import annotations

import contextlib
import math
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from nebula_fl.clients import overlap
from nebula_fl.clients.exchange import Exchange, privatize_update
from nebula_fl.clients.outgoing import in_the_clear
from nebula_fl.clients.overlap import Ahead, Unapplied, steps_ahead, steps_on_arrival
from nebula_fl.clients.privacy_gate import PrivacyGate
from nebula_fl.clients.secagg_stage import SecAggStage
from nebula_fl.compression import Compressor
from nebula_fl.compression.randk import RandK
from nebula_fl.config import RunConfig, TrainConfig
from nebula_fl.privacy.cluster_ledger import ClusterLedger
from nebula_fl.privacy.policy import PrivacyPolicy
from nebula_fl.secagg.field import FieldCode
from nebula_fl.secagg.identity import Identity
from nebula_fl.strategies.secure_aggregation import SecAggWrapper
from tests.secagg_harness import FakeGrid

Arrays = dict[str, np.ndarray]
ROUNDS = 16
SECURE_ROUNDS = 10  # a masked round costs ~0.15 s here (keys, masks, Flower's serialisation of every message)
LONG_RUN = 400  # rounds of the reference alone, to say where an algorithm goes (it is cheap; the real run is not)
DEVIATION_TOL = 1e-6  # per round, max |real - reference| over every coordinate (relative, past |G| = 1: `gap`)
ETA = 0.3  # the clusters' inner step (`lr` of the round's config, constant schedule)
CLIP = 10.0  # client DP's clipping norm: far above any update here (checked), so it never bites
SIGMA = 1e-12  # client DP's noise multiplier: noise std sigma * CLIP = 1e-11 per coordinate
SECAGG_BITS = 64  # 2^48 levels: the field's rounding step is clip * max-weight / 2^48 (`secagg_tolerance`)
SECAGG_CLIP = 64.0  # far above any update, so a fault's divergence shows instead of saturating at the field's clip


# -- the problem ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """f_i(w) = 1/2 sum h * (w - c_i)^2 over a few small arrays: one positive diagonal curvature h shared by every
    cluster, a centre c_i each, the cluster's example count as its weight.

    Why the weighted mean w* = sum p_i c_i is FedAvg's fixed point: tau steps of gradient descent with step eta
    from w give w + a * (c_i - w), a = 1 - (1 - eta h)^tau per coordinate, the same a for every cluster (shared h,
    equal tau). The weighted mean update is a * (w* - w): zero exactly at w*, and with 0 < eta h < 2 each round
    contracts the error by (1 - a). Unequal step counts make a differ per cluster, and the plain mean's fixed point
    moves to sum p_i a_i c_i / sum p_i a_i (objective inconsistency); FedNova's (a_i / tau_i) weights undo that to
    first order in eta h, not exactly (`fixed_point`)."""

    shapes: dict[str, tuple[int, ...]]
    curvature: np.ndarray  # h, flat, in the layout's order (keys sorted, C order)
    centres: list[np.ndarray]  # c_i, flat
    weights: list[int]  # num-examples
    speeds: list[int]  # local-steps = "auto": steps each cluster fits in a round (its time budget, deterministic)
    start: np.ndarray  # the initial global adapter, flat

    @property
    def clusters(self) -> int:
        return len(self.centres)

    def arrays(self, flat: np.ndarray) -> Arrays:
        out, at = {}, 0
        for k in sorted(self.shapes):
            size = math.prod(self.shapes[k])
            out[k] = np.asarray(flat[at:at + size], np.float32).reshape(self.shapes[k])
            at += size
        return out

    @staticmethod
    def flat(arrays: Arrays) -> np.ndarray:
        return np.concatenate([np.asarray(arrays[k], np.float64).ravel() for k in sorted(arrays)])

    def optimum(self, *, equal_weights: bool = False) -> np.ndarray:
        p = np.ones(self.clusters) if equal_weights else np.asarray(self.weights, np.float64)
        return sum(pi * c for pi, c in zip(p / p.sum(), self.centres, strict=True))

    def fixed_point(self, steps: list[int], *, normalised: bool, overlapped: bool = False) -> np.ndarray:
        """FedAvg's fixed point for these step counts: sum p_i b_i c_i / sum p_i b_i, b_i = a_i (/ tau_i) (/ (1 + a_i)
        overlapped: there each cluster's anchor keeps its own last update, u_i = a_i (c_i - G - u_i) at rest)."""
        p = np.asarray(self.weights, np.float64)
        a = [1 - (1 - ETA * self.curvature) ** t for t in steps]
        b = [ai / (t if normalised else 1) / (1 + ai if overlapped else 1) for ai, t in zip(a, steps, strict=True)]
        return sum(pi * bi * c for pi, bi, c in zip(p, b, self.centres, strict=True)) / sum(
            pi * bi for pi, bi in zip(p, b, strict=True))


def make_problem(seed: int = 0) -> Problem:
    rng = np.random.default_rng(seed)
    shapes = {"a": (4,), "b": (2, 3)}
    size = sum(math.prod(s) for s in shapes.values())
    return Problem(shapes=shapes, curvature=rng.uniform(0.5, 1.5, size),
                   centres=[rng.uniform(-0.8, 0.8, size) for _ in range(3)], weights=[30, 10, 20],
                   speeds=[2, 4, 7], start=rng.uniform(-0.2, 0.2, size).astype(np.float32).astype(np.float64))


# -- the modes ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    name: str
    overlap: bool = False
    secure: bool = False
    outer: str = "fedavg"
    outer_lr: float | None = None
    steps: int | str = 4  # local-steps; "auto": time-budgeted, each cluster its `speeds` entry
    codec: str = "none"
    codec_down: str = "same"
    client_dp: bool = False
    rounds: int = ROUNDS
    blocking_lag: int | None = None
    """Rounds by which its reported global trails blocking's when the algorithm is blocking's (None: another one).
    With FedAvg (lr 1) and a local map affine in w with one slope for all clusters, the rebase makes the clusters'
    mean anchor exactly the new global, so overlapped training is blocking training; under secure aggregation the
    global is reported one round late (round n's global holds rounds <= n - 1), and the last round flushes both."""
    converge_tol: float | None = 1e-4
    """Max |G_N - optimum| after `rounds`: the algorithm's own contraction (the reference's distance) with a margin;
    None where the mode makes no convergence claim (compression's error-feedback noise floor, a finding)."""
    finding: str | None = None
    """Why the algorithm itself (the reference, LONG_RUN rounds) does not converge here, where the real run follows
    it: said in the table, and asserted (with the server's warning) in test_mode_equivalence.py."""

    def run_config(self) -> dict[str, Any]:
        flat: dict[str, Any] = {
            "num-server-rounds": self.rounds, "min-clusters": 3, "local-steps": self.steps, "max-local-steps": 8,
            "round-overlap": self.overlap, "lr": ETA, "lr-schedule": "constant", "outer-optimizer": self.outer,
            "comm.codec": self.codec, "comm.codec-down": self.codec_down, "round-timeout": 30.0}
        if self.outer_lr is not None:
            flat["outer-lr"] = self.outer_lr
        if self.secure:
            flat.update({"secagg.enabled": True, "secagg.bits": SECAGG_BITS, "secagg.clip": SECAGG_CLIP,
                         "secagg.timeout": 5.0})
        if self.client_dp:
            flat.update({"privacy.mode": "client", "privacy.noise-multiplier": SIGMA, "privacy.max-grad-norm": CLIP,
                         "privacy.accountant": "rdp"})
        return flat

    def optimum(self, problem: Problem) -> np.ndarray:
        """Client DP averages with equal weights (each cluster's influence is bounded by C): its optimum is the plain
        mean of the centres. FedNova's fixed point is its own (Problem's docstring)."""
        if self.steps == "auto":
            return problem.fixed_point(problem.speeds, normalised=True, overlapped=self.overlap)
        return problem.optimum(equal_weights=self.client_dp)


# The real runs follow their references in these modes too: the algorithm itself does not converge here.
MOMENTUM = ("the rebase carries a cluster's own updates as if the global moved by their mean (FedAvg, lr 1); a momentum "
            "optimizer moves it by more, so every anchor misses the momentum's share of the step")
STALE_VIEW = ("a cluster trains from its view, which lags the global where topk left the change behind, and its update "
              "is added to the global: a delayed step, unstable when a round's local progress is large")
BLOCKING = Mode("blocking")
MODES = [
    BLOCKING,
    Mode("round-overlap", overlap=True, blocking_lag=0),
    Mode("secure aggregation", secure=True, blocking_lag=0, rounds=SECURE_ROUNDS, converge_tol=1e-3),
    Mode("secure + overlap", secure=True, overlap=True, blocking_lag=1, rounds=SECURE_ROUNDS, converge_tol=1e-3),
    Mode("local-steps auto (FedNova)", steps="auto"),
    Mode("auto + overlap", steps="auto", overlap=True, rounds=40, converge_tol=2e-3),
    Mode("fedavgm", outer="fedavgm", rounds=60, converge_tol=4e-2),
    Mode("nesterov (DiLoCo)", outer="nesterov", rounds=24, converge_tol=1e-3),
    Mode("adam", outer="adam", outer_lr=0.05, rounds=60, converge_tol=6e-2),
    Mode("nesterov + overlap", outer="nesterov", overlap=True, rounds=40, converge_tol=2e-2),
    Mode("flwr:FedAvg", outer="flwr:FedAvg", blocking_lag=0),
    Mode("client DP, sigma 1e-12", client_dp=True),
    Mode("topk:0.3 up (EF), down none", codec="topk:0.3", codec_down="none", converge_tol=None),
    Mode("topk:0.3 up (EF) + down", codec="topk:0.3", converge_tol=None),
    Mode("topk:0.3 down only", codec_down="topk:0.3", converge_tol=None, finding=STALE_VIEW),
    Mode("fedavgm + overlap", outer="fedavgm", overlap=True, converge_tol=None, finding=MOMENTUM),
    Mode("adam + overlap", outer="adam", outer_lr=0.05, overlap=True, converge_tol=None, finding=MOMENTUM),
    Mode("secure + overlap + nesterov", outer="nesterov", secure=True, overlap=True, rounds=SECURE_ROUNDS,
         converge_tol=None, finding=MOMENTUM),
]
BY_NAME = {m.name: m for m in MODES}


# -- the cluster ----------------------------------------------------------------------------------------------------
class QuadCluster:
    """One cluster: what trainer_service.py and trainer.py do with a round, in their order, around gradient descent
    on f_i (the only stand-in; its ledger is not charged: accounting changes no update). Answers FakeGrid's train,
    query and query.secagg messages, and trains ahead after a reply, as the trainer does while it travels."""

    def __init__(self, cid: int, problem: Problem, folder: Path, roster: dict[str, str]) -> None:
        self.cid, self.problem = cid, problem
        self.h, self.c = problem.curvature, problem.centres[cid]
        self.examples = problem.weights[cid]
        self.stage = SecAggStage(state_dir=folder, cluster_id=cid, roster=roster)
        self.gate = PrivacyGate(policy=PrivacyPolicy(), ledger=ClusterLedger(path=folder / "ledger.jsonl"),
                                num_examples=self.examples)
        self.exchange = Exchange(initial=problem.arrays(problem.start), cluster_id=cid)
        self.weights: np.ndarray | None = None  # the model: flat float32, as the exchanged tensors are
        self.anchor: Arrays | None = None
        self.ahead, self.ahead_losses = Ahead(), []
        self.unapplied = Unapplied()
        self.global_round = 0
        self.round: int | None = None
        self.last: tuple[dict[str, Any], TrainConfig] | None = None
        self.norms: list[float] = []  # client DP: each update's norm before clipping (must stay under CLIP)
        self.sent: list[np.ndarray] = []  # each round's update as it went into the uplink codec, flat
        self.peak, self.field_clip = 0.0, math.inf  # secure aggregation: the largest |coordinate| masked, the clip

    # -- messages
    def answer(self, msg: Message, layout: Any) -> Message:
        kind = msg.metadata.message_type
        if kind == "query":
            return Message(RecordDict({"metrics": MetricRecord({"cluster-id": self.cid})}), reply_to=msg)
        if kind == "query.secagg":
            reply = self.stage.handle(dict(msg.content.config_records["secagg"]))
            return Message(RecordDict({"secagg": ConfigRecord(reply)}), reply_to=msg)
        reply = self._serve(msg)
        self._train_ahead()  # while the network carries the reply (clients/overlap.py)
        return reply

    def _serve(self, msg: Message) -> Message:
        """trainer_service._train: riding unmask answer, admit (masking plan, privacy gate), train, mask, reply."""
        config = dict(msg.content.config_records["config"])
        records = msg.content.array_records
        payload = {k: v.numpy() for k, v in (records["down"] if "down" in records else records["arrays"]).items()}
        riding = None
        if "secagg" in msg.content.config_records:
            riding = self.stage.answer_riding(dict(msg.content.config_records["secagg"]))
        plan = self.stage.prepare(config) if "secagg-epoch" in config else None
        admission = self.gate.admit(config, world=1, secure_threshold=None if plan is None else plan.threshold)
        assert admission.allowed, admission.reason
        update, metrics = self.train_round(config, payload, admission)
        if plan is not None:  # release.Release._mask
            seed = int(config["codec-seed"])
            dense = Compressor.decode(update["blob"].tobytes(), layout=self.exchange.layout, seed=seed)
            first = self.exchange.up.stages[0]
            values = dense[first.positions(dense.size, seed)] if isinstance(first, RandK) else dense
            self.peak, self.field_clip = max(self.peak, float(np.abs(values).max())), plan.code.clip
            weight = 1 if admission.mode == "client" else min(self.examples, plan.code.max_weight)
            update = {"blob": self.stage.mask(plan, values=values, weight=weight)}
            metrics["secagg-keys-held"] = int(self.stage.holds_keys(plan.federation, plan.epoch))
            metrics = in_the_clear(metrics, mode=admission.mode)
        numbers = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        content = RecordDict({"update": ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in update.items()}),
                              "metrics": MetricRecord(numbers)})
        if riding is not None:
            content["secagg"] = ConfigRecord(riding)
        return Message(content, reply_to=msg)

    # -- trainer.ClusterTrainer.train_round, step by step
    def train_round(self, config: dict[str, Any], payload: Arrays, admission) -> tuple[Arrays, dict[str, Any]]:
        server_round = int(config["server-round"])
        train_cfg = TrainConfig.from_flat(config)
        global_arrays, view = self.exchange.receive(config, payload)  # _start_round
        if train_cfg.round_overlap:
            self.global_round = overlap.global_round_of(config, server_round=server_round)
        if not train_cfg.round_overlap or self.round is None or self.round + 1 != server_round:
            self.anchor = None
        if self.ahead.steps == 0:
            start = global_arrays if self.anchor is None else self.anchor
            self.weights = Problem.flat(start).astype(np.float32)
        todo = steps_on_arrival(fixed=train_cfg.local_steps, ahead=self.ahead.steps, overlap=train_cfg.round_overlap)
        count = self._budget(train_cfg.steps_cap - self.ahead.steps) if todo is None else todo
        losses = self.ahead_losses + self._steps(count, train_cfg.lr)
        after = self.problem.arrays(self.weights)
        base = self.anchor if self.anchor is not None else global_arrays
        update = {k: (after[k] - np.asarray(base[k], dtype=np.float32)).astype(np.float32) for k in after}
        if train_cfg.round_overlap:
            self.unapplied.keep(server_round, update)
            self.anchor = self.unapplied.base(global_arrays, global_round=self.global_round)
            self.weights = Problem.flat(self.anchor).astype(np.float32)
        else:
            self.anchor = None
            self.unapplied.clear()
        privacy: dict[str, Any] = {}
        if admission.mode == "client":
            update, privacy = privatize_update(update, admission)
            self.norms.append(float(privacy["update-norm-before-clip"]))
        self.sent.append(Problem.flat(update))
        out = {"blob": np.frombuffer(self.exchange.encode_up(update, config).blob, dtype=np.uint8).copy()}
        self.exchange.keep_view(view, server_round)
        self.round, self.last = server_round, (config, train_cfg)
        self.ahead, self.ahead_losses = Ahead(), []
        metrics = {"cluster-id": self.cid, "num-examples": self.examples, "examples-seen": len(losses),
                   "steps": len(losses), "train-loss": float(np.mean(losses)), "seconds": 0.0, "encode-seconds": 0.0,
                   "workers": 1, "device": "cpu", "precision": "fp32", "parallel": "ddp", "rank-divergence": 0.0,
                   "busy-seconds": 0.0, "codec-up": self.exchange.up.describe()["spec"],
                   "update-bytes": int(out["blob"].size), **privacy}
        return out, metrics

    def _train_ahead(self) -> None:
        """trainer.wants_ahead / train_ahead: the next round's steps from the anchor, until its message comes."""
        if self.last is None or self.anchor is None:
            return
        config, train_cfg = self.last
        if not train_cfg.round_overlap or self.round >= int(config.get("num-server-rounds", self.round + 1)):
            return
        while (count := steps_ahead(fixed=train_cfg.local_steps, cap=train_cfg.steps_cap, ahead=self.ahead.steps)):
            if train_cfg.local_steps is None and self.ahead.steps >= self._budget(train_cfg.steps_cap):
                break  # time-budgeted: the next message arrives now
            self.ahead_losses += self._steps(count, train_cfg.lr)
            self.ahead.steps = len(self.ahead_losses)

    def _budget(self, cap: int) -> int:
        """Steps a time-budgeted round fits: this cluster's speed (deterministic stand-in for its clock)."""
        return min(cap, self.problem.speeds[self.cid])

    def _steps(self, count: int, eta: float) -> list[float]:
        """`count` gradient-descent steps on f_i, float32 weights; the loss before each."""
        losses = []
        for _ in range(count):
            w = self.weights.astype(np.float64)
            losses.append(float(0.5 * np.sum(self.h * (w - self.c) ** 2)))
            self.weights = (w - eta * self.h * (w - self.c)).astype(np.float32)
        return losses


# -- the real run ----------------------------------------------------------------------------------------------------
@dataclass
class Run:
    globals: list[np.ndarray]  # the global adapter the loop holds after each trained round, flat
    final: np.ndarray | None = None  # the run's final adapter (after a flush of a held round, if the loop made one)
    flushed: list[int] = field(default_factory=list)  # records of a flush after the loop (`trained` False)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    clusters: list[QuadCluster] = field(default_factory=list)
    strategy: Any = None


def run_real(mode: Mode, problem: Problem, folder: Path) -> Run:
    """The mode's rounds of the real loop over the stack the server app builds, QuadClusters behind a FakeGrid."""
    from nebula_fl.server.app import build_strategy
    from nebula_fl.strategies.adapter_strategy import to_record

    rounds = mode.rounds
    cfg = RunConfig.from_flat({**RunConfig().to_flat(), **mode.run_config()})
    initial = problem.arrays(problem.start)
    strategy = build_strategy(cfg, initial=initial)
    roster = {str(i): Identity.load_or_create(folder / f"c{i}" / "secagg").public for i in range(problem.clusters)}
    clusters = [QuadCluster(i, problem, folder / f"c{i}", roster) for i in range(problem.clusters)]
    grid = FakeGrid(clusters, clusters[0].exchange.layout)
    train_config = ConfigRecord({**cfg.train.to_flat(), **cfg.privacy.to_flat(), "federation-id": "equivalence",
                                 "seed": cfg.federation.seed, "num-server-rounds": rounds})
    run = Run(globals=[], clusters=clusters, strategy=strategy)

    def aggregated(outcome) -> None:
        assert outcome.skipped is None, f"{mode.name}: round {outcome.round} skipped: {outcome.skipped}"
        arrays = Problem.flat({k: v.numpy() for k, v in outcome.arrays.items()})
        if getattr(outcome, "trained", True):
            run.globals.append(arrays)
            run.metrics.append(dict(outcome.train_metrics or {}))
        else:
            run.flushed.append(outcome.round)
        run.final = arrays

    strategy.start(grid, to_record(initial), num_rounds=rounds, timeout=cfg.federation.round_timeout,
                   train_config=train_config, evaluate_initial=False, poll_interval=0.0,
                   on_round_aggregated=aggregated)
    return run


# -- the reference ---------------------------------------------------------------------------------------------------
def _outer(name: str, lr: float | None) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The outer step G <- step(G, d), d the round's mean update, each from its paper.

    fedavg (McMahan 2017): G + lr d. fedavgm (Hsu 2019): v = m v + d, G + lr v. nesterov (DiLoCo, Douillard 2023;
    PyTorch's Nesterov SGD on the outer gradient g = -d): b = m b + g, G - lr (g + m b). adam (FedAdam, Reddi 2021):
    bias-corrected moments of g = -d, G - lr m_hat / (sqrt(v_hat) + eps). flwr:FedAvg: Flower's FedAvg averages the
    trained weights G + u_i, which is G + d."""
    state: dict[str, Any] = {"t": 0}
    m, b1, b2, eps = 0.9, 0.9, 0.99, 1e-6

    def step(g: np.ndarray, d: np.ndarray) -> np.ndarray:
        if name in ("fedavg", "flwr:FedAvg"):
            return g + (1.0 if lr is None else lr) * d
        if name == "fedavgm":
            state["v"] = d if "v" not in state else m * state["v"] + d
            return g + (1.0 if lr is None else lr) * state["v"]
        if name == "nesterov":
            grad = -d
            state["b"] = grad if "b" not in state else m * state["b"] + grad
            return g - (0.7 if lr is None else lr) * (grad + m * state["b"])
        if name == "adam":
            grad, state["t"] = -d, state["t"] + 1
            state["m"] = b1 * state.get("m", 0.0) + (1 - b1) * grad
            state["v"] = b2 * state.get("v", 0.0) + (1 - b2) * grad * grad
            m_hat, v_hat = state["m"] / (1 - b1 ** state["t"]), state["v"] / (1 - b2 ** state["t"])
            return g - (0.01 if lr is None else lr) * m_hat / (np.sqrt(v_hat) + eps)
        raise ValueError(name)

    return step


def _topk(x: np.ndarray, ratio: float) -> np.ndarray:
    """x on its k = ceil(ratio n) largest magnitudes (ties to the lowest index), zero elsewhere."""
    k = min(x.size, max(1, math.ceil(ratio * x.size)))
    keep = np.argsort(-np.abs(x), kind="stable")[:k]
    out = np.zeros_like(x)
    out[keep] = x[keep]
    return out


def reference(mode: Mode, problem: Problem, *, rounds: int | None = None) -> list[np.ndarray]:
    """The global after each round, as the mode's algorithm defines it (float64, no project code).

    blocking: every cluster trains tau steps from G, the server steps G with the weighted mean update.
    overlap (clients/overlap.py): round n's message holds every round <= k (k = n - 1; k = n - 2 under secure
    aggregation, whose round n - 1 sum is applied on round n); a cluster sends u_n = W - A, then W = A = G +
    its own u_r for k < r <= n, and trains the next round's tau steps from there before the next message.
    secure + overlap: the server applies round n - 1's mean on round n, and the last round's at once as well.
    auto: FedNova (Wang 2020): each update times tau_eff / tau_i, tau_eff = sum p_i tau_i.
    client DP: equal weights, clip C (never reached here), noise sigma C ~ 0.
    compression: the uplink sends topk(u + r) and keeps r = u + r - sent (error feedback); the downlink sends each
    cluster topk(G - V_i) of the change since its view V_i, which it trains from."""
    rounds = mode.rounds if rounds is None else rounds
    n = problem.clusters
    p = np.ones(n) if mode.client_dp else np.asarray(problem.weights, np.float64)
    p = p / p.sum()
    taus = problem.speeds if mode.steps == "auto" else [int(mode.steps)] * n
    scale = [1.0] * n if len(set(taus)) == 1 else [float(np.dot(p, taus)) / t for t in taus]
    late = mode.secure and mode.overlap
    down = mode.codec if mode.codec_down == "same" else mode.codec_down

    def ratio_of(spec: str) -> float | None:
        return float(spec.partition(":")[2]) if spec.startswith("topk") else None

    up_ratio, down_ratio = ratio_of(mode.codec), ratio_of(down)
    step = _outer(mode.outer, mode.outer_lr)

    def descend(w: np.ndarray, i: int, steps: int) -> np.ndarray:
        for _ in range(steps):
            w = w - ETA * problem.curvature * (w - problem.centres[i])
        return w

    g = problem.start.astype(np.float64)
    views = [g.copy() for _ in range(n)]
    residual = [np.zeros_like(g) for _ in range(n)]
    kept: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
    ahead: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n
    pending, out = None, []
    for r in range(1, rounds + 1):
        k = max(0, r - 2) if late else r - 1
        sent = []
        for i in range(n):
            if down_ratio is not None:
                views[i] = views[i] + _topk(g - views[i], down_ratio)
            received = views[i] if down_ratio is not None else g
            base, w = ahead[i] if mode.overlap and ahead[i] is not None else (received, descend(received, i, taus[i]))
            u = w - base
            if mode.overlap:
                kept[i] = {q: v for q, v in {**kept[i], r: u}.items() if q > k}
                anchor = received + sum(kept[i][q] for q in sorted(kept[i]))
                ahead[i] = (anchor, descend(anchor, i, taus[i])) if r < rounds else None
            if up_ratio is not None:
                x = u + residual[i]
                u = _topk(x, up_ratio)
                residual[i] = x - u
            sent.append(u)
        mean = sum(pi * s * u for pi, s, u in zip(p, scale, sent, strict=True))
        if late:
            if pending is not None:
                g = step(g, pending)
            pending = mean
            if r == rounds:
                g, pending = step(g, pending), None
        else:
            g = step(g, mean)
        out.append(g.copy())
    return out


# -- faults the harness must catch -----------------------------------------------------------------------------------
def _old_global_round(config: dict[str, Any], *, server_round: int) -> int:
    """The behaviour before the fix: `global-round` ignored, the global taken to hold every round before this one."""
    return server_round - 1


def _base_without_kept(self: Unapplied, new_global: Arrays, *, global_round: int) -> Arrays:
    """A rebase that drops the cluster's kept updates: the progress no global holds yet is lost."""
    self.decided(global_round)
    return overlap.rebased(new_global)


def _never_last(original: Callable) -> Callable:
    """SecAggWrapper.configure_train that never learns which round is the run's last, so the last round is held
    like any other instead of unmasked at once (`_aggregate_overlapped`)."""

    def configure_train(self, server_round, arrays, config, grid):
        out = original(self, server_round, arrays, config, grid)
        self.num_rounds = 1 << 30
        return out

    return configure_train


def _last_round_flush_off() -> list[tuple[Any, str, Any]]:
    return [(SecAggWrapper, "configure_train", _never_last(SecAggWrapper.configure_train)),
            (SecAggWrapper, "note_last_round", lambda self, server_round: None)]


def _every_flush_off() -> list[tuple[Any, str, Any]]:
    """The last round's flush off, and the loop's flush of a round still held when it ends (where the loop has one:
    `held_rounds` says nothing is held, so the held round is dropped without a word)."""
    extra = [(SecAggWrapper, "held_rounds", lambda self: [])] if hasattr(SecAggWrapper, "held_rounds") else []
    return _last_round_flush_off() + extra


FAULTS: dict[str, Callable[[], list[tuple[Any, str, Any]]]] = {
    "double count": lambda: [(overlap, "global_round_of", _old_global_round)],
    "lost step": lambda: [(Unapplied, "base", _base_without_kept)],
    "lost round": _every_flush_off,
    "last-round flush off": _last_round_flush_off,  # not a fault where the loop flushes what is held after it ends
}
# (mode, fault, rounds): a lost round is seen best early, while a round's update is still large; divergence late
FAULT_RUNS = [("secure + overlap", "double count", ROUNDS), ("secure + overlap", "lost step", SECURE_ROUNDS),
              ("round-overlap", "lost step", ROUNDS), ("secure + overlap", "lost round", 6),
              ("secure + overlap", "last-round flush off", 6)]


@contextlib.contextmanager
def fault(name: str | None) -> Iterator[None]:
    """The fault switched on (for the table; the tests use pytest's monkeypatch with the same FAULTS)."""
    with contextlib.ExitStack() as stack:
        for target, attribute, value in (FAULTS[name]() if name else []):
            stack.enter_context(mock.patch.object(target, attribute, value))
        yield


# -- comparison ------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    mode: str
    fault: str | None
    rounds: int
    deviation: float  # max over the rounds' records of max |real - reference|
    final_deviation: float  # the run's final adapter (after any flush) against the reference's last global
    from_blocking: float | None  # the same against blocking's run, where the algorithm is blocking's
    distance: float  # max |final adapter - the mode's optimum|
    distances: list[float]  # after each round's record
    run: Run
    long_run: float | None = None  # the reference's max |G - optimum| after LONG_RUN rounds (no fault): where it goes


def secagg_tolerance(problem: Problem, *, rounds: int = ROUNDS) -> float:
    """What the field encoding can add to a trajectory: each round's mean is off by at most n * step / sum w (one
    stochastic rounding step of w x per upload), and a contraction never amplifies it; bounded over all rounds."""
    code = FieldCode(bits=SECAGG_BITS, clip=SECAGG_CLIP, max_weight=100_000, clusters=problem.clusters)
    return rounds * problem.clusters * code.step / sum(problem.weights)


def gap(real: np.ndarray, want: np.ndarray) -> float:
    """max |real - want|, relative to max(1, max |want|): float32 weights carry 7 digits, and a diverging mode's grow."""
    return float(np.abs(real - want).max()) / max(1.0, float(np.abs(want).max()))


def compare(mode: Mode, problem: Problem, folder: Path, *, blocking: Run | None = None,
            fault_name: str | None = None) -> Row:
    """The mode's real run against its reference (and blocking's run, where the algorithm is the same)."""
    rounds = mode.rounds
    with fault(fault_name):
        run = run_real(mode, problem, folder)
    want = reference(mode, problem)
    assert len(run.globals) == rounds, f"{mode.name}: {len(run.globals)} rounds recorded of {rounds}"
    deviation = max(gap(a, b) for a, b in zip(run.globals, want, strict=True))
    final_deviation = gap(run.final, want[-1])
    from_blocking = None
    if blocking is not None and mode.blocking_lag is not None and len(blocking.globals) >= rounds:
        lag = mode.blocking_lag  # round n reports blocking's round n - lag; the last round is flushed to blocking's
        pairs = [(run.globals[r], blocking.globals[r - lag]) for r in range(lag, rounds - 1)]
        pairs.append((run.final, blocking.globals[rounds - 1]))
        from_blocking = max(gap(a, b) for a, b in pairs)
    optimum = mode.optimum(problem)
    distances = [float(np.abs(g - optimum).max()) for g in run.globals]
    long_run = None if fault_name else float(np.abs(reference(mode, problem, rounds=LONG_RUN)[-1] - optimum).max())
    return Row(mode.name, fault_name, rounds, deviation, final_deviation, from_blocking,
               float(np.abs(run.final - optimum).max()), distances, run, long_run)


def table(rows: list[Row]) -> str:
    head = (f"{'mode':<28} {'fault switched on':<36} {'N':>3} {'dev ref/round':>13} {'dev ref final':>13} "
            f"{'dev blocking':>12} {'|G_N - w*|':>10} {f'ref @{LONG_RUN}':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        blocking = "-" if r.from_blocking is None else f"{r.from_blocking:.1e}"
        long_run = "-" if r.long_run is None else f"{r.long_run:.1e}"
        flushed = f" (+flush rec {r.run.flushed[0]})" if r.run.flushed else ""
        lines.append(f"{r.mode:<28} {(r.fault or 'none') + flushed:<36} {r.rounds:>3} {r.deviation:>13.1e} "
                     f"{r.final_deviation:>13.1e} {blocking:>12} {r.distance:>10.1e} {long_run:>9}")
    return "\n".join(lines)


def notes(problem: Problem) -> str:
    def off(x: np.ndarray) -> str:
        return f"{float(np.abs(x - problem.optimum()).max()):.2f}"

    return "\n".join([
        f"{problem.clusters} clusters (weights {problem.weights}), {problem.start.size} coordinates, h in [0.5, 1.5], "
        f"eta {ETA}, 4 local steps (auto: {problem.speeds}).",
        f"dev: max over coordinates of |real - reference| (and against blocking's run where the algorithm is blocking's);"
        f" tolerance {DEVIATION_TOL:g}. Secure aggregation's {SECAGG_BITS}-bit field adds at most "
        f"{secagg_tolerance(problem):.1e}.",
        "w*: the weighted mean of the centres; client DP: their plain mean (equal weights); FedNova: its own fixed "
        f"point, {off(problem.fixed_point(problem.speeds, normalised=True))} from the weighted mean (the plain mean of "
        f"unequal steps: {off(problem.fixed_point(problem.speeds, normalised=False))}); auto + overlap: "
        f"{off(problem.fixed_point(problem.speeds, normalised=True, overlapped=True))}.",
        "ref @400: the reference alone, 400 rounds: where the algorithm goes (the real run follows it for N).",
    ])


def main() -> int:
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 0  # Flower stamps messages with it
    problem = make_problem()
    started = time.monotonic()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        blocking = None
        for i, mode in enumerate(MODES):
            row = compare(mode, problem, Path(tmp) / f"m{i}", blocking=blocking)
            blocking = blocking or row.run
            rows.append(row)
        for i, (name, fault_name, rounds) in enumerate(FAULT_RUNS):
            mode = replace(BY_NAME[name], rounds=rounds)
            rows.append(compare(mode, problem, Path(tmp) / f"f{i}", blocking=blocking, fault_name=fault_name))
    print(table(rows))
    print(notes(problem))
    print(f"{len(rows)} runs in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
