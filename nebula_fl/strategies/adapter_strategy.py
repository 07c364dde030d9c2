"""The shared round logic for adapter federations; each outer optimizer is a subclass in its own file.

A round: sample clusters, send each the global adapter and the round's config, take back each
cluster's *update* (its adapter after local training minus the global one it received), refuse any
update that does not match the global adapter, average the rest weighted by the clusters' example
counts, and let the outer optimizer turn that mean into the next global adapter. Clusters that trained
different numbers of local steps (`local-steps = "auto"`) have their updates FedNova-normalised first.

A strategy may replace the average (``aggregate_updates``, e.g. a robust trimmed mean); one that needs the
updates one by one says so (``needs_individual_updates``), since secure aggregation shows the server only
their sum. What it decided (clusters kept or dropped, their scores) it says with ``record`` and
``record_round``: the round's line in metrics.jsonl carries it, and ``clusters_aggregated`` counts only the
updates it kept. One whose algorithm has a client side declares the options it needs (``client_config``, e.g.
FedProx's `prox-mu`), merged into every round's config. Installed packages add strategies by entry point (group
``nebula_fl.strategies``): a subclass of this class, or one of Flower's own Message-API strategies, which
``strategies/flower.py`` wraps.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from nebula_fl.comm.validation import check_arrays
from nebula_fl.config import Section, TrainConfig
from nebula_fl.errors import ConfigError
from nebula_fl.strategies.aggregation import scale_updates, step_scales, weighted_mean
from nebula_fl.strategies.base import NebulaStrategy
from nebula_fl.strategies.records import StrategyRecords

if TYPE_CHECKING:
    from nebula_fl.config import RunConfig

Arrays = dict[str, np.ndarray]

ARRAYS_KEY = "arrays"  # server -> cluster: the global adapter
CONFIG_KEY = "config"  # server -> cluster: the round's config
UPDATE_KEY = "update"  # cluster -> server: adapter after local training minus the global adapter
METRICS_KEY = "metrics"  # cluster -> server: num-examples, train-loss, steps, seconds, cluster-id
WEIGHT_KEY = "num-examples"
# What a strategy's client_config may set: run-config keys that shape only the clusters' inner optimisation. Not
# local-steps, max-local-steps, round-seconds, round-overlap (the server, secure aggregation and privacy budgets plan
# rounds with the run's values), not batch-size (the floor of the per-example-DP logical batch, so of its sampling
# rate), never privacy.*.
CLIENT_OPTIONS = ("prox-mu", "lr", "weight-decay", "max-grad-norm", "lr-schedule", "lr-min-ratio")


def to_numpy(record: ArrayRecord) -> Arrays:
    return {key: array.numpy() for key, array in record.items()}


def to_record(arrays: Arrays) -> ArrayRecord:
    return ArrayRecord({key: Array(np.ascontiguousarray(value)) for key, value in arrays.items()})


@dataclass(kw_only=True, frozen=True)
class NoStrategyOptions(Section):
    """A strategy without options of its own."""

    PREFIX: ClassVar[str] = "strategy"


@dataclass
class Contribution:
    node_id: int
    update: Arrays
    weight: float
    metrics: dict[str, Any]


class AdapterStrategy(NebulaStrategy):
    """Sampling, messaging, validation and weighted averaging; subclasses define the outer step."""

    name: ClassVar[str]
    default_lr: ClassVar[float]
    needs_individual_updates: ClassVar[bool] = False
    """True when ``aggregate_updates`` is more than a weighted mean: such a strategy cannot run under secure
    aggregation, where the server only ever sees the sum of a round's updates."""

    Options: ClassVar[type[Section]] = NoStrategyOptions
    """The strategy's own run-config keys (``strategy.*``): a config Section with PREFIX 'strategy', checked at
    start with the same one-line errors as every other key; the parsed values are ``self.options``."""

    def __init__(self, *, lr: float | None = None, clusters_per_round: int = 0, seed: int = 0,
                 options: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.options = self.Options.from_flat(dict(options or {}))
        self.lr = self.default_lr if lr is None else float(lr)
        if not self.lr > 0:
            raise ValueError(f"outer learning rate must be > 0, got {self.lr}")
        if clusters_per_round < 0:
            raise ValueError(f"clusters_per_round must be >= 0 (0 = all), got {clusters_per_round}")
        self.clusters_per_round = clusters_per_round
        self.rng = np.random.default_rng(seed)
        self.current: Arrays | None = None
        self.records = StrategyRecords(strategy=self.name)
        self.round_clusters: list[str] = []
        """The cluster id of each update ``aggregate_updates`` is given, in its order."""

    # -- client side -----------------------------------------------------------------------------
    def client_config(self) -> dict[str, int | float | str | bool]:
        """Run-config keys the clusters must train with for this algorithm, merged into every round's config over
        the run's own values: FedProx returns ``{"prox-mu": mu}``. Default: nothing.

        Keys are limited to ``CLIENT_OPTIONS``, the inner optimisation's (checked when the strategy is built and
        each round: a one-line ConfigError naming the strategy and the key). Privacy keys are refused: what a
        cluster releases is set by the run's privacy.* keys and, above them, by its operator's policy, never by
        an optimisation algorithm. This check keeps honest plug-ins honest; against a malicious server, which can
        send any config, each cluster's privacy gate is the guard, and a proximal term changes only how it
        optimises, never what it releases or under what guarantee."""
        return {}

    def checked_client_config(self) -> dict[str, int | float | str | bool]:
        """``client_config()``, validated: known client options only, values within their run-config bounds."""
        return check_client_config(self.client_config(), strategy=self.name)

    # -- outer optimizer -------------------------------------------------------------------------
    @abstractmethod
    def outer_step(self, params: Arrays, delta: Arrays) -> Arrays:
        """The next global adapter from the current one and the round's aggregated (by default mean) update."""

    def aggregate_updates(self, updates: list[Arrays], weights: list[float]) -> Arrays:
        """The one update a round's outer step consumes; by default the example-weighted mean."""
        return weighted_mean(updates, weights)

    # -- what the strategy decided ---------------------------------------------------------------
    def record(self, index: int, **values: bool | int | float | str) -> None:
        """Record values for the cluster whose update is ``updates[index]`` in this round's
        ``aggregate_updates``: e.g. ``record(2, kept=False, score=3.2)``. ``kept=False`` says the update was
        left out of the aggregate (``clusters_aggregated`` counts the rest). Numbers, bools and one-line
        strings (80 characters), under lower_snake_case keys; anything else is a ValueError naming the strategy.
        Called outside a round (a test calling ``aggregate_updates`` directly), the cluster is named by the index."""
        known = len(self.round_clusters)
        if isinstance(index, bool) or not isinstance(index, int) or index < 0 or (known and index >= known):
            raise ValueError(f"strategy '{self.name}' recorded for update index {index!r}; this round's "
                             f"aggregate_updates was given {known} update(s): use 0..{known - 1}")
        self.records.add_cluster(self.round_clusters[index] if known else str(index), values)

    def record_round(self, **values: bool | int | float | str) -> None:
        """Record values for the whole round (e.g. ``record_round(trim_k=1)``), checked as ``record``'s."""
        self.records.add_round(values)

    def round_notes(self) -> dict[str, dict[str, Any]]:
        return self.records.notes()

    def round_summary(self) -> dict[str, Any]:
        return self.records.summary()

    def step(self, params: Arrays, mean: Arrays, *, weight: float,
             contributions: list[Contribution] | None) -> Arrays | None:
        """The next global adapter, or None when the strategy declines the round (it is skipped). `contributions`
        are the round's updates one by one (FedNova-normalised), None under secure aggregation, which shows only
        their mean; by default the outer step on the mean. A strategy that reads more than the mean (Flower's
        own, wrapped) overrides this."""
        return self.outer_step(params, mean)

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        """Refuse, with a ConfigError naming the key, a run config this strategy cannot serve; called by
        ``components.resolve`` after the ``strategy.*`` options parsed. Nothing to check here."""

    @abstractmethod
    def outer_state(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_outer_state(self, state: dict[str, Any]) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "lr": self.lr, "rng": self.rng.bit_generator.state, "outer": self.outer_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"checkpoint holds '{state.get('name')}' optimizer state, this run uses '{self.name}'")
        self.rng.bit_generator.state = state["rng"]
        self.load_outer_state(state["outer"])

    # -- Flower's contract -----------------------------------------------------------------------
    def summary(self) -> None:
        log(INFO, "\t├──> %s outer optimizer, lr %s", self.name, self.lr)
        if extra := self.checked_client_config():
            log(INFO, "\t├──> sent to every cluster: %s", ", ".join(f"{k}={v}" for k, v in sorted(extra.items())))
        log(INFO, "\t└──> clusters per round: %s", self.clusters_per_round or "all")

    def sample(self, node_ids: list[int]) -> list[int]:
        if not node_ids:
            raise ValueError("no cluster is connected")
        k = self.clusters_per_round or len(node_ids)
        if k >= len(node_ids):
            return sorted(node_ids)
        return sorted(int(n) for n in self.rng.choice(sorted(node_ids), size=k, replace=False))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.records.clear()  # a round's records describe that round only
        self.round_clusters = []
        live = [n for n in grid.get_node_ids() if n not in self.directory.retired]
        open_ = [n for n in live if self.directory.get(n) not in self.directory.stopped]
        if live and not open_:
            return []  # every cluster stopped: the wrapper that stopped them ends the run, saying why
        nodes = self.sample(open_)
        self.current = to_numpy(arrays)
        round_config = ConfigRecord({**dict(config), **self.checked_client_config()})
        round_config["server-round"] = server_round
        # the rounds the global holds: every round before this one was decided (applied or skipped); a wrapper that
        # applies a round late (secure aggregation with round-overlap) lowers it (clients/overlap.py)
        round_config["global-round"] = server_round - 1
        content = RecordDict({ARRAYS_KEY: arrays, CONFIG_KEY: round_config})
        log(INFO, "configure_train: %d cluster(s) sampled", len(nodes))
        return [Message(content=content, dst_node_id=n, message_type=MessageType.TRAIN) for n in nodes]

    def parse_reply(self, reply: Message) -> Contribution:
        """Turn a reply into a Contribution, or raise ValueError saying why it cannot be used."""
        if reply.has_error():
            raise ValueError(f"the cluster failed: {reply.error.reason}")
        content = reply.content
        if UPDATE_KEY not in content.array_records or METRICS_KEY not in content.metric_records:
            raise ValueError(f"reply lacks the '{UPDATE_KEY}' arrays or the '{METRICS_KEY}' metrics")
        metrics = dict(content.metric_records[METRICS_KEY])
        weight = metrics.get(WEIGHT_KEY)
        if not isinstance(weight, int | float) or not weight > 0 or not np.isfinite(weight):
            raise ValueError(f"reply's '{WEIGHT_KEY}' is {weight!r}; it must be a positive number")
        try:
            update = to_numpy(content.array_records[UPDATE_KEY])
        except (ValueError, TypeError, OSError) as err:
            raise ValueError(f"update arrays cannot be decoded: {err}") from None
        assert self.current is not None, "configure_train must run before aggregate_train"
        check_arrays(expected={k: v.shape for k, v in self.current.items()}, arrays=update, what="update")
        return Contribution(self.node_of(reply), update, float(weight), metrics)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        contributions = []
        for reply in replies:
            try:
                contributions.append(self.parse_reply(reply))
            except ValueError as err:
                node = self.node_of(reply)
                self.rejected[node] = str(err)
                log(WARNING, "round %d: dropped the reply of node %d: %s", server_round, node, err)
        usable = len(contributions)
        if not contributions or usable < self.min_updates or self.current is None:
            # too few to move the global adapter (min-clusters): the round is skipped, nothing changes
            return None, MetricRecord({"clusters": 0, "clusters-usable": usable})
        weights = [c.weight for c in contributions]
        losses = [(c.weight, c.metrics.get("train-loss")) for c in contributions]
        loss = (float(sum(w * x for w, x in losses) / sum(weights))
                if all(isinstance(x, int | float) for _, x in losses) else None)
        updates, normalization = self.normalize_steps(contributions)
        self.round_clusters = [self.cluster_of(c) for c in contributions]
        mean = self.aggregate_updates(updates, weights)
        normalized = [replace(c, update=u) for c, u in zip(contributions, updates, strict=True)]
        return self._outer_update(mean, weight=sum(weights), count=usable, usable=usable, train_loss=loss,
                                  extra=normalization, contributions=normalized)

    def cluster_of(self, contribution: Contribution) -> str:
        """The cluster id a contribution comes from, as the round's line names it."""
        cid = contribution.metrics.get("cluster-id")
        if isinstance(cid, int | float) and not isinstance(cid, bool):
            return str(int(cid))
        return self.directory.get(contribution.node_id) or f"node-{contribution.node_id}"

    @staticmethod
    def normalize_steps(contributions: list[Contribution]) -> tuple[list[Arrays], dict[str, float]]:
        """The updates to aggregate, FedNova-normalised when the clusters trained different step counts.

        Under `local-steps = "auto"` a faster cluster trains more steps, and the plain mean would weigh its
        data more (objective inconsistency, aggregation.step_scales). Each update is pre-scaled by
        tau_eff / tau_i here, before ``aggregate_updates``, so a plug-in aggregator (a trimmed mean) gets the
        normalised updates too. Only when every contribution reports a positive `steps` and they differ;
        otherwise the updates pass unchanged and no metric is added.
        """
        updates = [c.update for c in contributions]
        steps = [c.metrics.get("steps") for c in contributions]
        usable = all(isinstance(s, int | float) and not isinstance(s, bool) and np.isfinite(s) and s > 0
                     for s in steps)
        if not usable or len(set(steps)) < 2:
            return updates, {}
        tau_eff, scales = step_scales(weights=[c.weight for c in contributions], steps=steps)
        return scale_updates(updates, scales), {"steps-normalized": 1, "tau-eff": tau_eff}

    def apply_mean(self, mean: Arrays, *, weight: float, count: int,
                   train_loss: float | None = None) -> tuple[ArrayRecord | None, MetricRecord]:
        """One outer step from the weighted mean of `count` updates unmasked as a sum (secure aggregation)."""
        if self.needs_individual_updates:
            raise ConfigError(f"outer optimizer '{self.name}' needs each cluster's update, but secure aggregation "
                              "shows the server only their sum; turn secagg.enabled off or use a mean-based optimizer")
        return self._outer_update(mean, weight=weight, count=count, train_loss=train_loss)

    def _outer_update(self, mean: Arrays, *, weight: float, count: int, usable: int | None = None,
                      train_loss: float | None = None, extra: dict[str, float] | None = None,
                      contributions: list[Contribution] | None = None) -> tuple[ArrayRecord | None, MetricRecord]:
        """`count` updates went into `mean`, of `usable` (default `count`) that passed validation; those the strategy
        recorded as not kept (in ``aggregate_updates`` or ``step``) are not counted as aggregated."""
        usable = count if usable is None else usable
        if usable < self.min_updates or self.current is None:
            return None, MetricRecord({"clusters": 0, "clusters-usable": usable})
        check_arrays(expected={k: v.shape for k, v in self.current.items()}, arrays=mean, what="mean update")
        stepped = self.step(self.current, mean, weight=weight, contributions=contributions)
        if stepped is None:  # the strategy declined the round (e.g. too few updates for Bulyan): it is skipped
            return None, MetricRecord({"clusters": 0, "clusters-usable": usable})
        self.current = stepped
        metrics = {
            WEIGHT_KEY: int(weight),
            "clusters": count - self.records.dropped(),
            "clusters-usable": usable,
            "update-norm": float(np.sqrt(sum(float(np.sum(v.astype(np.float64) ** 2)) for v in mean.values()))),
        }
        if train_loss is not None:
            metrics["train-loss"] = train_loss
        metrics.update(extra or {})
        return to_record(self.current), MetricRecord(metrics)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Evaluation is server-side, on the held-out split: no message goes to the clusters."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None


def check_client_config(options: object, *, strategy: str) -> dict[str, int | float | str | bool]:
    """A strategy's client options as a plain dict, or a one-line ConfigError naming the strategy and the key."""
    where = f"strategy '{strategy}' client_config()"
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where} returned {type(options).__name__}, not a dict of run-config keys; fix the plugin")
    for key in options:
        if not isinstance(key, str) or key.startswith("privacy"):
            raise ConfigError(f"{where} sets {key!r}: a strategy may not change privacy settings (the run's privacy.* "
                              "keys and each cluster's own policy decide them); drop it from the plugin")
        if key not in CLIENT_OPTIONS:
            raise ConfigError(f"{where} sets {key!r}, which is not a client-side training option; use only "
                              f"{', '.join(CLIENT_OPTIONS)}")
    try:
        TrainConfig.from_flat(options)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return dict(options)

