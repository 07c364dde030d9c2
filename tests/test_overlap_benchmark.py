"""benchmarks/overlap.py without running a federation: the plan of runs, busy time from either source, the
target chosen from the reference curve, time to target and its ratios (null, with a reason, when a side never
gets there), the goal verdicts and the tables."""

from __future__ import annotations

import pytest
from rich.console import Console

from tests.conftest import REPO, load_script

overlap = load_script("nebula_benchmarks_overlap", REPO / "benchmarks" / "overlap.py")


def run(config, name, accs, *, link="unthrottled", seconds=10.0, start=5.0, busy=None, steps=10, train_s=None,
        reference=False):
    """A run record: rounds 1..n with these accuracies, `seconds` per round (one value or one per round)."""
    seconds = seconds if isinstance(seconds, list) else [seconds] * len(accs)
    rounds, elapsed = [], start
    for i, (acc, sec) in enumerate(zip(accs, seconds, strict=True), start=1):
        elapsed += sec
        clusters = {cid: {"steps": steps, "train_s": (train_s or [4.0, 8.0])[int(cid)],
                          "busy_fraction": busy, "busy_s": None, "idle_s": None, "busy_from": None}
                    for cid in ("0", "1")}
        rounds.append({"round": i, "accuracy": acc, "elapsed_s": elapsed, "seconds": sec, "clusters": clusters})
    side = {"config": config, "name": name, "link": link, "reference": reference}
    return f"{config}/{name}@{link}", {"side": side, "rounds": rounds}


def test_quick_plans_only_what_the_figures_need_and_references_go_first():
    kw = dict(configs=overlap.CONFIGS, local_steps=10, hop_local_steps=2, rounds=4, secagg_rounds=3,
              hetero_workers="2,1", hetero_threads="2,1", secagg_clusters=3)
    quick = overlap.plan_sides(quick=True, **kw)
    assert [s.key for s in quick] == [
        "demo/blocking@wan", "demo/overlapped@wan", "hop-bound/blocking@wan", "hop-bound/overlapped-auto@wan",
        "hetero/fixed@unthrottled", "hetero/budgeted@unthrottled", "secagg/plain@unthrottled",
        "secagg/secure@unthrottled"]
    full = overlap.plan_sides(quick=False, **kw)
    assert len(full) == 13
    for config in overlap.CONFIGS:  # a configuration's reference runs before any of its auto sides
        mine = [s for s in full if s.config == config]
        assert sum(s.reference for s in mine) == 1
        first_auto = next((i for i, s in enumerate(mine) if s.auto), len(mine))
        assert any(s.reference for s in mine[:first_auto]) or first_auto == len(mine)
    blocking, over = full[0], full[1]
    assert (blocking.local_steps, blocking.overlap, over.local_steps, over.overlap) == (10, False, 10, True)
    assert {s.local_steps for s in full if s.config == "hop-bound"} == {2}
    assert all(s.clusters == 3 and s.overlap and s.rounds == 3 for s in full if s.config == "secagg")


def test_side_command_carries_each_mode():
    side = overlap.Side(config="hetero", name="budgeted-overlapped", overlap=True, auto=True, local_steps=10, rounds=4,
                        workers="2,1", threads="2,1")
    cmd = overlap.side_command(side, preset="demo", seed=3, wan="20mbit:100ms", run_config="eval-initial=false")
    assert cmd[cmd.index("--local-steps") + 1] == "auto" and "--round-overlap" in cmd and "--wan" not in cmd
    assert cmd[cmd.index("--threads-per-cluster") + 1] == "2,1" and cmd[cmd.index("--seed") + 1] == "3"
    secure = overlap.Side(config="secagg", name="secure", link="wan", secure=True, local_steps=10, rounds=3)
    cmd = overlap.side_command(secure, preset="demo", seed=0, wan="20mbit:100ms", run_config="")
    assert "--secure-aggregation" in cmd and cmd[cmd.index("--wan") + 1] == "20mbit:100ms"
    assert cmd[cmd.index("--local-steps") + 1] == "10" and "--round-overlap" not in cmd


