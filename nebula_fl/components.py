"""The plug-in names of a run config resolved to classes, and every check that needs a class.

``config.py`` validates values and names plug-ins but imports none of them: a config is read without loading
torch, a model or a plug-in package, and no import circle runs config -> tasks -> model -> strategies -> config.
What depends on the chosen classes is checked here, once, by ``resolve``: the task's and the strategy's own
options (``task.*``, ``strategy.*``, each with its did-you-mean), the codec chains (codecs are plug-ins too), the privacy modes the task supports, and a
strategy that needs each update under secure aggregation. The launcher, the ServerApp and the fuzzer call it,
so each refuses the same config with the same sentence before anything starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nebula_fl.config import RunConfig, Scalar, Section, require, show
from nebula_fl.errors import ConfigError

if TYPE_CHECKING:
    from nebula_fl.strategies.adapter_strategy import AdapterStrategy
    from nebula_fl.tasks.base import Task


def check_options(options_cls: type[Section], given: Mapping[str, Any], *, owner: str) -> Section:
    """`given` parsed by a plug-in's Options section, or a ConfigError naming the unknown key and the closest one."""
    known = options_cls.flat_keys()
    for key in given:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"{owner} knows {sorted(known) or 'none'}"
            raise ConfigError(f"unknown config key {show(key)}; {hint}")
    return options_cls.from_flat(given)


@dataclass(frozen=True)
class Components:
    """The classes a run config names, after every check that needs them passed."""

    task: type[Task]
    strategy: type[AdapterStrategy]

    def flat(self, cfg: RunConfig) -> dict[str, Scalar]:
        """The run config with every task and strategy option spelled out, defaults included: what a run folder's
        config.json records, so a run can be read (and repeated) without knowing the plug-ins' defaults."""
        task = self.task.Options.from_flat(dict(cfg.task_options)).to_flat()
        strategy = self.strategy.Options.from_flat(dict(cfg.strategy_options)).to_flat()
        return {**cfg.to_flat(), **task, **strategy}


def resolve(cfg: RunConfig) -> Components:
    """The task and strategy classes of `cfg`, or a ConfigError naming the key: an unknown or broken plug-in, an
    unknown or bad option, a privacy mode the task cannot run, a strategy secure aggregation cannot serve."""
    from nebula_fl.compression import CodecError, parse_spec
    from nebula_fl.strategies import strategy_class
    from nebula_fl.tasks import task_class

    for key, spec in (("comm.codec", cfg.comm.codec), ("comm.codec-down", cfg.comm.codec_down)):
        if key == "comm.codec-down" and spec == "same":
            continue
        try:
            parse_spec(spec)
        except CodecError as err:
            raise ConfigError(f"config key '{key}' {err}") from None

    try:
        task = task_class(cfg.task.name)
    except ConfigError as err:
        raise ConfigError(f"config key 'task.name': {err}") from None
    check_options(task.Options, cfg.task_options, owner=f"task '{cfg.task.name}'")
    require(cfg.privacy.mode in task.privacy_modes, "privacy.mode", f"is '{cfg.privacy.mode}' with task "
             f"'{cfg.task.name}'", f"use one of {', '.join(task.privacy_modes)} (what that task supports)")
    try:
        strategy = strategy_class(cfg.outer.outer_optimizer)
    except ConfigError as err:
        raise ConfigError(f"config key 'outer-optimizer': {err}") from None
    check_options(strategy.Options, cfg.strategy_options, owner=f"outer optimizer '{cfg.outer.outer_optimizer}'")
    strategy.check_config(cfg)
    if cfg.secagg.enabled:
        require(not strategy.needs_individual_updates, "outer-optimizer",
                 f"is '{cfg.outer.outer_optimizer}' with secure aggregation",
                 "turn secagg.enabled off or use a mean-based optimizer (it needs each cluster's update; "
                 "secure aggregation shows the server only their sum)")
    return Components(task=task, strategy=strategy)


def settle(cfg: RunConfig) -> RunConfig:
    """`cfg` with the task-dependent "auto" keys (lr, lr-warmup-ratio, max-seq-len) as its task's values."""
    from nebula_fl.tasks import task_class

    return cfg.settled(task_class(cfg.task.name).run_defaults())


def load(flat: Mapping[str, Any]) -> RunConfig:
    """A flat run config (Flower's, ``--run-config``'s, a run folder's) validated whole: values, then plug-ins."""
    cfg = RunConfig.from_flat(flat)
    resolve(cfg)
    return cfg
