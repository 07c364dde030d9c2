"""Message-API strategies that aggregate adapter updates; one outer optimizer per file. Flower's own strategies
are named ``flwr:<Class>`` (``strategies/flower.py`` wraps them). More come from the entry-point group
``nebula_fl.strategies`` (see ``nebula_fl/plugins.py``): a subclass of ``AdapterStrategy`` whose ``name`` is its
entry point's name, or a Flower Message-API strategy class, wrapped the same way."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from nebula_fl.config import OuterConfig
from nebula_fl.errors import ConfigError
from nebula_fl.plugins import Plugins
from nebula_fl.strategies.adam import AdapterAdam
from nebula_fl.strategies.adapter_strategy import AdapterStrategy
from nebula_fl.strategies.fedavg import AdapterFedAvg
from nebula_fl.strategies.fedavgm import AdapterFedAvgM
from nebula_fl.strategies.flower import PREFIX as FLOWER_PREFIX
from nebula_fl.strategies.flower import flower_names, flower_strategy_class
from nebula_fl.strategies.momentum import MomentumStrategy
from nebula_fl.strategies.nesterov import AdapterNesterov
from nebula_fl.strategies.plugin_class import check_strategy_class

BUILTIN_STRATEGIES: dict[str, type[AdapterStrategy]] = {
    cls.name: cls for cls in (AdapterFedAvg, AdapterFedAvgM, AdapterNesterov, AdapterAdam)
}

STRATEGIES = Plugins(group="nebula_fl.strategies", kind="strategy", builtins=lambda: dict(BUILTIN_STRATEGIES),
                     check=check_strategy_class)


def strategy_names() -> list[str]:
    """Every outer optimizer that can be named: the built-ins in their order, then installed plugins."""
    return [*BUILTIN_STRATEGIES, *(n for n in STRATEGIES.names() if n not in BUILTIN_STRATEGIES)]


def strategy_class(name: str) -> type[AdapterStrategy]:
    """The class for an outer-optimizer name, or a ConfigError: an unknown name gets the closest known one and the
    list; a plugin that does not load or is not a strategy is named with its package."""
    if name in BUILTIN_STRATEGIES:  # no entry-point scan for the common case
        return BUILTIN_STRATEGIES[name]
    if name.startswith(FLOWER_PREFIX):
        return flower_strategy_class(name)
    known = strategy_names()
    if name not in known:
        close = difflib.get_close_matches(name, [*known, *flower_names()], n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        raise ConfigError(f"unknown outer optimizer '{name}'; {hint}use one of {', '.join(known)}, one of Flower's "
                          f"as flwr:<Class> (e.g. flwr:FedYogi), or install a plugin package declaring it in the "
                          f"entry-point group '{STRATEGIES.group}'")
    return STRATEGIES.get(name)


def make_strategy(cfg: OuterConfig, *, clusters_per_round: int = 0, seed: int = 0,
                  options: Mapping[str, Any] | None = None) -> AdapterStrategy:
    """The strategy for an outer-optimizer config; 'auto' values take each optimizer's defaults. Plugins get lr,
    clusters_per_round, seed and their ``strategy.*`` options (only when given or declared, so a plugin with its
    own __init__ and no options keeps working); momentum and Adam's keys go only to subclasses of those kinds."""
    cls = strategy_class(cfg.outer_optimizer)
    kwargs: dict = {"lr": cfg.outer_lr, "clusters_per_round": clusters_per_round, "seed": seed}
    if options or cls.Options is not AdapterStrategy.Options:
        kwargs["options"] = dict(options or {})
    if issubclass(cls, MomentumStrategy):
        kwargs["momentum"] = cfg.outer_momentum
    if issubclass(cls, AdapterAdam):
        kwargs.update(beta1=cfg.outer_beta1, beta2=cfg.outer_beta2, eps=cfg.outer_eps)
    strategy = cls(**kwargs)
    strategy.checked_client_config()  # a plugin asking clusters for what it may not: refused before any connects
    return strategy


__all__ = ["BUILTIN_STRATEGIES", "STRATEGIES", "AdapterStrategy", "make_strategy", "strategy_class", "strategy_names"]