def test_busy_from_the_timeline_then_the_reply_then_unknown():
    timed = overlap.busy_of({"busy_seconds": 9.0, "since_send_seconds": 10.0}, {"busy_fraction": 0.95, "idle_s": 0.5})
    assert timed == {"busy_fraction": 0.95, "busy_s": 9.0, "idle_s": 0.5, "busy_from": "timeline"}
    derived = overlap.busy_of({}, {"busy_fraction": 0.75, "idle_s": 2.0})
    assert derived["busy_s"] == pytest.approx(6.0) and derived["busy_from"] == "timeline"
    reply = overlap.busy_of({"busy_seconds": 3.0, "since_send_seconds": 12.0}, {"train_s": 3.0})
    assert reply == {"busy_fraction": 0.25, "busy_s": 3.0, "idle_s": 9.0, "busy_from": "reply"}
    assert overlap.busy_of({"seconds": 3.0}, {"train_s": 3.0})["busy_fraction"] is None


def test_records_from_metrics_lines():
    line = {"round": 2, "accuracy": 0.8, "elapsed_seconds": 31.5, "seconds": 12.0,
            "clusters": {"1": {"steps": 7, "seconds": 5.0, "busy_seconds": 9.0, "since_send_seconds": 10.0},
                         "0": {"steps": 10, "seconds": 4.0}},
            "timeline": {"clusters": {"0": {"train_s": 4.0, "busy_fraction": 1.0, "idle_s": 0.0}}}}
    (rec,) = overlap.records_from_lines([line])
    assert (rec["round"], rec["accuracy"], rec["elapsed_s"], rec["seconds"]) == (2, 0.8, 31.5, 12.0)
    assert list(rec["clusters"]) == ["0", "1"]
    assert rec["clusters"]["0"]["busy_from"] == "timeline" and rec["clusters"]["0"]["busy_fraction"] == 1.0
    assert rec["clusters"]["1"] == {"steps": 7, "train_s": 5.0, "busy_fraction": 0.9, "busy_s": 9.0, "idle_s": 1.0,
                                    "busy_from": "reply"}


def test_time_to_target_is_the_elapsed_clock_of_the_first_round_there():
    _, r = run("demo", "blocking", [0.5, 0.7, 0.65, 0.9], seconds=[10.0, 20.0, 30.0, 40.0])
    assert overlap.time_to_target(r["rounds"], 0.7) == 35.0  # 5 s start-up + 10 + 20
    assert overlap.time_to_target(r["rounds"], 0.95) is None
    assert overlap.time_to_target(r["rounds"], None) is None
    # a record that says when its adapter was aggregated is timed from that, its evaluation apart
    line = {"round": 1, "accuracy": 0.9, "elapsed_seconds": 40.0, "aggregated_seconds": 31.0, "seconds": 9.0}
    rec = overlap.records_from_lines([line])
    assert overlap.time_to_target(rec, 0.8) == 31.0 and overlap.time_to_target(rec, 0.8, at="elapsed_s") == 40.0


def test_the_target_is_the_reference_final_accuracy_else_its_lowest_above_every_round_one():
    _, ref = run("demo", "blocking", [0.60, 0.80, 0.78, 0.90])
    _, other = run("demo", "overlapped", [0.70, 0.75, 0.85, 0.88])
    # round 1s: 0.60 and 0.70; the reference ends at 0.90, above both
    assert overlap.choose_target(ref["rounds"], [ref["rounds"], other["rounds"]]) == 0.90
    _, early = run("demo", "overlapped", [0.92, 0.93, 0.95, 0.95])
    _, dip = run("demo", "blocking", [0.60, 0.95, 0.93, 0.91])  # its final is below a round 1: the lowest above it
    assert overlap.choose_target(dip["rounds"], [dip["rounds"], early["rounds"]]) == 0.93
    _, high = run("demo", "overlapped-auto", [0.95, 0.96, 0.97, 0.97])
    assert overlap.choose_target(ref["rounds"], [ref["rounds"], high["rounds"]]) is None
    runs = dict([run("demo", "a", [0.79, 0.9]), run("demo", "b", [0.5, 0.9])])
    assert overlap.early_hits(runs, 0.78) == ["demo/a@unthrottled"]


