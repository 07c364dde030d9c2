"""A Flower Message-API strategy whose round loop can start at round k and reports every round.

Flower's ``Strategy.start`` always begins at round 1, sleeps a fixed 3 s between pulls, and keeps no
record of who sent what. This base keeps Flower's five-method contract (configure/aggregate train and
evaluate, summary) and replaces only the loop: it polls for replies at `poll_interval`, measures the
serialized bytes of every message each way, and hands a ``RoundOutcome`` to a callback after each
round, which is where the run folder writes metrics and a checkpoint. Wrappers (compression, privacy,
secure aggregation) subclass this too, so the loop and its accounting always see the outermost,
actually-sent messages.

Faults are part of the loop: a round with fewer usable updates than the strategy needs
(`min_updates`, from ``min-clusters``) is skipped, the global adapter unchanged, and said so; too
many skipped in a row end the run with the reasons. Which cluster a SuperNode serves is learned
from replies and, when it matters (after a resume, or when a SuperNode appears mid-run), asked
with one ``query`` message; a SuperNode replaced mid-round (restarted: a new node id for the same
cluster) is dropped from the round at once instead of waited for until the round timeout.

Stopping is part of it too: whatever a wrapper still holds when the loop ends, by its last round or by a stop
(secure aggregation's held round under round-overlap), is flushed into one more record, numbered as the round
that would have carried it (`trained` False), so the final adapter holds every round that was released.
"""

from __future__ import annotations

import copy
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from logging import ERROR, INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.supercore import log

from nebula_fl import compat
from nebula_fl.comm.accounting import payload_bytes
from nebula_fl.errors import NebulaError

MAX_SKIPPED_IN_A_ROW = 3  # more rounds in a row without enough usable updates end the run
NODE_CHECK_S = 2.0  # how often the loop looks for new SuperNodes while it waits for replies
IDENTIFY_TIMEOUT_S = 60.0
RESEND_AFTER_S = 30.0  # a node silent this long plus twice the slowest answer is sent its message again


@dataclass
class NodeTraffic:
    """One node's part in one round, as the loop saw it."""

    bytes_down: int = 0
    bytes_up: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    elapsed_s: float | None = None  # push to reply, on the server's clock
    arrived_at: float | None = None  # wall-clock time the reply reached the SuperLink (midpoint of two polls)
    pushed_at: float | None = None  # wall-clock time the round's message was handed to the SuperLink


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
    skipped: str | None = None  # why the round left the global adapter as it was, if it did
    phases: dict[str, float] = field(default_factory=dict)  # the server's share of the round, seconds per phase
    strategy_state: dict[str, Any] | None = None  # state_dict() as it was when the round ended
    measured: dict[str, Any] = field(default_factory=dict)  # what on_round_aggregated read at the round's end
    trained: bool = True  # False: no cluster trained; the record applies what was held (a flush after the loop)


class NodeDirectory:
    """Which cluster each SuperNode serves. Node ids change when a SuperNode restarts; cluster ids do not.

    Learned from replies and identify queries, shared by every wrapper of a strategy, never
    checkpointed (after a resume the nodes are new and are asked again).
    """

    def __init__(self) -> None:
        self.clusters: dict[int, str] = {}
        self.retired: dict[int, str] = {}  # node -> its cluster, for nodes another node of that cluster replaced
        # clusters sent no more rounds (their privacy stopped them): no wrapper samples them or asks them anything,
        # so no stage of a wrapper inside the one that stopped them spends a trip on them
        self.stopped: set[str] = set()

    def get(self, node: int) -> str | None:
        """The cluster `node` serves, or served before another node replaced it."""
        return self.clusters.get(node, self.retired.get(node))

    def learn(self, node: int, cluster: str) -> list[int]:
        """Record that `node` serves `cluster`; returns the other nodes it replaces (now forgotten)."""
        replaced = [n for n, c in self.clusters.items() if c == cluster and n != node]
        for n in replaced:
            self.retired[n] = self.clusters.pop(n)
        self.retired.pop(node, None)
        self.clusters[node] = cluster
        return replaced

    def known_clusters(self) -> set[str]:
        return set(self.clusters.values())


