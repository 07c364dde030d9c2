"""The analysis of benchmarks/comm.py on synthetic run records: target reach, the round-1 guard, WAN share,
the link model and its error, the least-favourable stock figure, the best-chain pick, ratios and goals.
Also: the stock baseline's config agrees with nebula-fl's defaults, and its Grid polls every 0.2 s."""

from __future__ import annotations

import argparse
import time
import tomllib

import pytest
from flwr.common.config import parse_config_args

from nebula_fl.wan.profile import parse_profile
from tests.conftest import REPO, load_script

comm = load_script("nebula_benchmarks_comm", REPO / "benchmarks" / "comm.py")
WAN, SLOW = parse_profile("8mbit:100ms"), parse_profile("0.8mbit:300ms")  # 1e6 and 1e5 bytes/s


def cluster(up=0, down=0, push=0, pull=0):
    return {"bytes_up": up, "bytes_down": down, "push_objects": push, "pull_objects": pull}


def run(config, accs, *, seconds=None, link="wan", system="nebula-fl", start=10.0, per_round=None):
    """A run record: round 0..n with the given accuracies, `seconds` per round, cumulative bytes and elapsed."""
    seconds = seconds or [20.0] * (len(accs) - 1)
    per_round = per_round or [[cluster(1000, 1000, 1, 1)] * 2] * (len(accs) - 1)
    rounds = [{"round": 0, "accuracy": accs[0], "elapsed_s": start, "seconds": start, "wan_bytes_cum": 100,
               "clusters": [cluster(50, 0), cluster(50, 0)]}]
    for i, (acc, sec, clusters) in enumerate(zip(accs[1:], seconds, per_round, strict=True), start=1):
        prev = rounds[-1]
        rounds.append({"round": i, "accuracy": acc, "elapsed_s": prev["elapsed_s"] + sec, "seconds": sec,
                       "wan_bytes_cum": prev["wan_bytes_cum"] + sum(c["bytes_up"] + c["bytes_down"] for c in clusters),
                       "clusters": clusters})
    return {"config": config, "system": system, "link": link, "rounds": rounds}


# -- target reach ------------------------------------------------------------------------------------
def test_reach_is_the_first_round_at_or_above_the_target():
    r = run("x", [0.2, 0.89, 0.93, 0.91, 0.95])
    assert comm.reach(r["rounds"], 0.93)["round"] == 2
    assert comm.reach(r["rounds"], 0.95)["round"] == 4
    assert comm.reach(r["rounds"], 0.96) is None
    assert comm.time_to_target(r, 0.93) == 10.0 + 2 * 20.0
    assert comm.bytes_to_target(r, 0.93) == 100 + 2 * 4000
    assert comm.time_to_target(None, 0.93) is None


def test_reach_skips_rounds_without_an_accuracy():
    rounds = [{"round": 0, "accuracy": None}, {"round": 1, "accuracy": 0.97}]
    assert comm.reach(rounds, 0.9)["round"] == 1


def test_first_round_at_target_is_the_earliest_of_any_run():
    runs = [run("a", [0.1, 0.8, 0.95]), run("b", [0.1, 0.94, 0.96]), run("c", [0.1, 0.5, 0.6])]
    assert comm.first_round_at_target(runs, 0.93) == 1  # b: the run would be invalid
    assert comm.first_round_at_target(runs, 0.95) == 2
    assert comm.first_round_at_target(runs, 0.99) is None


# -- WAN share and the link model --------------------------------------------------------------------
def test_wan_share_is_the_median_over_rounds_matched_by_number():
    linked = run("x", [0.1, 0.5, 0.6, 0.7], seconds=[40.0, 25.0, 20.0])
    free = run("x", [0.1, 0.5, 0.6], seconds=[30.0, 24.0], link="unthrottled")  # no round 3: not matched
    # round 1: 10/40 = 0.25, round 2: 1/25 = 0.04 -> median of the two = 0.145; round 0 never counts
    assert comm.wan_share(linked, free) == pytest.approx(0.145)
    assert comm.wan_share(linked, run("y", [0.1], link="unthrottled")) is None


def test_round_wan_seconds_takes_the_slowest_cluster():
    r = {"round": 1, "clusters": [cluster(1_000_000, 2_000_000, 3, 1), cluster(10, 10, 0, 0)]}
    # 1 s up + 2 s down at 1e6 B/s; requests (3+1 up, 1+1 down) in waves of 2: 2 + 1 round trips of 0.1 s
    assert comm.round_wan_seconds(r, WAN) == pytest.approx(3.3)
    r0 = {"round": 0, "clusters": [cluster(100_000, 0, 0, 0)]}  # round 0: bytes only, no message requests
    assert comm.round_wan_seconds(r0, WAN) == pytest.approx(0.1)


