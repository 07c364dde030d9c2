"""components.resolve: the plug-in checks that left config.py, and the strategy options section."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest

from nebula_fl.components import load, resolve
from nebula_fl.config import OuterConfig, RunConfig, Section, require
from nebula_fl.errors import ConfigError
from nebula_fl.strategies import BUILTIN_STRATEGIES, make_strategy
from nebula_fl.strategies.fedavg import AdapterFedAvg


def test_reading_a_config_imports_no_plugin_model_or_torch():
    code = ("import sys, nebula_fl.config as c; c.RunConfig.from_flat({'task.name': 'mlm', 'task.layers': 2, "
            "'strategy.trim': 0.1, 'comm.codec': 'topk:0.1+int8', 'outer-optimizer': 'adam'}); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith(('nebula_fl', 'torch', 'flwr')))))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "nebula_fl.config" in loaded
    plugins = ("nebula_fl.tasks", "nebula_fl.strategies", "nebula_fl.compression", "nebula_fl.model", "torch", "flwr")
    assert not [m for m in loaded if m.startswith(plugins)]


@dataclass(kw_only=True, frozen=True)
class TrimOptions(Section):
    PREFIX: ClassVar[str] = "strategy"
    trim: float = 0.2
    """Share cut from each end; in [0, 0.5)."""

    def __post_init__(self) -> None:
        require(isinstance(self.trim, float) and 0 <= self.trim < 0.5, "strategy.trim", f"is {self.trim!r}",
                 "use a share in [0, 0.5)")


class Trim(AdapterFedAvg):
    name = "trim-test"
    needs_individual_updates = True
    Options = TrimOptions


@pytest.fixture
def trim(monkeypatch):
    monkeypatch.setitem(BUILTIN_STRATEGIES, Trim.name, Trim)
    return Trim


def test_strategy_options_reach_the_strategy(trim):
    cfg = load({"outer-optimizer": "trim-test", "strategy.trim": 0.3})
    strategy = make_strategy(cfg.outer, options=cfg.strategy_options)
    assert isinstance(strategy, Trim) and strategy.options.trim == 0.3
    assert make_strategy(cfg.outer).options.trim == 0.2  # the default when the key is absent
    assert cfg.to_flat()["strategy.trim"] == 0.3 and RunConfig.from_flat(cfg.to_flat()) == cfg


def test_a_misspelt_or_bad_strategy_option_is_refused_in_one_line(trim):
    with pytest.raises(ConfigError, match=r"unknown config key 'strategy\.trm'; did you mean 'strategy\.trim'\?"):
        load({"outer-optimizer": "trim-test", "strategy.trm": 0.3})
    with pytest.raises(ConfigError, match=r"config key 'strategy\.trim' is 0\.7; use a share in \[0, 0\.5\)"):
        load({"outer-optimizer": "trim-test", "strategy.trim": 0.7})
    with pytest.raises(ConfigError, match=r"unknown config key 'strategy\.trim'; outer optimizer 'fedavg' knows none"):
        load({"strategy.trim": 0.3})  # the built-ins have no strategy.* options


def test_resolve_refuses_what_needs_a_class(trim):
    with pytest.raises(ConfigError, match=r"config key 'outer-optimizer': unknown outer optimizer 'fedavgg'; did you mean 'fedavg'"):
        resolve(RunConfig(outer=OuterConfig(outer_optimizer="fedavgg")))
    with pytest.raises(ConfigError, match=r"'outer-optimizer' is 'trim-test' with secure aggregation"):
        load({"outer-optimizer": "trim-test", "secagg.enabled": True})
    with pytest.raises(ConfigError, match=r"config key 'task\.name': unknown task 'clasify'; did you mean 'classify'"):
        load({"task.name": "clasify"})


def test_the_recorded_config_spells_out_every_plugin_default(trim):
    cfg = load({"task.name": "distill", "task.alpha": 0.25, "outer-optimizer": "trim-test"})
    flat = resolve(cfg).flat(cfg)
    assert flat["task.alpha"] == 0.25 and flat["task.temperature"] == 2.0 and flat["strategy.trim"] == 0.2
    assert "task.temperature" not in cfg.to_flat()  # what was given, and no more
    assert load(flat) == RunConfig.from_flat(flat)  # the recorded config reads back as it was
