"""The pre-training and distillation tasks end to end, exactly as a user starts them (`nebula-fl run --task T
--preset smoke`): a real flower-superlink, 2 flower-supernodes with their trainers, and flwr run."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from safetensors.numpy import load_file

from nebula_fl.config import ModelConfig
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.tasks import TaskSetup, make_task


def _run(run_cli, tmp_path, task: str, *extra: str):
    out = tmp_path / task
    cli = run_cli("run", "--task", task, "--preset", "smoke", "--clusters", "2", "--port", "0", "--out", str(out),
                  *extra, name=task)
    assert cli.wait(420) == 0, cli.output()[-4000:]
    assert cli.survivors() == [], "processes outlived the launcher"
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["status"] == "completed" and summary["task"] == task
    assert [x["round"] for x in lines] == list(range(1, summary["num_server_rounds"] + 1))
    for line in lines:
        assert set(line["clusters"]) == {"0", "1"} and not line["rejected"]
    return out, summary, lines


def test_mlm_pretrains_every_weight_across_two_clusters(run_cli, tmp_path):
    out, summary, lines = _run(run_cli, tmp_path, "mlm")
    preset = make_task("mlm").presets["smoke"]
    vocab = 30522  # the MiniLM tokenizer's
    assert summary["metric"] == "perplexity"
    for line in lines:
        assert math.isfinite(line["perplexity"]) and 1 < line["perplexity"] < vocab
        assert math.exp(line["loss"]) == pytest.approx(line["perplexity"], rel=1e-4)
    assert lines[-1]["loss"] < lines[0]["loss"] or lines[-1]["train_loss"] < lines[0]["train_loss"]
    model = load_file(str(out / "model.safetensors"))  # the whole model, not an adapter
    assert any("embeddings.word_embeddings" in k for k in model) and not any("lora_" in k for k in model)
    # every tensor of the model the run's config builds, the exchanged ones equal to the last round's global
    config = json.loads((out / "config.json").read_text())["run_config"]
    task = make_task("mlm", {k: v for k, v in config.items() if k.startswith("task.") and k != "task.name"})
    path = resolve_model_path(config["model"])
    built = task.build_model(TaskSetup(model=ModelConfig.from_flat(config), labels=[], seed=config["seed"], path=path))
    assert set(model) == set(built.state_dict())
    final = load_file(str(out / "checkpoint" / f"round-{summary['num_server_rounds']:05d}" / "adapter.safetensors"))
    assert set(final) == set(task.exchanged(built)) and set(final) < set(model)  # the tied decoder is never sent
    for key, value in final.items():
        np.testing.assert_array_equal(model[key], value, err_msg=key)
    np.testing.assert_array_equal(model["cls.predictions.decoder.weight"], model["bert.embeddings.word_embeddings.weight"])
    params = sum(v.size for v in final.values())
    assert params > vocab * preset.get("task.hidden", 64)
    sent = lines[0]["clusters"]["0"]["bytes_up"]
    codec = preset.get("comm.codec", "none")
    per_param = {"none": 4, "int8": 1, "int4": 0.5}[codec.split(":")[0]]
    assert per_param * params <= sent < 1.1 * per_param * params + 8192
    assert (out / "perplexity_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_distill_trains_a_smaller_student_from_teachers_inside_the_clusters(run_cli, tmp_path):
    out, summary, lines = _run(run_cli, tmp_path, "distill")
    assert summary["metric"] == "accuracy" and 0 <= summary["final_metric"] <= 1
    adapter = load_file(str(out / "adapter.safetensors"))  # only the student's adapter and head crossed
    assert adapter and all(("lora_" in k or ".head." in k) for k in adapter)
    layers = {int(k.split(".layer.")[1].split(".")[0]) for k in adapter if ".layer." in k}
    assert layers and max(layers) < make_task("distill").presets["smoke"].get("task.student-layers", 1)
    for line in lines:
        for cluster in line["clusters"].values():
            assert math.isfinite(cluster["train_loss"])