def test_modelled_elapsed_adds_each_rounds_wan_time_to_the_unthrottled_elapsed():
    per_round = [[cluster(1_000_000, 1_000_000, 1, 1), cluster(0, 0, 1, 1)]] * 2
    linked = run("s", [0.1, 0.8, 0.95], per_round=per_round)
    linked["rounds"][0]["clusters"] = [cluster(500_000, 0), cluster(0, 0)]
    free = run("s", [0.1, 0.8, 0.95], seconds=[30.0, 31.0], link="unthrottled", start=12.0)
    # unthrottled elapsed at round 2: 12 + 30 + 31 = 73; round 0: 0.5 s; rounds 1, 2: 2 s + 2 trips x 0.1
    assert comm.modelled_elapsed(unthrottled=free, linked=linked, profile=WAN, upto=2) == pytest.approx(
        73 + 0.5 + 2 * 2.2)
    with pytest.raises(ValueError, match="missing"):
        comm.modelled_elapsed(unthrottled=free, linked=linked, profile=WAN, upto=3)


def test_model_error_is_signed_and_the_stock_figure_always_shrinks_by_its_size():
    assert comm.model_error(modelled=110.0, measured=100.0) == pytest.approx(0.10)
    assert comm.model_error(modelled=90.0, measured=100.0) == pytest.approx(-0.10)
    assert comm.least_favourable(1000.0, 0.10) == pytest.approx(900.0)
    assert comm.least_favourable(1000.0, -0.10) == pytest.approx(900.0)  # an under-estimate is not rewarded
    with pytest.raises(ValueError):
        comm.model_error(modelled=1.0, measured=0.0)


# -- the best chain --------------------------------------------------------------------------------
def test_pick_best_takes_the_fewest_bytes_within_one_point_of_uncompressed():
    finals = {"none": 0.950, "a": 0.945, "b": 0.930, "c": 0.9405}
    to_bytes = {"none": 900, "a": 300, "b": 100, "c": 200}
    # b has the fewest bytes but is 2 points below; c is 0.95 points below: within 1
    assert comm.pick_best(finals, to_bytes, chains=["a", "b", "c"], uncompressed="none") == "c"
    assert comm.pick_best(finals, to_bytes, chains=["a", "b"], uncompressed="none") == "a"


def test_pick_best_falls_back_when_no_chain_is_close_or_none_reached():
    finals = {"none": 0.99, "a": 0.95, "b": 0.96}
    assert comm.pick_best(finals, {"a": 300, "b": 500}, chains=["a", "b"], uncompressed="none") == "a"
    assert comm.pick_best(finals, {"a": None, "b": 500}, chains=["a", "b"], uncompressed="none") == "b"
    assert comm.pick_best(finals, {"a": None, "b": None}, chains=["a", "b"], uncompressed="none") == "b"
    with pytest.raises(ValueError):
        comm.pick_best(finals, {}, chains=[], uncompressed="none")


# -- ratios and goals ------------------------------------------------------------------------------
def test_judge_marks_missing_figures_as_missed():
    goals = comm.judge({"bytes_ratio_vs_flower": 3500.0, "bytes_ratio_vs_flower_lora": 9.0,
                        "wan_share_20mbit": 0.05, "accuracy_gap_vs_uncompressed": None})
    assert goals["bytes_ratio_vs_flower"]["met"] is True
    assert goals["bytes_ratio_vs_flower_lora"]["met"] is False
    assert goals["wan_share_20mbit"]["met"] is True  # at the bound
    assert goals["accuracy_gap_vs_uncompressed"]["met"] is False
    assert goals["time_ratio_vs_flower_2mbit"] == {"goal": ">= 20", "value": None, "met": False}


def synthetic_runs():
    """Stock full (huge rounds), stock LoRA, uncompressed, two chains, adaptive; target 0.93 reached in round 2."""
    big = [[cluster(90_000_000, 90_000_000, 111, 111)] * 2] * 3
    lora = [[cluster(400_000, 300_000, 26, 26)] * 2] * 3
    none = [[cluster(330_000, 330_000, 1, 1)] * 2] * 3
    small = [[cluster(40_000, 30_000, 1, 1)] * 2] * 3
    tiny = [[cluster(20_000, 15_000, 1, 1)] * 2] * 3
    full_wan = run(comm.FULL, [0.15, 0.90, 0.95, 0.96], seconds=[240.0, 240.0, 240.0], per_round=big, system="flower")
    full_free = run(comm.FULL, [0.15, 0.90, 0.95, 0.96], seconds=[60.0, 60.0, 60.0], link="unthrottled",
                    system="flower")
    return {
        comm.FULL: {"wan": full_wan, "unthrottled": full_free},
        comm.LORA: {"wan": run(comm.LORA, [0.15, 0.92, 0.96, 0.96], seconds=[50.0] * 3, per_round=lora, system="flower"),
                    "slow": run(comm.LORA, [0.15, 0.92, 0.96, 0.96], seconds=[60.0] * 3, link="slow", system="flower")},
        comm.NONE: {"wan": run(comm.NONE, [0.15, 0.91, 0.94, 0.952], per_round=none)},
        "nebula-a": {"wan": run("nebula-a", [0.15, 0.90, 0.94, 0.950], seconds=[21.0] * 3, per_round=small),
                     "slow": run("nebula-a", [0.15, 0.90, 0.94, 0.950], seconds=[25.0] * 3, link="slow"),
                     "unthrottled": run("nebula-a", [0.15, 0.90, 0.94, 0.950], seconds=[20.0] * 3, link="unthrottled")},
        "nebula-b": {"wan": run("nebula-b", [0.15, 0.88, 0.92, 0.935], per_round=tiny)},  # 1.7 points below
        comm.ADAPTIVE: {"wan": run(comm.ADAPTIVE, [0.15, 0.89, 0.93, 0.94], per_round=tiny)},
    }


