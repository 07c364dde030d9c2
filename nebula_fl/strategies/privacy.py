"""Differential privacy as a wrapper: budgets, exhausted clusters and the server-side accountant.

Sample-level DP ('sample') happens inside each cluster (Opacus, in its trainer); the cluster keeps
its own ledger and refuses a round that would carry it past `privacy.max-epsilon`. This wrapper
takes such a refusal as final for that cluster: it stops sending it rounds, records where and why
it stopped, and ends the run cleanly once no cluster with budget is left.

Client-level DP ('client'): every cluster clips its update to C and adds Gaussian noise before the
update leaves it; the accountant is here, one sampled Gaussian mechanism per round (q = the share
of clusters sampled). Each message says how many shares the noise is split into: 1 now (each
update carries the full sigma C on its own, so even the server sees only noised updates); with
secure aggregation each of the n sampled clusters adds 1/n of the variance and the sum carries the
full sigma C. Updates are averaged with equal weights: the sensitivity is C per cluster, whatever
its size.
"""

from __future__ import annotations

from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message.message import make_message
from flwr.serverapp import Grid
from flwr.supercore import log

from nebula_fl.config import PrivacyConfig
from nebula_fl.strategies.adapter_strategy import METRICS_KEY, WEIGHT_KEY
from nebula_fl.strategies.base import NebulaStrategy, NodeTraffic, StopFederation