def _all_runs(*, secure_seconds=11.0, auto_accs=(0.6, 0.85, 0.9), busy_over=0.95):
    wan = "wan"
    return dict([
        run("demo", "blocking", [0.6, 0.85, 0.9], link=wan, seconds=20.0, busy=0.5, reference=True),
        run("demo", "overlapped", [0.6, 0.84, 0.896], link=wan, seconds=14.0, busy=busy_over),
        run("demo", "overlapped-auto", list(auto_accs), link=wan, seconds=10.0, busy=1.0),
        run("hop-bound", "blocking", [0.5, 0.7, 0.8], link=wan, seconds=10.0, reference=True),
        run("hop-bound", "overlapped-auto", [0.5, 0.75, 0.8], link=wan, seconds=4.0),
        run("hetero", "fixed", [0.6, 0.8, 0.9], seconds=30.0, reference=True),
        run("hetero", "budgeted", [0.6, 0.8, 0.9], seconds=15.0),
        run("secagg", "plain", [0.6, 0.8, 0.9], seconds=[30.0, 10.0, 10.0], reference=True),
        run("secagg", "secure", [0.6, 0.8, 0.9], seconds=[60.0, secure_seconds, secure_seconds]),
    ])


def test_figures_and_goals_from_synthetic_runs():
    runs = _all_runs()
    values, why = overlap.figures(runs, {"demo": 0.84, "hop-bound": 0.7, "hetero": 0.8})
    # demo: blocking 5 + 20 + 20 = 45 s, overlapped 5 + 14 + 14 = 33 s
    assert values["time_to_target_ratio"] == pytest.approx(33 / 45)
    assert values["time_to_target_ratio_auto"] == pytest.approx(25 / 45)
    assert values["time_to_target_ratio_hop_bound"] == pytest.approx(13 / 25)  # round 2 both: 5+4+4 vs 5+10+10
    assert values["accuracy_gap_points"] == pytest.approx(0.4)
    assert values["busy_fraction"] == {"blocking": 0.5, "overlapped": 0.95, "overlapped_auto": 1.0}
    assert values["hetero_time_ratio"] == pytest.approx(35 / 65)
    assert values["secure_over_plain_overlapped"] == pytest.approx(1.1)  # rounds 2..3 only: round 1 is the setup
    assert values["time_to_target_ratio_unthrottled"] is None and "did not run" in why["time_to_target_ratio_unthrottled"]
    assert values["hetero_time_ratio_overlapped"] is None
    goals = overlap.judge(values)
    assert {k: g["met"] for k, g in goals.items()} == {
        "time_to_target_ratio": True, "time_to_target_ratio_hop_bound": False, "accuracy_gap_points": True,
        "busy_fraction": True, "hetero_time_ratio": True, "secure_over_plain_overlapped": True}
    assert goals["busy_fraction"]["value"] == 0.95 and goals["busy_fraction"]["goal"] == ">= 0.9 (overlapped)"


def test_a_side_that_never_reaches_the_target_gives_null_not_a_number():
    runs = _all_runs(secure_seconds=12.0, busy_over=None)
    values, why = overlap.figures(runs, {"demo": 0.895, "hop-bound": 0.7, "hetero": None})
    assert values["time_to_target_ratio"] == pytest.approx((5 + 14 * 3) / (5 + 20 * 3))
    assert values["time_to_target_ratio_auto"] == pytest.approx(35 / 65)
    values, why = overlap.figures(runs, {"demo": 0.899, "hop-bound": 0.7, "hetero": None})
    assert values["time_to_target_ratio"] is None
    assert "demo/overlapped@wan never reached accuracy 0.8990" in why["time_to_target_ratio"]
    assert values["hetero_time_ratio"] is None and "no target" in why["hetero_time_ratio"]
    assert values["busy_fraction"]["overlapped"] is None and "no cluster reported" in why["busy_fraction"]
    goals = overlap.judge(values)
    assert not goals["time_to_target_ratio"]["met"] and not goals["busy_fraction"]["met"]
    assert not goals["hetero_time_ratio"]["met"] and not goals["secure_over_plain_overlapped"]["met"]  # 1.2 > 1.1


