"""The anchor of the secure-aggregation benchmark: Flower 1.42's own legacy SecAgg+, timed per round.

What a Flower user writes from Flower's secure-aggregation example: a `LegacyContext`, a legacy
`flwr.server.strategy.FedAvg`, `DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(...))` on the server
and a `NumPyClient` behind `secaggplus_mod` on each cluster. With `secure=false` the same app runs the
plain `DefaultWorkflow()`, so the two differ only in the protocol. The model is one float32 array of
`params` entries and `fit` adds a seeded pseudo-random update (no training): what is measured is the
protocol's cost. The ServerApp times each fit round (the whole fit workflow: configure_fit, the four
SecAgg+ stages or the one plain exchange, aggregate_fit), counts the serialized bytes of every message
each cluster receives and sends, checks the aggregate against the mean it must equal, and rewrites
`out-file` (JSON) after every round.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.client import NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server import LegacyContext, ServerConfig
from flwr.server.strategy import FedAvg
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, Key
from flwr.server.workflow.default_workflows import default_fit_workflow
from flwr.serverapp import Grid, ServerApp

server = ServerApp()


def update_for(partition: int, server_round: int, size: int) -> np.ndarray:
    """The update cluster `partition` adds in `server_round`: seeded, so the server can recompute the mean."""
    return np.random.default_rng([partition, server_round]).normal(0.0, 0.01, size).astype(np.float32)


# -- client ----------------------------------------------------------------------------------------
class UpdateClient(NumPyClient):
    def __init__(self, partition: int, num_examples: int) -> None:
        self.partition = partition
        self.num_examples = num_examples

    def fit(self, parameters, config):
        update = update_for(self.partition, int(config["server-round"]), parameters[0].size)
        return [parameters[0] + update.reshape(parameters[0].shape)], self.num_examples, {}


def client_fn(context: Context):
    return UpdateClient(int(context.node_config["partition-id"]), int(context.run_config["num-examples"])).to_client()


def secure_if_configured(msg: Message, context: Context, call_next):
    """`secaggplus_mod` when the run is secure; the plain path has no SecAgg+ records for it to read."""
    if context.run_config["secure"]:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


client = ClientApp(client_fn=client_fn, mods=[secure_if_configured])


# -- server ----------------------------------------------------------------------------------------
def payload_bytes(message: Message) -> int:
    """Serialized size of a message, counted as nebula-fl counts its own (nebula_fl.comm.accounting)."""
    from nebula_fl.comm.accounting import payload_bytes as count

    return count(message)


class CountingGrid:
    """The ServerApp's Grid, with each `send_and_receive` (one per SecAgg+ stage) timed and its bytes counted.

    With `poll_s` > 0 it pushes and pulls itself, pulling every `poll_s` seconds instead of Flower's fixed 3 s,
    and records each stage's pulls and the median time between two pulls (the interval really kept: the
    sleep plus one pull's round trip). The time spent counting bytes is kept apart, so the round time can
    leave it out.
    """

    def __init__(self, grid: Grid, *, poll_s: float, count_bytes: bool) -> None:
        self._grid = grid
        self.poll_s = poll_s
        self.count_bytes = count_bytes
        self.stages: list[dict[str, Any]] = []
        self.counting_s = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None):
        messages = list(messages)
        down = self._sizes(messages, lambda m: m.metadata.dst_node_id)
        started = time.perf_counter()
        pulls: list[float] = []  # when each pull started (only our own loop's; Flower's are not seen)
        replies = list(self._exchange(messages, timeout, pulls) if self.poll_s > 0 else
                       self._grid.send_and_receive(messages, timeout=timeout))
        seconds = time.perf_counter() - started
        up = self._sizes([r for r in replies if not r.has_error()], lambda m: m.metadata.src_node_id)
        gaps = [b - a for a, b in itertools.pairwise(pulls)]
        self.stages.append({"seconds": seconds, "bytes_down": down, "bytes_up": up,
                            "errors": sum(r.has_error() for r in replies),
                            "pulls": len(pulls) if self.poll_s > 0 else None,
                            "pull_interval_s": statistics.median(gaps) if gaps else None})
        return replies

    def _exchange(self, messages: list[Message], timeout: float | None, pulls: list[float]) -> list[Message]:
        pending = set(self._grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending and (deadline is None or time.monotonic() < deadline):
            pulls.append(time.perf_counter())
            got = list(self._grid.pull_messages(pending))
            replies.extend(got)
            pending.difference_update(m.metadata.reply_to_message_id for m in got)
            if pending:
                time.sleep(self.poll_s)
        return replies

    def _sizes(self, messages: list[Message], node) -> dict[str, int] | None:
        if not self.count_bytes:
            return None
        started = time.perf_counter()
        sizes: dict[str, int] = {}
        for message in messages:
            sizes[str(node(message))] = sizes.get(str(node(message)), 0) + payload_bytes(message)
        self.counting_s += time.perf_counter() - started
        return sizes


class RecordingFedAvg(FedAvg):
    """Legacy FedAvg that keeps what the last aggregate_fit received and returned."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.last: dict[str, Any] = {}

    def aggregate_fit(self, server_round, results, failures):
        parameters, metrics = super().aggregate_fit(server_round, results, failures)
        self.last = {"round": server_round, "results": len(results), "failures": len(failures),
                     "parameters": parameters}
        return parameters, metrics


