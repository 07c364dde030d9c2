"""Flower's own Message-API strategies as outer optimizers: ``outer-optimizer = "flwr:FedYogi"``.

A Flower strategy aggregates the *weights* stock ClientApps send back; nebula-fl's round loop, its wrappers
(compression, secure aggregation, privacy) and its checkpoints speak ``AdapterStrategy`` and *updates*. A
``FlowerOuter`` is an AdapterStrategy holding one instance of the Flower class, and each outer step drives it
as Flower's own loop would: ``configure_train`` with the round's global adapter (against a grid of the round's
clusters; its messages are not sent, nebula-fl sent its own), then ``aggregate_train`` on the replies stock
ClientApps would have sent, each built with Flower's public reply constructor ``Message(content,
reply_to=instruction)``: an ArrayRecord of the cluster's trained adapter (global + its update) and a
MetricRecord with its example count (and ``train-loss``). What it returns is the next global adapter.

Under secure aggregation the server learns only the example-weighted mean of the updates and the total weight.
A mean-based strategy (FedAvg, FedAvgM, FedProx, FedAdam, FedYogi, FedAdagrad) first reduces the replies to
exactly that weighted mean, so it is given one reply, global + mean, carrying the total weight: the same next
global. The rest read the updates one by one (median, trimmed mean, Krum's distances, Bulyan, q-FedAvg's
per-cluster losses) and are refused with secure aggregation, at start.

The Flower class's constructor scalars are the strategy's ``strategy.*`` run-config keys (``eta_l`` ->
``strategy.eta-l``), defaults from its signature; the arguments that are the framework's business (sampling
fractions, minimum node counts, record keys, the weighting key, metric functions) are set here. Its evolving
state (FedOpt's moments and current arrays, FedAvgM's momentum) is checkpointed with the run.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import typing
from collections.abc import Iterable, Mapping
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log

from nebula_fl.comm.validation import check_arrays
from nebula_fl.config import RunConfig, Section, config_key
from nebula_fl.errors import ConfigError
from nebula_fl.strategies.adapter_strategy import (
    METRICS_KEY,
    WEIGHT_KEY,
    AdapterStrategy,
    Arrays,
    Contribution,
    to_numpy,
    to_record,
)

PREFIX = "flwr:"
LOSS_KEY = "train-loss"  # what the clusters report as their mean training loss
INDEX_KEY = "nebula-reply"  # each built reply's position, so the replies a strategy aggregated can be told apart

MEAN_BASED = ("FedAvg", "FedAvgM", "FedProx", "FedAdam", "FedYogi", "FedAdagrad")
INDIVIDUAL = ("FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan", "QFedAvg")
_DP = ("a wrapper that clips and noises another strategy's updates; nebula-fl does differential privacy in its own "
       "privacy layer (privacy.mode), with each cluster's policy and one accountant, which this would bypass; set "
       "privacy.mode and name the strategy itself")
_XGB = "it aggregates XGBoost trees (serialized boosters), not arrays; a LoRA adapter is arrays"
REFUSED = {
    "FedXgbBagging": _XGB,
    "FedXgbCyclic": _XGB,
    "DifferentialPrivacyClientSideAdaptiveClipping": _DP,
    "DifferentialPrivacyClientSideFixedClipping": _DP,
    "DifferentialPrivacyServerSideAdaptiveClipping": _DP,
    "DifferentialPrivacyServerSideFixedClipping": _DP,
    "Strategy": "it is the abstract base class; name a strategy",
}

# The constructor arguments nebula-fl owns: sampling is its own (clusters-per-round), every sampled cluster's
# reply reaches the strategy, replies carry their weight under num-examples and their loss under train-loss.
OWNED: dict[str, Any] = {
    "fraction_train": 1.0,
    "min_train_nodes": 0,
    "min_available_nodes": 0,
    "weighted_by_key": WEIGHT_KEY,
    "train_loss_key": LOSS_KEY,
}
NOT_EXPOSED = {*OWNED, "fraction_evaluate", "min_evaluate_nodes", "arrayrecord_key", "configrecord_key",
               "train_metrics_aggr_fn", "evaluate_metrics_aggr_fn"}
SCALARS = (bool, int, float, str)
SERVER_LR = ("eta", "server_learning_rate")  # the option that is a Flower strategy's own outer learning rate


def flower_names() -> list[str]:
    """Every ``flwr:<Class>`` that can be named, in the README's order."""
    return [PREFIX + n for n in (*MEAN_BASED, *INDIVIDUAL)]


