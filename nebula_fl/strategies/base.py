"""A Flower Message-API strategy whose round loop can start at round k and reports every round.

Flower's ``Strategy.start`` always begins at round 1, sleeps a fixed 3 s between pulls, and keeps no
record of who sent what. This base keeps Flower's five-method contract (configure/aggregate train and
evaluate, summary) and replaces only the loop: it polls for replies at `poll_interval`, measures the
serialized bytes of every message each way, and hands a ``RoundOutcome`` to a callback after each
round, which is where the run folder writes metrics and a checkpoint. Wrappers (compression, privacy,
secure aggregation) subclass this too, so the loop and its accounting always see the outermost,
actually-sent messages.
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from nebula_fl.comm.accounting import payload_bytes
from nebula_fl.errors import NebulaError


@dataclass
class NodeTraffic:
    """One node's part in one round, as the loop saw it."""

    bytes_down: int = 0
    bytes_up: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    elapsed_s: float | None = None  # push to reply, on the server's clock
    arrived_at: float | None = None  # wall-clock time the reply reached the SuperLink (midpoint of two polls)


@dataclass
class RoundOutcome:
    round: int
    arrays: ArrayRecord
    train_metrics: MetricRecord | None
    eval_metrics: MetricRecord | None
    nodes: dict[int, NodeTraffic]
    rejected: dict[int, str]
    seconds: float
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)  # cluster id -> what a wrapper decided
    extras: dict[str, Any] = field(default_factory=dict)  # run-level records of this round (e.g. privacy)


class StopFederation(Exception):
    """Raised by a strategy when the run should end now, cleanly (e.g. every privacy budget is spent)."""


RoundCallback = Callable[[RoundOutcome], None]
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class NebulaStrategy(Strategy):
    """Flower strategy with a resumable, accounted round loop and checkpointable state."""

    def __init__(self) -> None:
        # node id -> reason, filled by aggregate_train for replies it refused to aggregate.
        self.rejected: dict[int, str] = {}
        # message id -> destination node of the messages in flight; an error reply made by the SuperLink
        # (e.g. "node unavailable") carries the SuperLink as its source, so replies are matched by id.
        self.destinations: dict[str, int] = {}
        self.stop_reason: str | None = None  # why the run ended before its last round, if it did

    def node_of(self, reply: Message) -> int:
        """The cluster node a reply answers for, even when the SuperLink wrote it."""
        return self.destinations.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue after the last completed round."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def observe_traffic(self, traffic: dict[int, NodeTraffic]) -> None:
        """Called with each round's measured traffic before the next round is configured."""

    def round_notes(self) -> dict[str, dict[str, Any]]:
        """Per-cluster decisions of this round worth recording (e.g. an adaptive codec setting)."""
        return {}

    def round_summary(self) -> dict[str, Any]:
        """Run-level records of this round (e.g. the server's privacy accountant)."""
        return {}

    def exchange(
        self, grid: Grid, messages: Iterable[Message], *, timeout: float, poll_interval: float
    ) -> tuple[list[Message], dict[int, NodeTraffic]]:
        """Push `messages`, pull replies until all arrive or `timeout` passes; count bytes both ways."""
        messages = list(messages)
        traffic = {m.metadata.dst_node_id: NodeTraffic(bytes_down=payload_bytes(m)) for m in messages}
        ids = list(grid.push_messages(messages))
        self.destinations = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages) if mid}
        pending = set(self.destinations)
        if len(pending) < len(messages):
            log(WARNING, "%d of %d messages could not be pushed", len(messages) - len(pending), len(messages))
        replies: list[Message] = []
        pushed = time.monotonic()
        arrived: dict[str, float] = {}
        deadline = pushed + timeout
        arrived_wall: dict[str, float] = {}
        last_poll = time.time()
        while pending and time.monotonic() < deadline:
            got = list(grid.pull_messages(pending))
            replies.extend(got)
            now, wall = time.monotonic(), time.time()
            arrived.update({m.metadata.reply_to_message_id: now - pushed for m in got})
            arrived_wall.update({m.metadata.reply_to_message_id: (last_poll + wall) / 2 for m in got})
            last_poll = wall
            pending -= {m.metadata.reply_to_message_id for m in got}
            if pending:
                time.sleep(poll_interval)
        for reply in replies:
            entry = traffic.setdefault(self.node_of(reply), NodeTraffic())
            entry.elapsed_s = arrived.get(reply.metadata.reply_to_message_id)
            entry.arrived_at = arrived_wall.get(reply.metadata.reply_to_message_id)
            if reply.has_error():
                entry.error = reply.error.reason
            else:
                entry.bytes_up = payload_bytes(reply)
                if "metrics" in reply.content.metric_records:
                    entry.metrics = dict(reply.content.metric_records["metrics"])
        answered = {self.node_of(r) for r in replies}
        for node_id, entry in traffic.items():
            if node_id not in answered:
                entry.error = f"no reply within {timeout:.0f} s"
        return replies, traffic

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
        *,
        first_round: int = 1,
        evaluate_initial: bool = True,
        on_round_end: RoundCallback | None = None,
        poll_interval: float = 0.2,
    ) -> Result:
        """Run rounds `first_round`..`num_rounds`; a round with no usable update raises NebulaError."""
        if not 1 <= first_round <= num_rounds + 1:
            raise ValueError(f"first_round must be in 1..{num_rounds + 1}, got {first_round}")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result(arrays=initial_arrays)
        arrays = initial_arrays
        if evaluate_fn and evaluate_initial and first_round == 1 and (res := evaluate_fn(0, arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        for rnd in range(first_round, num_rounds + 1):
            started = time.monotonic()
            log(INFO, "[ROUND %d/%d]", rnd, num_rounds)
            self.rejected = {}
            try:
                messages = self.configure_train(rnd, arrays, train_config, grid)
            except StopFederation as stop:
                self.stop_reason = str(stop)
                log(INFO, "the run ends before round %d: %s", rnd, stop)
                break
            replies, traffic = self.exchange(grid, messages, timeout=timeout, poll_interval=poll_interval)
            new_arrays, train_metrics = self.aggregate_train(rnd, replies)
            self.observe_traffic(traffic)
            if new_arrays is None:
                reasons = "; ".join(
                    f"node {n}: {self.rejected.get(n) or t.error or 'rejected'}" for n, t in traffic.items()
                )
                raise NebulaError(f"round {rnd}: no cluster returned a usable update ({reasons or 'no clusters'})")
            arrays = result.arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            eval_messages = list(self.configure_evaluate(rnd, arrays, evaluate_config, grid))
            if eval_messages:
                eval_replies, _ = self.exchange(grid, eval_messages, timeout=timeout, poll_interval=poll_interval)
                if (agg := self.aggregate_evaluate(rnd, eval_replies)) is not None:
                    result.evaluate_metrics_clientapp[rnd] = agg
            eval_metrics = evaluate_fn(rnd, arrays) if evaluate_fn else None
            if eval_metrics is not None:
                result.evaluate_metrics_serverapp[rnd] = eval_metrics
            if on_round_end:
                on_round_end(
                    RoundOutcome(rnd, arrays, train_metrics, eval_metrics, traffic, dict(self.rejected),
                                 time.monotonic() - started, self.round_notes(), self.round_summary())
                )
        return result
