"""Differential privacy as a wrapper: refusals, stopped clusters and the server-side accountant.

Whether a cluster trains is its own decision: its trainer holds its operator's privacy policy and its
own lifetime ledger, and refuses a round whose request is weaker than the policy (`policy`) or that
would carry it past its budget (`budget`), saying why. This wrapper is always in the stack (with
privacy off too, since a cluster's policy may require DP the server did not ask for): it takes a
refusal as final for that cluster, stops sending it rounds, records where and why it stopped, no
longer counts it towards `min-clusters`, and ends the run cleanly once no cluster is left.

Client-level DP ('client'): every cluster clips its update to C and adds Gaussian noise before the
update leaves it; the accountant is here, one sampled Gaussian mechanism per round (q = the share
of clusters sampled). Each message says how many shares the noise is split into: 1 without secure
aggregation (each update carries the full sigma C on its own, so even the server sees only noised
updates); with it the secure-aggregation wrapper asks for the threshold t, each cluster adds 1/t of
the variance, and every sum the server can unmask (t or more updates) carries at least sigma C. Updates are averaged with equal weights: the sensitivity is C per cluster, whatever
its size.

The accountant counts what the server learned, when it learned it: without secure aggregation each round in
which an update reached the server; with it each round whose sum was unmasked (`released_rounds`), so a round
every cluster refused, or a held round never unmasked, is not counted, and a round held for round-overlap counts
when its sum is. The budget checks count the held rounds (`held_rounds`) as still to come.
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
        self.inner, self.cfg = inner, cfg
        self.directory = inner.directory
        self.num_rounds, self.clusters = num_rounds, clusters
        self.exhausted: dict[str, dict[str, Any]] = {}  # cluster -> {"round", "reason", "epsilon", "refusal"}
        self.notes: dict[str, dict[str, Any]] = {}
        self.current: ArrayRecord | None = None
        self.server_ledger = None
        self.sigma: float | None = None
        if cfg.mode == "client":
            self._setup_client_dp()

    def _setup_client_dp(self) -> None:
        from nebula_fl.privacy.budget import noise_for_target
        from nebula_fl.privacy.client_dp import ServerDPAccountant

        # δ ≤ 1e-5 and well below 1/n of the protected units (the clusters) unless the operator sets it
        self.delta = self.cfg.delta if self.cfg.delta is not None else min(1e-5, 1.0 / (10 * self.clusters))
        self.server_ledger = ServerDPAccountant(accountant=self.cfg.accountant, delta=self.delta)
        self.sample_rate = 1.0  # every connected cluster is sampled each round unless clusters-per-round says less
        self.sigma = self.cfg.noise_multiplier
        if self.sigma is None:
            self.sigma = noise_for_target(target_epsilon=self.cfg.target_epsilon, delta=self.delta,
                                          sample_rate=self.sample_rate, steps=self.num_rounds,
                                          accountant=self.cfg.accountant)

    def needs_identity(self) -> bool:
        """A stopped cluster must be recognised under a new node id, or it would be sent rounds again."""
        return bool(self.exhausted) or super().needs_identity()

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "exhausted": self.exhausted,
                "server_ledger": None if self.server_ledger is None else self.server_ledger.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
        self.exhausted = {str(k): dict(v) for k, v in state.get("exhausted", {}).items()}
        self.directory.stopped.update(self.exhausted)
        if self.server_ledger is not None and state.get("server_ledger"):
            self.server_ledger.load_state_dict(state["server_ledger"])

    def summary(self) -> None:
        log(INFO, "\t├──> differential privacy (as asked; each cluster's own policy decides): %s, clip %s, accountant %s, budget %s", self.cfg.mode,
            self.cfg.max_grad_norm, self.cfg.accountant, self.cfg.max_epsilon or "none")
        self.inner.summary()

    def report(self) -> dict[str, Any]:
        """What summary.json says about privacy."""
        out: dict[str, Any] = {"mode": self.cfg.mode, "accountant": self.cfg.accountant,
                               "max_epsilon": self.cfg.max_epsilon,
                               "clusters": {cid: {"stopped_round": e["round"], "reason": e["reason"],
                                                  "epsilon": e.get("epsilon"), "refusal": e.get("refusal")}
                                            for cid, e in self.exhausted.items()}}
        if self.server_ledger is not None:
            out["client"] = self.server_ledger.metrics_entry()
        return out

    # -- rounds ----------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.current = arrays
        self.notes = {}
        if self.server_ledger is not None and self.cfg.max_epsilon is not None:
            after = self.server_ledger.epsilon_after(noise_multiplier=self.sigma, sample_rate=self.sample_rate,
                                                     steps=1 + len(self.inner.held_rounds()))
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
                    if self.directory.get(m.metadata.dst_node_id) not in self.exhausted]
        if not messages and self._every_cluster_stopped(grid):  # else a wrapper aborted the round: it is skipped
            why = sorted({e.get("refusal") or "budget" for e in self.exhausted.values()})
            raise StopFederation(
                "every cluster has stopped: "
                + " or ".join({"budget": f"its privacy budget is spent (ε ≤ {self.cfg.max_epsilon})",
                               "policy": "its privacy policy refuses what the server asks"}.get(w, w) for w in why)
            )
        return messages

    def _every_cluster_stopped(self, grid: Grid) -> bool:
        live = [n for n in grid.get_node_ids() if n not in self.directory.retired]
        return bool(self.exhausted) and all(self.directory.get(n) in self.exhausted for n in live)

    def _refusal(self, reply: Message) -> tuple[str, dict[str, Any]] | None:
        """Learn the reply's cluster and keep what it says of its privacy; return (cluster, notes) if it refused."""
        if reply.has_error() or METRICS_KEY not in reply.content.metric_records:
            return None
        metrics = dict(reply.content.metric_records[METRICS_KEY])
        self.learn_node(self.node_of(reply), metrics)
        notes = dict(reply.content.config_records["notes"]) if "notes" in reply.content.config_records else {}
        cluster = self.directory.get(self.node_of(reply))
        if cluster is not None and notes:  # e.g. the accountant and mode the cluster's own policy used
            self.notes.setdefault(cluster, {}).update({k.replace("-", "_"): v for k, v in notes.items()})
        if not metrics.get("privacy-refused"):
            return None
        return str(int(metrics["cluster-id"])), {"epsilon": metrics.get("epsilon"), **notes}

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        passed, declined = [], []
        for reply in replies:
            refused = self._refusal(reply)
            if refused is None:
                passed.append(self._equal_weight(reply) if self.cfg.mode == "client" else reply)
                continue
            declined.append(reply)
            cluster, info = refused
            reason = info.get("privacy-reason", "its privacy budget would be exceeded")
            kind = info.get("privacy-refusal") or "budget"
            self.exhausted[cluster] = {"round": server_round, "reason": reason, "epsilon": info.get("epsilon"),
                                       "refusal": kind}
            self.directory.stopped.add(cluster)
            self.notes.setdefault(cluster, {}).update(privacy_refused=True, privacy_reason=reason, privacy_refusal=kind)
            log(WARNING, "round %d: cluster %s stops (%s): %s", server_round, cluster, kind, reason)
        self.inner.destinations = self.destinations
        self.inner.rejected = {}
        self.inner.note_refused(server_round, declined)  # a refusal may still carry what a wrapper asked beside it
        if self.server_ledger is not None and self.cfg.max_epsilon is not None and self.server_ledger.epsilon_after(
                noise_multiplier=self.sigma, sample_rate=self.sample_rate,
                steps=2 + len(self.inner.held_rounds())) > self.cfg.max_epsilon:
            self.inner.note_last_round(server_round)  # the budget stops the run before the next round (configure_train)
        # a cluster that stopped has left the federation: min-clusters counts the ones still in it
        active = self.directory.known_clusters() - set(self.exhausted)
        self.inner.set_min_updates(min(self.min_updates, len(active)) if active else self.min_updates)
        if not passed and declined and not self.inner.held_rounds():
            # every sampled cluster refused and nothing is held: the global adapter stays as it is this round
            arrays, metrics = self.current, MetricRecord({"clusters": 0})
        else:  # a held round is unmasked even when every cluster refused this one (their refusals carry the answers)
            arrays, metrics = self.inner.aggregate_train(server_round, passed)
        self.rejected.update(self.inner.rejected)
        self._account(server_round, passed)
        return arrays, metrics

    def flush(self, grid: Grid, arrays: ArrayRecord) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self.notes = {}
        self.inner.rejected = {}
        out = self.inner.flush(grid, arrays)
        self.rejected.update(self.inner.rejected)
        self._account(None, [])
        return out

    def _account(self, server_round: int | None, passed: list[Message]) -> None:
        """One step of the server's ledger per round the server learned (see the module's docstring)."""
        if self.server_ledger is None:
            return
        released = self.inner.released_rounds()
        if released is None:  # the updates reached the server as they are: this round's, if any came
            released = [server_round] if any(not r.has_error() for r in passed) else []
        for _ in released:
            self.server_ledger.record_round(noise_multiplier=self.sigma, sample_rate=self.sample_rate)

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
        self.inner.observe_traffic(traffic)

    def round_notes(self) -> dict[str, dict[str, Any]]:
        notes = {cid: dict(n) for cid, n in self.inner.round_notes().items()}
        for cid, n in self.notes.items():
            notes.setdefault(cid, {}).update(n)
        return notes

    def round_summary(self) -> dict[str, Any]:
        out = dict(self.inner.round_summary())
        if self.server_ledger is not None:
            out["privacy"] = self.server_ledger.metrics_entry()
        return out

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid):
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return self.inner.aggregate_evaluate(server_round, replies)

