"""The Task interface and its registry: built-ins found by name, options checked by the task, what is exchanged
(an adapter or every trainable weight) round-trips exactly, and the run config refuses what a task cannot do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import pytest
import torch
from torch import nn

from nebula_fl.components import load as load_config
from nebula_fl.config import ModelConfig, Section, check_int
from nebula_fl.errors import ConfigError
from nebula_fl.model.adapter import adapter_arrays
from nebula_fl.tasks import TASKS, Task, TaskSetup, make_task
from nebula_fl.tasks.base import check_task_class


@dataclass(kw_only=True, frozen=True)
class _Width(Section):
    PREFIX: ClassVar[str] = "task"
    width: int = 3

    def __post_init__(self) -> None:
        check_int("task.width", self.width, low=1, high=64, fix="use 1 to 64")


class _Toy(Task):
    """Every weight trainable and exchanged; one frozen buffer-like parameter that must never be sent."""

    name = "toy"
    exchange = "full"
    Options = _Width

    def build_model(self, setup):
        torch.manual_seed(setup.seed)
        model = nn.Sequential(nn.Linear(2, self.options.width), nn.Linear(self.options.width, 1))
        model[0].bias.requires_grad_(False)
        return model

    def examples(self, *, setup, tokenizer, texts, labels, train):
        raise NotImplementedError

    def loss(self, model, batch):
        return model(batch["x"]).pow(2).mean()

    def evaluate(self, model, data, *, batch_size):
        return {"loss": 0.0, "accuracy": 0.0}


def test_builtins_are_found_by_name_and_unknown_names_get_a_hint():
    assert {"classify", "mlm", "distill"} <= set(TASKS.names())
    assert make_task("classify").metric == "accuracy"
    with pytest.raises(ConfigError, match=r"unknown task 'clasify'; did you mean 'classify'\?"):
        make_task("clasify")


def test_full_exchange_is_every_trainable_weight_and_round_trips(tmp_path):
    task = _Toy(options={"task.width": 4})
    setup = TaskSetup(model=ModelConfig(), labels=[], seed=3, path=tmp_path)
    a, b = task.build_model(setup), task.build_model(TaskSetup(model=ModelConfig(), labels=[], seed=4, path=tmp_path))
    sent = task.exchanged(a)
    assert sorted(sent) == ["0.weight", "1.bias", "1.weight"]  # the frozen bias stays home
    assert sent["0.weight"].shape == (4, 2) and all(v.dtype == np.float32 for v in sent.values())
    task.load_exchanged(b, sent)
    for key, value in task.exchanged(b).items():
        np.testing.assert_array_equal(value, sent[key])
    assert not torch.equal(a[0].bias, b[0].bias)  # not exchanged, so not overwritten
    with pytest.raises(ValueError, match=r"1\.bias"):
        task.load_exchanged(b, {k: v for k, v in sent.items() if k != "1.bias"})
    assert task.fingerprint(a) == ""


def test_classify_exchanges_exactly_the_peft_adapter(tiny_model):
    task = make_task("classify")
    setup = TaskSetup(model=ModelConfig(model=str(tiny_model), max_seq_len=16), labels=["a", "b"], seed=0,
                      path=tiny_model)
    model = task.build_model(setup)
    sent = task.exchanged(model)
    expected = adapter_arrays(model)
    assert sorted(sent) == sorted(expected) and any("lora_B" in k for k in sent) and any("head" in k for k in sent)
    assert sum(v.size for v in sent.values()) < sum(p.numel() for p in model.parameters()) / 10


def test_task_options_are_checked_by_the_task():
    with pytest.raises(ConfigError, match=r"unknown config key 'task\.temprature'; did you mean 'task\.temperature'"):
        load_config({"task.name": "distill", "task.temprature": 2.0})
    with pytest.raises(ConfigError, match=r"task\.temperature"):
        load_config({"task.name": "distill", "task.temperature": -1.0})
    with pytest.raises(ConfigError, match=r"unknown config key 'task\.layers'"):
        load_config({"task.layers": 2})  # classify has no options
    cfg = load_config({"task.name": "mlm", "task.layers": 2})
    assert cfg.to_flat()["task.layers"] == 2 and cfg.to_flat()["task.name"] == "mlm"


def test_a_privacy_mode_the_task_cannot_run_is_refused():
    with pytest.raises(ConfigError, match=r"privacy\.mode.*task .mlm."):
        load_config({"task.name": "mlm", "privacy.mode": "sample", "privacy.target-epsilon": 8.0})
    load_config({"task.name": "mlm", "privacy.mode": "client", "privacy.target-epsilon": 8.0})


def test_a_plugin_class_is_checked_before_use():
    with pytest.raises(ValueError, match="registered as 'other'"):
        check_task_class(_Toy, name="other", where="task plugin 'other'")
    with pytest.raises(ValueError, match="not a subclass"):
        check_task_class(dict, name="toy", where="task plugin 'toy'")

    class Bad(_Toy):
        exchange = "half"

    with pytest.raises(ValueError, match="exchange"):
        check_task_class(Bad, name="toy", where="task plugin 'toy'")
    assert check_task_class(_Toy, name="toy", where="x") is _Toy


def test_the_task_preset_is_merged_over_the_generic_one(tmp_path):
    from argparse import Namespace

    from nebula_fl.launcher.plan import make_plan

    args = Namespace(resume=None, rewind=False, clusters=2, preset="smoke", task="mlm", rounds=None, local_steps=None,
                     outer_optimizer=None, partition=None, seed=None, codec=None, secure_aggregation=None,
                     run_config=None, out=str(tmp_path / "run"), workers_per_cluster=None, device=None, port=0,
                     wan=None, secure=None)
    flat = make_plan(args).config.to_flat()
    assert flat["task.name"] == "mlm"
    for key, value in make_task("mlm").presets["smoke"].items():
        assert flat[key] == value, key
    assert flat["max-examples"] == make_task("mlm").presets["smoke"].get("max-examples", 300)


def test_run_help_names_every_built_in_task():
    """`nebula-fl run --help` is where a user looks for what can be trained: every built-in task is listed."""
    from nebula_fl.cli import parser
    from nebula_fl.tasks import TASKS

    run = next(a for a in parser()._subparsers._group_actions[0].choices.items() if a[0] == "run")[1]
    text = next(a.help for a in run._actions if "--task" in a.option_strings)
    assert all(name in text for name in TASKS._builtins()), text