def flower_strategy_class(name: str) -> type[FlowerOuter]:
    """The wrapper class for ``flwr:<Class>``, or a ConfigError: an unknown class gets the closest known name, a
    refused one the reason."""
    import flwr.serverapp.strategy as stock

    short = name[len(PREFIX):]
    if short in REFUSED:
        raise ConfigError(f"unknown outer optimizer '{name}': Flower's {short} cannot be an outer optimizer: "
                          f"{REFUSED[short]}")
    if short not in (*MEAN_BASED, *INDIVIDUAL):
        known = flower_names()
        lowered = {n.lower(): n for n in known}
        close = difflib.get_close_matches(name.lower(), list(lowered), n=1)
        hint = f"did you mean '{lowered[close[0]]}'? " if close else ""
        raise ConfigError(f"unknown outer optimizer '{name}'; {hint}Flower's strategies that work are "
                          f"{', '.join(known)}")
    return flower_outer(getattr(stock, short), name=name, where=f"Flower's {short}",
                        individual=short in INDIVIDUAL)


def flower_outer(cls: type[Strategy], *, name: str, where: str, individual: bool | None = None) -> type[FlowerOuter]:
    """The AdapterStrategy subclass named `name` that wraps the Flower strategy class `cls`, or a ValueError why it
    cannot. `individual`: whether it reads updates one by one; None (a plug-in) takes the class's own
    ``needs_individual_updates`` if it declares one, else True (nothing says it is mean-based)."""
    if individual is None:
        individual = getattr(cls, "needs_individual_updates", True)
        if not isinstance(individual, bool):
            raise ValueError(f"{where} has needs_individual_updates = {individual!r}; use True or False")
    return _wrap(cls, name, where, individual)


@functools.cache
def _wrap(cls: type[Strategy], name: str, where: str, individual: bool) -> type[FlowerOuter]:
    import flwr.serverapp.strategy as stock

    if inspect.isabstract(cls):
        raise ValueError(f"{where} does not implement {sorted(cls.__abstractmethods__)}; fix the plugin")
    for refused, why in REFUSED.items():
        if refused != "Strategy" and issubclass(cls, getattr(stock, refused)):
            raise ValueError(f"{where} is a {refused}, which cannot be an outer optimizer: {why}")
    options, required = _options_section(cls, where)
    return type(f"Flower{cls.__name__}", (FlowerOuter,), {
        "__module__": __name__, "__doc__": f"Flower's {cls.__name__} as the outer optimizer '{name}'.",
        "name": name, "flower_class": cls, "Options": options, "required_options": required,
        "needs_individual_updates": individual,
    })


def _options_section(cls: type[Strategy], where: str) -> tuple[type[Section], frozenset[str]]:
    """A ``strategy.*`` Section from the constructor: one field per scalar argument nebula-fl does not own, with the
    signature's default; an argument without a default is "auto" here and required at start (check_config)."""
    try:
        hints = typing.get_type_hints(cls.__init__)
    except Exception:  # an annotation that does not resolve: fall back to the defaults' types
        hints = {}
    fields, required = [], set()
    for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or param.name in NOT_EXPOSED:
            continue
        kind = hints.get(param.name)
        if kind not in SCALARS and param.default is not param.empty and type(param.default) in SCALARS:
            kind = type(param.default)
        if kind not in SCALARS:
            if param.default is param.empty:
                raise ValueError(f"{where} needs the argument '{param.name}', which is not a number, bool or "
                                 "string a run config can set; give it a default")
            continue  # e.g. Bulyan's selection_rule: left at Flower's default
        if param.default is param.empty:
            required.add(param.name)
            fields.append((param.name, kind | None, dataclasses.field(default=None)))
        else:
            fields.append((param.name, kind, dataclasses.field(default=param.default)))
    section = dataclasses.make_dataclass(
        f"{cls.__name__}Options", fields, bases=(Section,), frozen=True, kw_only=True,
        namespace={"PREFIX": "strategy", "__module__": __name__, "__post_init__": _check_finite,
                   "__doc__": f"{where}'s constructor arguments, as strategy.* run-config keys."},
    )
    return section, frozenset(required)