class StopFederation(Exception):
    """Raised by a strategy when the run should end now, cleanly (e.g. every privacy budget is spent)."""


FINISH_STEPS = ("evaluation", "record", "checkpoint")


class RoundFinishFailed(NebulaError):
    """A round's finish (its evaluation, record or checkpoint) failed: the run ends, naming the round and the step.
    A round callback raises it itself to name a step other than "record" (the server's checkpoint)."""

    def __init__(self, server_round: int, step: str, cause: BaseException) -> None:
        if step not in FINISH_STEPS:
            raise ValueError(f"unknown finish step {step!r}; use one of {', '.join(FINISH_STEPS)}")
        super().__init__(f"round {server_round}'s {step} failed: {type(cause).__name__}: {cause}")
        self.round, self.step = server_round, step


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
        self.directory = NodeDirectory()  # wrappers share their inner strategy's
        self.min_updates = 1  # usable updates a round needs, else it is skipped
        self.message_ttl: float | None = None  # seconds a message may wait for its SuperNode (the round timeout)
        self.last_push_s = 0.0  # how long the last push_messages call took
        self.refused_installs: set[int] = set()  # nodes whose nebula-fl was refused (said once each)

    def set_min_updates(self, count: int) -> None:
        """The usable updates the next aggregation needs; wrappers pass it to the strategy they hold."""
        self.min_updates = max(1, int(count))
        inner = getattr(self, "inner", None)
        if isinstance(inner, NebulaStrategy):
            inner.set_min_updates(self.min_updates)

    def needs_identity(self) -> bool:
        """Whether per-cluster state exists that a node must be matched to before it is sent a round."""
        inner = getattr(self, "inner", None)
        return isinstance(inner, NebulaStrategy) and inner.needs_identity()

    def learn_node(self, node: int, metrics: dict[str, Any]) -> list[int]:
        """Learn a node's cluster from a reply's metrics (its `cluster-id`), if it says; returns the nodes it replaces."""
        cid = metrics.get("cluster-id")
        if not isinstance(cid, int | float) or isinstance(cid, bool):
            return []
        if self.directory.get(node) != str(int(cid)):
            log(INFO, "node %d serves cluster %d", node, int(cid))
        return self.directory.learn(node, str(int(cid)))

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

    def note_refused(self, server_round: int, replies: list[Message]) -> None:
        """Replies an outer wrapper took out of the round (the clusters' refusals), before the round is aggregated:
        a wrapper that reads a record riding on them overrides this (secure aggregation's piggybacked unmask
        answers); the rest pass them on."""
        inner = getattr(self, "inner", None)
        if isinstance(inner, NebulaStrategy):
            inner.note_refused(server_round, replies)

    def note_last_round(self, server_round: int) -> None:
        """An outer wrapper knows `server_round` is the run's last (e.g. the privacy budget ends the run after it),
        before it is aggregated: a wrapper that holds something for the next round flushes it now (secure
        aggregation with round-overlap); the rest pass it on."""
        inner = getattr(self, "inner", None)
        if isinstance(inner, NebulaStrategy):
            inner.note_last_round(server_round)

    def held_rounds(self) -> list[int]:
        """Rounds trained whose aggregate is held for a later one (secure aggregation with round-overlap): not yet
        in the global adapter, nor released to the server; a budget check counts them as still to come."""
        inner = getattr(self, "inner", None)
        return inner.held_rounds() if isinstance(inner, NebulaStrategy) else []

    def released_rounds(self) -> list[int] | None:
        """The rounds whose sum the last aggregation (or flush) released to the server, where a wrapper hides the
        updates until then (secure aggregation); None: every update that reached the server was released."""
        inner = getattr(self, "inner", None)
        return inner.released_rounds() if isinstance(inner, NebulaStrategy) else None

    def flush(self, grid: Grid, arrays: ArrayRecord) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Apply what `held_rounds` says is held, once no round is left to carry it (the loop ended or stopped):
        (the new global adapter, or None when it could not be applied; the aggregate's metrics). `arrays` is the
        global adapter as the loop holds it."""
        inner = getattr(self, "inner", None)
        return inner.flush(grid, arrays) if isinstance(inner, NebulaStrategy) else (None, None)

    def round_notes(self) -> dict[str, dict[str, Any]]:
        """Per-cluster decisions of this round worth recording (e.g. an adaptive codec setting, or what the
        strategy recorded); a wrapper adds its own to those of the strategy it holds."""
        return {}

    def round_summary(self) -> dict[str, Any]:
        """Run-level records of this round (e.g. the server's privacy accountant, the strategy's records)."""
        return {}

    def exchange(
        self, grid: Grid, messages: Iterable[Message], *, timeout: float, poll_interval: float
    ) -> tuple[list[Message], dict[int, NodeTraffic]]:
        """Push `messages`, pull replies until all arrive or `timeout` passes; count bytes both ways.

        Meanwhile, a SuperNode that appears is asked which cluster it serves; if that cluster is one
        this round waits for under another node id, the old node was replaced (its SuperNode
        restarted, and the message it held is lost) and the round stops waiting for it. A node still
        silent long after the others answered is sent its message once more: a SuperNode restarted
        under the same node id (node authentication keeps it) lost the first copy, and the cluster
        answers a copy of a round it already trained from its reply cache, so a copy is never a
        second release.
        """
        messages = list(messages)
        for message in messages:  # a message its SuperNode picks up after the round gave up on it is dropped
            message.metadata.ttl = min(message.metadata.ttl, self.message_ttl or timeout)
        traffic = {m.metadata.dst_node_id: NodeTraffic(bytes_down=payload_bytes(m)) for m in messages}
        push_started = time.monotonic()
        ids = list(grid.push_messages(messages))
        self.last_push_s = time.monotonic() - push_started
        pushed_wall = time.time()
        for entry in traffic.values():
            entry.pushed_at = pushed_wall
        self.destinations = {mid: m.metadata.dst_node_id for mid, m in zip(ids, messages) if mid}
        sent = {m.metadata.dst_node_id: m for mid, m in zip(ids, messages) if mid}
        pending = set(self.destinations)
        if len(pending) < len(messages):
            log(WARNING, "%d of %d messages could not be pushed", len(messages) - len(pending), len(messages))
        replies: list[Message] = []
        pushed = time.monotonic()
        arrived: dict[int, float] = {}  # node -> seconds from push to its reply
        arrived_wall: dict[int, float] = {}
        deadline = pushed + timeout
        last_poll = time.time()
        seen_nodes = set(self.directory.clusters) | set(traffic)
        probes: dict[str, int] = {}  # identify query id -> node
        resent: set[int] = set()
        next_check = pushed + NODE_CHECK_S

        def stop_waiting(node: int) -> None:
            pending.difference_update([m for m in pending if self.destinations[m] == node])

        while pending and time.monotonic() < deadline:
            got = list(grid.pull_messages(pending | set(probes)))
            now, wall = time.monotonic(), time.time()
            for reply in got:  # a node that says it serves a cluster replaces any other node of that cluster
                mid = reply.metadata.reply_to_message_id
                node = probes.pop(mid) if mid in probes else self.destinations.get(mid)
                if node is None:
                    continue
                if (why := self._refused_install(node, reply)) is not None:  # never parsed, never aggregated
                    if mid in pending:
                        traffic[node].error = why
                        stop_waiting(node)
                    continue
                for old in self._identified(node, reply):
                    if any(self.destinations[m] == old for m in pending):
                        stop_waiting(old)
                        traffic[old].error = f"its SuperNode was replaced by node {node} (restarted); the round went on"
                        log(WARNING, "node %d was replaced by node %d mid-round: not waiting for it", old, node)
                if mid in pending:  # the first answer of a node counts; a copy's answer is the same bytes
                    replies.append(reply)
                    arrived[node], arrived_wall[node] = now - pushed, (last_poll + wall) / 2
                    stop_waiting(node)
            last_poll = wall
            if pending and now >= next_check:
                next_check = now + NODE_CHECK_S
                new = set(grid.get_node_ids()) - seen_nodes
                seen_nodes |= new
                if new:
                    probes.update(self._push_identify(grid, sorted(new)))
            if pending and arrived and now - pushed > RESEND_AFTER_S + 2 * max(arrived.values()):
                silent = sorted({self.destinations[m] for m in pending} - resent)
                copies = [Message(content=sent[n].content, dst_node_id=n, message_type=sent[n].metadata.message_type,
                                  ttl=max(1.0, deadline - now)) for n in silent]
                for mid, copy in zip(grid.push_messages(copies), copies):
                    if mid:
                        self.destinations[mid] = copy.metadata.dst_node_id
                        pending.add(mid)
                        traffic[copy.metadata.dst_node_id].bytes_down += payload_bytes(copy)
                resent.update(silent)
                if silent:
                    log(WARNING, "node(s) %s still silent %.0f s after the others answered: sent the round again",
                        ", ".join(map(str, silent)), now - pushed - max(arrived.values()))
            if pending:
                time.sleep(poll_interval)
        for reply in replies:
            node = self.node_of(reply)
            entry = traffic.setdefault(node, NodeTraffic())
            entry.elapsed_s, entry.arrived_at = arrived.get(node), arrived_wall.get(node)
            if reply.has_error():
                entry.error = reply.error.reason
            else:
                entry.bytes_up = payload_bytes(reply)
                if "metrics" in reply.content.metric_records:
                    entry.metrics = dict(reply.content.metric_records["metrics"])
        answered = {self.node_of(r) for r in replies}
        for node_id, entry in traffic.items():
            if node_id not in answered and entry.error is None:
                entry.error = f"no reply within {timeout:.0f} s"
        return replies, traffic

    # -- which cluster a node serves ---------------------------------------------------------------
    def _push_identify(self, grid: Grid, nodes: list[int]) -> dict[str, int]:
        messages = [Message(content=RecordDict({}), dst_node_id=n, message_type=MessageType.QUERY,
                            ttl=IDENTIFY_TIMEOUT_S) for n in nodes]
        return {mid: m.metadata.dst_node_id for mid, m in zip(grid.push_messages(messages), messages) if mid}

    def _refused_install(self, node: int, reply: Message) -> str | None:
        """Why a reply from another nebula-fl protocol (or none named) is refused, said once per node; None to take
        it. An error reply names no install: it is handled as the error it is."""
        if reply.has_error():
            return None
        said = reply.content.config_records.get(compat.RECORD)
        why = compat.refusal(dict(said) if said is not None else None, who=f"node {node}")
        if why is not None and node not in self.refused_installs:
            self.refused_installs.add(node)
            log(ERROR, "%s", why)
        return why

    def _identified(self, node: int, reply: Message) -> list[int]:
        """Learn from a reply (an identify answer or a round's): returns the nodes it replaces."""
        if reply.has_error() or "metrics" not in reply.content.metric_records:
            return []
        return self.learn_node(node, dict(reply.content.metric_records["metrics"]))

    def identify(self, grid: Grid, *, timeout: float, poll_interval: float) -> None:
        """Ask every connected node not yet matched to a cluster which one it serves (one query each)."""
        unknown = sorted(set(grid.get_node_ids()) - set(self.directory.clusters) - set(self.directory.retired))
        if not unknown:
            return
        probes = self._push_identify(grid, unknown)
        deadline = time.monotonic() + timeout
        while probes and time.monotonic() < deadline:
            for reply in grid.pull_messages(set(probes)):
                node = probes.pop(reply.metadata.reply_to_message_id)
                if self._refused_install(node, reply) is None:
                    self._identified(node, reply)
            if probes:
                time.sleep(poll_interval)
        if probes:
            log(WARNING, "%d node(s) did not say which cluster they serve within %.0f s", len(probes), timeout)

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
        overlap_evaluation: bool = False,
        on_round_aggregated: RoundCallback | None = None,
    ) -> Result:
        """Run rounds `first_round`..`num_rounds`; too many skipped rounds in a row raise NebulaError.

        `on_round_aggregated` runs on the loop's thread as soon as a round is aggregated (before the next one
        starts): counters that must be read at the round's end belong there. `on_round_end` (the record and
        the checkpoint) runs on one background thread while the next round is sent and trained, and with
        `overlap_evaluation` the round's server-side evaluation does too: they leave the critical path.
        Rounds are recorded in order; the strategy's state is copied when the round ends, so what the
        callback checkpoints is that round's state even while the next one changes it.

        Training runs at most one round ahead of the records: before round r starts, round r-2's finish has
        ended (so at most one round's finish is in flight while the next trains). A finish that failed is
        raised there (or when the loop waits for the last records) as RoundFinishFailed, naming the round and
        the step (evaluation, record or checkpoint), and no later round is recorded after it.

        When the loop ends, by its last round or a StopFederation, with a round still held (`held_rounds`), that
        round is flushed (`flush`) into one more outcome, numbered after it and with `trained` False, so the
        final adapter holds every round that was released, or its record says why one was not.
        """
        if not 1 <= first_round <= num_rounds + 1:
            raise ValueError(f"first_round must be in 1..{num_rounds + 1}, got {first_round}")
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result(arrays=initial_arrays)
        arrays = initial_arrays
        if evaluate_fn and evaluate_initial and first_round == 1 and (res := evaluate_fn(0, arrays)) is not None:
            result.evaluate_metrics_serverapp[0] = res
        skipped_in_a_row: list[str] = []
        self.message_ttl = timeout
        finisher = _RoundFinisher(result=result, evaluate_fn=evaluate_fn, on_round_end=on_round_end,
                                  on_round_aggregated=on_round_aggregated, overlap_evaluation=overlap_evaluation)
        try:
            for rnd in range(first_round, num_rounds + 1):
                finisher.settle(in_flight=1)  # round rnd-2's finish has ended; a failed one ends the run here
                started = time.monotonic()
                try:
                    outcome, reasons = self._train_round(grid, rnd, num_rounds, arrays, result, timeout=timeout,
                                                         poll_interval=poll_interval, train_config=train_config,
                                                         evaluate_config=evaluate_config)
                except StopFederation as stop:
                    self.stop_reason = str(stop)
                    log(INFO, "the run ends before round %d: %s", rnd, stop)
                    break
                if reasons is None:
                    skipped_in_a_row, arrays = [], outcome.arrays
                else:
                    skipped_in_a_row.append(f"round {rnd}: {reasons}")
                    if len(skipped_in_a_row) >= MAX_SKIPPED_IN_A_ROW:
                        raise NebulaError(
                            f"{len(skipped_in_a_row)} rounds in a row had too few usable updates "
                            f"({' | '.join(skipped_in_a_row)}); check the clusters' logs, or lower min-clusters"
                        )
                finisher.hand_over(outcome, started)
            finisher.settle(in_flight=1)
            started = time.monotonic()
            if (flushed := self._flush_round(grid, arrays, result, timeout=timeout,
                                             poll_interval=poll_interval)) is not None:
                finisher.hand_over(flushed, started)
            finisher.close(cancel=False)  # the last rounds' records
            finisher.settle(in_flight=0)
        except BaseException as err:
            finisher.close(cancel=True)  # an interrupted run still records the round it was at
            if finisher.failed and finisher.failed[0] is not err:  # the run fails for `err`; the lost record is said
                log(ERROR, "the run also failed to finish a round: %s: %s", type(finisher.failed[0]).__name__,
                    finisher.failed[0])
            raise
        return result

    def _train_round(self, grid: Grid, rnd: int, num_rounds: int, arrays: ArrayRecord, result: Result, *,
                     timeout: float, poll_interval: float, train_config: ConfigRecord,
                     evaluate_config: ConfigRecord) -> tuple[RoundOutcome, str | None]:
        """One round: configure, exchange, aggregate (and the clusters' evaluation, if any). Returns its outcome and,
        when it was skipped, the reasons per cluster; StopFederation when the strategy ends the run instead."""
        started = time.monotonic()
        log(INFO, "[ROUND %d/%d]", rnd, num_rounds)
        self.rejected = {}
        if self.needs_identity():
            self.identify(grid, timeout=min(timeout, IDENTIFY_TIMEOUT_S), poll_interval=poll_interval)
        messages = self.configure_train(rnd, arrays, train_config, grid)
        configured = time.monotonic()
        replies, traffic = self.exchange(grid, messages, timeout=timeout, poll_interval=poll_interval)
        exchanged = time.monotonic()
        new_arrays, train_metrics = self.aggregate_train(rnd, replies)
        self.observe_traffic(traffic)
        phases = {"configure_s": configured - started, "push_s": self.last_push_s,
                  "exchange_s": exchanged - configured, "aggregate_s": time.monotonic() - exchanged}
        skipped = reasons = None
        if new_arrays is None:
            reasons = "; ".join(
                f"cluster {self.directory.get(n) or f'of node {n}'}: "
                f"{self.rejected.get(n) or t.error or 'usable update'}" for n, t in traffic.items()
            ) or "no cluster was sent the round"
            metrics = dict(train_metrics or {})
            usable = int(metrics.get("clusters-usable", metrics.get("clusters", 0)))
            skipped = (f"{usable} usable update(s), fewer than the {self.min_updates} a round needs "
                       f"(min-clusters); the global adapter stays ({reasons})")
            log(WARNING, "round %d skipped: %s", rnd, skipped)
        else:
            arrays = result.arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            eval_messages = list(self.configure_evaluate(rnd, arrays, evaluate_config, grid))
            if eval_messages:
                eval_replies, _ = self.exchange(grid, eval_messages, timeout=timeout, poll_interval=poll_interval)
                if (agg := self.aggregate_evaluate(rnd, eval_replies)) is not None:
                    result.evaluate_metrics_clientapp[rnd] = agg
        outcome = RoundOutcome(rnd, arrays, train_metrics, None, traffic, dict(self.rejected), 0.0,
                               self.round_notes(), self.round_summary(), skipped, phases=phases,
                               strategy_state=copy.deepcopy(self.state_dict()))
        return outcome, reasons

    def _flush_round(self, grid: Grid, arrays: ArrayRecord, result: Result, *, timeout: float,
                     poll_interval: float) -> RoundOutcome | None:
        """The outcome of flushing what is still held when the loop ends (None when nothing is): numbered after the
        last held round, as the round that would have carried it, `trained` False; skipped, saying why, when the
        held sum could not be applied."""
        held = self.held_rounds()
        if not held:
            return None
        rnd, started = max(held) + 1, time.monotonic()
        log(INFO, "[FLUSH] round(s) %s held when the loop ended: applied now, recorded as round %d",
            ", ".join(map(str, held)), rnd)
        self.rejected = {}
        if self.needs_identity():  # after a resume with no round left, no node is known yet
            self.identify(grid, timeout=min(timeout, IDENTIFY_TIMEOUT_S), poll_interval=poll_interval)
        new_arrays, metrics = self.flush(grid, arrays)
        traffic: dict[int, NodeTraffic] = {}
        self.observe_traffic(traffic)  # the flush's own trips
        skipped = None
        if new_arrays is None:
            skipped = (f"the held round(s) {', '.join(map(str, held))} could not be applied (see this record's "
                       "not_applied); the global adapter stays")
            log(WARNING, "round %d: %s", rnd, skipped)
        else:
            arrays = result.arrays = new_arrays
            if metrics is not None:
                result.train_metrics_clientapp[rnd] = metrics
        return RoundOutcome(rnd, arrays, metrics, None, traffic, dict(self.rejected), 0.0, {}, self.round_summary(),
                            skipped, phases={"flush_s": time.monotonic() - started},
                            strategy_state=copy.deepcopy(self.state_dict()), trained=False)


class _RoundFinisher:
    """Hands each round's outcome on: `on_round_aggregated` (and the evaluation, unless overlapped) on the loop's
    thread, then the evaluation (when overlapped), record and checkpoint on one background thread, in round order.
    `settle` bounds how far training runs ahead of the records and raises the first finish that failed."""

    def __init__(self, *, result: Result, evaluate_fn: EvaluateFn | None, on_round_end: RoundCallback | None,
                 on_round_aggregated: RoundCallback | None, overlap_evaluation: bool) -> None:
        self.result, self.evaluate_fn, self.on_round_end = result, evaluate_fn, on_round_end
        self.on_round_aggregated, self.overlap_evaluation = on_round_aggregated, overlap_evaluation
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="round-finisher")  # rounds in order
        self.in_flight: deque[Future[None]] = deque()
        self.failed: list[BaseException] = []  # the first finish that failed; nothing is recorded after it

    def settle(self, *, in_flight: int) -> None:
        """Wait until at most `in_flight` finishes are still queued or running; raise the first that failed."""
        while len(self.in_flight) > in_flight:
            self.in_flight.popleft().result()
        if self.failed:
            raise self.failed[0]

    def hand_over(self, outcome: RoundOutcome, started: float) -> None:
        """The round is aggregated: measure it now, evaluate it unless overlapped, queue its finish."""
        if self.on_round_aggregated:
            self.on_round_aggregated(outcome)
        if not self.overlap_evaluation:
            self._evaluate(outcome)
            outcome.seconds = time.monotonic() - started
        self.in_flight.append(self.pool.submit(self._finish, outcome, started, time.monotonic()))

    def close(self, *, cancel: bool) -> None:
        """Wait for the finish running (an interrupted run still records the round it was at); `cancel` drops the
        queued ones."""
        self.pool.shutdown(wait=True, cancel_futures=cancel)

    def _evaluate(self, outcome: RoundOutcome) -> None:
        if outcome.skipped is not None or self.evaluate_fn is None:
            return
        t = time.monotonic()
        try:
            outcome.eval_metrics = self.evaluate_fn(outcome.round, outcome.arrays)
        except Exception as err:
            raise RoundFinishFailed(outcome.round, "evaluation", err) from err
        outcome.phases["evaluate_s"] = time.monotonic() - t
        if outcome.eval_metrics is not None:
            self.result.evaluate_metrics_serverapp[outcome.round] = outcome.eval_metrics

    def _finish(self, outcome: RoundOutcome, started: float, submitted: float) -> None:
        """Evaluate the round's adapter (when overlapped; else it was), then hand the outcome to the callback.
        A round's seconds leave out the time its finish queued behind the previous round's. A failure is kept
        for the loop to raise (a future's exception is only seen if asked for), and skips every later round's
        finish, so metrics.jsonl never holds a round after one that is missing."""
        if self.failed:
            return
        try:
            queued = time.monotonic() - submitted
            outcome.phases["finish_queued_s"] = queued
            if self.overlap_evaluation:
                self._evaluate(outcome)
                outcome.seconds = time.monotonic() - started - queued
            if self.on_round_end:
                self.on_round_end(outcome)
        except RoundFinishFailed as err:
            self.failed.append(err)
        except Exception as err:
            failure = RoundFinishFailed(outcome.round, "record", err)
            failure.__cause__ = err
            self.failed.append(failure)
        except BaseException as err:
            err.add_note(f"raised while finishing round {outcome.round} (its evaluation, record or checkpoint)")
            self.failed.append(err)
