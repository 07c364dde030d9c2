"""Opacus DP-SGD around our model: equal to a plain step without noise or clipping, noise of the set scale."""

import numpy as np
import pytest
import torch

from nebula_fl.config import ModelConfig
from nebula_fl.model.adapter import adapter_arrays, load_adapter_arrays
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.model.loading import build_model, load_tokenizer
from nebula_fl.privacy.sample_dp import Batches, make_private, train_private_steps
from tests.conftest import dp_steps_one_at_a_time

TEXTS = ["the match ended in a draw", "shares fell on the stock market", "the minister resigned today",
         "a new phone was launched", "the film won an award", "profits rose sharply this year",
         "the striker scored twice", "the election is next week"]
LABELS = np.array([3, 0, 2, 4, 1, 0, 3, 2])


@pytest.fixture
def parts(tiny_model):
    cfg = ModelConfig(model=str(tiny_model), max_seq_len=16)
    data = TokenizedTexts(load_tokenizer(tiny_model), TEXTS, LABELS, max_len=16)

    def fresh():
        model = build_model(cfg, num_labels=5, seed=0)
        for module in model.modules():  # the comparisons need the same forward pass: no dropout draws
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        return model

    return fresh, data


def one_step(model, data, *, private: bool, noise: float, clip: float, optimizer_cls=torch.optim.SGD, lr=0.5,
             physical=None):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_cls(params, lr=lr)
    if private:
        training = make_private(model=model, optimizer=optimizer, data=data, batch_size=len(data),
                                noise_multiplier=noise, max_grad_norm=clip, distributed=False, poisson_sampling=False,
                                physical_batch_size=physical)
        losses = train_private_steps(training, Batches(training.loader), steps=1, device=torch.device("cpu"))
        assert len(losses) == 1 and np.isfinite(losses[0])
    else:
        model.train()
        batch = data.batch(range(len(data)))
        loss = torch.nn.functional.cross_entropy(model(input_ids=batch["input_ids"],
                                                       attention_mask=batch["attention_mask"]), batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return adapter_arrays(model)


def test_without_noise_or_clipping_a_dp_step_is_a_plain_step(parts):
    """Guards against silently corrupted LoRA updates under Opacus + PEFT (opacus issue #820)."""
    fresh, data = parts
    before = adapter_arrays(fresh())
    plain = one_step(fresh(), data, private=False, noise=0.0, clip=1e9, optimizer_cls=torch.optim.AdamW, lr=1e-2)
    dp = one_step(fresh(), data, private=True, noise=0.0, clip=1e9, optimizer_cls=torch.optim.AdamW, lr=1e-2)
    for k in plain:
        np.testing.assert_allclose(dp[k], plain[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert any(not np.allclose(plain[k], before[k]) for k in plain)  # the step did move the adapter
    assert all(np.isfinite(v).all() for v in dp.values())


def test_a_logical_batch_in_physical_chunks_is_one_step_over_the_whole_batch(parts):
    """privacy.batch-size > batch-size: Opacus accumulates clipped chunks and steps once, as one plain step."""
    fresh, data = parts
    plain = one_step(fresh(), data, private=False, noise=0.0, clip=1e9, optimizer_cls=torch.optim.AdamW, lr=1e-2)
    chunked = one_step(fresh(), data, private=True, noise=0.0, clip=1e9, optimizer_cls=torch.optim.AdamW, lr=1e-2,
                       physical=3)
    model = fresh()
    probe = make_private(model=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad]),
                         data=data, batch_size=len(data), noise_multiplier=0.0, max_grad_norm=1e9, distributed=False,
                         poisson_sampling=False, physical_batch_size=3)
    chunks = list(probe.loader)
    assert sorted(len(chunk[0]) for chunk in chunks) == [2, 3, 3]  # the step above saw three chunks
    # chunks are cut from the batch sorted by length: each pads only to its own longest, never to the batch's
    lengths = [chunk[1].sum(dim=1).tolist() for chunk in chunks]
    flat = [n for chunk in lengths for n in chunk]
    assert flat == sorted(len(x) for x in data.ids)
    assert [chunk[0].shape[1] for chunk in chunks] == [max(n) for n in lengths]
    for k in plain:
        np.testing.assert_allclose(chunked[k], plain[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_clipping_bounds_each_example_and_noise_has_the_configured_scale(parts):
    fresh, data = parts
    start = fresh()
    base = adapter_arrays(start)
    clean = one_step(fresh(), data, private=True, noise=0.0, clip=0.01)
    sigma, clip, lr, batch = 2.0, 0.01, 0.5, len(data)
    diffs = []
    for seed in range(6):
        torch.manual_seed(seed)
        model = fresh()
        noisy = one_step(model, data, private=True, noise=sigma, clip=clip)
        diffs.append(np.concatenate([(noisy[k] - clean[k]).ravel() for k in clean]))
    noise = np.concatenate(diffs) / lr  # SGD: parameter change = lr x (clipped mean gradient + noise)
    expected = sigma * clip / batch  # Opacus adds N(0, (sigma C)^2) to the sum, then divides by the batch
    n = noise.size
    # the sample std of n normal draws lies within a few standard errors (std / sqrt(2n)) of the truth
    assert abs(noise.std() - expected) < 5 * expected / np.sqrt(2 * n)
    assert abs(noise.mean()) < 5 * expected / np.sqrt(n)
    # with clipping, no example moves the adapter by more than lr x C / batch in norm
    step = np.concatenate([(clean[k] - base[k]).ravel() for k in clean])
    assert np.linalg.norm(step) <= lr * clip * 1.0001


def test_the_loaded_global_adapter_is_what_opacus_trains(parts):
    fresh, data = parts
    model = fresh()
    params = [p for p in model.parameters() if p.requires_grad]
    training = make_private(model=model, optimizer=torch.optim.SGD(params, lr=0.1), data=data, batch_size=4,
                            noise_multiplier=1.0, max_grad_norm=1.0, distributed=False)
    target = {k: np.full_like(v, 0.01) for k, v in adapter_arrays(model).items()}
    load_adapter_arrays(model, target)  # what the trainer does each round, after make_private
    batch = data.batch(range(4))
    with torch.no_grad():
        a = training.module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        b = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    torch.testing.assert_close(a, b)
    assert 0 < training.sample_rate <= 1


def test_an_empty_poisson_batch_of_the_encoder_is_a_pure_noise_step(parts):
    """Expected batch 1 of 8 texts: some Poisson batches are empty. BERT cannot run on zero rows, so the step must
    not call it; it still adds noise to every weight and reports a NaN loss, and training carries on."""
    fresh, data = parts
    model = fresh()
    params = [p for p in model.parameters() if p.requires_grad]
    training = make_private(model=model, optimizer=torch.optim.SGD(params, lr=0.1), data=data, batch_size=1,
                            noise_multiplier=1.0, max_grad_norm=1.0, distributed=False, physical_batch_size=1)
    losses, empty_moves = dp_steps_one_at_a_time(training, params)
    assert empty_moves and all(bool((move != 0).all()) for move in empty_moves) and np.isfinite(losses).any()
