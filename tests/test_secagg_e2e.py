"""Secure aggregation end to end on real Flower processes: 3 clusters, 3 rounds, random-k, the tiny model.

The same run without secure aggregation (same seed) is the reference: masking, the field encoding and the
extra unmask trip must not change what the federation learns beyond the encoding's rounding."""

import json

import pytest

from tests.test_e2e import smoke_args

ARGS = ("--clusters", "3", "--rounds", "3", "--codec", "randk:0.25")


def records(out):
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, lines


def test_secure_aggregation_learns_what_the_plain_run_learns(tiny_model, run_cli, tmp_path):
    plain, secure = tmp_path / "plain", tmp_path / "secure"
    # side by side: both wait on Flower's polling far more than they compute
    a = run_cli(*smoke_args(tiny_model, plain, *ARGS), name="plain")
    b = run_cli(*smoke_args(tiny_model, secure, *ARGS, "--secure-aggregation"), name="secure")
    assert a.wait(500) == 0, a.output()[-3000:]
    assert b.wait(500) == 0, b.output()[-3000:]
    assert b.survivors() == []
    (ps, _), (ss, lines) = records(plain), records(secure)
    assert ss["status"] == "completed" and ss["rounds_completed"] == 3 and not ss["skipped_rounds"]
    assert abs(ss["final_accuracy"] - ps["final_accuracy"]) <= 0.005
    assert [x["secagg"]["survivors"] for x in lines] == [3, 3, 3]
    assert "setup_s" in lines[0]["secagg"] and all("setup_s" not in x["secagg"] for x in lines[1:])
    for line in lines:  # the server never saw a cluster's loss or weight
        assert line["train_loss"] is None and line["clusters_aggregated"] == 3
        for cluster in line["clusters"].values():
            assert "train_loss" not in cluster and "num_examples" not in cluster
    for cid in "012":
        state = next((secure / "clusters" / cid / "state" / "secagg").glob("*.json"))
        assert state.stat().st_mode & 0o077 == 0  # the cluster's private keys: its eyes only


def test_secure_aggregation_with_client_level_dp_splits_the_noise_into_threshold_shares(tiny_model, run_cli, tmp_path):
    out = tmp_path / "dp"
    # σ 0.5 at q = 1 spends ε ≈ 10 a release (20.1 after three, PRV): past the default lifetime budget (ε ≤ 10) that
    # a policy without max_epsilon gets, so the run gives its clusters a budget of their own
    dp = 'privacy.mode="client" privacy.noise-multiplier=0.5 privacy.max-grad-norm=0.5 privacy.max-epsilon=25'
    args = list(smoke_args(tiny_model, out, *ARGS, "--secure-aggregation"))
    args[args.index("--run-config") + 1] += " " + dp
    cli = run_cli(*args, name="secure-dp")
    assert cli.wait(400) == 0, cli.output()[-3000:]
    summary, lines = records(out)
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3
    assert [x["privacy"]["noise_multiplier"] for x in lines] == [0.5, 0.5, 0.5]
    assert summary["privacy"]["client"]["epsilon"] == pytest.approx(lines[-1]["privacy"]["epsilon"])
    for cid in "012":  # each cluster accounted the sum's σ, having added 1/threshold of its variance
        ledger = [json.loads(x) for x in (out / "clusters" / cid / "state" / "privacy-ledger.jsonl").read_text().splitlines()]
        assert [e["noise_multiplier"] for e in ledger] == [0.5, 0.5, 0.5] and {e["mode"] for e in ledger} == {"client"}
    log = (out / "logs").glob("trainer-*.log")
    assert any("unmask answered" in p.read_text() for p in log)


def test_a_cluster_that_requires_secure_aggregation_refuses_a_plain_round_and_a_weak_one(tiny_model, run_cli, tmp_path):
    """The operator's demand, on real processes: cluster 1 refuses an unmasked update, cluster 2 a sum of fewer
    clusters than its policy allows; each refusal is the cluster's own policy and reaches the run's summary."""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "mask.json").write_text(json.dumps({"require_secure_aggregation": True}))
    (policies / "three.json").write_text(json.dumps({"require_secure_aggregation": True, "min_secagg_threshold": 3}))
    plain, weak = tmp_path / "plain", tmp_path / "weak"
    a = run_cli(*smoke_args(tiny_model, plain, "--cluster-policy", f"1={policies / 'mask.json'}"), name="plain")
    b = run_cli(*smoke_args(tiny_model, weak, "--clusters", "3", "--secure-aggregation",
                            "--cluster-policy", f"2={policies / 'three.json'}"), name="weak")
    assert a.wait(400) == 0, a.output()[-3000:]
    assert b.wait(400) == 0, b.output()[-3000:]
    (ps, _), (ws, lines) = records(plain), records(weak)
    refused = ps["privacy"]["clusters"]["1"]
    assert refused["refusal"] == "policy" and "requires secure aggregation" in refused["reason"]
    refused = ws["privacy"]["clusters"]["2"]
    assert refused["refusal"] == "policy" and "sums of 2 clusters" in refused["reason"] and "at least 3" in refused["reason"]
    assert ws["status"] == "completed" and lines[0]["secagg"]["dropped"] == ["2"]  # round 1 went on without it
    peers = (weak / "clusters" / "peers.txt").read_text().split("\n")
    assert [line.split()[0] for line in peers if line and not line.startswith("#")] == ["0", "1", "2"]
