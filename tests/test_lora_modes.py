"""lora-mode: FFA-LoRA's shared frozen A makes the mean of the clusters' adapters the mean of their layers.

The reference for "the layer a cluster ends with" is PEFT's own ``merge_and_unload`` (W + scale·B·A),
not this project's code.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from nebula_fl.config import ConfigError, ModelConfig
from nebula_fl.model.adapter import adapter_arrays, adapter_shapes, load_adapter_arrays
from nebula_fl.model.frozen_a import fingerprint, frozen_keys, shared_a
from nebula_fl.model.loading import build_model


def _build(tiny_model, mode: str, seed: int = 0):
    cfg = ModelConfig(model=str(tiny_model), lora_mode=mode, lora_r=4)
    return build_model(cfg, num_labels=3, seed=seed, path=tiny_model)


def _merged(model) -> dict[str, np.ndarray]:
    """Every dense weight of the model with its adapter merged in, by PEFT."""
    merged = copy.deepcopy(model).merge_and_unload()
    return {k: v.detach().numpy().copy() for k, v in merged.state_dict().items()}


def _local_training(model, seed: int) -> None:
    """A cluster's divergent local training, stood in for by a random step on every trainable tensor."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


def test_frozen_a_exchanges_only_b_and_the_head(tiny_model):
    standard, frozen = _build(tiny_model, "standard"), _build(tiny_model, "frozen-a")
    assert any(".lora_A." in k for k in adapter_shapes(standard))
    assert not any(".lora_A." in k for k in adapter_shapes(frozen))
    assert set(adapter_shapes(frozen)) == {k for k in adapter_shapes(standard) if ".lora_A." not in k}
    assert frozen_keys(frozen) and all(".lora_A." in k for k in frozen_keys(frozen))
    trainable = [n for n, p in frozen.named_parameters() if p.requires_grad]
    assert trainable and not any("lora_A" in n for n in trainable)
    sent = sum(int(np.prod(s)) for s in adapter_shapes(frozen).values())
    assert sent < sum(int(np.prod(s)) for s in adapter_shapes(standard).values())


def test_shared_a_depends_on_the_seed_alone(tiny_model):
    torch.manual_seed(123)  # whatever the global RNG did before must not matter
    a = _build(tiny_model, "frozen-a", seed=7)
    torch.manual_seed(999)
    torch.rand(1000)
    b = _build(tiny_model, "frozen-a", seed=7)
    assert fingerprint(a) == fingerprint(b) != ""
    assert fingerprint(_build(tiny_model, "frozen-a", seed=8)) != fingerprint(a)
    assert fingerprint(_build(tiny_model, "standard")) == ""
    # PEFT's default A distribution: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    draw = shared_a(7, "x", (64, 256))
    assert float(draw.abs().max()) <= 1 / 16 and float(draw.abs().max()) > 0.9 / 16
    assert abs(float(draw.mean())) < 0.01 / 16 * 10


@pytest.mark.parametrize("mode", ["standard", "frozen-a"])
def test_the_mean_of_adapters_is_the_mean_of_layers_only_with_a_frozen(tiny_model, mode):
    clusters = [_build(tiny_model, mode) for _ in range(3)]
    for i, model in enumerate(clusters):
        _local_training(model, seed=i)
    mean = {k: np.mean([adapter_arrays(m)[k] for m in clusters], axis=0) for k in adapter_shapes(clusters[0])}
    server = _build(tiny_model, mode)
    load_adapter_arrays(server, mean)
    reference = {k: np.mean([_merged(m)[k] for m in clusters], axis=0) for k in _merged(clusters[0])}
    got = _merged(server)
    lora_layers = [k for k in reference if ("query" in k or "value" in k) and k.endswith("weight")]
    assert lora_layers
    error = max(float(np.abs(got[k] - reference[k]).max()) for k in lora_layers)
    if mode == "frozen-a":
        assert error < 1e-5
    else:  # mean(B)·mean(A) != mean(B·A): the naive average is off by far more than rounding
        assert error > 1e-3


def test_a_frozen_adapter_round_trips_and_refuses_lora_a(tiny_model):
    model = _build(tiny_model, "frozen-a")
    before = fingerprint(model)
    arrays = {k: v + 1.0 for k, v in adapter_arrays(model).items()}
    load_adapter_arrays(model, arrays)
    assert all(np.array_equal(adapter_arrays(model)[k], arrays[k]) for k in arrays)
    assert fingerprint(model) == before  # loading the exchanged tensors never touches A
    a_key = next(iter(frozen_keys(model)))
    with pytest.raises(Exception, match="adapter"):
        load_adapter_arrays(model, {**arrays, a_key: np.zeros((4, 4), np.float32)})


def test_an_unknown_lora_mode_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"lora-mode.*frozen-a"):
        ModelConfig(lora_mode="product")
