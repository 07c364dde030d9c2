"""Only the adapter (LoRA factors and the head) crosses; the base model never changes."""

import numpy as np
import pytest
import torch

from nebula_fl.clients.inner_loop import BatchSchedule, train_steps
from nebula_fl.config import ModelConfig
from nebula_fl.model.adapter import adapter_arrays, load_adapter_arrays
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.loading import build_model, load_tokenizer

TEXTS = ["the match ended in a draw", "shares fell on the stock market", "the minister resigned today",
         "a new phone was launched", "the film won an award", "profits rose sharply this year"] * 4
LABELS = np.array([3, 0, 2, 4, 1, 0] * 4)


@pytest.fixture
def model_and_data(tiny_model):
    cfg = ModelConfig(model=str(tiny_model), max_seq_len=16, lora_target_modules="query,value")
    model = build_model(cfg, num_labels=5, seed=0)
    data = TokenizedTexts(load_tokenizer(tiny_model), TEXTS, LABELS, max_len=16)
    return model, data


def test_only_adapter_and_head_keys_cross(model_and_data):
    model, _ = model_and_data
    keys = set(adapter_arrays(model))
    assert keys and all(("lora_A" in k or "lora_B" in k or ".head." in k) for k in keys)
    assert any(".head." in k for k in keys)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert all(("lora_" in n or "head" in n) for n in trainable)
    total = sum(p.numel() for p in model.parameters())
    crossing = sum(v.size for v in adapter_arrays(model).values())
    assert crossing < 0.1 * total


def test_base_weights_unchanged_after_a_round_and_adapter_moves(model_and_data):
    model, data = model_and_data
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapter_before = adapter_arrays(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = train_steps(model, opt, data, BatchSchedule(len(data), batch_size=4, seed=0, rank=0), steps=5,
                         max_grad_norm=1.0, device=torch.device("cpu"))
    assert len(losses) == 5 and all(np.isfinite(losses))
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, base_before[n]), n
    after = adapter_arrays(model)
    moved = [k for k in after if not np.array_equal(after[k], adapter_before[k])]
    assert any("lora_B" in k for k in moved) and any(".head." in k for k in moved)


def test_adapter_round_trip_reproduces_the_model(model_and_data, tiny_model):
    model, data = model_and_data
    params = [p for p in model.parameters() if p.requires_grad]
    train_steps(model, torch.optim.AdamW(params, lr=1e-2), data, BatchSchedule(len(data), batch_size=4, seed=0, rank=0),
                steps=3, max_grad_norm=0.0, device=torch.device("cpu"))
    other = build_model(ModelConfig(model=str(tiny_model), max_seq_len=16), num_labels=5, seed=123)
    load_adapter_arrays(other, adapter_arrays(model))
    batch = data.batch(range(6))
    model.eval()
    other.eval()
    with torch.no_grad():
        a = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        b = other(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(a, b)


def test_loading_a_mismatched_adapter_is_refused(model_and_data):
    model, _ = model_and_data
    arrays = adapter_arrays(model)
    key = next(iter(arrays))
    with pytest.raises(ValueError, match="shape"):
        load_adapter_arrays(model, {**arrays, key: np.zeros((1, 1), np.float32)})
    with pytest.raises(ValueError, match="keys do not match"):
        load_adapter_arrays(model, {k: v for k, v in arrays.items() if k != key})