def _check_finite(self: Section) -> None:
    for key, value in self.to_flat().items():
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key '{key}' is {value}; use a finite number")


class RoundGrid(Grid):
    """The round's clusters, as the wrapped strategy's ``configure_train`` samples them. Read-only: nebula-fl sends
    the round's messages itself, so anything but reading node ids is refused."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self.node_ids = list(node_ids)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.node_ids)

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a Flower strategy wrapped as nebula-fl's outer optimizer may only read the round's node "
                           "ids in configure_train; nebula-fl sends and receives the messages")

    set_run = create_message = push_messages = pull_messages = send_and_receive = _refuse

    @property
    def run(self) -> Any:
        return self._refuse()


class FlowerOuter(AdapterStrategy):
    """An AdapterStrategy whose outer step is a Flower strategy's ``aggregate_train``; see the module docstring.
    One subclass per Flower class (``flower_outer``), so ``name`` and ``Options`` are per class as for any strategy."""

    default_lr = 1.0  # unused: a Flower strategy has its own server learning rate (eta), among its options
    flower_class: ClassVar[type[Strategy]]
    required_options: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, *, lr: float | None = None, clusters_per_round: int = 0, seed: int = 0,
                 options: Mapping[str, Any] | None = None) -> None:
        if lr is not None:
            raise ValueError(f"outer-lr does not apply to '{self.name}': {self.lr_hint()}")
        super().__init__(clusters_per_round=clusters_per_round, seed=seed, options=options)
        given = dataclasses.asdict(self.options)
        missing = sorted(config_key("strategy", n) for n in self.required_options if given[n] is None)
        if missing:
            raise ValueError(f"'{self.name}' needs {', '.join(missing)} (Flower's {self.flower_class.__name__} has no "
                             "default for it); set it with --run-config")
        params = inspect.signature(self.flower_class.__init__).parameters
        owned = {k: v for k, v in OWNED.items() if k in params}
        if "train_metrics_aggr_fn" in params:  # Flower's public hook sees exactly the replies a strategy aggregates
            owned["train_metrics_aggr_fn"] = self._aggregated_metrics
        self.aggregated: set[int] | None = None  # the round's reply indices the strategy aggregated, when it said
        self.flower = self.flower_class(**owned, **given)
        self.arrays_key = getattr(self.flower, "arrayrecord_key", "arrays")
        self.constructor = set(params)  # attributes named for an argument are settings, not state
        self.server_round = 0
        self.round_nodes: list[int] = []
        self.unsaved: set[str] = set()

    @classmethod
    def lr_hint(cls) -> str:
        own = [f.name for f in dataclasses.fields(cls.Options) if f.name in SERVER_LR]
        return (f"its own server learning rate is {config_key('strategy', own[0])}; leave outer-lr auto and set that"
                if own else f"Flower's {cls.flower_class.__name__} has no server learning rate; leave outer-lr auto")

    @classmethod
    def check_config(cls, cfg: RunConfig) -> None:
        if cfg.outer.outer_lr is not None:
            raise ConfigError(f"config key 'outer-lr' is {cfg.outer.outer_lr}, but it does not apply to outer "
                              f"optimizer '{cls.name}': {cls.lr_hint()}")
        options = cls.Options.from_flat(dict(cfg.strategy_options))
        for name in sorted(cls.required_options):
            if getattr(options, name) is None:
                hint = f" (the clusters' lr is {cfg.train.lr})" if name == "client_learning_rate" else ""
                raise ConfigError(f"config key '{config_key('strategy', name)}' is required by outer optimizer "
                                  f"'{cls.name}' (Flower's {cls.flower_class.__name__} has no default for it); "
                                  f"set it with --run-config{hint}")
        try:
            cls(options=cfg.strategy_options)
        except (ValueError, TypeError) as err:
            raise ConfigError(f"config key 'outer-optimizer' is '{cls.name}', which refuses its strategy.* options: "
                              f"{err}") from None

    # -- the outer step ---------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
                        ) -> Iterable[Message]:
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if not self.server_round:  # once a process: Flower's own lines that follow do not name the strategy
            log(INFO, "outer optimizer %s: Flower's %s (%s)", self.name, self.flower_class.__name__, self.settings())
        self.server_round = server_round
        self.round_nodes = [m.metadata.dst_node_id for m in messages]
        return messages

    def outer_step(self, params: Arrays, delta: Arrays) -> Arrays:
        """The step from the mean alone (one reply, global + mean); None from the strategy is an error here."""
        new = self.step(params, delta, weight=1.0, contributions=None)
        if new is None:
            raise ValueError(f"'{self.name}' returned no arrays for a mean update")
        return new

    def step(self, params: Arrays, mean: Arrays, *, weight: float,
             contributions: list[Contribution] | None) -> Arrays | None:
        if contributions is None:  # secure aggregation: the mean of the round's updates and their total weight
            contributions = [Contribution(node_id=self.round_nodes[0] if self.round_nodes else 0, update=mean,
                                          weight=weight, metrics={})]
            order = [0]
        else:  # in cluster order, not arrival order: Krum breaks ties by reply order, sums round by it
            order = sorted(range(len(contributions)), key=lambda i: self._cluster_order(contributions[i]))
            contributions = [contributions[i] for i in order]
        grid = RoundGrid(self.round_nodes or sorted({c.node_id for c in contributions}))
        sent = list(self.flower.configure_train(self.server_round, to_record(params), ConfigRecord(), grid))
        to_node = {m.metadata.dst_node_id: m for m in sent}
        losses = [c.metrics.get(LOSS_KEY) for c in contributions]
        with_loss = all(isinstance(x, int | float) and not isinstance(x, bool) for x in losses)
        replies = []
        for c, loss in zip(contributions, losses, strict=True):
            instruction = to_node.get(c.node_id)
            if instruction is None:  # a strategy that samples on its own left this cluster out: its own instruction
                instruction = Message(RecordDict(), dst_node_id=c.node_id, message_type=MessageType.TRAIN)
            metrics: dict[str, Any] = {WEIGHT_KEY: c.weight, INDEX_KEY: len(replies)}
            metrics |= {LOSS_KEY: float(loss)} if with_loss else {}
            trained = {k: (params[k] + c.update[k]).astype(params[k].dtype, copy=False) for k in params}
            content = RecordDict({self.arrays_key: to_record(trained), METRICS_KEY: MetricRecord(metrics)})
            replies.append(Message(content, reply_to=instruction))
        self.aggregated = None
        arrays, _ = self.flower.aggregate_train(self.server_round, replies)
        if self.needs_individual_updates and len(replies) > 1 and self.aggregated is not None:
            for position, original in enumerate(order):  # what a selecting strategy (Krum, Bulyan) kept
                self.record(original, kept=position in self.aggregated)
        if arrays is None:
            log(WARNING, "round %d: %s aggregated none of the %d update(s); the round is skipped", self.server_round,
                self.name, len(replies))
            return None
        new = {k: v.astype(params[k].dtype, copy=False) if k in params else v for k, v in to_numpy(arrays).items()}
        check_arrays(expected={k: v.shape for k, v in params.items()}, arrays=new, what=f"{self.name}'s next adapter")
        return new

    def _aggregated_metrics(self, records: list[RecordDict], weighting_key: str) -> MetricRecord:
        """Flower's metric aggregation, noting which replies reached it: the ones the strategy aggregated (Krum's
        and Bulyan's selection; every reply for the others), for ``clusters_aggregated`` and the round's record."""
        from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

        self.aggregated = {int(next(iter(r.metric_records.values()))[INDEX_KEY]) for r in records}
        return aggregate_metricrecords(records, weighting_key)

    def _cluster_order(self, contribution: Contribution) -> tuple[int, int]:
        cluster = self.directory.get(contribution.node_id)
        return (int(cluster) if cluster is not None and cluster.isdigit() else 1 << 62, contribution.node_id)

    def client_config(self) -> dict[str, Any]:
        """FedProx's proximal term is the clusters' to add: its mu rides in every round's config as ``prox-mu``."""
        from flwr.serverapp.strategy import FedProx

        return {"prox-mu": float(self.flower.proximal_mu)} if isinstance(self.flower, FedProx) else {}

    def settings(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.options.to_flat().items()) or "no options"

    def summary(self) -> None:
        log(INFO, "\t├──> %s outer optimizer: Flower's %s (%s)", self.name, self.flower_class.__name__,
            self.settings())
        log(INFO, "\t└──> clusters per round: %s", self.clusters_per_round or "all")

    # -- state ------------------------------------------------------------------------------------
    def outer_state(self) -> dict[str, Any]:
        """The wrapped strategy's evolving attributes (not its settings, not functions), in a form a checkpoint
        stores (arrays and JSON); one it cannot store is said once and starts afresh after a resume."""
        state = {}
        for name, value in vars(self.flower).items():
            if name in self.constructor or callable(value):
                continue
            encoded = _encode(value)
            if encoded is None:
                if name not in self.unsaved:
                    self.unsaved.add(name)
                    log(WARNING, "%s: the wrapped strategy's attribute '%s' (%s) cannot be checkpointed; a resumed "
                        "run starts it afresh", self.name, name, type(value).__name__)
                continue
            state[name] = encoded
        return state

    def load_outer_state(self, state: dict[str, Any]) -> None:
        for name, encoded in state.items():
            setattr(self.flower, name, _decode(encoded))


