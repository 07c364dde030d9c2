import tomllib
from dataclasses import FrozenInstanceError

import pytest
from flwr.common.config import flatten_dict

from nebula_fl.components import load as load_config
from nebula_fl.config import PRESETS, RunConfig, default_run_config
from nebula_fl.errors import ConfigError
from tests.conftest import REPO


def test_pyproject_mirrors_the_config_dataclasses_key_for_key():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    app_config = flatten_dict(pyproject["tool"]["flwr"]["app"]["config"])  # as Flower flattens comm.codec & co
    assert app_config == default_run_config()


def test_flat_round_trip_is_identity():
    cfg = RunConfig().replace({"local-steps": 7, "outer-lr": 0.3, "partition": "iid"})
    assert load_config(cfg.to_flat()) == cfg
    assert cfg.train.local_steps == 7 and cfg.outer.outer_lr == 0.3 and cfg.data.partition == "iid"


def test_auto_maps_to_none_and_back():
    cfg = load_config({"outer-lr": "auto"})
    assert cfg.outer.outer_lr is None
    assert cfg.to_flat()["outer-lr"] == "auto"


def test_unknown_key_names_the_closest_known_one():
    with pytest.raises(ConfigError, match="unknown config key 'local-step'; did you mean 'local-steps'"):
        load_config({"local-step": 3})


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("local-steps", 2.5, "must be int"),
        ("local-steps", 0, "use 1 or more"),
        ("lr", "fast", "must be float"),
        ("resume", 1, "must be bool"),
        ("partition", "dirichlet:-1", "alpha must be > 0"),
        ("partition", "shards", "use 'iid' or 'dirichlet:ALPHA'"),
        ("outer-optimizer", "sgd", "use one of fedavg"),
        ("outer-momentum", 1.5, r"\[0, 1\)"),
        ("test-fraction", 1.0, "strictly between 0 and 1"),
    ],
)
def test_bad_values_are_rejected_with_the_key_named(key, value, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_config({key: value})
    assert key in str(err.value)
    assert "\n" not in str(err.value)


def test_ints_are_accepted_for_floats():
    assert load_config({"lr": 1}).train.lr == 1.0


def test_presets_are_valid_configs():
    for overrides in PRESETS.values():
        RunConfig().replace(overrides)


def test_sections_are_frozen():
    with pytest.raises(FrozenInstanceError):
        RunConfig().train.lr = 1.0  # type: ignore[misc]


def test_auto_local_steps_is_refused_with_secure_aggregation():
    # the server sees only the sum under secure aggregation, so it cannot FedNova-normalise unequal step counts
    with pytest.raises(ConfigError, match=r"'local-steps' is \"auto\" with secagg.enabled.*use a fixed local-steps") \
            as err:
        load_config({"secagg.enabled": True, "comm.codec": "randk:0.1", "local-steps": "auto"})
    assert "\n" not in str(err.value)
    assert load_config({"secagg.enabled": True, "comm.codec": "randk:0.1", "local-steps": 4}).train.local_steps == 4
    assert load_config({"local-steps": "auto"}).train.local_steps is None


def test_auto_keys_settle_to_the_tasks_own_defaults():
    """An encoder and a decoder want different rates, warm-ups and lengths: "auto" is the task's, recorded as a
    number; what a user sets stays."""
    from nebula_fl.components import settle

    encoder = settle(RunConfig.from_flat({}))
    assert (encoder.train.lr, encoder.train.lr_warmup_ratio, encoder.model.max_seq_len) == (5e-3, 0.0, 128)
    decoder = settle(RunConfig.from_flat({"task.name": "causal-lm"}))
    assert (decoder.train.lr, decoder.train.lr_warmup_ratio, decoder.model.max_seq_len) == (2e-4, 0.03, 1024)
    assert decoder.model.lora_alpha == 16 and decoder.model.lora_target_modules == "auto"
    assert settle(RunConfig.from_flat({"lora-r": 32})).model.lora_alpha == 64  # alpha follows the rank
    mine = settle(RunConfig.from_flat({"task.name": "causal-lm", "lr": 1e-4, "max-seq-len": 512, "lora-alpha": 8}))
    assert (mine.train.lr, mine.model.max_seq_len, mine.model.lora_alpha) == (1e-4, 512, 8)
    flat = decoder.to_flat()
    assert flat["lr"] == 2e-4 and flat["max-seq-len"] == 1024 and "auto" not in (flat["lr-warmup-ratio"],)
