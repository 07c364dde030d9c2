"""The causal-lm task in real federations, each run combining several of the framework's features at smoke size
(the 1-layer scratch decoder): what the task must not break, the features must not break for it either.

- LoRA instruction tuning under secure aggregation, client-level DP, the random-k codec and Flower's FedAdam;
- pre-training on plain text, every weight exchanged, under top-k + int4 both ways and Nesterov outer steps,
  interrupted after round 1 and resumed: the run folder holds the whole model, its last checkpoint the exchanged
  weights, and exact match (none: no answers) is written as null. That a resumed run ends on the very model of the
  same run left alone (codec views, error feedback, the outer optimizer's state) is checked once, in
  tests/test_e2e.py, under the same codec and outer optimizer."""

from __future__ import annotations

import json
import math
import signal

import numpy as np
import pytest
from safetensors.numpy import load_file

from nebula_fl.config import ModelConfig
from nebula_fl.model.locate import resolve_model_path
from nebula_fl.tasks import TaskSetup, make_task
from tests.test_e2e import rounds_of
from tests.test_secagg_e2e import records


def _strict_lines(out) -> list[dict]:
    """metrics.jsonl parsed as strict JSON (a bare NaN raises)."""
    def refuse(name):
        raise ValueError(f"{name} in metrics.jsonl")

    json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    return [json.loads(x, parse_constant=refuse) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _built(out):
    """The model the run's config builds (its initial weights), and the task."""
    config = json.loads((out / "config.json").read_text())["run_config"]
    task = make_task("causal-lm", {k: v for k, v in config.items() if k.startswith("task.") and k != "task.name"})
    setup = TaskSetup(model=ModelConfig.from_flat(config), labels=[], seed=config["seed"],
                      path=resolve_model_path(config["model"]))
    return task, task.build_model(setup)


def test_lora_tuning_under_secure_aggregation_client_dp_randk_and_fedadam(causal_lm_secure_federation):
    run = causal_lm_secure_federation  # started once for this module and test_generate (tests/conftest.py)
    out = run.out
    assert run.code == 0, run.cli.output()[-4000:]
    assert run.cli.survivors() == []
    summary, _ = records(out)
    lines = _strict_lines(out)
    assert summary["status"] == "completed" and summary["task"] == "causal-lm" and summary["metric"] == "loss"
    assert [x["round"] for x in lines] == [1, 2] and not summary["skipped_rounds"]
    # nothing cut silently: at max-seq-len 64 every BBC article (the input) is shortened, no answer is cut and no
    # record dropped, and the summary and the server's log say so
    for split in ("train", "held_out"):
        r = summary["records"][split]
        assert r["records"] > 0 and r["inputs_cut"] == r["rows"] == r["records"] and r["dropped"] == 0, r
    said = summary["records"]["train"]["said"]
    assert f"{summary['records']['train']['records']:,} with their input shortened to fit" in said
    for line in lines:
        assert line["secagg"]["survivors"] == 3 and line["clusters_aggregated"] == 3
        assert line["train_loss"] is None  # masked: the server never saw a cluster's loss
        assert line["privacy"]["noise_multiplier"] == 0.5
        assert math.exp(line["loss"]) == pytest.approx(line["perplexity"], rel=1e-4)
        assert 0.0 <= line["exact-match"] <= 1.0 and line["tokens"] > 0
        assert {c["codec_up"] for c in line["clusters"].values()} == {"randk:0.25"}
    assert summary["privacy"]["client"]["epsilon"] == pytest.approx(lines[-1]["privacy"]["epsilon"])
    task, built = _built(out)
    adapter = load_file(str(out / "adapter.safetensors"))
    assert set(adapter) == set(task.exchanged(built)) and all("lora_" in k for k in adapter)
    assert {k.split(".")[-3] for k in adapter} == {"q_proj", "v_proj"}
    assert max(float(np.abs(v).max()) for k, v in adapter.items() if "lora_B" in k) > 0  # B starts at 0: it moved
    # a Flower strategy under secure aggregation: it saw only sums and used them, its moments checkpointed
    assert "outer optimizer flwr:FedAdam: Flower's FedAdam (" in (out / "logs" / "server.log").read_text()
    assert [x["secagg"]["unmasked_round"] for x in lines] == [1, 2]
    g1, g2 = (load_file(str(out / "checkpoint" / f"round-0000{r}" / "adapter.safetensors")) for r in (1, 2))
    assert any(not np.array_equal(g1[k], g2[k]) for k in g1)  # the global adapter moved
    state = json.loads((out / "checkpoint" / "round-00002" / "state.json").read_text())["state"]["strategy"]
    while "inner" in state:
        state = state["inner"]
    assert state["name"] == "flwr:FedAdam" and set(state["outer"]) >= {"m_t", "v_t", "current_arrays"}


def test_full_pretraining_on_plain_text_with_topk_int4_and_nesterov_is_interrupted_and_resumed(run_cli, tmp_path):
    rng = np.random.default_rng(0)
    words = ["market", "film", "vote", "goal", "chip", "bank", "actor", "party", "match", "phone", "shares"]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(" ".join(rng.choice(words, 12)) for _ in range(120)))
    args = ["run", "--task", "causal-lm", "--preset", "smoke", "--clusters", "2", "--port", "0", "--rounds", "3",
            "--codec", "topk:0.25+int4", "--outer-optimizer", "nesterov",
            "--run-config", f'dataset="{corpus}" task.exchange="full" task.objective="pretrain"']
    out = tmp_path / "run"
    first = run_cli(*args, "--out", str(out), name="first")
    assert first.wait(420, until=lambda: len(rounds_of(out)) >= 1) == -1, first.output()[-3000:]
    first.popen.send_signal(signal.SIGINT)
    assert first.wait(120) == 130, first.output()[-3000:]
    interrupted = json.loads((out / "summary.json").read_text())
    assert interrupted["status"] == "interrupted" and interrupted["metric"] == "loss"  # not a classifier's accuracy
    assert "final loss" in first.output()
    second = run_cli("run", "--resume", str(out), "--port", "0", name="resume")
    assert second.wait(420) == 0, second.output()[-3000:]
    assert first.survivors() == [] and second.survivors() == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and rounds_of(out) == [1, 2, 3]
    lines = _strict_lines(out)
    for line in lines:  # plain text: no answer to match, written as null; every record's tokens learned
        assert line["exact-match"] is None and math.isfinite(line["loss"]) and line["tokens"] > 0
        assert {c["codec_up"] for c in line["clusters"].values()} == {"topk:0.25+int4"}
    task, built = _built(out)
    model = load_file(str(out / "model.safetensors"))
    assert set(model) == set(built.state_dict()) and not any("lora_" in k for k in model)  # the whole model
    final = load_file(str(out / "checkpoint" / "round-00003" / "adapter.safetensors"))
    assert set(final) == set(task.exchanged(built))
    for key, value in final.items():
        np.testing.assert_array_equal(model[key], value, err_msg=key)