class PrivacyWrapper(NebulaStrategy):
    def __init__(self, inner: NebulaStrategy, *, cfg: PrivacyConfig, num_rounds: int, clusters: int) -> None:
        super().__init__()
        if cfg.mode == "off":
            raise ValueError("PrivacyWrapper needs privacy.mode 'sample' or 'client'")
        self.inner, self.cfg = inner, cfg
        self.num_rounds, self.clusters = num_rounds, clusters
        self.exhausted: dict[str, dict[str, Any]] = {}  # cluster -> {"round", "reason", "epsilon"}
        self.node_cluster: dict[int, str] = {}
        self.round_clusters: set[str] = set()
        self.notes: dict[str, dict[str, Any]] = {}
        self.current: ArrayRecord | None = None
        self.server_ledger = None
        self.sigma: float | None = None
        if cfg.mode == "client":
            self._setup_client_dp()

    def _setup_client_dp(self) -> None:
        from nebula_fl.privacy.budget import noise_for_target
        from nebula_fl.privacy.client_dp import ServerDPAccountant

        self.delta = self.cfg.delta if self.cfg.delta is not None else 1.0 / (10 * self.clusters)
        self.server_ledger = ServerDPAccountant(accountant=self.cfg.accountant, delta=self.delta)
        self.sample_rate = 1.0  # every connected cluster is sampled each round unless clusters-per-round says less
        self.sigma = self.cfg.noise_multiplier
        if self.sigma is None:
            self.sigma = noise_for_target(target_epsilon=self.cfg.target_epsilon, delta=self.delta,
                                          sample_rate=self.sample_rate, steps=self.num_rounds,
                                          accountant=self.cfg.accountant)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "exhausted": self.exhausted,
                "server_ledger": None if self.server_ledger is None else self.server_ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.exhausted = {str(k): dict(v) for k, v in state.get("exhausted", {}).items()}
        if self.server_ledger is not None and state.get("server_ledger"):
            self.server_ledger.load_state_dict(state["server_ledger"])

    def summary(self) -> None:
        log(INFO, "\t├──> differential privacy: %s, clip %s, accountant %s, budget %s", self.cfg.mode,
            self.cfg.max_grad_norm, self.cfg.accountant, self.cfg.max_epsilon or "none")
        self.inner.summary()

    def report(self) -> dict[str, Any]:
        """What summary.json says about privacy."""
        out: dict[str, Any] = {"mode": self.cfg.mode, "accountant": self.cfg.accountant,
                               "max_epsilon": self.cfg.max_epsilon,
                               "clusters": {cid: {"stopped_round": e["round"], "reason": e["reason"],
                                                  "epsilon": e.get("epsilon")}
                                            for cid, e in self.exhausted.items()}}
        if self.server_ledger is not None:
            out["client"] = self.server_ledger.metrics_entry()
        return out

    # -- rounds ----------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.current = arrays
        self.notes = {}
        if self.server_ledger is not None and self.cfg.max_epsilon is not None:
            after = self.server_ledger.epsilon_after(noise_multiplier=self.sigma, sample_rate=self.sample_rate, steps=1)
            if after > self.cfg.max_epsilon:
                raise StopFederation(
                    f"the federation's client-level budget ε ≤ {self.cfg.max_epsilon} would be exceeded "
                    f"({self.server_ledger.epsilon():.3f} now, {after:.3f} after round {server_round})"
                )
        cfg = ConfigRecord(dict(config))
        if self.sigma is not None:
            cfg["privacy-sigma"] = float(self.sigma)
            cfg["privacy-noise-shares"] = 1
        messages = [m for m in self.inner.configure_train(server_round, arrays, cfg, grid)
                    if self.node_cluster.get(m.metadata.dst_node_id) not in self.exhausted]
        if not messages:
            raise StopFederation(f"every cluster has spent its privacy budget (ε ≤ {self.cfg.max_epsilon})")
        return messages

    def _refusal(self, reply: Message) -> tuple[str, dict[str, Any]] | None:
        if reply.has_error() or METRICS_KEY not in reply.content.metric_records:
            return None
        metrics = dict(reply.content.metric_records[METRICS_KEY])
        if "cluster-id" in metrics:
            self.node_cluster[self.node_of(reply)] = str(int(metrics["cluster-id"]))
        if not metrics.get("privacy-refused"):
            return None
        notes = dict(reply.content.config_records["notes"]) if "notes" in reply.content.config_records else {}
        return str(int(metrics["cluster-id"])), {"epsilon": metrics.get("epsilon"), **notes}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        passed = []
        for reply in replies:
            refused = self._refusal(reply)
            if refused is None:
                passed.append(self._equal_weight(reply) if self.cfg.mode == "client" else reply)
                continue
            cluster, info = refused
            reason = info.get("privacy-reason", "its privacy budget would be exceeded")
            self.exhausted[cluster] = {"round": server_round, "reason": reason, "epsilon": info.get("epsilon")}
            self.notes[cluster] = {"privacy_refused": True, "privacy_reason": reason}
            log(WARNING, "round %d: cluster %s stops: %s", server_round, cluster, reason)
        self.inner.destinations = self.destinations
        self.inner.rejected = {}
        if not passed:  # every sampled cluster refused: the global adapter stays as it is this round
            arrays, metrics = self.current, MetricRecord({"clusters": 0})
        else:
            arrays, metrics = self.inner.aggregate_train(server_round, passed)
        self.rejected.update(self.inner.rejected)
        if self.server_ledger is not None and arrays is not None:
            self.server_ledger.record_round(noise_multiplier=self.sigma, sample_rate=self.sample_rate)
        return arrays, metrics

    def _equal_weight(self, reply: Message) -> Message:
        """Client-level DP bounds each cluster's influence by C: average with equal weights."""
        if reply.has_error():
            return reply
        content = reply.content
        metrics = dict(content.metric_records[METRICS_KEY])
        metrics[WEIGHT_KEY] = 1
        records = {k: v for k, v in content.items() if k != METRICS_KEY}
        records[METRICS_KEY] = MetricRecord(metrics)
        return make_message(metadata=reply.metadata, content=RecordDict(records))

    def observe_traffic(self, traffic: dict[int, NodeTraffic]) -> None:
        self.round_clusters = {self.node_cluster[n] for n in traffic if n in self.node_cluster}
        self.inner.observe_traffic(traffic)

    def round_notes(self) -> dict[str, dict[str, Any]]:
        notes = {cid: dict(n) for cid, n in self.inner.round_notes().items()}
        for cid, n in self.notes.items():
            notes.setdefault(cid, {}).update(n)
        for cid in self.round_clusters:  # only the clusters that took part in this round
            notes.setdefault(cid, {})["accountant"] = self.cfg.accountant
        return notes

    def round_summary(self) -> dict[str, Any]:
        return {"privacy": self.server_ledger.metrics_entry()} if self.server_ledger is not None else {}

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

