"""End to end with the real Flower commands: a flower-superlink, 2 flower-supernodes, 2 trainers (2 DDP workers
and 2 FSDP workers) and flwr run, on a tiny model built here; then the same interrupted and resumed."""

import json
import re
import signal
import subprocess
import time
import tomllib

import numpy as np
import pytest
from flwr.common.config import flatten_dict
from safetensors.numpy import load_file

from nebula_fl.wan.capture import CAPTURE_DIR_ENV
from nebula_fl.wan.service import query_proxy
from tests.conftest import nebula_cmd
from tests.wan_capture_search import captured_streams, found, lora_b_windows

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


def test_two_clusters_two_rounds_with_real_flower(tiny_model, run_cli, tmp_path, monkeypatch):
    """Also, through the emulated WAN without TLS, the control for test_secure_federation's search: the bytes the
    proxies forwarded show the adapter (round 2's downlink, codec "none", carries round 1's global B verbatim)."""
    out, capture = tmp_path / "run", tmp_path / "capture"
    monkeypatch.setenv(CAPTURE_DIR_ENV, str(capture))
    # 2 workers in each cluster double its batch: at lr 0.05 the tiny model barely moves in 2 rounds, at 0.1 it learns
    args = ["run", "--preset", "smoke", "--clusters", "2", "--port", "0", "--out", str(out),
            "--run-config", f'model="{tiny_model}" {TINY.replace("lr=0.05", "lr=0.1")}',
            "--workers-per-cluster", "2,2", "--parallel", "ddp,fsdp", "--wan", "100mbit:20ms"]
    cli = run_cli(*args, name="e2e")
    assert cli.wait(300) == 0, cli.output()[-4000:]
    assert cli.survivors() == [], "processes outlived the launcher"

    plain = captured_streams(capture)
    assert len(list(capture.glob("*.cap"))) == 2 and any(b"POST /" in data for data in plain.values())
    plain_b = lora_b_windows(load_file(str(out / "checkpoint" / "round-00001" / "adapter.safetensors")))
    assert len(plain_b) > 1000
    seen = found(plain, plain_b)
    assert len(seen) > 0.5 * len(plain_b), f"control: only {len(seen)} of {len(plain_b)} windows seen in plaintext"
    assert "SuperNode authentication is disabled" in (out / "logs" / "superlink.log").read_text()
    # --rank-host (the fixture's): the launcher started no host of its own, and every trainer reached the given one
    assert not (out / "logs" / "rank-host.log").exists()
    assert not any("cannot be reached" in (out / "logs" / f"trainer-{i}.log").read_text() for i in (0, 1))
    seen = " ".join(cli.commands)
    for program in ("flower-superlink", "flower-supernode", "nebula_fl trainer", "flwr-serverapp"):
        assert program in seen, program
    # `flwr run` submitted the run and streamed its log: its own output is evidence too (the sampler once kept a
    # pre-exec command line for it, most likely across a clock adjustment; see same_process_start)
    streamed = (out / "logs" / "server.log").read_text()
    assert "flwr run" in seen or ("Successfully started run" in streamed and "[ROUND 2/2]" in streamed)
    # nebula-fl submit read the run's end: the SuperLink's status and the ServerApp's outcome line
    assert re.fullmatch(rf"run \d+: completed, 2 round\(s\) aggregated; run folder on the server host: {re.escape(str(out))}",
                        streamed.strip().splitlines()[-1]), streamed[-2000:]

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
        assert (c0["workers"], c1["workers"]) == (2, 2)
        assert (c0["parallel"], c1["parallel"]) == ("ddp", "fsdp")
        # DDP kept both ranks of cluster 0 identical; FSDP's ranks gather the same full adapter from their shards
        assert c0["rank_divergence"] == c1["rank_divergence"] == 0.0
        assert c1["examples_seen"] == c0["examples_seen"]
        assert line["bytes_up"] == c0["bytes_up"] + c1["bytes_up"]
    assert summary["bytes_up_total"] == sum(x["bytes_up"] for x in lines)
    assert summary["bytes_down_total"] == sum(x["bytes_down"] for x in lines)
    for line in lines:  # the timeline: each cluster's phases fit in the server's exchange, which fits in the round
        t = line["timeline"]
        assert set(t["clusters"]) == {"0", "1"} and t["round_s"] >= t["exchange_s"] > 0
        for phases in t["clusters"].values():
            assert phases["compute_s"] >= phases["train_s"] > 0 and phases["pickup_s"] > 0
            assert phases["pickup_s"] + phases["compute_s"] + phases["upload_s"] <= t["exchange_s"] + 0.5
        slowest = t["clusters"][t["slowest_cluster"]]
        critical = slowest["compute_s"] + slowest["transfer_s"]  # through the WAN proxies the wire is timed too
        assert slowest["transfer_s"] >= 0.02 and t["overhead_s"] == pytest.approx(
            max(0.0, t["round_s"] - critical - t["evaluate_s"]), abs=1e-6)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    accuracy = {e.step: e.value for e in board.Scalars("eval/accuracy")}
    assert accuracy == pytest.approx({x["round"]: x["accuracy"] for x in lines}, abs=1e-6)
    assert [e.step for e in board.Scalars("timeline/overhead_s")] == [1, 2]

    adapter = load_file(str(out / "adapter.safetensors"))
    assert adapter and all(("lora_" in k or ".head." in k) for k in adapter)
    adapter_bytes = sum(v.nbytes for v in adapter.values())
    # an update carries exactly the adapter's tensors: its payload is their bytes plus small framing
    assert adapter_bytes < lines[0]["clusters"]["0"]["bytes_up"] < 1.2 * adapter_bytes + 4000
    assert (out / "accuracy_vs_bytes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    config = json.loads((out / "config.json").read_text())
    assert config["run_config"]["model"] == str(tiny_model) and config["launcher"]["workers"] == [2, 2]
    assert config["launcher"]["parallel"] == ["ddp", "fsdp"]  # kept for --resume
    assert "2 worker(s) on cpu (fsdp)" in cli.output()
    assert "round 2/2" in cli.output()


def test_interrupt_after_round_one_then_resume_loses_and_repeats_nothing(tiny_model, run_cli, tmp_path):
    # a lossy codec both ways: the resumed server must find each cluster's view (and each cluster its
    # residual) again, or the first resumed round would compress another change and the adapters differ;
    # overlapped rounds: each cluster must also find the weights it rebased onto the last global, and what it
    # trains ahead must not depend on when the next message came
    # Nesterov outer steps: the server's momentum must come back too (the full-exchange causal-lm run in
    # test_causal_lm_e2e resumes under this codec and outer optimizer, and relies on this test for exactness)
    lossy = ("--rounds", "3", "--codec", "topk:0.25+int4", "--round-overlap", "--outer-optimizer", "nesterov")
    out = tmp_path / "run"
    # evaluated while the next round trains (its record and checkpoint too); the reference below does not overlap
    overlapped = ["run", "--preset", "smoke", "--clusters", "2", "--port", "0", "--out", str(out),
                  "--run-config", f'model="{tiny_model}" {TINY} eval-overlap=true', *lossy]
    # The same run, uninterrupted and not evaluation-overlapped, beside it: the resumed federation must end on the
    # very same adapter.
    reference = tmp_path / "reference"
    third = run_cli("run", "--preset", "smoke", "--clusters", "2", "--port", "0", "--out", str(reference),
                    "--run-config", f'model="{tiny_model}" {TINY} eval-overlap=false', *lossy, name="reference")
    first = run_cli(*overlapped, name="first")
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
    assert json.loads((out / "config.json").read_text())["run_config"]["eval-overlap"] is True
    assert json.loads((out / "config.json").read_text())["run_config"]["round-overlap"] is True

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


# Per HTTP request, what the WAN carries beyond the payload: Flower's request headers (a key, a
# signature, a timestamp, versions: ~850 B measured) and the small poll bodies up; headers down.
HEADER_BYTES_UP, HEADER_BYTES_DOWN = 1200, 400


def test_compressed_over_an_emulated_wan_proxy_counts_agree_with_payloads(tiny_model, run_cli, tmp_path):
    """Also: cluster 1 trains under bf16 autocast (on CPU here) and still sends fp32 tensors the other uses."""
    out = tmp_path / "run"
    cli = run_cli(*smoke_args(tiny_model, out, "--codec", "topk:0.1+int8", "--wan", "100mbit:20ms",
                              "--precision", "auto,bf16"), name="wan")
    # Drop cluster 0's link once, mid-run: Flower reconnects and the run goes on.
    assert cli.wait(300, until=lambda: len(rounds_of(out)) >= 1) == -1, cli.output()[-3000:]
    app = tomllib.loads((out / "app" / "pyproject.toml").read_text())
    control = flatten_dict(app["tool"]["flwr"]["app"]["config"])["comm.wan-control"].split(",")[0]
    query_proxy(control, "drop")
    assert query_proxy(control, "stats")["drops"] == 1
    assert cli.wait(300) == 0, cli.output()[-4000:]
    assert rounds_of(out) == [1, 2]
    assert cli.survivors() == []
    assert "python -m nebula_fl.wan" in " ".join(cli.commands)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    adapter = load_file(str(out / "adapter.safetensors"))
    raw = sum(v.nbytes for v in adapter.values())
    for line in lines:
        for cluster in line["clusters"].values():
            # the update is ~10% of the entries at ~5 bytes each (int8 value + coded index), in one blob
            assert cluster["bytes_up"] < 0.15 * raw + 2500
            for way, per_request in (("up", HEADER_BYTES_UP), ("down", HEADER_BYTES_DOWN)):
                payload, wire = cluster[f"bytes_{way}"], cluster[f"wan_bytes_{way}"]
                assert payload <= wire <= payload + per_request * cluster["wan_requests"], (way, cluster)
            assert cluster["wan_push_objects"] >= 1 and cluster["wan_pull_objects"] >= 1
        for cid, phases in line["timeline"]["clusters"].items():  # the proxy timed the wire: 20 ms RTT at least
            assert 0.02 <= phases["transfer_s"] == line["clusters"][cid]["wan_wire_seconds"] < line["timeline"]["round_s"]
    # Round 1 sends no adapter (every cluster rebuilds the seeded initial one); round 2 the compressed change.
    first, second = lines[0]["clusters"]["0"]["bytes_down"], lines[1]["clusters"]["0"]["bytes_down"]
    assert first < 2500 < raw and first < second < 0.15 * raw + 2500
    assert [lines[0]["clusters"][c]["precision"] for c in "01"] == ["fp32", "bf16"]
    assert all(v.dtype == np.float32 for v in adapter.values())
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["wan_bytes_total"] == lines[-1]["cumulative_wan_bytes"] > summary["bytes_up_total"]


def test_privacy_budgets_stop_each_cluster_and_the_run_ends_cleanly(tiny_model, run_cli, tmp_path):
    out = tmp_path / "run"
    # RDP at sigma 1, 8 steps a round: cluster 0 (144 examples, q 1/9) reaches 3.49, 4.28, 4.90; cluster 1
    # (96 examples, q 1/6) 4.66, 5.92. A budget of 4.8 lets cluster 1 train once and cluster 0 twice.
    # (privacy.batch-size=16: one batch per step, not the DP recipe's n/8, so q is as stated; the recipe's other
    # defaults, frozen-a LoRA and the rate rule, run here end to end)
    dp = ('privacy.mode="sample" privacy.noise-multiplier=1.0 privacy.delta=1e-5 privacy.accountant="rdp" '
          "privacy.batch-size=16 privacy.max-epsilon=4.8")
    cli = run_cli("run", "--preset", "smoke", "--clusters", "2", "--port", "0", "--out", str(out), "--rounds", "5",
                  "--run-config", f'model="{tiny_model}" {TINY} {dp}', name="dp")
    assert cli.wait(300) == 0, cli.output()[-4000:]
    assert cli.survivors() == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and "privacy budget" in summary["stopped_early"]
    stopped = summary["privacy"]["clusters"]
    assert (stopped["0"]["stopped_round"], stopped["1"]["stopped_round"]) == (3, 2)
    assert "would be exceeded" in stopped["1"]["reason"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1, 2, 3]
    eps = [[x["clusters"].get(c, {}).get("epsilon") for c in ("0", "1")] for x in lines]
    assert "1" not in lines[2]["clusters"]  # an exhausted cluster is no longer sampled
    assert [lines[0]["clusters"][c]["accountant"] for c in ("0", "1")] == ["rdp", "rdp"]
    assert eps[0] == [pytest.approx(3.493, abs=2e-3), pytest.approx(4.659, abs=2e-3)]
    assert eps[1][0] == pytest.approx(4.278, abs=2e-3) and eps[1][1] == pytest.approx(4.659, abs=2e-3)
    assert max(e for row in eps for e in row if e is not None) <= 4.8  # nobody went past the budget
    assert lines[1]["clusters_aggregated"] == 1 and lines[2]["clusters_aggregated"] == 0
    # lora-mode auto under sample DP is frozen-a: only B and the head cross, and the run's adapter holds only them
    adapter = load_file(str(out / "adapter.safetensors"))
    assert any(".lora_B." in k for k in adapter) and not any(".lora_A." in k for k in adapter)
    sent = sum(v.nbytes for v in adapter.values())
    assert sent < lines[0]["clusters"]["0"]["bytes_up"] < 1.2 * sent + 4000
    # the PEFT adapter folder holds what crossed and the frozen A that never did (drawn from the run's seed), and
    # PEFT's own loader puts exactly those into a fresh classifier
    from peft import PeftModel, get_peft_model_state_dict

    from nebula_fl.model.frozen_a import shared_a
    from nebula_fl.model.loading import build_classifier

    seed = json.loads((out / "config.json").read_text())["run_config"]["seed"]
    head = next(v for k, v in adapter.items() if k.endswith(".weight") and ".lora_" not in k)
    peft = PeftModel.from_pretrained(build_classifier(tiny_model, num_labels=head.shape[0], seed=seed + 1),
                                     str(out / "peft-adapter"))
    state = {k: v.detach().float().numpy() for k, v in get_peft_model_state_dict(peft).items()}
    assert set(state) == set(adapter) | {k.replace(".lora_B.", ".lora_A.") for k in adapter if ".lora_B." in k}
    for key, value in state.items():
        want = shared_a(seed, key, value.shape).numpy() if ".lora_A." in key else adapter[key]
        np.testing.assert_array_equal(value, want, err_msg=key)

    report = subprocess.run(nebula_cmd("privacy-report", str(out)), capture_output=True, text=True, timeout=120)
    assert report.returncode == 0, report.stderr
    assert "4.8" in report.stdout and "rdp accountant" in report.stdout
    privacy = json.loads((out / "privacy.json").read_text())
    assert set(privacy["clusters"]) == {"0", "1"}
    assert (out / "privacy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