class TimedFit:
    """Wraps one fit workflow (SecAgg+ or plain): times each round and rewrites the JSON record."""

    def __init__(self, fit, *, grid: CountingGrid, strategy: RecordingFedAvg, record: dict, out: Path,
                 initial: np.ndarray) -> None:
        self.fit, self.grid, self.strategy, self.record, self.out = fit, grid, strategy, record, out
        self.expected = initial.astype(np.float64)

    def __call__(self, grid, context: LegacyContext) -> None:
        server_round = int(context.state.config_records[MAIN_CONFIGS_RECORD][Key.CURRENT_ROUND])
        self.grid.stages, self.grid.counting_s = [], 0.0
        started = time.perf_counter()
        self.fit(grid, context)
        gross = time.perf_counter() - started
        last = self.strategy.last if self.strategy.last.get("round") == server_round else {}
        clusters = int(context.run_config["num-clusters"])
        self.expected += np.mean([update_for(p, server_round, self.expected.size) for p in range(clusters)], axis=0)
        error = None
        if last.get("parameters") is not None:
            got = parameters_to_ndarrays(last["parameters"])[0].astype(np.float64)
            error = float(np.max(np.abs(got - self.expected)))
            self.expected = got  # the next round starts from what the server really holds
        self.record["rounds"].append({
            "round": server_round,
            "seconds": gross - self.grid.counting_s,
            "counting_seconds": self.grid.counting_s,
            "aggregated": last.get("results", 0),
            "failures": last.get("failures", 0),
            "max_abs_error": error,
            "stages": self.grid.stages,
            "bytes_up": _per_node(self.grid.stages, "bytes_up"),
            "bytes_down": _per_node(self.grid.stages, "bytes_down"),
        })
        _write(self.out, self.record)


def _per_node(stages: list[dict], key: str) -> dict[str, int] | None:
    if any(s[key] is None for s in stages):
        return None
    total: dict[str, int] = {}
    for stage in stages:
        for node, size in stage[key].items():
            total[node] = total.get(node, 0) + size
    return total


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path)


def _wait_for_nodes(grid: Grid, count: int, timeout: float) -> None:
    """Round 1 should time the protocol, not SuperNodes still connecting."""
    deadline = time.monotonic() + timeout
    while len(list(grid.get_node_ids())) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(list(grid.get_node_ids()))} of {count} SuperNodes connected within "
                               f"{timeout:.0f} s; check the SuperNode logs")
        time.sleep(0.5)


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    clusters, params, secure = int(cfg["num-clusters"]), int(cfg["params"]), bool(cfg["secure"])
    out = Path(str(cfg["out-file"]))
    initial = np.random.default_rng(int(cfg["seed"])).normal(0.0, 0.1, params).astype(np.float32)
    strategy = RecordingFedAvg(
        fraction_fit=1.0, fraction_evaluate=0.0, min_fit_clients=clusters, min_available_clients=clusters,
        initial_parameters=ndarrays_to_parameters([initial]),
        on_fit_config_fn=lambda server_round: {"server-round": server_round},
    )
    shares = int(cfg["num-shares"]) or clusters
    threshold = int(cfg["reconstruction-threshold"]) or shares // 2 + 1
    # Flower takes an integer num_shares only above 2; the float 1.0 means "every sampled cluster".
    num_shares: int | float = 1.0 if shares == clusters and clusters < 3 else shares
    record: dict[str, Any] = {
        "secure": secure, "clusters": clusters, "params": params, "num_shares": shares if secure else None,
        "reconstruction_threshold": threshold if secure else None, "max_weight": float(cfg["max-weight"]),
        "poll_s": float(cfg["poll-s"]), "rounds": [], "done": False,
    }
    counting = CountingGrid(grid, poll_s=float(cfg["poll-s"]), count_bytes=bool(cfg["count-bytes"]))
    fit = SecAggPlusWorkflow(
        num_shares=num_shares, reconstruction_threshold=threshold, max_weight=float(cfg["max-weight"]),
        clipping_range=8.0, quantization_range=2**22, modulus_range=2**32,
    ) if secure else default_fit_workflow
    timed = TimedFit(fit, grid=counting, strategy=strategy, record=record, out=out, initial=initial)
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=int(cfg["num-server-rounds"])),
                           strategy=strategy)
    _write(out, record)
    _wait_for_nodes(grid, clusters, float(cfg["connect-timeout"]))
    DefaultWorkflow(fit_workflow=timed)(counting, legacy)
    record["done"] = True
    _write(out, record)

