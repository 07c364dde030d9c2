"""Strategy and task plugins: examples/strategy_plugin and examples/task_plugin installed for real with pip, found
through their entry points, checked against hand-computed values, refused by name when broken, and run end to end
by a real federation (superlink, supernodes, trainers, serverapp) that imports them from PYTHONPATH."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from safetensors.numpy import load_file

from nebula_fl.clients.protocol import unpack
from nebula_fl.components import load as load_config
from nebula_fl.compression import Compressor, Layout
from nebula_fl.config import ModelConfig, OuterConfig
from nebula_fl.errors import ConfigError
from nebula_fl.strategies import STRATEGIES, make_strategy, strategy_class, strategy_names
from nebula_fl.strategies.adapter_strategy import to_numpy
from nebula_fl.tasks import TASKS, TaskSetup, make_task, task_class
from tests.conftest import put_on_path, take_off_path
from tests.test_strategy import FakeGrid, _reply

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"nebula_trimmed_mean": REPO / "examples" / "strategy_plugin",
            "nebula_linear_probe": REPO / "examples" / "task_plugin"}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """pip-installs copies of both examples (no build files land in the repo) into one private folder."""
    work = tmp_path_factory.mktemp("plugins")
    target = work / "site"
    sources = [str(shutil.copytree(src, work / module, ignore=shutil.ignore_patterns("build", "*.egg-info")))
               for module, src in EXAMPLES.items()]
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-build-isolation",
           "--disable-pip-version-check", "--quiet", "--target", str(target), *sources]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert all((target / module).is_dir() for module in EXAMPLES)
    put_on_path(target)
    yield target
    take_off_path(target, *EXAMPLES)


# -- discovery --------------------------------------------------------------------------------------------------
def test_both_plugins_are_found_through_their_entry_points(site):
    assert "trimmed-mean" in STRATEGIES.names() and strategy_names()[-1] == "trimmed-mean"
    assert strategy_names()[:4] == ["fedavg", "fedavgm", "nesterov", "adam"]  # built-ins first, in their order
    assert "linear-probe" in TASKS.names()
    assert strategy_class("trimmed-mean").__module__ == "nebula_trimmed_mean"
    assert task_class("linear-probe").__module__ == "nebula_linear_probe"
    dists = {ep.name: ep.dist.name for group in ("nebula_fl.strategies", "nebula_fl.tasks")
             for ep in importlib.metadata.entry_points(group=group)}
    assert dists["trimmed-mean"].replace("_", "-") == "nebula-trimmed-mean"
    assert dists["linear-probe"].replace("_", "-") == "nebula-linear-probe"


# -- the strategy -----------------------------------------------------------------------------------------------
GLOBAL = {"lora_A": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32), "head.bias": np.zeros(2, np.float32)}


def _round(strategy, updates, weights):
    record = ArrayRecord({k: Array(v) for k, v in GLOBAL.items()})
    nodes = list(range(1, len(updates) + 1))
    list(strategy.configure_train(1, record, ConfigRecord({}), FakeGrid(nodes)))
    replies = [_reply(n, u, {"num-examples": w, "train-loss": 1.0}) for n, u, w in zip(nodes, updates, weights)]
    arrays, metrics = strategy.aggregate_train(1, replies)
    return to_numpy(arrays), metrics


def test_trimmed_mean_drops_an_outlier_cluster_where_the_mean_follows_it(site):
    # 5 clusters, trim 0.2: per coordinate the smallest and largest value go, the middle three are averaged.
    # lora_A coordinates (row-major) of clusters 1..4, then cluster 5, the outlier:
    a = [[1, 2, 3, 0], [2, 2, 1, 1], [3, 0, 2, 2], [4, 1, 0, 3], [100, -50, 9, 40]]
    bias = [[0.1, 0.0], [0.2, 0.0], [0.3, 0.0], [0.4, 0.0], [-9.0, 0.0]]
    updates = [{"lora_A": np.array(x, np.float32).reshape(2, 2), "head.bias": np.array(b, np.float32)}
               for x, b in zip(a, bias)]
    # coord 0: 1 2 3 4 100 -> (2+3+4)/3 = 3; coord 1: -50 0 1 2 2 -> (0+1+2)/3 = 1;
    # coord 2: 0 1 2 3 9 -> 2; coord 3: 0 1 2 3 40 -> 2; bias 0: -9 .1 .2 .3 .4 -> (.1+.2+.3)/3 = .2
    robust = {"lora_A": np.array([[3.0, 1.0], [2.0, 2.0]]), "head.bias": np.array([0.2, 0.0])}
    weights = [10, 10, 10, 10, 1000]  # example counts do not buy the outlier influence
    strategy = make_strategy(OuterConfig(outer_optimizer="trimmed-mean"))
    new, metrics = _round(strategy, updates, weights)
    for key in GLOBAL:  # outer step: lr 1.0 x the robust mean
        np.testing.assert_allclose(new[key], GLOBAL[key] + robust[key], rtol=0, atol=1e-6, err_msg=key)
    # the share of each cluster's 6 coordinates inside the kept range (ties count): cluster 1 is cut at coordinates
    # 0 and 3, cluster 4 at 2 and bias 0, the outlier everywhere but bias 1, where all five tie at 0
    assert [n["strategy"]["kept_share"] for n in strategy.round_notes().values()] == pytest.approx(
        [4 / 6, 1, 1, 4 / 6, 1 / 6])
    assert strategy.round_summary() == {"strategy": {"cut_per_end": 1}}
    assert metrics["clusters"] == metrics["clusters-usable"] == 5  # each cluster's values entered some coordinate
    plain, _ = _round(make_strategy(OuterConfig(outer_optimizer="fedavg")), updates, weights)
    # the weighted mean goes where the outlier pulls: 1 + (10 * (1+2+3+4) + 1000 * 100) / 1040 = 97.25
    assert plain["lora_A"][0, 0] == pytest.approx(97.25) and new["lora_A"][0, 0] == pytest.approx(4.0)


def test_trimmed_mean_with_few_clusters_is_the_median(site):
    strategy = make_strategy(OuterConfig(outer_optimizer="trimmed-mean"))
    one = {"head.bias": np.zeros(2, np.float32)}

    def agg(*values):
        return strategy.aggregate_updates([{"b": np.array([v], np.float32)} for v in values], [1.0] * len(values))

    assert agg(1.0, 2.0, 50.0)["b"][0] == pytest.approx(2.0)  # 3: the median
    assert agg(1.0, 3.0, 4.0, 50.0)["b"][0] == pytest.approx(3.5)  # 4: mean of the middle two
    assert agg(1.0, 3.0)["b"][0] == pytest.approx(2.0)  # 2: nothing can be trimmed, their mean
    assert agg(7.0)["b"][0] == pytest.approx(7.0)
    assert set(strategy.aggregate_updates([one, one, one], [1, 1, 1])) == {"head.bias"}


def test_a_cluster_none_of_whose_values_is_kept_is_not_counted_as_aggregated(site):
    # 3 clusters: the median of each coordinate is cluster 2's value, so clusters 1 and 3 entered nothing
    updates = [{"head.bias": np.full(2, v, np.float32), "lora_A": np.full((2, 2), v, np.float32)} for v in (1, 2, 50)]
    strategy = make_strategy(OuterConfig(outer_optimizer="trimmed-mean"))
    new, metrics = _round(strategy, updates, [10, 10, 10])
    np.testing.assert_allclose(new["head.bias"], GLOBAL["head.bias"] + 2.0)
    assert metrics["clusters"] == 1 and metrics["clusters-usable"] == 3
    assert {c: n["strategy"]["kept"] for c, n in strategy.round_notes().items()} == {
        "node-1": False, "node-2": True, "node-3": False}


def test_make_strategy_builds_the_plugin_from_an_outer_config(site):
    cls = strategy_class("trimmed-mean")
    s = make_strategy(OuterConfig(outer_optimizer="trimmed-mean", outer_lr=0.5), clusters_per_round=3, seed=7)
    assert type(s) is cls and s.lr == 0.5 and s.clusters_per_round == 3 and s.options.trim == 0.2
    assert make_strategy(OuterConfig(outer_optimizer="trimmed-mean")).lr == 1.0  # its default_lr, as FedAvg's
    twin = make_strategy(OuterConfig(outer_optimizer="trimmed-mean"), seed=99)
    twin.load_state_dict(s.state_dict())  # checkpoints resume under the plugin's name
    assert twin.rng.integers(1 << 30) == s.rng.integers(1 << 30)
    cfg = load_config({"outer-optimizer": "trimmed-mean", "strategy.trim": 0.4})
    assert make_strategy(cfg.outer, options=cfg.strategy_options).options.trim == 0.4
    with pytest.raises(ConfigError, match=r"config key 'strategy\.trim' is 0\.5; use a share in \[0, 0\.5\)"):
        load_config({"outer-optimizer": "trimmed-mean", "strategy.trim": 0.5})
    with pytest.raises(ConfigError, match=r"unknown config key 'strategy\.trm'; did you mean 'strategy\.trim'"):
        load_config({"outer-optimizer": "trimmed-mean", "strategy.trm": 0.1})
    assert load_config({"outer-optimizer": "trimmed-mean"}).outer.outer_optimizer == "trimmed-mean"
    with pytest.raises(ConfigError, match=r"config key 'outer-optimizer': unknown outer optimizer 'trimed-mean'; "
                                          r"did you mean 'trimmed-mean'\? use one of fedavg, .*trimmed-mean"):
        load_config({"outer-optimizer": "trimed-mean"})


def test_a_strategy_that_needs_each_update_refuses_a_secure_sum(site):
    s = make_strategy(OuterConfig(outer_optimizer="trimmed-mean"))
    assert s.needs_individual_updates and not make_strategy(OuterConfig()).needs_individual_updates
    s.current = {k: v.copy() for k, v in GLOBAL.items()}
    with pytest.raises(ConfigError, match=r"'trimmed-mean' needs each cluster's update.*secagg\.enabled"):
        s.apply_mean({k: np.ones_like(v) for k, v in GLOBAL.items()}, weight=20, count=2)
    # and the run config refuses the combination before anything starts
    with pytest.raises(ConfigError, match=r"outer-optimizer.*secure aggregation"):
        load_config({"outer-optimizer": "trimmed-mean", "secagg.enabled": True})


# -- the task ---------------------------------------------------------------------------------------------------
def test_run_config_takes_the_task_and_its_option_and_refuses_a_bad_one(site):
    cfg = load_config({"task.name": "linear-probe", "task.pooling": "cls"})
    assert cfg.to_flat()["task.pooling"] == "cls" and make_task("linear-probe", cfg.task_options).options.pooling == "cls"
    assert make_task("linear-probe").options.pooling == "mean"
    with pytest.raises(ConfigError, match=r"config key 'task\.pooling' is 'max'; use 'mean' or 'cls'"):
        load_config({"task.name": "linear-probe", "task.pooling": "max"})
    with pytest.raises(ConfigError, match=r"unknown config key 'task\.poling'; did you mean 'task\.pooling'"):
        load_config({"task.name": "linear-probe", "task.poling": "cls"})
    with pytest.raises(ConfigError, match=r"privacy\.mode.*linear-probe"):
        load_config({"task.name": "linear-probe", "privacy.mode": "sample", "privacy.noise-multiplier": 1.0})
    assert task_class("linear-probe").presets["smoke"]["lr"] > 0


def test_linear_probe_trains_and_sends_only_the_head(site, tiny_model):
    labels = ["a", "b", "c"]
    setup = TaskSetup(model=ModelConfig(model=str(tiny_model), max_seq_len=16), labels=labels, seed=3, path=tiny_model)
    task = make_task("linear-probe")  # mean pooling: the tiny model's features separate topics from step 0
    model = task.build_model(setup)
    sent = task.exchanged(model)
    assert sorted(sent) == ["head.bias", "head.weight"] and sent["head.weight"].shape == (3, 32)  # tiny: hidden 32
    texts = ["the match ended in a draw", "shares fell on the market", "a new phone was launched"] * 4
    data = task.examples(setup=setup, tokenizer=task.tokenizer(setup), texts=texts,
                         labels=np.array([0, 1, 2] * 4), train=True)
    encoder_before = {k: v.clone() for k, v in model.encoder.state_dict().items()}
    model.train()
    assert not model.encoder.training  # frozen features: no dropout
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for _ in range(30):
        loss = task.loss(model, data.batch(range(len(data))))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]  # 3 separable sentences: the head alone fits them
    for key, value in model.encoder.state_dict().items():
        assert torch.equal(value, encoder_before[key]), key
    assert not np.allclose(task.exchanged(model)["head.weight"], sent["head.weight"])
    metrics = task.evaluate(model, data, batch_size=8)
    assert metrics["accuracy"] == 1.0 and "loss" in metrics
    twin = make_task("linear-probe", {"task.pooling": "cls"}).build_model(setup)
    batch = data.batch(range(3))
    with torch.no_grad():  # same head weights, other pooling: other logits
        twin.head.load_state_dict(model.head.state_dict())
        assert not torch.allclose(twin(batch["input_ids"], batch["attention_mask"]),
                                  model(batch["input_ids"], batch["attention_mask"]))


# -- broken plugins ---------------------------------------------------------------------------------------------
def _fake_dist(site: Path, name: str, group: str, entry_points: str) -> None:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{entry_points}")


def test_broken_plugins_are_refused_naming_the_plugin_and_its_package(site, tmp_path):
    fake = tmp_path / "site"
    _fake_dist(fake, "broken_strategies", "nebula_fl.strategies",
               "gone = no_such_module_xyz:Strategy\nnotastrategy = json:JSONDecoder\n"
               "renamed = nebula_trimmed_mean:TrimmedMean\n")
    _fake_dist(fake, "broken_tasks", "nebula_fl.tasks",
               "gone-task = no_such_module_xyz:Task\nnotatask = json:JSONDecoder\n"
               "renamed-task = nebula_linear_probe:LinearProbeTask\n")
    put_on_path(fake)
    try:
        cases = [
            ({"outer-optimizer": "gone"}, r"outer-optimizer.*strategy plugin 'gone'.*broken_strategies 0\.1.*failed "
                                          r"to load.*no_such_module_xyz"),
            ({"outer-optimizer": "notastrategy"}, r"strategy plugin 'notastrategy'.*not a subclass of .*AdapterStrategy"),
            ({"outer-optimizer": "renamed"}, r"strategy plugin 'renamed'.*name = 'trimmed-mean'.*registered as 'renamed'"),
            ({"task.name": "gone-task"}, r"task\.name.*task plugin 'gone-task'.*broken_tasks 0\.1.*failed to load"),
            ({"task.name": "notatask"}, r"task plugin 'notatask'.*not a subclass of nebula_fl\.tasks\.Task"),
            ({"task.name": "renamed-task"}, r"task plugin 'renamed-task'.*name = 'linear-probe'.*registered as"),
        ]
        for flat, match in cases:
            with pytest.raises(ConfigError, match=match):
                load_config(flat)
        assert "trimmed-mean" in strategy_names()  # the good plugins still load beside the broken ones
        assert strategy_class("trimmed-mean").__module__ == "nebula_trimmed_mean"
    finally:
        take_off_path(fake)
    assert "gone" not in strategy_names()


# -- end to end -------------------------------------------------------------------------------------------------
def test_a_federation_runs_the_plugin_strategy_and_task_end_to_end(site, tiny_model, run_cli, tmp_path, monkeypatch):
    """3 clusters, so the trimmed mean (trim 0.2, at least one cut from each end) is the coordinate-wise median."""
    # every process the launcher starts (superlink, serverapp, supernodes, trainers) inherits this environment
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "run"
    cli = run_cli("run", "--preset", "smoke", "--task", "linear-probe", "--clusters", "3", "--port", "0",
                  "--out", str(out), "--run-config",
                  f'model="{tiny_model}" outer-optimizer="trimmed-mean" strategy.trim=0.2 task.pooling="cls" '
                  "local-steps=8 batch-size=16 "
                  "eval-initial=true", name="plugins")
    assert cli.wait(400) == 0, cli.output()[-4000:]
    assert cli.survivors() == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2]
    for line in lines:
        assert set(line["clusters"]) == {"0", "1", "2"} and not line["rejected"]
        assert 0.0 <= line["accuracy"] <= 1.0 and np.isfinite(line["loss"])
    assert 0.0 <= summary["final_accuracy"] <= 1.0 and "accuracy" in summary["initial_evaluation"]
    config = json.loads((out / "config.json").read_text())["run_config"]
    assert config["outer-optimizer"] == "trimmed-mean" and config["task.name"] == "linear-probe"
    assert config["task.pooling"] == "cls" and config["strategy.trim"] == 0.2
    # what the strategy recorded is in each round's line, and clusters_aggregated counts the clusters it kept
    for line in lines:
        kept = {cid: c["strategy"]["kept"] for cid, c in line["clusters"].items()}
        shares = [c["strategy"]["kept_share"] for c in line["clusters"].values()]
        assert line["strategy"] == {"cut_per_end": 1} and line["clusters_usable"] == 3
        assert line["clusters_aggregated"] == sum(kept.values())
        assert all(k == (s > 0) for k, s in zip(kept.values(), shares))
        assert sum(shares) >= 1 - 1e-9  # a median per coordinate: at least one cluster's value is it
    # its logging.getLogger(__name__) lines reached the server's log, once per round (the stream `flwr run` prints
    # may end before the last round's lines arrive: round 1's, followed by many more, is always there)
    server_log = (out / "logs" / "server.log").read_text()
    assert server_log.count("[nebula_trimmed_mean] trimmed mean of 3 updates") in (1, 2), server_log[-3000:]
    assert server_log.index("[ROUND 1/2]") < server_log.index("[nebula_trimmed_mean]") < server_log.index("[ROUND 2/2]")
    assert config["lr"] == task_class("linear-probe").presets["smoke"]["lr"]  # --preset smoke took the task's own
    # the server really trimmed: round 2's global is round 1's plus the coordinate-wise median of the three
    # updates the clusters sent (decoded from their reply caches), which is not their mean
    g1, g2 = (load_file(str(out / "checkpoint" / f"round-0000{r}" / "adapter.safetensors")) for r in (1, 2))
    layout = Layout.from_arrays({k: g1[k] for k in sorted(g1)})
    updates = []
    for cluster in range(3):
        frame = out / "clusters" / str(cluster) / "state" / "replies" / summary["federation_id"] / "round-000002.frame"
        _, arrays = unpack(frame.read_bytes())
        updates.append(layout.unflatten(Compressor.decode(arrays["blob"].tobytes(), layout=layout, seed=0)))
    assert sorted(g2) == ["head.bias", "head.weight"]
    for key in g2:
        stacked = np.stack([u[key] for u in updates])
        np.testing.assert_allclose(g2[key], g1[key] + np.median(stacked, axis=0), rtol=0, atol=1e-6, err_msg=key)
        assert np.abs(g2[key] - (g1[key] + stacked.mean(axis=0))).max() > 1e-4
    state = json.loads((out / "checkpoint" / "round-00002" / "state.json").read_text())["state"]["strategy"]
    while "inner" in state:  # the wrappers (privacy, compression) hold the outer strategy's state
        state = state["inner"]
    assert state["name"] == "trimmed-mean" and state["lr"] == 1.0
    # the final file is the whole model: the frozen encoder as built from the model folder, the head as trained
    model = load_file(str(out / "model.safetensors"))
    probe = task_class("linear-probe")(options={"task.pooling": "cls"}).build_model(
        TaskSetup(model=ModelConfig(model=str(tiny_model)), labels=["x"] * 5, seed=0, path=tiny_model))
    assert set(model) == set(probe.state_dict()) and any(k.startswith("encoder.") for k in model)
    for key, value in probe.encoder.state_dict().items():
        np.testing.assert_array_equal(model[f"encoder.{key}"], value.numpy(), err_msg=key)  # never sent, never changed
    for key in g2:
        np.testing.assert_array_equal(model[key], g2[key], err_msg=key)
    # only the head crossed the WAN: an update is its bytes plus framing
    head_bytes = sum(v.nbytes for v in g2.values())
    assert head_bytes < lines[0]["clusters"]["0"]["bytes_up"] < head_bytes + 4000