def test_analyse_measures_ratios_against_both_baselines_and_applies_the_model_error():
    runs = synthetic_runs()
    profiles = {"wan": WAN, "slow": SLOW}
    result = comm.analyse(runs, target=0.93, chains=["nebula-a", "nebula-b"], profiles=profiles)
    assert result["best"] == "nebula-a"  # b has fewer bytes but loses 1.7 points
    assert result["first_round_at_target"] == 2
    cfg, fig = result["configs"], result["figures"]
    best_bytes = 100 + 2 * 2 * 70_000
    assert cfg["nebula-a"]["wan_bytes_to_target"] == best_bytes
    assert fig["bytes_ratio_vs_flower"] == pytest.approx((100 + 2 * 2 * 180_000_000) / best_bytes)
    assert fig["bytes_ratio_vs_flower_lora"] == pytest.approx((100 + 2 * 2 * 700_000) / best_bytes)
    assert fig["accuracy_gap_vs_uncompressed"] == pytest.approx(0.2)
    assert fig["wan_share_20mbit"] == pytest.approx(1 / 21)
    assert fig["wan_share_2mbit"] == pytest.approx(5 / 25)

    stock = cfg[comm.FULL]
    measured = 10.0 + 2 * 240.0
    per_round = lambda p: 90_000_000 * 8 / p.up_bps * 2 + (56 + 56) * p.rtt_s  # noqa: E731
    round0 = lambda p: 50 * 8 / p.up_bps  # noqa: E731
    at_wan = 10.0 + 2 * 60.0 + round0(WAN) + 2 * per_round(WAN)
    at_slow = 10.0 + 2 * 60.0 + round0(SLOW) + 2 * per_round(SLOW)
    error = (at_wan - measured) / measured
    assert stock["model"]["error"] == pytest.approx(error)
    assert stock["time_to_target"]["slow"]["how"] == "modelled"
    assert stock["time_to_target"]["slow"]["seconds"] == pytest.approx(at_slow)
    best_slow = 10.0 + 2 * 25.0
    assert fig["time_ratio_vs_flower_2mbit"] == pytest.approx(at_slow * (1 - abs(error)) / best_slow)
    assert fig["time_ratio_vs_flower_2mbit_measured"] is False
    assert fig["time_ratio_vs_flower_20mbit"] == pytest.approx(measured / (10.0 + 2 * 21.0))
    assert fig["time_ratio_vs_flower_lora_2mbit"] == pytest.approx((10.0 + 2 * 60.0) / best_slow)
    assert fig["stock_model_error_20mbit"] == pytest.approx(error)


def test_a_measured_stock_slow_run_replaces_the_model():
    runs = synthetic_runs()
    runs[comm.FULL]["slow"] = run(comm.FULL, [0.15, 0.90, 0.95, 0.96], seconds=[1500.0] * 3, link="slow",
                                  system="flower")
    result = comm.analyse(runs, target=0.93, chains=["nebula-a", "nebula-b"], profiles={"wan": WAN, "slow": SLOW})
    assert result["configs"][comm.FULL]["time_to_target"]["slow"] == {"seconds": 3010.0, "how": "measured"}
    assert result["figures"]["time_ratio_vs_flower_2mbit"] == pytest.approx(3010.0 / 60.0)
    assert result["figures"]["time_ratio_vs_flower_2mbit_measured"] is True


def test_a_baseline_that_misses_the_target_leaves_its_ratios_empty_and_goals_missed():
    runs = synthetic_runs()
    runs[comm.FULL]["wan"] = run(comm.FULL, [0.15, 0.5, 0.6, 0.7], system="flower")
    result = comm.analyse(runs, target=0.93, chains=["nebula-a", "nebula-b"], profiles={"wan": WAN, "slow": SLOW})
    assert result["configs"][comm.FULL]["round_reached"] is None
    assert result["figures"]["bytes_ratio_vs_flower"] is None
    assert result["figures"]["time_ratio_vs_flower_2mbit"] is None
    goals = comm.judge(result["figures"])
    assert not goals["bytes_ratio_vs_flower"]["met"] and not goals["time_ratio_vs_flower_2mbit"]["met"]


