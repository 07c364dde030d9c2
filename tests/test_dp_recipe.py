"""What privacy.mode="sample" trains with by default: the rules, and that an explicit key wins."""

import math

import pytest

from nebula_fl.config import ConfigError, RunConfig
from nebula_fl.model.frozen_a import lora_mode
from nebula_fl.privacy.dp_recipe import learning_rate, logical_batch


def test_the_logical_batch_is_an_eighth_of_the_data_under_sample_dp_only():
    assert logical_batch(requested=None, num_examples=4001, batch_size=64, world=1, private=True) == 501
    assert logical_batch(requested=None, num_examples=4001, batch_size=64, world=1, private=False) == 64
    assert logical_batch(requested=None, num_examples=40, batch_size=8, world=2, private=True) == 16  # >= 1 per worker
    assert logical_batch(requested=300, num_examples=4001, batch_size=64, world=1, private=True) == 300


def test_the_rate_follows_the_square_root_rule_unless_set():
    assert learning_rate(requested=None, lr=5e-3, logical=512, batch_size=64, world=1) == pytest.approx(5e-3 * math.sqrt(8))
    assert learning_rate(requested=None, lr=5e-3, logical=16, batch_size=16, world=1) == 5e-3
    assert learning_rate(requested=1e-2, lr=5e-3, logical=512, batch_size=64, world=1) == 1e-2


def test_lora_mode_auto_is_frozen_a_under_sample_dp():
    assert lora_mode(requested="auto", privacy_mode="sample") == "frozen-a"
    assert lora_mode(requested="auto", privacy_mode="client") == "standard"
    assert lora_mode(requested="auto", privacy_mode="off") == "standard"
    assert lora_mode(requested="standard", privacy_mode="sample") == "standard"


@pytest.mark.parametrize(("key", "bad"), [("privacy.batch-size", 0), ("privacy.batch-size", -1),
                                          ("privacy.batch-size", 1_000_001), ("privacy.batch-size", 1.5),
                                          ("privacy.lr", 0), ("privacy.lr", -1e-3), ("privacy.lr", float("nan")),
                                          ("privacy.lr", 11)])
def test_bad_dp_recipe_keys_are_one_line_errors(key, bad):
    with pytest.raises(ConfigError) as err:
        RunConfig().replace({key: bad})
    assert key in str(err.value) and "\n" not in str(err.value)
