"""End to end with the real Flower commands: a flower-superlink, 2 flower-supernodes, 2 trainers (one
with 2 DDP workers) and flwr run, on a tiny model built here; then the same interrupted and resumed."""

import json
import signal
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

# The tiny model needs a livelier learning rate than MiniLM to learn something in 2 rounds.
TINY = "eval-initial=true lr=0.05 local-steps=8 batch-size=16"


def smoke_args(tiny_model, out, *extra):
    return ["run", "--preset", "smoke", "--clusters", "2", "--port", "0", "--out", str(out),
            "--run-config", f'model="{tiny_model}" {TINY}', *extra]


def rounds_of(out):
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["round"] for line in path.read_text().splitlines() if line.strip()]


def test_two_clusters_two_rounds_with_real_flower(tiny_model, run_cli, tmp_path):
    out = tmp_path / "run"
    cli = run_cli(*smoke_args(tiny_model, out, "--workers-per-cluster", "1,2"), name="e2e")
    assert cli.wait(300) == 0, cli.output()[-4000:]
    assert cli.survivors() == [], "processes outlived the launcher"
    seen = " ".join(cmd for _, cmd in cli.seen.values())
    for program in ("flower-superlink", "flower-supernode", "flwr run", "nebula_fl trainer", "flwr-serverapp"):
        assert program in seen, program

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2]
    test_size = 60  # smoke: 300 examples, 20% held out
    majority = 14 / test_size  # BBC's largest class (sport, 23%) of 60
    assert summary["final_accuracy"] > max(0.35, majority + 0.1)
    assert summary["final_accuracy"] > summary["initial_evaluation"]["accuracy"]

    for line in lines:
        assert set(line["clusters"]) == {"0", "1"} and not line["rejected"]
        c0, c1 = line["clusters"]["0"], line["clusters"]["1"]
        assert (c0["workers"], c1["workers"]) == (1, 2)
        assert c1["rank_divergence"] == 0.0  # DDP kept both ranks of cluster 1 identical
        assert c1["examples_seen"] == 2 * c0["examples_seen"]
        assert line["bytes_up"] == c0["bytes_up"] + c1["bytes_up"]
    assert summary["bytes_up_total"] == sum(x["bytes_up"] for x in lines)
    assert summary["bytes_down_total"] == sum(x["bytes_down"] for x in lines)

    adapter = load_file(str(out / "adapter.safetensors"))
    assert adapter and all(("lora_" in k or ".head." in k) for k in adapter)
    adapter_bytes = sum(v.nbytes for v in adapter.values())
    # an update carries exactly the adapter's tensors: its payload is their bytes plus small framing
    assert adapter_bytes < lines[0]["clusters"]["0"]["bytes_up"] < 1.2 * adapter_bytes + 4000
    assert (out / "accuracy_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    assert config["run_config"]["model"] == str(tiny_model) and config["launcher"]["workers"] == [1, 2]
    assert "round 2/2" in cli.output()


def test_interrupt_after_round_one_then_resume_loses_and_repeats_nothing(tiny_model, run_cli, tmp_path):
    out = tmp_path / "run"
    first = run_cli(*smoke_args(tiny_model, out, "--rounds", "3"), name="first")
    assert first.wait(300, until=lambda: len(rounds_of(out)) >= 1) == -1, first.output()[-3000:]
    first.popen.send_signal(signal.SIGINT)
    assert first.wait(120) == 130, first.output()[-3000:]
    assert first.survivors() == []
    interrupted = json.loads((out / "summary.json").read_text())
    assert interrupted["status"] == "interrupted"
    assert 1 <= interrupted["rounds_completed"] < 3

    second = run_cli("run", "--resume", str(out), "--port", "0", name="resume")
    assert second.wait(300) == 0, second.output()[-3000:]
    assert second.survivors() == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    assert rounds_of(out) == [1, 2, 3]

    # The same run, uninterrupted: the resumed federation ends on the very same adapter.
    reference = tmp_path / "reference"
    third = run_cli(*smoke_args(tiny_model, reference, "--rounds", "3"), name="reference")
    assert third.wait(300) == 0, third.output()[-3000:]
    resumed, straight = load_file(str(out / "adapter.safetensors")), load_file(str(reference / "adapter.safetensors"))
    assert set(resumed) == set(straight)
    for key in straight:
        np.testing.assert_allclose(resumed[key], straight[key], rtol=0, atol=1e-6, err_msg=key)
    assert json.loads((reference / "summary.json").read_text())["final_accuracy"] == pytest.approx(
        summary["final_accuracy"]
    )


def test_resuming_a_completed_run_says_how_to_extend_it(tiny_model, run_cli, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint" / "round-00002").mkdir(parents=True)
    (out / "checkpoint" / "latest").write_text("round-00002")
    (out / "checkpoint" / "round-00002" / "state.json").write_text('{"round": 2, "state": {}}')
    from safetensors.numpy import save_file

    save_file({"x": np.zeros(1, np.float32)}, str(out / "checkpoint" / "round-00002" / "state.safetensors"))
    save_file({"x": np.zeros(1, np.float32)}, str(out / "checkpoint" / "round-00002" / "adapter.safetensors"))
    flat = {"num-server-rounds": 2, "model": str(tiny_model), "max-examples": 300}
    (out / "config.json").write_text(json.dumps({"run_config": flat, "launcher": {"clusters": 2, "workers": [1, 1],
                                                                                   "devices": ["cpu", "cpu"]}}))
    cli = run_cli("run", "--resume", str(out), name="done")
    started = time.monotonic()
    assert cli.wait(60) == 2
    assert "already completed 2 of 2 rounds" in cli.output() and "--rounds" in cli.output()
    assert time.monotonic() - started < 60