def _encode(value: Any) -> dict[str, Any] | None:
    """One attribute as a tagged dict of arrays and JSON values, or None when it is none of these kinds."""
    if value is None or isinstance(value, SCALARS):
        return {"kind": "value", "value": value}
    if isinstance(value, np.generic):
        return {"kind": "value", "value": value.item()}
    if isinstance(value, np.ndarray):
        return {"kind": "array", "array": value.copy()}
    if isinstance(value, ArrayRecord):
        arrays = to_numpy(value)
        return {"kind": "ArrayRecord", "keys": list(arrays), "arrays": list(arrays.values())}
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, np.ndarray) for k, v in value.items()):
        return {"kind": "dict", "keys": list(value), "arrays": [v.copy() for v in value.values()]}
    if isinstance(value, list | tuple) and all(isinstance(v, np.ndarray) for v in value):
        return {"kind": "list", "arrays": [v.copy() for v in value]}
    return None


def _decode(encoded: dict[str, Any]) -> Any:
    kind = encoded.get("kind")
    if kind == "value":
        return encoded["value"]
    if kind == "array":
        return np.array(encoded["array"])
    if kind == "ArrayRecord":
        return to_record(dict(zip(encoded["keys"], encoded["arrays"], strict=True)))
    if kind == "dict":
        return {k: np.array(v) for k, v in zip(encoded["keys"], encoded["arrays"], strict=True)}
    if kind == "list":
        return [np.array(v) for v in encoded["arrays"]]
    raise ValueError(f"checkpointed Flower strategy state of unknown kind {kind!r}")