def test_calibration_and_per_step_times():
    _, r = run("hetero", "fixed", [0.5, 0.6, 0.7], train_s=[4.0, 16.0], steps=8)
    assert overlap.slowest_train_s(r["rounds"]) == 16.0  # the slow cluster's: the fast one trains through its wait
    r["rounds"][0]["clusters"]["1"]["train_s"] = 30.0  # round 1 (warm-up) only counts when it is the only one
    assert overlap.slowest_train_s(r["rounds"]) == 16.0 and overlap.slowest_train_s(r["rounds"][:1]) == 30.0
    assert overlap.seconds_per_step(r["rounds"]) == {"0": 0.5, "1": 2.0}
    assert overlap.median_round_s(r["rounds"]) == 10.0 and overlap.median_steps(r["rounds"]) == 8


def test_tables_show_every_figure_and_say_why_one_is_missing():
    runs = _all_runs()
    targets = {"demo": 0.899, "hop-bound": 0.7, "hetero": 0.8}
    values, why = overlap.figures(runs, targets)
    per_run = {key: {"side": {**r["side"], "reference": r["side"]["reference"]}, "rounds": len(r["rounds"]),
                     "command_seconds": 60.0, **overlap.run_summary(r, targets.get(r["side"]["config"]))}
               for key, r in runs.items()}
    results = {**values, "why_null": why, "goals": overlap.judge(values), "runs": per_run,
               "targets": {c: {"value": v, "how": "fixed by --target"} for c, v in targets.items()},
               "settings": {"wan": "20mbit:100ms"}}
    console = Console(record=True, width=250)
    console.print(overlap.runs_table(results))
    console.print(overlap.goals_table(results))
    text = console.export_text()
    for key in overlap.GOALS:
        assert key in text
    assert "never reached accuracy 0.8990" in text and "NO" in text
    assert "not in 3" in text and "blocking (ref)" in text and "20mbit:100ms" in text
    assert overlap.targets_lines(results)[0] == "demo: target 0.8990 (fixed by --target)"


def test_the_timeline_png_is_drawn_from_synthetic_runs(tmp_path):
    runs = _all_runs()
    for key in ("demo/blocking@wan", "demo/overlapped@wan"):  # seconds for one, fractions only for the other
        for r in runs[key]["rounds"][1:]:
            for c in r["clusters"].values():
                c.update(busy_s=c["busy_fraction"] * 10, idle_s=(1 - c["busy_fraction"]) * 10)
    runs["demo/overlapped@wan"]["rounds"][2]["clusters"]["0"]["busy_s"] = None
    results = {"targets": {"demo": {"value": 0.84}, "hop-bound": {"value": None}}}
    overlap.plot(runs, results, tmp_path / "t.png", wan="20mbit:100ms")
    assert (tmp_path / "t.png").stat().st_size > 10_000


def test_targets_per_configuration_chosen_fixed_or_missing():
    sides = overlap.plan_sides(quick=True, configs=("demo", "hop-bound", "hetero", "secagg"), local_steps=10,
                               hop_local_steps=2, rounds=3, secagg_rounds=3, hetero_workers="2,1", hetero_threads="2,1",
                               secagg_clusters=3)
    runs = _all_runs()
    del runs["hetero/fixed@unthrottled"]
    targets = overlap.pick_targets(sides, runs, {"hop-bound": 0.45})
    assert set(targets) == {"demo", "hop-bound", "hetero"}
    assert targets["demo"]["value"] == 0.9 and targets["demo"]["reached_in_round_1"] == []  # blocking's final
    assert targets["hop-bound"] == {"value": 0.45, "how": "fixed by --target",
                                    "reached_in_round_1": ["hop-bound/blocking@wan", "hop-bound/overlapped-auto@wan"]}
    assert targets["hetero"]["value"] is None and "did not run" in targets["hetero"]["how"]


def test_box_cpu_busy_is_the_share_of_cpu_time_not_idle():
    bench = overlap
    before = [100, 0, 50, 800, 50, 0, 0, 0, 0, 0]
    after = [400, 0, 150, 1000, 50, 0, 0, 0, 0, 0]  # 400 busy, 200 idle of 600
    assert bench.cpu_busy(before, after) == pytest.approx(400 / 600)
    assert bench.cpu_busy(None, after) is None and bench.cpu_busy(before, before) is None