# -- records from the runs' own files ---------------------------------------------------------------
def test_records_from_metrics_lines_keep_cluster_order_and_only_proxy_counts():
    lines = [{"round": 1, "accuracy": 0.9, "elapsed_seconds": 50.0, "seconds": 30.0, "cumulative_wan_bytes": 999,
              "clusters": {"1": {"bytes_up": 5, "wan_bytes_up": 20, "wan_bytes_down": 21, "wan_push_objects": 1,
                                 "wan_pull_objects": 2},
                           "0": {"bytes_up": 5, "wan_bytes_up": 10, "wan_bytes_down": 11, "wan_push_objects": 3,
                                 "wan_pull_objects": 4, "wan_wire_seconds": 2.5},
                           "node-7": {"bytes_up": 1}},
              "timeline": {"ignored": True}}]
    (r,) = comm.records_from_lines(lines)
    assert r == {"round": 1, "accuracy": 0.9, "elapsed_s": 50.0, "seconds": 30.0, "wan_bytes_cum": 999,
                 "clusters": [cluster(10, 11, 3, 4), cluster(20, 21, 1, 2)], "wire_s": 2.5}
    assert comm.wire_share({"rounds": [{"round": 0, "seconds": 9.0, "wire_s": 9.0}, r,
                                       {"round": 2, "seconds": 10.0, "wire_s": 1.0},
                                       {"round": 3, "seconds": 10.0, "wire_s": None}]}) == pytest.approx(
        (2.5 / 30 + 1.0 / 10) / 2)


# -- the stock baseline app ------------------------------------------------------------------------
def test_stock_app_defaults_are_nebula_fls_and_the_run_config_parses(tmp_path):
    config = tomllib.loads((REPO / "benchmarks" / "stock_flower" / "pyproject.toml").read_text())
    defaults = config["tool"]["flwr"]["app"]["config"]
    for key, value in {**comm.DEFAULTS.train.to_flat(), **comm.DEFAULTS.model.to_flat()}.items():
        if key in defaults:
            assert defaults[key] == value, key
    assert {"lr", "lr-schedule", "lora-r", "lora-target-modules", "batch-size"} <= set(defaults)
    args = argparse.Namespace(clusters=2, seed=3)
    text = comm.stock_run_config(mode="lora", settings=comm.QUICK, args=args, folder=tmp_path,
                                 controls=[tmp_path / "w0.sock", tmp_path / "w1.sock"])
    parsed = parse_config_args([text])
    assert set(parsed) <= set(defaults), set(parsed) - set(defaults)
    assert parsed["mode"] == "lora" and parsed["seed"] == 3 and parsed["lr"] == comm.DEFAULTS.train.lr == 5e-3
    assert parsed["num-server-rounds"] == comm.QUICK.rounds and parsed["max-examples"] == comm.QUICK.max_examples
    assert parsed["wan-control"] == f"{tmp_path / 'w0.sock'},{tmp_path / 'w1.sock'}"


class _Reply:
    def __init__(self, to: str) -> None:
        self.metadata = argparse.Namespace(reply_to_message_id=to)


class _SlowGrid:
    """A grid whose replies arrive one per pull after the first two (pure logic: no SuperLink)."""

    def __init__(self) -> None:
        self.pulls: list[float] = []

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls.append(time.monotonic())
        ids = sorted(ids)
        return [_Reply(ids[0])] if len(self.pulls) > 2 and ids else []


def test_stock_grid_polls_every_fifth_of_a_second():
    app = load_script("nebula_benchmarks_stock_app", REPO / "benchmarks" / "stock_flower" / "stock_flower_app.py")
    inner = _SlowGrid()
    replies = list(app.FastPollGrid(inner).send_and_receive(["a", "b"], timeout=30))
    assert sorted(r.metadata.reply_to_message_id for r in replies) == ["m0", "m1"]
    gaps = [b - a for a, b in zip(inner.pulls, inner.pulls[1:])]
    assert len(gaps) == 3 and all(0.19 <= g < 1.0 for g in gaps), gaps  # Flower's own grid waits 3 s
    stalled = _SlowGrid()
    stalled.pull_messages = lambda ids: stalled.pulls.append(time.monotonic()) or []
    started = time.monotonic()
    assert list(app.FastPollGrid(stalled).send_and_receive(["a"], timeout=0.5)) == []
    assert time.monotonic() - started < 1.0
    with pytest.raises(ValueError):
        app.FastPollGrid(inner, poll_s=0)
