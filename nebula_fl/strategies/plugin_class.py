"""What a strategy plug-in may be: a usable ``AdapterStrategy`` subclass, or a Flower Message-API strategy that
``flower.py`` wraps. Apart from both, which it chooses between."""

from __future__ import annotations

import inspect

from flwr.serverapp.strategy import Strategy

from nebula_fl.config import Section
from nebula_fl.strategies.adapter_strategy import AdapterStrategy
from nebula_fl.strategies.base import NebulaStrategy
from nebula_fl.strategies.flower import flower_outer


def check_strategy_class(cls: object, *, name: str, where: str) -> type[AdapterStrategy]:
    """A loaded plugin is a usable AdapterStrategy subclass registered under its own name, or a Flower Message-API
    strategy class (returned wrapped, named by its entry point), or a ValueError why."""
    if isinstance(cls, type) and issubclass(cls, Strategy) and not issubclass(cls, NebulaStrategy):
        return flower_outer(cls, name=name, where=where)
    if not (isinstance(cls, type) and issubclass(cls, AdapterStrategy)):
        raise ValueError(f"{where} is {cls!r}, not a subclass of "
                         "nebula_fl.strategies.adapter_strategy.AdapterStrategy or of Flower's "
                         "flwr.serverapp.strategy.Strategy; fix the plugin")
    if inspect.isabstract(cls):
        raise ValueError(f"{where} does not implement {sorted(cls.__abstractmethods__)}; fix the plugin")
    if getattr(cls, "name", None) != name:
        raise ValueError(f"{where} defines name = {getattr(cls, 'name', None)!r}, but is registered as '{name}'; "
                         "make them equal")
    lr = getattr(cls, "default_lr", None)
    if not (isinstance(lr, int | float) and not isinstance(lr, bool) and 0 < lr <= 10):
        raise ValueError(f"{where} has default_lr = {lr!r}; set a class default_lr in (0, 10]")
    if not (isinstance(cls.Options, type) and issubclass(cls.Options, Section) and cls.Options.PREFIX == "strategy"):
        raise ValueError(f"{where}'s Options must be a nebula_fl.config.Section dataclass with PREFIX = 'strategy'")
    if not isinstance(cls.needs_individual_updates, bool):
        raise ValueError(f"{where} has needs_individual_updates = {cls.needs_individual_updates!r}; use True or False")
    return cls
