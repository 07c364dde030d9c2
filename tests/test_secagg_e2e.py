"""Secure aggregation end to end on real Flower processes: 3 clusters, 2 or 3 rounds, random-k, the tiny model.

The same run without secure aggregation (same seed) is the reference: masking, the field encoding and the
extra unmask trip must not change what the federation learns beyond the encoding's rounding."""

import json

import pytest

from nebula_fl.clients.trainer_service import IN_THE_CLEAR
from tests.test_e2e import smoke_args

ARGS = ("--clusters", "3", "--rounds", "3", "--codec", "randk:0.25")


def records(out):
    summary = json.loads((out / "summary.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, lines


def test_secure_aggregation_learns_what_the_plain_run_learns(tiny_model, run_cli, tmp_path):
    """And, overlapped, round r's unmask request rides on round r+1's train message and its answer on the reply:
    no `query.secagg` trip in any round but the last, whose own sum is unmasked at once (one trip) so the final
    global holds every round; round 1 applies nothing yet (its sum lands in round 2) and is no skipped round."""
    plain, secure, overlap = tmp_path / "plain", tmp_path / "secure", tmp_path / "overlap"
    # side by side: all three wait on Flower's polling far more than they compute
    # plain and secure: two rounds tell whether masking changed what was learnt; overlapped: three, so that a round
    # between the first and the last shows the unmask request riding on the next round
    a = run_cli(*smoke_args(tiny_model, plain, *ARGS, "--rounds", "2"), name="plain")
    b = run_cli(*smoke_args(tiny_model, secure, *ARGS, "--secure-aggregation", "--rounds", "2"), name="secure")
    c = run_cli(*smoke_args(tiny_model, overlap, *ARGS, "--secure-aggregation", "--round-overlap"), name="overlap")
    assert a.wait(500) == 0, a.output()[-3000:]
    assert b.wait(500) == 0, b.output()[-3000:]
    assert c.wait(500) == 0, c.output()[-3000:]
    assert b.survivors() == [] and c.survivors() == []
    summary, over = records(overlap)
    assert summary["status"] == "completed" and summary["rounds_completed"] == 3 and not summary["skipped_rounds"]
    assert summary["final_accuracy"] is not None and over[-1]["accuracy"] is not None
    assert [x["secagg"]["extra_trips"] for x in over] == [0, 0, 1]
    assert [x["secagg"]["unmasked_rounds"] for x in over] == [[], [1], [2, 3]]
    assert over[0]["secagg"]["setup_trips"] == 2 and all("setup_trips" not in x["secagg"] for x in over[1:])
    assert [x["clusters_aggregated"] for x in over] == [0, 3, 3]
    (ps, _), (ss, lines) = records(plain), records(secure)
    assert ss["status"] == "completed" and ss["rounds_completed"] == 2 and not ss["skipped_rounds"]
    assert ps["rounds_completed"] == 2 and abs(ss["final_accuracy"] - ps["final_accuracy"]) <= 0.005
    assert [x["secagg"]["survivors"] for x in lines] == [3, 3]
    assert "setup_s" in lines[0]["secagg"] and all("setup_s" not in x["secagg"] for x in lines[1:])
    clear = {k.replace("-", "_") for k in IN_THE_CLEAR} | {"bytes_up", "bytes_down", "node_id"}  # the last: the server's
    for line in lines:  # the server never saw a cluster's loss, weight, examples seen or timing
        assert line["train_loss"] is None and line["clusters_aggregated"] == 3
        for cluster in line["clusters"].values():
            assert set(cluster) <= clear, set(cluster) - clear
            assert not {"train_loss", "num_examples", "examples_seen", "seconds", "client_seconds"} & set(cluster)
    for cid in "012":
        state = next((secure / "clusters" / cid / "state" / "secagg").glob("*.json"))
        assert state.stat().st_mode & 0o077 == 0  # the cluster's private keys: its eyes only


def test_client_level_dp_splits_the_noise_and_a_cluster_refuses_a_weak_round(tiny_model, run_cli, tmp_path):
    """A secure federation under client-level DP, 4 clusters: each adds 1/t of the noise variance and accounts the
    sum's σ; cluster 3's policy demands sums of at least 4, the server's threshold is 3, so it refuses, as its policy,
    and the others go on; the refusal reaches the run's summary. (A policy that demands masking refusing a plain round:
    tests/test_shard_secrecy.py on the cluster's real boundary, tests/test_run_status.py for the server's record; a
    plain run's refusals reaching the summary end to end: test_e2e's privacy budgets.)"""
    policies = tmp_path / "policies"
    policies.mkdir()
    (policies / "four.json").write_text(json.dumps({"require_secure_aggregation": True, "min_secagg_threshold": 4}))
    out = tmp_path / "dp"
    # σ 0.5 at q = 1 spends ε ≈ 10 a release (20.1 after three, PRV): past the default lifetime budget (ε ≤ 10) that
    # a policy without max_epsilon gets, so the run gives its clusters a budget of their own
    dp = 'privacy.mode="client" privacy.noise-multiplier=0.5 privacy.max-grad-norm=0.5 privacy.max-epsilon=25'
    args = list(smoke_args(tiny_model, out, *ARGS, "--clusters", "4", "--secure-aggregation",
                           "--cluster-policy", f"3={policies / 'four.json'}"))
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
    refused = summary["privacy"]["clusters"]["3"]
    assert refused["refusal"] == "policy" and "sums of 3 clusters" in refused["reason"] and "at least 4" in refused["reason"]
    assert lines[0]["secagg"]["dropped"] == ["3"] and "3" not in lines[1]["clusters"]  # refused, then not asked again
    ledger = out / "clusters" / "3" / "state" / "privacy-ledger.jsonl"
    assert not ledger.exists() or not ledger.read_text().strip(), "a refused round released nothing"
    peers = (out / "clusters" / "peers.txt").read_text().split("\n")
    assert [line.split()[0] for line in peers if line and not line.startswith("#")] == ["0", "1", "2", "3"]
